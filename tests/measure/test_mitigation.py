"""The Yang et al. protocol on simulated time.

Error bound (2 %). The sensor presets have no gain error, so what is left is timing: after the
25 ms gap a group's first kept reading can still average part of the gap. The worst case is the
100 ms-window preset: a reading whose window overlaps the gap by g <= 25 ms is held for at most
x = 100 ms - g of kept time, so the error is at most max_x x (100 - x) / 100 ms * dP = 18.75 ms * dP
per group, against >= 1.25 s of kept time per group (5 s / 4 groups): <= 1.5 % of dP / P_mean,
and dP < P_mean. Hence every case below must stay within 2 %, while naive polling of a part-time
sensor is off by tens of percent.
"""

from __future__ import annotations

import math

import pytest

from mtad_energy.measure import (
    PRESETS,
    Measurement,
    MitigationConfig,
    NoneMeter,
    PowerProfile,
    PowerTrace,
    SensorModel,
    SimClock,
    SimulatedGPU,
    SimulatedMeter,
    measure_mitigated,
    polled_energy_j,
)
from mtad_energy.measure.mitigation import FLAG_NO_PHASE_ALIGN, GroupResult, _summarise

BOUND = 0.02
IDLE_W = 60.0
WORKLOADS = {
    "periodic-kernels": PowerProfile.periodic(1, 0.020, 400.0, 0.030, 120.0),
    "short-kernels": PowerProfile.periodic(1, 0.004, 380.0, 0.006, 110.0),
    "steady": PowerProfile.constant(0.5, 300.0),
    "bursty-decode": PowerProfile.concat(
        PowerProfile.constant(0.040, 420.0),
        PowerProfile.periodic(24, 0.006, 330.0, 0.003, 140.0),
        PowerProfile.constant(0.030, 110.0),
    ),
}


def run(profile: PowerProfile, sensor: SensorModel, config: MitigationConfig | None = None):
    gpu = SimulatedGPU(idle_power_w=IDLE_W, clock=SimClock())
    meter = SimulatedMeter(gpu, sensor=sensor, keep_samples=False)
    return measure_mitigated(
        lambda: gpu.run(profile), meter, config, sleep=gpu.idle, sync=lambda: None
    )


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_mitigated_error_within_bound(preset: str, workload: str) -> None:
    profile = WORKLOADS[workload]
    base = PRESETS[preset].instant
    for phase in (0.0, 0.3, 0.55, 0.8):
        result = run(profile, base.with_phase(phase * base.update_period_s))
        assert result.energy_per_rep_j is not None
        error = result.energy_per_rep_j / profile.energy_j - 1
        assert abs(error) <= BOUND, f"{preset}/{workload} phase {phase}: {error:+.2%}"


def test_naive_error_is_large_on_the_part_time_preset() -> None:
    profile = PowerProfile.concat(*[WORKLOADS["periodic-kernels"]] * 60)  # one 3 s run
    trace = PowerTrace.from_profile(profile, start_s=2.0, before_w=IDLE_W, after_w=IDLE_W)
    truth = trace.energy_j(2.0, 5.0)
    sensor = PRESETS["a100-h100"].draw
    errors = [
        polled_energy_j(sensor.with_phase(ph * 0.1), trace, 2.0, 5.0, 0.005) / truth - 1
        for ph in (0.0, 0.3, 0.55, 0.8)
    ]
    assert max(abs(e) for e in errors) > 0.30
    mitigated = run(WORKLOADS["periodic-kernels"], PRESETS["a100-h100"].instant.with_phase(0.055))
    assert abs(mitigated.energy_per_rep_j / WORKLOADS["periodic-kernels"].energy_j - 1) < 0.001


def test_delay_and_rise_time_are_absorbed_by_the_drop() -> None:
    sensor = SensorModel(0.1, 0.025, delay_s=0.02, rise_time_s=0.03, phase_s=0.04)
    for profile in WORKLOADS.values():
        result = run(profile, sensor)
        assert abs(result.energy_per_rep_j / profile.energy_j - 1) <= BOUND


