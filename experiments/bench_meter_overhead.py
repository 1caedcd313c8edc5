"""Overhead of the nvml-power polling thread on a CPU-bound workload, at the default interval.

Runs each workload alternately without and with an open `nvml-power` window (its background
thread polling every 5 ms) and reports the median and mean slowdown over the pairs. Alternating
pairs cancel slow drifts of a shared machine.

On a machine with an NVIDIA driver the real NVML is polled. Without one (CI, laptops) the NVML
functions are replaced by stubs returning a fixed power, so what is measured is the thread's own
cost: waking up, taking the GIL, building samples. On a GPU the NVML call itself runs in C with
the GIL released (ctypes), so it lengthens the poll period rather than stalling the workload.

Run: python experiments/bench_meter_overhead.py [--pairs 15] [--seconds 0.4]
Writes experiments/results/meter_overhead.{json,csv} (meter_overhead_<N>ms.* for other intervals).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pynvml
import torch

from mtad_energy.measure import MeterUnavailableError, NvmlPowerMeter, no_sync, window
from mtad_energy.measure.nvml import DEFAULT_POLL_INTERVAL_S

RESULTS = Path(__file__).resolve().parent / "results"


@contextmanager
def nvml_backend() -> Iterator[str]:
    """The real NVML when it starts, else stubs with the real signatures (autospec)."""
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        yield "real NVML"
        return
    except pynvml.NVMLError:
        pass

    def field_values(handle: object, field_ids: list) -> list:
        v = pynvml.c_nvmlFieldValue_t()
        v.nvmlReturn = pynvml.NVML_SUCCESS
        v.value.uiVal = 250_000
        return [v]

    stubs = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 1,
        "nvmlDeviceGetHandleByIndex": lambda index: f"gpu{index}",
        "nvmlDeviceGetUUID": lambda handle: "GPU-00000000-0000-0000-0000-000000000000",
        "nvmlDeviceGetName": lambda handle: "stub GPU",
        "nvmlDeviceGetMigMode": lambda device: [0, 0],
        "nvmlDeviceGetFieldValues": field_values,
    }
    # plain functions, not mocks: a mock call costs far more than a real ctypes call would
    patches = [mock.patch.object(pynvml, n, new=f) for n, f in stubs.items()]
    for p in patches:
        p.start()
    try:
        yield "stub NVML (no driver on this machine)"
    finally:
        for p in patches:
            p.stop()


class InstrumentedMeter(NvmlPowerMeter):
    """Adds up the CPU time the polling thread itself uses (time.thread_time inside the thread)."""

    poll_cpu_s = 0.0

    def _poll(self, stop) -> None:  # noqa: ANN001 (same signature as the base class)
        t0 = time.thread_time()
        try:
            super()._poll(stop)
        finally:
            self.poll_cpu_s += time.thread_time() - t0


def python_loop(n: int) -> Callable[[], object]:
    # holds the GIL throughout: the worst case for a Python polling thread
    return lambda: sum(i * i for i in range(n))


def torch_matmul(threads: int) -> Callable[[int], Callable[[], object]]:
    def make(n: int) -> Callable[[], object]:
        a = torch.randn(256, 256)

        def run() -> None:
            torch.set_num_threads(threads)
            for _ in range(n):
                torch.mm(a, a)

        return run

    return make


def calibrate(make: Callable[[int], Callable[[], object]], seconds: float) -> Callable[[], object]:
    make(10)()  # warm-up: thread pools and allocators are not part of the calibration
    n = 1000
    while True:
        fn = make(n)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if dt > seconds / 4:
            return make(max(1, int(n * seconds / dt)))
        n *= 4


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds: all threads, so the poller's own work counts)."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def bench(
    name: str, fn: Callable[[], object], meter: InstrumentedMeter, pairs: int
) -> dict[str, object]:
    fn()  # warm-up
    wall = {"base": [], "polled": []}
    cpu = {"base": [], "polled": []}
    samples = 0
    meter.poll_cpu_s = 0.0
    for i in range(pairs):
        # alternate the order so a drift does not favour one arm
        for arm in ("base", "polled") if i % 2 == 0 else ("polled", "base"):
            if arm == "base":
                w, c = timed(fn)
            else:
                with window(meter, "bench", sync=no_sync) as win:
                    w, c = timed(fn)
                samples += len(win.result().samples)
            wall[arm].append(w)
            cpu[arm].append(c)
    wall_ratio = [p / b - 1.0 for p, b in zip(wall["polled"], wall["base"], strict=True)]
    cpu_ratio = [p / b - 1.0 for p, b in zip(cpu["polled"], cpu["base"], strict=True)]
    return {
        "workload": name,
        "pairs": pairs,
        "base_median_s": statistics.median(wall["base"]),
        "polled_median_s": statistics.median(wall["polled"]),
        "wall_overhead_median_pct": 100 * statistics.median(wall_ratio),
        "wall_overhead_stdev_pct": 100 * statistics.stdev(wall_ratio),
        "cpu_overhead_median_pct": 100 * statistics.median(cpu_ratio),
        "cpu_overhead_stdev_pct": 100 * statistics.stdev(cpu_ratio),
        "samples_per_s": samples / sum(wall["polled"]),
        "poll_thread_cpu_pct": 100 * meter.poll_cpu_s / sum(wall["polled"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=0.25, help="duration of one workload run")
    parser.add_argument(
        "--interval-ms",
        type=float,
        default=DEFAULT_POLL_INTERVAL_S * 1000,
        help="polling interval (default: the library default)",
    )
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    workloads = {
        "python-loop": python_loop,  # GIL-bound, like a Python decode loop
        "torch-mm-1thr": torch_matmul(1),  # GIL released, one core left for the poller
        f"torch-mm-{cores}thr": torch_matmul(cores),  # every core busy: the poller must preempt
    }
    rows = []
    with nvml_backend() as backend:
        try:
            meter = InstrumentedMeter(poll_interval_s=args.interval_ms / 1000)
        except MeterUnavailableError as err:
            raise SystemExit(f"cannot build the nvml-power meter: {err}") from err
        with meter:
            for name, make in workloads.items():
                rows.append(bench(name, calibrate(make, args.seconds), meter, args.pairs))
    print(
        f"nvml-power polling overhead, interval {args.interval_ms:g} ms, {backend}, "
        f"{cores} CPU cores, {args.pairs} alternating pairs"
    )
    print("overhead = polled / base - 1 per pair; median over pairs (stdev in brackets)")
    print(
        f"{'workload':<14} {'base s':>7} {'wall overhead':>18} {'CPU-time overhead':>18} "
        f"{'samples/s':>9} {'poll thread CPU':>15}"
    )
    for r in rows:
        wall = f"{r['wall_overhead_median_pct']:+.2f}% ({r['wall_overhead_stdev_pct']:.1f})"
        cpu = f"{r['cpu_overhead_median_pct']:+.2f}% ({r['cpu_overhead_stdev_pct']:.1f})"
        print(
            f"{r['workload']:<14} {r['base_median_s']:>7.3f} {wall:>18} {cpu:>18} "
            f"{r['samples_per_s']:>9.0f} {r['poll_thread_cpu_pct']:>14.2f}%"
        )
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "backend": backend,
        "poll_interval_s": args.interval_ms / 1000,
        "cpu_count": cores,
        "seconds_per_run": args.seconds,
        "unix_time_s": time.time(),
    }
    stem = (
        "meter_overhead"
        if args.interval_ms == DEFAULT_POLL_INTERVAL_S * 1000
        else (f"meter_overhead_{args.interval_ms:g}ms")
    )
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    with open(RESULTS / f"{stem}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    wall = max(r["wall_overhead_median_pct"] for r in rows)
    cpu = max(r["cpu_overhead_median_pct"] for r in rows)
    thread = max(r["poll_thread_cpu_pct"] for r in rows)
    print(
        f"overhead at {args.interval_ms:g} ms polling (worst workload): "
        f"wall {wall:+.2f}%, CPU time {cpu:+.2f}%, poll thread {thread:.2f}% of wall time "
        "(target <= 1 %)"
    )


if __name__ == "__main__":
    main()
