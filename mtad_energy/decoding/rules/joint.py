"""The joint likelihood-ratio rules (MTAD, MMTAD): a draft passes while the warped target's and
draft's cumulative log-probabilities along it differ by more than log tau. Pure tensor functions.

- `joint_accept_length`: the longest passing prefix of given log-probabilities;
- `joint_accept` / `joint_accept_u`: MTAD's rule on the best beam y* (its accepted length and the
  next token from p);
- `tree_joint_accept` / `tree_joint_accept_rows`: MMTAD's rule on the whole draft beam tree;
- `lineage`: each beam-tree node's ancestors (what the tree rule and `runtime.beams` trace).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtad_energy.decoding.rules.sampling import sample_shape, sample_u, uniforms


def joint_accept_length(log_p: torch.Tensor, log_q: torch.Tensor, log_tau: float) -> torch.Tensor:
    """MTAD's accepted length eta for one draft.

    log_p, log_q: ``[..., gamma]`` per-token warped log-probabilities of the draft tokens under
    the target and draft. With L_j = sum_{i<=j} (log_p_i - log_q_i), eta = max{j : L_j > log tau},
    0 if none (``[...]``). It is the *longest* passing prefix: an earlier failing prefix does not
    stop it.
    """
    ratio = (log_p - log_q).cumsum(-1)  # [..., gamma]
    lengths = torch.arange(1, ratio.shape[-1] + 1, device=ratio.device)
    return torch.where(ratio > log_tau, lengths, torch.zeros_like(lengths)).amax(-1)


def joint_accept(p: torch.Tensor, y: torch.Tensor, cum_log_q: torch.Tensor, log_tau: float,
                generator: torch.Generator | None = None, depth: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """MTAD verification of one draft, or of B (leading ``[B]`` dims).

    p: ``[..., gamma+1, V]`` warped target after each draft prefix; y: ``[..., gamma]`` draft
    tokens; cum_log_q: ``[..., gamma]`` cumulative warped draft log-prob of y_1..y_j; depth
    ``[...]``: only y_1..y_depth are a draft (default: all gamma). Returns ``(eta, next)``, each
    ``[...]``: the accepted length and a token sampled from p after y_1..y_eta.
    """
    u = uniforms(sample_shape(p[..., 0, :]), generator, p.device)
    return joint_accept_u(p, y, cum_log_q, log_tau, u, depth)


def joint_accept_u(p: torch.Tensor, y: torch.Tensor, cum_log_q: torch.Tensor, log_tau: float,
                  u_next: torch.Tensor, depth: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`joint_accept` with the next token's uniforms ``u_next`` given (`sample_u`'s)."""
    gamma = y.shape[-1]
    log_q = torch.diff(cum_log_q, prepend=torch.zeros_like(cum_log_q[..., :1]))  # log ~q(y_i)
    log_p = p[..., :gamma, :].gather(-1, y[..., None]).squeeze(-1).log()
    if depth is not None:  # positions past a row's own draft never pass
        past = torch.arange(gamma, device=y.device) >= depth[..., None]
        log_p = log_p.masked_fill(past, float("-inf"))
    eta = joint_accept_length(log_p, log_q, log_tau)
    at = eta[..., None, None].expand(*eta.shape, 1, p.shape[-1])
    return eta, sample_u(p.gather(-2, at).squeeze(-2), u_next)


def tree_joint_accept(log_p_tok: torch.Tensor, log_q: torch.Tensor, parents: torch.Tensor,
                 best: torch.Tensor, log_tau: float) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """MMTAD's acceptance rule on a beam tree (pure; no models).

    log_p_tok: ``[D, W]`` log ~p of node (d, b)'s token given its own path (conditional).
    log_q: ``[D, W]`` cumulative log ~q of each node (-inf = dead). parents: ``[D, W]``.
    best: 0-d index of the final best beam y*.
    Returns ``(eta, b, path)``: eta 0-d (0 = nothing passes), the chosen node's index b at depth
    eta (0 when eta = 0) and ``path [D]``, its ancestors' indices per depth (first eta valid).
    """
    depth = torch.full((1,), log_p_tok.shape[0], dtype=torch.long, device=log_p_tok.device)
    eta, b, path = tree_joint_accept_rows(log_p_tok[None], log_q[None], parents[None],
                                     torch.as_tensor(best, device=depth.device).reshape(1),
                                     depth, log_tau)
    return eta[0], b[0], path[0]


