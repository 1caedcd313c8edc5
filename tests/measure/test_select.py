"""Meter selection by name and `auto`."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtad_energy.measure import (
    MeterUnavailableError,
    NoneMeter,
    NvmlCounterMeter,
    NvmlPowerMeter,
    SimulatedMeter,
    get_meter,
    select_meter,
)
from tests.measure.conftest import FakeNvml
from tests.measure.test_rapl import zone


def test_no_gpu_no_rapl_gives_none_with_the_reasons(no_nvml: None, tmp_path: Path) -> None:
    choice = select_meter(env={}, rapl_root=tmp_path / "none")
    assert choice.name == "none"
    assert isinstance(choice.meter, NoneMeter)
    nvml_msg = (
        "NVML could not start (NVML Shared Library Not Found); this machine has no usable NVIDIA "
        "driver. "
        "Use a CPU meter ('rapl' or 'none') or run on a GPU machine."
    )
    rapl_msg = (
        f"RAPL is not available: {tmp_path / 'none'} does not exist "
        "(no powercap driver, or not Linux)."
    )
    assert choice.rejected == (
        ("nvml-counter", nvml_msg),
        ("nvml-power", nvml_msg),
        ("zeus", "skipped: Zeus measures through NVML too, which failed above"),
        ("rapl", rapl_msg),
        ("simulated", "never chosen automatically (it simulates a sensor)"),
    )
    # one sentence per cause (NVML once, though two meters failed on it), where the rest is, and
    # the modelled meter: never the ~600 characters of every rejection (issue 27 item 9)
    assert choice.reason == (
        "no energy meter here: NVML could not start (NVML Shared Library Not Found), and "
        f"RAPL is not available: {tmp_path / 'none'} does not exist (no powercap driver, or not "
        "Linux), so energy is null (`--meter simulated` models a GPU, `mtad-energy env` says why "
        "in full)"
    )
    meter = choice.meter
    meter.begin_window("w")
    m = meter.end_window("w")
    assert m.energy_j is None and m.reason == choice.reason
    from mtad_energy.results.analysis import short_reason

    assert short_reason(choice.reason) == choice.reason
    assert "not rapl: RAPL is not available" in choice.describe()


def test_auto_prefers_the_energy_counter(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    choice = select_meter(env={}, rapl_root=tmp_path)
    assert choice.name == "nvml-counter"
    assert isinstance(choice.meter, NvmlCounterMeter)
    assert choice.reason == "NVML total-energy counter on gpu0, gpu1"
    assert choice.rejected == (
        ("nvml-power", "lower priority than nvml-counter"),
        ("zeus", "lower priority than nvml-counter"),
        ("rapl", "lower priority than nvml-counter"),
        ("simulated", "never chosen automatically (it simulates a sensor)"),
    )


def test_auto_falls_back_to_power_polling_before_volta(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    import pynvml

    from tests.measure.conftest import nvml_error

    for gpu in fake_nvml.gpus:
        gpu.energy_mj = [nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)]
    choice = select_meter(env={}, rapl_root=tmp_path)
    assert choice.name == "nvml-power"
    assert isinstance(choice.meter, NvmlPowerMeter)
    assert choice.rejected[0][0] == "nvml-counter"
    assert choice.rejected[0][1].startswith(
        "nvml-counter needs the total-energy counter (Volta or newer)"
    )
    choice.meter.close()


def test_auto_picks_rapl_without_gpu(no_nvml: None, tmp_path: Path) -> None:
    zone(tmp_path / "intel-rapl:0", "package-0", 5)
    choice = select_meter(env={}, rapl_root=tmp_path)
    assert choice.name == "rapl"
    assert choice.reason == "CPU RAPL counters (package-0); no GPU meter available"


def test_get_meter_by_name() -> None:
    assert isinstance(get_meter("none"), NoneMeter)
    assert isinstance(get_meter("simulated", preset="v100"), SimulatedMeter)
    with pytest.raises(ValueError) as err:
        get_meter("nvidia-smi")
    assert str(err.value) == (
        "unknown meter 'nvidia-smi'; choose from auto, nvml-counter, nvml-power, zeus, rapl, "
        "none, simulated"
    )


def test_get_meter_named_but_unavailable_raises(no_nvml: None) -> None:
    with pytest.raises(MeterUnavailableError, match="NVML could not start"):
        get_meter("nvml-counter")
