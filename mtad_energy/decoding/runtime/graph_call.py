"""A compiled function as the host sees it: one call, and the clones of its outputs.

Every ``torch.compile``d function the decode loop calls (a runner's forward, a head) goes through
`GraphFunction`, so a host-work counter on the dispatch mode stack (`mtad_energy.measure.host_work`,
found by duck type: this package does not import `measure`) counts the call as one graph call and
none of the ops inside it. Without a counter it is a plain call. A call that compiles (a new
shape's untimed warm-up) is not the loop's work: `uncounted` runs it with the count paused.

A call that a GPU runs as a CUDA graph (``graph``: mode ``reduce-overhead``) hands back tensors
its next replay overwrites, so the host clones each one (an ``aten::clone`` per tensor output:
the fewer outputs a call returns, the less host work). Where graphs are recorded (``clone``) the
clones are made here, and a counter sees them as the ops they are; elsewhere (the CPU, which
records no graphs) a counter still counts them, as the ops a GPU host makes
(`graph_outputs`), so a count on the CPU says what the GPU host does.

What a generation meets for the first time runs uncompiled there and compiles after it
(`Pending`, `CompilesAfter.compile_pending`): never inside a measured window.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from mtad_energy.decoding.rules.counted import counter_on_stack


def graph_outputs(out: Any, clone: bool) -> Any:
    """A CUDA-graph call's outputs as the host keeps them: ``out`` (a tensor or a flat tuple)
    with each tensor cloned if ``clone`` (the graph's next replay overwrites them), else as it
    is; a host-work counter counts one clone per tensor either way (`HostWorkCounter.clones_of`:
    made, or the ones a GPU host would make)."""
    items = out if isinstance(out, tuple) else (out,)
    n = sum(isinstance(t, torch.Tensor) for t in items)
    counter = counter_on_stack()
    if counter is not None:
        counter.clones_of(n, made=clone)
    if not clone:
        return out
    kept = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in items)
    return kept if isinstance(out, tuple) else kept[0]


class GraphFunction:
    """Wraps a compiled function ``fn``; calling it calls ``fn``. ``graph``: a GPU runs it as a
    CUDA graph (its tensor outputs cloned on the host, `graph_outputs`); ``clone``: this process
    does (its outputs are cloned here)."""

    def __init__(self, fn: Callable[..., Any], graph: bool = False, clone: bool = False):
        self.fn = fn
        self.graph = graph
        self.clone = clone

    def __call__(self, *args, **kwargs):
        out = self._under("graph_call", args, kwargs)
        return graph_outputs(out, self.clone) if self.graph else out

    def uncounted(self, *args, **kwargs):
        """The call with a counter's count paused: neither a graph call nor ops (its outputs,
        a warm-up's, not cloned)."""
        return self._under("paused", args, kwargs)

    def _under(self, how: str, args: tuple, kwargs: dict):
        """The call inside the counter's ``how`` context (`graph_call` or `paused`), if one
        counts; a plain call otherwise."""
        counter = counter_on_stack()
        if counter is None:
            return self.fn(*args, **kwargs)
        with getattr(counter, how)():
            return self.fn(*args, **kwargs)


def sync(device: torch.device | None) -> None:
    """Wait for ``device``'s queued work (a CUDA device; nothing elsewhere): a compile's seconds
    end when its warm-up ran, not when it was queued."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class Pending:
    """What a generation met for the first time and ran uncompiled: key -> the call that compiles
    it (on the inputs the generation met it with), made after the generation, outside every
    window (`compile`). A key added twice keeps its last call; ``device``: synchronised after."""

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self._todo: dict[Hashable, Callable[[], Any]] = {}

    def add(self, key: Hashable, compile: Callable[[], Any]) -> None:
        self._todo[key] = compile

    def compile(self) -> float:
        """Run every pending compile, then forget them; returns the seconds it took."""
        if not self._todo:
            return 0.0
        t0 = time.perf_counter()
        for compile in self._todo.values():
            compile()
        sync(self.device)
        self._todo.clear()
        return time.perf_counter() - t0


class CompilesAfter:
    """What may compile what a generation met first, after it: a runner, the generation's
    `calls.EagerCalls`. ``_pending`` None: nothing ever pending (the eager path)."""

    _pending: Pending | None = None

    def compile_pending(self) -> float:
        """Compile what this generation met for the first time, after it (the generate loop
        calls it after its "end" hook); returns the seconds it took."""
        return 0.0 if self._pending is None else self._pending.compile()
