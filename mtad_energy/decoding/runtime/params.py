"""The parameter contract every decoder's ``Params`` dataclass follows: `param` (a field with
its help), `DecoderParams` (the warp every decoder has) and `require` (validation)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from mtad_energy.decoding.rules.sampling import Warp


def param(default: Any, help: str, when: tuple[str, str] | None = None) -> Any:
    """A decoder parameter with its one-line help (shown by ``mtad-energy decoders``); ``when``
    (another parameter, its value): the mode it belongs to (EAGLE's ``branching`` is read only
    with ``tree=static``): set to other than its default in another mode, it is refused rather
    than silently ignored."""
    return field(default=default, metadata={"help": help, **({"when": when} if when else {})})


@dataclass(frozen=True)
class DecoderParams:
    """Parameters every decoder has: the warp applied to p (and q)."""

    temperature: float = param(1.0, "softmax temperature; 0 = greedy")
    top_k: int = param(10, "keep the k most likely tokens (0 = all)")
    top_p: float = param(0.9, "nucleus: drop a token once the mass before it exceeds top_p")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # NaN passes every comparison the range checks make
            value = getattr(self, f.name)
            require(not (isinstance(value, float) and math.isnan(value)),
                    f"{f.name} must be a number, got nan")
        require(math.isfinite(self.temperature),
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        self.warp  # noqa: B018 - validates the warp fields
        self.validate()
        self._refuse_ignored()

    def _refuse_ignored(self) -> None:
        """A parameter of a mode that is not selected (`param`'s ``when``), set to other than its
        default, would be ignored: refuse it, naming the mode that reads it."""
        for f in dataclasses.fields(self):
            when = f.metadata.get("when")
            if when is None or getattr(self, when[0]) == when[1] or getattr(self, f.name) == f.default:
                continue
            raise ValueError(f"{f.name} is read only with {when[0]}={when[1]}; with {when[0]}="
                             f"{getattr(self, when[0])} it would be ignored: add --set {when[0]}="
                             f"{when[1]}, or drop {f.name}")

    def validate(self) -> None:
        """Subclasses raise ValueError naming the parameter and its valid range."""

    @property
    def warp(self) -> Warp:
        return Warp(self.temperature, self.top_k, self.top_p)


MAX_BEAM_WIDTH = 1024  # beams (rows of the cache) per sequence: far past any useful width


def require_beam_width(width: int) -> None:
    """A beam width in [1, `MAX_BEAM_WIDTH`]: each beam is a row of the KV cache, so a width of
    10^5 would ask for gigabytes before the first token (the vocabulary bounds it too, checked
    where the pair is known: `generate.check_beams`)."""
    require(1 <= width <= MAX_BEAM_WIDTH,
            f"beam_width must be in [1, {MAX_BEAM_WIDTH}] (beams kept per sequence, each a row of "
            f"the KV cache), got {width}")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
