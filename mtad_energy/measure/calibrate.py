"""Calibrating the meters of one GPU: which to trust, and the shortest window worth measuring.

Users of GPU energy tools meet contradictory readings (Zeus issue 181: on one idle window the
energy counter gave 187 J and power polling 327 J). `calibrate_meters` measures, on the user's
own device, the meters side by side (the energy counter, 5 ms instant power, Zeus and naive 1 s
power.draw polling) on an idle window and on a steady and a bursty workload, each plain (one
window read by all meters at once) and under the Yang et al. protocol (one meter after the
other); the counter's update period (by polling it); and a window sweep with the trusted meter.

The verdict:

- the consensus of a workload is the median of the meters' protocol estimates (energy per
  repetition); a meter is trusted when its plain readings are within `tolerance` of the
  consensus on every workload, the first such in `TRUST_ORDER`;
- the shortest window worth measuring is the shortest window length from which on every plain
  window of the bursty workload read by the trusted meter is within `tolerance` of the consensus.

A `CalibrationRecord` is stored per device (``$MTAD_ENERGY_CALIBRATION``, default
``<cache>/calibration/<device id>.json``). Later runs on that device reference it in their
environment snapshot, and `calibrated` wraps their meter so that a window shorter than the
calibrated minimum carries the `FLAG_BELOW_MIN_WINDOW` flag (windows of the Yang et al. protocol
are exempt: the protocol exists to measure short work).

Everything runs on an injected clock, sleep and sync, so the whole calibration also runs on
simulated time (`simulated_probe`) and against a mocked NVML in the tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtad_energy.measure.base import (
    FLAG_BELOW_MIN_WINDOW,
    Clock,
    EnergyMeter,
    Flag,
    MeasureError,
    Measurement,
    MeterBase,
    MeterUnavailableError,
    SyncFn,
    no_sync,
    window,
)
from mtad_energy.measure.env import EnvSnapshot
from mtad_energy.measure.mitigation import MitigationConfig, measure_mitigated
from mtad_energy.measure.profiler import cache_dir

CALIBRATION_ENV_VAR = "MTAD_ENERGY_CALIBRATION"
COUNTER, POWER, ZEUS, NAIVE = "nvml-counter", "nvml-power", "zeus", "power.draw-1s"
ROLES = (COUNTER, POWER, ZEUS, NAIVE)
"""The meters compared: the energy counter, instant power polled every 5 ms, Zeus, and
nvidia-smi's power.draw polled every second (the naive method Yang et al. measured)."""
TRUST_ORDER = (COUNTER, ZEUS, POWER, NAIVE)
"""Among meters equally within tolerance, the cheapest and most direct first."""
MITIGATION_WINDOW_PREFIX = "mitigation-"  # measure_mitigated's own windows


class CalibrationError(MeasureError):
    """A calibration record cannot be read; the message names the file and the fix."""


@dataclass(frozen=True)
class Workload:
    """One repetition of a workload (`run`), about `rep_s` seconds long."""

    name: str
    run: Callable[[], object]
    rep_s: float
    description: str


@dataclass(frozen=True)
class Probe:
    """What a calibration needs from a device: its identity, the meters to compare (name ->
    factory, built once), its energy counter (joules) for the update period, an optional reader
    of board and memory average power (watts; H100), and the clock, sleep and sync to run on."""

    device_id: str
    device_name: str
    meters: Mapping[str, Callable[[], EnergyMeter]]
    counter_j: Callable[[], float] | None
    clock: Clock
    sleep: Callable[[float], object]
    sync: SyncFn = no_sync
    average_power_w: Callable[[], tuple[float, float]] | None = None
    simulated: bool = False
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class CalibrationPlan:
    """How long each part runs (seconds) and the tolerance of the verdict."""

    idle_s: float = 5.0
    settle_s: float = 0.5
    plain_s: float = 3.0
    period_probe_s: float = 2.0
    period_poll_s: float = 0.0005
    window_lengths_s: tuple[float, ...] = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0)
    window_repeats: int = 5
    tolerance: float = 0.05
    mitigation: MitigationConfig = field(default_factory=MitigationConfig)

    @classmethod
    def quick(cls) -> CalibrationPlan:
        """About a minute on a GPU: shorter windows, a lighter protocol, three repeats."""
        return cls(idle_s=1.0, settle_s=0.2, plain_s=2.0, period_probe_s=1.0,
                   window_lengths_s=(0.05, 0.1, 0.2, 0.5, 1.0, 2.0), window_repeats=3,
                   mitigation=MitigationConfig(min_repetitions=8, min_duration_s=1.0,
                                               warmup_s=0.2, idle_s=0.5))


