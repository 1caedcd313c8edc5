"""A compiled function as the host sees it: one call.

Every ``torch.compile``d function the decode loop calls (a runner's forward, a head) goes through
`GraphFunction`, so a host-work counter on the dispatch mode stack (`mtad_energy.measure.host_work`,
found by duck type: this package does not import `measure`) counts the call as one graph call and
none of the ops inside it. Without a counter it is a plain call. A call that compiles (a new
shape's untimed warm-up) is not the loop's work: `uncounted` runs it with the count paused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mtad_energy.decoding.rules.counted import counter_on_stack


class GraphFunction:
    """Wraps a compiled function ``fn``; calling it calls ``fn``."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self._under("graph_call", args, kwargs)

    def uncounted(self, *args, **kwargs):
        """The call with a counter's count paused: neither a graph call nor ops."""
        return self._under("paused", args, kwargs)

    def _under(self, how: str, args: tuple, kwargs: dict):
        """The call inside the counter's ``how`` context (`graph_call` or `paused`), if one
        counts; a plain call otherwise."""
        counter = counter_on_stack()
        if counter is None:
            return self.fn(*args, **kwargs)
        with getattr(counter, how)():
            return self.fn(*args, **kwargs)

