"""Calibration records: what `mtad-energy calibrate` found for one device, stored, and how later
runs use it.

A `CalibrationRecord` is stored per device (``$MTAD_ENERGY_CALIBRATION``, default
``<cache>/calibration/<device id>.json``). Later runs on that device reference it in their
environment snapshot (`calibration_refs`), and `measure.env.calibrated` wraps their meter in a
`CalibratedMeter` so that a window shorter than the calibrated minimum carries the `FLAG_BELOW_MIN_WINDOW`
flag (windows of the Yang et al. protocol are exempt: the protocol exists to measure short work).

The procedure that produces a record is `mtad_energy.bench.calibrate`; the probes it reads the
meters through are `measure.probes`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtad_energy.measure.base import (
    FLAG_BELOW_MIN_WINDOW,
    EnergyMeter,
    Flag,
    MeasureError,
    Measurement,
    MeterBase,
)
from mtad_energy.measure.mitigation import MITIGATION_WINDOW_PREFIX
from mtad_energy.paths import cache_dir, env_folder

CALIBRATION_ENV_VAR = "MTAD_ENERGY_CALIBRATION"


class CalibrationError(MeasureError):
    """A calibration record cannot be read; the message names the file and the fix."""


# -- records ------------------------------------------------------------------------------------
def calibration_dir() -> Path:
    """$MTAD_ENERGY_CALIBRATION, else ``calibration/`` in the cache ($MTAD_ENERGY_CACHE, ...);
    a variable naming a file is refused (`paths.env_folder`)."""
    if override := env_folder(CALIBRATION_ENV_VAR):
        return override
    return cache_dir() / "calibration"


@dataclass(frozen=True)
class CalibrationRecord:
    """One device's calibration, as stored and as later runs reference it."""

    device_id: str
    device_name: str
    created_unix_s: float
    simulated: bool
    trusted_meter: str | None
    min_window_s: float | None
    tolerance: float
    counter_update_period_s: float | None
    idle_power_w: float | None
    copy_bandwidth_bytes_per_s: float | None
    floor: tuple[dict[str, Any], ...]
    meters: tuple[dict[str, Any], ...]
    sweep: tuple[dict[str, Any], ...]
    verdict: tuple[str, ...]

    @property
    def record_id(self) -> str:
        blob = json.dumps([self.device_id, self.created_unix_s]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def reference(self) -> dict[str, Any]:
        """What an environment snapshot holds of it."""
        return {"record_id": self.record_id, "device_id": self.device_id,
                "device_name": self.device_name, "created_unix_s": self.created_unix_s,
                "simulated": self.simulated, "trusted_meter": self.trusted_meter,
                "min_window_s": self.min_window_s, "tolerance": self.tolerance}

    def to_dict(self) -> dict[str, Any]:
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return {"record_id": self.record_id, **out}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CalibrationRecord:
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        return cls(**{n: tuple(data[n]) if isinstance(data[n], list) else data[n] for n in names})


def record_path(device_id: str, directory: Path | None = None) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in device_id)
    return (directory or calibration_dir()) / f"{safe}.json"


def check_record_dir(directory: Path | None = None) -> Path:
    """The directory records go to (``directory``, else `calibration_dir`), created and tried
    with a file, before anything is calibrated: a ValueError naming it and the option when it
    cannot be written (minutes of calibrating would otherwise be lost at the end)."""
    where = Path(directory) if directory is not None else calibration_dir()
    probe = where / f".tmp-{os.getpid()}-write-check"
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"cannot write calibration records to {where} (--record-dir, else "
                         f"${CALIBRATION_ENV_VAR}): {err.strerror or err}; pick a directory you "
                         "can write to") from None
    return where


def save_record(record: CalibrationRecord, directory: Path | None = None) -> Path:
    """Write ``record`` (atomically; it replaces the device's previous one); returns the path."""
    path = record_path(record.device_id, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        tmp.write_text(json.dumps(record.to_dict(), indent=2, default=str) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_record(device_id: str, directory: Path | None = None) -> CalibrationRecord | None:
    """The device's calibration, or None if it was never calibrated."""
    path = record_path(device_id, directory)
    try:
        return CalibrationRecord.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as err:
        raise CalibrationError(f"{path} is not a readable calibration record ({err}); delete it or "
                               "run `mtad-energy calibrate` again on that GPU") from None


# -- later runs ---------------------------------------------------------------------------------
class CalibratedMeter(MeterBase):
    """``meter`` with a flag on every window shorter than the calibrated minimum (except the
    Yang et al. protocol's own windows). Everything else is the meter's own."""

    def __init__(self, meter: EnergyMeter, min_window_s: float, record: CalibrationRecord):
        self.meter, self.min_window_s, self.record = meter, min_window_s, record

    def __getattr__(self, name: str) -> Any:  # name, preset, reason, ... of the meter
        if name == "meter":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.meter, name)

    @property
    def devices(self) -> tuple[str, ...]:
        return self.meter.devices

    @property
    def update_period_s(self) -> float | None:
        return self.meter.update_period_s

    def now(self) -> float:
        return self.meter.now()

    def begin_window(self, key: str) -> None:
        self.meter.begin_window(key)

    def end_window(self, key: str) -> Measurement:
        m = self.meter.end_window(key)
        if m.time_s >= self.min_window_s or key.startswith(MITIGATION_WINDOW_PREFIX):
            return m
        r = self.record
        flag = Flag(FLAG_BELOW_MIN_WINDOW,
                    f"window of {m.time_s:.3g} s is shorter than the {self.min_window_s:.3g} s that "
                    f"the calibration of {r.device_name} (record {r.record_id}) found worth measuring "
                    f"with {r.trusted_meter}: its energy may be off by more than "
                    f"±{r.tolerance:.0%}; measure longer windows or use --mitigate on")
        return dataclasses.replace(m, flags=(*m.flags, flag))

    def close(self) -> None:
        self.meter.close()


def calibration_refs(device_ids: Sequence[str], directory: Path | None = None
                     ) -> tuple[dict[str, Any], ...]:
    """References to the stored calibrations of these devices (for an environment snapshot)."""
    return tuple(r.reference() for d in device_ids if (r := load_record(d, directory)))
