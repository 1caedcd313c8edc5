"""Beam sampling with the target over the whole output."""

from __future__ import annotations

from dataclasses import dataclass

from mtad_energy.decoding.runtime.beams import beam_sample_rows
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.params import DecoderParams, param, require_beam_width
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult


@dataclass(frozen=True)
class BeamParams(DecoderParams):
    beam_width: int = param(4, "W beams")
    stochastic: bool = param(True, "sample (beam, token) pairs by joint ~p; false = keep top W")

    def validate(self) -> None:
        require_beam_width(self.beam_width)


class Beam(Decoder):
    name = "beam"
    help = "beam sampling with the target over the whole output; emits the most likely beam"
    Params = BeamParams
    batched = True

    def cache_rows(self, role: str) -> int:
        return self.params.beam_width if role == "target" else 1

    def step(self, s: DecodeState) -> StepResult:
        p = self.params
        beams = beam_sample_rows(s.target, s.last_token, s.remaining, p.beam_width, p.warp,
                                 s.generator, p.stochastic, s.eos_token_id, calls=s.calls)
        beams.keep(s.target, beams.best)
        # each row's most likely beam over its own remaining length (a batch searches to the
        # longest row's; a search is sequential, so a shorter row's beams are those at its end)
        return StepResult(beams.best_at(s.row_depths(s.remaining))[0])
