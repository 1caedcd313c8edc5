"""RAPL meter on a fake powercap tree."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from mtad_energy.measure import FLAG_COUNTER_WRAP, MeterUnavailableError, RaplMeter
from mtad_energy.measure.rapl import RaplZone
from tests.measure.conftest import StepClock

RANGE_UJ = 262_143_328_850


def zone(path: Path, name: str, energy_uj: int) -> Path:
    path.mkdir(parents=True)
    (path / "name").write_text(f"{name}\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{RANGE_UJ}\n")
    return path


@pytest.fixture
def powercap(tmp_path: Path) -> Path:
    root = tmp_path / "powercap"
    pkg = zone(root / "intel-rapl:0", "package-0", 1_000_000)
    zone(pkg / "intel-rapl:0:0", "core", 500)  # inside the package: not added
    zone(pkg / "intel-rapl:0:1", "dram", 2_000_000)
    zone(root / "intel-rapl:1", "psys", 9)  # overlaps everything: not added
    return root


def set_uj(path: Path, value: int) -> None:
    (path / "energy_uj").write_text(f"{value}\n")


def test_package_and_dram_exact(powercap: Path) -> None:
    clock = StepClock(0.0)
    meter = RaplMeter(root=powercap, clock=clock)
    assert meter.devices == ("package-0", "package-0/dram")
    meter.begin_window("w")
    set_uj(powercap / "intel-rapl:0", 31_000_000)
    set_uj(powercap / "intel-rapl:0" / "intel-rapl:0:1", 7_000_000)
    clock.now_s = 1.0
    m = meter.end_window("w")
    assert m.device_energy_j == {"package-0": 30.0, "package-0/dram": 5.0}
    assert m.energy_j == 35.0
    assert m.flags == ()


def test_wrap_is_corrected(powercap: Path) -> None:
    clock = StepClock(0.0)
    set_uj(powercap / "intel-rapl:0", RANGE_UJ - 1_000_000)
    meter = RaplMeter(root=powercap, clock=clock)
    meter.begin_window("w")
    set_uj(powercap / "intel-rapl:0", 4_000_000)
    clock.now_s = 1.0
    m = meter.end_window("w")
    assert m.device_energy_j["package-0"] == 5.0
    assert m.flags[0].code == FLAG_COUNTER_WRAP
    assert m.flags[0].message == "package-0: energy counter wrapped at 262143328850 uJ; corrected."


def test_long_window_warns_about_undetectable_wraps(powercap: Path) -> None:
    clock = StepClock(0.0)
    meter = RaplMeter(root=powercap, clock=clock)
    meter.begin_window("w")
    clock.now_s = 600.0
    m = meter.end_window("w")
    assert [f.code for f in m.flags] == [FLAG_COUNTER_WRAP, FLAG_COUNTER_WRAP]
    assert m.flags[0].message.startswith(
        "package-0: window of 600.0 s may span more than one counter wrap"
    )


def test_missing_powercap(tmp_path: Path) -> None:
    with pytest.raises(MeterUnavailableError) as err:
        RaplMeter(root=tmp_path / "nope")
    assert str(err.value) == (
        f"RAPL is not available: {tmp_path / 'nope'} does not exist (no powercap driver, or not "
        "Linux)."
    )


def test_unreadable_counters_explain_the_fix(powercap: Path) -> None:
    with mock.patch.object(
        RaplZone, "read_uj", autospec=True, side_effect=PermissionError("denied")
    ):
        with pytest.raises(MeterUnavailableError) as err:
            RaplMeter(root=powercap)
    assert str(err.value) == (
        f"RAPL counters are not readable ({powercap / 'intel-rapl:0' / 'energy_uj'}: permission "
        "denied); "
        "since Linux 5.10 they are root-only. Run as root or grant read access, e.g. "
        "`sudo chmod o+r /sys/class/powercap/intel-rapl:*/energy_uj`."
    )
