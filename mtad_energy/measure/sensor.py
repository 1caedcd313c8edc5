"""A simulated GPU power sensor: a true power trace in, sensor readings out.

Model (Yang, Adamek & Armour, "Part-time power measurements: nvidia-smi's lack of attention",
2023): the sensor publishes a new value every `update_period_s`; a value is the mean of the
(optionally low-pass filtered) true power over the `window_s` seconds ending `delay_s` before the
update. A reading taken at time t returns the latest published value. With window 25 ms and
period 100 ms (A100/H100) the sensor sees only 25 % of the time, which is what makes naive
integration of periodic workloads wrong by tens of percent.

Traces are piecewise constant, so every integral here is exact (no quadrature error), which
lets tests assert tight error bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

RISE_TIME_TO_TAU = 1.0 / math.log(9.0)
"""A first-order response rises 10 % -> 90 % in tau * ln 9, so tau = rise_time * this."""


@dataclass(frozen=True)
class PowerProfile:
    """A power shape relative to its own start: piece i lasts `durations_s[i]` at `power_w[i]`.

    Used for one repetition of a workload (e.g. a periodic kernel pattern).
    """

    durations_s: tuple[float, ...]
    power_w: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.durations_s) != len(self.power_w) or not self.durations_s:
            raise ValueError("a PowerProfile needs one power per duration and at least one piece")
        if any(d < 0 for d in self.durations_s):
            raise ValueError("PowerProfile durations must be >= 0 s")

    @property
    def duration_s(self) -> float:
        return float(sum(self.durations_s))

    @property
    def energy_j(self) -> float:
        """Exact energy of one run of the profile (joules)."""
        return float(sum(d * p for d, p in zip(self.durations_s, self.power_w, strict=True)))

    @property
    def mean_power_w(self) -> float:
        return self.energy_j / self.duration_s

    @classmethod
    def constant(cls, duration_s: float, power_w: float) -> PowerProfile:
        return cls((duration_s,), (power_w,))

    @classmethod
    def periodic(
        cls, periods: int, on_s: float, on_w: float, off_s: float, off_w: float
    ) -> PowerProfile:
        """`periods` repeats of `on_s` seconds at `on_w` then `off_s` seconds at `off_w`."""
        return cls((on_s, off_s) * periods, (on_w, off_w) * periods)

    @classmethod
    def concat(cls, *parts: PowerProfile) -> PowerProfile:
        return cls(
            tuple(d for p in parts for d in p.durations_s),
            tuple(w for p in parts for w in p.power_w),
        )

    @classmethod
    def from_callable(
        cls, fn: Callable[[float], float], duration_s: float, step_s: float = 1e-3
    ) -> PowerProfile:
        """Piecewise-constant `fn(t)` (watts at seconds since start), sampled at midpoints."""
        n = max(1, math.ceil(duration_s / step_s))
        step = duration_s / n
        return cls((step,) * n, tuple(float(fn((i + 0.5) * step)) for i in range(n)))


@dataclass(frozen=True)
class PowerTrace:
    """Piecewise-constant power on absolute time: `power_w[i]` from `change_s[i]` until the next
    change; the first value also holds before the first change, the last one holds forever."""

    change_s: np.ndarray
    power_w: np.ndarray

    @classmethod
    def from_changes(cls, change_s: Sequence[float], power_w: Sequence[float]) -> PowerTrace:
        t = np.asarray(change_s, dtype=float)
        p = np.asarray(power_w, dtype=float)
        if t.ndim != 1 or t.shape != p.shape or t.size == 0:
            raise ValueError(
                "a PowerTrace needs equally many change times and powers (at least one)"
            )
        if np.any(np.diff(t) < 0):
            raise ValueError("PowerTrace change times must be sorted")
        return cls(t, p)

    @classmethod
    def from_profile(
        cls,
        profile: PowerProfile,
        start_s: float = 0.0,
        before_w: float = 0.0,
        after_w: float = 0.0,
    ):
        """The profile placed at `start_s`, at `before_w` before it and `after_w` after it."""
        starts = start_s + np.concatenate(([0.0], np.cumsum(profile.durations_s)))
        return cls.from_changes(
            np.concatenate(([starts[0] - 1.0], starts)),
            np.concatenate(([before_w], profile.power_w, [after_w])),
        )

    def _index(self, t: np.ndarray) -> np.ndarray:
        return np.clip(
            np.searchsorted(self.change_s, t, side="right") - 1, 0, self.change_s.size - 1
        )

    def power_at(self, t: float | np.ndarray) -> np.ndarray:
        return self.power_w[self._index(np.asarray(t, dtype=float))]

    def cumulative_j(self, t: float | np.ndarray, tau_s: float = 0.0) -> np.ndarray:
        """Energy from the first change to `t` (joules; negative before it) of the power after a
        first-order low-pass filter with time constant `tau_s` (0 = the true power)."""
        t = np.asarray(t, dtype=float)
        dt = np.diff(self.change_s)
        p = self.power_w
        idx = self._index(t)
        since = t - self.change_s[idx]
        if tau_s <= 0:
            cum = np.concatenate(([0.0], np.cumsum(p[:-1] * dt)))
            return cum[idx] + since * p[idx]
        # y' = (x - y) / tau per constant piece: y = x + (y0 - x) exp(-s/tau), integrated exactly
        y = np.empty_like(p)
        y[0] = p[0]  # steady state before the first change
        decay = np.exp(-dt / tau_s)
        for i in range(dt.size):
            y[i + 1] = p[i] + (y[i] - p[i]) * decay[i]
        piece = p[:-1] * dt + (y[:-1] - p[:-1]) * tau_s * (1.0 - decay)
        cum = np.concatenate(([0.0], np.cumsum(piece)))
        # before the first change the filter sits at steady state p[0]: plain p[0] * since
        decay_t = np.where(since > 0, np.exp(-np.maximum(since, 0.0) / tau_s), 1.0)
        part = p[idx] * since + (y[idx] - p[idx]) * tau_s * (1.0 - decay_t)
        return cum[idx] + part

    def filtered_power_at(self, t: float | np.ndarray, tau_s: float) -> np.ndarray:
        """Low-pass filtered power at `t` (watts)."""
        t = np.asarray(t, dtype=float)
        if tau_s <= 0:
            return self.power_at(t)
        dt = np.diff(self.change_s)
        p = self.power_w
        y = np.empty_like(p)
        y[0] = p[0]
        for i in range(dt.size):
            y[i + 1] = p[i] + (y[i] - p[i]) * math.exp(-dt[i] / tau_s)
        idx = self._index(t)
        since = np.maximum(t - self.change_s[idx], 0.0)
        return p[idx] + (y[idx] - p[idx]) * np.exp(-since / tau_s)

    def energy_j(self, start_s: float, end_s: float) -> float:
        """Exact true energy over [start_s, end_s] (joules)."""
        e = self.cumulative_j(np.array([start_s, end_s]))
        return float(e[1] - e[0])


@dataclass(frozen=True)
class SensorModel:
    """How a power sensor turns true power into readings.

    Attributes:
        update_period_s: a new value is published every this many seconds.
        window_s: each value averages the power over this many seconds (0 = instantaneous).
        delay_s: the averaging window ends this long before the update.
        rise_time_s: 10-90 % rise time of a first-order lag applied before averaging (0 = none).
        phase_s: updates happen at phase_s + k * update_period_s (the grid is not tied to the
            workload; vary it to see every alignment).
    """

    update_period_s: float
    window_s: float
    delay_s: float = 0.0
    rise_time_s: float = 0.0
    phase_s: float = 0.0

    def __post_init__(self) -> None:
        if self.update_period_s <= 0:
            raise ValueError(f"update_period_s must be > 0, got {self.update_period_s}")
        if self.window_s < 0 or self.delay_s < 0 or self.rise_time_s < 0:
            raise ValueError("window_s, delay_s and rise_time_s must be >= 0")

    @property
    def coverage(self) -> float:
        """Fraction of time the sensor sees (1.0 when windows tile time)."""
        return min(1.0, self.window_s / self.update_period_s)

    def with_phase(self, phase_s: float) -> SensorModel:
        return SensorModel(
            self.update_period_s, self.window_s, self.delay_s, self.rise_time_s, phase_s
        )

    def last_update_s(self, t: float | np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=float)
        k = np.floor(
            (t - self.phase_s) / self.update_period_s + 1e-9
        )  # 1e-9: updates at exact grid times count
        return self.phase_s + k * self.update_period_s

    def readings_w(self, trace: PowerTrace, t: float | np.ndarray) -> np.ndarray:
        """What the sensor reports at times `t` (watts)."""
        tau = self.rise_time_s * RISE_TIME_TO_TAU
        end = self.last_update_s(t) - self.delay_s
        if self.window_s == 0:
            return trace.filtered_power_at(end, tau)
        return (
            trace.cumulative_j(end, tau) - trace.cumulative_j(end - self.window_s, tau)
        ) / self.window_s


@dataclass(frozen=True)
class SensorPreset:
    """A GPU class: its fastest power field (`instant`) and nvidia-smi's `power.draw` (`draw`)."""

    name: str
    description: str
    instant: SensorModel
    draw: SensorModel

    def field(self, name: str) -> SensorModel:
        if name not in ("instant", "draw"):
            raise ValueError(f"unknown sensor field {name!r}; use 'instant' or 'draw'")
        return self.instant if name == "instant" else self.draw


