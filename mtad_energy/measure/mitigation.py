"""Error mitigation for part-time GPU power sensors (Yang, Adamek & Armour, 2023/SC'24).

The protocol, for a workload callable that runs one repetition:

1. idle baseline: settle for `drop_s`, then measure `idle_s` of idle power;
2. warm-up: run the workload for at least `warmup_s` (and `warmup_repetitions`), unmeasured;
3. `groups` groups separated by idle gaps of at least `gap_s`; in each group the repetitions that
   start within the first `drop_s` are run but not measured (sensor delay and rise time), then a
   meter window covers the kept repetitions; together the groups keep at least
   `min_repetitions` repetitions and `min_duration_s` seconds;
4. energy per repetition = kept energy / kept repetitions, with a 95 % confidence interval over
   the groups' per-repetition energies (a 100 ms sensor cannot resolve single repetitions, so
   the groups are the independent samples); dynamic energy = total - idle power * time.

The meter integrates with the trapezoid rule interpolated at the window ends (nvml-power,
simulated) or reads a counter (nvml-counter, zeus); both work here.

Phase alignment (`align_phase`, on by default): the 25 ms gaps exist to move the sensor's
sampling window to a different phase of the workload in each group. A fixed 25 ms gap only does
that when a group lasts a whole number of sensor periods, so the gap is lengthened until group g
starts g/groups of a sensor period after group 0 (mod the period). With a 25 ms window every
100 ms and 4 groups the four windows then tile the period, which makes the estimate exact for any
workload whose period divides the sensor period.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mtad_energy.measure.base import EnergyMeter, Flag, SyncFn, default_sync, window

MITIGATION_WINDOW_PREFIX = "mitigation-"  # the protocol's own windows (calibration exempts them)
FLAG_NO_PHASE_ALIGN = "no-phase-align"


@dataclass(frozen=True)
class MitigationConfig:
    """Protocol parameters (seconds, counts). Defaults follow Yang et al."""

    min_repetitions: int = 32
    min_duration_s: float = 5.0
    groups: int = 4
    gap_s: float = 0.025
    drop_s: float = 0.1
    warmup_s: float = 1.0
    warmup_repetitions: int = 1
    idle_s: float = 1.0
    align_phase: bool = True
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.groups < 2:
            raise ValueError(f"groups must be >= 2 to get a confidence interval, got {self.groups}")
        if self.min_repetitions < self.groups:
            raise ValueError(
                f"min_repetitions ({self.min_repetitions}) must be >= groups ({self.groups})"
            )
        for name in ("min_duration_s", "gap_s", "drop_s", "warmup_s", "idle_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GroupResult:
    """One group: repetitions run and kept, the kept window's time and energy."""

    index: int
    start_timestamp_s: float
    repetitions_dropped: int
    repetitions_kept: int
    time_s: float
    energy_j: float | None

    @property
    def energy_per_rep_j(self) -> float | None:
        return None if self.energy_j is None else self.energy_j / self.repetitions_kept

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "energy_per_rep_j": self.energy_per_rep_j}


@dataclass(frozen=True)
class MitigatedEnergy:
    """Energy per repetition (joules) with its confidence interval."""

    meter: str
    config: MitigationConfig
    groups: tuple[GroupResult, ...]
    repetitions_kept: int
    time_per_rep_s: float
    energy_per_rep_j: float | None
    ci_low_j: float | None
    ci_high_j: float | None
    idle_power_w: float | None
    dynamic_energy_per_rep_j: float | None
    flags: tuple[Flag, ...] = ()
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "meter": self.meter,
            "config": self.config.to_dict(),
            "groups": [g.to_dict() for g in self.groups],
            "repetitions_kept": self.repetitions_kept,
            "time_per_rep_s": self.time_per_rep_s,
            "energy_per_rep_j": self.energy_per_rep_j,
            "ci_low_j": self.ci_low_j,
            "ci_high_j": self.ci_high_j,
            "idle_power_w": self.idle_power_w,
            "dynamic_energy_per_rep_j": self.dynamic_energy_per_rep_j,
            "flags": [f.to_dict() for f in self.flags],
            "reason": self.reason,
        }


def t_quantile(p: float, dof: int) -> float:
    """Student-t quantile (scipy, imported lazily: it is slow to import)."""
    from scipy.stats import t

    return float(t.ppf(p, dof))


