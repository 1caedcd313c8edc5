"""Multi-step speculative sampling over a static token tree (SpecInfer, MCSS), as a pure function.

Tree layout (``tree.level_parents``): level l has ``prod(branching[:l+1])`` nodes stored after the
previous levels; the children of the j-th node of a level are contiguous. Rows of ``p``: root
(the last emitted token) then every node; rows of ``q``: root then every internal node.
"""

from __future__ import annotations

import itertools

import torch

from mtad_energy.decoding.sampling import residual


def level_offsets(branching: tuple[int, ...]) -> list[int]:
    """First node index of each level."""
    widths = list(itertools.accumulate(branching, lambda a, b: a * b))
    return [0, *itertools.accumulate(widths)][:len(branching)]


def remove_token(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """MCSS: q without token x, renormalised ``[..., V]`` (x ``[...]``); all-zero once its
    support is used up."""
    q = q.scatter(-1, x[..., None], 0.0)
    return q / q.sum(-1, keepdim=True).clamp_min(1e-30)


def _at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``x[b, i[b]]`` per row: x ``[B, N, ...]``, i ``[B]`` -> ``[B, ...]``."""
    idx = i.view(-1, 1, *([1] * (x.dim() - 2))).expand(-1, 1, *x.shape[2:])
    return x.gather(1, idx).squeeze(1)


def tree_speculative_accept(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor,
                            branching: tuple[int, ...], u: torch.Tensor,
                            without_replacement: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk the tree from the root, accepting at most one child per level; for one tree or for
    B trees of the same shape (a leading ``[B]`` on every argument and result).

    p: ``[1 + N, V]`` warped target at the root and every node. q: ``[1 + N_int, V]`` warped draft
    the children were drawn from. tokens: ``[N]`` node tokens. u: ``[N]`` uniforms (one per node;
    each node is tested at most once).
    At a node, try its children in order: accept x with prob min(1, p(x)/q(x)); on rejection
    p <- norm(max(0, p - q)) and, without replacement (MCSS), q <- norm(q with x removed). A child
    with q(x) = 0 is no draw at all (MCSS children beyond q's support, e.g. after top-k) and is
    skipped. If every child fails, the next token comes from the current p; after a leaf, from p
    at the leaf. Returns ``(depth, path [L], dist [V])``: the accepted depth (0-d), the accepted
    node per level (the first ``depth`` valid) and the distribution of the next token.
    All tensor ops, no host sync: the loop runs over the static sum(branching) child slots.
    """
    if tokens.dim() == 1:  # one tree: a batch of one
        depth, path, dist = tree_speculative_accept(p[None], q[None], tokens[None], branching,
                                                    u[None], without_replacement)
        return depth[0], path[0], dist[0]
    offsets = level_offsets(branching)
    levels = len(branching)
    rows = tokens.shape[0]
    zero = torch.zeros(rows, dtype=torch.long, device=p.device)
    cur = zero  # index of the current node within its level, per tree
    alive = torch.ones(rows, dtype=torch.bool, device=p.device)
    depth = zero
    p_cur, q_cur, dist = p[:, 0], q[:, 0], p[:, 0]  # [B, V]
    path = []
    for level, b in enumerate(branching):
        first = offsets[level] + cur * b  # [B]
        chosen, found = first, torch.zeros_like(alive)
        for c in range(b):
            i = first + c
            x = _at(tokens, i)  # [B]
            p_x, q_x = _at(p_cur, x), _at(q_cur, x)
            tried = alive & ~found & (q_x > 0)
            ok = tried & (_at(u, i) * q_x <= p_x) & (p_x > 0)
            rejected = tried & ~ok
            chosen = torch.where(ok, i, chosen)
            found = found | ok
            p_cur = torch.where(rejected[:, None], residual(p_cur, q_cur), p_cur)
            if without_replacement:
                q_cur = torch.where(rejected[:, None], remove_token(q_cur, x), q_cur)
        # stop here: the residual gives the token
        dist = torch.where((alive & ~found)[:, None], p_cur, dist)
        alive = alive & found
        depth = depth + alive.long()
        path.append(chosen)
        cur = chosen - offsets[level]
        p_cur = _at(p, 1 + chosen)  # only used while alive
        if level + 1 < levels:
            q_cur = _at(q, 1 + chosen)
    dist = torch.where(alive[:, None], p_cur, dist)  # accepted a leaf: its bonus token from p
    return depth, torch.stack(path, 1), dist
