"""The `rapl` meter: CPU package and DRAM energy from Linux powercap.

Intel RAPL; recent kernels expose AMD's counters through the same interface.

Measured zones: top-level ``package-N`` zones and their ``dram`` subzones. ``core``/``uncore``
subzones are inside the package and ``psys`` overlaps everything, so they are not added.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from mtad_energy.measure.base import (
    FLAG_COUNTER_WRAP,
    FLAG_MISSING_DEVICE,
    Clock,
    Flag,
    Measurement,
    MeterBase,
    MeterUnavailableError,
    WindowBook,
    device_measurement,
    short_window_flag,
)

POWERCAP_ROOT = Path("/sys/class/powercap")
RAPL_UPDATE_PERIOD_S = 0.001
"""RAPL counters update about every millisecond."""


@dataclass(frozen=True)
class RaplZone:
    """One powercap zone: `label` (e.g. ``"package-0"`` or ``"package-0/dram"``) and its files."""

    label: str
    path: Path
    max_energy_range_uj: int

    def read_uj(self) -> int:
        return int((self.path / "energy_uj").read_text().strip())


def discover_zones(root: Path = POWERCAP_ROOT) -> list[RaplZone]:
    """Readable package and DRAM zones under `root`, else `MeterUnavailableError` with why."""
    if not root.is_dir():
        raise MeterUnavailableError(
            f"RAPL is not available: {root} does not exist (no powercap driver, or not Linux)."
        )
    tops = sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1)
    zones: list[RaplZone] = []
    for top in tops:
        name = _read_name(top)
        if not name.startswith("package"):
            continue  # psys and friends overlap the packages
        zones.append(_zone(name, top))
        for sub in sorted(top.glob(f"{top.name}:*")):
            if _read_name(sub) == "dram":
                zones.append(_zone(f"{name}/dram", sub))
    if not zones:
        raise MeterUnavailableError(f"RAPL is not available: no package zone under {root}.")
    for zone in zones:
        try:
            zone.read_uj()
        except PermissionError as err:
            raise MeterUnavailableError(
                f"RAPL counters are not readable ({zone.path / 'energy_uj'}: permission denied); "
                "since "
                "Linux 5.10 they are root-only. Run as root or grant read access, e.g. "
                "`sudo chmod o+r /sys/class/powercap/intel-rapl:*/energy_uj`."
            ) from err
        except OSError as err:
            raise MeterUnavailableError(
                f"RAPL counter {zone.path / 'energy_uj'} cannot be read: {err}"
            ) from err
    return zones


def _read_name(path: Path) -> str:
    try:
        return (path / "name").read_text().strip()
    except OSError:
        return ""


def _zone(label: str, path: Path) -> RaplZone:
    return RaplZone(
        label=label, path=path, max_energy_range_uj=int((path / "max_energy_range_uj").read_text())
    )


class RaplMeter(MeterBase):
    """CPU energy per RAPL zone; counter wrap-around at `max_energy_range_uj` is corrected.

    Args:
        root: powercap directory (tests point it at a fake tree).
        clock: seconds clock.
        max_plausible_power_w: per-zone power bound used to warn that a long window may hide
            more than one wrap (which no counter can reveal).
    """

    name = "rapl"

    def __init__(
        self,
        root: Path = POWERCAP_ROOT,
        clock: Clock | None = None,
        max_plausible_power_w: float = 500.0,
    ):
        self._zones = tuple(discover_zones(Path(root)))
        self._clock = clock or time.perf_counter
        self._book = WindowBook()
        self.max_plausible_power_w = max_plausible_power_w

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(z.label for z in self._zones)

    @property
    def update_period_s(self) -> float | None:
        return RAPL_UPDATE_PERIOD_S

    def now(self) -> float:
        return self._clock()

    def _read(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {}
        for zone in self._zones:
            try:
                out[zone.label] = zone.read_uj()
            except (OSError, ValueError) as err:
                out[zone.label] = str(err)
        return out

    def begin_window(self, key: str) -> None:
        readings = self._read()
        self._book.open(key, (self._clock(), readings))

    def end_window(self, key: str) -> Measurement:
        start_s, start_uj = self._book.close(key)
        end_uj = self._read()
        end_s = self._clock()
        time_s = end_s - start_s
        flags: list[Flag] = []
        device_j: dict[str, float | None] = {}
        for zone in self._zones:
            a, b = start_uj[zone.label], end_uj[zone.label]
            if isinstance(a, str) or isinstance(b, str):
                device_j[zone.label] = None
                err = a if isinstance(a, str) else b
                flags.append(
                    Flag(
                        FLAG_MISSING_DEVICE,
                        f"{zone.label}: reading {zone.path / 'energy_uj'} failed ({err})",
                    )
                )
                continue
            delta = b - a
            if delta < 0:
                delta += zone.max_energy_range_uj
                flags.append(
                    Flag(
                        FLAG_COUNTER_WRAP,
                        f"{zone.label}: energy counter wrapped at {zone.max_energy_range_uj} uJ; "
                        "corrected.",
                    )
                )
            wrap_time_s = zone.max_energy_range_uj / 1e6 / self.max_plausible_power_w
            if time_s > wrap_time_s:
                flags.append(
                    Flag(
                        FLAG_COUNTER_WRAP,
                        f"{zone.label}: window of {time_s:.1f} s may span more than one counter "
                        "wrap "
                        f"(one wrap every >= {wrap_time_s:.1f} s at "
                        f"{self.max_plausible_power_w:g} W); "
                        "split it into shorter windows.",
                    )
                )
            device_j[zone.label] = delta / 1e6
        flags += short_window_flag(self.name, time_s, RAPL_UPDATE_PERIOD_S)
        return device_measurement(key, self.name, start_s, end_s, device_j, flags)
