"""The devices a calibration runs on (`Probe`): a real NVIDIA GPU through NVML, or a
simulated GPU seen through simulated sensors on simulated time."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from mtad_energy.measure._nvml import init_nvml, require_devices, shutdown_nvml, visible_devices
from mtad_energy.measure.base import Clock, EnergyMeter, MeterUnavailableError, SyncFn, no_sync
from mtad_energy.measure.nvml import DEFAULT_POLL_INTERVAL_S
from mtad_energy.measure.sensor import PowerProfile, get_preset
from mtad_energy.measure.simulated import SimClock, SimulatedCounterMeter, SimulatedGPU, SimulatedMeter

COUNTER, POWER, ZEUS, NAIVE = "nvml-counter", "nvml-power", "zeus", "power.draw-1s"
ROLES = (COUNTER, POWER, ZEUS, NAIVE)
"""The meters compared: the energy counter, instant power polled every 5 ms, Zeus, and
nvidia-smi's power.draw polled every second (the naive method Yang et al. measured)."""

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


NAIVE_POLL_S = 1.0  # nvidia-smi --loop=1


@contextlib.contextmanager
def nvml_probe(env: Mapping[str, str] | None = None, clock: Clock | None = None,
               sleep: Callable[[float], object] = time.sleep, sync: SyncFn = no_sync,
               zeus_monitor: Any | None = None) -> Iterator[Probe]:
    """The first GPU visible to this process (CUDA_VISIBLE_DEVICES picks another), measured by
    the four meters of `ROLES`; NVML stays started while the probe is open. Raises
    `MeterUnavailableError` (with NVML's reason) where there is no usable GPU."""
    from mtad_energy.measure.nvml import NvmlCounterMeter, NvmlPowerMeter
    from mtad_energy.measure.zeus_meter import ZeusMeter

    nv = init_nvml()
    try:
        try:
            devices, _ = visible_devices(nv, env)
        except nv.NVMLError as err:
            raise MeterUnavailableError(f"NVML started but could not list the GPUs ({err}); check "
                                        "the driver with `nvidia-smi`") from err
        require_devices(devices, env)
        dev, clock = devices[0], clock or time.perf_counter
        one = {"CUDA_VISIBLE_DEVICES": dev.uuid}  # the meters measure this GPU only

        def counter_j() -> float:
            return nv.nvmlDeviceGetTotalEnergyConsumption(dev.handle) / 1000.0

        meters = {
            COUNTER: lambda: NvmlCounterMeter(env=one, clock=clock),
            POWER: lambda: NvmlPowerMeter(DEFAULT_POLL_INTERVAL_S, env=one, clock=clock,
                                          keep_samples=False),
            ZEUS: lambda: ZeusMeter(gpu_indices=[dev.cuda_index], monitor=zeus_monitor, clock=clock,
                                    env=env),
            NAIVE: lambda: NvmlPowerMeter(NAIVE_POLL_S, env=one, clock=clock, keep_samples=False,
                                          field="power.draw"),
        }
        average, note = _average_power_reader(nv, dev.handle)
        yield Probe(dev.uuid, dev.name, meters, counter_j, clock, sleep, sync, average,
                    notes=(note,) if note else ())
    finally:
        shutdown_nvml(nv)


def _average_power_reader(nv: Any, handle: Any) -> tuple[Callable[[], tuple[float, float]] | None,
                                                          str | None]:
    """Board and memory average power (H100: NVML_FI_DEV_POWER_AVERAGE, GPU and memory scope),
    or None and why where the driver or GPU does not report them."""
    fields = [(nv.NVML_FI_DEV_POWER_AVERAGE, nv.NVML_POWER_SCOPE_GPU),
              (nv.NVML_FI_DEV_POWER_AVERAGE, nv.NVML_POWER_SCOPE_MEMORY)]

    def read() -> tuple[float, float]:
        values = nv.nvmlDeviceGetFieldValues(handle, fields)
        for v in values:
            if v.nvmlReturn != nv.NVML_SUCCESS:
                raise nv.NVMLError(v.nvmlReturn)
        return values[0].value.uiVal / 1e3, values[1].value.uiVal / 1e3

    try:
        read()
    except nv.NVMLError as err:
        return None, f"memory power: this GPU does not report memory-scope average power ({err})"
    return read, None


def simulated_probe(preset: str = "a100-h100", idle_power_w: float = 120.0,
                    busy_power_w: float = 430.0) -> tuple[Probe, list[Workload]]:
    """A simulated GPU (``preset``'s sensors) on simulated time, with a steady and a bursty
    decode-like workload: the whole calibration runs in a second of real time."""
    sensors = get_preset(preset)  # raises with the list of presets
    clock = SimClock()
    gpu = SimulatedGPU(idle_power_w, clock)
    period = sensors.instant.update_period_s
    meters = {
        COUNTER: lambda: SimulatedCounterMeter(gpu, update_period_s=period, phase_s=period / 3),
        POWER: lambda: SimulatedMeter(gpu, sensor=sensors.instant.with_phase(period / 3)),
        # Zeus reads NVML's energy counter on Volta and newer: simulated as that counter
        ZEUS: lambda: SimulatedCounterMeter(gpu, update_period_s=period, phase_s=period / 3),
        NAIVE: lambda: SimulatedMeter(gpu, sensor=sensors.draw.with_phase(period / 3),
                                      poll_interval_s=NAIVE_POLL_S),
    }
    reader = SimulatedCounterMeter(gpu, update_period_s=period, phase_s=period / 3)
    # steady: 10 ms of kernels alternating 1 ms at busy and 1 ms 15 % lower; bursty: the same
    # 10 ms, then 15 ms idle while the host prepares the next step
    busy = PowerProfile.periodic(5, 0.001, busy_power_w, 0.001, 0.85 * busy_power_w)
    bursty = PowerProfile.concat(busy, PowerProfile.constant(0.015, idle_power_w))
    workloads = [
        Workload("steady", lambda: gpu.run(busy), busy.duration_s,
                 f"10 ms of simulated kernels at {busy_power_w:g}/{0.85 * busy_power_w:g} W"),
        Workload("bursty", lambda: gpu.run(bursty), bursty.duration_s,
                 f"the steady repetition, then 15 ms idle at {idle_power_w:g} W"),
    ]
    probe = Probe(f"simulated-{preset}", f"simulated GPU ({sensors.description})", meters,
                  reader.read_j, clock, gpu.idle, no_sync, simulated=True,
                  notes=("simulated: zeus is modelled as the energy counter it reads",))
    return probe, workloads
