"""The `none` meter: wall time only. Energy is None with the reason, never 0."""

from __future__ import annotations

import time

from mtad_energy.measure.base import Clock, Measurement, MeterBase, WindowBook


class NoneMeter(MeterBase):
    """Measures time only; every measurement carries `reason` for the missing energy."""

    name = "none"

    def __init__(
        self, reason: str = "no energy meter selected (meter='none')", clock: Clock | None = None
    ):
        self.reason = reason
        self._clock = clock or time.perf_counter
        self._book = WindowBook()

    @property
    def devices(self) -> tuple[str, ...]:
        return ()

    @property
    def update_period_s(self) -> float | None:
        return None

    def now(self) -> float:
        return self._clock()

    def begin_window(self, key: str) -> None:
        self._book.open(key, self._clock())

    def end_window(self, key: str) -> Measurement:
        start = self._book.close(key)
        end = self._clock()
        return Measurement(
            name=key,
            meter=self.name,
            time_s=end - start,
            start_timestamp_s=start,
            end_timestamp_s=end,
            energy_j=None,
            reason=self.reason,
        )

