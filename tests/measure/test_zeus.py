"""Zeus meter with an autospec ZeusMonitor / PowerMonitor, and the real Zeus without a GPU."""

from __future__ import annotations

from unittest import mock

import pytest
from zeus.monitor import ZeusMonitor
from zeus.monitor.energy import Measurement as ZeusMeasurement
from zeus.monitor.power import PowerDomain, PowerMonitor

from mtad_energy.measure import (
    FLAG_SHORT_WINDOW,
    FLAG_ZERO_ENERGY,
    MeterUnavailableError,
    MigNotSupportedError,
    ZeusMeter,
    no_sync,
    window,
    zeus_power_timelines,
)
from mtad_energy.measure.zeus_meter import NO_GPU_REASON
from tests.measure.conftest import StepClock


def zeus_monitor(gpu_energy: dict[int, float], time_s: float = 2.0) -> mock.NonCallableMagicMock:
    monitor = mock.create_autospec(ZeusMonitor, instance=True)
    monitor.gpu_indices = sorted(gpu_energy)
    monitor.end_window.return_value = ZeusMeasurement(time=time_s, gpu_energy=gpu_energy)
    return monitor


def test_exact_joules_and_no_double_sync() -> None:
    monitor = zeus_monitor({0: 120.5, 1: 80.0})
    meter = ZeusMeter(monitor=monitor, clock=StepClock(), env={})
    assert meter.devices == ("gpu0", "gpu1")
    with window(meter, "gen", sync=no_sync) as w:
        pass
    m = w.result()
    assert m.device_energy_j == {"gpu0": 120.5, "gpu1": 80.0}
    assert m.energy_j == 200.5 and m.time_s == 2.0 and m.meter == "zeus"
    monitor.begin_window.assert_called_once_with("gen", sync_execution=False)
    monitor.end_window.assert_called_once_with("gen", sync_execution=False)


def test_empty_gpu_energy_gives_none_with_reason() -> None:
    meter = ZeusMeter(monitor=zeus_monitor({}), clock=StepClock(), env={})
    meter.begin_window("w")
    m = meter.end_window("w")
    assert m.energy_j is None
    assert m.reason == NO_GPU_REASON


def test_zero_energy_and_short_window_flagged() -> None:
    meter = ZeusMeter(monitor=zeus_monitor({0: 0.0}, time_s=0.01), clock=StepClock(), env={})
    meter.begin_window("w")
    assert meter.end_window("w").flag_codes == (FLAG_ZERO_ENERGY, FLAG_SHORT_WINDOW)


def test_mig_env_is_refused() -> None:
    with pytest.raises(
        MigNotSupportedError, match=r"CUDA_VISIBLE_DEVICES names a MIG slice \(MIG-abc\)"
    ):
        ZeusMeter(monitor=zeus_monitor({}), env={"CUDA_VISIBLE_DEVICES": "MIG-abc"})


def test_real_zeus_without_gpu_reports_clearly(no_nvml: None) -> None:
    meter = ZeusMeter(env={})
    with window(meter, "w", sync=no_sync) as w:
        pass
    assert w.result().energy_j is None
    assert w.result().reason == NO_GPU_REASON


def test_power_timelines_with_memory_domain_and_stop_in_finally() -> None:
    monitor = mock.create_autospec(PowerMonitor, instance=True)
    monitor.measurement_domains = [PowerDomain.DEVICE_INSTANT, PowerDomain.MEMORY_AVERAGE]
    monitor.get_all_power_timelines.return_value = {
        "device_instant": {0: [(100.0, 300.0), (101.0, 500.0)]},
        "memory_average": {0: [(100.0, 50.0), (101.0, 70.0)]},
    }
    factory = mock.Mock(return_value=monitor)
    with pytest.raises(RuntimeError, match="body"):
        with zeus_power_timelines(
            domains=["device_instant", "memory_average"], monitor_factory=factory
        ) as rec:
            assert rec.domains == ("device_instant", "memory_average")
            lines = rec.timelines(start_s=100.0, end_s=101.0)
            raise RuntimeError("body")
    monitor.stop.assert_called_once_with()
    factory.assert_called_once_with(
        gpu_indices=None, update_period=None, power_domains=["device_instant", "memory_average"]
    )
    assert [(t.domain, t.device) for t in lines] == [
        ("device_instant", "gpu0"),
        ("memory_average", "gpu0"),
    ]
    assert lines[0].energy_j(100.0, 101.0) == 400.0
    assert lines[1].energy_j(100.0, 101.0) == 60.0


def test_power_timelines_unknown_domain_and_no_gpu() -> None:
    with pytest.raises(ValueError, match="unknown Zeus power domain 'hbm'"):
        with zeus_power_timelines(domains=["hbm"]):
            pass
    factory = mock.Mock(side_effect=RuntimeError("no GPUs"))
    with pytest.raises(MeterUnavailableError) as err:
        with zeus_power_timelines(monitor_factory=factory):
            pass
    assert str(err.value) == (
        "Zeus PowerMonitor could not start (RuntimeError: no GPUs); power timelines need a GPU."
    )
