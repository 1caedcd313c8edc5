"""The one generate loop: set-up, prefill, iterate a decoder (EOS / max_new_tokens, cache
rollback), then the rows' statistics (`runtime.stats`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mtad_energy.decoding.runtime.calls import EagerCalls
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.state import DecodeState, ids_width, to_device
from mtad_energy.decoding.runtime.stats import (
    Generation,
    Trace,
    draft_target,
    perplexity,
    row_statistics,
    shape_marks,
    spans_work,
    total_work,
)
from mtad_energy.decoding.runtime.step import COUNTS, StepResult
from mtad_energy.decoding.runtime.timer import PhaseTimer
from mtad_energy.models import ModelPair

if TYPE_CHECKING:
    from mtad_energy.decoding.runtime.compiled import CompileOptions


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
    return text_ids(pair.tokenizer, prompt, chat)


def text_ids(tokenizer, text: str, chat: bool | None = None) -> list[int]:
    """Token ids of a text prompt under ``tokenizer``: through its chat template (one user turn,
    the generation prompt added) when it has one (chat=None) or when chat=True. Every engine
    decodes these ids (`encode_prompt` for a pair's tokenizer)."""
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text)["input_ids"]


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


def _read_back(result: StepResult, rows: int) -> list[tuple[list[int], int, float, int]]:
    """Per row: (emitted tokens, accepted count, draft-cache positions kept, draft depth) on the
    host, in one device-to-host copy of the tokens (``result.tokens`` as ``[B, m]``) and whatever
    counts the decoder left on the device (a depth known only on the device: EAGLE's dynamic
    tree), or of ``result.read``, where the kernel packed them."""
    on_device = result.device_counts()
    block = result.block_rows(rows)
    if result.read is not None:  # packed by the kernel, inside its graph
        width = None if block is None else len(on_device) + block.shape[1]
        assert result.read.shape[0] == rows and width in (None, result.read.shape[1]), (
            "StepResult.read must hold the device counts, then the tokens")
        tokens = result.read
    elif on_device:  # [B, F + m]: the counts, then the tokens (one op each, whatever F)
        counts = [getattr(result, c) for c in on_device]
        counts = [x if x.dtype == block.dtype else x.to(block.dtype) for x in counts]
        tokens = torch.cat([torch.stack(counts, -1).reshape(rows, -1), block], 1)
    else:
        tokens = block
    values = tokens.tolist()
    out = []
    for row in values:
        host = []
        for name in COUNTS:
            if name in on_device:
                host.append(row[0])
                row = row[1:]
            else:
                host.append(getattr(result, name))
        accepted, length, draft_valid, row_depth = host
        if length is not None:
            row = row[:length]
        out.append((row, 0 if accepted is None else int(accepted),
                    math.inf if draft_valid is None else draft_valid, row_depth))
    return out


def _of_row(values: Sequence[int], b: int) -> int:
    """Row b's count of a per-row sequence (``()``: none, 0)."""
    return values[b] if values else 0


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
    from mtad_energy.decoding.runtime.head_runner import HeadCall, HeadRunner

    draft_model = decoder.draft_model(pair)
    roles = [("target", pair.target, decoder.target_hidden(pair))]
    if draft_model is not None:
        roles.append(("draft", draft_model, decoder.draft_hidden()))
    opts = compile if compile and not isinstance(compile, bool) else None
    chain = decoder.lookahead + 1
    # widths a drafting decoder meets only on some runs: a draft's step and its catch-up after a
    # full accept (1, 2), the target's last short verify or step (1, 2) and verify; a head's
    # forwards take its features (the decoder names them: `Decoder.warm_forwards`)
    warm = {"draft": (1, 2) if decoder.head is None else (),
            "target": tuple(sorted({1, 2, chain}))}
    runners: list[ModelRunner] = []
    for role, model, hidden in roles:
        if getattr(model, "cacheless", False):
            runners.append(HeadRunner(model, timer, role, rows, compile, opts, tuple(
                HeadCall(*c) for c in decoder.warm_forwards(role, pair))))
        elif compile:
            from mtad_energy.decoding.runtime.static import (  # the compiler stack
                ForwardShape,
                WarmForward,
                make_runner,
            )

            shape = ForwardShape(repr(decoder), decoder.cache_rows(role), chain,
                                 warm[role] if decoder.lookahead else (), hidden,
                                 tuple(WarmForward(*f) for f in decoder.warm_forwards(role, pair)))
            runners.append(make_runner(model, timer, role, rows, slots, opts, shape))
        else:
            from mtad_energy.decoding.runtime.batch import rows_runner

            runners.append(rows_runner(model, timer, role, rows, hidden))
    return runners[0], (runners[1] if len(runners) > 1 else None)


