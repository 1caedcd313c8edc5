"""The one compile mechanism of the decode loop: `CompileOptions` (how the compiled path
compiles), dynamo's process-wide settings and graph count, `CompiledFunctions` (the only
``torch.compile`` call: a cache of compiled functions that warms a new input untimed and
uncounted, clones a CUDA graph's outputs and returns the seconds a compile took) and
`CompiledCalls`, the decoders' pure tensor functions compiled once per input signature
(`calls.EagerCalls`' compiled twin). Its users: the static graphs of a model's forwards
(`static_graphs.StaticGraphs`), a draft head's runner (`head_runner.HeadRunner`) and
`CompiledCalls`. What a generation meets for the first time runs uncompiled there and compiles
after it (`graph_call.Pending`): never inside a measured window."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch._dynamo.utils import counters

from mtad_energy.decoding.runtime.calls import EagerCalls
from mtad_energy.decoding.runtime.graph_call import GraphFunction, Pending, sync


@dataclass(frozen=True)
class CompileOptions:
    """How the compiled path compiles: ``mode`` None picks ``"reduce-overhead"`` (CUDA graphs)
    on CUDA with inductor and the default mode elsewhere (`resolved_mode`)."""

    backend: str = "inductor"
    mode: str | None = None
    # False: one graph per (row bucket, width, slots) (specialised kernels, a compile per shape);
    # None: dynamo's automatic dynamic shapes: a dimension seen at a second size compiles once
    # more as a symbol, and later row buckets, widths and cache sizes reuse that graph (on CUDA
    # reduce-overhead still records one CUDA graph per shape, which takes milliseconds): far
    # fewer compiles, kernels with symbolic sizes (their speed is what a GPU run must measure)
    dynamic: bool | None = False
    # graphs the compiled forward may hold (dynamo counts them per code object, and every
    # model's static graphs compile the same function: shapes x buffer sizes x models);
    # dynamo's default is 8
    recompile_limit: int = 256

    @property
    def cuda_graphs(self) -> bool:
        """Whether a GPU runs the compiled calls as CUDA graphs, each tensor output cloned on the
        host (`graph_call.graph_outputs`): `uses_cuda_graphs` of ``mode``."""
        return uses_cuda_graphs(self.mode)


def uses_cuda_graphs(mode: str | None) -> bool:
    """Whether compile ``mode`` runs CUDA graphs on a GPU: "reduce-overhead" and "max-autotune",
    and None, which picks "reduce-overhead" on CUDA with inductor (a count made with another
    backend, standing in for inductor, counts the clones inductor's graphs make)."""
    return mode in (None, "reduce-overhead", "max-autotune")


def resolved_mode(options: CompileOptions, device: torch.device) -> str | None:
    """The compile mode a forward on ``device`` runs under: ``options.mode``, or for None
    ``"reduce-overhead"`` (CUDA graphs) on CUDA with inductor and the default mode elsewhere."""
    if options.mode is None and device.type == "cuda" and options.backend == "inductor":
        return "reduce-overhead"
    return options.mode


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


def configure_dynamo(options: CompileOptions) -> None:
    """Process-wide dynamo settings (it has no per-function ones): room for the graphs the
    static graphs and compiled calls need, and an error instead of dynamo's silent fall-back to eager at the
    limit, which would leave "compiled" timings measuring eager forwards."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, options.recompile_limit)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit,
                                          8 * options.recompile_limit)
    cfg.fail_on_recompile_limit_hit = True




def signature(args: tuple) -> tuple:
    """What a compiled function specialises on: each tensor's shape, strides, dtype and device,
    each other argument's value."""
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                 else (type(a), a) for a in args)


