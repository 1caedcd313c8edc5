"""Environment snapshot and the pre-flight GPU sharing check."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mtad_energy.measure import preflight_check, snapshot
from tests.measure.conftest import FakeNvml


def test_snapshot_without_nvml(no_nvml: None) -> None:
    snap = snapshot(env={})
    assert snap.gpus == () and snap.driver_version is None
    assert snap.nvml_error is not None and snap.nvml_error.startswith("NVML could not start")
    assert snap.cpu_count >= 1 and snap.cpu_model
    assert snap.libraries["torch"] is not None
    d = json.loads(json.dumps(snap.to_dict()))
    assert d["snapshot_id"] == snap.snapshot_id and len(snap.snapshot_id) == 16


def test_snapshot_with_gpus(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpus[1].power_limit_mw = 500_000
    snap = snapshot(env={"CUDA_VISIBLE_DEVICES": "1"})
    assert snap.driver_version == "570.86.15"
    (gpu,) = snap.gpus
    assert (gpu.cuda_index, gpu.nvml_index, gpu.name) == (0, 1, "NVIDIA H100 80GB HBM3")
    assert (gpu.power_limit_w, gpu.default_power_limit_w) == (500.0, 700.0)
    assert (gpu.sm_clock_mhz, gpu.memory_clock_mhz, gpu.temperature_c) == (1980, 2619, 41)
    assert gpu.persistence_mode is None  # unsupported field: absent, not an error
    assert snap.cuda_visible_devices == "1"


def test_snapshot_id_ignores_volatile_fields(fake_nvml: FakeNvml) -> None:
    snap = snapshot(env={})
    hotter = dataclasses.replace(
        snap,
        timestamp_unix_s=snap.timestamp_unix_s + 100,
        gpus=tuple(dataclasses.replace(g, temperature_c=80, sm_clock_mhz=1200) for g in snap.gpus),
    )
    assert hotter.snapshot_id == snap.snapshot_id
    capped = dataclasses.replace(
        snap, gpus=tuple(dataclasses.replace(g, power_limit_w=300.0) for g in snap.gpus)
    )
    assert capped.snapshot_id != snap.snapshot_id


def test_preflight_warns_about_other_processes(fake_nvml: FakeNvml) -> None:
    fake_nvml.gpus[0].pids = (1234, 4242)
    fake_nvml.gpus[1].pids = (1234,)
    with pytest.warns(RuntimeWarning) as record:
        messages = preflight_check(env={}, own_pid=1234)
    assert messages == [
        "gpu0 (NVIDIA H100 80GB HBM3, NVML index 0) is also used by process(es) 4242; their work "
        "would be "
        "counted in this measurement. Stop them or measure on another GPU."
    ]
    assert [str(w.message) for w in record] == messages


def test_preflight_is_quiet_without_nvml(no_nvml: None) -> None:
    assert preflight_check(env={}) == []
