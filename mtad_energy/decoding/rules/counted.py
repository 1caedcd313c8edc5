"""What the decoding code tells a host-work counter (`mtad_energy.measure.host_work`), found by duck
type on the dispatch mode stack: this package imports no meter.

Two things: a compiled call is one graph call with nothing inside it counted
(`runtime.graph_call.GraphFunction`), and a host read that only the CPU path makes (a shortcut
that reads a CPU tensor's values where that is free, never on another device: `cpu_only`) is
counted apart from the reads a GPU would make, so a count taken on the CPU predicts a GPU's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

T = TypeVar("T")


def counter_on_stack() -> Any:
    """The host-work counter on the dispatch mode stack, if one counts (else None)."""
    for mode in _get_current_dispatch_mode_stack():
        counter = getattr(mode, "counter", None)
        if counter is not None and hasattr(counter, "graph_call"):
            return counter
    return None


def cpu_only(read: Callable[[], T]) -> T:
    """``read()``: a host read of CPU tensors that only the CPU path makes (its caller checked
    the device: a GPU takes another path, with no read). A counter counts it apart
    (``cpu_only_reads``), not among the host reads per iteration."""
    counter = counter_on_stack()
    if counter is None:
        return read()
    with counter.cpu_only():
        return read()
