"""The one generate loop: prefill, iterate a decoder, EOS / max_new_tokens, rollback, stats."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from mtad_energy.decoding.base import (
    Decoder,
    DecodeState,
    ModelRunner,
    PhaseTimer,
    StepResult,
    ids_width,
    to_device,
)
from mtad_energy.decoding.kernels import Kernels
from mtad_energy.energy.work import Work, dims_of, shapes_work
from mtad_energy.models import ModelPair

if TYPE_CHECKING:
    from mtad_energy.decoding.static import CompileOptions


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


def encode_prompt(pair: ModelPair, prompt: str | Sequence[int] | torch.Tensor,
                  chat: bool | None = None) -> list[int]:
    """Token ids of a prompt. Text gets the tokenizer's chat template when it has one (chat=None)
    or when chat=True."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ValueError(
                f"a prompt tensor of shape {list(prompt.shape)} holds {prompt.shape[0]} prompts "
                "(what tokenizer(..., return_tensors='pt') gives for a batch); pass one prompt "
                "as [T] or [1, T] ids, or several as a list of texts or id lists (padded rows "
                "of a [B, T] tensor would be decoded as tokens)")
        return [int(t) for t in prompt.reshape(-1).tolist()]
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    tok = pair.tokenizer
    if chat is None:
        chat = bool(getattr(tok, "chat_template", None))
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)
    return tok(prompt)["input_ids"]


def _check_lengths(pair: ModelPair, decoder: Decoder, prompt_len: int, max_new_tokens: int) -> None:
    if prompt_len == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ctx = pair.context_length
    if ctx is None:
        return
    if prompt_len >= ctx:
        raise ValueError(f"the prompt is {prompt_len} tokens, longer than the target's context of "
                         f"{ctx}; shorten the prompt")
    look = decoder.lookahead_for(max_new_tokens)
    need = prompt_len + max_new_tokens + look
    if need > ctx:
        most = max(m for m in (1, ctx - prompt_len - decoder.lookahead, (ctx - prompt_len + 1) // 2)
                   if m < 1 or prompt_len + m + decoder.lookahead_for(m) <= ctx)
        fix = f"lower max_new_tokens to at most {most}" if most >= 1 else "shorten the prompt"
        raise ValueError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + the decoder's lookahead "
            f"({look}) = {need} exceeds the target's context of {ctx}; {fix}")


@torch.inference_mode()
def perplexity(model, ids: torch.Tensor, prompt_len: int) -> float | None:
    """exp(mean NLL) of ``ids[prompt_len:]`` given what precedes, under ``model`` (unwarped)."""
    if ids.shape[0] <= prompt_len:
        return None
    logits = model(input_ids=ids[None]).logits[0, prompt_len - 1:-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[prompt_len:])
    return math.exp(nll.item())


def _draft_target(timer: PhaseTimer) -> tuple[float, float]:
    t = timer.time_s
    return t.get("draft", 0.0), t.get("target", 0.0)


def _split(wall_s: float, before: tuple[float, float], after: tuple[float, float]
           ) -> tuple[float, float, float]:
    """(draft, target, other) seconds of a span of ``wall_s`` between two `_draft_target`
    readings; other is the rest, clamped at 0 against rounding."""
    draft_s, target_s = after[0] - before[0], after[1] - before[1]
    return draft_s, target_s, max(0.0, wall_s - draft_s - target_s)


def _read_back(result: StepResult, tokens: torch.Tensor
               ) -> list[tuple[list[int], int, float, int]]:
    """Per row: (emitted tokens, accepted count, valid draft-cache length, draft depth) on the
    host, in one device-to-host copy of the tokens (``result.tokens`` as ``[B, m]``) and whatever
    counts the decoder left on the device (a depth known only on the device: EAGLE's dynamic
    tree)."""
    rows = tokens.shape[0]
    depth = result.depth if isinstance(result.depth, torch.Tensor) else None
    fields = (result.accepted, result.length, result.draft_cache_len, depth)
    on_device = [x if x.dtype == tokens.dtype else x.to(tokens.dtype)
                 for x in fields if isinstance(x, torch.Tensor)]
    if on_device:  # [B, F + m]: the counts, then the tokens (one op each, whatever F)
        tokens = torch.cat([torch.stack(on_device, -1).reshape(rows, -1), tokens], 1)
    values = tokens.tolist()
    out = []
    for row in values:
        host = []
        for x in fields:
            if isinstance(x, torch.Tensor):
                host.append(row[0])
                row = row[1:]
            else:
                host.append(x)
        accepted, length, draft_valid, row_depth = host
        if length is not None:
            row = row[:length]
        out.append((row, int(accepted), math.inf if draft_valid is None else draft_valid,
                    row_depth))
    return out


