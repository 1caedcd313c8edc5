"""The one generate loop: prefill, iterate a decoder, EOS / max_new_tokens, rollback, stats."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mtad_energy.decoding.base import Decoder, DecodeState, ModelRunner, PhaseTimer, StepResult
from mtad_energy.models import ModelPair


@dataclass(frozen=True)
class StepStats:
    """One decoder iteration, with the same meaning for every decoder (README, "Statistics"):
    ``emitted`` tokens appended (kept draft tokens + the token from p); ``proposed`` every draft
    token shown to the target (tree nodes, k*gamma for Spectr: verification work, not
    acceptance); ``accepted`` draft tokens on the emitted path that were kept; ``draft_depth``
    how many draft tokens on one path could have been accepted (gamma for a chain, the tree
    depth for trees, the draft length for Spectr; 0 without a draft)."""

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


@dataclass(frozen=True)
class GenerationStats:
    iterations: int
    tokens_emitted: int
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
    need = prompt_len + max_new_tokens + decoder.lookahead
    if need > ctx:
        raise ValueError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) + the decoder's lookahead "
            f"({decoder.lookahead}) = {need} exceeds the target's context of {ctx}; lower "
            f"max_new_tokens to at most {ctx - prompt_len - decoder.lookahead}")


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


def _read_back(result: StepResult) -> tuple[list[int], int, float]:
    """(emitted tokens, accepted count, valid draft-cache length) on the host, in one
    device-to-host copy of the tokens and whatever counts the decoder left on the device."""
    tokens = result.tokens
    fields = (result.accepted, result.length, result.draft_cache_len)
    head = [x.view(1).to(tokens.dtype) for x in fields if isinstance(x, torch.Tensor)]
    values = torch.cat([*head, tokens]).tolist() if head else tokens.tolist()
    host = []
    for x in fields:
        if isinstance(x, torch.Tensor):
            host.append(values[0])
            values = values[1:]
        else:
            host.append(x)
    accepted, length, draft_valid = host
    if length is not None:
        values = values[:length]
    return values, int(accepted), math.inf if draft_valid is None else draft_valid


PhaseHook = Callable[[str], None]
"""Called with "prefill", "decode" and "end" at the phase boundaries, after the device is synced,
so a caller can open and close measurement windows without this module knowing about meters."""


def _no_hook(phase: str) -> None:
    pass


@torch.inference_mode()
def generate_ids(decoder: Decoder, pair: ModelPair, prompt_ids: list[int], max_new_tokens: int,
                 seed: int = 0, compute_perplexity: bool = True,
                 on_phase: PhaseHook | None = None) -> Generation:
    if decoder.needs_draft and pair.draft is None:
        raise ValueError(f"decoder {decoder.name!r} needs a draft model, but the pair has none; "
                         "load one with draft=... (e.g. 'self:int8') or pick ar/beam/mtjd")
    prompt_len = len(prompt_ids)
    _check_lengths(pair, decoder, prompt_len, max_new_tokens)
    device = pair.device
    timer = PhaseTimer.for_device(device)
    ids = torch.zeros(prompt_len + max_new_tokens, dtype=torch.long, device=device)
    ids[:prompt_len] = torch.tensor(prompt_ids, dtype=torch.long)
    generator = torch.Generator(device=device).manual_seed(seed)
    target = ModelRunner(pair.target, timer, "target")
    draft = ModelRunner(pair.draft, timer, "draft") if decoder.needs_draft else None
    state = DecodeState(ids, prompt_len, prompt_len, max_new_tokens, target, draft, generator,
                        pair.eos_token_id)

    hook = on_phase or _no_hook
    timer.sync()
    hook("prefill")
    t0 = time.perf_counter()
    if prompt_len > 1:  # everything but the last prompt token (see the cache invariant in base.py)
        target(ids[None, :prompt_len - 1])
        if draft is not None:
            draft(ids[None, :prompt_len - 1])
    timer.sync()
    t_prefill = time.perf_counter()
    hook("decode")
    t_decode = time.perf_counter()  # after the hook, so a meter's bookkeeping is not billed to decode
    fwd0 = (target.forwards, draft.forwards if draft else 0)

    eos = pair.eos_token_id
    counts: list[dict[str, int]] = []  # per iteration: the StepStats fields other than times
    phase_times: list[tuple[float, float]] = [_draft_target(timer)]  # cumulative, per iteration
    bounds = [t_decode]  # iteration boundaries (wall clock)
    new_tokens: list[int] = []
    stop = "max_new_tokens"
    while state.remaining > 0:
        before = (target.forwards, draft.forwards if draft else 0)
        result = decoder.step(state)
        token_list, accepted, draft_valid = _read_back(result)  # the one host sync per iteration
        timer.flush()  # this iteration's events are complete now: reading them does not stall
        token_list = token_list[:state.remaining]
        if eos is not None and eos in token_list:
            token_list = token_list[:token_list.index(eos) + 1]
            stop = "eos"
        state.append(result.tokens[:len(token_list)])
        new_tokens.extend(token_list)
        # draft tokens kept: a block cut by EOS or max_new_tokens keeps only what it emitted
        accepted = min(accepted, len(token_list))
        counts.append({"emitted": len(token_list), "proposed": result.proposed, "accepted": accepted,
                       "draft_forwards": (draft.forwards if draft else 0) - before[1],
                       "target_forwards": target.forwards - before[0], "draft_depth": result.depth})
        phase_times.append(_draft_target(timer))
        if stop == "eos":
            bounds.append(time.perf_counter())
            break
        # roll the caches back to the cache invariant: target sees all but the last token
        target.crop(state.n - 1)
        if draft is not None:
            draft.crop(min(len(draft), state.n - 1, draft_valid))
        bounds.append(time.perf_counter())
    timer.sync()
    t_end = time.perf_counter()
    hook("end")

    decode_s = t_end - t_decode
    bounds[-1] = t_end  # the closing sync belongs to the last iteration: iterations tile decode_s
    steps = []
    for i, c in enumerate(counts):
        d, t, o = _split(bounds[i + 1] - bounds[i], phase_times[i], phase_times[i + 1])
        steps.append(StepStats(**c, time_draft_s=d, time_target_s=t, time_other_s=o))
    draft_s, target_s, _ = _split(decode_s, phase_times[0], phase_times[-1])
    target_fw = target.forwards - fwd0[0]
    proposed = sum(s.proposed for s in steps)
    accepted = sum(s.accepted for s in steps)
    depth = sum(s.draft_depth for s in steps)
    drafting = sum(1 for s in steps if s.draft_depth)
    ppl = perplexity(pair.target, ids[:state.n], prompt_len) if compute_perplexity else None
    stats = GenerationStats(
        iterations=len(steps), tokens_emitted=len(new_tokens), draft_proposed=proposed,
        draft_accepted=accepted, draft_forwards=(draft.forwards - fwd0[1]) if draft else 0,
        target_forwards=target_fw, prefill_time_s=t_prefill - t0, decode_time_s=decode_s,
        time_draft_s=draft_s, time_target_s=target_s,
        time_other_s=max(0.0, decode_s - draft_s - target_s),
        tokens_per_s=len(new_tokens) / decode_s if decode_s > 0 else float("inf"),
        block_efficiency=len(new_tokens) / target_fw if target_fw else 0.0,
        acceptance_rate=accepted / depth if depth else None,
        perplexity=ppl, stop_reason=stop, draft_depth=depth,
        mean_accepted_length=accepted / drafting if drafting else None)
    text = pair.tokenizer.decode(new_tokens, skip_special_tokens=True)
    config = {**decoder.config(), "max_new_tokens": max_new_tokens, "seed": seed}
    return Generation(new_tokens, text, prompt_len, stats, steps, config)


def generate(decoder: Decoder | str, pair: ModelPair,
             prompt: str | Sequence[int] | torch.Tensor | list[str],
             max_new_tokens: int = 128, seed: int = 0, chat: bool | None = None,
             compute_perplexity: bool = True, **params) -> Generation | list[Generation]:
    """Decode ``prompt`` (text or ids) with ``decoder`` (an instance or a registry name plus its
    params). A list of text prompts gives a list of Generations, decoded one at a time (batch
    size 1 per sequence, as in the paper); prompt i uses seed + i."""
    from mtad_energy.decoding.registry import get_decoder

    if isinstance(decoder, str):
        decoder = get_decoder(decoder, **params)
    elif params:
        raise TypeError("pass decoder parameters either in the Decoder or as keywords, not both")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return [generate_ids(decoder, pair, encode_prompt(pair, p, chat), max_new_tokens, seed + i,
                             compute_perplexity) for i, p in enumerate(prompt)]
    return generate_ids(decoder, pair, encode_prompt(pair, prompt, chat), max_new_tokens, seed,
                        compute_perplexity)
