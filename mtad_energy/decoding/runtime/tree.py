"""Token trees: tree attention mask, position ids, one-forward verification and path keeping.

A tree of N nodes is a parent vector ``parents [N]`` (long) with ``parents[i] < i`` (nodes are in
topological order, e.g. level by level) and -1 for a node attached directly to the prefix. Nodes
are fed to a model in index order, so node i lands at cache position ``prefix_len + i``.

Each node sees the whole prefix, its ancestors and itself (SpecInfer's tree attention). Depth
counts ancestors-or-self inside the tree (a node hanging off the prefix has depth 1), so a node's
position id is ``prefix_len + depth - 1``: exactly where it would sit in a sequential run of its
path. Callers that verify with the target put the prefix's last token at the root (node 0,
parent -1) and pass ``prefix_len = n - 1`` (the cache invariant of ``runtime.runner``).

The 4-D float mask ``[1, 1, K, past + K]`` (0 allowed, dtype-min elsewhere) goes through
transformers' custom-mask path (``masking_utils`` returns a 4-D mask as-is) with explicit
``position_ids``; verified for the architectures in ``TREE_MODEL_TYPES`` with eager and sdpa.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

from mtad_energy.decoding.runtime.masks import additive_mask
from mtad_energy.decoding.runtime.params import DecoderParams, require
from mtad_energy.decoding.runtime.runner import ModelRunner

# model_type values whose HF implementation takes a custom 4-D additive mask plus position_ids
# (tested in tests/decoding/runtime/test_tree.py); others may silently ignore or rebuild the mask.
TREE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "opt"})
TREE_ATTN = frozenset({"eager", "sdpa"})


def check_tree_support(model) -> None:
    """Raise NotImplementedError naming the architecture if it cannot run a token tree."""
    cfg = model.config
    arch = type(model).__name__
    model_type = getattr(cfg, "model_type", "?")
    attn = getattr(cfg, "_attn_implementation", None) or "eager"
    if model_type not in TREE_MODEL_TYPES:
        raise NotImplementedError(
            f"tree attention needs a custom 4-D attention mask, which {arch} "
            f"(model_type={model_type!r}) is not known to accept; supported model types: "
            f"{', '.join(sorted(TREE_MODEL_TYPES))}. Use a chain decoder (spd, mtad) instead.")
    if attn not in TREE_ATTN:
        raise NotImplementedError(
            f"tree attention on {arch} needs attn_implementation in {sorted(TREE_ATTN)} "
            f"(a custom 4-D mask), got {attn!r}; reload the model with attn_implementation='sdpa'")


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """``anc [..., N, N]`` bool: ``anc[..., i, j]`` iff j is i or an ancestor of i; ``parents
    [..., N]`` (one tree, or one per sequence: EAGLE-2's dynamic trees).

    Transitive closure by repeated squaring of (I + parent edges): ceil(log2 N) tiny matmuls, no
    host sync (a walk up the tree would need one per level to know when to stop).
    """
    n = parents.shape[-1]
    a = torch.eye(n, device=parents.device).expand(*parents.shape[:-1], n, n).clone()
    par = parents.clamp_min(0)[..., None]  # a prefix-attached node maps onto 0: harmless
    a.scatter_(-1, par, torch.maximum(a.gather(-1, par), (parents >= 0).float()[..., None]))
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
        a = (a @ a).clamp_max(1.0)
    return a > 0


def depths(anc: torch.Tensor) -> torch.Tensor:
    """``[(B,) N]`` long: 1 for a node on the prefix, parent's depth + 1 otherwise."""
    return anc.sum(-1)


def tree_mask(anc_rows: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[1, 1, K, prefix_len + M + K]`` for K new nodes.

    anc_rows: ``[K, M + K]`` ancestor rows of the new nodes over all tree nodes (the M earlier
    ones are already in the cache after the prefix).
    """
    k = anc_rows.shape[0]
    return additive_mask(torch.cat([anc_rows.new_ones(k, prefix_len), anc_rows], 1), dtype)


def tree_forward(runner: ModelRunner, tokens: torch.Tensor, anc: torch.Tensor,
                 prefix_len: int | None = None) -> torch.Tensor:
    """Run the last K nodes of a tree through ``runner`` in one forward -> logits ``[K, V]``
    (tokens ``[K]``), or ``[B, K, V]`` for B sequences' trees of the same shape (tokens
    ``[B, K]``, `batch.RowsRunner`).

    anc: ``[M + K, M + K]`` ancestor matrix of the whole tree (``ancestors(parents)``); the cache
    must hold each sequence's prefix followed by tree nodes 0..M-1 (M = 0 for a tree fed at
    once). ``prefix_len`` (one sequence): checked against the cache.
    """
    check_tree_support(runner.model)
    k = tokens.shape[-1]
    m = anc.shape[-1] - k
    if prefix_len is not None and len(runner) != prefix_len + m:
        raise ValueError(f"cache holds {len(runner)} positions, expected prefix_len + M = "
                         f"{prefix_len} + {m}")
    rows = anc[..., m:, :]  # [(B,) K, M + K]: one tree shape for all, or one per sequence
    logits = runner.forward_tree(tokens.reshape(-1, k), rows, depths(rows))
    return logits if tokens.dim() == 2 else logits[0]


def tree_verify(runner: ModelRunner, calls, tokens: torch.Tensor, anc: torch.Tensor,
                fn: Callable[..., Any], *args: Any) -> Any:
    """`tree_forward` of B sequences' trees fed at once (``tokens [B, K]``, ``anc [(B,) K, K]``),
    then ``fn(logits [B, K, V], *args)`` through ``calls`` (a verify's rule), which returns
    ``(block, accepted, length [B], path [B, m], *rest)``, and the tree rolled back to the path
    (root first; the loop crops it to the block's length): one graph call on the compiled path,
    the rollback included (`ModelRunner.verify_tree`). Returns ``rest``: what the host needs."""
    check_tree_support(runner.model)
    return runner.verify_tree(calls, tokens, anc, depths(anc), fn, *args)


def keep_path(runner: ModelRunner, prefix_len: int, nodes: torch.Tensor) -> None:
    """Keep the prefix and the KV entries of tree nodes ``nodes [m]`` (root first), dropping the
    rest of the tree: afterwards the cache equals a sequential run of that path (no recompute)."""
    runner.keep_tree(len(runner) - prefix_len, nodes)


def level_parents(branching: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
    """Parents ``[N]`` of a static tree: every node at level l has ``branching[l]`` children,
    levels stored one after another, children of a node contiguous; level-1 parents are -1."""
    parents, prev_off, width = [], -1, 1
    for b in branching:
        off = sum(p.shape[0] for p in parents)
        par = torch.arange(width * b, device=device) // b
        parents.append(par + prev_off if prev_off >= 0 else torch.full_like(par, -1))
        prev_off, width = off, width * b
    return torch.cat(parents)


MAX_TREE_NODES = 1024


def set_branching(params: DecoderParams, name: str = "branching") -> None:
    """Check a static tree's ``branching`` parameter (children per node at each level) and
    normalise it to a tuple on the frozen ``params``: ints >= 1, at least one level, at most
    `MAX_TREE_NODES` nodes."""
    value = getattr(params, name)
    try:
        branching = tuple(int(b) for b in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of ints such as 4,2,2, got {value!r}") from None
    object.__setattr__(params, name, branching)  # frozen: normalise lists to a tuple
    require(len(branching) >= 1, f"{name} must name at least one level, e.g. 4,2,2")
    require(all(b >= 1 for b in branching),
            f"every branching factor must be >= 1, got {branching}")
    nodes = tree_nodes(branching)
    require(nodes <= MAX_TREE_NODES, f"{name} {branching} gives {nodes} tree nodes; at "
            f"most {MAX_TREE_NODES} fit one verification forward")


@lru_cache(maxsize=32)
def rooted_tree(branching: tuple[int, ...], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(parents [1 + N], anc [1 + N, 1 + N])`` of the static tree with the last emitted token
    at the root (index 0): the tree a target verifies."""
    parents = torch.cat([torch.full((1,), -1, device=device),
                         level_parents(branching, device) + 1])
    return parents, ancestors(parents)


@lru_cache(maxsize=32)
def tree_structure(branching: tuple[int, ...], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor matrices of a static tree a draft grows and a target verifies: the draft's ``[N,
    N]`` (levels on the prefix) and the target's ``[1 + N, 1 + N]`` (the last emitted token at
    the root)."""
    parents = level_parents(branching, device)
    return ancestors(parents), ancestors(torch.cat([parents.new_full((1,), -1), parents + 1]))


def tree_nodes(branching: tuple[int, ...]) -> int:
    """Nodes of a static tree (4, 2, 2: 4 + 8 + 16 = 28)."""
    return sum(math.prod(branching[:i + 1]) for i in range(len(branching)))


def tree_warm_forwards(role: str, branching: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The forwards a static draft tree of ``branching`` and its verify run only inside the
    loop (`Decoder.warm_forwards`' fields, one tree for all rows): the draft's levels but the
    leaves (grown level by level: `ModelRunner.tree_levels`; K nodes after the M of the levels
    before) and its catch-up after it drops its tree (`DecodeState.draft_rewind`: the accepted
    path and the bonus, up to depth + 1 tokens, a chain); the target's tree of the root and
    every node (4, 2, 2: the draft's 4 after 0 and 8 after 4, a chain of 4; the target's 29)."""
    if role == "target":
        return ((1 + tree_nodes(branching), 0),)
    sizes = [math.prod(branching[:i + 1]) for i in range(len(branching) - 1)]
    return ((len(branching) + 1,),) + tuple((c, sum(sizes[:i])) for i, c in enumerate(sizes))
