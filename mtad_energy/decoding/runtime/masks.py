"""Tree-attention inputs of one forward: the additive mask transformers takes and the tree's
allowed matrix and positions over a cache (`ModelRunner.forward_tree`)."""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed [k, T]`` or ``[B, k, T]`` (bool) -> the 4-D additive mask ``[1 or B, 1, k, T]``
    transformers takes as-is: 0 where allowed, the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None] if allowed.dim() == 2 else mask[:, None]


def tree_inputs(anc_rows: torch.Tensor, depths: torch.Tensor, cached: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tree forward (`ModelRunner.forward_tree`) over a cache of ``cached``
    positions, the last M of them earlier tree nodes: ``(allowed [K, cached + K], position_ids
    [1, K])``. ``anc_rows [(1,) K, M + K]``, ``depths [(1,) K]``."""
    if anc_rows.dim() == 3:  # one tree per sequence: here one sequence
        anc_rows, depths = anc_rows[0], depths[0]
    k = anc_rows.shape[0]
    prefix = cached - (anc_rows.shape[1] - k)
    allowed = torch.cat([anc_rows.new_ones(k, prefix), anc_rows], 1)
    return allowed, (prefix - 1 + depths)[None]
