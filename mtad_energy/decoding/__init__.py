"""Decoding algorithms over Hugging Face causal LMs. ``DECODERS`` is the registry."""

from mtad_energy.decoding.base import Decoder, DecoderParams, DecodeState, StepResult
from mtad_energy.decoding.generate import Generation, GenerationStats, generate, generate_rows
from mtad_energy.decoding.registry import DECODERS, get_decoder, param_specs
from mtad_energy.decoding.sampling import Warp, warp_probs

__all__ = ["DECODERS", "Decoder", "DecoderParams", "DecodeState", "Generation", "GenerationStats",
           "StepResult", "Warp", "generate", "generate_rows", "get_decoder", "param_specs",
           "warp_probs"]