def _calls_for(compile: bool | CompileOptions) -> EagerCalls:
    """Where the decoder's pure tensor functions run: compiled under ``compile``, else eagerly."""
    if not compile:
        return EagerCalls()
    from mtad_energy.decoding.runtime.compiled import CompiledCalls  # the compiler stack

    return CompiledCalls(None if isinstance(compile, bool) else compile)


def _graphs_compiled(compile: bool | CompileOptions) -> int:
    """Dynamo's count of graphs compiled in this process (0 when eager: nothing compiles)."""
    if not compile:
        return 0
    from mtad_energy.decoding.runtime.compiled import graphs_compiled  # the compiler stack

    return graphs_compiled()


@dataclass
class _Run:
    """One call's set-up, shared by its prefill, loop and row statistics."""

    decoder: Decoder
    pair: ModelPair
    prompt_lens: list[int]
    compile: bool | CompileOptions
    hook: PhaseHook
    timer: PhaseTimer
    state: DecodeState
    target: ModelRunner
    draft: ModelRunner | None
    calls: EagerCalls
    graphs_before: int  # dynamo's count of graphs compiled before this call

    @property
    def rows(self) -> int:
        return len(self.prompt_lens)

    @property
    def runners(self) -> list[Any]:
        """What may compile: the runners and the kernels."""
        return [r for r in (self.target, self.draft, self.calls) if r is not None]

    def clock(self) -> float:
        """Wall time less the first forwards of new shapes (compiling)."""
        return time.perf_counter() - sum(r.compile_s for r in self.runners)

    def forwards(self) -> tuple[int, int]:
        """Target and draft forwards so far."""
        return self.target.forwards, self.draft.forwards if self.draft is not None else 0


def _check_decoder(decoder: Decoder, pair: ModelPair, rows: int) -> None:
    """Refuse a call the decoder cannot run: no prompt, a draft model or head the pair lacks, or
    B > 1 rows for a decoder that decodes one sequence."""
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
    check_beams(decoder, pair)
    if rows > 1 and not decoder.batched:
        from mtad_energy.decoding.registry import batched_names

        raise ValueError(f"decoder {decoder.name!r} does not decode batches yet (batch size "
                         f"{rows}); decoders that do: {batched_names()}. Use batch size 1 for "
                         f"{decoder.name}")


def check_beams(decoder: Decoder, pair: ModelPair) -> None:
    """Refuse more beams (`Decoder.cache_rows`) than a model's vocabulary has tokens: the first
    step of a beam search keeps the W most likely of V tokens (torch's top-k would fail mid-run:
    "selected index k out of range")."""
    for role, model in (("target", pair.target), ("draft", pair.draft)):
        width = decoder.cache_rows(role)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if width > 1 and vocab is not None and width > vocab:
            raise ValueError(f"{decoder.name}: beam_width {width} is more beams than the {role}'s "
                             f"vocabulary has tokens ({vocab}): set --set beam_width={vocab} or less")


def _set_up(decoder: Decoder, pair: ModelPair, prompts: list[list[int]], max_new_tokens: int,
            seed: int, compile: bool | CompileOptions, hook: PhaseHook) -> _Run:
    """Checked lengths, the ids buffer, the generator, the runners and kernels, and the state."""
    rows = len(prompts)
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
    calls = _calls_for(compile)
    state = DecodeState(ids, list(prompt_lens), prompt_lens, max_new_tokens, target, draft,
                        generator, pair.eos_token_id, tokens=[list(p) for p in prompts],
                        calls=calls, recent_width=decoder.lookahead + 1)
    return _Run(decoder=decoder, pair=pair, prompt_lens=prompt_lens, compile=compile, hook=hook,
                timer=timer, state=state, target=target, draft=draft, calls=calls,
                graphs_before=graphs_before)


