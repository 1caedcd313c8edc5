"""NVML meters: `nvml-counter` (cumulative energy counter) and `nvml-power` (polled power).

Every GPU visible to the process is measured (CUDA_VISIBLE_DEVICES respected, MIG refused).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from mtad_energy.measure._nvml import (
    NvmlDevice,
    init_nvml,
    require_devices,
    shutdown_nvml,
    visible_devices,
)
from mtad_energy.measure.base import (
    FLAG_COUNTER_RESET,
    FLAG_COUNTER_WRAP,
    FLAG_FEW_SAMPLES,
    FLAG_MISSING_DEVICE,
    FLAG_POWER_FALLBACK,
    FLAG_ZERO_ENERGY,
    Clock,
    Flag,
    Measurement,
    MeterBase,
    MeterUnavailableError,
    PowerSample,
    WindowBook,
    device_measurement,
    short_window_flag,
)
from mtad_energy.measure.integrate import trapezoid_energy_j

COUNTER_MODULUS_MJ = 2**64
"""nvmlDeviceGetTotalEnergyConsumption is an unsigned 64-bit count of millijoules."""

DEFAULT_POLL_INTERVAL_S = 0.005
"""Far below the fastest sensor update (10-20 ms on V100, 100 ms on A100/H100)."""

DEFAULT_UPDATE_PERIOD_S = 0.1
"""Typical NVML power/energy update period on A100/H100 and Ampere/Ada (Yang et al. 2023)."""


class _NvmlMeterBase(MeterBase):
    """NVML start-up, device resolution and window bookkeeping shared by both NVML meters."""

    name = "nvml"

    def __init__(
        self, env: Mapping[str, str] | None, clock: Clock | None, update_period_s: float | None
    ):
        self._pynvml: ModuleType = init_nvml()
        try:
            devices, self._mapping_flags = visible_devices(self._pynvml, env)
            require_devices(devices, env)
        except self._pynvml.NVMLError as err:
            shutdown_nvml(self._pynvml)
            raise MeterUnavailableError(
                f"NVML started but could not list the GPUs ({err}); check the driver with "
                "`nvidia-smi`, or use meter='none'."
            ) from err
        except BaseException:
            shutdown_nvml(self._pynvml)
            raise
        self._devices = tuple(devices)
        self._clock = clock or time.perf_counter
        self._update_period_s = update_period_s
        self._book = WindowBook()
        self._closed = False

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d.label for d in self._devices)

    @property
    def nvml_devices(self) -> tuple[NvmlDevice, ...]:
        return self._devices

    @property
    def update_period_s(self) -> float | None:
        return self._update_period_s

    def now(self) -> float:
        return self._clock()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            shutdown_nvml(self._pynvml)


class NvmlCounterMeter(_NvmlMeterBase):
    """Window energy from `nvmlDeviceGetTotalEnergyConsumption` (mJ since driver load; Volta+).

    Args:
        env: environment to read CUDA_VISIBLE_DEVICES from (default `os.environ`).
        clock: seconds clock (default `time.perf_counter`).
        update_period_s: counter update period; shorter windows are flagged.
        max_plausible_power_w: a wrapped delta implying more than this mean power is taken as a
            counter reset (driver reload), not a wrap, and that device's energy is dropped.
    """

    name = "nvml-counter"

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        update_period_s: float | None = DEFAULT_UPDATE_PERIOD_S,
        max_plausible_power_w: float = 5000.0,
    ):
        super().__init__(env, clock, update_period_s)
        self.max_plausible_power_w = max_plausible_power_w
        for dev in self._devices:
            try:
                self._pynvml.nvmlDeviceGetTotalEnergyConsumption(dev.handle)
            except self._pynvml.NVMLError as err:
                self.close()
                raise MeterUnavailableError(
                    "nvml-counter needs the total-energy counter (Volta or newer); "
                    f"{dev.describe()} "
                    f"does not provide it ({err}). Use meter='nvml-power'."
                ) from err

    def _read_mj(self) -> dict[str, int | str]:
        """Counter per device in mJ, or the error text for a device that failed."""
        out: dict[str, int | str] = {}
        for dev in self._devices:
            try:
                out[dev.label] = int(self._pynvml.nvmlDeviceGetTotalEnergyConsumption(dev.handle))
            except self._pynvml.NVMLError as err:
                out[dev.label] = str(err)
        return out

    def begin_window(self, key: str) -> None:
        readings = self._read_mj()
        self._book.open(key, (self._clock(), readings))

    def end_window(self, key: str) -> Measurement:
        start_s, start_mj = self._book.close(key)
        end_mj = self._read_mj()
        end_s = self._clock()
        time_s = end_s - start_s
        flags = list(self._mapping_flags)
        device_j: dict[str, float | None] = {}
        for dev in self._devices:
            a, b = start_mj[dev.label], end_mj[dev.label]
            if isinstance(a, str) or isinstance(b, str):
                err = a if isinstance(a, str) else b
                device_j[dev.label] = None
                flags.append(
                    Flag(
                        FLAG_MISSING_DEVICE,
                        f"{dev.describe()}: reading the energy counter failed ({err})",
                    )
                )
                continue
            delta_mj = b - a
            if delta_mj < 0:
                wrapped_mj = delta_mj + COUNTER_MODULUS_MJ
                if wrapped_mj / 1000.0 > self.max_plausible_power_w * max(time_s, 1e-9):
                    device_j[dev.label] = None
                    flags.append(
                        Flag(
                            FLAG_COUNTER_RESET,
                            f"{dev.describe()}: energy counter went back from {a} mJ to {b} mJ "
                            "(driver reload or GPU reset); its energy for this window is unknown.",
                        )
                    )
                    continue
                delta_mj = wrapped_mj
                flags.append(
                    Flag(
                        FLAG_COUNTER_WRAP,
                        f"{dev.describe()}: energy counter wrapped at 2**64 mJ; corrected.",
                    )
                )
            device_j[dev.label] = delta_mj / 1000.0
            if delta_mj == 0 and time_s > 0:
                flags.append(
                    Flag(
                        FLAG_ZERO_ENERGY,
                        f"{dev.describe()}: energy counter did not advance in {time_s:.6g} s; the "
                        "window "
                        "is shorter than the counter update period.",
                    )
                )
        flags += short_window_flag(self.name, time_s, self._update_period_s)
        return device_measurement(key, self.name, start_s, end_s, device_j, flags)


@dataclass(frozen=True)
class _PowerReader:
    """How one device's power is read: the field used and whether it is the fallback."""

    device: NvmlDevice
    read_mw: Callable[[], int]
    field: str
    fallback_note: str | None


