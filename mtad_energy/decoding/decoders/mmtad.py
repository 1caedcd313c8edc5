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

from typing import Any

import torch

from mtad_energy.decoding.decoders.mtad import MtadParams
from mtad_energy.decoding.rules.beam import beam_rows, closest_beam
from mtad_energy.decoding.rules.joint import tree_joint_accept_rows
from mtad_energy.decoding.rules.sampling import sample_u, warp_probs
from mtad_energy.decoding.runtime.beams import beam_sample_rows
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult, block_out, block_tokens
from mtad_energy.decoding.runtime.tree import ancestors, tree_verify


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

    def warm_forwards(self, role: str, pair) -> tuple[tuple, ...]:
        """The draft's beam steps (`Decoder.warm_forwards`), the target's beam tree (the root
        and gamma * W nodes, one per sequence)."""
        prm = self.params
        tree = ((1 + prm.gamma * prm.beam_width, 0, None, True),) if role == "target" else ()
        return super().warm_forwards(role, pair) + tree

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
                                 counts=counts, calls=s.calls, finish=beam_tree,
                                 finish_args=(s.recent[:, -1:],))  # [B, 1]: fixed strides
        tree, anc, beam, log_q = beams.finished  # [B, N], [B, N, N], [B, 2 D W], [B, D, W]
        # the target scores the whole tree in one forward; each row over its own depth (its
        # search alone stops there; y* is then the best beam at that depth); a row with no draft
        # of its own takes its token from p
        # (compiled: the target's rollback to the kept path in the same graph call)
        row, recent, read = tree_verify(
            s.target, s.calls, tree, anc, mmtad_verify_packed, tree, beam, log_q,
            s.on_device(lens), s.uniform(s.batch, 1), s.recent, prm.log_tau, *warp.args)
        # draft cache: the final beam sharing the longest token prefix with the chosen path; the
        # loop crops it to n + that prefix after the read-back (no host sync here)
        beams.keep_rows(s.draft, row)
        return StepResult.from_read(read, recent, ("accepted", "length", "draft_kept"),
                                    proposed=tuple(n * width for n in lens), depth=lens)


def beam_tree(tokens: torch.Tensor, parents: torch.Tensor, log_q: torch.Tensor,
              seqs: torch.Tensor, path_log_q: torch.Tensor, last: torch.Tensor
              ) -> tuple[torch.Tensor, ...]:
    """Kernel: the beam tree (``tokens, parents, log_q [B, D, W]``) as the target's token tree
    after the last emitted token ``last [B, 1]``: root 0, node (d, b) at 1 + d*W + b; ``(tree
    [B, N], ancestors [B, N, N], beam [B, 2 D W], log_q)``, N = 1 + D*W: what MMTAD reads of
    its search (the search's ``finish``; ``path_log_q`` it does not), ``beam`` the tree's
    parents and the final beams ``seqs [B, W, D]`` packed (one tensor for the host to hold:
    `mmtad_verify_packed`; the tokens are the tree's)."""
    rows, gamma, width = tokens.shape
    flat_par = torch.cat([parents.new_full((rows, 1), -1), parents.new_zeros(rows, width),
                          1 + (torch.arange(gamma - 1, device=tokens.device)[None, :, None] * width
                               + parents[:, 1:]).reshape(rows, -1)], 1)  # [B, N]
    return (torch.cat([last, tokens.reshape(rows, -1)], 1), ancestors(flat_par),
            torch.cat([parents.reshape(rows, -1), seqs.reshape(rows, -1)], 1), log_q)


def mmtad_verify_packed(logits: torch.Tensor, tree: torch.Tensor, beam: torch.Tensor,
                        log_q: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
    """Kernel: `mmtad_verify` of `beam_tree`'s outputs: the draft's tokens ``[B, D, W]`` are
    the tree's nodes after its root, ``beam [B, 2 D W]`` its parents then the final beams."""
    rows, gamma, width = log_q.shape
    n = gamma * width
    return mmtad_verify(logits, tree, tree[:, 1:].reshape(rows, gamma, width),
                        beam[:, :n].reshape(rows, gamma, width), log_q,
                        beam[:, n:].reshape(rows, width, gamma), *args)


def mmtad_verify(logits: torch.Tensor, tree: torch.Tensor, tokens: torch.Tensor,
                 parents: torch.Tensor, log_q: torch.Tensor, seqs: torch.Tensor,
                 lens: torch.Tensor, u_next: torch.Tensor, recent: torch.Tensor, log_tau: float,
                 temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, ...]:
    """Kernel: MMTAD's rule on the verified beam tree (``logits [B, N, V]`` of ``tree [B, N]``,
    `beam_tree`; the draft's ``tokens, parents, log_q [B, D, W]`` and final beams ``seqs [B, W,
    D]``), each row over its own draft length ``lens [B]`` (0: nothing accepted). Returns
    ``(block [B, D+1], eta, length, path [B, 1+D], row, recent, read)``: the emitted block, the
    target tree's nodes to keep (root first), and the final beam whose draft cache to keep, as
    its cache row (`beam_rows`), with the length it shares with the emitted draft (kept [B],
    in ``read`` only; `block_out`: ``recent``, ``read``)."""
    rows, gamma, width = tokens.shape
    p = warp_probs(logits, temperature, top_k, top_p)  # [B, N, V]
    # each node's conditional log ~p: p at its parent (its flat index: `beam_tree`), of its token
    d_idx = torch.arange(gamma, device=tokens.device)
    parent_at = torch.cat([parents.new_zeros(rows, 1, width),
                           1 + (d_idx[None, :-1, None] * width + parents[:, 1:])], 1)  # [B, D, W]
    at_parent = p.gather(1, parent_at.reshape(rows, -1, 1).expand(-1, -1, p.shape[-1]))
    log_p_tok = at_parent.gather(2, tree[:, 1:, None]).squeeze(2).log()  # [B, D*W]
    depth = lens.clamp_min(1)  # [B]
    best = log_q.gather(1, (depth - 1)[:, None, None].expand(-1, 1, width))[:, 0]  # [B, W]
    eta, b, path = tree_joint_accept_rows(log_p_tok.view(rows, gamma, width), log_q, parents,
                                          best.argmax(-1), depth, log_tau)  # [B], [B], [B, D]
    eta = torch.minimum(eta, lens)
    path_tok = tokens.gather(2, path[:, :, None]).squeeze(2)  # [B, D]: first eta kept
    node = torch.where(eta > 0, 1 + (eta - 1) * width + b, 0)  # [B]
    nxt = sample_u(p.gather(1, node[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1), u_next)
    block, length = block_tokens(path_tok, eta, nxt)
    beam, kept = closest_beam(seqs, path_tok, eta)
    nodes = torch.cat([path.new_zeros(rows, 1), 1 + d_idx[None] * width + path], 1)  # [B, 1+D]
    return (block, eta, length, nodes, beam_rows(beam, width),
            *block_out(block, length, recent, eta, length, kept))
