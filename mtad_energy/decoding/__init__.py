"""Decoding algorithms over Hugging Face causal LMs. ``DECODERS`` is the registry."""

from mtad_energy.decoding.registry import DECODERS, get_decoder, param_specs
from mtad_energy.decoding.rules.sampling import Warp, warp_probs
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.generate import generate, generate_rows
from mtad_energy.decoding.runtime.params import DecoderParams
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.stats import Generation, GenerationStats
from mtad_energy.decoding.runtime.step import StepResult

__all__ = ["DECODERS", "Decoder", "DecoderParams", "DecodeState", "Generation", "GenerationStats",
           "StepResult", "Warp", "generate", "generate_rows", "get_decoder", "param_specs",
           "warp_probs"]
