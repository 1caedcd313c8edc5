"""Frozen run configurations that round-trip through JSON (what a sweep asked for, stored with it).

The decoder and model specs they hold are `mtad_energy.specs`' (imported by the engines and the
results too, which sit below this module); what an engine can honour is checked by the engine
registry (`engines.registry.check_run`) when a configuration is made.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from mtad_energy.specs import RANDOM_NOTE, DecoderSpec, ModelSpec, random_weights

__all__ = ["GPU_METERS", "MITIGATE_CHOICES", "RANDOM_NOTE", "DecoderSpec", "MeasureConfig",
           "ModelSpec", "NoEnergyError", "RunConfig", "compile_arg", "compile_identity",
           "compile_label", "random_weights"]

MITIGATE_CHOICES = ("auto", "on", "off")
# Meters whose part-time sensors need the Yang et al. protocol; "auto" mitigates only on these.
GPU_METERS = frozenset({"nvml-counter", "nvml-power", "zeus"})


class NoEnergyError(ValueError):
    """Energy was asked for (--require-energy, --mitigate on) but the meter measures none here."""


@dataclass(frozen=True)
class MeasureConfig:
    meter: str = "auto"
    mitigate: str = "auto"  # auto: on for GPU meters (part-time sensors) that measure energy here
    mitigation_repetitions: int = 32
    mitigation_min_s: float = 5.0
    require_energy: bool = False  # refuse to run (before loading a model) when no energy is measured

    def __post_init__(self) -> None:
        if self.mitigate not in MITIGATE_CHOICES:
            raise ValueError(f"mitigate must be one of {', '.join(MITIGATE_CHOICES)}, "
                             f"got {self.mitigate!r}")
        if self.mitigation_repetitions < 4:
            raise ValueError(f"mitigation_repetitions must be >= 4 (one per measured group), got "
                             f"{self.mitigation_repetitions}")

    def mitigates(self, meter_name: str) -> bool:
        return self.mitigate == "on" or (self.mitigate == "auto" and meter_name in GPU_METERS)

    def mitigation_for(self, meter) -> bool:
        """Whether to run the Yang et al. repetitions with ``meter`` (an `EnergyMeter`), checked
        before any model is loaded: without energy readings there is nothing to repeat for, so
        ``auto`` skips them; ``on`` and ``require_energy`` raise `NoEnergyError` naming the fix."""
        from mtad_energy.measure.select import energy_unavailable

        why = energy_unavailable(meter)
        if why is None:
            return self.mitigates(meter.name)
        if self.require_energy:
            raise NoEnergyError(
                f"--require-energy: meter {meter.name!r} cannot measure energy here ({why}); run on a "
                "machine it can measure (`mtad-energy env` shows the meter `auto` would pick), choose "
                "another --meter, or drop --require-energy to record time only")
        if self.mitigate == "on":
            raise NoEnergyError(
                f"--mitigate on repeats every generation to measure its energy, but meter "
                f"{meter.name!r} measures no energy here ({why}); use --mitigate auto or off, or a "
                "meter that measures energy (`mtad-energy env` shows which)")
        return False


def compile_label(backend: str | None = None, dynamic: bool = False) -> str:
    """What a compiled row's model label carries: ``+compile``, with the backend and dynamic
    shapes when asked for (``+compile-aot_eager-dynamic``): other kernels, never pooled."""
    return "+compile" + (f"-{backend}" if backend else "") + ("-dynamic" if dynamic else "")


def compile_identity(backend: str | None = None, dynamic: bool = False) -> dict[str, Any]:
    """A compiled row's key fields (rows compiled with the defaults keep their old keys)."""
    return {"compile": True, **({"compile_backend": backend} if backend else {}),
            **({"compile_dynamic": True} if dynamic else {})}


def check_compile_backend(backend: str) -> None:
    """Refuse a ``--compile-backend`` torch.compile does not have, before any model loads."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"--compile-backend {backend!r} is not a torch.compile backend here; "
                         f"choose one of {', '.join(known)} (default: inductor)")


def compile_arg(compile: bool, backend: str | None = None, dynamic: bool = False):
    """What `decoding.generate` takes: False (eager), True (the default compilation) or a
    `decoding.runtime.compiled.CompileOptions` with the backend / dynamo's automatic dynamic shapes."""
    if not compile:
        if backend or dynamic:
            raise ValueError("--compile-backend and --dynamic-shapes choose how --compile compiles: "
                             "add --compile, or drop them")
        return False
    if not backend and not dynamic:
        return True
    if backend:
        check_compile_backend(backend)
    from mtad_energy.decoding.runtime.compiled import CompileOptions

    return CompileOptions(backend=backend or "inductor", dynamic=None if dynamic else False)


@dataclass(frozen=True)
class RunConfig:
    """Everything `bench.runner.run_profile` needs; defaults give the one-minute CPU demo."""

    decoders: tuple[DecoderSpec, ...] = (DecoderSpec("mtad"),)
    model: ModelSpec = field(default_factory=ModelSpec)
    datasets: tuple[str, ...] = ("mtbench",)
    n_prompts: int = 3
    max_new_tokens: int = 32
    seed: int = 0
    repeats: int = 1
    chat: bool | None = None  # None: use the tokenizer's chat template when it has one
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    warmup: bool = True
    ops: bool = False  # also profile FLOPs/bytes of one generation per decoder (for `decompose`)
    allow_code_execution: bool = False  # HumanEval pass@1 runs generated code (sandboxed)
    sweep: str = "profile"
    compile: bool = False  # static KV cache + torch.compile forwards (CUDA graphs on CUDA)
    batch_size: int = 1  # prompts decoded together per set of forwards (generate_rows)
    compile_backend: str | None = None  # torch.compile's backend under compile (None: inductor)
    compile_dynamic: bool = False  # compile with dynamo's automatic dynamic shapes
    engine: str = "hf"  # what generates (`mtad_energy.engines`): hf = the project's own decoders
    # the engine's own settings (``--engine-option``; `EngineKind.settings`), sorted (key, value)
    engine_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.decoders:
            raise ValueError("give at least one decoder")
        if self.n_prompts < 1:
            raise ValueError(f"n_prompts must be >= 1, got {self.n_prompts}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.compile_backend or self.compile_dynamic:  # without --compile: refused, with
            compile_arg(self.compile, self.compile_backend, self.compile_dynamic)  # the fix
        from mtad_energy.engines.registry import check_run

        # what the engine cannot honour, refused before anything loads
        check_run(self.engine, self.decoders, self.batch_size, self.compile, self.ops,
                  dict(self.engine_options))

    @property
    def compile_arg(self):
        """`compile_arg` of this configuration (what the decoders' generate takes)."""
        return compile_arg(self.compile, self.compile_backend, self.compile_dynamic)

    @property
    def compile_label(self) -> str:
        return compile_label(self.compile_backend, self.compile_dynamic) if self.compile else ""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["decoders"] = [d.to_dict() for d in self.decoders]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, default=str)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        data = dict(data)
        data["decoders"] = tuple(DecoderSpec.of(d["name"], **d.get("params", {}))
                                 for d in data["decoders"])
        data["model"] = ModelSpec(**data["model"])
        data["measure"] = MeasureConfig(**data["measure"])
        data["datasets"] = tuple(data["datasets"])
        data["engine_options"] = tuple(tuple(kv) for kv in data.get("engine_options", ()))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(json.loads(text))
