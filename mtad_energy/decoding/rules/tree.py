"""The token-tree rules (SpecInfer and MCSS's multi-step speculative sampling, EAGLE and Medusa's
candidate and typical acceptance) as pure tensor functions.

Tree layout (``runtime.tree.level_parents``): level l has ``prod(branching[:l+1])`` nodes stored after the
previous levels; the children of the j-th node of a level are contiguous. Rows of ``p``: root
(the last emitted token) then every node; rows of ``q``: root then every internal node.
"""

from __future__ import annotations

import itertools

import torch

from mtad_energy.decoding.rules.sampling import residual, sample_shape, sample_u, uniforms


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


# --- trees of deterministic candidates (EAGLE, Medusa) --------------------------------------------

def node_depths(anc: torch.Tensor) -> torch.Tensor:
    """Depth of every node of a tree with its root at index 0: ``anc [..., 1 + N, 1 + N]``
    (ancestors-or-self) -> ``[..., 1 + N]`` (the root 0)."""
    return anc.sum(-1) - 1


def _deepest(on_path: torch.Tensor, depth: torch.Tensor, key: torch.Tensor | None = None
             ) -> torch.Tensor:
    """Per row the deepest node with ``on_path`` (``[B, 1 + N]``; the root always is), ties by
    the larger ``key`` then the lower index -> ``[B]``."""
    score = depth.to(torch.float64) * 1e9 + (0.0 if key is None else key.to(torch.float64))
    return score.masked_fill(~on_path, float("-inf")).argmax(-1)


def _path(anc: torch.Tensor, depth: torch.Tensor, node: torch.Tensor, levels: int
          ) -> torch.Tensor:
    """``[B, levels]``: the ancestor of ``node [B]`` at each level 1..levels, padded with
    ``node`` past its depth (keeping a padded path keeps the same columns,
    `ModelRunner.keep_tree`). anc ``[B, 1 + N, 1 + N]``, depth ``[B, 1 + N]``."""
    line = anc.gather(1, node[:, None, None].expand(-1, 1, anc.shape[-1]))[:, 0]  # [B, 1 + N]
    level = torch.arange(1, levels + 1, device=depth.device)  # [L]
    at = line[:, None, :] & (depth[:, None, :] == level[None, :, None])  # [B, L, 1 + N]
    return torch.where(at.any(-1), at.long().argmax(-1), node[:, None])


def _children_mask(tokens: torch.Tensor, parents: torch.Tensor, allowed: torch.Tensor,
                   node: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, V]``: 1.0 at the tokens of ``node``'s allowed children."""
    child = (parents == node[:, None]) & allowed  # [B, 1 + N]
    mask = torch.zeros(tokens.shape[0], vocab, device=tokens.device)
    return mask.scatter_add_(1, tokens, child.float()).clamp_max_(1.0)


def tree_candidates_accept(p: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                           anc: torch.Tensor, caps: torch.Tensor, levels: int,
                           generator: torch.Generator | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless verification of B token trees whose children are *chosen*, not sampled (the top
    tokens of a head: EAGLE, Medusa), so a child's q is one-hot at its own token, as EAGLE's
    ``evaluate_posterior`` treats them: at a node accept child x with prob p(x) / 1, on rejection
    p <- norm(max(0, p - onehot(x))), next child; when all fail, sample the residual. Children of
    a node are distinct tokens, so this is: draw y ~ p at every node; descend into the child
    whose token is y; at the node where none is, emit a sample of p without its children
    (`sampling.residual` of p and the children's indicator). Lossless w.r.t. p, greedy-exact.

    p: ``[B, 1 + N, V]`` warped target at the root (index 0, the last emitted token) and every
    node; tokens ``[B, 1 + N]`` (the root's is ignored); parents ``[(B,) 1 + N]`` (root -1);
    anc ``[(B,) 1 + N, 1 + N]`` ancestors-or-self; caps ``[B]``: nodes deeper than caps[b] are
    not row b's draft (a row near its end); levels: the tree's depth L (host-known). Returns
    ``(depth [B], path [B, L], next [B], node [B])``: accepted depth, the accepted node per
    level 1..L (padded past the depth with the last), the next token, and the deepest accepted
    node (0: the root).
    """
    u = uniforms(sample_shape(p), generator, p.device)
    return tree_candidates_accept_u(p, tokens, parents, anc, caps, levels, u,
                                    uniforms((tokens.shape[0], 1), generator, p.device))


def tree_candidates_accept_u(p: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                             anc: torch.Tensor, caps: torch.Tensor, levels: int, u: torch.Tensor,
                             u_next: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree_candidates_accept` with its uniforms given (a kernel): ``u [B * (1 + N), 1]``, one
    per node's draw, and ``u_next [B, 1]`` for the next token."""
    rows = tokens.shape[0]
    parents = parents.expand(rows, -1)
    anc = anc.expand(rows, -1, -1)
    depth = node_depths(anc)  # [B, 1 + N]
    allowed = depth <= caps[:, None]
    y = sample_u(p, u)  # [B, 1 + N]: one draw per node
    match = tokens == y.gather(1, parents.clamp_min(0))
    ok = (match | (parents < 0)) & allowed
    on_path = ~(anc & ~ok[:, None, :]).any(-1)  # every ancestor-or-self ok
    node = _deepest(on_path, depth)
    p_node = p.gather(1, node[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]
    kids = _children_mask(tokens, parents, allowed, node, p.shape[-1])
    nxt = sample_u(residual(p_node, kids), u_next)
    return depth.gather(1, node[:, None])[:, 0], _path(anc, depth, node, levels), nxt, node


def tree_typical_accept(p_test: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                        anc: torch.Tensor, caps: torch.Tensor, levels: int, eps: float,
                        delta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Medusa's typical acceptance over B token trees (lossy, as published): a node passes if
    p(x) > min(eps, delta * exp(-H(p))) under its parent's ``p_test`` (temperature-scaled,
    untruncated); the accepted node is the deepest whose ancestors all pass (Medusa's longest
    accepted candidate), ties by the higher joint log p along the path. Shapes as
    `tree_candidates_accept`. Returns ``(depth [B], path [B, L], node [B])``; the next token is
    sampled from ~p at ``node`` by the caller."""
    rows = tokens.shape[0]
    parents = parents.expand(rows, -1)
    anc = anc.expand(rows, -1, -1).float()
    depth = node_depths(anc.bool())
    at_parent = p_test.gather(1, parents.clamp_min(0)[..., None].expand(-1, -1, p_test.shape[-1]))
    entropy = -torch.special.xlogy(at_parent, at_parent).sum(-1)  # [B, 1 + N]
    p_x = at_parent.gather(-1, tokens[..., None])[..., 0]
    passed = (p_x > torch.clamp(delta * torch.exp(-entropy), max=eps)) | (parents < 0)
    ok = passed & (depth <= caps[:, None])
    on_path = (anc @ (~ok).float()[..., None])[..., 0] == 0
    log_p = torch.where(parents < 0, 0.0, p_x.clamp_min(1e-30).log())
    joint = (anc @ log_p[..., None])[..., 0]  # [B, 1 + N]: along each node's path
    node = _deepest(on_path, depth, joint)
    return depth.gather(1, node[:, None])[:, 0], _path(anc.bool(), depth, node, levels), node
