"""Multinomial sampling from the warped target (temperature 0 = greedy)."""

from __future__ import annotations

from mtad_energy.decoding.base import Decoder, DecoderParams, DecodeState, StepResult
from mtad_energy.decoding.sampling import sample


class Multinomial(Decoder):
    name = "ar"
    help = "autoregressive multinomial sampling from warped p (temperature 0 = greedy)"
    Params = DecoderParams

    def step(self, s: DecodeState) -> StepResult:
        p = self.params.warp.probs(s.target(s.last_token)[0, -1])  # [V]
        return StepResult(sample(p, s.generator)[None])
