"""Measurement records, the `EnergyMeter` protocol and the `window()` context manager.

Units: seconds (`*_s`), joules (`*_j`), watts (`*_w`). Timestamps come from the meter's clock
(by default `time.perf_counter`, a monotonic clock in seconds) unless a field says otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, runtime_checkable

Clock = Callable[[], float]
"""A clock returning seconds (monotonic). Injected so tests can run on simulated time."""

SyncFn = Callable[[], None]
"""Blocks until queued device work is done (e.g. `torch.cuda.synchronize`)."""

# Flag codes. A flag marks a number that is present but doubtful, or a reason it is missing.
FLAG_SHORT_WINDOW = "short-window"
FLAG_COUNTER_WRAP = "counter-wrap"
FLAG_COUNTER_RESET = "counter-reset"
FLAG_MISSING_DEVICE = "missing-device"
FLAG_POWER_FALLBACK = "power-fallback"
FLAG_DEVICE_ORDER = "device-order"
FLAG_FEW_SAMPLES = "few-samples"
FLAG_ZERO_ENERGY = "zero-energy"
FLAG_BELOW_MIN_WINDOW = "below-calibrated-min"


class MeasureError(RuntimeError):
    """Base class for measurement errors."""


class MeterUnavailableError(MeasureError):
    """The requested meter cannot run on this machine; the message says why and what to do."""


class MigNotSupportedError(MeterUnavailableError):
    """A measured GPU is in MIG mode; NVML cannot attribute power to a MIG slice."""


@dataclass(frozen=True)
class Flag:
    """Something doubtful about a measurement: a stable `code` and a human `message`."""

    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True)
class PowerSample:
    """One power reading of one device at `timestamp_s` (meter clock, seconds)."""

    device: str
    timestamp_s: float
    power_w: float

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "timestamp_s": self.timestamp_s, "power_w": self.power_w}


@dataclass(frozen=True)
class Measurement:
    """Time and energy of one measurement window.

    Attributes:
        name: window name given to `window()`.
        meter: backend name that produced it (e.g. ``"nvml-counter"``).
        time_s: wall time of the window (seconds).
        start_timestamp_s / end_timestamp_s: window ends on the meter clock (seconds).
        energy_j: total energy over all measured devices (joules), or None with `reason`.
        device_energy_j: energy per device (joules; None for a device that could not be read).
        power_w: mean power, energy_j / time_s (watts), or None.
        samples: power samples when the backend polls (empty otherwise).
        flags: anything doubtful (short window, counter wrap, missing device, fallback field).
        reason: why energy_j is None (None when energy_j is a number).
    """

    name: str
    meter: str
    time_s: float
    start_timestamp_s: float
    end_timestamp_s: float
    energy_j: float | None
    device_energy_j: Mapping[str, float | None] = field(default_factory=dict)
    samples: tuple[PowerSample, ...] = ()
    flags: tuple[Flag, ...] = ()
    reason: str | None = None

    @property
    def power_w(self) -> float | None:
        """Mean power over the window in watts (None without energy or time)."""
        if self.energy_j is None or self.time_s <= 0:
            return None
        return self.energy_j / self.time_s

    @property
    def flag_codes(self) -> tuple[str, ...]:
        return tuple(f.code for f in self.flags)

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        """JSON-ready dict. Samples are left out unless asked for (they can be large)."""
        out: dict[str, Any] = {
            "name": self.name,
            "meter": self.meter,
            "time_s": self.time_s,
            "start_timestamp_s": self.start_timestamp_s,
            "end_timestamp_s": self.end_timestamp_s,
            "energy_j": self.energy_j,
            "power_w": self.power_w,
            "device_energy_j": dict(self.device_energy_j),
            "flags": [f.to_dict() for f in self.flags],
            "reason": self.reason,
            "n_samples": len(self.samples),
        }
        if with_samples:
            out["samples"] = [s.to_dict() for s in self.samples]
        return out


def total_energy(
    device_energy_j: Mapping[str, float | None],
) -> tuple[float | None, str | None]:
    """Sum per-device energies; any missing device makes the total None (a partial sum misleads)."""
    if not device_energy_j:
        return None, "no device was measured"
    missing = [d for d, e in device_energy_j.items() if e is None]
    if missing:
        return None, f"energy missing for device(s) {', '.join(missing)}; see flags"
    return float(sum(e for e in device_energy_j.values() if e is not None)), None


def short_window_flag(meter: str, time_s: float, update_period_s: float | None) -> list[Flag]:
    """A `FLAG_SHORT_WINDOW` flag when a window is shorter than the sensor's update period."""
    if update_period_s is None or time_s >= update_period_s:
        return []
    return [
        Flag(
            FLAG_SHORT_WINDOW,
            f"window of {time_s:.6g} s is shorter than the {meter} sensor update period "
            f"({update_period_s:g} s), so its energy is unreliable; measure a longer window or "
            "repeat the workload with measure.mitigation.",
        )
    ]


