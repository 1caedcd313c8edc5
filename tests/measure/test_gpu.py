"""Smoke tests against a real NVIDIA GPU; skipped on machines without one."""

from __future__ import annotations

import time

import pytest

from mtad_energy.measure import MeterUnavailableError, NvmlCounterMeter, NvmlPowerMeter, window


def _has_gpu() -> bool:
    try:
        NvmlCounterMeter().close()
    except MeterUnavailableError:
        return False
    return True


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU with NVML"),
]


@pytest.mark.parametrize("meter_cls", [NvmlCounterMeter, NvmlPowerMeter])
def test_real_meter_reads_positive_energy(meter_cls: type) -> None:
    with meter_cls() as meter, window(meter, "idle") as w:
        time.sleep(0.5)
    m = w.result()
    assert m.energy_j is not None and m.energy_j > 0
    assert 1.0 < m.power_w < 2000.0  # an idle GPU draws tens of watts, never kilowatts
