"""The `simulated` meter: a simulated GPU seen through a simulated sensor, or a simulated device
whose energy follows a known FLOP / byte / static model.

Two ways to drive it:

* simulated time (tests, `experiments/sensor_error.py`): a `SimulatedGPU` on a `SimClock`;
  `gpu.run(profile)` is one workload repetition and `gpu.idle(s)` is the sleep function, so
  the whole window / mitigation path runs in microseconds of real time;
* live (`get_meter("simulated")`): real clock and a `RooflineDevice`: a window's energy is
  ``static_w * T + j_per_flop * FLOPs + j_per_byte * bytes`` of the work the models did inside
  it, counted from the tensors their forwards touched (`mtad_energy.energy.tap.WorkTap`, attached with
  ``meter.tap(model, ...)``), so a CPU-only pipeline produces joules with a known truth: a fit of
  the energy roofline must recover the device's coefficients.

  The tap costs host time on every forward it sees (a Python call per aten op and per module:
  3x the decode time of a tiny model, 1.13x of opt-125m on one CPU thread), so a measured
  generation never runs under it: `tapped_apart` learns the generation's work per window in an
  untimed, tapped pass of the same seeded generation first, then the timed pass runs untapped
  and each of its windows is charged the work its phase did in the learning pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from mtad_energy.energy.tap import RooflineDevice
from mtad_energy.measure.base import (
    Clock,
    Flag,
    Measurement,
    MeterBase,
    PowerSample,
    WindowBook,
    short_window_flag,
)
from mtad_energy.measure.integrate import trapezoid_energy_j
from mtad_energy.measure.nvml import DEFAULT_POLL_INTERVAL_S
from mtad_energy.measure.sensor import PowerProfile, PowerTrace, SensorModel, get_preset

FLAG_WORK_UNSEEN = "work-unseen"  # a roofline window whose compiled forwards no tap saw


class SimClock:
    """A clock that moves only when told to (seconds)."""

    def __init__(self, start_s: float = 0.0):
        self._now_s = float(start_s)

    def __call__(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock back by {seconds} s")
        self._now_s += seconds


class SimulatedGPU:
    """Records the true power of a simulated device as a piecewise-constant trace.

    Args:
        idle_power_w: power when nothing runs (watts).
        clock: a `SimClock` for simulated time, or a real clock for live use.
    """

    def __init__(self, idle_power_w: float = 60.0, clock: Clock | None = None):
        self.idle_power_w = float(idle_power_w)
        self.clock: Clock = clock if clock is not None else SimClock()
        now = self.clock()
        self._change_s: list[float] = [now]
        self._power_w: list[float] = [self.idle_power_w]

    def set_power(self, power_w: float) -> None:
        """True power becomes `power_w` from now on."""
        now = self.clock()
        if now < self._change_s[-1]:
            raise ValueError("simulated clock went backwards")
        if now == self._change_s[-1]:
            self._power_w[-1] = float(power_w)  # a later change at the same instant wins
        else:
            self._change_s.append(now)
            self._power_w.append(float(power_w))

    def _sim_clock(self) -> SimClock:
        if not isinstance(self.clock, SimClock):
            raise TypeError(
                "run()/idle() need a SimulatedGPU on a SimClock; live GPUs follow meter windows"
            )
        return self.clock

    def run(self, profile: PowerProfile) -> None:
        """Run one repetition: the power follows `profile`, the clock advances by its duration."""
        clock = self._sim_clock()
        for d, p in zip(profile.durations_s, profile.power_w, strict=True):
            self.set_power(p)
            clock.advance(d)
        self.set_power(self.idle_power_w)

    def idle(self, seconds: float) -> None:
        """Sleep: idle power for `seconds` (the protocol's injectable sleep)."""
        self.set_power(self.idle_power_w)
        self._sim_clock().advance(seconds)

    def trace(self) -> PowerTrace:
        return PowerTrace.from_changes(self._change_s, self._power_w)

    def true_energy_j(self, start_s: float, end_s: float) -> float:
        return self.trace().energy_j(start_s, end_s)


class _SimulatedDevice(MeterBase):
    """What both simulated meters share: one device, ``sim0``, on the GPU's clock, with the
    update period of ``self.sensor``."""

    name = "simulated"
    gpu: SimulatedGPU
    sensor: SensorModel

    @property
    def devices(self) -> tuple[str, ...]:
        return ("sim0",)

    @property
    def update_period_s(self) -> float | None:
        return self.sensor.update_period_s

    def now(self) -> float:
        return self.gpu.clock()


class SimulatedMeter(_SimulatedDevice):
    """A meter that polls a `SensorModel` watching a `SimulatedGPU`, like `nvml-power` does, or
    reads a `RooflineDevice`'s true energy.

    Sensor mode (``gpu`` given): polls happen every `poll_interval_s` from the window start plus
    one at the end; energy is their trapezoid integral (exactly what the NVML power meter
    computes). Roofline mode (no ``gpu``; the live default): a window's energy is the device's
    model applied to the window's time and the work tapped inside it, exactly (no sensor error),
    so what a fit recovers is checked against a known truth.

    Args:
        gpu: a simulated device seen through the sensor (tests on a `SimClock`).
        device: the roofline device of roofline mode (default `RooflineDevice()`).
        preset: sensor preset name (see `sensor.PRESETS`), used when `sensor` is None.
        field: ``"instant"`` (fastest field) or ``"draw"`` (nvidia-smi power.draw).
        sensor: an explicit sensor model (overrides preset/field).
    """

    def __init__(
        self,
        gpu: SimulatedGPU | None = None,
        preset: str = "a100-h100",
        field: str = "instant",
        sensor: SensorModel | None = None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        keep_samples: bool = True,
        device: RooflineDevice | None = None,
    ):
        self.gpu = gpu
        self.device = device if device is not None or gpu is not None else RooflineDevice()
        self.preset = preset if sensor is None else None  # what a calibration is filed under
        self.sensor = sensor if sensor is not None else get_preset(preset).field(field)
        self.poll_interval_s = poll_interval_s
        self.keep_samples = keep_samples
        self._book = WindowBook()
        self._blind = 0  # open `blind()` spans: compiled forwards the tap cannot see
        self._learned: list[tuple[int, int]] | None = None  # `replayed`: work per window, in order

    @property
    def update_period_s(self) -> float | None:
        return self.sensor.update_period_s if self.gpu is not None else None

    def now(self) -> float:
        return self.gpu.clock() if self.gpu is not None else self.device.clock()

    def tap(self, *models: Any) -> Any:
        """Context manager: count the work of ``models``' forwards for the roofline device (a
        no-op in sensor mode, whose power does not depend on the work)."""
        return self.device.tap(*models) if self.device is not None else _no_tap()

    @property
    def learns_work(self) -> bool:
        """Whether windows charge the work of the forwards inside them (roofline mode)."""
        return self.device is not None and self.gpu is None

    @contextmanager
    def replayed(self, works: Sequence[tuple[int, int]]) -> Iterator[None]:
        """Context manager: roofline windows closed inside it are charged ``works`` ((FLOPs,
        bytes) each, in the order they close: what an untimed pass of the same generation did in
        each window, `tapped_apart`) instead of what a tap counted in them."""
        self._learned = list(works)
        try:
            yield
        finally:
            self._learned = None

    @contextmanager
    def blind(self) -> Iterator[None]:
        """Context manager: forwards run where no tap sees them (compiled graphs); roofline
        windows opened inside it are flagged `FLAG_WORK_UNSEEN` (their energy is static power x
        time, plus whatever eager work was still tapped)."""
        self._blind += 1
        try:
            yield
        finally:
            self._blind -= 1

    def begin_window(self, key: str) -> None:
        if self.gpu is None:
            self._book.open(key, (self.now(), self.device.flops, self.device.bytes,
                                  self._blind > 0))
            return
        self._book.open(key, self.now())

    def end_window(self, key: str) -> Measurement:
        if self.gpu is None:
            return self._roofline_window(key)
        start_s = self._book.close(key)
        end_s = self.now()
        polls = np.append(np.arange(start_s, end_s, self.poll_interval_s), end_s)
        readings = self.sensor.readings_w(self.gpu.trace(), polls)
        energy = trapezoid_energy_j(polls, readings, start_s, end_s)
        samples = (
            tuple(
                PowerSample("sim0", float(t), float(p))
                for t, p in zip(polls, readings, strict=True)
            )
            if self.keep_samples
            else ()
        )
        return Measurement(
            name=key,
            meter=self.name,
            time_s=end_s - start_s,
            start_timestamp_s=start_s,
            end_timestamp_s=end_s,
            energy_j=energy,
            device_energy_j={"sim0": energy},
            samples=samples,
            flags=tuple(short_window_flag(self.name, end_s - start_s, self.update_period_s)),
        )

    def _roofline_window(self, key: str) -> Measurement:
        start_s, flops0, bytes0, blind = self._book.close(key)
        end_s = self.now()
        flops, nbytes = self.device.flops - flops0, self.device.bytes - bytes0
        if self._learned:  # replayed: the work the learning pass did in this window
            flops, nbytes = self._learned.pop(0)
        energy = self.device.energy_j(end_s - start_s, flops, nbytes)
        flags = (Flag(FLAG_WORK_UNSEEN, "the simulated device did not see this window's "
                      "compiled forwards: its energy is static power x time alone; run eager "
                      "for modelled work"),) if blind else ()
        return Measurement(name=key, meter=self.name, time_s=end_s - start_s,
                           start_timestamp_s=start_s, end_timestamp_s=end_s, energy_j=energy,
                           device_energy_j={"sim0": energy}, flags=flags)

    def true_energy_j(self, start_s: float, end_s: float) -> float:
        """The true energy of the simulated device over [start_s, end_s] (joules)."""
        return self.gpu.true_energy_j(start_s, end_s)


class SimulatedCounterMeter(_SimulatedDevice):
    """The energy counter of a simulated GPU, like NVML's total-energy counter: the true energy,
    published every `update_period_s` (a read returns the total at the last update, in whole
    millijoules). Full coverage, but a window shorter than a few updates reads the wrong number of
    them: what a calibration's window sweep finds.

    Args:
        gpu: the simulated device (on a `SimClock` or the real clock).
        update_period_s: the counter's update period (seconds).
        phase_s: updates at phase_s + k * update_period_s.
    """

    def __init__(self, gpu: SimulatedGPU, update_period_s: float = 0.1, phase_s: float = 0.0):
        self.gpu = gpu
        self.preset = None
        # only its update grid counts: the counter integrates the true power, all of it
        self.sensor = SensorModel(update_period_s=update_period_s, window_s=update_period_s,
                                  phase_s=phase_s)
        self._book = WindowBook()

    def read_j(self) -> float:
        """The counter now (joules since the simulation started, whole millijoules)."""
        at = self.sensor.last_update_s(self.now())
        return float(np.floor(self.gpu.trace().cumulative_j(at) * 1000.0)) / 1000.0

    def begin_window(self, key: str) -> None:
        self._book.open(key, (self.now(), self.read_j()))

    def end_window(self, key: str) -> Measurement:
        (start_s, start_j), end_j, end_s = self._book.close(key), self.read_j(), self.now()
        energy = end_j - start_j
        return Measurement(
            name=key, meter=self.name, time_s=end_s - start_s, start_timestamp_s=start_s,
            end_timestamp_s=end_s, energy_j=energy, device_energy_j={"sim0": energy},
            flags=tuple(short_window_flag(self.name, end_s - start_s, self.update_period_s)),
        )


@contextmanager
def _no_tap() -> Iterator[None]:
    yield


PhaseHook = Callable[[str], None]


def tapped_apart(meter: Any, models: Sequence[Any], run: Callable[[PhaseHook | None], Any],
                 on_phase: PhaseHook | None, compiled: bool = False) -> Any:
    """``run(on_phase)`` (a seeded generation whose phase hook opens the meter's windows) with the
    work its windows see, but no tap on its timed forwards: where ``meter`` learns work
    (`SimulatedMeter.learns_work`) and windows open (``on_phase``, eager), an untimed tapped pass
    ``run(marks)`` first notes the work each phase did, then the timed pass runs under
    `SimulatedMeter.replayed`. Elsewhere (another meter, compiled, no windows): ``run`` under
    `work_tap`, as before. Costs one more generation per measured one, outside every window."""
    if compiled or on_phase is None or not getattr(meter, "learns_work", False):
        with work_tap(meter, *models, compiled=compiled):
            return run(on_phase)
    device = meter.device
    marks: list[tuple[str, int, int]] = []  # (phase, FLOPs, bytes) at each phase change

    def mark(phase: str) -> None:
        marks.append((phase, device.flops, device.bytes))

    with work_tap(meter, *models):
        run(mark)
    mark("end")
    works = [(f1 - f0, b1 - b0) for (phase, f0, b0), (_, f1, b1)
             in zip(marks, marks[1:], strict=False) if phase in WINDOW_PHASES]
    with meter.replayed(works):
        return run(on_phase)


WINDOW_PHASES = ("prefill", "decode")  # the phases a measured generation opens windows at


def work_tap(meter: Any, *models: Any, compiled: bool = False) -> Any:
    """Context manager: let ``meter`` see the work of ``models``' forwards where it needs to (the
    simulated roofline device); a no-op for every meter that reads a real sensor. ``compiled``
    runs are not tapped: a compiled graph hides its forwards from the tap, and the tap's hooks,
    traced into the graph, would make dynamo recompile at every forward. The roofline device
    then charges static power alone and flags its windows `FLAG_WORK_UNSEEN`."""
    if compiled:
        blind = getattr(meter, "blind", None)
        return blind() if blind is not None else _no_tap()
    tap = getattr(meter, "tap", None)
    return tap(*models) if tap is not None else _no_tap()
