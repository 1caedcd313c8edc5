"""Work observed, not counted: what a model's forwards really did, and a device that charges it.

`mtad_energy.energy.work` counts a forward's FLOPs and bytes from the model's dimensions and the
forward's shape (the rule the energy model is fitted and attributed with). This module observes
the same work independently, from the tensors the forwards touch, for two users:

* the tests of the counting rule (the count must equal what a forward is seen to do);
* the simulated device (`measure.simulated`, ``--meter simulated``): a `RooflineDevice` charges
  ``static_w * T + j_per_flop * W + j_per_byte * Q`` for the work its `WorkTap` saw, so a CPU-only
  pipeline produces joules with a known truth that a fit of the energy roofline must recover.

FLOPs come from torch's formulas (`matrix_flops`: matrix products and attention), also used by
the ops profiler (`measure.profiler`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

Clock = Callable[[], float]


def matrix_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one aten op by torch's formulas: matrix products and attention (0 for the rest,
    pointwise ops included)."""
    import torch
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    packet = func._overloadpacket
    if packet in _sdpa_ops(aten) and _is_bhld(args[:3]):
        # counted here, not by torch's formula: with grouped-query attention (enable_gqa, e.g.
        # Llama with num_key_value_heads < num_heads) the CUDA kernels get K/V with fewer heads,
        # and torch < 2.13's sdpa_flop_count asserts equal head counts
        return _sdpa_flops(args[0], args[1], args[2])
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet is aten.linear:
        # under inference_mode linear reaches the dispatcher whole (not as addmm/mm), and the
        # flop registry has no entry for it: 2 * (rows of x) * in * out
        x, w = args[0], args[1]
        return 2 * x.numel() * w.shape[0]
    return 0


