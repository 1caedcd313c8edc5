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

from mtad_energy.decoding.rules.beam import beam_rows, best_at, closest_beam
from mtad_energy.decoding.rules.joint import joint_accept_u
from mtad_energy.decoding.rules.sampling import warp_probs
from mtad_energy.decoding.runtime.beams import beam_sample_rows
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.params import DecoderParams, param, require, require_beam_width
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult, block_out, block_tokens


@dataclass(frozen=True)
class MtadParams(DecoderParams):
    gamma: int = param(4, "draft length (beam depth)")
    beam_width: int = param(4, "W draft beams")
    tau: float = param(0.5, "acceptance threshold on the joint ratio p/q, in (0, 1)")

    def validate(self) -> None:
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")
        require_beam_width(self.beam_width)
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
        # y*: each row's best beam at its own depth (what its search alone would end with; read
        # off the tree with the search); a row with no draft of its own (one token left) accepts
        # nothing: its token is from p
        depth = s.on_device(lens)  # [B]
        beams = beam_sample_rows(s.draft, pending, gamma, prm.beam_width, warp, s.generator,
                                 counts=counts, calls=s.calls, finish=mtad_finish,
                                 finish_args=(depth,))
        y, cum_log_q, seqs = beams.finished  # [B, gamma], [B, gamma], [B, W, gamma]
        # logits [B, gamma+1, V] -> the block and the beam to keep (compiled: one graph call)
        row, recent, read = s.target.verify(
            s.calls, torch.cat([s.last_token, y], 1), mtad_verify, y, cum_log_q, depth, seqs,
            s.uniform(s.batch, 1), s.recent, prm.log_tau, *warp.args)
        beams.keep_rows(s.draft, row)  # the draft cache holds y*_1..y*_kept
        return StepResult.from_read(read, recent, ("accepted", "length", "draft_kept"),
                                    proposed=lens, depth=lens)


def mtad_finish(tokens: torch.Tensor, parents: torch.Tensor, log_q: torch.Tensor,
                seqs: torch.Tensor, path_log_q: torch.Tensor, depth: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel: what MTAD reads of its beam search (`beams.BeamDraft`'s fields, the search's
    ``finish``): y*, each row's best beam at its own depth ``depth [B]`` (at least 1: a row
    with no draft of its own reads its first beam; `best_at`), its
    cumulative log ~q, and the final beams: ``(y [B, gamma], cum_log_q [B, gamma], seqs [B, W,
    gamma])``, what its verify reads. (The row's last token stays out of the graph: a slice of
    the ids would bring their buffer's strides into its guards.)"""
    return (*best_at(tokens, parents, log_q, depth.clamp_min(1)), seqs)


def mtad_verify(logits: torch.Tensor, y: torch.Tensor, cum_log_q: torch.Tensor,
                depth: torch.Tensor, seqs: torch.Tensor, u_next: torch.Tensor,
                recent: torch.Tensor, log_tau: float, temperature: float, top_k: int,
                top_p: float) -> tuple[torch.Tensor, ...]:
    """Kernel: the verify's warped p (``logits [B, gamma+1, V]``), MTAD's rule on y*
    (`joint_accept_u`), the block, and the final beam (of ``seqs [B, W, gamma]``) whose draft
    cache to keep, as its cache row (`beam_rows`), with the length it shares with the emitted
    draft: ``(tokens [B, gamma+1], eta, length, row [B], recent, read)`` (`block_out`; kept
    [B] in ``read`` only)."""
    p = warp_probs(logits, temperature, top_k, top_p)
    eta, nxt = joint_accept_u(p, y, cum_log_q, log_tau, u_next, depth)
    tokens, length = block_tokens(y, eta, nxt)
    beam, kept = closest_beam(seqs, y, eta)
    return (tokens, eta, length, beam_rows(beam, seqs.shape[1]),
            *block_out(tokens, length, recent, eta, length, kept))
