"""A fake NVML: the real `pynvml` functions patched with mock autospec (as Zeus's tests do).

Autospec keeps the real signatures, so a call with wrong arguments fails the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from unittest import mock

import pynvml
import pytest


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    energy_mj: list[int | Exception] = field(
        default_factory=lambda: [0]
    )  # consumed one read at a time
    instant_mw: int | None = 300_000  # None: field unsupported
    usage_mw: int | None = 280_000  # None: unsupported
    mig: int | None = None  # None: not MIG-capable; 0/1 current mode
    power_limit_mw: int = 700_000
    pids: tuple[int, ...] = ()
    average_mw: dict[int, int] | None = None  # average power by scope (H100); None: unsupported


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeNvml:
    """State behind the patched functions; handles are the FakeGpu objects themselves."""

    def __init__(self, gpus: list[FakeGpu]):
        self.gpus = gpus
        self.init_error: int | None = None
        self.count_error: int | None = None
        self.energy_reads = 0

    def _gpu(self, handle: object) -> FakeGpu:
        assert isinstance(handle, FakeGpu), (
            f"not a handle from nvmlDeviceGetHandleByIndex: {handle!r}"
        )
        return handle

    # side effects, one per patched NVML function
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise nvml_error(self.init_error)

    def nvmlShutdown(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise nvml_error(self.count_error)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: object) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetMigMode(self, device: object) -> list[int]:
        gpu = self._gpu(device)
        if gpu.mig is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [gpu.mig, gpu.mig]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object) -> int:
        gpu = self._gpu(handle)
        self.energy_reads += 1
        value = gpu.energy_mj.pop(0) if len(gpu.energy_mj) > 1 else gpu.energy_mj[0]
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlDeviceGetFieldValues(self, handle: object, fieldIds: list) -> list:
        gpu = self._gpu(handle)
        out = []
        for fid, scope in fieldIds:
            v = pynvml.c_nvmlFieldValue_t()
            v.fieldId, v.scopeId = fid, scope
            if fid == pynvml.NVML_FI_DEV_POWER_AVERAGE:
                value = None if gpu.average_mw is None else gpu.average_mw.get(scope)
            else:
                assert fid == pynvml.NVML_FI_DEV_POWER_INSTANT
                assert scope == pynvml.NVML_POWER_SCOPE_GPU
                value = gpu.instant_mw
            if value is None:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            else:
                v.nvmlReturn = pynvml.NVML_SUCCESS
                v.value.uiVal = value
            out.append(v)
        return out

    def nvmlDeviceGetPowerUsage(self, handle: object) -> int:
        gpu = self._gpu(handle)
        if gpu.usage_mw is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.usage_mw

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.86.15"

    def nvmlDeviceGetPowerManagementLimit(self, handle: object) -> int:
        return self._gpu(handle).power_limit_mw

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: object) -> int:
        return 700_000

    def nvmlDeviceGetClockInfo(self, handle: object, type: int) -> int:
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[type]

    def nvmlDeviceGetMaxClockInfo(self, handle: object, type: int) -> int:
        return {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 2619}[type]

    def nvmlDeviceGetTemperature(self, handle: object, sensor: int) -> int:
        return 41

    def nvmlDeviceGetPersistenceMode(self, handle: object) -> int:
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list:
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in self._gpu(handle).pids]


PATCHED = [name for name in vars(FakeNvml) if name.startswith("nvml")]


@pytest.fixture
def fake_nvml() -> Iterator[FakeNvml]:
    """Two H100s by default; tests edit `fake.gpus` before building a meter."""
    fake = FakeNvml(
        [
            FakeGpu(uuid="GPU-aaaa1111-0000-0000-0000-000000000000"),
            FakeGpu(uuid="GPU-bbbb2222-0000-0000-0000-000000000000"),
        ]
    )
    patches = [
        mock.patch.object(pynvml, name, autospec=True, side_effect=getattr(fake, name))
        for name in PATCHED
    ]
    for p in patches:
        p.start()
    try:
        yield fake
    finally:
        for p in patches:
            p.stop()


@pytest.fixture
def no_nvml() -> Iterator[None]:
    """NVML as on a machine without the driver, whatever machine the tests run on."""
    err = nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with mock.patch.object(pynvml, "nvmlInit", autospec=True, side_effect=err):
        yield


class StepClock:
    """A clock the test sets by hand (seconds)."""

    def __init__(self, now_s: float = 0.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s
