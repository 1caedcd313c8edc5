"""Measurement core: energy meters, window(), error mitigation, the ops profiler, contention, the
environment snapshot and the calibration records it references.

Typical use::

    from mtad_energy.measure import get_meter, window

    with get_meter("auto") as meter, window(meter, "generate") as w:
        run()
    print(w.measurement.energy_j, w.measurement.flags)

What a forward's FLOPs and bytes are, and how joules split over them, is the energy model
(`mtad_energy.energy`), which this package imports (the simulated device charges its counts);
the procedure that calibrates meters is `mtad_energy.bench.calibrate`.

This package never imports `mtad_energy.decoding`; torch, pynvml, Zeus and scipy are imported
only when a backend needs them.
"""

from mtad_energy.energy.tap import RooflineDevice, WorkTap  # the simulated device's work
from mtad_energy.measure.base import (
    FLAG_BELOW_MIN_WINDOW,
    FLAG_COUNTER_RESET,
    FLAG_COUNTER_WRAP,
    FLAG_DEVICE_ORDER,
    FLAG_FEW_SAMPLES,
    FLAG_MISSING_DEVICE,
    FLAG_POWER_FALLBACK,
    FLAG_SHORT_WINDOW,
    FLAG_ZERO_ENERGY,
    EnergyMeter,
    Flag,
    MeasureError,
    Measurement,
    MeterUnavailableError,
    MigNotSupportedError,
    PowerSample,
    WindowHandle,
    default_sync,
    no_sync,
    window,
)
from mtad_energy.measure.env import EnvSnapshot, GpuInfo, preflight_check, snapshot
from mtad_energy.measure.integrate import trapezoid_energy_j
from mtad_energy.measure.memory import PeakMemory, peak_memory
from mtad_energy.measure.mitigation import (
    GroupResult,
    MitigatedEnergy,
    MitigationConfig,
    measure_mitigated,
)
from mtad_energy.measure.none import NoneMeter
from mtad_energy.measure.nvml import NvmlCounterMeter, NvmlPowerMeter
from mtad_energy.measure.profiler import (
    DevicePeaks,
    OpRecord,
    ProfileResult,
    export_trace,
    get_peaks,
    measure_peaks,
    profile_ops,
)
from mtad_energy.measure.rapl import RaplMeter
from mtad_energy.measure.select import METER_NAMES, MeterChoice, get_meter, meter_for, select_meter
from mtad_energy.measure.sensor import (
    PRESETS,
    PowerProfile,
    PowerTrace,
    SensorModel,
    SensorPreset,
    get_preset,
    polled_energy_j,
)
from mtad_energy.measure.simulated import (
    SimClock,
    SimulatedGPU,
    SimulatedMeter,
    work_tap,
)
from mtad_energy.measure.zeus_meter import (
    PowerTimeline,
    ZeusMeter,
    zeus_power_timelines,
)

__all__ = [
    "FLAG_BELOW_MIN_WINDOW",
    "FLAG_COUNTER_RESET",
    "FLAG_COUNTER_WRAP",
    "FLAG_DEVICE_ORDER",
    "FLAG_FEW_SAMPLES",
    "FLAG_MISSING_DEVICE",
    "FLAG_POWER_FALLBACK",
    "FLAG_SHORT_WINDOW",
    "FLAG_ZERO_ENERGY",
    "METER_NAMES",
    "PRESETS",
    "DevicePeaks",
    "EnergyMeter",
    "EnvSnapshot",
    "Flag",
    "GpuInfo",
    "GroupResult",
    "MeasureError",
    "Measurement",
    "MeterChoice",
    "MeterUnavailableError",
    "MigNotSupportedError",
    "MitigatedEnergy",
    "MitigationConfig",
    "NoneMeter",
    "NvmlCounterMeter",
    "NvmlPowerMeter",
    "OpRecord",
    "PeakMemory",
    "PowerProfile",
    "PowerSample",
    "PowerTimeline",
    "PowerTrace",
    "ProfileResult",
    "RaplMeter",
    "RooflineDevice",
    "SensorModel",
    "SensorPreset",
    "SimClock",
    "SimulatedGPU",
    "SimulatedMeter",
    "WindowHandle",
    "WorkTap",
    "ZeusMeter",
    "default_sync",
    "export_trace",
    "get_meter",
    "meter_for",
    "get_peaks",
    "get_preset",
    "measure_mitigated",
    "measure_peaks",
    "no_sync",
    "peak_memory",
    "polled_energy_j",
    "preflight_check",
    "profile_ops",
    "select_meter",
    "snapshot",
    "trapezoid_energy_j",
    "window",
    "work_tap",
    "zeus_power_timelines",
]
