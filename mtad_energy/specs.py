"""What a run names: a decoder by registry name with its parameters (`DecoderSpec`), a model pair
(`ModelSpec`), and whether a model spec holds random weights (`random_weights`, `RANDOM_NOTE`).

Plain values, importable from anywhere (the engines and the results read them; the run
configuration in `mtad_energy.config` holds them). Nothing here loads or builds anything: a
decoder is built from its spec by `decoding.registry.build_decoder`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderSpec:
    """A decoder by registry name with parameter overrides (values as given: str or typed)."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str, **params: Any) -> DecoderSpec:
        return cls(name, tuple(sorted(params.items())))

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def label(self) -> str:
        if not self.params:
            return self.name
        return f"{self.name}(" + ",".join(f"{k}={v}" for k, v in self.params) + ")"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.param_dict}


RANDOM_NOTE = ("random weights at real shapes (random:SHAPE): time and energy per forward are "
               "real; acceptance, block efficiency and quality are not")


def random_weights(spec: Any) -> bool:
    """Whether a model spec holds random weights: a ``random:SHAPE`` model, or a draft spec
    naming random heads (``eagle:random``, ``eagle:random-v1``, ``medusa:random``; comma-joined
    with others, as ``--draft`` and a row's ``draft_id`` are)."""
    parts = [p.strip() for p in str(spec or "").split(",")] if isinstance(spec, str) else []
    return any(p.startswith("random:") or p.partition(":")[2].startswith("random") for p in parts)


@dataclass(frozen=True)
class ModelSpec:
    alias: str | None = "smollm2"
    target: str | None = None
    draft: str | None = None
    device: str = "auto"
    dtype: str | None = None

    @property
    def label(self) -> str:
        """The alias; a ``random:SHAPE`` target without one is named by its shape (random
        weights are never pooled with a real model's rows), any other "custom"."""
        if self.alias:
            return self.alias
        return self.target if self.target and self.target.startswith("random:") else "custom"