@dataclass(frozen=True)
class MeterCalibration:
    """The measurements and the verdict of `calibrate_meters`."""

    rows: tuple[dict[str, Any], ...]  # side by side: idle, then per workload plain and mitigated
    counter_update_period_s: float | None
    counter_updates: int
    idle_power_w: float | None
    sweep: tuple[dict[str, Any], ...]  # window length sweep with the trusted meter
    trusted: str | None
    trust_reason: str
    min_window_s: float | None
    tolerance: float
    verdict: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


# -- the counter's update period ----------------------------------------------------------------
def counter_update_period_s(counter_j: Callable[[], float], clock: Clock,
                            sleep: Callable[[float], object], duration_s: float,
                            poll_s: float = 0.0005) -> tuple[float | None, int]:
    """Poll the energy counter for ``duration_s`` every ``poll_s``; returns the median time
    between the reads at which it changed (None with fewer than two changes) and how many
    changes were seen."""
    start = clock()
    last = counter_j()
    changes: list[float] = []
    while clock() - start < duration_s:
        sleep(poll_s)
        value = counter_j()
        if value != last:
            changes.append(clock())
            last = value
    gaps = [b - a for a, b in zip(changes, changes[1:], strict=False)]
    return (statistics.median(gaps) if gaps else None), len(changes)


# -- side by side -------------------------------------------------------------------------------
def _open_meters(probe: Probe) -> tuple[dict[str, EnergyMeter], list[dict[str, Any]]]:
    meters: dict[str, EnergyMeter] = {}
    rows: list[dict[str, Any]] = []
    for name, make in probe.meters.items():
        try:
            meters[name] = make()
        except (MeterUnavailableError, ImportError, OSError) as err:
            rows.append({"workload": "-", "meter": name, "protocol": "-", "error": str(err)})
    return meters, rows


def _all_windows(stack: ExitStack, meters: Mapping[str, EnergyMeter], key: str,
                 sync: SyncFn) -> dict[str, Any]:
    """One window on every meter, entered on ``stack`` (closed in reverse order, always)."""
    return {name: stack.enter_context(window(meter, key, sync)) for name, meter in meters.items()}


def _plain_row(workload: str, name: str, m: Measurement, reps: int,
               average_w: tuple[float | None, float | None] = (None, None)) -> dict[str, Any]:
    return {"workload": workload, "meter": name, "protocol": "plain", "reps": reps,
            "time_s": m.time_s, "energy_j": m.energy_j, "power_w": m.power_w,
            "energy_per_rep_j": None if m.energy_j is None or not reps else m.energy_j / reps,
            "board_average_power_w": average_w[0], "memory_average_power_w": average_w[1],
            "flags": ",".join(m.flag_codes), "reason": m.reason}


def _means(samples: Sequence[tuple[float, float]]) -> tuple[float | None, float | None]:
    if not samples:
        return None, None
    return statistics.fmean(s[0] for s in samples), statistics.fmean(s[1] for s in samples)


def _idle(probe: Probe, meters: Mapping[str, EnergyMeter], plan: CalibrationPlan) -> list[dict]:
    probe.sync()
    probe.sleep(plan.settle_s)  # let the sensors forget what ran before
    with ExitStack() as stack:
        handles = _all_windows(stack, meters, "idle", probe.sync)
        probe.sleep(plan.idle_s)
    return [_plain_row("idle", name, h.result(), 0) for name, h in handles.items()]


def _plain(probe: Probe, meters: Mapping[str, EnergyMeter], work: Workload,
           plan: CalibrationPlan) -> list[dict]:
    reps, average = 0, []
    with ExitStack() as stack:
        handles = _all_windows(stack, meters, work.name, probe.sync)
        start = probe.clock()
        while reps < 8 or probe.clock() - start < plan.plain_s:
            work.run()
            reps += 1
            if probe.average_power_w is not None and reps % 4 == 0:
                average.append(probe.average_power_w())
    return [_plain_row(work.name, name, h.result(), reps, _means(average))
            for name, h in handles.items()]


