"""Hang guards for tests: limits that stop a stuck subprocess or wait, never measurements.

Tests assert behaviour, not time (a test that asserts a duration is a benchmark in the wrong
place, and fails on a busy machine). Where a test must bound a wait, the bound is what the step
takes on a quiet machine times a generous factor: 4, times the machine's load per core when it
is busier than one runnable process per core (read when the limit is taken), or
``$MTAD_TEST_TIME_SCALE`` where set.
"""

from __future__ import annotations

import os


def load_factor() -> float:
    """``$MTAD_TEST_TIME_SCALE``, else 4 x max(1, 1-minute load average per core)."""
    if scale := os.environ.get("MTAD_TEST_TIME_SCALE"):
        return float(scale)
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return 4.0 * max(1.0, load)


def hang_limit_s(quiet_s: float, cap_s: float | None = None) -> float:
    """A limit for a step that takes ``quiet_s`` on a quiet machine; ``cap_s`` keeps it below a
    time the test must still tell apart (a stand-in process that would end by itself then)."""
    limit = quiet_s * load_factor()
    return limit if cap_s is None else min(limit, cap_s)
