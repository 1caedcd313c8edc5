"""`mtad-energy calibrate`: the meters of one GPU side by side, which to trust, the shortest window
worth measuring, its copy bandwidth and a model's forward floor, kept as a record.

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

`run_calibration` is what the command runs: the meters' comparison above through the device's
probe (`bench.gpu_probe`: NVML, with matrix-vector workloads), the copy bandwidth and the
batch-1 forward floor of a model (`bench.floor`), a verdict, and a
`measure.calibration.CalibrationRecord` that later runs on the device reference. Without a GPU it
measures what a CPU allows (copy bandwidth, the forward time) and says what it cannot measure and
why; ``meter="simulated"`` runs the whole calibration on a simulated GPU (on simulated time) and
stores its record under ``simulated-<preset>``, which later runs with ``--meter simulated``
reference.

Everything runs on an injected clock, sleep and sync, so the whole calibration also runs on
simulated time (`simulated_probe`) and against a mocked NVML in the tests.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mtad_energy.bench.floor import (
    copy_bandwidth,
    decode_forward_time,
    decode_read_bytes,
    matrix_bytes,
    weight_bytes,
)
from mtad_energy.bench.gpu_probe import gpu_calibration_probe
from mtad_energy.measure import MeterUnavailableError
from mtad_energy.measure.base import (
    FLAG_BELOW_MIN_WINDOW,
    Clock,
    EnergyMeter,
    Measurement,
    SyncFn,
    window,
)
from mtad_energy.measure.calibration import CalibrationRecord, check_record_dir, save_record
from mtad_energy.measure.mitigation import MitigationConfig, measure_mitigated
from mtad_energy.measure.probes import (
    COUNTER,
    NAIVE,
    POWER,
    ZEUS,
    Probe,
    Workload,
    simulated_probe,
)

TRUST_ORDER = (COUNTER, ZEUS, POWER, NAIVE)
"""Among meters equally within tolerance, the cheapest and most direct first."""


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
    found = MeterCalibration(
        rows=tuple(rows), counter_update_period_s=period, counter_updates=updates,
        idle_power_w=idle_w, sweep=tuple(sweep), trusted=trusted, trust_reason=why,
        min_window_s=minimum, tolerance=plan.tolerance, verdict=())
    return dataclasses.replace(found, verdict=_verdict(found, swept.name, probe))


def _verdict(found: MeterCalibration, swept: str, probe) -> tuple[str, ...]:
    rows, trusted, why, minimum = found.rows, found.trusted, found.trust_reason, found.min_window_s
    period, updates, idle_w = (found.counter_update_period_s, found.counter_updates,
                               found.idle_power_w)
    tolerance = found.tolerance
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


METER_CHOICES = ("auto", "simulated")


@dataclass(frozen=True)
class CalibrateConfig:
    """What `run_calibration` does. ``model``: a shape of `models.shapes` (random weights, nothing
    downloaded) or a model alias, hub id or directory; default ``llama3.1-8b`` on a GPU and
    ``tiny-llama`` on the CPU."""

    meter: str = "auto"
    preset: str = "a100-h100"
    model: str | None = None
    quick: bool = False
    compile: bool = False
    record_dir: Path | None = None
    save: bool = True

    def __post_init__(self) -> None:
        if self.meter not in METER_CHOICES:
            raise ValueError(f"calibrate measures the meters 'auto' picks from (the GPU's) or a "
                             f"'simulated' GPU, got {self.meter!r}")


@dataclass(frozen=True)
class CalibrationReport:
    device: str  # where bandwidth and the forward floor were measured ("cuda:0", "cpu")
    meters: MeterCalibration | None
    copy_bandwidth_bytes_per_s: float | None
    floor: tuple[dict[str, Any], ...]
    cannot: tuple[tuple[str, str], ...]  # (what, why) this machine cannot measure
    record: CalibrationRecord | None
    record_path: Path | None
    verdict: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "meters": self.meters.to_dict() if self.meters else None,
                "copy_bandwidth_bytes_per_s": self.copy_bandwidth_bytes_per_s,
                "floor": list(self.floor), "cannot": [{"what": w, "why": y} for w, y in self.cannot],
                "record": self.record.to_dict() if self.record else None,
                "record_path": str(self.record_path) if self.record_path else None,
                "verdict": list(self.verdict)}


def measure_floor(model, name: str, bandwidth_bytes_per_s: float, modes: Sequence[str] = ("eager",),
                  context_len: int = 128, forwards: int = 32, repeats: int = 5,
                  backend: str = "inductor", log: Callable[[str], object] = lambda s: None
                  ) -> list[dict[str, Any]]:
    """Batch-1 decode forward time of ``model`` (each of ``modes``) against its floor, the bytes
    a decode forward reads (`decode_read_bytes`: the weights but an untied embedding table, of
    which it gathers one row) / copy bandwidth; one row per mode (a failing mode is a row with
    its error). On CUDA each row also says where the time above the floor goes (one profiled
    block: `KernelProfile.limits`)."""
    wb, read = weight_bytes(model), decode_read_bytes(model)
    floor_ms = read / bandwidth_bytes_per_s * 1e3
    rows = []
    for mode in modes:
        base = {"model": name, "mode": mode, "batch_size": 1, "weight_gb": wb / 1e9,
                "read_gb": read / 1e9, "copy_tb_per_s": bandwidth_bytes_per_s / 1e12,
                "floor_ms": floor_ms}
        try:
            t = decode_forward_time(model, mode, context_len=context_len, forwards=forwards,
                                    repeats=repeats, backend=backend, profile_kernels=True)
            limits = (t.kernels.limits(t.forward_ms, matrix_bytes(model), bandwidth_bytes_per_s)
                      if t.kernels is not None else {})
            rows.append({**base, "forward_ms": t.forward_ms, "forward_ms_min": t.forward_ms_min,
                         "x_floor": t.forward_ms / floor_ms, "tokens_per_s": 1e3 / t.forward_ms,
                         "warmup_s": t.compile_s, "detail": t.detail, "error": None, **limits})
        except Exception as err:  # noqa: BLE001 - one failing mode must not end the others
            rows.append({**base, "error": f"{type(err).__name__}: {str(err)[:300]}"})
        r = rows[-1]
        why = (f"; above it: {r['idle_ms']:.2f} ms idle between {r['kernels_per_forward']:.0f} "
               f"kernels, matmuls {r['matmul_excess_ms']:.2f} ms past their floor, "
               f"{r['other_ms']:.2f} ms other kernels (limit: {r['limit']})"
               if "limit" in r else "")
        log(f"floor: {name} {mode}: {r.get('forward_ms')} ms vs floor {floor_ms:.3f} ms{why}")
    return rows


def _load_model(name: str, device: torch.device):
    """A shape of `models.shapes` with random weights, else a model alias, hub id or directory."""
    from mtad_energy.models import ALIASES, load_pair
    from mtad_energy.models.shapes import SHAPES, random_model

    if name in SHAPES:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return random_model(name, device, dtype, max_positions=1024)
    alias, target = (name, None) if name in ALIASES else (None, name)
    return load_pair(alias, target=target, device=str(device), with_draft=False).target


def _floor_part(cfg: CalibrateConfig, device: torch.device, log: Callable[[str], object]
                ) -> tuple[float, list[dict[str, Any]]]:
    quick = cfg.quick or device.type != "cuda"
    bandwidth = copy_bandwidth(device, (1 << 31) if device.type == "cuda" else (1 << 26))
    names = [n.strip() for n in (cfg.model or ("llama3.1-8b" if device.type == "cuda"
                                               else "tiny-llama")).split(",") if n.strip()]
    rows: list[dict[str, Any]] = []
    for name in names:  # one model at a time on the device
        model = _load_model(name, device)
        try:
            rows += measure_floor(model, name, bandwidth,
                                  ("eager", "compiled") if cfg.compile else ("eager",),
                                  context_len=128, forwards=8 if quick else 32,
                                  repeats=3 if quick else 5,
                                  backend="inductor" if device.type == "cuda" else "eager", log=log)
        finally:
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return bandwidth, rows


GPU_PARTS = ("the GPU's meters side by side (energy counter, instant power, Zeus, 1 s polling), "
             "idle power, the energy counter's update period and the shortest window worth "
             "measuring")


def no_gpu_meter(reason: str) -> str:
    """Why calibrate cannot measure the GPU's meters, said once, with calibrate's own fix (a
    meter's error advises a CPU meter, which calibrate does not take)."""
    cause = re.sub(r"\s*Use a CPU meter[^.]*\.", "", reason).rstrip(". ")
    return (f"{cause}; calibrate compares a GPU's meters: run it on a GPU machine, or rehearse it "
            "with --meter simulated")


def run_calibration(cfg: CalibrateConfig, log: Callable[[str], object] = lambda s: None
                    ) -> CalibrationReport:
    """Calibrate this machine (see the module docstring); stores the record unless ``cfg.save``
    is off or nothing could be calibrated."""
    if cfg.save:
        check_record_dir(cfg.record_dir)  # before minutes of calibrating, not after
    plan = CalibrationPlan.quick() if cfg.quick else CalibrationPlan()
    cannot: list[tuple[str, str]] = []
    meters: MeterCalibration | None = None
    probe: Probe | None = None
    if cfg.meter == "simulated":
        probe, works = simulated_probe(cfg.preset)
        meters = calibrate_meters(probe, works, plan, log)
    else:
        try:
            with gpu_calibration_probe() as (probe, works):
                meters = calibrate_meters(probe, works, plan, log)
        except MeterUnavailableError as err:
            cannot.append((GPU_PARTS, no_gpu_meter(str(err))))
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        cannot.append(("GPU copy bandwidth and forward floor", "no CUDA device: measured on the "
                       "CPU instead (its memory bandwidth, its forward time)"))
    bandwidth, floor = _floor_part(cfg, device, log)
    record = path = None
    if meters is not None and probe is not None and meters.trusted is not None:
        record = CalibrationRecord(
            device_id=probe.device_id, device_name=probe.device_name, created_unix_s=time.time(),
            simulated=probe.simulated, trusted_meter=meters.trusted,
            min_window_s=meters.min_window_s, tolerance=meters.tolerance,
            counter_update_period_s=meters.counter_update_period_s,
            idle_power_w=meters.idle_power_w, copy_bandwidth_bytes_per_s=bandwidth,
            floor=tuple(floor), meters=meters.rows, sweep=meters.sweep, verdict=meters.verdict)
        if cfg.save:
            path = save_record(record, cfg.record_dir)
    verdict = list(meters.verdict) if meters else [
        "nothing to calibrate: " + cannot[0][1].split(";")[0] + "; `mtad-energy calibrate --meter "
        "simulated` rehearses the calibration on a simulated GPU"]
    verdict += [f"{r['model']} {r['mode']} forward at batch 1: {r['forward_ms']:.3g} ms, "
                f"{r['x_floor']:.2g}x its floor of {r['floor_ms']:.3g} ms (bytes read / copy "
                f"bandwidth {bandwidth / 1e12:.3g} TB/s on {device.type})" if r["error"] is None else
                f"{r['model']} {r['mode']} forward failed: {r['error']}" for r in floor]
    return CalibrationReport(str(device), meters, bandwidth, tuple(floor), tuple(cannot), record, path,
                             tuple(verdict))