def _of_row(value: int | list[int], b: int) -> int:
    return value[b] if isinstance(value, list) else value


def _shape_marks(*runners: ModelRunner | None) -> tuple[int | None, ...]:
    """How many forwards each runner has recorded (None: it records none)."""
    return tuple(None if r is None or getattr(r, "forward_shapes", None) is None
                 else len(r.forward_shapes) for r in runners)


def _spans_work(runner: ModelRunner | None, marks: list[int | None]) -> list[Work | None]:
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


def _total(works: Sequence[Work | None]) -> Work | None:
    if any(w is None for w in works):
        return None
    return sum(works, Work())


def slots_needed(decoder: Decoder, prompt_lens: Sequence[int], max_new_tokens: int) -> int:
    """Cache slots a static cache is sized for: the longest row, plus headroom, as a token tree
    and a padded verify write past the emitted tokens (so it rarely has to compact)."""
    return max(prompt_lens) + max_new_tokens + decoder.lookahead + 64


PhaseHook = Callable[[str], None]
"""Called with "prefill", "decode" and "end" at the phase boundaries, after the device is synced,
so a caller can open and close measurement windows without this module knowing about meters."""


def _no_hook(phase: str) -> None:
    pass


def _runners(decoder: Decoder, pair: ModelPair, timer: PhaseTimer, rows: int, slots: int,
             compile: bool | CompileOptions) -> tuple[ModelRunner, ModelRunner | None]:
    """The target and draft runners: eager with a dynamic cache, `batch.RowsRunner` for B > 1
    rows, or (``compile``) `static.StaticRunner` - different runners under the same loop. The
    draft runner runs `Decoder.draft_model`: a draft model, a head with a KV cache (EAGLE: the
    same runners), or a cache-free head (Medusa: `head_runner.HeadRunner`)."""
    from mtad_energy.decoding.head_runner import HeadRunner

    draft_model = decoder.draft_model(pair)
    roles = [("target", pair.target, decoder.target_hidden(pair))]
    if draft_model is not None:
        roles.append(("draft", draft_model, decoder.draft_hidden()))
    opts = compile if compile and not isinstance(compile, bool) else None
    chain = decoder.lookahead + 1
    # widths a drafting decoder meets only on some runs: a draft's step and its catch-up after a
    # full accept (1, 2), the target's last short verify or step (1, 2) and verify; a head's
    # forwards take its features (their widths compile at the full-length warm-up)
    warm = {"draft": (1, 2) if decoder.head is None else (),
            "target": tuple(sorted({1, 2, chain}))}
    runners: list[ModelRunner] = []
    for role, model, hidden in roles:
        if getattr(model, "cacheless", False):
            runners.append(HeadRunner(model, timer, role, rows, compile, opts))
        elif compile:
            from mtad_energy.decoding.static import ForwardShape, make_runner  # compiler stack

            shape = ForwardShape(repr(decoder), decoder.cache_rows(role), chain,
                                 warm[role] if decoder.lookahead else (), hidden)
            runners.append(make_runner(model, timer, role, rows, slots, opts, shape))
        else:
            from mtad_energy.decoding.batch import rows_runner

            runners.append(rows_runner(model, timer, role, rows, hidden))
    return runners[0], (runners[1] if len(runners) > 1 else None)


def _kernels(compile: bool | CompileOptions) -> Kernels:
    """Where the decoder's pure tensor functions run: compiled under ``compile``, else eagerly."""
    if not compile:
        return Kernels()
    from mtad_energy.decoding.static import CompiledKernels  # the compiler stack

    return CompiledKernels(None if isinstance(compile, bool) else compile)


def _graphs_compiled(compile: bool | CompileOptions) -> int:
    """Dynamo's count of graphs compiled in this process (0 when eager: nothing compiles)."""
    if not compile:
        return 0
    from mtad_energy.decoding.static import graphs_compiled  # the compiler stack

    return graphs_compiled()


