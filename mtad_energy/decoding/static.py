"""The compiled path: a static KV cache the runner writes at its own position, and a forward
compiled once per shape (gpt-fast style), under the same generate loop and decoders.

`StaticRunner` has `ModelRunner`'s interface. Differences, all inside it:

* the KV cache is preallocated ``[rows, H_kv, L, D]`` per layer (`SlotCache`); a forward of k
  tokens writes slots ``start .. start+k-1`` where ``start`` is a 0-d device tensor the runner
  sets from its host-side length, so **rollback is moving the write position** (nothing is
  freed or copied) and slots past it are masked out;
* every forward gets an explicit 4-D additive mask over all L slots (built inside the compiled
  graph for a chain: slot j is visible to query i iff ``j <= start + i``; given by the caller for a
  token tree) and explicit position ids; transformers returns a 4-D mask as-is, so the model
  code never asks the cache for its length and the graph has no data-dependent shapes;
* ``torch.compile(dynamic=False)`` specialises on the input shape: one graph per (rows, k, L)
  the loop uses - draft step, catch-up, verify of gamma+1, a tree of N nodes - compiled on first
  use; with ``mode="reduce-overhead"`` on CUDA each graph is replayed as a CUDA graph;
* keeping beam rows is an in-place gather into the first rows; keeping a tree path is an
  in-place gather of the path's slots to just after the prefix.

The compiled forward and its buffers live in a `StaticEngine` per (model, role) that outlives a
generation, so later generations reuse the graphs; the buffers grow (to the next power of two)
only when a generation needs more rows or slots, and the next forward then compiles again.
The prefill runs the same function uncompiled (its length differs per prompt).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from mtad_energy.decoding.base import ModelRunner, PhaseTimer, additive_mask, tree_inputs
from mtad_energy.decoding.tree import TREE_ATTN, TREE_MODEL_TYPES

MIN_SLOTS = 256


def _bucket(n: int) -> int:
    """The power of two >= n (at least MIN_SLOTS): prompts of similar length share graphs."""
    return max(MIN_SLOTS, 1 << (max(n, 1) - 1).bit_length())


class SlotLayer(CacheLayerMixin):
    """One layer's preallocated keys/values ``[rows, H_kv, L, D]``. ``update`` writes the k new
    entries at slots ``start + arange(k)`` of the first B rows and returns those rows whole."""

    is_compileable = True
    is_sliding = False

    def __init__(self, start: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.start = start
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("SlotLayer is allocated up front")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        b, k = key_states.shape[0], key_states.shape[-2]
        slots = self.start + torch.arange(k, device=key_states.device)  # [k]
        keys, values = self.keys[:b], self.values[:b]
        keys.index_copy_(2, slots, key_states.to(keys.dtype))
        values.index_copy_(2, slots, value_states.to(values.dtype))
        return keys, values

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self, *args, **kwargs) -> int:
        # The length lives on the host, in the StaticRunner. Models ask for it only to derive
        # positions (OPT always does, then ignores it when position_ids are given, as we do);
        # a constant keeps the compiled graph from guarding on a changing Python int.
        return 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """The static cache of one model: a `SlotLayer` per decoder layer, one shared ``start``."""

    def __init__(self, model, rows: int, slots: int, device: torch.device):
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.start = torch.zeros((), dtype=torch.long, device=device)
        shape = (rows, heads, slots, head_dim)
        layers = [SlotLayer(self.start, torch.zeros(shape, dtype=dtype, device=device),
                            torch.zeros(shape, dtype=dtype, device=device))
                  for _ in range(cfg.num_hidden_layers)]
        super().__init__(layers=layers)
        if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs may mutate them
            for t in (self.start, *(x for layer in layers for x in (layer.keys, layer.values))):
                torch._dynamo.mark_static_address(t)

    @property
    def rows(self) -> int:
        return self.layers[0].keys.shape[0]

    @property
    def slots(self) -> int:
        return self.layers[0].keys.shape[2]


def _forward(model, cache: SlotCache, input_ids: torch.Tensor,
             position_ids: torch.Tensor | None = None,
             allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``input_ids [B, k]`` -> float32 logits ``[B, k, V]``, written at slots start.. of ``cache``.

    position_ids ``[1, k]`` and allowed ``[k, L]`` (bool: query i sees slot j) default to a
    chain: positions ``start + i`` and slots ``j <= start + i``.
    """
    k = input_ids.shape[1]
    if position_ids is None:
        position_ids = (cache.start + torch.arange(k, device=input_ids.device))[None]  # [1, k]
    if allowed is None:
        slots = torch.arange(cache.slots, device=input_ids.device)
        allowed = slots[None, :] <= position_ids[0, :, None]  # [k, L]
    mask = additive_mask(allowed, cache.layers[0].keys.dtype)  # [1, 1, k, L]
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                past_key_values=cache, use_cache=True)
    return out.logits.float()


