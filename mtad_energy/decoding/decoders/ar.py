"""Multinomial sampling from the warped target (temperature 0 = greedy)."""

from __future__ import annotations

from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.params import DecoderParams
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult


class Multinomial(Decoder):
    name = "ar"
    help = "autoregressive multinomial sampling from warped p (temperature 0 = greedy)"
    Params = DecoderParams
    batched = True

    def step(self, s: DecodeState) -> StepResult:
        return target_step(s, self.params.warp)