@torch.inference_mode()
def generate_ids(decoder: Decoder, pair: ModelPair, prompt_ids: list[int], max_new_tokens: int,
                 seed: int = 0, compute_perplexity: bool = True,
                 on_phase: PhaseHook | None = None,
                 compile: bool | CompileOptions = False) -> Generation:
    """Decode after ``prompt_ids``. ``compile`` (True, or `static.CompileOptions` to pick the
    backend / mode): run the forwards on a static KV cache through ``torch.compile``
    (`static.StaticRunner`; CUDA graphs on CUDA) instead of eager transformers with a dynamic
    cache; the loop and the decoders are the same."""
    return generate_rows(decoder, pair, [prompt_ids], max_new_tokens, seed, compute_perplexity,
                         on_phase, compile)[0]


@torch.inference_mode()
def generate_rows(decoder: Decoder, pair: ModelPair, prompts: list[list[int]],
                  max_new_tokens: int, seed: int = 0, compute_perplexity: bool = True,
                  on_phase: PhaseHook | None = None,
                  compile: bool | CompileOptions = False) -> list[Generation]:
    """Decode B prompts together, one set of forwards per iteration for all rows (B = 1: one
    sequence). Rows keep their own lengths, EOS, max_new_tokens and statistics; a row that is
    done rides along until every row is. Times are the batch's: row b's decode time runs until
    the iteration that finished it. One generator for the batch: sampled rows differ from
    their batch-1 runs (same distribution), greedy rows are identical."""
    rows = len(prompts)
    if rows < 1:
        raise ValueError("give at least one prompt")
    if decoder.needs_draft and pair.draft is None:
        from mtad_energy.decoding.registry import DECODERS

        runs = [n for n, cls in DECODERS.items()  # with this pair: no model, or a head it has
                if not cls.needs_draft and (cls.head is None or cls.head in (pair.heads or {}))]
        raise ValueError(f"decoder {decoder.name!r} needs a draft model, but the pair has none; "
                         "give one with --draft (e.g. --draft self:int8; beside a head: --draft "
                         "self:int8,eagle:DIR; Python: draft=...), or pick a decoder this pair "
                         f"runs: {', '.join(runs)}")
    if decoder.head is not None and decoder.draft_model(pair) is None:
        kind = decoder.head
        raise ValueError(
            f"decoder {decoder.name!r} drafts with a {kind} head on the target's hidden states, "
            f"but the pair has none; load one with draft='{kind}:DIR' (CLI --draft {kind}:DIR; "
            f"beside a draft model: --draft MODEL,{kind}:DIR): a directory in the {kind} "
            "checkpoint layout, or a hub id already in the local Hugging Face cache")
    if rows > 1 and not decoder.batched:
        from mtad_energy.decoding.registry import batched_names

        raise ValueError(f"decoder {decoder.name!r} does not decode batches yet (batch size "
                         f"{rows}); decoders that do: {batched_names()}. Use batch size 1 for "
                         f"{decoder.name}")
    prompt_lens = [len(p) for p in prompts]
    for n in prompt_lens:
        _check_lengths(pair, decoder, n, max_new_tokens)
    device = pair.device
    timer = PhaseTimer.for_device(device)
    ids = torch.zeros(rows, ids_width(prompt_lens, max_new_tokens, decoder.lookahead),
                      dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    generator = torch.Generator(device=device).manual_seed(seed)
    graphs_before = _graphs_compiled(compile)
    target, draft = _runners(decoder, pair, timer, rows,
                             slots_needed(decoder, prompt_lens, max_new_tokens), compile)
    kernels = _kernels(compile)
    state = DecodeState(ids, list(prompt_lens), prompt_lens, max_new_tokens, target, draft,
                        generator, pair.eos_token_id, tokens=[list(p) for p in prompts],
                        kernels=kernels)

    hook = on_phase or _no_hook
    marks = [_shape_marks(target, draft)]  # forwards recorded before the prefill, then per phase
    timer.sync()
    hook("prefill")
    t0 = time.perf_counter()
    if max(prompt_lens) > 1:  # all but the last prompt token (the cache invariant of base.py)
        width = max(prompt_lens) - 1
        counts = [n - 1 for n in prompt_lens]
        if rows == 1:
            prefix = ids[:, :width]
        else:  # right-aligned: row b's prompt ends at column width - 1
            idx = to_device(counts, device)[:, None] - width + torch.arange(width, device=device)
            prefix = ids.gather(1, idx.clamp_min(0))
        for runner in (target, draft if decoder.needs_draft else None):
            if runner is not None:
                runner.prefill(prefix, **({"counts": counts} if rows > 1 else {}))
    decoder.prefill(state)  # a head primes itself from the target's hidden states
    timer.sync()
    t_prefill = time.perf_counter()
    hook("decode")
    runners = [r for r in (target, draft, kernels) if r is not None]  # what may compile

    def clock() -> float:  # wall time less the first forwards of new shapes (compiling)
        return time.perf_counter() - sum(r.compile_s for r in runners)

    t_decode = clock()  # after the hook, so a meter's bookkeeping is not billed to decode
    fwd0 = (target.forwards, draft.forwards if draft is not None else 0)
    marks.append(_shape_marks(target, draft))

    eos = pair.eos_token_id
    counts_per_row: list[list[dict[str, int]]] = [[] for _ in range(rows)]
    phase_times: list[tuple[float, float]] = [_draft_target(timer)]  # cumulative, per iteration
    bounds = [t_decode]  # iteration boundaries (wall clock)
    new_tokens: list[list[int]] = [[] for _ in range(rows)]
    stop = ["max_new_tokens"] * rows
    last_iter = [0] * rows  # index of the iteration that finished each row
    forwards_at_end = [(0, 0)] * rows
    it = 0
    while state.remaining > 0:
        before = (target.forwards, draft.forwards if draft is not None else 0)
        result = decoder.step(state)
        block = result.tokens  # [B, m] ([m]: one sequence)
        block = block if block.dim() == 2 else block.reshape(rows, -1)
        read = _read_back(result, block)  # the one host sync per iteration
        timer.flush()  # this iteration's events are complete now: reading them does not stall
        fw = (target.forwards - before[0], (draft.forwards if draft is not None else 0) - before[1])
        taken: list[list[int]] = [[] for _ in range(rows)]
        for b, (token_list, accepted, _, row_depth) in enumerate(read):
            if not state.active[b]:
                continue
            token_list = token_list[:state.row_remaining(b)]
            if eos is not None and eos in token_list:
                token_list = token_list[:token_list.index(eos) + 1]
                stop[b] = "eos"
            taken[b] = token_list
            new_tokens[b].extend(token_list)
            # draft tokens kept: a block cut by EOS or max_new_tokens keeps only what it emitted,
            # and a row never keeps more than its own depth (a batch may draft further)
            depth = _of_row(result.depth, b) if row_depth is None else int(row_depth)
            counts_per_row[b].append({
                "emitted": len(token_list), "proposed": _of_row(result.proposed, b),
                "accepted": min(accepted, len(token_list), depth), "draft_forwards": fw[1],
                "target_forwards": fw[0], "draft_depth": depth})
            if stop[b] == "eos" or len(token_list) == state.row_remaining(b):  # (appended below)
                state.active[b] = False
                last_iter[b] = it
                forwards_at_end[b] = (target.forwards - fwd0[0],
                                      (draft.forwards - fwd0[1]) if draft is not None else 0)
        state.append_rows(block, taken)
        phase_times.append(_draft_target(timer))
        marks.append(_shape_marks(target, draft))
        it += 1
        if not any(state.active):
            bounds.append(clock())
            break
        # roll the caches back to the cache invariant: target sees all but the last token
        target.crop_rows([n - 1 for n in state.lengths])
        if draft is not None:
            draft.crop_rows([min(c, n - 1, r[2]) for c, n, r in
                             zip(draft.row_lengths, state.lengths, read, strict=True)])
        bounds.append(clock())
    timer.sync()
    t_end = clock()
    hook("end")

    compile_in_window_s = sum(r.compile_s for r in runners)  # the runners' in-loop seconds
    # kernels met for the first time ran eagerly; they compile now, outside every window
    compile_s = compile_in_window_s + sum(r.prewarm_s for r in runners) + kernels.compile_pending()
    graphs = _graphs_compiled(compile) - graphs_before
    bounds[-1] = t_end  # the closing sync belongs to the last iteration: iterations tile decode
    splits = [_split(bounds[i + 1] - bounds[i], phase_times[i], phase_times[i + 1])
              for i in range(it)]
    target_work = _spans_work(target, [m[0] for m in marks])  # [prefill, iteration 0, ...]
    draft_work = _spans_work(draft, [m[1] for m in marks])
    prefill_work = _total([target_work[0], draft_work[0]])
    config = {**decoder.config(), "max_new_tokens": max_new_tokens, "seed": seed}
    if compile:  # the models whose forwards ran compiled (an int8 draft stays eager)
        config["compiled"] = [role for role, r in (("target", target), ("draft", draft))
                              if r is not None and r.compiled]
    if rows > 1:
        config["batch_size"] = rows
        from mtad_energy.decoding.batch import PerRowRunner

        per_row = [role for role, r in (("target", target), ("draft", draft))
                   if isinstance(r, PerRowRunner)]
        if per_row:  # rows not batched, so that each is exactly its batch-1 self
            config["per_row"] = per_row
    out = []
    for b in range(rows):
        steps = [StepStats(**c, time_draft_s=d, time_target_s=t, time_other_s=o,
                           draft_flops=dw and dw.flops, draft_bytes=dw and dw.bytes,
                           target_flops=tw and tw.flops, target_bytes=tw and tw.bytes)
                 for c, (d, t, o), dw, tw in zip(counts_per_row[b], splits, draft_work[1:],
                                                 target_work[1:], strict=False)]
        row_draft = _total(draft_work[1:last_iter[b] + 2])
        row_target = _total(target_work[1:last_iter[b] + 2])
        decode_s = bounds[last_iter[b] + 1] - t_decode
        draft_s, target_s, _ = _split(decode_s, phase_times[0], phase_times[last_iter[b] + 1])
        target_fw, draft_fw = forwards_at_end[b]
        tokens = new_tokens[b]
        proposed = sum(s.proposed for s in steps)
        accepted = sum(s.accepted for s in steps)
        depth = sum(s.draft_depth for s in steps)
        drafting = sum(1 for s in steps if s.draft_depth)
        ppl = (perplexity(pair.target, ids[b, :state.lengths[b]], prompt_lens[b])
               if compute_perplexity else None)
        stats = GenerationStats(
            iterations=len(steps), tokens_emitted=len(tokens), draft_proposed=proposed,
            draft_accepted=accepted, draft_forwards=draft_fw, target_forwards=target_fw,
            prefill_time_s=t_prefill - t0, decode_time_s=decode_s, time_draft_s=draft_s,
            time_target_s=target_s, time_other_s=max(0.0, decode_s - draft_s - target_s),
            tokens_per_s=len(tokens) / decode_s if decode_s > 0 else float("inf"),
            decode_tokens=len(tokens),
            block_efficiency=len(tokens) / target_fw if target_fw else 0.0,
            acceptance_rate=accepted / depth if depth else None,
            perplexity=ppl, stop_reason=stop[b], draft_depth=depth, compile_s=compile_s,
            compile_in_window_s=compile_in_window_s, graphs_compiled=graphs,
            mean_accepted_length=accepted / drafting if drafting else None,
            draft_flops=row_draft and row_draft.flops, draft_bytes=row_draft and row_draft.bytes,
            target_flops=row_target and row_target.flops,
            target_bytes=row_target and row_target.bytes,
            prefill_flops=prefill_work and prefill_work.flops,
            prefill_bytes=prefill_work and prefill_work.bytes)
        text = pair.tokenizer.decode(tokens, skip_special_tokens=True)
        out.append(Generation(tokens, text, prompt_lens[b], stats, steps,
                              {**config, **({"row": b} if rows > 1 else {})}))
    return out


def generate(decoder: Decoder | str, pair: ModelPair,
             prompt: str | Sequence[int] | torch.Tensor | list[str],
             max_new_tokens: int = 128, seed: int = 0, chat: bool | None = None,
             compute_perplexity: bool = True, compile: bool | CompileOptions = False,
             batch_size: int = 1, **params) -> Generation | list[Generation]:
    """Decode ``prompt`` (text or ids) with ``decoder`` (an instance or a registry name plus its
    params). A list of text prompts gives a list of Generations, decoded ``batch_size`` at a time
    (default 1 per sequence, as in the paper; see `generate_rows`); the batch starting at prompt
    i uses seed + i. ``compile=True``: the static-cache, compiled forward path (see
    `generate_ids`)."""
    from mtad_energy.decoding.registry import get_decoder

    if isinstance(decoder, str):
        decoder = get_decoder(decoder, **params)
    elif params:
        raise TypeError("pass decoder parameters either in the Decoder or as keywords, not both")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        ids = [encode_prompt(pair, p, chat) for p in prompt]
        out: list[Generation] = []
        for i in range(0, len(ids), batch_size):
            out += generate_rows(decoder, pair, ids[i:i + batch_size], max_new_tokens, seed + i,
                                 compute_perplexity, compile=compile)
        return out
    return generate_ids(decoder, pair, encode_prompt(pair, prompt, chat), max_new_tokens, seed,
                        compute_perplexity, compile=compile)
