"""Multi-candidate MTAD (MMTAD): verify every node of the draft beam tree in one target forward.

The draft runs stochastic beam sampling exactly as MTAD (W nodes per depth, gamma depths). The
target scores the whole beam tree (the last emitted token at the root, then node (d, b) at flat
index 1 + d*W + b) in one tree-attention forward. Node (d, b) passes if
logP(d, b) - logQ*_d > log tau, where logP is the node's cumulative log ~p along its own path and
logQ*_d the cumulative log ~q of the first d tokens of the final best beam y*, traced through its
ancestors. eta = deepest depth with a passing node; there the passing node with the highest logP
(ties: lowest index) is chosen; its path is emitted plus one token from ~p at that node. Dead beam
nodes (log ~q = -inf) never pass. Lossy by design.

Stats: ``proposed`` = gamma * W tree nodes shown to the target; ``accepted`` = eta.
"""

from __future__ import annotations

import torch

from mtad_energy.decoding.base import (
    Decoder,
    DecodeState,
    StepResult,
    cap_per_row,
    target_step,
    to_device,
)
from mtad_energy.decoding.beams import beam_sample_rows, lineage
from mtad_energy.decoding.mtad import MtadParams
from mtad_energy.decoding.sampling import sample
from mtad_energy.decoding.tree import ancestors, tree_forward


def mmtad_select(log_p_tok: torch.Tensor, log_q: torch.Tensor, parents: torch.Tensor,
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
    eta, b, path = mmtad_select_rows(log_p_tok[None], log_q[None], parents[None],
                                     torch.as_tensor(best, device=depth.device).reshape(1),
                                     depth, log_tau)
    return eta[0], b[0], path[0]


def mmtad_select_rows(log_p_tok: torch.Tensor, log_q: torch.Tensor, parents: torch.Tensor,
                      best: torch.Tensor, depth: torch.Tensor, log_tau: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mmtad_select` for B beam trees at once, each over its own first ``depth[b]`` levels
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


class Mmtad(Decoder):
    name = "mmtad"
    help = "MMTAD: verify the whole draft beam tree in one tree-attention forward, keep the best"
    Params = MtadParams
    needs_draft = True
    batched = True

    @property
    def lookahead(self) -> int:
        return self.params.gamma

    def cache_rows(self, role: str) -> int:
        return self.params.beam_width if role == "draft" else 1

    def step(self, s: DecodeState) -> StepResult:
        prm = self.params
        warp = prm.warp
        width = prm.beam_width
        lens = self.draft_lens(s)
        gamma = max(lens)
        if gamma == 0:
            return target_step(s, warp)
        pending, counts = s.draft_feed()
        beams = beam_sample_rows(s.draft, pending, gamma, width, warp, s.generator,
                                 counts=counts, kernels=s.kernels)  # fields [B, ...]
        rows = beams.tokens.shape[0]
        dev = beams.tokens.device
        # flat target tree per sequence: root = last token (0), node (d, b) -> 1 + d*W + b
        flat_par = torch.cat([beams.parents.new_full((rows, 1), -1),
                              beams.parents.new_zeros(rows, width),
                              1 + (torch.arange(gamma - 1, device=dev)[None, :, None] * width
                                   + beams.parents[:, 1:]).reshape(rows, -1)], 1)  # [B, N]
        anc = ancestors(flat_par)  # [B, N, N]
        tokens = torch.cat([s.last_token, beams.tokens.reshape(rows, -1)], 1)  # [B, 1 + D*W]
        p = warp.probs(tree_forward(s.target, tokens, anc))  # [B, 1 + D*W, V]
        # p at each node's parent, of the node's token: the node's conditional log ~p
        at_parent = p.gather(1, flat_par[:, 1:, None].expand(-1, -1, p.shape[-1]))
        log_p_tok = at_parent.gather(2, tokens[:, 1:, None]).squeeze(2).log()
        # each row over its own depth g (its search alone stops there; y* is then the best
        # beam at depth g); a row that is done takes any depth
        depth = to_device([max(n, 1) for n in lens], dev)  # [B]
        best = beams.log_q.gather(1, (depth - 1)[:, None, None].expand(-1, 1, width))[:, 0]
        eta, b, path = mmtad_select_rows(log_p_tok.view(rows, gamma, width), beams.log_q,
                                         beams.parents, best.argmax(-1), depth,
                                         prm.log_tau)  # [B], [B], [B, D]
        eta = cap_per_row(eta, lens)  # a row with no draft of its own takes its token from p
        d_idx = torch.arange(gamma, device=dev)
        path_tok = beams.tokens.gather(2, path[:, :, None]).squeeze(2)  # [B, D]: first eta kept
        node = torch.where(eta > 0, 1 + (eta - 1) * width + b, 0)  # [B]
        nxt = sample(p.gather(1, node[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1),
                     s.generator)
        # draft cache: the final beam sharing the longest token prefix with the chosen path; the
        # loop crops it to n + that prefix after the read-back (no host sync here)
        kept = beams.keep_closest(s.draft, path_tok, eta)
        # target: keep the path's node at every depth; the loop crops to the accepted eta
        path_nodes = 1 + d_idx[None] * width + path  # [B, D]
        s.target.keep_tree(1 + gamma * width,
                           torch.cat([path_nodes.new_zeros(rows, 1), path_nodes], 1))
        return StepResult.block(path_tok, eta, nxt, [n * width for n in lens],
                                s.lengths_on_device() + kept, depth=lens)