def _prefill(run: _Run) -> Trace:
    """The prefill phase, between the "prefill" and "decode" hooks: every prompt token but the
    last through the target (and a draft model), then the decoder's own prefill (a head primes
    itself from the target's hidden states). Returns the trace the loop goes on with."""
    target, draft, timer = run.target, run.draft, run.timer
    marks = [shape_marks(target, draft)]  # forwards recorded before the prefill, then per phase
    timer.sync()
    run.hook("prefill")
    t0 = time.perf_counter()
    if max(run.prompt_lens) > 1:  # all but the last prompt token (`runtime.runner`'s invariant)
        width = max(run.prompt_lens) - 1
        counts = [n - 1 for n in run.prompt_lens]
        ids = run.state.ids
        if run.rows == 1:
            prefix = ids[:, :width]
        else:  # right-aligned: row b's prompt ends at column width - 1
            device = run.pair.device
            idx = to_device(counts, device)[:, None] - width + torch.arange(width, device=device)
            prefix = ids.gather(1, idx.clamp_min(0))
        for runner in (target, draft if run.decoder.needs_draft else None):
            if runner is not None:
                runner.prefill(prefix, **({"counts": counts} if run.rows > 1 else {}))
    run.decoder.prefill(run.state)
    timer.sync()
    t_prefill = time.perf_counter()
    run.hook("decode")
    t_decode = run.clock()  # after the hook, so a meter's bookkeeping is not billed to decode
    fwd0 = run.forwards()
    marks.append(shape_marks(target, draft))
    return Trace(run.rows, t_prefill - t0, t_decode, fwd0, marks,
                 phase_times=[draft_target(timer)],  # cumulative, per iteration
                 bounds=[t_decode])


def _loop(run: _Run, trace: Trace) -> None:
    """The decode phase, up to the "end" hook: one decoder step per iteration, its one host read
    (`_read_back`), the rows' new tokens and counts, and the caches rolled back to the invariant
    (the target holds all but the last token)."""
    state, target, draft, timer = run.state, run.target, run.draft, run.timer
    while state.remaining > 0:
        before, lengths = run.forwards(), list(state.lengths)
        result = run.decoder.step(state)
        block = result.block_rows(run.rows)  # [B, m]; None: in result.read only
        read = _read_back(result, run.rows)  # the one host sync per iteration
        timer.flush()  # this iteration's events are complete now: reading them does not stall
        after = run.forwards()
        taken = _take_rows(run, trace, result, read, (after[0] - before[0], after[1] - before[1]))
        state.append_rows(block, taken, _counted(result, block, taken, read), result.recent)
        trace.phase_times.append(draft_target(timer))
        trace.marks.append(shape_marks(target, draft))
        trace.iterations += 1
        if not any(state.active):
            trace.bounds.append(run.clock())
            break
        # roll the caches back to the cache invariant: target sees all but the last token
        target.crop_rows([n - 1 for n in state.lengths], kept=[len(r[0]) for r in read])
        if draft is not None:
            draft.crop_rows([min(c, n - 1, m + r[2]) for c, n, m, r in
                             zip(draft.row_lengths, state.lengths, lengths, read, strict=True)])
        trace.bounds.append(run.clock())
    timer.sync()
    # the closing sync belongs to the last iteration: iterations tile decode
    trace.bounds[-1] = run.clock()
    run.hook("end")


def _counted(result: StepResult, block: torch.Tensor | None, taken: list[list[int]],
             read: list[tuple[list[int], int, float, int]]) -> torch.Tensor | int | None:
    """The rows' new tokens as the device counts them (the block's ``length``, or all of its
    columns) when every row took exactly that; None when one took less (EOS, max_new_tokens, a
    row already done) or the device's count is only in the read-back (`StepResult.packed`)."""
    if any(len(t) != len(r[0]) for t, r in zip(taken, read, strict=True)):
        return None
    if result.length is not None:
        return result.length
    return None if block is None or "length" in result.packed else block.shape[1]


