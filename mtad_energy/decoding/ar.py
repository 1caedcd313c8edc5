"""Multinomial sampling from the warped target (temperature 0 = greedy)."""

from __future__ import annotations

from mtad_energy.decoding.base import Decoder, DecoderParams, DecodeState, StepResult, target_step


class Multinomial(Decoder):
    name = "ar"
    help = "autoregressive multinomial sampling from warped p (temperature 0 = greedy)"
    Params = DecoderParams
    batched = True

    def step(self, s: DecodeState) -> StepResult:
        return target_step(s, self.params.warp)
