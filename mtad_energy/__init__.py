"""mtad-energy: which decoding algorithm is fastest, best and cheapest in joules, and why.

Public API (imported lazily so ``import mtad_energy.measure`` stays light)::

    pair = mtad_energy.load_pair("smollm2")           # or target=..., draft=...
    gen = mtad_energy.generate("mtad", pair, "Write a haiku", max_new_tokens=64, tau=0.5)
    gens = mtad_energy.generate("spd", pair, ["one", "two"], batch_size=2)  # 2 rows per forward

The packages, one concept each (imports go one way; README "Layout", CONTRIBUTING.md):
``decoding`` (the algorithms and the one decode loop), ``models`` (pairs and draft heads),
``measure`` (meters, windows, the Yang et al. protocol, the environment), ``energy`` (the energy
model: counted work, fits, attribution), ``engines`` (vLLM, llama.cpp under the same instrument),
``bench`` (the runner and the sweeps: the only place decoding meets measure), ``results`` (the
store and what reads it), ``cli`` (the command line).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_pair": "mtad_energy.models",
    "ModelPair": "mtad_energy.models",
    "ALIASES": "mtad_energy.models",
    "generate": "mtad_energy.decoding",
    "generate_rows": "mtad_energy.decoding",
    "get_decoder": "mtad_energy.decoding",
    "DECODERS": "mtad_energy.decoding",
    "Generation": "mtad_energy.decoding",
    "Warp": "mtad_energy.decoding",
    "load_results": "mtad_energy.results",
    "ResultStore": "mtad_energy.results",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mtad_energy' has no attribute {name!r}")
