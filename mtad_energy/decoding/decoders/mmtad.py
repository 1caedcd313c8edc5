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

from mtad_energy.decoding.decoders.mtad import MtadParams
from mtad_energy.decoding.rules.joint import tree_joint_accept_rows
from mtad_energy.decoding.rules.sampling import sample
from mtad_energy.decoding.runtime.beams import beam_sample_rows
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.state import DecodeState, cap_per_row, to_device
from mtad_energy.decoding.runtime.step import StepResult
from mtad_energy.decoding.runtime.tree import ancestors, tree_forward


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
        eta, b, path = tree_joint_accept_rows(log_p_tok.view(rows, gamma, width), beams.log_q,
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
