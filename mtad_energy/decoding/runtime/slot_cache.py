"""The static KV cache of the compiled path (`static`): per decoder layer, keys and values
preallocated as ``[rows, H_kv, L, D]`` (`SlotLayer`), views of one buffer ``kv [2 * layers, rows,
H_kv, L, D]`` (so moving rows or columns of every layer is one op, not one per layer), written
at slots ``start .. start+k-1`` where ``start`` is one 0-d device tensor shared by the layers,
and a bool ``valid [rows, L]`` saying which slots a row holds (`SlotCache`). Nothing is freed
or copied on rollback: the runner invalidates columns and moves ``start``. Every buffer keeps its
address (CUDA graphs replay over them).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """One layer's preallocated keys/values ``[rows, H_kv, L, D]``. ``update`` writes the k new
    entries at slots ``start + arange(k)`` of the first B rows and returns those rows whole."""

    is_compileable = True
    is_sliding = False

    def __init__(self, start: torch.Tensor, kv: torch.Tensor, index: int):
        # not CacheLayerMixin.__init__: its keys / values are this class's views of ``kv``
        self.start = start
        # the cache's one buffer and this layer's place in it: the views are taken where they
        # are used (inside a compiled graph too), so the graph's only input is the buffer, not
        # 2 x layers aliasing views of it (which AOT autograd would rebase on every compile)
        self.kv, self.index = kv, index
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:  # [rows, H_kv, L, D]
        return self.kv[2 * self.index]

    @property
    def values(self) -> torch.Tensor:
        return self.kv[2 * self.index + 1]

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
    """The static cache of one model: a `SlotLayer` per decoder layer, one shared ``start``,
    and ``valid [rows, L]`` (row r holds slot j)."""

    def __init__(self, model, rows: int, slots: int, device: torch.device):
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.valid = torch.zeros(rows, slots, dtype=torch.bool, device=device)
        self.flat_valid = self.valid.view(-1)  # [rows * slots]: for indexed writes of columns
        n = cfg.num_hidden_layers
        # keys of layer i at kv[2i], values at kv[2i + 1]: contiguous views, as separate buffers
        self.kv = torch.zeros((2 * n, rows, heads, slots, head_dim), dtype=dtype, device=device)
        layers = [SlotLayer(self.start, self.kv, i) for i in range(n)]
        super().__init__(layers=layers)
        # the forward shapes already run (compiled, and on CUDA recorded) on these buffers
        self.warmed: set[tuple] = set()
        if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs may mutate them
            for t in (self.start, self.valid, self.kv):
                torch._dynamo.mark_static_address(t)

    def buffers(self):
        """Every layer's keys and values (views of `kv`)."""
        for layer in self.layers:
            yield layer.keys
            yield layer.values

    @property
    def rows(self) -> int:
        return self.valid.shape[0]

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
