"""The compiler stack's settings and the compiled kernels: `CompileOptions` (how the compiled
path compiles), dynamo's process-wide settings and graph count, and `CompiledKernels`, the
decoders' pure tensor functions compiled once per input signature (`kernels.Kernels`' compiled
twin). The static-cache runner that compiles the forwards is `static.StaticRunner`."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.utils import counters

from mtad_energy.decoding.runtime.graph_call import GraphFunction
from mtad_energy.decoding.runtime.kernels import Kernels


@dataclass(frozen=True)
class CompileOptions:
    """How `StaticEngine` compiles: ``mode`` None picks ``"reduce-overhead"`` (CUDA graphs) on
    CUDA with inductor and the default mode elsewhere."""

    backend: str = "inductor"
    mode: str | None = None
    # False: one graph per (row bucket, width, slots) (specialised kernels, a compile per shape);
    # None: dynamo's automatic dynamic shapes: a dimension seen at a second size compiles once
    # more as a symbol, and later row buckets, widths and cache sizes reuse that graph (on CUDA
    # reduce-overhead still records one CUDA graph per shape, which takes milliseconds): far
    # fewer compiles, kernels with symbolic sizes (their speed is what a GPU run must measure)
    dynamic: bool | None = False
    # graphs the compiled forward may hold (dynamo counts them per code object, and every
    # engine compiles the same function: shapes x buffer sizes x models); dynamo's default is 8
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


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


def configure_dynamo(options: CompileOptions) -> None:
    """Process-wide dynamo settings (it has no per-function ones): room for the graphs the
    engines and kernels need, and an error instead of dynamo's silent fall-back to eager at the
    limit, which would leave "compiled" timings measuring eager forwards."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, options.recompile_limit)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit,
                                          8 * options.recompile_limit)
    cfg.fail_on_recompile_limit_hit = True


# options -> {pure function: (its compiled form, the input signatures compiled so far)}: kept
# across generations, like the engines
_KERNELS: dict[CompileOptions, dict[Callable[..., Any], tuple[GraphFunction, set[tuple]]]] = {}


def reset_dynamo() -> None:
    """Forget every graph (``torch._dynamo.reset()``) and which kernel signatures were compiled
    (dynamo's reset alone would leave the kernels thinking their graphs exist). The engines and
    heads keep records of their own: `static.reset_compiled` forgets those too."""
    torch._dynamo.reset()
    _KERNELS.clear()


def signature(args: tuple) -> tuple:
    """What a compiled kernel specialises on: each tensor's shape, strides, dtype and device,
    each other argument's value."""
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                 else (type(a), a) for a in args)


class CompiledKernels(Kernels):
    """`Kernels` compiled: each pure function one graph per input signature (``torch.compile``,
    fullgraph; no CUDA graphs: a kernel is a few fused launches, and its outputs live on while
    the next call runs), called through `GraphFunction`.

    Nothing compiles inside a generation: a signature met for the first time (a shape that
    depends on sampled values, such as a last, shorter verify) runs eagerly there (the same
    function; a host-work counter sees one call, as it will be), and compiles after the loop's
    "end" hook (`compile_pending`), outside every window, for the next generation. The runners'
    full-length warm-up meets them all before the first measured row."""

    def __init__(self, options: CompileOptions | None = None):
        self.options = options or CompileOptions()
        configure_dynamo(self.options)
        self._fns = _KERNELS.setdefault(self.options, {})
        self._pending: dict[tuple, tuple[Callable[..., Any], tuple]] = {}
        self.compile_s = 0.0
        self.eager_calls = 0  # calls of a signature not compiled yet (run eagerly)

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        entry = self._fns.get(fn)
        if entry is None:
            entry = self._fns[fn] = (GraphFunction(torch.compile(
                fn, backend=self.options.backend, dynamic=self.options.dynamic,
                fullgraph=True)), set())
        compiled, seen = entry
        if compiled is None:  # it failed to compile (warned): eager, and counted as such
            return fn(*args)
        key = signature(args)
        if key in seen:
            before, t0 = graphs_compiled(), time.perf_counter()
            out = compiled(*args)
            if graphs_compiled() != before:  # dynamo saw what the signature does not
                self.compile_s += time.perf_counter() - t0
            return out
        self._pending.setdefault((fn, key), (fn, args))
        self.eager_calls += 1
        return GraphFunction(fn)(*args)

    def compile_pending(self) -> float:
        """Compile the signatures this generation met for the first time (on the inputs it met
        them with: the kernels are pure); returns the seconds it took."""
        if not self._pending:
            return 0.0
        t0 = time.perf_counter()
        for (fn, key), (_, args) in self._pending.items():
            compiled, seen = self._fns[fn]
            if compiled is None:
                continue
            try:
                compiled(*args)
            except Exception as error:  # a compiler that cannot: eager, said, never silent
                self._fns[fn] = (None, seen)
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                warnings.warn(f"compile: kernel {fn.__module__}.{fn.__qualname__} failed to "
                              f"compile with backend {self.options.backend!r} "
                              f"({type(error).__name__}: {first}); it runs eagerly from now "
                              "on (host work counted as such)", stacklevel=2)
                continue
            seen.add(key)
        self._pending.clear()
        return time.perf_counter() - t0
