"""Multi-token joint decoding (MTJD), approximated as in the paper: each iteration runs beam sampling
with the *target* for K tokens and emits the beam with the highest joint likelihood.

With W=1 beam sampling is exact ancestral sampling from the joint ~p; larger W moves the emitted
block towards the joint argmax. K=1 is multinomial sampling (``ar``) whatever W.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtad_energy.decoding.runtime.beams import beam_sample_rows
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.params import DecoderParams, param, require, require_beam_width
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult


@dataclass(frozen=True)
class MtjdParams(DecoderParams):
    k: int = param(4, "tokens decoded jointly per iteration (K)")
    beam_width: int = param(4, "W beams approximating the joint argmax/sample")
    stochastic: bool = param(True, "sample beams by joint ~p; false = deterministic top W")

    def validate(self) -> None:
        require(self.k >= 1, f"k must be >= 1, got {self.k}")
        require_beam_width(self.beam_width)


class Mtjd(Decoder):
    name = "mtjd"
    help = "multi-token joint decoding: K-token beam sampling with the target per iteration"
    Params = MtjdParams
    batched = True

    def cache_rows(self, role: str) -> int:
        return self.params.beam_width if role == "target" and self.params.k > 1 else 1

    def step(self, s: DecodeState) -> StepResult:
        p = self.params
        # K=1 is multinomial sampling (the paper): one token drawn from ~p, no beam to pick from
        width = 1 if p.k == 1 else p.beam_width
        beams = beam_sample_rows(s.target, s.last_token, min(p.k, s.remaining), width, p.warp,
                                 s.generator, p.stochastic, s.eos_token_id, calls=s.calls)
        beams.keep(s.target, beams.best)
        # a row with fewer tokens left decodes them jointly: its best beam at its own depth
        return StepResult(beams.best_at(s.row_depths(min(p.k, s.remaining)))[0])
