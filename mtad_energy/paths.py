"""Where the project keeps what it makes once and reuses: converted models, measured device peaks,
calibration records."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "MTAD_ENERGY_CACHE"


def cache_dir() -> Path:
    """$MTAD_ENERGY_CACHE, else $XDG_CACHE_HOME/mtad_energy, else ~/.cache/mtad_energy."""
    if override := os.environ.get(CACHE_ENV_VAR):
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mtad_energy"
