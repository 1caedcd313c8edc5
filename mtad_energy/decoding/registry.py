"""The decoder registry: a plain dict from name to class, parameter validation, and the one
construction of a decoder from its spec (`build_decoder`).

A decoder's parameters are read here only (`param_types`): the command line's ``--set``
(`cli.options.decoder_specs`), the engines' refusal of a parameter hf lacks and the
batch sweep's variants all ask this module, never the ``Params`` class itself."""

from __future__ import annotations

import dataclasses
import itertools
import typing
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from mtad_energy.decoding.decoders.ar import Multinomial
from mtad_energy.decoding.decoders.beam import Beam
from mtad_energy.decoding.decoders.bild import Bild
from mtad_energy.decoding.decoders.eagle import Eagle
from mtad_energy.decoding.decoders.mcss import Mcss
from mtad_energy.decoding.decoders.medusa import Medusa
from mtad_energy.decoding.decoders.mmtad import Mmtad
from mtad_energy.decoding.decoders.mtad import Mtad
from mtad_energy.decoding.decoders.mtjd import Mtjd
from mtad_energy.decoding.decoders.pld import PromptLookup
from mtad_energy.decoding.decoders.spd import SpeculativeDecoding
from mtad_energy.decoding.decoders.specinfer import SpecInfer
from mtad_energy.decoding.decoders.spectr import Spectr
from mtad_energy.decoding.decoders.typical import Typical
from mtad_energy.decoding.runtime.decoder import Decoder

if TYPE_CHECKING:  # types only
    from mtad_energy.specs import DecoderSpec

DECODERS: dict[str, type[Decoder]] = {
    "ar": Multinomial,
    "beam": Beam,
    "mtjd": Mtjd,
    "spd": SpeculativeDecoding,
    "mtad": Mtad,
    "mmtad": Mmtad,
    "specinfer": SpecInfer,
    "mcss": Mcss,
    "spectr": Spectr,
    "bild": Bild,
    "typical": Typical,
    "pld": PromptLookup,
    "medusa": Medusa,
    "eagle": Eagle,
}


TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def coerce(value: Any, kind: type, name: str) -> Any:
    """Turn CLI strings ('0.3', 'true', '4,2,2') into the parameter's type: the one conversion of
    decoder parameters and engine settings (`engines.registry` words its own refusal); ValueError
    naming ``name`` where the string is not one."""
    if not isinstance(value, str):
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value
    try:
        if kind is bool:
            if value.lower() in TRUE:
                return True
            if value.lower() in FALSE:
                return False
            raise ValueError(value)
        if typing.get_origin(kind) is tuple:
            (item, *_) = typing.get_args(kind)
            return tuple(item(v) for v in value.split(",") if v.strip())
        return kind(value)
    except ValueError:
        raise ValueError(f"parameter {name}={value!r} is not a valid {getattr(kind, '__name__', kind)}"
                         ) from None


def param_specs(cls: type[Decoder]) -> list[dict[str, Any]]:
    """Name, type, default and help of every parameter of a decoder class."""
    hints = typing.get_type_hints(cls.Params)
    return [{"name": f.name, "type": getattr(hints[f.name], "__name__", str(hints[f.name])),
             "default": f.default, "help": f.metadata.get("help", "")}
            for f in dataclasses.fields(cls.Params)]


def param_types(name: str) -> dict[str, Any]:
    """Parameter name -> type of registered decoder ``name`` (empty for a name not registered:
    refused where the decoder is built)."""
    return typing.get_type_hints(DECODERS[name].Params) if name in DECODERS else {}


def check_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` of decoder ``name`` as typed keyword arguments of its ``Params`` (strings
    coerced, `coerce`): the one type check of a decoder's parameters. ValueError naming an
    unknown decoder, an unknown parameter, or a value not of its type."""
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; available: {', '.join(DECODERS)} "
                         "(`mtad-energy decoders` lists their parameters)")
    hints = param_types(name)
    unknown = sorted(set(params) - set(hints))
    if unknown:
        raise ValueError(f"decoder {name!r} has no parameter {', '.join(unknown)}; its parameters "
                         f"are: {', '.join(hints)}")
    return {k: coerce(v, hints[k], k) for k, v in params.items()}


def get_decoder(name: str, **params: Any) -> Decoder:
    """A decoder by registry name, with validated parameters (strings are coerced, `check_params`;
    the ``Params`` class checks their values)."""
    kwargs = check_params(name, params)  # refuses an unknown name first
    return DECODERS[name](DECODERS[name].Params(**kwargs))


def build_decoder(spec: DecoderSpec) -> Decoder:
    """The one construction of a decoder from its spec (every engine, command and check that
    needs the decoder itself calls it): a bad name, parameter or value is a
    ValueError naming it."""
    return get_decoder(spec.name, **spec.param_dict)


def expand_variants(specs: Sequence[DecoderSpec]) -> list[DecoderSpec]:
    """One decoder per value of a comma list given to a scalar parameter (``--set gamma=1,2,3,5``:
    spd(gamma=1), ..., spd(gamma=5); several such parameters: their grid). A tuple-valued
    parameter (specinfer's ``branching=4,2,2``) keeps its comma list as one value. A spec listed
    twice (or a value twice) runs once."""
    out: list[DecoderSpec] = []
    for spec in specs:
        hints = param_types(spec.name)
        axes = []
        for key, value in spec.params:
            scalar = typing.get_origin(hints.get(key)) is not tuple and hints.get(key) is not tuple
            if isinstance(value, str) and "," in value and scalar:
                axes.append([(key, v.strip()) for v in value.split(",") if v.strip()])
            else:
                axes.append([(key, value)])
        out += [type(spec).of(spec.name, **dict(combo)) for combo in itertools.product(*axes)]
    return list(dict.fromkeys(out))


def batched_names() -> str:
    """The registry decoders that decode B rows at once, as a comma list (for messages)."""
    return ", ".join(n for n, c in DECODERS.items() if c.batched)


def check_batched(decoders: Iterable[Decoder | type[Decoder]]) -> None:
    """Raise ValueError naming the decoders that cannot decode batches of B > 1 rows."""
    slow = [d.name for d in decoders if not d.batched]
    if slow:
        raise ValueError(f"decoder(s) {', '.join(slow)} do not decode batches yet; decoders that "
                         f"do: {batched_names()}; use batch size 1 for them")


def head_kinds(decoders: Iterable[Decoder | type[Decoder]]) -> tuple[str, ...]:
    """The kinds of draft head (``"eagle"``, ``"medusa"``) the decoders run: what `load_pair`
    must load of an alias's heads (``heads=``)."""
    return tuple(dict.fromkeys(d.head for d in decoders if d.head is not None))
