"""Simulated sensor: exact traces, windows, delay, rise time, presets, and the simulated meter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mtad_energy.measure import (
    FLAG_SHORT_WINDOW,
    PRESETS,
    PowerProfile,
    PowerTrace,
    RooflineDevice,
    SensorModel,
    SimClock,
    SimulatedGPU,
    SimulatedMeter,
    get_preset,
    no_sync,
    polled_energy_j,
    window,
)


def square(period_s: float = 0.1, high_s: float = 0.025) -> PowerTrace:
    """High 400 W for `high_s` at the start of every period, else 100 W, for 10 s."""
    n = 100
    profile = PowerProfile.periodic(n, high_s, 400.0, period_s - high_s, 100.0)
    return PowerTrace.from_profile(profile, start_s=0.0, before_w=100.0, after_w=100.0)


class TestTrace:
    def test_profile_energy_is_exact(self) -> None:
        p = PowerProfile.concat(
            PowerProfile.constant(0.5, 200.0), PowerProfile.periodic(3, 0.1, 300.0, 0.1, 100.0)
        )
        assert p.duration_s == pytest.approx(1.1)
        assert p.energy_j == pytest.approx(100.0 + 3 * 40.0)
        trace = PowerTrace.from_profile(p, start_s=2.0, before_w=50.0, after_w=60.0)
        assert trace.energy_j(2.0, 3.1) == pytest.approx(220.0)
        assert trace.energy_j(1.0, 2.0) == pytest.approx(50.0)
        assert trace.energy_j(3.1, 4.1) == pytest.approx(60.0)

    def test_from_callable(self) -> None:
        p = PowerProfile.from_callable(lambda t: 100.0 + 100.0 * t, 1.0, step_s=0.01)
        assert p.energy_j == pytest.approx(150.0)  # midpoint rule is exact for a linear ramp

    def test_lowpass_cumulative_matches_numerical_integral(self) -> None:
        trace = PowerTrace.from_changes([0.0, 1.0, 1.3], [100.0, 300.0, 50.0])
        tau = 0.2
        t = np.linspace(-1.0, 3.0, 400_001)
        y = trace.filtered_power_at(t, tau)
        numeric = np.sum((y[1:] + y[:-1]) / 2 * np.diff(t))
        exact = trace.cumulative_j(3.0, tau) - trace.cumulative_j(-1.0, tau)
        assert exact == pytest.approx(numeric, rel=1e-8)
        # y' = (x - y) / tau integrates to: filtered - true = -tau * (y(end) - y(start))
        y_end, y_start = trace.filtered_power_at(np.array([3.0, -1.0]), tau)
        assert exact - trace.energy_j(-1.0, 3.0) == pytest.approx(
            -tau * (y_end - y_start), rel=1e-9
        )


class TestSensorModel:
    def test_part_time_window_sees_only_its_phase(self) -> None:
        trace = square()
        # updates at k*0.1 + 0.025: the window [k*0.1, k*0.1 + 0.025] is the high part
        high = SensorModel(0.1, 0.025, phase_s=0.025)
        low = SensorModel(0.1, 0.025, phase_s=0.075)
        t = np.array([1.03, 5.07])
        assert np.allclose(high.readings_w(trace, t), 400.0)
        assert np.allclose(low.readings_w(trace, t), 100.0)
        assert high.coverage == 0.25

    def test_full_window_sees_the_mean(self) -> None:
        s = SensorModel(0.1, 0.1, phase_s=0.037)
        assert np.allclose(s.readings_w(square(), np.array([2.0, 3.3])), 175.0)

    def test_reading_holds_until_the_next_update_and_delay_shifts_it(self) -> None:
        step = PowerTrace.from_changes([0.0, 1.0], [0.0, 100.0])
        s = SensorModel(0.1, 0.0)
        assert s.readings_w(step, np.array([0.99, 1.0, 1.05]))[0] == 0.0
        assert s.readings_w(step, np.array([1.05]))[0] == 100.0
        delayed = SensorModel(0.1, 0.0, delay_s=0.05)
        assert delayed.readings_w(step, np.array([1.05, 1.1]))[0] == 0.0
        assert delayed.readings_w(step, np.array([1.1]))[0] == 100.0

    def test_rise_time_is_ten_to_ninety_percent(self) -> None:
        step = PowerTrace.from_changes([0.0, 1.0], [0.0, 100.0])
        s = SensorModel(1e-4, 0.0, rise_time_s=0.5)
        tau = 0.5 / math.log(9.0)
        t10 = 1.0 - tau * math.log(0.9)
        t90 = 1.0 - tau * math.log(0.1)
        assert t90 - t10 == pytest.approx(0.5)
        assert s.readings_w(step, np.array([t10 + 1e-4]))[0] == pytest.approx(10.0, abs=0.05)
        assert s.readings_w(step, np.array([t90 + 1e-4]))[0] == pytest.approx(90.0, abs=0.05)

    def test_invalid_parameters(self) -> None:
        with pytest.raises(ValueError, match="update_period_s must be > 0, got 0"):
            SensorModel(0, 0.1)


def test_presets_match_yang_et_al() -> None:
    a = get_preset("a100-h100")
    assert (a.instant.update_period_s, a.instant.window_s) == (0.1, 0.025)
    c = get_preset("ampere-ada")
    assert (c.instant.update_period_s, c.instant.window_s, c.draw.window_s) == (0.1, 0.1, 1.0)
    v = get_preset("v100")
    assert (v.instant.update_period_s, v.instant.window_s) == (0.02, 0.01)
    assert set(PRESETS) == {"a100-h100", "ampere-ada", "v100"}
    with pytest.raises(
        ValueError, match="unknown sensor preset 'h200'; choose from a100-h100, ampere-ada, v100"
    ):
        get_preset("h200")


def test_naive_polling_is_biased_on_a_part_time_sensor() -> None:
    trace = square()
    truth = trace.energy_j(1.0, 9.0)
    s = SensorModel(0.1, 0.025, phase_s=0.075)
    assert polled_energy_j(s, trace, 1.0, 9.0, 0.005) / truth - 1 == pytest.approx(
        100 / 175 - 1, abs=1e-3
    )
    assert polled_energy_j(s, trace, 1.0, 9.0, 1.0, method="sum") == pytest.approx(8 * 100.0)


class TestSimulatedMeter:
    def test_window_on_simulated_time(self) -> None:
        gpu = SimulatedGPU(idle_power_w=50.0, clock=SimClock())
        meter = SimulatedMeter(gpu, sensor=SensorModel(0.1, 0.1))
        gpu.idle(1.0)
        with window(meter, "w", sync=no_sync) as w:
            for _ in range(20):
                gpu.run(PowerProfile.periodic(1, 0.05, 300.0, 0.05, 100.0))
        m = w.result()
        assert m.time_s == pytest.approx(2.0)
        assert meter.true_energy_j(m.start_timestamp_s, m.end_timestamp_s) == pytest.approx(400.0)
        assert m.energy_j == pytest.approx(400.0, rel=0.06)  # one 100 ms lag at the start
        assert len(m.samples) == 401
        assert m.device_energy_j == {"sim0": m.energy_j}

    def test_live_mode_is_a_roofline_device_on_the_real_clock(self) -> None:
        assert isinstance(SimulatedMeter().device, RooflineDevice)  # the live default
        meter = SimulatedMeter(device=RooflineDevice(static_w=10.0, j_per_flop=1e-9, j_per_byte=2e-9))
        meter.device.record(7, 7)  # work outside the window is not billed to it
        meter.begin_window("w")
        meter.device.record(1000, 500)
        m = meter.end_window("w")
        assert m.energy_j == pytest.approx(10.0 * m.time_s + 1e-6 + 1e-6)
        assert m.flag_codes == () and meter.update_period_s is None

    def test_compiled_runs_are_not_tapped_and_their_windows_say_so(self) -> None:
        """A compiled run's forwards are invisible to the tap: the model is left unwrapped (its
        hooks would recompile the graph) and the window is billed static power, flagged."""
        from mtad_energy.measure.simulated import FLAG_WORK_UNSEEN, work_tap

        model = torch.nn.Linear(4, 4)
        meter = SimulatedMeter(device=RooflineDevice(static_w=10.0, j_per_flop=1e-9, j_per_byte=2e-9))
        for compiled in (False, True):
            with work_tap(meter, model, compiled=compiled):
                assert ("forward" in model.__dict__) is not compiled  # wrapped only when eager
                meter.begin_window("w")
                model(torch.ones(1, 4))
                m = meter.end_window("w")
            seen = m.energy_j - 10.0 * m.time_s
            if compiled:
                assert seen == pytest.approx(0.0, abs=1e-12) and m.flag_codes == (FLAG_WORK_UNSEEN,)
            else:
                assert seen > 0 and m.flag_codes == ()
        meter.begin_window("after")  # the flag belongs to windows opened inside the span
        assert meter.end_window("after").flag_codes == ()

    def test_sensor_mode_flags_a_window_shorter_than_the_update_period(self) -> None:
        meter = SimulatedMeter(SimulatedGPU(clock=SimClock()), sensor=SensorModel(0.1, 0.0))
        meter.begin_window("w")
        m = meter.end_window("w")
        assert m.energy_j is not None and m.energy_j >= 0.0
        assert m.flag_codes == (FLAG_SHORT_WINDOW,)

    def test_run_needs_a_sim_clock(self) -> None:
        gpu = SimulatedGPU(clock=lambda: 0.0)
        with pytest.raises(
            TypeError, match="run\\(\\)/idle\\(\\) need a SimulatedGPU on a SimClock"
        ):
            gpu.run(PowerProfile.constant(1.0, 1.0))
