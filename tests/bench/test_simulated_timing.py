"""The simulated meter never slows the forwards it times (issue 57, item 3): its work tap costs a
Python call per aten op and per module (3x a tiny model's decode time), so a measured generation
learns its work in an untimed, tapped pass first (`measure.simulated.tapped_apart`) and runs its
timed pass untapped. Asserted by behaviour: where the tap's calls happen, and what the windows
are charged; never by time."""

from __future__ import annotations

import pytest

from mtad_energy.bench.phase_windows import measure_generation
from mtad_energy.config import DecoderSpec
from mtad_energy.decoding.registry import build_decoder
from mtad_energy.decoding.runtime.generate import generate_rows
from mtad_energy.energy.tap import RooflineDevice
from mtad_energy.engines.hf import HfEngine
from mtad_energy.measure.simulated import SimulatedMeter

PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10]]


@pytest.fixture()
def taps_seen(monkeypatch):
    """Every forward the roofline device is charged for, as True when a window of ``meter`` was
    open then (`RooflineDevice.record` runs once per tapped forward)."""
    seen: list[bool] = []
    meter = SimulatedMeter()
    record = RooflineDevice.record

    def counted(self, flops, nbytes):
        seen.append(len(meter._book) > 0)
        record(self, flops, nbytes)

    monkeypatch.setattr(RooflineDevice, "record", counted)
    return meter, seen


@pytest.mark.parametrize("decoder", ["ar", "spd"])
def test_no_tap_call_runs_inside_a_timed_window(llama_pair, taps_seen, decoder):
    meter, seen = taps_seen
    engine = HfEngine(llama_pair, meter=meter)
    measured = measure_generation(engine, DecoderSpec.of(decoder), PROMPTS, 6, 0, meter, "k")
    assert seen and not any(seen), "the tap ran inside a measured window"
    assert set(measured.windows.measurements) == {"prefill", "decode"}


def test_each_window_is_charged_the_work_its_phase_does(llama_pair):
    """The decode window's joules less its static power are the work a tapped run of the same
    seeded generation does in its decode phase, and the prefill window's likewise."""
    spec = DecoderSpec.of("spd")
    meter = SimulatedMeter()
    measured = measure_generation(HfEngine(llama_pair, meter=meter), spec, PROMPTS, 6, 1, meter, "k")

    device = RooflineDevice()  # an independent tap of the same generation, phase by phase
    marks: list[tuple[str, int, int]] = []
    with device.tap(llama_pair.target, llama_pair.draft):
        generate_rows(build_decoder(spec), llama_pair, [list(p) for p in PROMPTS], 6, seed=1,
                      compute_perplexity=False,
                      on_phase=lambda phase: marks.append((phase, device.flops, device.bytes)))
    marks.append(("end", device.flops, device.bytes))
    work = {p: (f1 - f0, b1 - b0)
            for (p, f0, b0), (_, f1, b1) in zip(marks, marks[1:], strict=False)}
    for phase in ("prefill", "decode"):
        m = measured.windows.measurements[phase]
        flops, nbytes = work[phase]
        assert flops > 0 and nbytes > 0
        modelled = device.j_per_flop * flops + device.j_per_byte * nbytes
        assert m.energy_j - device.static_w * m.time_s == pytest.approx(modelled, rel=1e-9)
