"""Trapezoid integration of power samples over a window, interpolating at the window ends."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def trapezoid_energy_j(
    timestamps_s: Sequence[float],
    power_w: Sequence[float],
    start_s: float,
    end_s: float,
) -> float:
    """Energy in joules over [start_s, end_s] from power samples (watts at seconds).

    The power at both window ends is interpolated from the neighbouring samples (held constant
    outside the sampled range), so a window does not depend on where polling happened to land.
    Samples must be sorted by time; equal timestamps are allowed (zero-width trapezoids).
    """
    if end_s < start_s:
        raise ValueError(f"window end {end_s} s is before its start {start_s} s")
    t = np.asarray(timestamps_s, dtype=float)
    p = np.asarray(power_w, dtype=float)
    if t.size == 0:
        raise ValueError("no power samples in the window; the poller recorded nothing")
    if t.size > 1 and np.any(np.diff(t) < 0):
        raise ValueError("power samples must be sorted by timestamp")
    inside = (t > start_s) & (t < end_s)
    tt = np.concatenate(([start_s], t[inside], [end_s]))
    pp = np.concatenate(([np.interp(start_s, t, p)], p[inside], [np.interp(end_s, t, p)]))
    return float(np.sum((tt[1:] - tt[:-1]) * (pp[1:] + pp[:-1]) * 0.5))
