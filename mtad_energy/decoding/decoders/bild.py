"""Big-Little Decoder (Kim et al. 2023), sampling form. Lossy.

Fallback: the draft samples from ~q while it is confident (max ~q >= ``fallback``), up to
``max_draft`` tokens. Rollback: the target scores [last, x_1..x_m] in one forward; the first
draft token with -log p(x_i) > ``rollback`` and everything after it are discarded and replaced by a
sample from ~p at that position. If nothing rolls back, a bonus token is sampled from ~p after x_m:
it is free (same forward) and it is the target's own token at the position where the draft lost
confidence, as in the paper's fallback.

Which p the rollback test uses: the temperature-scaled but *untruncated* target softmax (the
paper's cross-entropy on the model's output distribution). The top-k / top-p warp would give every
token outside the target's nucleus -log p = inf, turning the threshold into a support check; the
thresholds are calibrated on the model's distribution. At temperature 0 (a one-hot warp) the test
uses temperature 1, as in the paper's greedy runs; the emitted tokens are then the draft's argmax
until the target finds one unlikely, and the target's argmax there.

Host syncs: one per draft token (the fallback decision is data-dependent control flow, inherent
to BiLD) and one for the rollback position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.chain import rollback_length
from mtad_energy.decoding.rules.sampling import Warp, sample
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.params import DecoderParams, param, require
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.state import DecodeState, to_device
from mtad_energy.decoding.runtime.step import StepResult


@dataclass(frozen=True)
class BildParams(DecoderParams):
    fallback: float = param(0.9, "fall back to the target once max ~q < this, in [0, 1]")
    rollback: float = param(2.0, "roll back at the first draft token with -log p(x) > this")
    max_draft: int = param(10, "draft length cap per iteration")

    def validate(self) -> None:
        require(0.0 <= self.fallback <= 1.0,
                f"fallback must be in [0, 1] (a probability; 0 = draft up to max_draft), "
                f"got {self.fallback}")
        require(self.rollback > 0, f"rollback must be > 0 (an NLL threshold in nats; inf = never "
                                   f"roll back), got {self.rollback}")
        require(self.max_draft >= 1, f"max_draft must be >= 1, got {self.max_draft}")


def draft_until_unsure(draft: ModelRunner, pending: torch.Tensor, caps: list[int],
                       fallback: float, warp: Warp, generator: torch.Generator,
                       counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """BiLD's fallback policy per sequence: sample from ~q while max ~q >= fallback, at most
    caps[b] tokens for row b (0: a row that drafts nothing, e.g. one that is done), after
    feeding ``pending [B, k]`` (row b's last counts[b] tokens real).

    Returns ``(tokens [B, M], lengths)``: row b's draft is ``tokens[b, :lengths[b]]``,
    0 <= lengths[b] <= caps[b] (0: the target takes over at once); M = max(lengths). Rows keep
    drafting (their extra tokens ignored) while another row is still sure.
    """
    rows = pending.shape[0]
    tokens: list[torch.Tensor] = []
    lengths = [0] * rows
    sure = [c > 0 for c in caps]
    q = warp.probs(draft(pending, counts)[:, -1])  # [B, V]
    for i in range(max(caps, default=0)):
        if i:
            q = warp.probs(draft(tokens[-1][:, None])[:, -1])
        # the fallback decision is data-dependent control flow: one read-back per draft token
        confident = (q.amax(-1) >= fallback).tolist()
        sure = [a and c and i < cap for a, c, cap in zip(sure, confident, caps, strict=True)]
        if not any(sure):  # every draft is unsure here (or at its cap): the target decides
            break
        tokens.append(sample(q, generator))
        lengths = [n + s for n, s in zip(lengths, sure, strict=True)]
    if not tokens:
        return pending.new_empty(rows, 0), lengths
    return torch.stack(tokens, 1), lengths


def rollback_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p for the rollback test: temperature-scaled, untruncated; T=0 uses T=1. ``[..., V]``."""
    return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)


class Bild(Decoder):
    name = "bild"
    help = "BiLD: draft while max ~q >= fallback, roll back where -log p(x) > rollback (lossy)"
    Params = BildParams
    needs_draft = True
    batched = True

    @property
    def lookahead(self) -> int:
        return self.params.max_draft

    def step(self, s: DecodeState) -> StepResult:
        prm = self.params
        warp = prm.warp
        pending, counts = s.draft_feed()
        draft, lengths = draft_until_unsure(s.draft, pending, self.draft_lens(s), prm.fallback,
                                            warp, s.generator, counts)  # [B, M]
        m = draft.shape[1]
        logits = s.target(torch.cat([s.last_token, draft], 1))  # [B, M+1, V]
        log_p = rollback_log_probs(logits[:, :m], prm.temperature)  # [B, M, V]
        nll = -log_p.gather(-1, draft[..., None])[..., 0]  # [B, M]
        if len(set(lengths)) > 1:  # a row's tokens past its own draft roll back by definition
            past = torch.arange(m, device=nll.device)[None] >= to_device(lengths, nll.device)[:, None]
            nll = nll.masked_fill(past, float("inf"))
        n = rollback_length(nll, prm.rollback)  # [B], stays on the device
        # rollback: replace x_{n+1} by a sample from ~p there; none: bonus token from ~p after x_m
        at = n[:, None, None].expand(-1, 1, logits.shape[-1])
        nxt = sample(warp.probs(logits.gather(1, at).squeeze(1)), s.generator)
        return StepResult.block(draft, n, nxt, lengths, depth=lengths)  # per row
