"""Environment snapshot (what numbers were measured on) and a pre-flight GPU-sharing check."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from mtad_energy.measure.base import EnergyMeter, MeterUnavailableError
from mtad_energy.measure.calibration import CalibratedMeter, calibration_refs, load_record

LIBRARIES = (
    "mtad-energy",
    "torch",
    "numpy",
    "transformers",
    "nvidia-ml-py",
    "zeus",
    "scipy",
    "pandas",
)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it. Power in watts, clocks in MHz, temperature in degrees C;
    a field NVML cannot read on this GPU is None."""

    cuda_index: int
    nvml_index: int
    name: str
    uuid: str
    power_limit_w: float | None
    default_power_limit_w: float | None
    sm_clock_mhz: int | None
    memory_clock_mhz: int | None
    max_sm_clock_mhz: int | None
    max_memory_clock_mhz: int | None
    temperature_c: int | None
    persistence_mode: bool | None


@dataclass(frozen=True)
class EnvSnapshot:
    """Where and with what a measurement ran.

    `snapshot_id` hashes the stable fields only (hardware, driver, power limits, versions, git
    revision), not clocks, temperatures or the time, so runs on the same setup share an id.
    """

    timestamp_unix_s: float
    hostname: str
    platform: str
    python: str
    cpu_model: str
    cpu_count: int
    driver_version: str | None
    cuda_visible_devices: str | None
    gpus: tuple[GpuInfo, ...]
    libraries: Mapping[str, str | None]
    git_revision: str | None
    git_dirty: bool | None
    nvml_error: str | None
    calibrations: tuple[Mapping[str, Any], ...] = ()  # `mtad-energy calibrate` records in force
    threads: Mapping[str, Any] = field(default_factory=dict)  # `thread_settings`

    def stable_fields(self) -> dict[str, Any]:
        volatile = {"sm_clock_mhz", "memory_clock_mhz", "temperature_c"}
        return {
            "platform": self.platform,
            "python": self.python,
            "cpu_model": self.cpu_model,
            "cpu_count": self.cpu_count,
            "driver_version": self.driver_version,
            "cuda_visible_devices": self.cuda_visible_devices,
            "gpus": [{k: v for k, v in asdict(g).items() if k not in volatile} for g in self.gpus],
            "libraries": dict(self.libraries),
            "git_revision": self.git_revision,
            "git_dirty": self.git_dirty,
            # only when calibrated: the ids of uncalibrated setups stay what they were
            **({"calibrations": [c["record_id"] for c in self.calibrations]}
               if self.calibrations else {}),
            # threads and wait policy decide CPU speed under load: another setting, another setup
            **({"threads": dict(self.threads)} if self.threads else {}),
        }

    @property
    def snapshot_id(self) -> str:
        blob = json.dumps(self.stable_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gpus"] = [asdict(g) for g in self.gpus]
        out["libraries"] = dict(self.libraries)
        out["calibrations"] = [dict(c) for c in self.calibrations]
        out["threads"] = dict(self.threads)
        out["snapshot_id"] = self.snapshot_id
        return out


def cpu_model() -> str:
    """CPU model name (from /proc/cpuinfo on Linux, `platform` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "GOMP_SPINCOUNT")


def thread_settings(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The CPU thread setup: torch's intra- and inter-op threads (None when torch was not imported:
    it is never imported here), the OpenMP/MKL variables (None where unset) and the CPUs this
    process may run on."""
    env = os.environ if env is None else env
    torch = sys.modules.get("torch")
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "torch_interop_threads": torch.get_num_interop_threads() if torch is not None else None,
        **{name.lower(): env.get(name) for name in THREAD_VARIABLES},
        "affinity_cpus": affinity,
    }