def device_measurement(
    key: str,
    meter: str,
    start_s: float,
    end_s: float,
    device_energy_j: Mapping[str, float | None],
    flags: list[Flag],
    *,
    time_s: float | None = None,
    samples: tuple[PowerSample, ...] = (),
    reason: str | None = None,
) -> Measurement:
    """A window's `Measurement` from per-device energies: the total is their sum, or None with
    the reason (``reason`` overrides the generic one) when a device is missing."""
    energy, why = total_energy(device_energy_j)
    return Measurement(
        name=key,
        meter=meter,
        time_s=end_s - start_s if time_s is None else time_s,
        start_timestamp_s=start_s,
        end_timestamp_s=end_s,
        energy_j=energy,
        device_energy_j=dict(device_energy_j),
        samples=samples,
        flags=tuple(flags),
        reason=None if energy is not None else (reason or why),
    )


class MeterBase:
    """What every meter shares: a no-op `close` and use as a context manager that closes it."""

    def close(self) -> None:
        """Nothing to release unless a backend overrides it."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@runtime_checkable
class EnergyMeter(Protocol):
    """A source of window energy readings.

    A meter is opened once (in its constructor), measures any number of named windows, and is
    closed with `close()` (or used as a context manager). `begin_window`/`end_window` do not
    synchronise the device; `window()` does.
    """

    name: str
    """Backend name, e.g. ``"nvml-counter"``."""

    @property
    def devices(self) -> tuple[str, ...]:
        """Names of the measured devices (e.g. ``("gpu0",)``)."""
        ...

    @property
    def update_period_s(self) -> float | None:
        """Sensor update period in seconds (None if unknown or not applicable)."""
        ...

    def now(self) -> float:
        """Current time on the meter clock (seconds)."""
        ...

    def begin_window(self, key: str) -> None: ...

    def end_window(self, key: str) -> Measurement: ...

    def close(self) -> None: ...


@dataclass
class WindowHandle:
    """What `window()` yields; `measurement` is filled in when the block exits (also on error)."""

    name: str
    measurement: Measurement | None = None

    def result(self) -> Measurement:
        if self.measurement is None:
            raise MeasureError(
                f"window {self.name!r} is still open; read .measurement after the with-block"
            )
        return self.measurement


def no_sync() -> None:
    """A sync function for CPU-only work (nothing to wait for)."""


def default_sync() -> SyncFn:
    """`torch.cuda.synchronize` when torch is already imported and CUDA is up, else a no-op.

    Torch is not imported here: if the caller never imported it, no CUDA work can be queued.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_available() and cuda.is_initialized():
            return cuda.synchronize
    return no_sync


@contextmanager
def window(
    meter: EnergyMeter, name: str = "window", sync: SyncFn | None = None
) -> Iterator[WindowHandle]:
    """Measure the enclosed block with `meter`, synchronising the device at both ends.

    Usage::

        with window(meter, "generate") as w:
            run()
        print(w.measurement.energy_j)

    The window is always closed (and any polling thread stopped) in `finally`, also when the
    block raises; the measurement of a failed block is still attached to the handle.
    """
    sync_fn = default_sync() if sync is None else sync
    handle = WindowHandle(name)
    sync_fn()  # work queued before the window must not be billed to it
    meter.begin_window(name)
    try:
        yield handle
    finally:
        try:
            sync_fn()  # work queued inside the window must finish before it closes
        finally:
            handle.measurement = meter.end_window(name)


class WindowBook:
    """Start states of open windows by key (a helper for backends; one per meter instance)."""

    def __init__(self) -> None:
        self._open: dict[str, Any] = {}

    def open(self, key: str, state: Any) -> None:
        if key in self._open:
            raise MeasureError(
                f"measurement window {key!r} is already open; end it or use another name"
            )
        self._open[key] = state

    def close(self, key: str) -> Any:
        try:
            return self._open.pop(key)
        except KeyError:
            raise MeasureError(
                f"measurement window {key!r} is not open; call begin_window first"
            ) from None

    def __len__(self) -> int:
        return len(self._open)

