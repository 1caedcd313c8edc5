"""Measurement records, window(), the none meter and trapezoid integration."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from mtad_energy.measure import (
    Flag,
    MeasureError,
    Measurement,
    NoneMeter,
    PowerSample,
    default_sync,
    no_sync,
    trapezoid_energy_j,
    window,
)
from mtad_energy.measure.base import EnergyMeter, total_energy
from tests.measure.conftest import StepClock

PACKAGE = Path(__file__).resolve().parents[2] / "mtad_energy" / "measure"


def test_measurement_to_dict_is_json_and_has_units() -> None:
    m = Measurement(
        name="w",
        meter="nvml-power",
        time_s=2.0,
        start_timestamp_s=1.0,
        end_timestamp_s=3.0,
        energy_j=10.0,
        device_energy_j={"gpu0": 10.0},
        samples=(PowerSample("gpu0", 1.0, 5.0),),
        flags=(Flag("short-window", "x"),),
    )
    d = json.loads(json.dumps(m.to_dict(with_samples=True)))
    assert d["power_w"] == 5.0
    assert d["samples"] == [{"device": "gpu0", "timestamp_s": 1.0, "power_w": 5.0}]
    assert d["flags"] == [{"code": "short-window", "message": "x"}]
    assert "samples" not in m.to_dict() and m.to_dict()["n_samples"] == 1
    with pytest.raises(AttributeError):
        m.energy_j = 1.0  # type: ignore[misc]


def test_none_meter_energy_is_null_with_reason_never_zero() -> None:
    clock = StepClock(5.0)
    meter = NoneMeter(reason="no GPU here", clock=clock)
    assert isinstance(meter, EnergyMeter)
    with window(meter, "gen", sync=no_sync) as w:
        clock.now_s = 7.5
    m = w.result()
    assert m.energy_j is None and m.power_w is None
    assert m.reason == "no GPU here"
    assert m.time_s == 2.5
    assert m.device_energy_j == {}


def test_window_closes_and_keeps_the_measurement_when_the_block_raises() -> None:
    meter = NoneMeter(clock=StepClock())
    syncs: list[str] = []
    with (
        pytest.raises(ValueError, match="boom"),
        window(meter, "w", sync=lambda: syncs.append("s")) as w,
    ):
        raise ValueError("boom")
    assert syncs == ["s", "s"]
    assert w.measurement is not None and w.measurement.name == "w"
    meter.begin_window("w")  # the name is free again: the window was closed


def test_window_closes_even_when_the_end_sync_fails() -> None:
    meter = NoneMeter(clock=StepClock())
    calls = iter([None, RuntimeError("cuda died")])

    def sync() -> None:
        err = next(calls)
        if err:
            raise err

    with pytest.raises(RuntimeError, match="cuda died"), window(meter, "w", sync=sync) as w:
        pass
    assert w.measurement is not None


def test_result_before_exit_is_a_clear_error() -> None:
    with window(NoneMeter(clock=StepClock()), "w", sync=no_sync) as w:
        with pytest.raises(
            MeasureError, match="window 'w' is still open; read .measurement after the with-block"
        ):
            w.result()


def test_end_of_unknown_window() -> None:
    with pytest.raises(
        MeasureError, match="measurement window 'x' is not open; call begin_window first"
    ):
        NoneMeter().end_window("x")


def test_default_sync_is_a_noop_without_cuda() -> None:
    sync = default_sync()
    sync()  # torch here is the CPU build: nothing to wait for


def test_total_energy() -> None:
    assert total_energy({"a": 1.0, "b": 2.5}) == (3.5, None)
    assert total_energy({}) == (None, "no device was measured")
    assert total_energy({"a": 1.0, "b": None}) == (
        None,
        "energy missing for device(s) b; see flags",
    )


class TestTrapezoid:
    def test_exact_on_samples(self) -> None:
        assert trapezoid_energy_j([0, 1, 2], [100, 300, 300], 0, 2) == 500.0

    def test_interpolates_inside_and_holds_outside(self) -> None:
        # window [0.5, 1.5]: p(0.5)=200, p(1)=300, p(1.5)=300 -> 125 + 150
        assert trapezoid_energy_j([0, 1, 2], [100, 300, 300], 0.5, 1.5) == 275.0
        # before the first sample the first value holds
        assert trapezoid_energy_j([1, 2], [100, 100], 0, 2) == 200.0

    def test_duplicate_timestamps_and_errors(self) -> None:
        assert trapezoid_energy_j([0, 1, 1, 2], [10, 10, 20, 20], 0, 2) == 30.0
        with pytest.raises(ValueError, match="no power samples in the window"):
            trapezoid_energy_j([], [], 0, 1)
        with pytest.raises(ValueError, match="window end 0 s is before its start 1 s"):
            trapezoid_energy_j([0], [1], 1, 0)
        with pytest.raises(ValueError, match="power samples must be sorted by timestamp"):
            trapezoid_energy_j([1, 0], [1, 1], 0, 1)


def test_measure_never_imports_decoding() -> None:
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.startswith("mtad_energy.decoding") for n in names), path.name