class CompiledFunctions:
    """Functions compiled on first use (``torch.compile``, fullgraph: a graph break would split
    every layer into graphs of its own, slower than eager; better an error naming it), each
    called through a `GraphFunction`: ``graphs``: counted as a CUDA graph's call (its tensor
    outputs cloned on the host), cloned here under ``mode`` "reduce-overhead" (a CUDA graph's
    outputs are overwritten by its next replay: `graph_call.graph_outputs`).

    A new input runs untimed first (`warm`: compiling it; on CUDA graphs warming up, recording
    and replaying it), uncounted by a host-work counter: not the loop's work. ``warmed``: the
    input signatures a user keeps here (the static graphs keep theirs per cache)."""

    def __init__(self, backend: str, mode: str | None, dynamic: bool | None, graphs: bool,
                 device: torch.device | None = None):
        self.backend = backend
        self.mode = mode
        self.dynamic = dynamic
        self.graphs = graphs
        self.device = device
        self._fns: dict[Any, GraphFunction | None] = {}  # key -> compiled (None: failed, eager)
        self.warmed: set[tuple] = set()

    @classmethod
    def for_forwards(cls, options: CompileOptions, device: torch.device,
                     dynamic: bool | None = None) -> CompiledFunctions:
        """Forwards on ``device`` as ``options`` compile them (CUDA graphs where
        `resolved_mode` picks them; ``dynamic`` None: ``options.dynamic``)."""
        mode = resolved_mode(options, device)
        return cls(options.backend, mode, options.dynamic if dynamic is None else dynamic,
                   uses_cuda_graphs(mode), device)

    @property
    def warm_calls(self) -> int:
        """Untimed calls of a new input: compile (CUDA graphs: warm up, record, replay once)."""
        return 3 if self.mode == "reduce-overhead" else 1

    def compiled(self, key: Any, target: Callable[..., Any] | None = None) -> GraphFunction | None:
        """``target`` (default ``key``, the function) compiled, made on first use; None: it
        failed to compile (`failed`) and runs eagerly."""
        if key not in self._fns:
            self._fns[key] = GraphFunction(torch.compile(
                key if target is None else target, backend=self.backend, mode=self.mode,
                dynamic=self.dynamic, fullgraph=True), graph=self.graphs,
                clone=self.mode == "reduce-overhead")
        return self._fns[key]

    def failed(self, key: Any) -> None:
        """``key`` could not compile: it runs eagerly from now on (`compiled` is None)."""
        self._fns[key] = None

    def warm(self, key: Any, args: tuple, kwargs: dict | None = None,
             target: Callable[..., Any] | None = None) -> float:
        """The untimed calls of a new input of ``key`` (`warm_calls`), uncounted by a host-work
        counter; returns their seconds (the device synchronised before and after)."""
        fn = self.compiled(key, target)
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(self.warm_calls):
            fn.uncounted(*args, **(kwargs or {}))
        sync(self.device)
        return time.perf_counter() - t0


# options -> the pure functions compiled so far, with the signatures compiled (``warmed``): kept
# across generations, like the static graphs
_CALLS: dict[CompileOptions, CompiledFunctions] = {}


def reset_dynamo() -> None:
    """Forget every graph (``torch._dynamo.reset()``) and which signatures of the pure functions
    were compiled (dynamo's reset alone would leave `CompiledCalls` thinking their graphs exist).
    The static graphs and heads keep records of their own: `static.reset_compiled` forgets those
    too."""
    torch._dynamo.reset()
    _CALLS.clear()


class CompiledCalls(EagerCalls):
    """`EagerCalls` compiled: each pure function one graph per input signature
    (`CompiledFunctions`; no CUDA graphs: a function is a few fused launches, and its outputs
    live on while the next call runs).

    Nothing compiles inside a generation: a signature met for the first time (a shape that
    depends on sampled values, such as a last, shorter verify) runs eagerly there (the same
    function; a host-work counter sees one call, as it will be), and compiles after the loop's
    "end" hook (`compile_pending`), outside every window, for the next generation. The runners'
    full-length warm-up meets them all before the first measured row."""

    def __init__(self, options: CompileOptions | None = None):
        self.options = options or CompileOptions()
        configure_dynamo(self.options)
        self._fns = _CALLS.get(self.options)
        if self._fns is None:
            self._fns = _CALLS[self.options] = CompiledFunctions(
                self.options.backend, None, self.options.dynamic, graphs=False)
        self._pending = Pending()
        self.compile_s = 0.0
        self.eager_calls = 0  # calls of a signature not compiled yet (run eagerly)

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        compiled = self._fns.compiled(fn)
        if compiled is None:  # it failed to compile (warned): eager, and counted as such
            return fn(*args)
        key = (fn, signature(args))
        if key in self._fns.warmed:
            before, t0 = graphs_compiled(), time.perf_counter()
            out = compiled(*args)
            if graphs_compiled() != before:  # dynamo saw what the signature does not
                self.compile_s += time.perf_counter() - t0
            return out
        self._pending.add(key, partial(self._compile, fn, args, key))
        self.eager_calls += 1
        return GraphFunction(fn)(*args)

    def _compile(self, fn: Callable[..., Any], args: tuple, key: tuple) -> None:
        """Compile ``fn`` on ``args`` (the inputs the generation met it with: it is pure); a
        compiler that cannot leaves it eager, said, never silent."""
        if self._fns.compiled(fn) is None:
            return
        try:
            self._fns.warm(fn, args)
        except Exception as error:
            self._fns.failed(fn)
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            warnings.warn(f"compile: function {fn.__module__}.{fn.__qualname__} failed to "
                          f"compile with backend {self.options.backend!r} "
                          f"({type(error).__name__}: {first}); it runs eagerly from now "
                          "on (host work counted as such)", stacklevel=4)
            return
        self._fns.warmed.add(key)
