"""Typical acceptance (Medusa, Cai et al. 2024) with a chain draft from ~q. Lossy.

Accept draft token x_i if p_i(x_i) > min(eps, delta * exp(-H(p_i))); keep the longest accepted
prefix; the next token is sampled from ~p after it (the same target forward).

Which p the test uses: as in Medusa's code, the temperature-scaled but *untruncated* target
softmax, for both p(x) and the entropy H: the thresholds (eps = 0.09, delta = 0.3 = sqrt(eps))
are calibrated on the model's distribution, and top-k / top-p truncation would shrink H and give
tokens outside the nucleus p = 0. At temperature 0 p is one-hot (H = 0), so a token is accepted iff
it is the target's argmax: greedy typical equals greedy ``ar``, Medusa's greedy mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.chain import typical_accept_length
from mtad_energy.decoding.rules.sampling import sample_u, warp_probs
from mtad_energy.decoding.runtime.decoder import Decoder, draft_chain, target_step
from mtad_energy.decoding.runtime.params import DecoderParams, param, require
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult, block_out, block_tokens


@dataclass(frozen=True)
class TypicalParams(DecoderParams):
    gamma: int = param(4, "draft tokens per iteration")
    eps: float = param(0.09, "hard threshold: accept x if p(x) > min(eps, delta*exp(-H(p)))")
    delta: float = param(0.3, "entropy-scaled threshold factor (Medusa's alpha)")

    def validate(self) -> None:
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")
        require(0.0 < self.eps <= 1.0, f"eps must be in (0, 1] (a probability), got {self.eps}")
        require(self.delta > 0.0, f"delta must be > 0, got {self.delta}")


class Typical(Decoder):
    name = "typical"
    help = "typical acceptance: keep draft tokens with p(x) > min(eps, delta*exp(-H(p))) (lossy)"
    Params = TypicalParams
    needs_draft = True
    batched = True

    @property
    def lookahead(self) -> int:
        return self.params.gamma

    def step(self, s: DecodeState) -> StepResult:
        prm = self.params
        warp = prm.warp
        lens = self.draft_lens(s)
        gamma = max(lens)
        if gamma == 0:  # one token left: no point drafting
            return target_step(s, warp)
        pending, counts = s.draft_feed()
        draft, = draft_chain(s, pending, gamma, warp, counts, q=False)  # [B, gamma]
        # logits [B, gamma+1, V] -> the block (compiled: one graph call)
        recent, read = s.target.verify(
            s.calls, torch.cat([s.last_token, draft], 1), typical_verify, draft,
            s.on_device(lens), s.uniform(s.batch, 1), s.recent, prm.eps, prm.delta, *warp.args)
        return StepResult.from_read(read, recent, ("accepted", "length"), proposed=lens,
                                    depth=lens)


def typical_verify(logits: torch.Tensor, draft: torch.Tensor, lens: torch.Tensor,
                   u_next: torch.Tensor, recent: torch.Tensor, eps: float, delta: float,
                   temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, ...]:
    """Kernel: the typical test of ``draft [B, gamma]`` on temperature-scaled, untruncated p
    (`typical_accept_length`), capped at each row's own draft length ``lens [B]``, then a token
    from warped p after the accepted prefix (only that position warped), and the block:
    ``(tokens [B, gamma+1], accepted [B], length [B], recent, read)`` (`block_out`)."""
    gamma = draft.shape[-1]
    p_test = warp_probs(logits[:, :gamma], temperature, top_k=0, top_p=1.0)
    n = torch.minimum(typical_accept_length(p_test, draft, eps, delta), lens)  # [B]
    at_n = n[:, None, None].expand(-1, 1, logits.shape[-1])
    nxt = sample_u(warp_probs(logits.gather(1, at_n)[:, 0], temperature, top_k, top_p), u_next)
    tokens, length = block_tokens(draft, n, nxt)
    return (tokens, n, length, *block_out(tokens, length, recent, n, length))
