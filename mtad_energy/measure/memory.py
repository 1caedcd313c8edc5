"""Peak memory over a stretch of work: what speculative decoding pays for its speed.

On CUDA the device's peak allocated bytes (``torch.cuda.max_memory_allocated`` after a reset:
weights, KV caches, activations, the static caches of compiled runs); on the CPU the process's
resident peak (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``; where the kernel does not
allow the reset, the peak since the process started, an upper bound).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _rss_peak_bytes() -> int | None:
    try:
        match = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        match = None
    if match:
        return int(match.group(1)) * 1024
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    except (ImportError, OSError):
        return None


def _reset_rss_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # "5": reset the peak resident set size to the current one
        return True
    except OSError:
        return False


@dataclass
class PeakMemory:
    """Filled in when its `peak_memory` block ends: ``bytes`` (None where nothing could be read)
    and ``since_reset`` (False: the CPU peak covers the whole process)."""

    device: str
    bytes: int | None = None
    since_reset: bool = True


@contextmanager
def peak_memory(device: str) -> Iterator[PeakMemory]:
    """``with peak_memory("cuda:0") as peak: work()`` -> ``peak.bytes``."""
    peak = PeakMemory(device)
    cuda = device.startswith("cuda")
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats(device)
    else:
        peak.since_reset = _reset_rss_peak()
    try:
        yield peak
    finally:
        if cuda:
            import torch

            peak.bytes = int(torch.cuda.max_memory_allocated(device))
        else:
            peak.bytes = _rss_peak_bytes()
