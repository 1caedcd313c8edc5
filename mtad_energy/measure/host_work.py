"""Host work per decode iteration, counted: a device-independent figure of what the host does.

On a GPU the host is the bottleneck of a compiled decode loop: every aten op dispatched outside a
compiled graph costs ~6-8 us of host time (H200, docs/design.md section 7), whether or not the device
is busy. A share of decode time measured on the CPU cannot see that (CPU forwards are ~10x
slower); a count can. `HostWorkCounter` counts, between the generate loop's "decode" and "end"
hooks (so no prefill, no warm-up of other shapes):

* ``ops``: aten ops dispatched outside compiled graphs (a `TorchDispatchMode`: the ops reaching
  the dispatcher's Python key, after composite ops decompose; an op's own internal calls are not
  counted again). Inside a compiled call nothing is counted: compiled calls go through
  `mtad_energy.decoding.runtime.graph_call.GraphFunction`, which pauses the counter around them;
* ``graph_calls``: those compiled calls (each a CUDA graph replay or a compiled kernel sequence);
* ``clones``: the ``aten::clone`` of each tensor a CUDA-graph call returns (a GPU's host clones
  them: the graph's next replay overwrites them; `graph_call.graph_outputs`), counted among the
  ops too. Where no graph is recorded (the CPU) the clones are not made, and counted all the
  same, as the ops a GPU host dispatches: a row says what the GPU host does;
* ``reads``: host reads of device values the code asks for (`is_host_read`): scalar reads
  (``.item()``, ``bool(t)``, ``int(t)``, a 0-d tensor as an index), data-dependent shapes
  (``nonzero``, boolean masks), and ``.tolist()`` / ``.cpu()`` / ``.numpy()`` (a
  `TorchFunctionMode`: on the CPU these never reach the dispatcher). Each stalls a GPU host until
  the device is done; the loop's contract is exactly one per iteration, the token read-back.
  A read that only the CPU path makes (a shortcut reading a CPU tensor where that is free, taken
  only on the CPU: `decoding.rules.counted.cpu_only`) is counted apart, in ``cpu_only_reads``: a
  GPU takes another path there and makes no read, so it is not among the reads per iteration.

The counts are the same on any device for the same code path, so the CPU tests hold every decoder
to a budget and the GPU's host time per iteration follows from them. Counting costs host time
itself (a Python call per op): run it in a pass of its own, never inside a timed window (the
runners count their untimed warm-up generation).
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose result the host must wait for: a scalar read, or an output whose shape depends
# on the values (overload packet names, ``str(func.overloadpacket)``)
HOST_READ_OPS = frozenset({
    "aten._local_scalar_dense", "aten.nonzero", "aten.nonzero_static", "aten.masked_select",
    "aten.unique", "aten._unique", "aten._unique2", "aten.unique_dim",
    "aten.unique_consecutive", "aten.equal", "aten.item", "aten.is_nonzero",
})
# ops that read the device only when indexed by a boolean mask (its count of True is a shape)
MASK_INDEXED_OPS = frozenset({"aten.index", "aten.index_put", "aten.index_put_",
                              "aten._index_put_impl_"})
# Tensor methods that copy device values to the host (invisible to the dispatcher on the CPU)
HOST_READ_METHODS = frozenset({"tolist", "cpu", "numpy"})


def _is_mask(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.bool, torch.uint8)


def is_host_read(func: Any, args: tuple = ()) -> bool:
    """Whether the aten op ``func`` (an OpOverload) called with ``args`` reads device values back
    to the host (a GPU stall): `HOST_READ_OPS`, or indexing by a boolean mask."""
    name = str(getattr(func, "overloadpacket", func))
    if name in HOST_READ_OPS:
        return True
    if name in MASK_INDEXED_OPS and len(args) > 1 and isinstance(args[1], list | tuple):
        return any(_is_mask(i) for i in args[1])
    return False


def is_host_read_method(func: Any) -> bool:
    """Whether a torch function call is a Python-level read (``Tensor.tolist`` and the like)."""
    return getattr(func, "__name__", "") in HOST_READ_METHODS


@dataclass(frozen=True)
class HostWork:
    """What a counted decode phase did on the host, and its iterations."""

    ops: int
    reads: int
    graph_calls: int
    iterations: int
    cpu_only_reads: int = 0  # reads only the CPU path makes (not in ``reads``; not stored)
    clones: int = 0  # CUDA-graph outputs cloned (among ``ops``; not stored)

    @property
    def clones_per_iter(self) -> float | None:
        """The clones of CUDA-graph outputs per decode iteration (None without iterations)."""
        return self.clones / self.iterations if self.iterations else None

    def columns(self) -> dict[str, float | None]:
        """Per decode iteration, the stored row's columns (None without iterations)."""
        it = self.iterations
        return {"host_ops_per_iter": self.ops / it if it else None,
                "host_reads_per_iter": self.reads / it if it else None,
                "graph_calls_per_iter": self.graph_calls / it if it else None}