def _aligned_start_s(
    earliest_s: float, first_start_s: float, offset_s: float, period_s: float
) -> float:
    """Smallest s >= earliest_s with s = first_start_s + offset_s (mod period_s)."""
    k = math.ceil((earliest_s - first_start_s - offset_s) / period_s - 1e-9)
    return first_start_s + offset_s + k * period_s


def measure_mitigated(
    workload: Callable[[], object],
    meter: EnergyMeter,
    config: MitigationConfig | None = None,
    sleep: Callable[[float], object] = time.sleep,
    sync: SyncFn | None = None,
) -> MitigatedEnergy:
    """Run the Yang et al. protocol on `workload` (one repetition per call) with `meter`.

    `sleep` and the meter's clock are injectable, so the protocol runs on simulated time with the
    `simulated` meter. The device is synchronised after every repetition so the CPU clock knows
    where each one ends (dropping and phase alignment depend on it).
    """
    cfg = config or MitigationConfig()
    sync_fn = default_sync() if sync is None else sync
    clock = meter.now
    flags: list[Flag] = []

    idle_power_w: float | None = None
    if cfg.idle_s > 0:
        sync_fn()
        sleep(cfg.drop_s)  # let the sensor forget whatever ran before
        with window(meter, f"{MITIGATION_WINDOW_PREFIX}idle", sync_fn) as w:
            sleep(cfg.idle_s)
        idle_power_w = w.result().power_w

    start = clock()
    warm = 0
    while warm < cfg.warmup_repetitions or clock() - start < cfg.warmup_s:
        workload()
        sync_fn()
        warm += 1

    reps_per_group = math.ceil(cfg.min_repetitions / cfg.groups)
    time_per_group_s = cfg.min_duration_s / cfg.groups
    period_s = meter.update_period_s if cfg.align_phase else None
    if cfg.align_phase and period_s is None:
        flags.append(
            Flag(
                FLAG_NO_PHASE_ALIGN,
                f"meter {meter.name} has no known update period; used fixed {cfg.gap_s:g} s gaps",
            )
        )

    groups: list[GroupResult] = []
    first_start_s = 0.0
    for g in range(cfg.groups):
        sleep(cfg.gap_s)
        if g == 0:
            first_start_s = clock()
        elif period_s:
            target = _aligned_start_s(clock(), first_start_s, g * period_s / cfg.groups, period_s)
            if target > clock():
                sleep(target - clock())
        group_start = clock()
        dropped = 0
        # 1 ns slack: a repetition starting exactly at drop_s is outside the drop window
        while clock() - group_start < cfg.drop_s - 1e-9:
            workload()
            sync_fn()
            dropped += 1
        kept = 0
        with window(meter, f"{MITIGATION_WINDOW_PREFIX}group{g}", sync_fn) as w:
            kept_start = clock()
            while kept < reps_per_group or clock() - kept_start < time_per_group_s:
                workload()
                sync_fn()
                kept += 1
        m = w.result()
        flags += [f for f in m.flags if f not in flags]
        groups.append(GroupResult(g, group_start, dropped, kept, m.time_s, m.energy_j))

    return _summarise(meter.name, cfg, groups, idle_power_w, flags)


def _summarise(
    meter: str,
    cfg: MitigationConfig,
    groups: list[GroupResult],
    idle_power_w: float | None,
    flags: list[Flag],
) -> MitigatedEnergy:
    kept = sum(g.repetitions_kept for g in groups)
    time_per_rep_s = sum(g.time_s for g in groups) / kept
    per_rep = [g.energy_per_rep_j for g in groups]
    shared = dict(meter=meter, config=cfg, groups=tuple(groups), repetitions_kept=kept,
                  time_per_rep_s=time_per_rep_s, idle_power_w=idle_power_w, flags=tuple(flags))
    if any(e is None for e in per_rep):
        return MitigatedEnergy(**shared, energy_per_rep_j=None, ci_low_j=None, ci_high_j=None,
                               dynamic_energy_per_rep_j=None,
                               reason=f"meter {meter} gave no energy for at least one group")
    values = [float(e) for e in per_rep if e is not None]
    mean = sum(g.energy_j or 0.0 for g in groups) / kept
    n = len(values)
    avg = sum(values) / n
    sd = math.sqrt(sum((v - avg) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + cfg.confidence / 2, n - 1) * sd / math.sqrt(n)
    dynamic = None if idle_power_w is None else mean - idle_power_w * time_per_rep_s
    return MitigatedEnergy(**shared, energy_per_rep_j=mean, ci_low_j=mean - half,
                           ci_high_j=mean + half, dynamic_energy_per_rep_j=dynamic)
