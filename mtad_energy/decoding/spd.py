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
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample gamma tokens autoregressively from warped q: ``([gamma], q [gamma, V])``."""
    tokens, qs = [], []
    ids = pending
    for _ in range(gamma):
        q = warp.probs(draft(ids)[0, -1])  # [V]
        tok = sample(q, generator)
        tokens.append(tok), qs.append(q)
        ids = tok.view(1, 1)
    return torch.stack(tokens), torch.stack(qs)


class SpeculativeDecoding(Decoder):
    name = "spd"
    help = "speculative decoding: gamma draft tokens, accept with min(1, p/q), residual on reject"
    Params = SpdParams
    needs_draft = True

    @property
    def lookahead(self) -> int:
        return self.params.gamma

    def step(self, s: DecodeState) -> StepResult:
        warp = self.params.warp
        gamma = self.draft_len(s)
        if gamma == 0:  # one token left: no point drafting
            return target_step(s, warp)
        draft, q = draft_chain(s.draft, s.draft_pending(), gamma, warp, s.generator)
        p = warp.probs(s.target(torch.cat([s.last_token[0], draft])[None])[0])  # [gamma+1, V]
        n, nxt = speculative_accept(p, q, draft, s.generator)
        return StepResult.block(draft, n, nxt, gamma)
