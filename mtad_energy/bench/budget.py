"""A time budget for a command that must fit a lease: start no new measurement once it is spent.

Every row measured before is stored, so re-running the same command goes on where this one
stopped (the store skips what it holds). The budget counts from its creation (the command's
start: model loading included); a measurement already started always finishes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass
class Budget:
    """``seconds`` None: no limit. ``left`` counts the rows not started because it was spent."""

    seconds: float | None = None
    started: float = field(default_factory=time.perf_counter)
    left: int = 0

    def __post_init__(self) -> None:
        if self.seconds is not None and not self.seconds >= 0:
            raise ValueError(f"--budget-s must be >= 0 seconds, got {self.seconds}")

    def spent(self) -> bool:
        """Whether a new row may no longer start (`skip` asks before each)."""
        return self.expired()

    def expired(self) -> bool:
        """Whether the time is up, read off the clock: the check of the loops between rows
        (hashing row keys, tokenising prompts, counting the rows left), so that a spent budget
        stops them too, within a row's time of its limit."""
        return self.seconds is not None and time.perf_counter() - self.started >= self.seconds

    def skip(self, rows: int = 1) -> bool:
        """Whether to skip ``rows`` about to start (counted in ``left`` when skipped)."""
        if self.spent():
            self.left += rows
            return True
        return False

    def to_dict(self) -> dict[str, float | int | bool | str | None]:
        """``seconds`` null where there is no limit (``--budget-s inf``), with the reason."""
        unlimited = self.seconds is not None and math.isinf(self.seconds)
        return {"seconds": None if unlimited else self.seconds, "spent": self.left > 0,
                "left": self.left, **({"seconds_reason": "--budget-s inf: no limit"}
                                      if unlimited else {})}

    def note(self) -> str | None:
        """What to tell the user when rows were left, else None."""
        if not self.left:
            return None
        return (f"--budget-s {self.seconds:g} s spent: {self.left} row(s) not measured; every row "
                "measured is stored: re-run the same command to go on from there")
