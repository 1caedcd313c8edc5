"""Where the project keeps what it makes once and reuses: converted models, measured device peaks,
calibration records."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "MTAD_ENERGY_CACHE"


def env_folder(var: str) -> Path | None:
    """The folder ``$var`` names (None when unset or empty). Raises ValueError naming the
    variable and the fix when it names an existing file: every write under it would fail."""
    if not (value := os.environ.get(var)):
        return None
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"${var}={value} is a file, not a folder: point {var} at a folder "
                         "(it is made when missing) or unset it to use the default")
    return path


def cache_dir() -> Path:
    """$MTAD_ENERGY_CACHE, else $XDG_CACHE_HOME/mtad_energy, else ~/.cache/mtad_energy (a
    variable naming a file is refused, `env_folder`)."""
    if override := env_folder(CACHE_ENV_VAR):
        return override
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mtad_energy"