def library_versions(names: Sequence[str] = LIBRARIES) -> dict[str, str | None]:
    """Installed versions by distribution name, without importing the packages (None if absent)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision(cwd: Path | None = None) -> tuple[str | None, bool | None]:
    """(HEAD commit, working tree has changes) or (None, None) outside a git checkout."""
    where = cwd or Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return rev or None, bool(status.strip())


def _nvml_value(pynvml: ModuleType, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except pynvml.NVMLError:  # a field unsupported on this GPU is expected, not an error
        return None


def _gpu_info(pynvml: ModuleType, dev: Any) -> GpuInfo:
    h = dev.handle
    limit = _nvml_value(pynvml, pynvml.nvmlDeviceGetPowerManagementLimit, h)
    default = _nvml_value(pynvml, pynvml.nvmlDeviceGetPowerManagementDefaultLimit, h)
    persistence = _nvml_value(pynvml, pynvml.nvmlDeviceGetPersistenceMode, h)
    return GpuInfo(
        cuda_index=dev.cuda_index,
        nvml_index=dev.nvml_index,
        name=dev.name,
        uuid=dev.uuid,
        power_limit_w=None if limit is None else limit / 1000.0,
        default_power_limit_w=None if default is None else default / 1000.0,
        sm_clock_mhz=_nvml_value(pynvml, pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM),
        memory_clock_mhz=_nvml_value(
            pynvml, pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM
        ),
        max_sm_clock_mhz=_nvml_value(
            pynvml, pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM
        ),
        max_memory_clock_mhz=_nvml_value(
            pynvml, pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM
        ),
        temperature_c=_nvml_value(
            pynvml, pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU
        ),
        persistence_mode=None if persistence is None else bool(persistence),
    )


def _read_gpus(env: Mapping[str, str]) -> tuple[tuple[GpuInfo, ...], str | None, str | None]:
    """(GPUs, driver version, error text); NVML problems become the error text, never a raise."""
    from mtad_energy.measure._nvml import (
        init_nvml,
        shutdown_nvml,
        text,
        visible_devices,
    )

    try:
        pynvml = init_nvml()
    except MeterUnavailableError as err:
        return (), None, str(err)
    try:
        driver = _nvml_value(pynvml, pynvml.nvmlSystemGetDriverVersion)
        devices, _ = visible_devices(pynvml, env)
        return (
            tuple(_gpu_info(pynvml, d) for d in devices),
            None if driver is None else text(driver),
            None,
        )
    except MeterUnavailableError as err:
        return (), None, str(err)
    finally:
        shutdown_nvml(pynvml)


def snapshot(env: Mapping[str, str] | None = None, repo: Path | None = None) -> EnvSnapshot:
    """Describe this machine and software; GPU fields are empty (with `nvml_error`) without NVML.
    The calibrations (`mtad-energy calibrate`) stored for its GPUs are referenced."""

    env = os.environ if env is None else env
    gpus, driver, nvml_error = _read_gpus(env)
    rev, dirty = git_revision(repo)
    return EnvSnapshot(
        timestamp_unix_s=time.time(),
        hostname=platform.node(),
        platform=platform.platform(),
        python=sys.version.split()[0],
        cpu_model=cpu_model(),
        cpu_count=os.cpu_count() or 0,
        driver_version=driver,
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        gpus=gpus,
        libraries=library_versions(),
        git_revision=rev,
        git_dirty=dirty,
        nvml_error=nvml_error,
        calibrations=calibration_refs([g.uuid for g in gpus]),
        threads=thread_settings(env),
    )


def preflight_check(
    env: Mapping[str, str] | None = None, own_pid: int | None = None, warn: bool = True
) -> list[str]:
    """Warnings for every other process computing on a GPU this process measures.

    NVML measures the whole GPU, so another process's work is billed to ours. Returns the
    messages (empty when the GPUs are ours alone or there is no NVML) and, with `warn`, also
    emits each as a `RuntimeWarning`.
    """
    from mtad_energy.measure._nvml import init_nvml, shutdown_nvml, visible_devices

    env = os.environ if env is None else env
    own = os.getpid() if own_pid is None else own_pid
    try:
        pynvml = init_nvml()
    except MeterUnavailableError:
        return []
    messages: list[str] = []
    try:
        devices, _ = visible_devices(pynvml, env)
        for dev in devices:
            try:
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(dev.handle)
            except pynvml.NVMLError as err:
                messages.append(
                    f"{dev.describe()}: cannot list its processes ({err}); sharing not checked."
                )
                continue
            others = sorted({p.pid for p in procs if p.pid != own})
            if others:
                messages.append(
                    f"{dev.describe()} is also used by process(es) {', '.join(map(str, others))}; "
                    "their work "
                    "would be counted in this measurement. Stop them or measure on another GPU."
                )
    except MeterUnavailableError as err:
        messages.append(str(err))
    finally:
        shutdown_nvml(pynvml)
    if warn:
        for msg in messages:
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return messages


def meter_device_ids(meter: EnergyMeter, snap: EnvSnapshot) -> list[str]:
    """What the calibrations of ``meter``'s devices are filed under: the GPU UUIDs (from the
    snapshot, by CUDA index), or ``simulated-<preset>`` for the simulated meter."""
    if meter.name == "simulated":
        preset = getattr(meter, "preset", None)
        return [f"simulated-{preset}"] if preset else []
    by_label = {f"gpu{g.cuda_index}": g.uuid for g in snap.gpus}
    return [by_label[d] for d in meter.devices if d in by_label]


def calibrated(meter: EnergyMeter, snap: EnvSnapshot, directory: Path | None = None
               ) -> tuple[EnergyMeter, EnvSnapshot]:
    """``meter`` flagging windows below its devices' calibrated minimum (the longest of them),
    and ``snap`` referencing those calibrations; both unchanged where none was calibrated."""
    records = [r for d in meter_device_ids(meter, snap) if (r := load_record(d, directory))]
    refs = list(snap.calibrations)
    refs += [r.reference() for r in records if r.record_id not in {x["record_id"] for x in refs}]
    snap = dataclasses.replace(snap, calibrations=tuple(refs))
    minimums = [(r.min_window_s, r) for r in records if r.min_window_s is not None]
    if not minimums:
        return meter, snap
    minimum, record = max(minimums, key=lambda x: x[0])
    return CalibratedMeter(meter, minimum, record), snap
