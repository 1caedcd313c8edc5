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

Host reads: one per draft token (the fallback decision is data-dependent control flow, inherent
to BiLD) and the loop's read-back. The warp, the confidence test, the draws and the rollback rule
are kernels (`bild_q`, `bild_draw`, `bild_verify`); a draft token's uniforms are drawn only once
the read says some row drafts it, so a draft that never drafts draws exactly what ``ar`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.chain import rollback_length
from mtad_energy.decoding.rules.sampling import Warp, sample_u, uniforms, warp_probs
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.params import DecoderParams, param, require
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult, block_out, block_tokens


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


def bild_q(logits: torch.Tensor, fallback: float, temperature: float, top_k: int, top_p: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel: warped q at the last position of the draft's ``logits [B, k, V]`` and whether each
    row is sure of it (max ~q >= ``fallback``): ``(q [B, V], sure [B])``."""
    q = warp_probs(logits[:, -1], temperature, top_k, top_p)
    return q, q.amax(-1) >= fallback


def bild_draw(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Kernel: a token per row from ``q [B, V]`` with uniforms ``u [B, 1]``: ``[B, 1]``."""
    return sample_u(q, u)[:, None]


def draft_until_unsure(draft: ModelRunner, calls, pending: torch.Tensor, caps: list[int],
                       fallback: float, warp: Warp, generator: torch.Generator | None,
                       counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """BiLD's fallback policy per sequence: sample from ~q while max ~q >= fallback, at most
    caps[b] tokens for row b (0: a row that drafts nothing, e.g. one that is done), after
    feeding ``pending [B, k]`` (row b's last counts[b] tokens real); the warp and the draws are
    kernels (``calls``), each draft forward fused with its warp (`ModelRunner.then`), a
    token's uniforms drawn from ``generator`` after the read that says some row drafts it.

    Returns ``(tokens [B, M], lengths)``: row b's draft is ``tokens[b, :lengths[b]]``,
    0 <= lengths[b] <= caps[b] (0: the target takes over at once); M = max(lengths). Rows keep
    drafting (their extra tokens ignored) while another row is still sure.
    """
    rows = pending.shape[0]
    tokens: list[torch.Tensor] = []
    lengths = [0] * rows
    sure = [c > 0 for c in caps]
    # [B, V], [B]: the catch-up's warped q and whether each row is sure of it
    q, confident = draft.then(calls, pending, bild_q, fallback, *warp.args, counts=counts)
    for i in range(max(caps, default=0)):
        if i:
            q, confident = draft.then(calls, tokens[-1], bild_q, fallback, *warp.args)
        # the fallback decision is data-dependent control flow: one host read per draft token
        sure = [a and c and i < cap
                for a, c, cap in zip(sure, confident.tolist(), caps, strict=True)]
        if not any(sure):  # every draft is unsure here (or at its cap): the target decides
            break
        tokens.append(calls(bild_draw, q, uniforms((rows, 1), generator, q.device)))
        lengths = [n + s for n, s in zip(lengths, sure, strict=True)]
    if not tokens:
        return pending.new_empty(rows, 0), lengths
    return torch.cat(tokens, 1), lengths


def rollback_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p for the rollback test: temperature-scaled, untruncated; T=0 uses T=1. ``[..., V]``."""
    return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)


def bild_verify(logits: torch.Tensor, draft: torch.Tensor, lengths: torch.Tensor,
                u: torch.Tensor, recent: torch.Tensor, rollback: float, temperature: float,
                top_k: int, top_p: float) -> tuple[torch.Tensor, ...]:
    """Kernel: the rollback test on the target's ``logits [B, m + 1, V]`` of ``draft [B, m]``
    (row b's first ``lengths[b]`` tokens its own; a row's tokens past them roll back by
    definition), and the next token from ~p where the draft stops (``u [B, 1]``): ``(block [B,
    m + 1], kept [B], length [B], recent, read)`` (`block_tokens`, `block_out`)."""
    m = draft.shape[1]
    log_p = rollback_log_probs(logits[:, :m], temperature)  # [B, m, V]
    nll = -log_p.gather(-1, draft[..., None])[..., 0]  # [B, m]
    past = torch.arange(m, device=nll.device)[None] >= lengths[:, None]
    n = rollback_length(nll.masked_fill(past, float("inf")), rollback)  # [B]
    # rollback: x_{n+1} replaced by a sample from ~p there; none: a bonus token from ~p after x_m
    at = n[:, None, None].expand(-1, 1, logits.shape[-1])
    nxt = sample_u(warp_probs(logits.gather(1, at)[:, 0], temperature, top_k, top_p), u)
    block, length = block_tokens(draft, n, nxt)
    return block, n, length, *block_out(block, length, recent, n, length)


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
        draft, lengths = draft_until_unsure(s.draft, s.calls, pending, self.draft_lens(s),
                                            prm.fallback, warp, s.generator, counts)  # [B, M]
        # logits [B, M+1, V] -> the block (compiled at full width: the verify, its rule and the
        # rollback one graph call)
        recent, read = s.target.verify(
            s.calls, torch.cat([s.last_token, draft], 1), bild_verify, draft,
            s.on_device(lengths), s.uniform(s.batch, 1), s.recent, prm.rollback, *warp.args)
        return StepResult.from_read(read, recent, ("accepted", "length"), proposed=lengths,
                                    depth=lengths)