def tree_joint_accept_rows(log_p_tok: torch.Tensor, log_q: torch.Tensor, parents: torch.Tensor,
                      best: torch.Tensor, depth: torch.Tensor, log_tau: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree_joint_accept` for B beam trees at once, each over its own first ``depth[b]`` levels
    (``[B]`` in 1..D: a row's search alone stops there; deeper nodes never pass and ``best[b]``
    is the best beam at that depth). Arguments ``[B, D, W]`` and ``[B]``; returns ``(eta [B],
    b [B], path [B, D])``, path entries past a row's chosen depth 0."""
    rows, levels, width = log_p_tok.shape
    lin = lineage(parents)  # [B, D, W, D]
    d_idx = torch.arange(levels, device=lin.device)
    on_path = d_idx[None, None, :] <= d_idx[:, None, None]  # [D, 1, D]: depth e is on the path
    # tok_lp[b, d, w, e] = log_p_tok[b, e, lin[b, d, w, e]]
    tok_lp = log_p_tok[:, None, None].expand(rows, levels, width, levels, width).gather(
        -1, lin[..., None])[..., 0]  # [B, D, W, D]
    log_p = torch.where(on_path, tok_lp, 0.0).sum(-1)  # [B, D, W] cumulative along own path

    def node_path(d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [B] each -> [B, D]
        at_d = lin.gather(1, d[:, None, None, None].expand(-1, 1, width, levels))[:, 0]
        return at_d.gather(1, w[:, None, None].expand(-1, 1, levels))[:, 0]

    star = node_path(depth - 1, best)  # [B, D]: y*'s ancestors, not the node at best
    log_q_star = log_q.gather(2, star[..., None])[..., 0]  # [B, D]
    within = (d_idx[None] < depth[:, None])[..., None]  # [B, D, 1]
    passes = (log_p - log_q_star[..., None] > log_tau) & (log_q > float("-inf")) & within
    lengths = torch.where(passes.any(-1), d_idx + 1, 0)  # [B, D]
    eta = lengths.amax(-1)  # [B]
    row = (eta - 1).clamp_min(0)
    at = row[:, None, None].expand(-1, 1, width)
    score = torch.where(passes.gather(1, at)[:, 0], log_p.gather(1, at)[:, 0],
                        float("-inf"))  # [B, W]
    b = torch.where(eta > 0, score.argmax(-1), 0)  # argmax: the first (lowest) index on ties
    return eta, b, node_path(row, b)


def lineage(parents: torch.Tensor) -> torch.Tensor:
    """``lin [(B,) D, W, D]``: ``lin[..., d, b, e]`` = index at depth e of the ancestor of node
    (d, b) (itself at e = d); entries with e > d are 0 and meaningless. parents: ``[(B,) D, W]``."""
    depth, width = parents.shape[-2:]
    own = torch.arange(width, device=parents.device).expand(parents.shape[:-2] + (width,))
    own = own[..., None]  # [(B,) W, 1]
    lin = [own]
    for d in range(1, depth):  # D tiny gathers; no host sync
        prev, par = lin[-1], parents[..., d, :, None]  # [(B,) W, d], [(B,) W, 1]
        lin.append(torch.cat([prev.gather(-2, par.expand(par.shape[:-1] + prev.shape[-1:])),
                              own], -1))
    return torch.stack([F.pad(x, (0, depth - x.shape[-1])) for x in lin], -3)
