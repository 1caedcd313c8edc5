"""Meter selection by name, and `auto` detection of the best meter on this machine."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtad_energy.measure.base import EnergyMeter, MeterUnavailableError
from mtad_energy.measure.none import NoneMeter
from mtad_energy.measure.rapl import POWERCAP_ROOT

METER_NAMES = ("auto", "nvml-counter", "nvml-power", "zeus", "rapl", "none", "simulated")

AUTO_ORDER = ("nvml-counter", "nvml-power", "zeus", "rapl")
"""Best first: the GPU energy counter (exact, cheap), polled GPU power (pre-Volta GPUs), Zeus
(same NVML counter through Zeus), CPU RAPL (no GPU). `none` is the fallback, `simulated` is
never chosen automatically."""


def _build(name: str, kwargs: Mapping[str, Any]) -> EnergyMeter:
    if name == "nvml-counter":
        from mtad_energy.measure.nvml import NvmlCounterMeter

        return NvmlCounterMeter(**kwargs)
    if name == "nvml-power":
        from mtad_energy.measure.nvml import NvmlPowerMeter

        return NvmlPowerMeter(**kwargs)
    if name == "zeus":
        from mtad_energy.measure.zeus_meter import ZeusMeter

        return ZeusMeter(**kwargs)
    if name == "rapl":
        from mtad_energy.measure.rapl import RaplMeter

        return RaplMeter(**kwargs)
    if name == "none":
        return NoneMeter(**kwargs)
    if name == "simulated":
        from mtad_energy.measure.simulated import SimulatedMeter

        return SimulatedMeter(**kwargs)
    raise ValueError(f"unknown meter {name!r}; choose from {', '.join(METER_NAMES)}")


@dataclass(frozen=True)
class MeterChoice:
    """What `select_meter` picked, why, and why each other candidate was not chosen."""

    meter: EnergyMeter
    name: str
    reason: str
    rejected: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        lines = [f"meter: {self.name} ({self.reason})"]
        lines += [f"  not {n}: {why}" for n, why in self.rejected]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "reason": self.reason,
            "rejected": [list(r) for r in self.rejected],
        }


def select_meter(
    env: Mapping[str, str] | None = None,
    rapl_root: Path = POWERCAP_ROOT,
    builders: Mapping[str, Callable[[], EnergyMeter]] | None = None,
) -> MeterChoice:
    """Try the meters in `AUTO_ORDER` and return the first that works, with the reasons.

    Args:
        env: environment for CUDA_VISIBLE_DEVICES (default `os.environ`).
        rapl_root: powercap directory.
        builders: override how a candidate is built (tests); name -> zero-argument factory.
    """
    factories: dict[str, Callable[[], EnergyMeter]] = {
        "nvml-counter": lambda: _build("nvml-counter", {"env": env}),
        "nvml-power": lambda: _build("nvml-power", {"env": env}),
        "zeus": lambda: _build("zeus", {"env": env}),
        "rapl": lambda: _build("rapl", {"root": rapl_root}),
    }
    factories.update(builders or {})
    rejected: list[tuple[str, str]] = []
    nvml_down = False
    for name in AUTO_ORDER:
        if name == "zeus" and nvml_down:
            rejected.append((name, "skipped: Zeus measures through NVML too, which failed above"))
            continue
        try:
            meter = factories[name]()
        except MeterUnavailableError as err:
            rejected.append((name, str(err)))
            nvml_down = nvml_down or name.startswith("nvml")
            continue
        if name == "zeus" and not meter.devices:
            rejected.append((name, "Zeus found no GPU"))
            continue
        rest = [n for n in AUTO_ORDER if n != name and n not in dict(rejected)]
        rejected += [(n, f"lower priority than {name}") for n in rest]
        rejected.append(("simulated", "never chosen automatically (it simulates a sensor)"))
        return MeterChoice(meter, name, _why(name, meter), tuple(rejected))
    reason = no_meter_reason(rejected)
    rejected.append(("simulated", "never chosen automatically (it simulates a sensor)"))
    return MeterChoice(NoneMeter(reason=reason), "none", reason, tuple(rejected))


def no_meter_reason(rejected: Sequence[tuple[str, str]]) -> str:
    """Why `auto` fell back to no energy, short enough for every error, row and footnote: one
    sentence per distinct cause (NVML, RAPL: the first sentence of each rejection), where the full
    text is (`mtad-energy env`) and how to get modelled joules anyway (`--meter simulated`)."""
    causes: list[str] = []
    for _, why in rejected:
        first = why.split("; ")[0].split(". ")[0].rstrip(".")
        if not why.startswith("skipped:") and first not in causes:
            causes.append(first)
    # one clause (no "; " or ". "): tables keep a reason's first clause (`short_reason`)
    return (f"no energy meter here: {', and '.join(causes) or 'no GPU meter and no RAPL'}, so "
            "energy is null (`--meter simulated` models a GPU, `mtad-energy env` says why in full)")


def _why(name: str, meter: EnergyMeter) -> str:
    devices = ", ".join(meter.devices) or "no device"
    return {
        "nvml-counter": f"NVML total-energy counter on {devices}",
        "nvml-power": f"NVML power polling on {devices} (no energy counter)",
        "zeus": f"Zeus on {devices}",
        "rapl": f"CPU RAPL counters ({devices}); no GPU meter available",
    }[name]


def energy_unavailable(meter: EnergyMeter) -> str | None:
    """Why ``meter`` cannot measure energy here, or None when it can (`simulated` can: it models
    a sensor, and its readings are marked as simulated wherever they are shown)."""
    if meter.name == "none":
        return str(getattr(meter, "reason", None) or "meter 'none' measures time only")
    if not meter.devices:
        if meter.name == "zeus":
            return ("Zeus found no GPU to measure (no usable NVIDIA/AMD driver, or "
                    "CUDA_VISIBLE_DEVICES hides every GPU)")
        return f"meter {meter.name!r} found no device to measure"
    return None


def get_meter(name: str = "auto", **kwargs: Any) -> EnergyMeter:
    """Build a meter by name (see `METER_NAMES`); ``"auto"`` picks the best available.

    Keyword arguments go to the backend's constructor (for ``"auto"``: to `select_meter`).
    Raises `MeterUnavailableError` with the reason when a named meter cannot run here.
    """
    if name == "auto":
        return select_meter(**kwargs).meter
    return _build(name, kwargs)


def meter_for(name: str) -> tuple[EnergyMeter, str]:
    """The meter ``--meter NAME`` gives and why it is that one (``auto``: `select_meter`'s reason)."""
    if name == "auto":
        choice = select_meter()
        return choice.meter, choice.reason
    return get_meter(name), f"asked for {name}"
