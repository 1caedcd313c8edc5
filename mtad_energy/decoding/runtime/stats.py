"""What a generation reports: per iteration (`StepStats`), per row (`GenerationStats`,
`Generation`), and how the generate loop's `Trace` becomes them after the decode phase (the
per-phase seconds, the counted work of the forwards, the row's own decode time)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.timer import PhaseTimer
from mtad_energy.energy.work import Work, dims_of, shapes_work


@dataclass(frozen=True)
class StepStats:
    """One decoder iteration, with the same meaning for every decoder (docs/concepts/statistics.md):
    ``emitted`` tokens appended (kept draft tokens + the token from p); ``proposed`` every draft
    token shown to the target (tree nodes, k*gamma for Spectr: verification work, not
    acceptance); ``accepted`` draft tokens on the emitted path that were kept; ``draft_depth``
    how many draft tokens on one path could have been accepted (gamma for a chain, the tree
    depth for trees, the draft length for Spectr; 0 without a draft). ``*_flops`` / ``*_bytes``:
    the work of this iteration's draft / target forwards, counted from their shapes
    (`mtad_energy.energy.work`; the batch's forwards, shared by its rows like the forward counts;
    None where a runner records no shapes or the model type cannot be counted)."""

    emitted: int
    proposed: int
    accepted: int
    draft_forwards: int
    target_forwards: int
    # seconds of this iteration: GPU time of its draft / target forwards (wall time on CPU), and
    # the rest of its wall time; iterations tile the decode phase, so each column sums to the
    # generation's time_draft_s / time_target_s / time_other_s
    time_draft_s: float = 0.0
    time_target_s: float = 0.0
    time_other_s: float = 0.0
    draft_depth: int = 0
    draft_flops: int | None = 0
    draft_bytes: int | None = 0
    target_flops: int | None = None
    target_bytes: int | None = None


@dataclass(frozen=True)
class GenerationStats:
    iterations: int
    tokens_emitted: int
    # tokens emitted inside the caller's decode window, the basis of tokens/s and decode J/token:
    # all of them in this loop (the forward that gives the first token is the decode window's);
    # an engine that streams its first token out of the prefill window counts fewer (`engines`)
    decode_tokens: int
    draft_proposed: int
    draft_accepted: int
    draft_forwards: int
    target_forwards: int
    prefill_time_s: float
    decode_time_s: float
    time_draft_s: float
    time_target_s: float
    time_other_s: float
    tokens_per_s: float
    block_efficiency: float  # tokens emitted per target forward
    # accepted / draft_depth: the share of the draftable positions that were kept, comparable
    # across chains, trees and multi-draft decoders; None without drafts
    acceptance_rate: float | None
    perplexity: float | None  # exp(mean NLL) of the output under the *unwarped* target
    stop_reason: str  # "eos" | "max_new_tokens"
    draft_depth: int = 0  # sum over iterations of the draftable positions on one path
    mean_accepted_length: float | None = None  # accepted draft tokens per drafting iteration
    # seconds this call spent compiling (first forwards of new shapes; on CUDA also recording
    # their graphs): the compiled runners' warm-up of their known widths before the prefill, plus
    # shapes first met in the loop; run untimed and left out of every time above
    compile_s: float = 0.0
    # the part of compile_s after the first ``on_phase`` hook: inside a caller's windows
    compile_in_window_s: float = 0.0
    graphs_compiled: int = 0  # graphs dynamo compiled during this call (0 when eager)
    # counted work (`mtad_energy.energy.work`) of the decode phase's draft / target forwards up to
    # this row's last iteration, and of the prefill (both models); None where not countable
    draft_flops: int | None = 0
    draft_bytes: int | None = 0
    target_flops: int | None = None
    target_bytes: int | None = None
    prefill_flops: int | None = None
    prefill_bytes: int | None = None


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens only
    text: str
    prompt_len: int
    stats: GenerationStats
    steps: list[StepStats] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_len": self.prompt_len,
                "stats": asdict(self.stats), "config": self.config,
                "accepted_lengths": [s.accepted for s in self.steps]}


@torch.inference_mode()
def perplexity(model, ids: torch.Tensor, prompt_len: int) -> float | None:
    """exp(mean NLL) of ``ids[prompt_len:]`` given what precedes, under ``model`` (unwarped)."""
    if ids.shape[0] <= prompt_len:
        return None
    logits = model(input_ids=ids[None]).logits[0, prompt_len - 1:-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[prompt_len:])
    return math.exp(nll.item())


def draft_target(timer: PhaseTimer) -> tuple[float, float]:
    t = timer.time_s
    return t.get("draft", 0.0), t.get("target", 0.0)


def split_span(wall_s: float, before: tuple[float, float], after: tuple[float, float]
           ) -> tuple[float, float, float]:
    """(draft, target, other) seconds of a span of ``wall_s`` between two `draft_target`
    readings; other is the rest, clamped at 0 against rounding."""
    draft_s, target_s = after[0] - before[0], after[1] - before[1]
    return draft_s, target_s, max(0.0, wall_s - draft_s - target_s)


def shape_marks(*runners: ModelRunner | None) -> tuple[int | None, ...]:
    """How many forwards each runner has recorded (None: it records none)."""
    return tuple(None if r is None or getattr(r, "forward_shapes", None) is None
                 else len(r.forward_shapes) for r in runners)


def spans_work(runner: ModelRunner | None, marks: list[int | None]) -> list[Work | None]:
    """The counted work of ``runner``'s forwards between consecutive ``marks`` (zero without a
    runner; None where it records no shapes or its model type cannot be counted). Host
    arithmetic on the recorded shapes, run after the decode phase."""
    spans = len(marks) - 1
    if runner is None:
        return [Work()] * spans
    shapes = getattr(runner, "forward_shapes", None)
    try:
        dims = dims_of(runner.model)
    except (ValueError, AttributeError):  # a model type the rule does not count, or no config
        return [None] * spans
    if shapes is None or None in marks:
        return [None] * spans
    # a static cache is written in place (a cache-free head has no KV to count)
    concat = isinstance(getattr(runner, "cache", None), DynamicCache)
    return [shapes_work(dims, shapes[a:b], concat) for a, b in zip(marks, marks[1:], strict=False)]


def total_work(works: Sequence[Work | None]) -> Work | None:
    if any(w is None for w in works):
        return None
    return sum(works, Work())


@dataclass
class Trace:
    """What the generate loop records of one call, for the row statistics after the decode phase:
    per iteration (its wall-clock bounds, the timer's cumulative draft / target seconds, how many
    forwards each runner had recorded) and per row (each iteration's counts, the tokens, why and
    in which iteration it stopped, and the forwards run by then)."""

    rows: int
    prefill_s: float  # the prefill phase's wall time
    t_decode: float  # the decode phase's start (wall clock less compiling)
    fwd0: tuple[int, int]  # target / draft forwards at the decode phase's start
    marks: list[tuple[int | None, ...]]  # forwards recorded before the prefill, then per phase
    phase_times: list[tuple[float, float]]  # cumulative (draft, target) seconds, per iteration
    bounds: list[float]  # iteration boundaries (wall clock)
    iterations: int = 0
    counts: list[list[dict[str, int]]] = field(default_factory=list)  # per row, per iteration
    new_tokens: list[list[int]] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    last_iter: list[int] = field(default_factory=list)  # the iteration that finished each row
    forwards_at_end: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts = [[] for _ in range(self.rows)]
        self.new_tokens = [[] for _ in range(self.rows)]
        self.stop = ["max_new_tokens"] * self.rows
        self.last_iter = [0] * self.rows
        self.forwards_at_end = [(0, 0)] * self.rows

    def splits(self) -> list[tuple[float, float, float]]:
        """Each iteration's (draft, target, other) seconds: the iterations tile the decode phase."""
        return [split_span(self.bounds[i + 1] - self.bounds[i], self.phase_times[i],
                           self.phase_times[i + 1]) for i in range(self.iterations)]