def flop_counter() -> Any:
    """A dispatch mode that adds up `matrix_flops` of every op run inside it (``.flops``); no
    syncs, no timing: cheap enough to wrap every forward of a simulated run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _FlopCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            self.flops += matrix_flops(func, args, kwargs, out)
            return out

    return _FlopCounter()


def _sdpa_ops(aten: Any) -> tuple[Any, ...]:
    """Scaled-dot-product attention ops whose first three arguments are q, k, v [B, H, L, D]."""
    names = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention")
    return tuple(getattr(aten, n) for n in names if hasattr(aten, n))


def _is_bhld(tensors: Any) -> bool:
    import torch

    return len(tensors) == 3 and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors)


def _sdpa_flops(q: Any, k: Any, v: Any) -> int:
    """FLOPs of softmax(Q K^T) V for q [B, H, Lq, D], k [B, H_kv, Lk, D], v [B, H_kv, Lk, Dv]:
    2*B*H*Lq*Lk*D for Q K^T plus 2*B*H*Lq*Lk*Dv for P V, H being the query's head count (each
    K/V head serves H/H_kv query heads under grouped-query attention)."""
    b, h, lq, d = q.shape
    lk, dv = k.shape[-2], v.shape[-1]
    return 2 * b * h * lq * lk * d + 2 * b * h * lq * lk * dv


@dataclass(frozen=True)
class RooflineDevice:
    """A simulated device whose energy is ``static_w * T + j_per_flop * W + j_per_byte * Q``
    (the energy roofline of Choi et al., IPDPS 2013) over the work W (FLOPs) and Q (bytes) its
    `tap` counted. The defaults are made up so that each term carries a visible share of the
    joules at a CPU's speed on the default pair; they are not any real GPU's values."""

    static_w: float = 30.0
    j_per_flop: float = 2e-9
    j_per_byte: float = 3e-9
    clock: Clock = time.perf_counter
    counter: list[int] | None = None  # [flops, bytes] done so far (mutable: the device's state)

    def __post_init__(self) -> None:
        if self.counter is None:
            object.__setattr__(self, "counter", [0, 0])

    @property
    def flops(self) -> int:
        return self.counter[0]

    @property
    def bytes(self) -> int:
        return self.counter[1]

    def record(self, flops: int, nbytes: int) -> None:
        self.counter[0] += int(flops)
        self.counter[1] += int(nbytes)

    def energy_j(self, time_s: float, flops: float, nbytes: float) -> float:
        return self.static_w * time_s + self.j_per_flop * flops + self.j_per_byte * nbytes

    def tap(self, *models: Any) -> Any:
        """Context manager: while open, every forward of ``models`` adds its work (`WorkTap`)."""
        return WorkTap(self.record).attached(*models)


class WorkTap:
    """Counts the work of a model's forwards from the tensors they touch, independently of any
    counting formula: FLOPs from torch's formulas for every matrix product and attention op
    dispatched (`profiler.matrix_flops`; dynamically quantised linear layers by their shapes);
    bytes as the parameters read (each once per forward, by the modules that ran: a draft head's
    layer that a forward skips reads nothing; an embedding table as the rows it gathers), the KV
    cache tensors before and after the forward (all of them read by attention; a cache that
    grew into a new tensor was copied: old ones read, new ones written; one updated in place
    wrote only the new columns), and the logits written (a forward returning a bare tensor:
    that tensor).

    ``attached(*models)`` wraps each model's ``forward`` (and hooks its embedding and quantised
    linear modules) until it exits; ``on_work(flops, bytes)`` is called after every forward.
    Eager forwards only: a ``torch.compile``d forward is not seen."""

    def __init__(self, on_work: Callable[[int, int], None]):
        self.on_work = on_work
        self._gathered = 0  # embedding bytes and quantised-linear FLOPs of the current forward
        self._extra_flops = 0
        self._ran: set[int] = set()  # modules owning parameters that ran in the current forward

    @contextmanager
    def attached(self, *models: Any) -> Iterator[WorkTap]:
        import torch

        unique = list({id(m): m for m in models if m is not None}.values())
        hooks, wrapped = [], []
        seen: set[int] = set()
        try:
            for model in unique:
                for module in model.modules():
                    if id(module) in seen:  # modules a self-draft shares with its target
                        continue
                    seen.add(id(module))
                    if isinstance(module, torch.nn.Embedding):
                        hooks.append(module.register_forward_hook(self._on_gather))
                    elif callable(getattr(module, "weight", None)):  # dynamic int8 Linear
                        hooks.append(module.register_forward_hook(self._on_quantized_linear))
                    if any(True for _ in module.parameters(recurse=False)):
                        hooks.append(module.register_forward_hook(self._on_ran))
                wrapped.append((model, model.__dict__.get("forward")))
                model.forward = self._wrap(model.forward, _ParamReads(model))
            yield self
        finally:
            for model, own in wrapped:  # the forward it had: its class's, or a wrapper's
                if own is None:
                    del model.forward
                else:
                    model.forward = own
            for hook in hooks:
                hook.remove()

    def _on_gather(self, module: Any, args: Any, out: Any) -> None:
        self._gathered += out.numel() * out.element_size()

    def _on_ran(self, module: Any, args: Any, out: Any) -> None:
        self._ran.add(id(module))

    def _on_quantized_linear(self, module: Any, args: Any, out: Any) -> None:
        self._extra_flops += 2 * args[0].numel() * module.out_features

    def _wrap(self, forward: Callable[..., Any], reads: _ParamReads) -> Callable[..., Any]:
        from mtad_energy.hf_cache import cache_from

        def tapped(*args: Any, **kwargs: Any) -> Any:
            import torch

            if torch.compiler.is_compiling():  # traced into a compiled graph: not seen
                return forward(*args, **kwargs)
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache = cache_from(kwargs)
            before = _kv_tensors(cache)
            self._gathered = self._extra_flops = 0
            self._ran = set()
            counter = flop_counter()
            with counter:
                out = forward(*args, **kwargs)
            rows, new = ids.shape
            nbytes = (reads.bytes(self._ran) + self._gathered
                      + _kv_traffic(before, _kv_tensors(cache), rows, new))
            logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
            nbytes += logits.numel() * logits.element_size() if logits is not None else 0
            self.on_work(counter.flops + self._extra_flops, nbytes)
            return out

        return tapped


def _full_read_bytes(model: Any) -> int:
    """Bytes of the parameters a forward reads whole: every distinct parameter tensor except the
    tables only embeddings own (those are read as the rows they gather), plus the int8 weights
    of dynamically quantised linear layers (not parameters)."""
    import torch

    embedding_only: set[int] = set()
    other: set[int] = set()
    total = 0
    for module in model.modules():
        if callable(getattr(module, "weight", None)):  # dynamic int8 Linear: packed weights
            for t in (module.weight(), module.bias()):
                total += 0 if t is None else t.numel() * t.element_size()
        owner = embedding_only if isinstance(module, torch.nn.Embedding) else other
        owner.update(id(p) for p in module.parameters(recurse=False))
    counted: set[int] = set()
    for p in model.parameters():  # distinct tensors (a tied table once)
        if id(p) in counted or (id(p) in embedding_only and id(p) not in other):
            continue
        counted.add(id(p))
        total += p.numel() * p.element_size()
    return total


class _ParamReads:
    """The parameter bytes one forward of a model reads: `_full_read_bytes`, less the parameters
    whose every owning module did not run (EAGLE-3's fusion layer on a forward fed the head's own
    features)."""

    def __init__(self, model: Any):
        import torch

        self.full = _full_read_bytes(model)
        self._owners: dict[int, tuple[Any, set[int]]] = {}  # parameter -> (it, its owners)
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                continue  # read as the rows it gathers
            for p in module.parameters(recurse=False):
                self._owners.setdefault(id(p), (p, set()))[1].add(id(module))

    def bytes(self, ran: set[int]) -> int:
        skipped = sum(p.numel() * p.element_size() for p, owners in self._owners.values()
                      if not owners & ran)
        return self.full - skipped


def _kv_tensors(cache: Any) -> list[tuple[int, int, Any] | None]:
    """Per layer of a transformers cache: (data pointer, columns, keys) of its keys, or None
    while the layer holds nothing (empty without a cache)."""
    out: list[tuple[int, int, Any] | None] = []
    for layer in getattr(cache, "layers", None) or []:
        keys = getattr(layer, "keys", None)
        ok = keys is not None and keys.numel() > 0
        out.append((keys.data_ptr(), keys.shape[-2], keys) if ok else None)
    return out


def _kv_traffic(before: list[tuple[int, int, Any] | None], after: list[tuple[int, int, Any] | None],
                rows: int, new: int) -> int:
    """KV bytes of one forward over ``rows`` input rows, keys and values alike: every column of
    each updated layer read by attention; a layer whose tensor was replaced (concatenation) read
    its old columns and wrote the new tensor whole, one updated in place wrote ``new`` columns."""
    total = 0
    for i, now in enumerate(after):
        if now is None:
            continue
        ptr, cols, keys = now
        per_col = 2 * rows * keys.numel() // (keys.shape[0] * cols) * keys.element_size()
        prev = before[i] if i < len(before) else None
        total += per_col * cols  # attention reads every column
        if prev is not None and prev[0] == ptr:
            total += per_col * new  # written in place
        else:
            total += per_col * (cols + (prev[1] if prev is not None else 0))
    return total
