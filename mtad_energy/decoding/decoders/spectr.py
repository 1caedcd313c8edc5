"""SpecTr (Sun et al. 2023): k i.i.d. draft sequences, k-sequential selection. Lossless w.r.t. ~p.

Layout: the k drafts are one token tree with branching ``(k, 1, ..., 1)``: the root (the last
emitted token) has k children drawn i.i.d. from its ~q, and each draft continues with one child
per node, so draft i is the nodes ``i, k + i, ..., (gamma - 1) k + i`` (levels stored one after
another). That is exactly k i.i.d. sequences whose first distribution is shared. The draft grows
it level by level (gamma forwards of k nodes at one row per sequence; compiled, one graph call:
`ModelRunner.tree_levels`) and the target scores the root and the k gamma nodes in one tree
forward whose rule selects a draft and whose rollback keeps that draft's path (compiled, one
graph call with the rollback: `tree.tree_verify`); the draft drops its tree and takes the
accepted tokens in its next first forward (`DecodeState.draft_rewind`). The drafts are not
merged where they share a prefix: the rule needs each draft's p and q along its own positions,
which a shared node holds alike.

Draws: each node's children come from its ~q by inverse CDF (the uniforms of the whole tree
drawn up front, a row of k per node with children: the root takes k, the others one), the same
law and, for one draft, the same draws as spd's chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.chain import spectr_accept_u
from mtad_energy.decoding.rules.sampling import sample_n_u, split_uniforms, warp_probs
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.params import DecoderParams, param, require
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult, block_out, block_tokens
from mtad_energy.decoding.runtime.tree import (
    MAX_TREE_NODES,
    check_tree_support,
    tree_structure,
    tree_verify,
    tree_warm_forwards,
)


@dataclass(frozen=True)
class SpectrParams(DecoderParams):
    num_drafts: int = param(4, "k i.i.d. draft sequences per iteration")
    gamma: int = param(4, "tokens per draft sequence")

    def validate(self) -> None:
        require(self.num_drafts >= 1, f"num_drafts (k) must be >= 1, got {self.num_drafts}")
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")
        nodes = self.num_drafts * self.gamma  # the drafts' tree, verified in one forward
        require(nodes <= MAX_TREE_NODES,
                f"num_drafts x gamma = {self.num_drafts} x {self.gamma} = {nodes} tree nodes; "
                f"at most {MAX_TREE_NODES} fit one verification forward: lower num_drafts or gamma")


def by_draft(x: torch.Tensor, k: int) -> torch.Tensor:
    """A tree's nodes in level order ``[B, gamma * k, ...]`` -> ``[B, k, gamma, ...]``, draft i's
    nodes ``i, k + i, ...`` in its row."""
    return x.unflatten(1, (-1, k)).transpose(1, 2)


def draw_drafts(logits: torch.Tensor, u: torch.Tensor, b: int, temperature: float, top_k: int,
                top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel: one level of the drafts' tree. Warped q at each of the level's C nodes (``logits
    [B, C, V]``) and ``b`` i.i.d. children per node by inverse CDF (uniforms ``u [B, C, >=
    b]``, the first b taken): ``(children [B, C*b] in node order, q [B, C, V])``."""
    q = warp_probs(logits, temperature, top_k, top_p)  # [B, C, V]
    return sample_n_u(q, u[..., :b]).flatten(1), q


