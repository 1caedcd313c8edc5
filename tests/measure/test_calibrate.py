"""Calibration of a GPU's meters: against an autospec-mocked NVML (exact joules, exact messages),
on a simulated GPU, the records later runs reference, and the short-window flag."""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

import pynvml
import pytest
from zeus.monitor import ZeusMonitor
from zeus.monitor.energy import Measurement as ZeusMeasurement

from mtad_energy.bench.calibrate import (
    CalibrationPlan,
    calibrate_meters,
    choose_meter,
    counter_update_period_s,
    shortest_window_s,
)
from mtad_energy.measure import (
    FLAG_BELOW_MIN_WINDOW,
    MeterUnavailableError,
    NvmlCounterMeter,
    no_sync,
    snapshot,
    window,
)
from mtad_energy.measure.calibration import (
    CalibratedMeter,
    CalibrationError,
    CalibrationRecord,
    load_record,
    record_path,
    save_record,
)
from mtad_energy.measure.env import calibrated
from mtad_energy.measure.mitigation import MitigationConfig
from mtad_energy.measure.probes import (
    COUNTER,
    NAIVE,
    POWER,
    ROLES,
    ZEUS,
    Workload,
    nvml_probe,
    simulated_probe,
)
from tests.measure.conftest import FakeNvml, StepClock

PLAN = CalibrationPlan(idle_s=0.5, settle_s=0.1, plain_s=2.0, period_probe_s=1.0, period_poll_s=0.025,
                       window_lengths_s=(0.05, 0.2, 1.0), window_repeats=2,
                       mitigation=MitigationConfig(min_repetitions=8, min_duration_s=1.0,
                                                   warmup_s=0.1, idle_s=0.5))


class Ramp(list):
    """An energy counter (mJ) that follows the test clock at a constant power."""

    def __init__(self, clock: StepClock, power_w: float):
        super().__init__([0, 0])
        self.clock, self.power_w = clock, power_w

    def __len__(self) -> int:
        return 2  # never the last reading: the fake keeps popping

    def pop(self, index: int = -1) -> int:
        return round(self.clock.now_s * self.power_w * 1000)


def sleeper(clock: StepClock):
    def sleep(seconds: float) -> None:
        clock.now_s = round(clock.now_s + seconds, 9)
    return sleep


def zeus_at(clock: StepClock, power_w: float) -> mock.NonCallableMagicMock:
    """An autospec ZeusMonitor reading `power_w` watts on GPU 0 over each window."""
    monitor = mock.create_autospec(ZeusMonitor, instance=True)
    monitor.gpu_indices = [0]
    starts: dict[str, float] = {}
    monitor.begin_window.side_effect = lambda key, sync_execution: starts.__setitem__(key, clock.now_s)
    monitor.end_window.side_effect = lambda key, sync_execution: ZeusMeasurement(
        time=clock.now_s - starts[key], gpu_energy={0: power_w * (clock.now_s - starts[key])})
    return monitor


def clock_workloads(clock: StepClock) -> list[Workload]:
    """Repetitions that only move the clock: the fake GPU's power is constant."""
    sleep = sleeper(clock)
    return [Workload(name, lambda rep=rep: sleep(rep), rep, name)
            for name, rep in (("steady", 0.01), ("bursty", 0.025))]