class NvmlPowerMeter(_NvmlMeterBase):
    """Window energy by polling instant power in a background thread and integrating it.

    Reads `NVML_FI_DEV_POWER_INSTANT` with `nvmlDeviceGetFieldValues` every `poll_interval_s`;
    on GPUs or drivers without that field it falls back to `nvmlDeviceGetPowerUsage`
    (nvidia-smi's power.draw, a 1 s average on many GPUs) and flags it. Energy is the trapezoid
    integral with power interpolated at both window ends. The thread runs only while a window is
    open and is always stopped in `finally`.

    Args:
        poll_interval_s: polling period of the background thread (seconds).
        background: start the polling thread (tests drive `sample_now()` themselves instead).
        keep_samples: attach the samples to each Measurement.
        field: ``"instant"`` (default; falls back to power.draw where unsupported) or
            ``"power.draw"`` to read `nvmlDeviceGetPowerUsage` on purpose, as the naive
            nvidia-smi polling that Yang et al. measured (to quantify its error).
    """

    name = "nvml-power"

    def __init__(
        self,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        env: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        update_period_s: float | None = DEFAULT_UPDATE_PERIOD_S,
        background: bool = True,
        keep_samples: bool = True,
        field: str = "instant",
    ):
        super().__init__(env, clock, update_period_s)
        if poll_interval_s <= 0:
            self.close()
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        if field not in ("instant", "power.draw"):
            self.close()
            raise ValueError(f"field must be 'instant' or 'power.draw', got {field!r}")
        self.field = field
        self.poll_interval_s = poll_interval_s
        self.background = background
        self.keep_samples = keep_samples
        try:
            self._readers = tuple(self._make_reader(dev) for dev in self._devices)
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._samples: dict[str, list[tuple[float, float]]] = {d.label: [] for d in self._devices}
        self._errors: dict[str, str] = {}
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def _make_reader(self, dev: NvmlDevice) -> _PowerReader:
        nv = self._pynvml

        def instant_mw() -> int:
            value = nv.nvmlDeviceGetFieldValues(
                dev.handle, [(nv.NVML_FI_DEV_POWER_INSTANT, nv.NVML_POWER_SCOPE_GPU)]
            )[0]
            if value.nvmlReturn != nv.NVML_SUCCESS:
                raise nv.NVMLError(value.nvmlReturn)
            return int(value.value.uiVal)

        def usage_mw() -> int:
            return int(nv.nvmlDeviceGetPowerUsage(dev.handle))

        if self.field == "power.draw":
            try:
                usage_mw()
            except nv.NVMLError as err:
                raise MeterUnavailableError(
                    f"nvml-power cannot read power.draw on {dev.describe()} "
                    f"(nvmlDeviceGetPowerUsage failed: {err}). Use field='instant'."
                ) from err
            return _PowerReader(dev, usage_mw, "power.draw", None)
        try:
            instant_mw()
            return _PowerReader(dev, instant_mw, "instant", None)
        except nv.NVMLError as err:
            instant_err = err
        try:
            usage_mw()
        except nv.NVMLError as err:
            raise MeterUnavailableError(
                f"nvml-power cannot read power on {dev.describe()}: instant power failed "
                f"({instant_err}) "
                f"and nvmlDeviceGetPowerUsage failed ({err}). Use meter='nvml-counter' or 'none'."
            ) from err
        note = (
            f"{dev.describe()}: instant power (NVML_FI_DEV_POWER_INSTANT) is not supported "
            f"({instant_err}); fell back to nvmlDeviceGetPowerUsage (power.draw, often a 1 s "
            "average), which lags and smooths short phases."
        )
        return _PowerReader(dev, usage_mw, "power.draw", note)

    @property
    def power_fields(self) -> dict[str, str]:
        """Which NVML field each device is read from (``"instant"`` or ``"power.draw"``)."""
        return {r.device.label: r.field for r in self._readers}

    def sample_now(self) -> None:
        """Read every device once and store the samples (by the thread and at window ends)."""
        for reader in self._readers:
            label = reader.device.label
            try:
                power_w = reader.read_mw() / 1000.0
            except self._pynvml.NVMLError as err:
                with self._lock:
                    self._errors.setdefault(label, str(err))
                continue
            t = self._clock()
            with self._lock:
                self._samples[label].append((t, power_w))

    def _poll(self, stop: threading.Event) -> None:
        # Short intervals: time.sleep, not stop.wait(timeout): a timed Event.wait costs about
        # twice the CPU per wake-up, which matters at 200 wake-ups a second, and stopping waits at
        # most one short interval. Long intervals (e.g. the naive 1 s polling): stop.wait, so
        # closing a window never blocks for up to a whole interval (seen on an H100: a 1 s poller
        # held the windows of meters measured beside it open 1 s too long).
        if self.poll_interval_s >= 0.05:
            while not stop.is_set():
                self.sample_now()
                stop.wait(self.poll_interval_s)
            return
        sleep = time.sleep
        while not stop.is_set():
            self.sample_now()
            sleep(self.poll_interval_s)

    def _start_poller(self) -> None:
        if self._thread is not None or not self.background:
            return
        stop = threading.Event()
        thread = threading.Thread(
            target=self._poll, args=(stop,), name="mtad-nvml-power", daemon=True
        )
        self._stop, self._thread = stop, thread
        thread.start()

    def _stop_poller(self) -> None:
        # getattr: close() may run from __init__ before the poller attributes exist
        stop, thread = getattr(self, "_stop", None), getattr(self, "_thread", None)
        self._stop = self._thread = None
        if stop is not None:
            stop.set()
        if thread is not None:
            thread.join()

    @property
    def polling(self) -> bool:
        """True while the background thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def begin_window(self, key: str) -> None:
        if len(self._book) == 0:
            with self._lock:
                for buf in self._samples.values():
                    buf.clear()
                self._errors.clear()
        self.sample_now()  # a sample at the start so the start power is interpolated, not guessed
        self._book.open(key, self._clock())
        try:
            self._start_poller()
        except BaseException:
            self._book.close(key)
            raise

    def end_window(self, key: str) -> Measurement:
        start_s = self._book.close(key)
        try:
            end_s = self._clock()
            self.sample_now()  # a sample at the end, for the same reason
        finally:
            if len(self._book) == 0:
                self._stop_poller()
        with self._lock:
            series = {label: list(buf) for label, buf in self._samples.items()}
            errors = dict(self._errors)
        return self._measure(key, start_s, end_s, series, errors)

    def _measure(
        self,
        key: str,
        start_s: float,
        end_s: float,
        series: dict[str, list[tuple[float, float]]],
        errors: dict[str, str],
    ) -> Measurement:
        time_s = end_s - start_s
        flags = list(self._mapping_flags)
        flags += [
            Flag(FLAG_POWER_FALLBACK, r.fallback_note) for r in self._readers if r.fallback_note
        ]
        device_j: dict[str, float | None] = {}
        kept: list[PowerSample] = []
        for reader in self._readers:
            label = reader.device.label
            pts = sorted(series[label])
            if not pts:
                device_j[label] = None
                why = errors.get(label, "no sample was recorded")
                flags.append(
                    Flag(
                        FLAG_MISSING_DEVICE, f"{reader.device.describe()}: no power samples ({why})"
                    )
                )
                continue
            t = np.array([p[0] for p in pts])
            w = np.array([p[1] for p in pts])
            # the samples that bracket the window: last at/before start .. first at/after end
            lo = max(int(np.searchsorted(t, start_s, side="right")) - 1, 0)
            hi = min(int(np.searchsorted(t, end_s, side="left")) + 1, t.size)
            t, w = t[lo:hi], w[lo:hi]
            device_j[label] = trapezoid_energy_j(t, w, start_s, end_s)
            if label in errors:
                flags.append(
                    Flag(
                        FLAG_MISSING_DEVICE,
                        f"{reader.device.describe()}: some power reads failed ({errors[label]})",
                    )
                )
            inside = int(np.sum((t >= start_s) & (t <= end_s)))
            if inside < 2:
                flags.append(
                    Flag(
                        FLAG_FEW_SAMPLES,
                        f"{reader.device.describe()}: only {inside} sample(s) inside the window",
                    )
                )
            if self.keep_samples:
                kept += [PowerSample(label, float(a), float(b)) for a, b in zip(t, w, strict=True)]
        flags += short_window_flag(self.name, time_s, self._update_period_s)
        return device_measurement(key, self.name, start_s, end_s, device_j, flags, samples=tuple(kept))

    def close(self) -> None:
        try:
            self._stop_poller()
        finally:
            super().close()