def test_structure_idle_baseline_and_dynamic_energy() -> None:
    profile = WORKLOADS["periodic-kernels"]  # 50 ms per repetition, 232 W mean
    result = run(profile, PRESETS["a100-h100"].instant.with_phase(0.013))
    assert len(result.groups) == 4
    assert all(g.repetitions_dropped == 2 for g in result.groups)  # reps starting at 0 and 50 ms
    assert result.repetitions_kept >= 32
    assert sum(g.time_s for g in result.groups) >= 5.0
    assert result.time_per_rep_s == pytest.approx(0.05)
    # group starts are a quarter sensor period apart (mod the period)
    first = result.groups[0].start_timestamp_s
    for g in result.groups:
        offset = (g.start_timestamp_s - first) % 0.1
        assert min(offset - g.index * 0.025, 0.1 - offset) == pytest.approx(0.0, abs=1e-9)
    assert result.idle_power_w == pytest.approx(IDLE_W)
    true_dynamic = profile.energy_j - IDLE_W * profile.duration_s
    assert result.dynamic_energy_per_rep_j == pytest.approx(true_dynamic, rel=BOUND)
    assert result.ci_low_j <= result.energy_per_rep_j <= result.ci_high_j
    d = result.to_dict()
    assert d["config"]["min_repetitions"] == 32 and len(d["groups"]) == 4


def test_confidence_interval_uses_student_t_over_groups() -> None:
    groups = [GroupResult(i, 0.0, 0, 1, 1.0, float(e)) for i, e in enumerate([1, 2, 3, 4])]
    r = _summarise("x", MitigationConfig(), groups, None, [])
    half = 3.182446305284263 * math.sqrt(5 / 3) / 2  # t(0.975, 3) * sd / sqrt(4)
    assert r.energy_per_rep_j == 2.5
    assert r.ci_low_j == pytest.approx(2.5 - half) and r.ci_high_j == pytest.approx(2.5 + half)
    assert r.dynamic_energy_per_rep_j is None


def test_counter_style_meter_gives_the_exact_energy() -> None:
    """An ideal counter (true energy per window) needs no interpolation: the protocol is exact."""
    gpu = SimulatedGPU(idle_power_w=IDLE_W, clock=SimClock())

    class IdealCounter:
        name = "ideal"
        devices = ("sim0",)
        update_period_s = None

        def __init__(self) -> None:
            self.open: dict[str, float] = {}

        def now(self) -> float:
            return gpu.clock()

        def begin_window(self, key: str) -> None:
            self.open[key] = gpu.clock()

        def end_window(self, key: str) -> Measurement:
            s, e = self.open.pop(key), gpu.clock()
            energy = gpu.true_energy_j(s, e)
            return Measurement(key, self.name, e - s, s, e, energy, {"sim0": energy})

        def close(self) -> None:
            pass

    profile = WORKLOADS["bursty-decode"]
    result = measure_mitigated(
        lambda: gpu.run(profile), IdealCounter(), sleep=gpu.idle, sync=lambda: None
    )
    assert result.energy_per_rep_j == pytest.approx(profile.energy_j, rel=1e-12)
    assert result.idle_power_w == pytest.approx(IDLE_W, rel=1e-12)
    assert [f.code for f in result.flags] == [FLAG_NO_PHASE_ALIGN]
    assert (
        result.flags[0].message == "meter ideal has no known update period; used fixed 0.025 s gaps"
    )


def test_none_meter_gives_no_energy_with_reason() -> None:
    clock = SimClock()
    meter = NoneMeter(reason="no GPU", clock=clock)
    config = MitigationConfig(
        min_repetitions=4, min_duration_s=0.4, warmup_s=0.0, idle_s=0.0, align_phase=False
    )
    result = measure_mitigated(
        lambda: clock.advance(0.01), meter, config, sleep=clock.advance, sync=lambda: None
    )
    assert result.energy_per_rep_j is None and result.ci_low_j is None
    assert result.reason == "meter none gave no energy for at least one group"
    assert result.time_per_rep_s == pytest.approx(0.01)
    assert result.repetitions_kept >= 4


def test_config_is_validated() -> None:
    with pytest.raises(
        ValueError, match=r"groups must be >= 2 to get a confidence interval, got 1"
    ):
        MitigationConfig(groups=1)
    with pytest.raises(ValueError, match=r"min_repetitions \(3\) must be >= groups \(4\)"):
        MitigationConfig(min_repetitions=3)
    with pytest.raises(ValueError, match="gap_s must be >= 0, got -1"):
        MitigationConfig(gap_s=-1)
    with pytest.raises(AttributeError):
        MitigationConfig().groups = 3  # type: ignore[misc]
