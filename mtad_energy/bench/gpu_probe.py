"""The real GPU a calibration measures (`calibrate.run_calibration`): GPU 0 through NVML's probe
(`measure.probes.nvml_probe`), with a steady and a bursty decode-like workload of matrix-vector
products (`MatVecWorkload`), opened and freed by `gpu_calibration_probe`. The simulated GPU's
probe and workloads are `measure.probes.simulated_probe`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch

from mtad_energy.measure import MeterUnavailableError
from mtad_energy.measure.probes import Probe, Workload, nvml_probe


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
