"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023). Lossless w.r.t. warped p."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad_energy.decoding.acceptance import speculative_accept
from mtad_energy.decoding.base import (
    Decoder,
    DecoderParams,
    DecodeState,
    ModelRunner,
    StepResult,
    param,
    require,
    target_step,
)
from mtad_energy.decoding.sampling import Warp, sample


@dataclass(frozen=True)
class SpdParams(DecoderParams):
    gamma: int = param(4, "draft tokens per iteration")

    def validate(self) -> None:
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")


def draft_chain(draft: ModelRunner, pending: torch.Tensor, gamma: int, warp: Warp,
                generator: torch.Generator, counts: list[int] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample gamma tokens per row autoregressively from warped q after feeding ``pending
    [B, k]`` (row b's last counts[b] tokens real, see `DecodeState.draft_feed`):
    ``(draft [B, gamma], q [B, gamma, V])``."""
    tokens, qs = [], []
    q = warp.probs(draft(pending, counts)[:, -1])  # [B, V]
    for i in range(gamma):
        if i:
            q = warp.probs(draft(tokens[-1][:, None])[:, -1])
        tokens.append(sample(q, generator)), qs.append(q)
    return torch.stack(tokens, 1), torch.stack(qs, 1)


class SpeculativeDecoding(Decoder):
    name = "spd"
    help = "speculative decoding: gamma draft tokens, accept with min(1, p/q), residual on reject"
    Params = SpdParams
    needs_draft = True
    batched = True

    @property
    def lookahead(self) -> int:
        return self.params.gamma

    def step(self, s: DecodeState) -> StepResult:
        warp = self.params.warp
        lens = self.draft_lens(s)  # per row; lossless: a longer batch draft changes no row's law
        gamma = max(lens)
        if gamma == 0:  # one token left: no point drafting
            return target_step(s, warp)
        pending, counts = s.draft_feed()
        draft, q = draft_chain(s.draft, pending, gamma, warp, s.generator, counts)  # [B, gamma]
        p = warp.probs(s.target(torch.cat([s.last_token, draft], 1)))  # [B, gamma+1, V]
        n, nxt = speculative_accept(p, q, draft, s.generator)  # [B], [B]
        return StepResult.block(draft, n, nxt, lens, depth=lens)