def _take_rows(run: _Run, trace: Trace, result: StepResult,
               read: list[tuple[list[int], int, float, int]], fw: tuple[int, int]
               ) -> list[list[int]]:
    """Each active row's tokens of this iteration (cut at EOS and its max_new_tokens), recorded
    with the iteration's counts; a row that is done stops being active."""
    state, eos, it = run.state, run.pair.eos_token_id, trace.iterations
    taken: list[list[int]] = [[] for _ in range(run.rows)]
    for b, (token_list, accepted, _, row_depth) in enumerate(read):
        if not state.active[b]:
            continue
        token_list = token_list[:state.row_remaining(b)]
        if eos is not None and eos in token_list:
            token_list = token_list[:token_list.index(eos) + 1]
            trace.stop[b] = "eos"
        taken[b] = token_list
        trace.new_tokens[b].extend(token_list)
        # draft tokens kept: a block cut by EOS or max_new_tokens keeps only what it emitted,
        # and a row never keeps more than its own depth (a batch may draft further)
        depth = _of_row(result.depth, b) if row_depth is None else int(row_depth)
        trace.counts[b].append({
            "emitted": len(token_list), "proposed": _of_row(result.proposed, b),
            "accepted": min(accepted, len(token_list), depth), "draft_forwards": fw[1],
            "target_forwards": fw[0], "draft_depth": depth})
        if trace.stop[b] == "eos" or len(token_list) == state.row_remaining(b):  # (appended later)
            state.active[b] = False
            trace.last_iter[b] = it
            now = run.forwards()
            trace.forwards_at_end[b] = (now[0] - trace.fwd0[0], now[1] - trace.fwd0[1])
    return taken


def _config(run: _Run, max_new_tokens: int, seed: int) -> dict[str, Any]:
    """The generation's config: the decoder's, the call's, and what ran compiled or per row."""
    config = {**run.decoder.config(), "max_new_tokens": max_new_tokens, "seed": seed}
    if run.compile:  # the models whose forwards ran compiled (an int8 draft stays eager)
        config["compiled"] = [role for role, r in (("target", run.target), ("draft", run.draft))
                              if r is not None and r.compiled]
    if run.rows > 1:
        config["batch_size"] = run.rows
        from mtad_energy.decoding.runtime.batch import PerRowRunner

        per_row = [role for role, r in (("target", run.target), ("draft", run.draft))
                   if isinstance(r, PerRowRunner)]
        if per_row:  # rows not batched, so that each is exactly its batch-1 self
            config["per_row"] = per_row
    return config


def _generations(run: _Run, trace: Trace, max_new_tokens: int, seed: int,
                 compute_perplexity: bool) -> list[Generation]:
    """After the "end" hook: pending kernels compiled, the forwards' work counted, and each row's
    `Generation` (its tokens, text, statistics and config)."""
    compile_in_window_s = sum(r.compile_s for r in run.runners)  # the runners' in-loop seconds
    # kernels and fused calls met for the first time ran eagerly (fused: their forwards
    # compiled); they compile now, outside every window
    compile_s = (compile_in_window_s + sum(r.prewarm_s for r in run.runners)
                 + sum(r.compile_pending() for r in run.runners))
    graphs = _graphs_compiled(run.compile) - run.graphs_before
    splits = trace.splits()
    target_work = spans_work(run.target, [m[0] for m in trace.marks])  # [prefill, iteration 0, ..]
    draft_work = spans_work(run.draft, [m[1] for m in trace.marks])
    prefill_work = total_work([target_work[0], draft_work[0]])
    call = {"compile_s": compile_s, "compile_in_window_s": compile_in_window_s,
            "graphs_compiled": graphs, "prefill_flops": prefill_work and prefill_work.flops,
            "prefill_bytes": prefill_work and prefill_work.bytes}
    config = _config(run, max_new_tokens, seed)
    out = []
    for b in range(run.rows):
        ppl = (perplexity(run.pair.target, run.state.ids[b, :run.state.lengths[b]],
                          run.prompt_lens[b]) if compute_perplexity else None)
        stats, steps = row_statistics(trace, b, splits, draft_work, target_work, ppl, call)
        tokens = trace.new_tokens[b]
        text = run.pair.tokenizer.decode(tokens, skip_special_tokens=True)
        out.append(Generation(tokens, text, run.prompt_lens[b], stats, steps,
                              {**config, **({"row": b} if run.rows > 1 else {})}))
    return out


@torch.inference_mode()
def generate_ids(decoder: Decoder, pair: ModelPair, prompt_ids: list[int], max_new_tokens: int,
                 seed: int = 0, compute_perplexity: bool = True,
                 on_phase: PhaseHook | None = None,
                 compile: bool | CompileOptions = False) -> Generation:
    """Decode after ``prompt_ids``. ``compile`` (True, or `compiled.CompileOptions` to pick the
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
    _check_decoder(decoder, pair, len(prompts))
    run = _set_up(decoder, pair, prompts, max_new_tokens, seed, compile, on_phase or _no_hook)
    trace = _prefill(run)
    _loop(run, trace)
    return _generations(run, trace, max_new_tokens, seed, compute_perplexity)


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
