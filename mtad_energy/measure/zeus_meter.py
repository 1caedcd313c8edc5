"""The `zeus` meter (Zeus 0.16 `ZeusMonitor` windows) and Zeus `PowerMonitor` power timelines.

Zeus is imported lazily: importing it costs about 1.5 s and it is optional.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mtad_energy.measure.base import (
    FLAG_ZERO_ENERGY,
    Clock,
    Flag,
    Measurement,
    MeterBase,
    MeterUnavailableError,
    MigNotSupportedError,
    WindowBook,
    device_measurement,
    short_window_flag,
)
from mtad_energy.measure.integrate import trapezoid_energy_j

POWER_DOMAINS = ("device_instant", "device_average", "memory_average")
"""Zeus power domains; `memory_average` (HBM power) is reported on H100."""

NO_GPU_REASON = (
    "Zeus found no GPU (ZeusMonitor returned no GPU energy): no NVIDIA/AMD driver is usable "
    "or CUDA_VISIBLE_DEVICES hides every GPU. Run on a GPU machine or use meter='rapl'/'none'."
)


def _refuse_mig_env(env: Mapping[str, str]) -> None:
    # Zeus turns a MIG CUDA_VISIBLE_DEVICES into "no GPUs" silently; say it plainly instead.
    spec = env.get("CUDA_VISIBLE_DEVICES", "")
    if any(part.strip().startswith("MIG-") for part in spec.split(",")):
        raise MigNotSupportedError(
            f"CUDA_VISIBLE_DEVICES names a MIG slice ({spec}); NVML (and so Zeus) cannot measure "
            "the power or energy of a MIG slice. Use whole GPUs or meter='none'."
        )


def _default_monitor(gpu_indices: list[int] | None, include_cpu: bool) -> Any:
    try:
        from zeus.monitor import ZeusMonitor
    except ImportError as err:
        raise MeterUnavailableError(
            "Zeus is not installed; install it with `pip install zeus`."
        ) from err
    return ZeusMonitor(
        gpu_indices=gpu_indices,
        cpu_indices=None if include_cpu else [],
        sync_execution_with="torch",
    )


class ZeusMeter(MeterBase):
    """Window energy from `zeus.monitor.ZeusMonitor.begin_window` / `end_window`.

    Device sync is left to `window()`, so Zeus is called with ``sync_execution=False``.
    Zeus uses the NVML energy counter on Volta+ and its own power polling on older GPUs.

    Args:
        gpu_indices: CUDA indices to measure (default: every visible GPU).
        include_cpu: also report RAPL CPU/DRAM energy through Zeus (needs readable RAPL).
        monitor: a ready ZeusMonitor-like object (tests pass an autospec mock).
        update_period_s: counter update period; shorter windows are flagged.
    """

    name = "zeus"

    def __init__(
        self,
        gpu_indices: list[int] | None = None,
        include_cpu: bool = False,
        monitor: Any | None = None,
        clock: Clock | None = None,
        update_period_s: float | None = 0.1,
        env: Mapping[str, str] | None = None,
    ):
        _refuse_mig_env(os.environ if env is None else env)
        self._monitor = (
            monitor if monitor is not None else _default_monitor(gpu_indices, include_cpu)
        )
        self._clock = clock or time.perf_counter
        self._update_period_s = update_period_s
        self._book = WindowBook()

    @property
    def monitor(self) -> Any:
        return self._monitor

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(f"gpu{i}" for i in self._monitor.gpu_indices)

    @property
    def update_period_s(self) -> float | None:
        return self._update_period_s

    def now(self) -> float:
        return self._clock()

    def begin_window(self, key: str) -> None:
        self._book.open(key, self._clock())
        try:
            self._monitor.begin_window(key, sync_execution=False)
        except BaseException:
            self._book.close(key)
            raise

    def end_window(self, key: str) -> Measurement:
        start_s = self._book.close(key)
        zm = self._monitor.end_window(key, sync_execution=False)
        end_s = self._clock()
        time_s = float(zm.time)
        flags: list[Flag] = []
        device_j: dict[str, float | None] = {
            f"gpu{i}": float(e) for i, e in sorted(zm.gpu_energy.items())
        }
        for i, e in sorted((zm.cpu_energy or {}).items()):
            device_j[f"cpu{i}"] = float(e)
        for i, e in sorted((zm.dram_energy or {}).items()):
            device_j[f"cpu{i}/dram"] = float(e)
        if not zm.gpu_energy:  # no GPU: CPU-only readings would pass for GPU energy
            device_j = {}
        else:
            for label, e in device_j.items():
                if e == 0.0 and time_s > 0:
                    flags.append(
                        Flag(
                            FLAG_ZERO_ENERGY,
                            f"{label}: Zeus measured 0 J in {time_s:.6g} s; the window is "
                            "shorter than the energy counter update period.",
                        )
                    )
            flags += short_window_flag(self.name, time_s, self._update_period_s)
        return device_measurement(key, self.name, start_s, end_s, device_j, flags, time_s=time_s,
                                  reason=NO_GPU_REASON if not zm.gpu_energy else None)


@dataclass(frozen=True)
class PowerTimeline:
    """Power samples of one device in one Zeus power domain.

    `timestamps_s` are Unix times (Zeus uses `time.time()`), `power_w` in watts.
    """

    domain: str
    device: str
    timestamps_s: tuple[float, ...]
    power_w: tuple[float, ...]

    def energy_j(self, start_s: float, end_s: float) -> float:
        """Trapezoid energy over [start_s, end_s] (Unix seconds), interpolated at the ends."""
        return trapezoid_energy_j(self.timestamps_s, self.power_w, start_s, end_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "device": self.device,
            "timestamps_s": list(self.timestamps_s),
            "power_w": list(self.power_w),
        }


class TimelineRecorder:
    """Wraps a running Zeus PowerMonitor; `timelines()` converts its samples to `PowerTimeline`s."""

    def __init__(self, monitor: Any):
        self._monitor = monitor

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(sorted(getattr(d, "value", d) for d in self._monitor.measurement_domains))

    def timelines(
        self, start_s: float | None = None, end_s: float | None = None
    ) -> list[PowerTimeline]:
        raw = self._monitor.get_all_power_timelines(start_time=start_s, end_time=end_s)
        out: list[PowerTimeline] = []
        for domain, per_gpu in sorted(raw.items()):
            for gpu, points in sorted(per_gpu.items()):
                out.append(
                    PowerTimeline(
                        domain=domain,
                        device=f"gpu{gpu}",
                        timestamps_s=tuple(float(t) for t, _ in points),
                        power_w=tuple(float(p) for _, p in points),
                    )
                )
        return out


@contextmanager
def zeus_power_timelines(
    domains: Sequence[str] | None = None,
    gpu_indices: list[int] | None = None,
    update_period_s: float | None = None,
    monitor_factory: Callable[..., Any] | None = None,
) -> Iterator[TimelineRecorder]:
    """Record power timelines with Zeus's PowerMonitor for the enclosed block; stopped in `finally`.

    `domains` defaults to every supported one of ``device_instant``, ``device_average`` and
    ``memory_average`` (H100's memory power, a direct check of the memory term of the energy
    decomposition). Zeus polls in spawned processes, so keep heavy work in the caller under
    ``if __name__ == "__main__"``.
    """
    for d in domains or ():
        if d not in POWER_DOMAINS:
            raise ValueError(
                f"unknown Zeus power domain {d!r}; choose from {', '.join(POWER_DOMAINS)}"
            )
    if monitor_factory is None:
        try:
            from zeus.monitor.power import PowerMonitor
        except ImportError as err:
            raise MeterUnavailableError(
                "Zeus is not installed; install it with `pip install zeus`."
            ) from err
        monitor_factory = PowerMonitor
    try:
        monitor = monitor_factory(
            gpu_indices=gpu_indices,
            update_period=update_period_s,
            power_domains=list(domains) if domains else None,
        )
    except MeterUnavailableError:
        raise
    except Exception as err:  # Zeus raises its own init errors when there is no GPU
        raise MeterUnavailableError(
            f"Zeus PowerMonitor could not start ({type(err).__name__}: {err}); power timelines "
            "need a GPU."
        ) from err
    try:
        yield TimelineRecorder(monitor)
    finally:
        monitor.stop()