class Spectr(Decoder):
    name = "spectr"
    help = "SpecTr: k i.i.d. drafts verified as one token tree, k-sequential selection (lossless)"
    Params = SpectrParams
    needs_draft = True
    batched = True

    @property
    def lookahead(self) -> int:
        return self.params.gamma

    @property
    def verify_width(self) -> int:
        return 1 + self.params.num_drafts * self.params.gamma

    def warm_forwards(self, role: str, pair) -> tuple[tuple, ...]:
        """The drafts' tree (k, 1, ..., 1): its levels and catch-up, the target's tree
        (`tree_warm_forwards`)."""
        prm = self.params
        return super().warm_forwards(role, pair) + tree_warm_forwards(
            role, (prm.num_drafts,) + (1,) * (prm.gamma - 1))

    def step(self, s: DecodeState) -> StepResult:
        warp, k = self.params.warp, self.params.num_drafts
        lens = self.draft_lens(s)  # per row (lossless: a longer batch draft changes no law)
        gamma = max(lens)
        if gamma == 0:  # one token left: no point drafting
            return target_step(s, warp)
        branching = (k,) + (1,) * (gamma - 1)  # k drafts of gamma tokens as one tree
        anc_d, anc_t = tree_structure(branching, s.device)
        check_tree_support(s.draft.model)
        pending, counts = s.draft_feed()
        # the k drafts grown level by level (compiled: one graph call): tokens [B, k gamma] in
        # level order, q [B, 1 + k (gamma - 1), V] at the root and the internal nodes
        tokens, q = s.draft.tree_levels(s.calls, pending, counts, branching, anc_d,
                                        draw_drafts, s.uniform(s.batch, 1 + k * (gamma - 1), k),
                                        *warp.args)
        # q has <= top_k nonzeros (up to ties at the cut): rho only needs those tokens
        recent, read = tree_verify(
            s.target, s.calls, torch.cat([s.last_token, tokens], 1), anc_t, spectr_verify, q,
            tokens, s.uniforms((s.batch, k, gamma), (s.batch, 1)), s.recent, k,
            2 * self.params.top_k, *warp.args)
        # the target keeps the selected draft inside the verify (the loop crops it to the
        # accepted length); the draft drops its tree and is fed the accepted tokens next
        s.draft_rewind()
        # proposed = every draft token shown to the target (k * gamma), as for tree decoders
        return StepResult.from_read(read, recent, ("accepted", "length"),
                                    proposed=tuple(k * g for g in lens), depth=lens)


def spectr_verify(logits: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor,
                  recent: torch.Tensor, k: int, support: int, temperature: float, top_k: int,
                  top_p: float) -> tuple[torch.Tensor, ...]:
    """Kernel: the target's warped p at the root and each node (``logits [B, 1 + k gamma, V]``),
    Spectr's selection (`spectr_accept_u`) of the drafts ``tokens [B, k gamma]`` (level order)
    drawn from ``q [B, 1 + k (gamma - 1), V]`` (the root's, then each internal node's; ``u``:
    its uniforms ``[B, k, gamma]`` then ``[B, 1]``, flat) and the block: ``(block [B, gamma+1],
    n, length [B], path [B, gamma+1], recent, read)``, path: the selected draft's target tree
    nodes (the root 0 first; `block_out`: ``recent``, ``read``)."""
    rows, gamma = tokens.shape[0], tokens.shape[1] // k
    p = warp_probs(logits, temperature, top_k, top_p)  # [B, 1 + k gamma, V]
    root_p, root_q = p[:, :1, None].expand(-1, k, 1, -1), q[:, :1, None].expand(-1, k, 1, -1)
    p = torch.cat([root_p, by_draft(p[:, 1:], k)], 2)  # [B, k, gamma+1, V] along each draft
    q = torch.cat([root_q, by_draft(q[:, 1:], k)], 2)  # [B, k, gamma, V]
    drafts = by_draft(tokens, k)  # [B, k, gamma]
    u_drafts, u_next = split_uniforms(u, drafts.shape, (rows, 1))
    n, nxt, row = spectr_accept_u(p, q, drafts, u_drafts, u_next, support)  # [B] each
    kept = drafts.gather(1, row[:, None, None].expand(-1, 1, gamma)).squeeze(1)  # [B, gamma]
    block, length = block_tokens(kept, n, nxt)
    nodes = 1 + row[:, None] + k * torch.arange(gamma, device=row.device)  # [B, gamma]
    return (block, n, length, torch.cat([nodes.new_zeros(rows, 1), nodes], 1),
            *block_out(block, length, recent, n, length))