def row_statistics(trace: Trace, b: int, splits: list[tuple[float, float, float]],
                   draft_work: list[Work | None], target_work: list[Work | None],
                   ppl: float | None, call: dict[str, Any]) -> tuple[GenerationStats, list[StepStats]]:
    """Row b's statistics and its iterations' (`StepStats`) from the loop's ``trace``: its decode
    time runs until the iteration that finished it. ``draft_work`` / ``target_work``: the counted
    work of the prefill, then of each iteration; ``call``: the fields the rows share (compiling,
    the prefill's work)."""
    steps = [StepStats(**c, time_draft_s=d, time_target_s=t, time_other_s=o,
                       draft_flops=dw and dw.flops, draft_bytes=dw and dw.bytes,
                       target_flops=tw and tw.flops, target_bytes=tw and tw.bytes)
             for c, (d, t, o), dw, tw in zip(trace.counts[b], splits, draft_work[1:],
                                             target_work[1:], strict=False)]
    last = trace.last_iter[b]
    row_draft = total_work(draft_work[1:last + 2])
    row_target = total_work(target_work[1:last + 2])
    decode_s = trace.bounds[last + 1] - trace.t_decode
    draft_s, target_s, _ = split_span(decode_s, trace.phase_times[0], trace.phase_times[last + 1])
    target_fw, draft_fw = trace.forwards_at_end[b]
    tokens = trace.new_tokens[b]
    proposed = sum(s.proposed for s in steps)
    accepted = sum(s.accepted for s in steps)
    depth = sum(s.draft_depth for s in steps)
    drafting = sum(1 for s in steps if s.draft_depth)
    stats = GenerationStats(
        iterations=len(steps), tokens_emitted=len(tokens), draft_proposed=proposed,
        draft_accepted=accepted, draft_forwards=draft_fw, target_forwards=target_fw,
        prefill_time_s=trace.prefill_s, decode_time_s=decode_s, time_draft_s=draft_s,
        time_target_s=target_s, time_other_s=max(0.0, decode_s - draft_s - target_s),
        tokens_per_s=len(tokens) / decode_s if decode_s > 0 else float("inf"),
        decode_tokens=len(tokens),
        block_efficiency=len(tokens) / target_fw if target_fw else 0.0,
        acceptance_rate=accepted / depth if depth else None,
        perplexity=ppl, stop_reason=trace.stop[b], draft_depth=depth,
        mean_accepted_length=accepted / drafting if drafting else None,
        draft_flops=row_draft and row_draft.flops, draft_bytes=row_draft and row_draft.bytes,
        target_flops=row_target and row_target.flops,
        target_bytes=row_target and row_target.bytes, **call)
    return stats, steps
