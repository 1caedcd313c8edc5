"""SpecTr (Sun et al. 2023): k i.i.d. draft sequences, k-sequential selection. Lossless w.r.t. ~p.

Verification layout: the k drafts are verified as k *batch rows* (the target cache is expanded to
k rows for one forward of ``[k, gamma+1]`` tokens, then the row of the accepted draft is kept),
not as a token tree. Why: it needs nothing but the runner's ``repeat_rows``/``select_rows`` and
works for every architecture (no custom 4-D attention mask); at batch 1 the forward is bound by
reading the weights, which the k rows share, so its cost is close to one chain verification. The
price is k copies of the KV cache per iteration (KV bytes are small next to the weights for the
paper's contexts); a tree would also merge drafts that share a prefix.

The draft does the same: its first distribution is shared by all k drafts (one batch-1 forward,
k i.i.d. samples), then the draft cache is expanded to k rows for the remaining gamma-1 steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.chain import spectr_accept_u
from mtad_energy.decoding.rules.sampling import Warp, sample, warp_probs
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.params import DecoderParams, param, require
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult, block_tokens


@dataclass(frozen=True)
class SpectrParams(DecoderParams):
    num_drafts: int = param(4, "k i.i.d. draft sequences per iteration")
    gamma: int = param(4, "tokens per draft sequence")

    def validate(self) -> None:
        require(self.num_drafts >= 1, f"num_drafts (k) must be >= 1, got {self.num_drafts}")
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")


def draft_sequences(draft: ModelRunner, pending: torch.Tensor, k: int, gamma: int, warp: Warp,
                    generator: torch.Generator, counts: list[int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """k i.i.d. sequences of gamma tokens from ~q per sequence, after feeding ``pending [B, m]``
    (row b's last counts[b] tokens real): ``(drafts [B, k, gamma], q [B, k, gamma, V])``.

    Leaves the draft cache at k rows per sequence when gamma > 1 (row b*k + i holds draft i's
    first gamma-1 tokens).
    """
    first = warp.probs(draft(pending, counts)[:, -1])  # [B, V], shared by the k drafts
    rows = first.shape[0]
    q = first[:, None].expand(rows, k, -1)  # [B, k, V]
    tok = sample(q, generator)  # [B, k]
    tokens, qs = [tok], [q]
    if gamma > 1:
        draft.repeat_rows(k)
    for _ in range(1, gamma):
        q = warp.probs(draft(tok.reshape(rows * k, 1))[:, -1]).view(rows, k, -1)  # [B, k, V]
        tok = sample(q, generator)
        tokens.append(tok), qs.append(q)
    return torch.stack(tokens, 2), torch.stack(qs, 2)


class Spectr(Decoder):
    name = "spectr"
    help = "SpecTr: k i.i.d. drafts verified as k rows, k-sequential selection (lossless)"
    Params = SpectrParams
    needs_draft = True
    batched = True

    @property
    def lookahead(self) -> int:
        return self.params.gamma

    def cache_rows(self, role: str) -> int:
        return self.params.num_drafts

    def step(self, s: DecodeState) -> StepResult:
        warp, k = self.params.warp, self.params.num_drafts
        lens = self.draft_lens(s)  # per row (lossless: a longer batch draft changes no law)
        gamma = max(lens)
        if gamma == 0:  # one token left: no point drafting
            return target_step(s, warp)
        pending, counts = s.draft_feed()
        drafts, q = draft_sequences(s.draft, pending, k, gamma, warp, s.generator, counts)
        rows = drafts.shape[0]
        if k > 1:
            s.target.repeat_rows(k)
        ids = torch.cat([s.last_token.repeat_interleave(k, 0), drafts.reshape(rows * k, gamma)],
                        1)  # [B*k, gamma+1]
        # q has <= top_k nonzeros (up to ties at the cut): rho only needs those tokens
        block, n, length, keep = s.target.then(
            s.kernels, ids, spectr_verify, q, drafts, s.uniform(*drafts.shape),
            s.uniform(rows, 1), 2 * self.params.top_k, *warp.args)
        # back to one row per sequence, the one consistent with the emitted prefix (the loop
        # then crops)
        if k > 1:
            s.target.select_rows(keep)
            if gamma > 1:
                s.draft.select_rows(keep)
        # proposed = every draft token shown to the target (k * gamma), as for tree decoders
        return StepResult(block, tuple(k * g for g in lens), n, length, depth=lens)


def spectr_verify(logits: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
                  u_next: torch.Tensor, support: int, temperature: float, top_k: int,
                  top_p: float) -> tuple[torch.Tensor, ...]:
    """Kernel: the target's warped p along each draft (``logits [B*k, gamma+1, V]``), Spectr's
    selection (`spectr_accept_u`; ``q [B, k, gamma, V]``, ``drafts [B, k, gamma]``) and the
    block: ``(block [B, gamma+1], n, length [B], keep [B])``, keep: the cache row of the draft
    each sequence keeps (row b*k + the chosen draft)."""
    rows, k, gamma = drafts.shape
    p = warp_probs(logits, temperature, top_k, top_p).view(rows, k, gamma + 1, -1)
    n, nxt, row = spectr_accept_u(p, q, drafts, u, u_next, support)  # [B] each
    kept = drafts.gather(1, row[:, None, None].expand(-1, 1, gamma)).squeeze(1)  # [B, gamma]
    block, length = block_tokens(kept, n, nxt)
    return block, n, length, torch.arange(rows, device=row.device) * k + row