@dataclass(frozen=True)
class CompileOptions:
    """How `StaticEngine` compiles: ``mode`` None picks ``"reduce-overhead"`` (CUDA graphs) on
    CUDA with inductor and the default mode elsewhere."""

    backend: str = "inductor"
    mode: str | None = None
    # graphs the compiled forward may hold (dynamo counts them per code object, and every
    # engine compiles the same function: shapes x buffer sizes x models); dynamo's default is 8
    recompile_limit: int = 256


class StaticEngine:
    """A model's compiled forward and its `SlotCache`, shared by the generations that use it."""

    def __init__(self, model, device: torch.device, options: CompileOptions):
        self.model = model
        self.device = device
        self.options = options
        mode = options.mode
        if mode is None and device.type == "cuda" and options.backend == "inductor":
            mode = "reduce-overhead"
        self.mode = mode
        # Process-wide dynamo settings (it has no per-function ones): room for the graphs the
        # engines need, and an error instead of dynamo's silent fall-back to eager at the limit,
        # which would leave "compiled" timings measuring eager forwards.
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, options.recompile_limit)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit,
                                              8 * options.recompile_limit)
        cfg.fail_on_recompile_limit_hit = True
        # fullgraph: a graph break would split every layer into its own graphs (and recompile
        # them per layer index), slower than eager; better an error naming the cause
        self.compiled = torch.compile(_forward, backend=options.backend, mode=mode,
                                      dynamic=False, fullgraph=True)
        self.cache: SlotCache | None = None
        self._widths: set[tuple[int, int]] = set()  # (rows, tokens) of the compiled forwards

    def width_for(self, rows: int, k: int) -> int:
        """The width to run a forward of k tokens at: k itself for a draft step or catch-up
        (k <= 2) or when no wider forward of these rows was compiled yet; otherwise the
        narrowest compiled width >= k, the input padded. So the shorter drafts of a
        generation's last iterations (gamma shrinks to what is still wanted) reuse the full
        verify's graph instead of compiling new shapes in the middle of a measurement: the first
        verify of a generation is the widest, and a warm-up generation has compiled it."""
        if k <= 2:
            return k
        wider = [w for r, w in self._widths if r == rows and w >= k]
        if wider:
            return min(wider)
        self._widths.add((rows, k))
        return k

    def reserve(self, rows: int, slots: int) -> SlotCache:
        """The cache, grown (keeping its contents) when it has fewer rows or slots than asked."""
        old = self.cache
        if old is not None and old.rows >= rows and old.slots >= slots:
            return old
        rows = max(rows, old.rows if old else 1)
        new = SlotCache(self.model, rows, _bucket(max(slots, old.slots if old else 0)),
                        self.device)
        if old is not None:
            for a, b in zip(old.layers, new.layers, strict=True):
                b.keys[:a.keys.shape[0], :, :a.keys.shape[2]] = a.keys
                b.values[:a.values.shape[0], :, :a.values.shape[2]] = a.values
        self.cache = new
        return new

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                allowed: torch.Tensor | None, compiled: bool = True) -> torch.Tensor:
        fn = self.compiled if compiled else _forward
        logits = fn(self.model, self.cache, input_ids, position_ids, allowed)
        # a CUDA graph's outputs are overwritten by its next replay
        if compiled and self.mode == "reduce-overhead":
            return logits.clone()
        return logits


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