# Update periods and windows as measured by Yang et al. (2023). Delay and rise time are 0 in
# the presets because the measured classes are characterised by window and period; the 1 s
# boxcar of power.draw on consumer GPUs is itself the ~1 s rise they report.
PRESETS: dict[str, SensorPreset] = {
    "a100-h100": SensorPreset(
        "a100-h100",
        "A100/H100: 25 ms averaging window every 100 ms (the sensor sees 25 % of the time)",
        instant=SensorModel(update_period_s=0.1, window_s=0.025),
        draw=SensorModel(update_period_s=0.1, window_s=0.025),
    ),
    "ampere-ada": SensorPreset(
        "ampere-ada",
        "Ampere/Ada consumer: instant power 100 ms window every 100 ms; power.draw a 1 s average",
        instant=SensorModel(update_period_s=0.1, window_s=0.1),
        draw=SensorModel(update_period_s=0.1, window_s=1.0),
    ),
    "v100": SensorPreset(
        "v100",
        "V100: 10 ms averaging window every 20 ms (the sensor sees 50 % of the time)",
        instant=SensorModel(update_period_s=0.02, window_s=0.01),
        draw=SensorModel(update_period_s=0.02, window_s=0.01),
    ),
}


def get_preset(name: str) -> SensorPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown sensor preset {name!r}; choose from {', '.join(PRESETS)}"
        ) from None


def polled_energy_j(
    sensor: SensorModel,
    trace: PowerTrace,
    start_s: float,
    end_s: float,
    interval_s: float,
    offset_s: float = 0.0,
    method: str = "trapezoid",
) -> float:
    """Energy estimated from readings polled every `interval_s` over [start_s, end_s].

    ``method="sum"`` is the naive nvidia-smi method (sum of readings times the interval, polls at
    start + offset + k * interval inside the window); ``"trapezoid"`` integrates the polled
    readings, with polls also at both ends.
    """
    if method == "sum":
        polls = np.arange(start_s + offset_s, end_s, interval_s)
        return float(np.sum(sensor.readings_w(trace, polls)) * interval_s)
    if method == "trapezoid":
        polls = np.append(np.arange(start_s, end_s, interval_s), end_s)
        r = sensor.readings_w(trace, polls)
        return float(np.sum((polls[1:] - polls[:-1]) * (r[1:] + r[:-1]) * 0.5))
    raise ValueError(f"unknown method {method!r}; use 'sum' or 'trapezoid'")
