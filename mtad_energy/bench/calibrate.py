"""`mtad-energy calibrate`: the meters of this GPU side by side, its idle power and counter update
period (`measure.calibrate`), its copy bandwidth and the batch-1 forward floor of a model
(`bench.floor`), a verdict, and a calibration record later runs reference.

Without a GPU it measures what a CPU allows (copy bandwidth, the forward time) and says what it
cannot measure and why; ``meter="simulated"`` runs the whole calibration on a simulated GPU (on
simulated time) and stores its record under ``simulated-<preset>``, which later runs with
``--meter simulated`` reference.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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
from mtad_energy.measure import MeterUnavailableError
from mtad_energy.measure.calibrate import (
    CalibrationPlan,
    CalibrationRecord,
    MeterCalibration,
    Probe,
    Workload,
    calibrate_meters,
    check_record_dir,
    save_record,
)
from mtad_energy.measure.probes import nvml_probe, simulated_probe

METER_CHOICES = ("auto", "simulated")


@dataclass(frozen=True)
class CalibrateConfig:
    """What `run_calibration` does. ``model``: a shape of `bench.shapes` (random weights, nothing
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


class MatVecWorkload:
    """A decode-like memory-bound repetition: `k` matrix-vector products over a weight matrix far
    larger than L2 (each reads the whole matrix, like a batch-1 decode forward), `k` set so one
    repetition takes about ``rep_ms``. ``bursty`` adds 1.5x that of host idle after each, as a
    Python decode loop has."""

    def __init__(self, device: torch.device, dtype: torch.dtype, n: int, bursty: bool,
                 rep_ms: float = 10.0):
        self.w = torch.randn(n, n, device=device, dtype=dtype)  # [n, n]
        self.x = torch.randn(n, 1, device=device, dtype=dtype)  # [n, 1]
        self.bursty = bursty
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.k = 4
        self._time_one()  # the first product pays for library initialisation
        t = min(self._time_one() for _ in range(3))
        self.k = max(1, round(self.k * rep_ms / 1e3 / max(t, 1e-6)))
        self.rep_s = self._time_one() * (2.5 if bursty else 1.0)

    def _time_one(self) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.run_busy()
        self.sync()
        return time.perf_counter() - t0

    def run_busy(self) -> None:
        for _ in range(self.k):
            self.x = (self.w @ self.x) * (1.0 / math.sqrt(self.w.shape[0]))

    def __call__(self) -> None:
        self.run_busy()
        if self.bursty:
            self.sync()
            time.sleep(1.5 * self.rep_s / 2.5)  # idle gap: the GPU waits for the host

    def workload(self) -> Workload:
        n = self.w.shape[0]
        what = f"{self.k} mat-vecs of {n}^2 {str(self.w.dtype).removeprefix('torch.')}"
        return Workload("bursty" if self.bursty else "steady", self, self.rep_s,
                        what + (", then 1.5x that idle" if self.bursty else ""))


@contextlib.contextmanager
def gpu_calibration_probe(matrix_n: int = 16384, dtype: torch.dtype = torch.bfloat16
                          ) -> Iterator[tuple[Probe, list[Workload]]]:
    """The first visible GPU through NVML, with the steady and bursty mat-vec workloads."""
    with nvml_probe(sync=lambda: torch.cuda.synchronize()) as probe:  # NVML's reason first
        if not torch.cuda.is_available():
            raise MeterUnavailableError(
                f"NVML sees {probe.device_name} but torch has no CUDA device (a CPU-only torch "
                "build, or a driver older than torch's CUDA): the workloads need one")
        device = torch.device("cuda", 0)
        works = [MatVecWorkload(device, dtype, matrix_n, bursty=b) for b in (False, True)]
        try:
            yield probe, [w.workload() for w in works]
        finally:
            del works
            torch.cuda.empty_cache()


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
    """A shape of `bench.shapes` with random weights, else a model alias, hub id or directory."""
    from mtad_energy.bench.shapes import SHAPES, random_model
    from mtad_energy.models import ALIASES, load_pair

    if name in SHAPES:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return random_model(name, device, dtype, max_positions=1024)
    alias, target = (name, None) if name in ALIASES else (None, name)
    return load_pair(alias, target=target, device=str(device), with_draft=False).target


def _floor_part(cfg: CalibrateConfig, device: torch.device, log: Callable[[str], object]
                ) -> tuple[float, list[dict[str, Any]]]:
    quick = cfg.quick or device.type != "cuda"
    bandwidth = copy_bandwidth(device, (1 << 31) if device.type == "cuda" else (1 << 26))
    name = cfg.model or ("llama3.1-8b" if device.type == "cuda" else "tiny-llama")
    model = _load_model(name, device)
    try:
        rows = measure_floor(model, name, bandwidth, ("eager", "compiled") if cfg.compile else ("eager",),
                             context_len=128, forwards=8 if quick else 32, repeats=3 if quick else 5,
                             backend="inductor" if device.type == "cuda" else "eager", log=log)
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return bandwidth, rows


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
            why = str(err)
            cannot += [("meters side by side (energy counter, instant power, Zeus, 1 s polling)", why),
                       ("idle power", why), ("the energy counter's update period", why),
                       ("the shortest window worth measuring", why)]
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        cannot.append(("GPU copy bandwidth and forward floor", "no CUDA device: measured on the "
                       "CPU instead (its memory bandwidth, its forward time)"))
    bandwidth, floor = _floor_part(cfg, device, log)
    record = path = None
    if meters is not None and probe is not None and meters.trusted is not None:
        record = CalibrationRecord(
            probe.device_id, probe.device_name, time.time(), probe.simulated, meters.trusted,
            meters.min_window_s, meters.tolerance, meters.counter_update_period_s,
            meters.idle_power_w, bandwidth, tuple(floor), meters.rows, meters.sweep, meters.verdict)
        if cfg.save:
            path = save_record(record, cfg.record_dir)
    verdict = list(meters.verdict) if meters else [
        "nothing to calibrate: " + cannot[0][1] + "; `mtad-energy calibrate --meter simulated` "
        "rehearses the calibration on a simulated GPU"]
    verdict += [f"{r['model']} {r['mode']} forward at batch 1: {r['forward_ms']:.3g} ms, "
                f"{r['x_floor']:.2g}x its floor of {r['floor_ms']:.3g} ms (bytes read / copy "
                f"bandwidth {bandwidth / 1e12:.3g} TB/s on {device.type})" if r["error"] is None else
                f"{r['model']} {r['mode']} forward failed: {r['error']}" for r in floor]
    return CalibrationReport(str(device), meters, bandwidth, tuple(floor), tuple(cannot), record, path,
                             tuple(verdict))