def test_the_counter_update_period_is_timed_by_polling_the_counter(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpus = fake_nvml.gpus[:1]
    # the counter moves every 4th read; reads are 25 ms apart: every 100 ms
    fake_nvml.gpus[0].energy_mj = [1000 * (i // 4) for i in range(60)]
    clock = StepClock()
    with nvml_probe(env={}, clock=clock, sleep=sleeper(clock)) as probe:
        period, changes = counter_update_period_s(probe.counter_j, clock, sleeper(clock), 1.0, 0.025)
    assert period == pytest.approx(0.1, abs=1e-9) and changes == 10


def test_calibrate_on_nvml_exact_joules_and_the_verdict(fake_nvml: FakeNvml) -> None:
    clock = StepClock()
    gpu = fake_nvml.gpus[0]  # instant power 300 W, power.draw 280 W
    gpu.energy_mj = Ramp(clock, 300.0)
    fake_nvml.gpus[1].energy_mj = Ramp(clock, 1000.0)  # the second GPU is not calibrated
    gpu.average_mw = {pynvml.NVML_POWER_SCOPE_GPU: 300_000, pynvml.NVML_POWER_SCOPE_MEMORY: 111_000}
    with nvml_probe(env={}, clock=clock, sleep=sleeper(clock), zeus_monitor=zeus_at(clock, 300.0)) as probe:
        assert (probe.device_id, probe.device_name) == (gpu.uuid, "NVIDIA H100 80GB HBM3")
        assert probe.notes == ()
        cal = calibrate_meters(probe, clock_workloads(clock), PLAN)
    rows = {(r["workload"], r["protocol"], r["meter"]): r for r in cal.rows}
    assert {m for _, _, m in rows} == set(ROLES)
    idle = {m: rows["idle", "plain", m] for m in ROLES}
    assert idle[COUNTER]["energy_j"] == 150.0 and idle[COUNTER]["time_s"] == 0.5  # 300 W x 0.5 s
    assert idle[POWER]["energy_j"] == pytest.approx(150.0, rel=1e-12)
    assert idle[NAIVE]["energy_j"] == pytest.approx(140.0, rel=1e-12)
    assert idle[ZEUS]["energy_j"] == pytest.approx(150.0, rel=1e-12)
    steady = rows["steady", "plain", COUNTER]
    assert (steady["reps"], steady["energy_j"], steady["energy_per_rep_j"]) == (200, 600.0, 3.0)
    assert (steady["board_average_power_w"], steady["memory_average_power_w"]) == (300.0, 111.0)
    assert rows["bursty", "plain", NAIVE]["energy_per_rep_j"] == pytest.approx(7.0, rel=1e-12)
    assert rows["bursty", "mitigated", COUNTER]["energy_per_rep_j"] == pytest.approx(7.5, rel=1e-12)
    assert rows["bursty", "mitigated", COUNTER]["idle_power_w"] == pytest.approx(300.0, rel=1e-12)
    assert rows["bursty", "plain", NAIVE]["vs_counter"] == pytest.approx(-1 / 15, rel=1e-9)
    assert cal.counter_update_period_s == pytest.approx(0.025, abs=1e-9)  # it moves at every read
    assert (cal.trusted, cal.idle_power_w) == (COUNTER, 300.0)
    assert cal.min_window_s == pytest.approx(0.05, abs=1e-12)  # 2 repetitions: exact at any length
    assert cal.verdict == (
        "trust nvml-counter: its plain windows are within +0.0% of the protocol's consensus on "
        "steady and bursty work (tolerance ±5%); zeus +0.0%, nvml-power +0.0%, power.draw-1s -6.7%",
        "shortest window worth measuring with nvml-counter: 0.05 s (every reading of the bursty "
        "workload within ±5% from there on); later runs flag shorter windows 'below-calibrated-min'",
        "the energy counter updates every 25 ms (40 updates seen)",
        "idle power 300 W (subtract idle power x time for dynamic energy)",
        "naive 1 s power.draw polling is off by -6.7% of the consensus on bursty work, -6.7% under "
        "the protocol",
    )


def test_a_gpu_without_memory_power_or_zeus_is_calibrated_with_the_others(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpus = fake_nvml.gpus[:1]
    clock = StepClock()
    fake_nvml.gpus[0].energy_mj = Ramp(clock, 300.0)
    with nvml_probe(env={}, clock=clock, sleep=sleeper(clock)) as probe:
        assert probe.notes == ("memory power: this GPU does not report memory-scope average power "
                               "(Not Supported)",)
        def no_zeus():
            raise ImportError("no zeus here")

        probe = dataclasses.replace(probe, meters={**probe.meters, ZEUS: no_zeus})
        cal = calibrate_meters(probe, clock_workloads(clock), PLAN)
    assert {"workload": "-", "meter": ZEUS, "protocol": "-", "error": "no zeus here"} in [
        {k: r.get(k) for k in ("workload", "meter", "protocol", "error")} for r in cal.rows]
    assert cal.trusted == COUNTER and cal.verdict[-1] == (
        "memory power: this GPU does not report memory-scope average power (Not Supported)")


def test_the_trusted_meter_is_the_first_within_tolerance_else_the_closest() -> None:
    errors = {COUNTER: {"steady": 0.08, "bursty": 0.01}, POWER: {"steady": 0.01, "bursty": -0.02},
              NAIVE: {"steady": -0.13, "bursty": 0.14}, ZEUS: {"steady": 0.01}}  # zeus: one only
    assert choose_meter(errors, ["steady", "bursty"], 0.05) == (POWER, (
        "its plain windows are within -2.0% of the protocol's consensus on steady and bursty work "
        "(tolerance ±5%); nvml-counter +8.0%, power.draw-1s +14.0%"))
    assert choose_meter(errors, ["steady", "bursty"], 0.01) == (POWER, (
        "no meter's plain windows are within ±1% of the protocol's consensus; nvml-power comes "
        "closest (-2.0%): measure with the protocol (--mitigate on)"))
    assert choose_meter({}, ["steady"], 0.05) == (None, "no meter gave energy on every workload")


def test_no_gpu_is_refused_with_nvmls_reason(no_nvml) -> None:
    refused = pytest.raises(MeterUnavailableError,
                            match=r"NVML could not start .*this machine has no usable NVIDIA driver")
    with refused, nvml_probe(env={}):
        pass


def test_the_shortest_window_is_where_every_longer_one_is_within_tolerance() -> None:
    sweep = [{"length_s": length, "time_s": length * 1.01, "error": err}
             for length, err in ((0.1, 0.3), (0.2, 0.01), (0.5, 0.08), (1.0, 0.04), (1.0, -0.05),
                                 (2.0, 0.0))]
    assert shortest_window_s(sweep, 0.05) == pytest.approx(1.01)  # 0.2 s was lucky, 0.5 s not
    assert shortest_window_s(sweep, 0.01) == pytest.approx(2.02)
    assert shortest_window_s([*sweep, {"length_s": 4.0, "time_s": 4.0, "error": None}], 0.05) is None


def test_a_simulated_gpu_is_calibrated_on_simulated_time() -> None:
    probe, works = simulated_probe("a100-h100")
    cal = calibrate_meters(probe, works, CalibrationPlan.quick())
    assert probe.device_id == "simulated-a100-h100" and probe.simulated
    assert cal.counter_update_period_s == pytest.approx(0.1, abs=1e-9)
    assert cal.idle_power_w == pytest.approx(120.0, rel=1e-9)
    # the sensor sees 25 % of the time: 1 s power.draw polling of steady kernels is far off
    naive = next(r for r in cal.rows if (r["workload"], r["protocol"], r["meter"]) ==
                 ("steady", "plain", NAIVE))
    assert naive["vs_counter"] < -0.1
    sweep = {r["length_s"]: abs(r["error"]) for r in cal.sweep if r["length_s"] in (0.05, 2.0)}
    assert sweep[0.05] > 0.3 and sweep[2.0] < 0.05  # a counter of 100 ms updates reads 50 ms badly
    assert cal.trusted in ROLES and 0.1 < cal.min_window_s <= 2.1


def record(min_window_s: float | None = 2.0, device_id: str = "GPU-aaaa1111-0000-0000-0000-000000000000"
           ) -> CalibrationRecord:
    return CalibrationRecord(device_id, "NVIDIA H100 80GB HBM3", 1.7e9, False, COUNTER, min_window_s, 0.05,
                             0.1, 120.0, 3.0e12, (), (), (), ("trust nvml-counter",))


def test_a_record_round_trips_and_a_damaged_one_names_the_file(tmp_path) -> None:
    r = record()
    path = save_record(r, tmp_path)
    assert path == tmp_path / "GPU-aaaa1111-0000-0000-0000-000000000000.json"
    assert load_record(r.device_id, tmp_path) == r and load_record("GPU-other", tmp_path) is None
    path.write_text("{")
    with pytest.raises(CalibrationError, match=f"{path} is not a readable calibration record .*; delete "
                                               "it or run `mtad-energy calibrate` again on that GPU"):
        load_record(r.device_id, tmp_path)


def test_later_runs_reference_the_record_and_flag_windows_below_its_minimum(fake_nvml: FakeNvml,
                                                                            calibration_records) -> None:
    r = record()
    save_record(r)  # $MTAD_ENERGY_CALIBRATION
    before = snapshot(env={"CUDA_VISIBLE_DEVICES": "1"})  # the other GPU: not calibrated
    snap = snapshot(env={"CUDA_VISIBLE_DEVICES": "0"})
    assert before.calibrations == () and snap.calibrations == (r.reference(),)
    assert snap.to_dict()["calibrations"] == [r.reference()]
    assert "calibrations" in snap.stable_fields() and "calibrations" not in before.stable_fields()
    fake_nvml.gpus[0].energy_mj = [0, 0, 1_500, 1_500, 5_000]
    clock = StepClock()
    meter, snap2 = calibrated(NvmlCounterMeter(env={"CUDA_VISIBLE_DEVICES": "0"}, clock=clock), snap)
    assert isinstance(meter, CalibratedMeter) and snap2.calibrations == snap.calibrations
    assert meter.name == "nvml-counter" and meter.devices == ("gpu0",)
    with window(meter, "decode", no_sync) as short:
        clock.now_s = 0.5
    with window(meter, "mitigation-group0", no_sync) as protocol:
        clock.now_s = 1.0
    m = short.result()
    assert m.energy_j == 1.5  # the meter's own reading, untouched
    assert m.flags[-1].code == FLAG_BELOW_MIN_WINDOW and m.flags[-1].message == (
        f"window of 0.5 s is shorter than the 2 s that the calibration of NVIDIA H100 80GB HBM3 "
        f"(record {r.record_id}) found worth measuring with nvml-counter: its energy may be off by "
        "more than ±5%; measure longer windows or use --mitigate on")
    assert FLAG_BELOW_MIN_WINDOW not in protocol.result().flag_codes  # the protocol measures short work
    meter.close()


def test_an_uncalibrated_device_keeps_its_meter(fake_nvml: FakeNvml) -> None:
    snap = snapshot(env={})
    meter = NvmlCounterMeter(env={}, clock=StepClock())
    assert calibrated(meter, snap) == (meter, snap)
    meter.close()


def test_a_simulated_meter_finds_the_simulated_record(calibration_records) -> None:
    from mtad_energy.measure import get_meter

    r = record(0.5, "simulated-a100-h100")
    save_record(r)
    meter, snap = calibrated(get_meter("simulated"), snapshot(env={}))
    assert isinstance(meter, CalibratedMeter) and snap.calibrations == (r.reference(),)
    assert record_path("simulated-a100-h100") == calibration_records / "simulated-a100-h100.json"
    assert json.loads(record_path(r.device_id).read_text())["record_id"] == r.record_id