def _mitigated(probe: Probe, name: str, meter: EnergyMeter, work: Workload,
               plan: CalibrationPlan) -> dict[str, Any]:
    started = time.perf_counter()
    mit = measure_mitigated(work.run, meter, plan.mitigation, sleep=probe.sleep, sync=probe.sync)
    return {"workload": work.name, "meter": name, "protocol": "mitigated",
            "reps": mit.repetitions_kept, "time_s": mit.time_per_rep_s * mit.repetitions_kept,
            "energy_j": None, "power_w": None, "energy_per_rep_j": mit.energy_per_rep_j,
            "ci_low_j": mit.ci_low_j, "ci_high_j": mit.ci_high_j, "idle_power_w": mit.idle_power_w,
            "dynamic_energy_per_rep_j": mit.dynamic_energy_per_rep_j,
            "flags": ",".join(f.code for f in mit.flags), "reason": mit.reason,
            "protocol_wall_s": time.perf_counter() - started}


def _compare(rows: list[dict[str, Any]]) -> None:
    """Each row's value (J per repetition; idle: W), its difference to the energy counter's, and
    its difference to the workload's consensus (`consensus_value`, `vs_consensus`): the one basis
    the table and the verdict both use."""
    for r in rows:
        r["value"] = r.get("power_w") if r["workload"] == "idle" else r.get("energy_per_rep_j")
    ref = {(r["workload"], r["protocol"]): r["value"] for r in rows if r["meter"] == COUNTER}
    basis = {w: consensus_value(rows, w) for w in dict.fromkeys(r["workload"] for r in rows)}
    for r in rows:
        r["counter_value"] = ref.get((r["workload"], r["protocol"]))
        ok = r["value"] is not None and r["counter_value"]
        r["vs_counter"] = r["value"] / r["counter_value"] - 1.0 if ok else None
        r["consensus_value"] = basis[r["workload"]]
        ok = r["value"] is not None and r["consensus_value"]
        r["vs_consensus"] = r["value"] / r["consensus_value"] - 1.0 if ok else None


def consensus_value(rows: Sequence[dict[str, Any]], workload: str) -> float | None:
    """The basis every difference is taken against: `consensus_j` of a workload (J per
    repetition); idle, which has no protocol run, the median of the meters' idle power (W)."""
    if workload != "idle":
        return consensus_j(rows, workload)
    values = [r["power_w"] for r in rows if r["workload"] == "idle" and r.get("power_w") is not None]
    return statistics.median(values) if values else None


# -- verdict ------------------------------------------------------------------------------------
def consensus_j(rows: Sequence[dict[str, Any]], workload: str) -> float | None:
    """The median of the meters' protocol estimates of ``workload`` (J per repetition)."""
    values = [r["energy_per_rep_j"] for r in rows if r["workload"] == workload
              and r["protocol"] == "mitigated" and r.get("energy_per_rep_j") is not None]
    return statistics.median(values) if values else None


