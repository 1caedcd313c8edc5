"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023). Lossless w.r.t. warped p."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.chain import speculative_accept_u
from mtad_energy.decoding.rules.sampling import split_uniforms, warp_probs
from mtad_energy.decoding.runtime.decoder import Decoder, draft_chain, target_step
from mtad_energy.decoding.runtime.params import DecoderParams, param, require
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult, block_out, block_tokens


@dataclass(frozen=True)
class SpdParams(DecoderParams):
    gamma: int = param(4, "draft tokens per iteration")

    def validate(self) -> None:
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")


def spd_verify(logits: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u: torch.Tensor,
               recent: torch.Tensor, temperature: float, top_k: int, top_p: float
               ) -> tuple[torch.Tensor, ...]:
    """Kernel: the verify's warped p (``logits [B, gamma+1, V]``), the speculative rule against
    ``q [B, gamma, V]`` (`speculative_accept_u`; ``u``: its uniforms ``[B, gamma]`` then ``[B,
    1]``, flat), and the block: ``(tokens [B, gamma+1], accepted [B], length [B], recent,
    read)`` (`block_tokens`, `block_out`)."""
    p = warp_probs(logits, temperature, top_k, top_p)
    u_draft, u_next = split_uniforms(u, draft.shape, (draft.shape[0], 1))
    n, nxt = speculative_accept_u(p, q, draft, u_draft, u_next)
    tokens, length = block_tokens(draft, n, nxt)
    return (tokens, n, length, *block_out(tokens, length, recent, n, length))


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
        draft, q = draft_chain(s, pending, gamma, warp, counts)  # [B, gamma], [B, gamma, V]
        # logits [B, gamma+1, V] -> the block (compiled: the verify and its rule one graph call)
        recent, read = s.target.verify(
            s.calls, torch.cat([s.last_token, draft], 1), spd_verify, q, draft,
            s.uniforms(draft.shape, (s.batch, 1)), s.recent, *warp.args)
        return StepResult.from_read(read, recent, ("accepted", "length"), proposed=lens,
                                    depth=lens)
