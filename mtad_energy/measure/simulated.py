"""The `simulated` meter: a simulated GPU seen through a simulated sensor, or a simulated device
whose energy follows a known FLOP / byte / static model.

Two ways to drive it:

* simulated time (tests, `experiments/sensor_error.py`): a `SimulatedGPU` on a `SimClock`;
  `gpu.run(profile)` is one workload repetition and `gpu.idle(s)` is the sleep function, so
  the whole window / mitigation path runs in microseconds of real time;
* live (`get_meter("simulated")`): real clock and a `RooflineDevice`: a window's energy is
  ``static_w * T + j_per_flop * FLOPs + j_per_byte * bytes`` of the work the models did inside
  it, counted from the tensors their forwards touched (`WorkTap`, attached with
  ``meter.tap(model, ...)``), so a CPU-only pipeline produces joules with a known truth: a fit of
  the energy roofline must recover the device's coefficients.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

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

    @property
    def update_period_s(self) -> float | None:
        return self.sensor.update_period_s if self.gpu is not None else None

    def now(self) -> float:
        return self.gpu.clock() if self.gpu is not None else self.device.clock()

    def tap(self, *models: Any) -> Any:
        """Context manager: count the work of ``models``' forwards for the roofline device (a
        no-op in sensor mode, whose power does not depend on the work)."""
        return self.device.tap(*models) if self.device is not None else _no_tap()

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
        energy = self.device.energy_j(end_s - start_s, self.device.flops - flops0,
                                      self.device.bytes - bytes0)
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


@dataclass(frozen=True)
class RooflineDevice:
    """A simulated device whose energy is ``static_w * T + j_per_flop * W + j_per_byte * Q``
    (the energy roofline of Choi et al., IPDPS 2013) over the work W (FLOPs) and Q (bytes) its
    `tap` counted. The defaults are made up so that each term carries a visible share of the
    joules at a CPU's speed on the default pair; they are not any real GPU's values."""

    static_w: float = 30.0
    j_per_flop: float = 2e-9
    j_per_byte: float = 3e-9
    clock: Clock = time.perf_counter
    counter: list[int] | None = None  # [flops, bytes] done so far (mutable: the device's state)

    def __post_init__(self) -> None:
        if self.counter is None:
            object.__setattr__(self, "counter", [0, 0])

    @property
    def flops(self) -> int:
        return self.counter[0]

    @property
    def bytes(self) -> int:
        return self.counter[1]

    def record(self, flops: int, nbytes: int) -> None:
        self.counter[0] += int(flops)
        self.counter[1] += int(nbytes)

    def energy_j(self, time_s: float, flops: float, nbytes: float) -> float:
        return self.static_w * time_s + self.j_per_flop * flops + self.j_per_byte * nbytes

    def tap(self, *models: Any) -> Any:
        """Context manager: while open, every forward of ``models`` adds its work (`WorkTap`)."""
        return WorkTap(self.record).attached(*models)


class WorkTap:
    """Counts the work of a model's forwards from the tensors they touch, independently of any
    counting formula: FLOPs from torch's formulas for every matrix product and attention op
    dispatched (`profiler.matrix_flops`; dynamically quantised linear layers by their shapes);
    bytes as the parameters read (each once per forward, by the modules that ran: a draft head's
    layer that a forward skips reads nothing; an embedding table as the rows it gathers), the KV
    cache tensors before and after the forward (all of them read by attention; a cache that
    grew into a new tensor was copied: old ones read, new ones written; one updated in place
    wrote only the new columns), and the logits written (a forward returning a bare tensor:
    that tensor).

    ``attached(*models)`` wraps each model's ``forward`` (and hooks its embedding and quantised
    linear modules) until it exits; ``on_work(flops, bytes)`` is called after every forward.
    Eager forwards only: a ``torch.compile``d forward is not seen."""

    def __init__(self, on_work: Callable[[int, int], None]):
        self.on_work = on_work
        self._gathered = 0  # embedding bytes and quantised-linear FLOPs of the current forward
        self._extra_flops = 0
        self._ran: set[int] = set()  # modules owning parameters that ran in the current forward

    @contextmanager
    def attached(self, *models: Any) -> Iterator[WorkTap]:
        import torch

        unique = list({id(m): m for m in models if m is not None}.values())
        hooks, wrapped = [], []
        seen: set[int] = set()
        try:
            for model in unique:
                for module in model.modules():
                    if id(module) in seen:  # modules a self-draft shares with its target
                        continue
                    seen.add(id(module))
                    if isinstance(module, torch.nn.Embedding):
                        hooks.append(module.register_forward_hook(self._on_gather))
                    elif callable(getattr(module, "weight", None)):  # dynamic int8 Linear
                        hooks.append(module.register_forward_hook(self._on_quantized_linear))
                    if any(True for _ in module.parameters(recurse=False)):
                        hooks.append(module.register_forward_hook(self._on_ran))
                wrapped.append((model, model.__dict__.get("forward")))
                model.forward = self._wrap(model.forward, _ParamReads(model))
            yield self
        finally:
            for model, own in wrapped:  # the forward it had: its class's, or a wrapper's
                if own is None:
                    del model.forward
                else:
                    model.forward = own
            for hook in hooks:
                hook.remove()

    def _on_gather(self, module: Any, args: Any, out: Any) -> None:
        self._gathered += out.numel() * out.element_size()

    def _on_ran(self, module: Any, args: Any, out: Any) -> None:
        self._ran.add(id(module))

    def _on_quantized_linear(self, module: Any, args: Any, out: Any) -> None:
        self._extra_flops += 2 * args[0].numel() * module.out_features

    def _wrap(self, forward: Callable[..., Any], reads: _ParamReads) -> Callable[..., Any]:
        from mtad_energy.hf_cache import cache_from
        from mtad_energy.measure.profiler import flop_counter

        def tapped(*args: Any, **kwargs: Any) -> Any:
            import torch

            if torch.compiler.is_compiling():  # traced into a compiled graph: not seen
                return forward(*args, **kwargs)
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache = cache_from(kwargs)
            before = _kv_tensors(cache)
            self._gathered = self._extra_flops = 0
            self._ran = set()
            counter = flop_counter()
            with counter:
                out = forward(*args, **kwargs)
            rows, new = ids.shape
            nbytes = (reads.bytes(self._ran) + self._gathered
                      + _kv_traffic(before, _kv_tensors(cache), rows, new))
            logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
            nbytes += logits.numel() * logits.element_size() if logits is not None else 0
            self.on_work(counter.flops + self._extra_flops, nbytes)
            return out

        return tapped


def _full_read_bytes(model: Any) -> int:
    """Bytes of the parameters a forward reads whole: every distinct parameter tensor except the
    tables only embeddings own (those are read as the rows they gather), plus the int8 weights
    of dynamically quantised linear layers (not parameters)."""
    import torch

    embedding_only: set[int] = set()
    other: set[int] = set()
    total = 0
    for module in model.modules():
        if callable(getattr(module, "weight", None)):  # dynamic int8 Linear: packed weights
            for t in (module.weight(), module.bias()):
                total += 0 if t is None else t.numel() * t.element_size()
        owner = embedding_only if isinstance(module, torch.nn.Embedding) else other
        owner.update(id(p) for p in module.parameters(recurse=False))
    counted: set[int] = set()
    for p in model.parameters():  # distinct tensors (a tied table once)
        if id(p) in counted or (id(p) in embedding_only and id(p) not in other):
            continue
        counted.add(id(p))
        total += p.numel() * p.element_size()
    return total


class _ParamReads:
    """The parameter bytes one forward of a model reads: `_full_read_bytes`, less the parameters
    whose every owning module did not run (EAGLE-3's fusion layer on a forward fed the head's own
    features)."""

    def __init__(self, model: Any):
        import torch

        self.full = _full_read_bytes(model)
        self._owners: dict[int, tuple[Any, set[int]]] = {}  # parameter -> (it, its owners)
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                continue  # read as the rows it gathers
            for p in module.parameters(recurse=False):
                self._owners.setdefault(id(p), (p, set()))[1].add(id(module))

    def bytes(self, ran: set[int]) -> int:
        skipped = sum(p.numel() * p.element_size() for p, owners in self._owners.values()
                      if not owners & ran)
        return self.full - skipped


def _kv_tensors(cache: Any) -> list[tuple[int, int, Any] | None]:
    """Per layer of a transformers cache: (data pointer, columns, keys) of its keys, or None
    while the layer holds nothing (empty without a cache)."""
    out: list[tuple[int, int, Any] | None] = []
    for layer in getattr(cache, "layers", None) or []:
        keys = getattr(layer, "keys", None)
        ok = keys is not None and keys.numel() > 0
        out.append((keys.data_ptr(), keys.shape[-2], keys) if ok else None)
    return out


def _kv_traffic(before: list[tuple[int, int, Any] | None], after: list[tuple[int, int, Any] | None],
                rows: int, new: int) -> int:
    """KV bytes of one forward over ``rows`` input rows, keys and values alike: every column of
    each updated layer read by attention; a layer whose tensor was replaced (concatenation) read
    its old columns and wrote the new tensor whole, one updated in place wrote ``new`` columns."""
    total = 0
    for i, now in enumerate(after):
        if now is None:
            continue
        ptr, cols, keys = now
        per_col = 2 * rows * keys.numel() // (keys.shape[0] * cols) * keys.element_size()
        prev = before[i] if i < len(before) else None
        total += per_col * cols  # attention reads every column
        if prev is not None and prev[0] == ptr:
            total += per_col * new  # written in place
        else:
            total += per_col * (cols + (prev[1] if prev is not None else 0))
    return total
