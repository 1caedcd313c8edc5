"""KV-cache helpers over transformers' ``DynamicCache``.

We slice ``cache.layers[i].keys/values`` (shape ``[B, H_kv, T, D]``) ourselves rather than call
``DynamicCache.crop``: its argument changed meaning between transformers 5.17 (absolute length)
and 5.23 (tokens to remove), and the project supports both.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def _layers(cache: DynamicCache):
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError(
                f"{type(layer).__name__}: sliding-window KV caches cannot be rolled back by "
                "mtad-energy; use a model with full attention layers (Llama, OPT, SmolLM2).")
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            yield layer


def cache_len(cache: DynamicCache) -> int:
    """Number of cached positions (T)."""
    return max((layer.keys.shape[-2] for layer in _layers(cache)), default=0)


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions (roll back rejected tokens)."""
    for layer in _layers(cache):
        if layer.keys.shape[-2] > length:  # nothing to cut: no new views
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Gather batch rows (beam reorder / keep the best beam): ``rows [B']`` (any device: moved
    to the cache's, a no-op when it is there already)."""
    for layer in _layers(cache):
        rows = rows.to(layer.keys.device)
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


def repeat_rows(cache: DynamicCache, n: int) -> None:
    """Expand every row to n consecutive identical rows (B rows -> B*n, row b*n + w: the beams
    of a beam search per sequence; a batch-1 cache becomes n rows)."""
    for layer in _layers(cache):
        layer.keys = layer.keys.repeat_interleave(n, 0)
        layer.values = layer.values.repeat_interleave(n, 0)


def keep_positions(cache: DynamicCache, positions: torch.Tensor) -> None:
    """Keep only the given positions along T (e.g. the accepted path of a token tree); any
    device, as for ``select_rows``."""
    for layer in _layers(cache):
        positions = positions.to(layer.keys.device)
        layer.keys = layer.keys.index_select(2, positions)
        layer.values = layer.values.index_select(2, positions)


def gather_columns(cache: DynamicCache, order: torch.Tensor) -> None:
    """Row r keeps positions ``order[r]`` (``[B, T']``, per row; compaction of a batched cache)."""
    for layer in _layers(cache):
        order = order.to(layer.keys.device)
        b, h, _, d = layer.keys.shape
        idx = order[:, None, :, None].expand(b, h, order.shape[1], d)
        layer.keys = layer.keys.gather(2, idx)
        layer.values = layer.values.gather(2, idx)