# (model, role) -> engine; weak on the model, so an engine goes with its model
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_for(model, role: str, device: torch.device,
               options: CompileOptions | None = None) -> StaticEngine:
    """The engine of ``model`` in ``role`` ("target" / "draft": a model that is both gets two
    caches), created on first use."""
    options = options or CompileOptions()
    per_model = _ENGINES.setdefault(model, {})
    eng = per_model.get(role)
    if eng is None or eng.options != options:
        eng = per_model[role] = StaticEngine(model, device, options)
    return eng


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


def make_runner(model, timer: PhaseTimer, phase: str, slots: int,
                options: CompileOptions | None = None) -> ModelRunner:
    """A `StaticRunner` for ``model``, or the eager `ModelRunner` (with a warning naming why)
    for a model that cannot compile."""
    why = eager_reason(model)
    if why is None:
        return StaticRunner(model, timer, phase, slots, options)
    warnings.warn(f"compile ({phase}): {why}", stacklevel=3)
    return ModelRunner(model, timer, phase)


class StaticRunner(ModelRunner):
    """`ModelRunner` over a `StaticEngine`: same interface, static cache, compiled forwards."""

    def __init__(self, model, timer: PhaseTimer, phase: str, slots: int,
                 options: CompileOptions | None = None):
        check_static_support(model)
        self.model = model
        self.forwards = 0
        self._timer = timer
        self._phase = phase
        device = next(model.parameters()).device
        self.engine = engine_for(model, phase, device, options)
        self.engine.reserve(1, slots)
        self.n = 0  # slots in use (host side: set by forwards, crops and gathers)
        self.rows = 1

    @property
    def cache(self) -> SlotCache:
        return self.engine.cache

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
             allowed: torch.Tensor | None, compiled: bool) -> torch.Tensor:
        b, k = input_ids.shape
        width = self.engine.width_for(b, k) if compiled else k
        cache = self.engine.reserve(b, self.n + width)
        if width > k:  # pad with copies of the last token: written past n, masked, overwritten
            pad = width - k
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(b, pad)], 1)
            if position_ids is not None:
                position_ids = torch.cat([position_ids, position_ids[:, -1:].expand(1, pad)], 1)
            if allowed is not None:
                allowed = torch.cat([allowed, allowed[-1:].expand(pad, -1)], 0)
        if allowed is not None and allowed.shape[1] != cache.slots:  # [w, n+k] -> [w, L]
            allowed = torch.cat([allowed, allowed.new_zeros(width, cache.slots - allowed.shape[1])],
                                1)
        cache.start.fill_(self.n)
        self.forwards += 1
        with self._timer(self._phase):
            logits = self.engine.forward(input_ids, position_ids, allowed, compiled)
        self.n += k
        return logits[:, :k] if width > k else logits

    def __call__(self, input_ids: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        assert counts is None, "a StaticRunner holds one sequence"
        return self._run(input_ids, None, None, compiled=True)

    def prefill(self, input_ids: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        assert counts is None, "a StaticRunner holds one sequence"
        return self._run(input_ids, None, None, compiled=False)

    def forward_tree(self, input_ids: torch.Tensor, anc_rows: torch.Tensor,
                     depths: torch.Tensor) -> torch.Tensor:
        allowed, pos = tree_inputs(anc_rows, depths, self.n)  # [K, n + K], [1, K]
        return self._run(input_ids, pos, allowed, compiled=True)

    def __len__(self) -> int:
        return self.n

    def crop(self, length: int) -> None:
        self.n = min(self.n, length)

    def _layers(self):
        for layer in self.cache.layers:
            yield layer.keys
            yield layer.values

    def select_rows(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.cache.start.device)
        m, n = rows.shape[0], self.n
        for buf in self._layers():
            buf[:m, :, :n] = buf[:, :, :n].index_select(0, rows)
        self.rows = m

    def repeat_rows(self, n_rows: int) -> None:
        self.engine.reserve(n_rows, self.n)
        n = self.n
        for buf in self._layers():
            buf[1:n_rows, :, :n] = buf[:1, :, :n]
        self.rows = n_rows

    def keep_positions(self, prefix_len: int, positions: torch.Tensor) -> None:
        positions = positions.to(self.cache.start.device)
        end, r = prefix_len + positions.shape[0], self.rows
        for buf in self._layers():
            buf[:r, :, prefix_len:end] = buf[:r].index_select(2, positions)
        self.n = end