def plain_errors(rows: Sequence[dict[str, Any]], workloads: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per meter and workload: plain reading / consensus - 1."""
    out: dict[str, dict[str, float]] = {}
    for w in workloads:
        ref = consensus_j(rows, w)
        for r in rows:
            if r["workload"] == w and r["protocol"] == "plain" and ref and r["energy_per_rep_j"] is not None:
                out.setdefault(r["meter"], {})[w] = r["energy_per_rep_j"] / ref - 1.0
    return out


def choose_meter(errors: Mapping[str, Mapping[str, float]], workloads: Sequence[str],
                 tolerance: float) -> tuple[str | None, str]:
    """The meter to trust and why (see the module's docstring)."""
    complete = {m: e for m, e in errors.items() if set(workloads) <= set(e)}
    if not complete:
        return None, "no meter gave energy on every workload"
    worst = {m: max(abs(v) for v in e.values()) for m, e in complete.items()}
    order = sorted(complete, key=lambda m: (TRUST_ORDER.index(m) if m in TRUST_ORDER else 99, m))
    within = [m for m in order if worst[m] <= tolerance]
    if within:
        others = ", ".join(f"{m} {_worst_signed(complete[m]):+.1%}" for m in order if m != within[0])
        return within[0], (f"its plain windows are within {_worst_signed(complete[within[0]]):+.1%} "
                           f"of the protocol's consensus on {' and '.join(workloads)} work "
                           f"(tolerance ±{tolerance:.0%})" + (f"; {others}" if others else ""))
    best = min(order, key=lambda m: worst[m])
    return best, (f"no meter's plain windows are within ±{tolerance:.0%} of the protocol's "
                  f"consensus; {best} comes closest ({_worst_signed(complete[best]):+.1%}): measure "
                  "with the protocol (--mitigate on)")


def _worst_signed(errors: Mapping[str, float]) -> float:
    """The largest error, signed, rounded to what is printed (no "-0.0%")."""
    return round(max(errors.values(), key=abs), 4) + 0.0


def window_sweep(probe: Probe, meter: EnergyMeter, work: Workload, plan: CalibrationPlan,
                 reference_j: float) -> list[dict[str, Any]]:
    """Plain windows of whole repetitions, about each of ``plan.window_lengths_s`` long, each
    ``plan.window_repeats`` times (phase-shifted by short idle gaps); every reading's energy per
    repetition against ``reference_j``."""
    rows = []
    for length in plan.window_lengths_s:
        reps = max(1, round(length / work.rep_s))
        for i in range(plan.window_repeats):
            probe.sleep(0.0137 * (i + 1))  # move the window against the sensor's update grid
            with window(meter, f"sweep-{length:g}s-{i}", probe.sync) as w:
                for _ in range(reps):
                    work.run()
            m = w.result()
            per_rep = None if m.energy_j is None else m.energy_j / reps
            rows.append({"length_s": length, "repeat": i, "reps": reps, "time_s": m.time_s,
                         "energy_per_rep_j": per_rep,
                         "error": None if per_rep is None else per_rep / reference_j - 1.0})
    return rows


def shortest_window_s(sweep: Sequence[dict[str, Any]], tolerance: float) -> float | None:
    """The shortest window (median time of its readings) from which on, at every longer length
    too, every reading is within ``tolerance``; None if even the longest is not."""
    lengths = sorted({r["length_s"] for r in sweep})
    ok = {length: all(r["error"] is not None and abs(r["error"]) <= tolerance
                      for r in sweep if r["length_s"] == length) for length in lengths}
    best = None
    for length in reversed(lengths):
        if not ok[length]:
            break
        best = length
    if best is None:
        return None
    return statistics.median(r["time_s"] for r in sweep if r["length_s"] == best)


def calibrate_meters(probe: Probe, workloads: Sequence[Workload], plan: CalibrationPlan,
                     progress: Callable[[str], object] | None = None) -> MeterCalibration:
    """The meters of ``probe`` side by side on idle and on ``workloads``, the counter's update
    period, the trusted meter and the shortest window worth measuring (module docstring)."""
    say = progress or (lambda text: None)
    meters, rows = _open_meters(probe)
    if not meters:
        raise MeterUnavailableError("no meter could start: " + "; ".join(
            f"{r['meter']}: {r['error']}" for r in rows))
    try:
        period, updates = None, 0
        if probe.counter_j is not None:
            say("counter update period")
            period, updates = counter_update_period_s(probe.counter_j, probe.clock, probe.sleep,
                                                      plan.period_probe_s, plan.period_poll_s)
        say("idle power")
        rows += _idle(probe, meters, plan)
        for work in workloads:
            for _ in range(3):  # warm-up
                work.run()
            probe.sync()
            say(f"{work.name}: plain windows")
            rows += _plain(probe, meters, work, plan)
            for name, meter in meters.items():
                say(f"{work.name}: {name} under the protocol")
                rows.append(_mitigated(probe, name, meter, work, plan))
        names = [w.name for w in workloads]
        trusted, why = choose_meter(plain_errors(rows, names), names, plan.tolerance)
        sweep: list[dict[str, Any]] = []
        swept = workloads[-1]  # the bursty one: host gaps, as a Python decode loop has
        reference = consensus_j(rows, swept.name)
        if trusted is not None and reference:
            say(f"window sweep with {trusted}")
            sweep = window_sweep(probe, meters[trusted], swept, plan, reference)
    finally:
        for meter in meters.values():
            meter.close()
    _compare(rows)
    idle = {r["meter"]: r["power_w"] for r in rows if r["workload"] == "idle"}
    idle_w = idle.get(trusted) if trusted else None
    minimum = shortest_window_s(sweep, plan.tolerance) if sweep else None
    return MeterCalibration(tuple(rows), period, updates, idle_w, tuple(sweep), trusted, why, minimum,
                            plan.tolerance, _verdict(rows, trusted, why, minimum, period, updates,
                                                     idle_w, plan.tolerance, swept.name, probe))


def _verdict(rows, trusted, why, minimum, period, updates, idle_w, tolerance, swept, probe
             ) -> tuple[str, ...]:
    lines = [f"trust {trusted}: {why}" if trusted else f"no meter to trust: {why}"]
    if trusted and minimum is not None:
        lines.append(f"shortest window worth measuring with {trusted}: {minimum:.3g} s (every "
                     f"reading of the {swept} workload within ±{tolerance:.0%} from there on); later "
                     f"runs flag shorter windows '{FLAG_BELOW_MIN_WINDOW}'")
    elif trusted:
        lines.append(f"no window length tried kept {trusted} within ±{tolerance:.0%} on the {swept} "
                     "workload: measure with the protocol (--mitigate on)")
    if period is not None:
        lines.append(f"the energy counter updates every {period * 1e3:.3g} ms ({updates} updates seen)")
    elif probe.counter_j is not None:
        lines.append(f"the energy counter changed {updates} time(s): too few to time its updates")
    if idle_w is not None:
        lines.append(f"idle power {idle_w:.4g} W (subtract idle power x time for dynamic energy)")
    # against the consensus, as `choose_meter` and the table: one basis for every figure printed
    naive = {(r["workload"], r["protocol"]): None if r["vs_consensus"] is None else
             round(r["vs_consensus"], 3) + 0.0 for r in rows if r["meter"] == NAIVE}  # no -0.0%
    if naive.get((swept, "plain")) is not None:
        mit = naive.get((swept, "mitigated"))
        lines.append(f"naive 1 s power.draw polling is off by {naive[(swept, 'plain')]:+.1%} of the "
                     f"consensus on {swept} work"
                     + (f", {mit:+.1%} under the protocol" if mit is not None else ""))
    lines += list(probe.notes)
    return tuple(lines)


# -- records ------------------------------------------------------------------------------------
def calibration_dir() -> Path:
    """$MTAD_ENERGY_CALIBRATION, else ``calibration/`` in the cache ($MTAD_ENERGY_CACHE, ...)."""
    if override := os.environ.get(CALIBRATION_ENV_VAR):
        return Path(override)
    return cache_dir() / "calibration"


@dataclass(frozen=True)
class CalibrationRecord:
    """One device's calibration, as stored and as later runs reference it."""

    device_id: str
    device_name: str
    created_unix_s: float
    simulated: bool
    trusted_meter: str | None
    min_window_s: float | None
    tolerance: float
    counter_update_period_s: float | None
    idle_power_w: float | None
    copy_bandwidth_bytes_per_s: float | None
    floor: tuple[dict[str, Any], ...]
    meters: tuple[dict[str, Any], ...]
    sweep: tuple[dict[str, Any], ...]
    verdict: tuple[str, ...]

    @property
    def record_id(self) -> str:
        blob = json.dumps([self.device_id, self.created_unix_s]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def reference(self) -> dict[str, Any]:
        """What an environment snapshot holds of it."""
        return {"record_id": self.record_id, "device_id": self.device_id,
                "device_name": self.device_name, "created_unix_s": self.created_unix_s,
                "simulated": self.simulated, "trusted_meter": self.trusted_meter,
                "min_window_s": self.min_window_s, "tolerance": self.tolerance}

    def to_dict(self) -> dict[str, Any]:
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return {"record_id": self.record_id, **out}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CalibrationRecord:
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        return cls(**{n: tuple(data[n]) if isinstance(data[n], list) else data[n] for n in names})


def record_path(device_id: str, directory: Path | None = None) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in device_id)
    return (directory or calibration_dir()) / f"{safe}.json"


def check_record_dir(directory: Path | None = None) -> Path:
    """The directory records go to (``directory``, else `calibration_dir`), created and tried
    with a file, before anything is calibrated: a ValueError naming it and the option when it
    cannot be written (minutes of calibrating would otherwise be lost at the end)."""
    where = Path(directory) if directory is not None else calibration_dir()
    probe = where / f".tmp-{os.getpid()}-write-check"
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"cannot write calibration records to {where} (--record-dir, else "
                         f"${CALIBRATION_ENV_VAR}): {err.strerror or err}; pick a directory you "
                         "can write to") from None
    return where


def save_record(record: CalibrationRecord, directory: Path | None = None) -> Path:
    """Write ``record`` (atomically; it replaces the device's previous one); returns the path."""
    path = record_path(record.device_id, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        tmp.write_text(json.dumps(record.to_dict(), indent=2, default=str) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_record(device_id: str, directory: Path | None = None) -> CalibrationRecord | None:
    """The device's calibration, or None if it was never calibrated."""
    path = record_path(device_id, directory)
    try:
        return CalibrationRecord.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as err:
        raise CalibrationError(f"{path} is not a readable calibration record ({err}); delete it or "
                               "run `mtad-energy calibrate` again on that GPU") from None


# -- later runs ---------------------------------------------------------------------------------
class CalibratedMeter(MeterBase):
    """``meter`` with a flag on every window shorter than the calibrated minimum (except the
    Yang et al. protocol's own windows). Everything else is the meter's own."""

    def __init__(self, meter: EnergyMeter, min_window_s: float, record: CalibrationRecord):
        self.meter, self.min_window_s, self.record = meter, min_window_s, record

    def __getattr__(self, name: str) -> Any:  # name, preset, reason, ... of the meter
        if name == "meter":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.meter, name)

    @property
    def devices(self) -> tuple[str, ...]:
        return self.meter.devices

    @property
    def update_period_s(self) -> float | None:
        return self.meter.update_period_s

    def now(self) -> float:
        return self.meter.now()

    def begin_window(self, key: str) -> None:
        self.meter.begin_window(key)

    def end_window(self, key: str) -> Measurement:
        m = self.meter.end_window(key)
        if m.time_s >= self.min_window_s or key.startswith(MITIGATION_WINDOW_PREFIX):
            return m
        r = self.record
        flag = Flag(FLAG_BELOW_MIN_WINDOW,
                    f"window of {m.time_s:.3g} s is shorter than the {self.min_window_s:.3g} s that "
                    f"the calibration of {r.device_name} (record {r.record_id}) found worth measuring "
                    f"with {r.trusted_meter}: its energy may be off by more than "
                    f"±{r.tolerance:.0%}; measure longer windows or use --mitigate on")
        return dataclasses.replace(m, flags=(*m.flags, flag))

    def close(self) -> None:
        self.meter.close()


def meter_device_ids(meter: EnergyMeter, snap: EnvSnapshot) -> list[str]:
    """What the calibrations of ``meter``'s devices are filed under: the GPU UUIDs (from the
    snapshot, by CUDA index), or ``simulated-<preset>`` for the simulated meter."""
    if meter.name == "simulated":
        preset = getattr(meter, "preset", None)
        return [f"simulated-{preset}"] if preset else []
    by_label = {f"gpu{g.cuda_index}": g.uuid for g in snap.gpus}
    return [by_label[d] for d in meter.devices if d in by_label]


def calibrated(meter: EnergyMeter, snap: EnvSnapshot, directory: Path | None = None
               ) -> tuple[EnergyMeter, EnvSnapshot]:
    """``meter`` flagging windows below its devices' calibrated minimum (the longest of them),
    and ``snap`` referencing those calibrations; both unchanged where none was calibrated."""
    records = [r for d in meter_device_ids(meter, snap) if (r := load_record(d, directory))]
    refs = list(snap.calibrations)
    refs += [r.reference() for r in records if r.record_id not in {x["record_id"] for x in refs}]
    snap = dataclasses.replace(snap, calibrations=tuple(refs))
    minimums = [(r.min_window_s, r) for r in records if r.min_window_s is not None]
    if not minimums:
        return meter, snap
    minimum, record = max(minimums, key=lambda x: x[0])
    return CalibratedMeter(meter, minimum, record), snap


def calibration_refs(device_ids: Sequence[str], directory: Path | None = None
                     ) -> tuple[dict[str, Any], ...]:
    """References to the stored calibrations of these devices (for an environment snapshot)."""
    return tuple(r.reference() for d in device_ids if (r := load_record(d, directory)))
