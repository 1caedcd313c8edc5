"""NVML access shared by the NVML meters and the environment snapshot.

All NVML calls go through the `pynvml` module attribute at call time (never `from pynvml import`),
so tests can patch the real functions with `unittest.mock.patch(..., autospec=True)`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mtad_energy.measure.base import (
    FLAG_DEVICE_ORDER,
    Flag,
    MeterUnavailableError,
    MigNotSupportedError,
)


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as the process sees it (`cuda_index`) and as NVML numbers it (`nvml_index`)."""

    cuda_index: int
    nvml_index: int
    uuid: str
    name: str
    handle: Any = field(compare=False, repr=False)

    @property
    def label(self) -> str:
        """Device name used in measurements, e.g. ``"gpu0"`` (the CUDA index)."""
        return f"gpu{self.cuda_index}"

    def describe(self) -> str:
        return f"{self.label} ({self.name}, NVML index {self.nvml_index})"


def text(value: str | bytes) -> str:
    """NVML strings are bytes in old pynvml releases and str in nvidia-ml-py >= 11.5."""
    return value.decode() if isinstance(value, bytes) else value


def load_pynvml() -> ModuleType:
    try:
        import pynvml
    except ImportError as err:
        raise MeterUnavailableError(
            "the NVML Python bindings are not installed; install them with `pip install "
            "nvidia-ml-py`"
        ) from err
    return pynvml


def init_nvml() -> ModuleType:
    """Start NVML (reference-counted by NVML itself; pair with `shutdown_nvml`)."""
    pynvml = load_pynvml()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise MeterUnavailableError(
            f"NVML could not start ({err}); this machine has no usable NVIDIA driver. "
            "Use a CPU meter ('rapl' or 'none') or run on a GPU machine."
        ) from err
    return pynvml


def shutdown_nvml(pynvml: ModuleType) -> None:
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass  # already shut down; nothing left to release


def _parse_visible(spec: str) -> list[str]:
    """Entries of CUDA_VISIBLE_DEVICES up to the first negative index (CUDA ignores the rest)."""
    entries: list[str] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if entry.lstrip("-").isdigit() and int(entry) < 0:
            break
        if entry:
            entries.append(entry)
    return entries


def visible_devices(
    pynvml: ModuleType, env: Mapping[str, str] | None = None
) -> tuple[list[NvmlDevice], list[Flag]]:
    """The GPUs this process can use, mapped to NVML indices, plus flags about the mapping.

    Honours CUDA_VISIBLE_DEVICES with integer indices and GPU UUIDs (full or a unique prefix,
    as CUDA accepts). MIG entries and GPUs in MIG mode are refused: NVML reports power and
    energy for the whole GPU, not for a slice.
    """
    env = os.environ if env is None else env
    count = int(pynvml.nvmlDeviceGetCount())
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
    names = [text(pynvml.nvmlDeviceGetName(h)) for h in handles]

    spec = env.get("CUDA_VISIBLE_DEVICES")
    flags: list[Flag] = []
    if spec is None:
        chosen = list(range(count))
    else:
        chosen = []
        uses_int = False
        for entry in _parse_visible(spec):
            if entry.startswith("MIG-"):
                raise MigNotSupportedError(
                    f"CUDA_VISIBLE_DEVICES names a MIG slice ({entry}); NVML cannot measure the "
                    "power or energy of a MIG slice. Set CUDA_VISIBLE_DEVICES to whole GPUs "
                    "(indices or GPU-UUIDs) or use meter='none'."
                )
            if entry.isdigit():
                idx = int(entry)
                if idx >= count:
                    raise MeterUnavailableError(
                        f"CUDA_VISIBLE_DEVICES entry {entry} is out of range: NVML sees {count} "
                        "GPU(s). "
                        "Fix CUDA_VISIBLE_DEVICES."
                    )
                uses_int = True
            else:
                prefix = entry if entry.startswith("GPU-") else f"GPU-{entry}"
                matches = [i for i, u in enumerate(uuids) if u.startswith(prefix)]
                if len(matches) != 1:
                    what = "no GPU" if not matches else f"{len(matches)} GPUs"
                    raise MeterUnavailableError(
                        f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {what} by UUID "
                        f"(NVML sees {', '.join(uuids) or 'none'}). Fix CUDA_VISIBLE_DEVICES."
                    )
                idx = matches[0]
            if idx in chosen:
                raise MeterUnavailableError(
                    f"CUDA_VISIBLE_DEVICES lists GPU {entry!r} twice; CUDA rejects duplicates. "
                    "Fix CUDA_VISIBLE_DEVICES."
                )
            chosen.append(idx)
        if uses_int and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len(set(names)) > 1:
            # CUDA numbers GPUs fastest-first by default, NVML by PCI bus: integer indices can
            # point at different GPUs when the models differ.
            flags.append(
                Flag(
                    FLAG_DEVICE_ORDER,
                    "CUDA_VISIBLE_DEVICES uses integer indices on a machine with different GPU "
                    "models "
                    "but CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA and NVML may number GPUs "
                    "differently. Set CUDA_DEVICE_ORDER=PCI_BUS_ID or list GPU UUIDs.",
                )
            )

    devices = [
        NvmlDevice(cuda_index=i, nvml_index=n, uuid=uuids[n], name=names[n], handle=handles[n])
        for i, n in enumerate(chosen)
    ]
    for dev in devices:
        refuse_mig(pynvml, dev)
    return devices, flags


def refuse_mig(pynvml: ModuleType, dev: NvmlDevice) -> None:
    """Raise `MigNotSupportedError` when `dev` has MIG mode enabled."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(dev.handle)
    except pynvml.NVMLError:
        return  # not MIG-capable (pre-Ampere or consumer GPU): nothing to refuse
    if current == pynvml.NVML_DEVICE_MIG_ENABLE:
        raise MigNotSupportedError(
            f"{dev.describe()} is in MIG mode; NVML reports power and energy only for the whole "
            "GPU, "
            "which would include other MIG tenants. Disable MIG "
            f"(`nvidia-smi -i {dev.nvml_index} -mig 0`) or use meter='none'."
        )


def require_devices(devices: list[NvmlDevice], env: Mapping[str, str] | None = None) -> None:
    if not devices:
        env = os.environ if env is None else env
        spec = env.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={spec!r} hides them)" if spec is not None else ""
        raise MeterUnavailableError(
            f"no GPU is visible to this process{hint}; nothing for NVML to measure."
        )
