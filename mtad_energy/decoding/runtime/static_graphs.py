"""A model's compiled forwards and its static caches (`StaticGraphs`), kept per (model, role)
across generations (`graphs_for`), the buckets their shapes round to (`slot_bucket`,
`row_bucket`), and what a model needs to compile (`check_static_support`, `eager_reason`,
`install_capture_hooks`): what `static.StaticRunner` runs on. Later generations reuse the
graphs and, when they need the same rows and slots, the cache; `release_graphs` frees them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from mtad_energy.decoding.runtime.compiled import (
    CompiledFunctions,
    CompileOptions,
    configure_dynamo,
)
from mtad_energy.decoding.runtime.graph_call import GraphFunction
from mtad_energy.decoding.runtime.slot_cache import SlotCache
from mtad_energy.decoding.runtime.slot_forward import forward_then, slot_forward
from mtad_energy.decoding.runtime.tree import TREE_ATTN, TREE_MODEL_TYPES

MIN_SLOTS = 256


def slot_bucket(n: int) -> int:
    """The power of two >= n (at least MIN_SLOTS): prompts of similar length share graphs."""
    return max(MIN_SLOTS, 1 << (max(n, 1) - 1).bit_length())


def row_bucket(n: int) -> int:
    """The power of two >= n: a batch of n sequences runs padded to it (1, 2, 4, ... 128)."""
    return 1 << (max(n, 1) - 1).bit_length()


def eager_reason(model) -> str | None:
    """Why ``model`` stays on the eager path under ``compile`` (None: it compiles). Dynamically
    quantized int8 layers (the CPU self-draft ``self:int8``) call quantized kernels dynamo cannot
    trace: compiled, every layer would be a graph break, and a static cache without a compiled
    forward only adds masked attention over empty slots."""
    from torch.ao.nn.quantized import dynamic

    if any(isinstance(m, dynamic.Linear) for m in model.modules()):
        return (f"{type(model).__name__} has dynamically quantized int8 layers, which "
                "torch.compile cannot trace: it runs eager, on a dynamic cache")
    return None


def check_static_support(model) -> None:
    """Raise NotImplementedError naming the architecture if its forwards cannot run on a
    `SlotCache` (a custom 4-D mask and explicit position ids, as token trees need)."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", "?")
    attn = getattr(cfg, "_attn_implementation", None) or "eager"
    if model_type not in TREE_MODEL_TYPES or attn not in TREE_ATTN:
        raise NotImplementedError(
            f"compile: the static-cache path runs every forward with a custom 4-D mask, which "
            f"{type(model).__name__} (model_type={model_type!r}, attn_implementation={attn!r}) "
            f"is not known to accept; supported: model types {', '.join(sorted(TREE_MODEL_TYPES))} "
            f"with attn_implementation {' or '.join(sorted(TREE_ATTN))}. Run without --compile.")


def install_capture_hooks(model) -> None:
    """Install transformers' hidden-state capturing hooks now (it does so on the first forward
    asking for hidden states, under a lock a compiled forward cannot trace)."""
    from transformers import PreTrainedModel
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    if isinstance(model, PreTrainedModel):  # on the module whose forward captures (as it does)
        maybe_install_capturing_hooks(model.get_decoder())


class StaticGraphs:
    """A model's compiled forwards (`compiled.CompiledFunctions`: `slot_forward` and the fused
    calls) and its `SlotCache`s, shared by the generations that use them."""

    def __init__(self, model, device: torch.device, options: CompileOptions):
        self.model = model
        self.device = device
        self.options = options
        configure_dynamo(options)
        # function (`slot_forward` or a fused call) -> its compiled form, made on first use
        self.functions = CompiledFunctions.for_forwards(options, device)
        self.mode = self.functions.mode
        # (rows, slots) -> cache: decoders that expand to other row counts (beams, drafts) keep
        # their own buffers, so alternating between them neither reallocates nor, on CUDA,
        # re-records graphs; `release` frees them
        self.caches: dict[tuple[int, int], SlotCache] = {}
        # (decoder key, rows, earlier tree nodes) -> tree widths run so far
        self.tree_widths: dict[tuple[str, int, int], set[int]] = {}

    def cache_for(self, rows: int, slots: int) -> SlotCache:
        """A cache of exactly ``rows`` rows and ``slot_bucket(slots)`` slots, emptied (its graphs'
        buffers: the same shape always gets the same cache)."""
        key = (rows, slot_bucket(slots))
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = SlotCache(self.model, *key, self.device)
        cache.valid.zero_()
        return cache

    def grow(self, cache: SlotCache, slots: int) -> SlotCache:
        """``cache`` with at least ``slots`` slots, its contents kept (mid-generation)."""
        new = self.cache_for(cache.rows, slots)
        new.kv[..., :cache.slots, :] = cache.kv
        new.valid[:, :cache.slots] = cache.valid
        new.start.copy_(cache.start)
        return new

    def release(self) -> None:
        """Free every cache (the graphs stay compiled; a later cache of a shape seen before
        compiles nothing, and on CUDA records its graphs again, untimed)."""
        self.caches.clear()

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches.values())

    def compiled(self, call):
        """``call`` (`slot_forward`, `forward_then`, `forward_chain`) compiled for this model."""
        return self.functions.compiled(call)

    def uncompiled(self, cache: SlotCache, args: tuple, kwargs: dict | None = None,
                   call=forward_then, fused: bool = True) -> Any:
        """``call`` not compiled yet (it compiles after the generation): its Python function,
        counted by a host-work counter as the one graph call it will be; a ``fused`` call's
        forwards compiled (graphs of their own, `forward`), the functions between them eager."""
        def forward(model, cache_, *args_, **kwargs_):  # ids, validity (a tree: ancestors,
            return self.forward(cache_, args_, kwargs=kwargs_)  # depths); features, hidden

        more = {"forward": forward} if fused else {}
        return GraphFunction(call, graph=self.options.cuda_graphs)(  # its outputs' clones counted
            self.model, cache, *args, **(kwargs or {}), **more)

    def warm(self, cache: SlotCache, args: tuple, kwargs: dict, call=slot_forward) -> float:
        """The untimed calls of a new shape of ``call`` on ``cache`` (`CompiledFunctions.warm`);
        returns their seconds."""
        return self.functions.warm(call, (self.model, cache, *args), kwargs)

    def forward(self, cache: SlotCache, args: tuple, compiled: bool = True,
                kwargs: dict | None = None, call=slot_forward):
        """``call`` (compiled or not) of ``args`` and the keyword ``kwargs`` (features, hidden):
        logits, (logits, hidden states), or what a fused call returns."""
        fn = self.compiled(call) if compiled else call
        return fn(self.model, cache, *args, **(kwargs or {}))


# (model, role) -> its static graphs; weak on the model, so they go with their model
_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graphs_for(model, role: str, device: torch.device,
               options: CompileOptions | None = None) -> StaticGraphs:
    """The static graphs of ``model`` in ``role`` ("target" / "draft": a model that is both gets
    two caches), created on first use."""
    options = options or CompileOptions()
    per_model = _GRAPHS.setdefault(model, {})
    graphs = per_model.get(role)
    if graphs is None or graphs.options != options:
        graphs = per_model[role] = StaticGraphs(model, device, options)
    return graphs


def release_graphs() -> None:
    """Free the static caches of every model's graphs (between the batch sizes of a sweep,
    say)."""
    for per_model in list(_GRAPHS.values()):
        for graphs in per_model.values():
            graphs.release()