NO_HOST_WORK: dict[str, float | None] = {"host_ops_per_iter": None, "host_reads_per_iter": None,
                                         "graph_calls_per_iter": None}
"""The columns of a row whose host work was not counted (an engine's, or no warm-up)."""


class _Ops(TorchDispatchMode):
    def __init__(self, counter: HostWorkCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counter._op(func, args)
        return func(*args, **(kwargs or {}))


class _Reads(TorchFunctionMode):
    def __init__(self, counter: HostWorkCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if is_host_read_method(func):
            self.counter._method_read(func)
        return func(*args, **(kwargs or {}))


class HostWorkCounter:
    """Counts host work between the generate loop's "decode" and "end" hooks: pass it as
    ``on_phase`` (or call it from one). `result` divides by the generation's iterations.

    A subclass may override `_note` to see every counted op (`HostWorkSites` records where)."""

    def __init__(self) -> None:
        self.ops = 0
        self.reads = 0
        self.graph_calls = 0
        self.clones = 0
        self.cpu_only_reads = 0
        self._cpu_only = 0  # inside `cpu_only` (nested: a depth)
        self._modes: list[Any] = []

    # -- the hook ------------------------------------------------------------------------------
    def __call__(self, phase: str) -> None:
        if phase == "decode":
            self.start()
        elif phase == "end":
            self.stop()

    def start(self) -> None:
        if self._modes:
            raise RuntimeError("HostWorkCounter.start: already counting")
        self._modes = [_Reads(self), _Ops(self)]
        self._enter()

    def stop(self) -> None:
        if self._modes:
            self._exit()
            self._modes = []

    @contextmanager
    def counting(self) -> Iterator[HostWorkCounter]:
        """Count inside the block (a test's or a benchmark's own span)."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def result(self, iterations: int) -> HostWork:
        return HostWork(self.ops, self.reads, self.graph_calls, iterations, self.cpu_only_reads,
                        self.clones)

    # -- compiled calls (`GraphFunction`) ------------------------------------------------------
    @contextmanager
    def graph_call(self) -> Iterator[None]:
        """One compiled call: counted as such, and nothing inside it is counted as an op."""
        self.graph_calls += 1
        with self.paused():
            yield

    def clones_of(self, n: int, made: bool) -> None:
        """A CUDA-graph call's ``n`` tensor outputs cloned on the host: ``made`` (the ops are
        dispatched here, and counted as such), or the clones a GPU host makes where this one
        records no graphs (counted as ``n`` ops)."""
        self.clones += n
        if not made:
            for _ in range(n):
                self.ops += 1
                self._note("aten.clone", False)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing inside counted (a new shape compiling: not the loop's work)."""
        self._exit()
        try:
            yield
        finally:
            self._enter()

    @contextmanager
    def cpu_only(self) -> Iterator[None]:
        """Reads inside are ones only the CPU path makes: counted in ``cpu_only_reads``, not in
        ``reads`` (their ops still count as ops)."""
        self._cpu_only += 1
        try:
            yield
        finally:
            self._cpu_only -= 1

    def _enter(self) -> None:
        for mode in self._modes:
            mode.__enter__()

    def _exit(self) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)

    # -- what the modes see --------------------------------------------------------------------
    def _op(self, func: Any, args: tuple) -> None:
        self.ops += 1
        read = is_host_read(func, args)
        self._read(read)
        self._note(str(func.overloadpacket), read and not self._cpu_only)

    def _method_read(self, func: Any) -> None:
        self._read(True)
        self._note(f"Tensor.{func.__name__}", not self._cpu_only)

    def _read(self, read: bool) -> None:
        if self._cpu_only:
            self.cpu_only_reads += read
        else:
            self.reads += read

    def _note(self, name: str, read: bool) -> None:
        """Called for every counted op (``read``: a host read); the base class keeps totals."""


class HostWorkSites(HostWorkCounter):
    """A `HostWorkCounter` that also records, per op and per read, the innermost mtad_energy
    line that issued it (``sites``, ``read_sites``): for budgets' failure messages and the
    benchmark's breakdown. Slower (a stack walk per op)."""

    def __init__(self, package: str = "mtad_energy") -> None:
        super().__init__()
        self.package = f"/{package}/"
        self.sites: collections.Counter[str] = collections.Counter()
        self.read_sites: collections.Counter[str] = collections.Counter()

    def _note(self, name: str, read: bool) -> None:
        frames = [f for f in traceback.extract_stack()[:-3] if self.package in f.filename
                  and not f.filename.endswith(("measure/host_work.py", "runtime/graph_call.py"))]
        where = (f"{frames[-1].filename.rsplit(self.package, 1)[-1]}:{frames[-1].lineno} "
                 f"{frames[-1].name}" if frames else "?")
        self.sites[f"{where} {name}"] += 1
        if read:
            self.read_sites[f"{where} {name}"] += 1
