"""Multi-token assisted decoding (MTAD, the paper's method).

The draft model proposes gamma tokens by stochastic beam sampling (W beams); the best final beam
y* is scored by the target in one forward; the accepted length is the *longest* prefix whose joint
likelihood ratio passes: eta = max{j : sum_{i<=j} log ~p(y*_i) - log ~q(y*_i) > log tau}; then
one token is sampled from ~p after y*_{1..eta}. Lossy by design.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mtad_energy.decoding.acceptance import joint_accept_length
from mtad_energy.decoding.base import (
    Decoder,
    DecoderParams,
    DecodeState,
    StepResult,
    block_tokens,
    param,
    require,
    target_step,
    to_device,
)
from mtad_energy.decoding.beams import beam_sample_rows, best_at, closest_beam
from mtad_energy.decoding.sampling import sample_shape, sample_u, uniforms, warp_probs


@dataclass(frozen=True)
class MtadParams(DecoderParams):
    gamma: int = param(4, "draft length (beam depth)")
    beam_width: int = param(4, "W draft beams")
    tau: float = param(0.5, "acceptance threshold on the joint ratio p/q, in (0, 1)")

    def validate(self) -> None:
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")
        require(self.beam_width >= 1, f"beam_width must be >= 1, got {self.beam_width}")
        require(0.0 < self.tau < 1.0, f"tau must be in (0, 1) (the paper uses 0.5), got {self.tau}")

    @property
    def log_tau(self) -> float:
        return math.log(self.tau)


class Mtad(Decoder):
    name = "mtad"
    help = "MTAD: beam-sampled draft, longest prefix with joint p/q > tau, bonus token from p"
    Params = MtadParams
    needs_draft = True
    batched = True

    @property
    def lookahead(self) -> int:
        return self.params.gamma

    def cache_rows(self, role: str) -> int:
        return self.params.beam_width if role == "draft" else 1

    def step(self, s: DecodeState) -> StepResult:
        prm = self.params
        warp = prm.warp
        lens = self.draft_lens(s)
        gamma = max(lens)
        if gamma == 0:
            return target_step(s, warp)
        pending, counts = s.draft_feed()
        beams = beam_sample_rows(s.draft, pending, gamma, prm.beam_width, warp, s.generator,
                                 counts=counts, kernels=s.kernels)
        # y*: each row's best beam at its own depth (what its search alone would end with); a
        # row with no draft of its own (one token left) accepts nothing: its token is from p
        depth = to_device(lens, pending.device)  # [B]
        y, cum_log_q = s.kernels(best_at, beams.tokens, beams.parents, beams.log_q,
                                 depth.clamp_min(1))  # [B, gamma]
        logits = s.target(torch.cat([s.last_token, y], 1))  # [B, gamma+1, V]
        tokens, eta, length, beam, kept = s.kernels(
            mtad_accept, logits, y, cum_log_q, depth, beams.seqs, s.uniform(s.batch, 1),
            prm.log_tau, *warp.args)
        beams.keep(s.draft, beam)  # the draft cache holds y*_1..y*_kept
        return StepResult(tokens, lens, eta, length, s.lengths_on_device() + kept, depth=lens)


def mtad_accept(logits: torch.Tensor, y: torch.Tensor, cum_log_q: torch.Tensor,
                depth: torch.Tensor, seqs: torch.Tensor, u_next: torch.Tensor, log_tau: float,
                temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, ...]:
    """Kernel: the verify's warped p (``logits [B, gamma+1, V]``), MTAD's rule on y*
    (`mtad_verify_u`), the block, and the final beam (of ``seqs [B, W, gamma]``) whose draft
    cache to keep with the length it shares with the emitted draft: ``(tokens [B, gamma+1], eta,
    length, beam, kept [B])``."""
    p = warp_probs(logits, temperature, top_k, top_p)
    eta, nxt = mtad_verify_u(p, y, cum_log_q, log_tau, u_next, depth)
    tokens, length = block_tokens(y, eta, nxt)
    beam, kept = closest_beam(seqs, y, eta)
    return tokens, eta, length, beam, kept


def mtad_verify(p: torch.Tensor, y: torch.Tensor, cum_log_q: torch.Tensor, log_tau: float,
                generator: torch.Generator | None = None, depth: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """MTAD verification of one draft, or of B (leading ``[B]`` dims).

    p: ``[..., gamma+1, V]`` warped target after each draft prefix; y: ``[..., gamma]`` draft
    tokens; cum_log_q: ``[..., gamma]`` cumulative warped draft log-prob of y_1..y_j; depth
    ``[...]``: only y_1..y_depth are a draft (default: all gamma). Returns ``(eta, next)``, each
    ``[...]``: the accepted length and a token sampled from p after y_1..y_eta.
    """
    u = uniforms(sample_shape(p[..., 0, :]), generator, p.device)
    return mtad_verify_u(p, y, cum_log_q, log_tau, u, depth)


def mtad_verify_u(p: torch.Tensor, y: torch.Tensor, cum_log_q: torch.Tensor, log_tau: float,
                  u_next: torch.Tensor, depth: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`mtad_verify` with the next token's uniforms ``u_next`` given (`sample_u`'s)."""
    gamma = y.shape[-1]
    log_q = torch.diff(cum_log_q, prepend=torch.zeros_like(cum_log_q[..., :1]))  # log ~q(y_i)
    log_p = p[..., :gamma, :].gather(-1, y[..., None]).squeeze(-1).log()
    if depth is not None:  # positions past a row's own draft never pass
        past = torch.arange(gamma, device=y.device) >= depth[..., None]
        log_p = log_p.masked_fill(past, float("-inf"))
    eta = joint_accept_length(log_p, log_q, log_tau)
    at = eta[..., None, None].expand(*eta.shape, 1, p.shape[-1])
    return eta, sample_u(p.gather(-2, at).squeeze(-2), u_next)
