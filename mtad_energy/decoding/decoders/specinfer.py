"""SpecInfer (Miao et al. 2024): a draft token tree verified with multi-step speculative sampling.

The draft builds a static tree level by level (branching per level, default 4,2,2 = 28 nodes):
children are drawn i.i.d. from ~q at their parent. Each level is one draft forward with tree
attention over the draft cache (the leaves need none), so depth L costs L draft forwards, as a
chain of L tokens does in spd; each level's draws are a kernel (`draw_level`, its uniforms drawn
up front), so compiled, the whole tree is one graph call (`ModelRunner.tree_levels`). The
target scores root + all nodes in one tree-attention forward; ``rules.tree.tree_speculative_accept``
walks the tree. Lossless w.r.t. ~p. The draft then drops its tree (`DecodeState.draft_rewind`):
the next iteration's first draft forward takes the accepted path with the bonus token.

Stats: ``proposed`` = all draft tree nodes shown to the target (28 by default); ``accepted`` =
accepted path length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.sampling import (
    gumbel_topk_u,
    log_probs,
    on_vocab,
    sample_n_u,
    sample_u,
    split_uniforms,
    uniforms,
    warp_probs,
    warp_support,
)
from mtad_energy.decoding.rules.tree import tree_speculative_accept
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.params import DecoderParams, param
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult, block_out, block_tokens
from mtad_energy.decoding.runtime.tree import (
    check_tree_support,
    set_branching,
    tree_nodes,
    tree_structure,
    tree_verify,
    tree_warm_forwards,
)
from mtad_energy.models.shapes import output_size


@dataclass(frozen=True)
class SpecInferParams(DecoderParams):
    branching: tuple[int, ...] = param((4, 2, 2), "children per node at each tree level (4,2,2)")

    def validate(self) -> None:
        set_branching(self)


def draw_children_u(q: torch.Tensor, b: int, u: torch.Tensor, without_replacement: bool,
                    support: tuple[torch.Tensor | None, torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """``q [..., V]`` -> ``[..., b]`` children per row, with their uniforms ``u`` given (a
    kernel's form): i.i.d. by inverse CDF (``u [..., >= b]``, the first b taken), or without
    replacement by Gumbel-top-k over every token (``u [..., V]``; exactly sequential sampling;
    slots beyond q's support get q = 0 tokens). ``support``: `Warp.support`'s ``(tokens [...,
    k], probs [..., k])`` of the same q (tokens None: the whole vocabulary): the draws run over
    those k candidates, which hold all of q's mass (the same law; without replacement only where
    k >= b, so that the b slots fit), with the first k of the uniforms."""
    tokens, probs = support if support is not None else (None, q)
    if tokens is not None and without_replacement and tokens.shape[-1] < b:
        tokens, probs = None, q
    if not without_replacement:
        pick = sample_n_u(probs, u[..., :b])
    else:
        pick = gumbel_topk_u(log_probs(probs), b, u[..., :probs.shape[-1]])
    return pick if tokens is None else tokens.gather(-1, pick)


def draw_children(q: torch.Tensor, b: int, generator: torch.Generator,
                  without_replacement: bool,
                  support: tuple[torch.Tensor | None, torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """`draw_children_u` with its uniforms drawn from ``generator`` (``[..., V]`` of them)."""
    u = uniforms(q.shape if without_replacement else (*q.shape[:-1], b), generator, q.device)
    return draw_children_u(q, b, u, without_replacement, support)


def draw_level(logits: torch.Tensor, u: torch.Tensor, b: int, without_replacement: bool,
               temperature: float, top_k: int, top_p: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel: one level of the draft tree. Warped q at each of a level's C nodes (``logits
    [B, C, V]``) and ``b`` children per node drawn from it (`draw_children_u`, uniforms ``u [B,
    C, n]``): ``(children [B, C*b] in node order, q [B, C, V])``. Compiled, the top-k shortcut
    (`Warp.support`) reads nothing back, so the draws run over the vocabulary."""
    cand, probs = warp_support(logits, temperature, top_k, top_p)  # [B, C, k] (or the vocabulary)
    q = on_vocab(cand, probs, logits.shape[-1])  # [B, C, V]
    children = draw_children_u(q, b, u, without_replacement, (cand, probs))  # [B, C, b]
    return children.reshape(children.shape[0], -1), q


def level_uniforms(s: DecodeState, branching: tuple[int, ...], vocab: int,
                   without_replacement: bool) -> torch.Tensor:
    """``[B, 1 + N_int, n]``: the uniforms of a draft tree's draws, a row of n per node that
    has children (the root, then the internal nodes in index order): n = ``vocab`` without
    replacement (Gumbel keys), else the most children of any node."""
    nodes = 1 + tree_nodes(branching[:-1])
    return s.uniform(s.batch, nodes, vocab if without_replacement else max(branching))


class SpecInfer(Decoder):
    name = "specinfer"
    help = "SpecInfer: i.i.d. draft token tree, one tree forward, multi-step speculative sampling"
    Params = SpecInferParams
    needs_draft = True
    batched = True
    without_replacement = False

    @property
    def lookahead(self) -> int:
        return len(self.params.branching)

    def warm_forwards(self, role: str, pair) -> tuple[tuple, ...]:
        """The draft's tree levels and catch-up, the target's tree (`tree_warm_forwards`)."""
        return super().warm_forwards(role, pair) + tree_warm_forwards(role, self.params.branching)

    def step(self, s: DecodeState) -> StepResult:
        warp = self.params.warp
        lens = self.draft_lens(s)  # per row: tree depth it would draft alone (lossless)
        branching = self.params.branching[:max(lens)]
        if not branching:  # one token left: no point drafting
            return target_step(s, warp)
        anc_d, anc_t = tree_structure(branching, s.device)
        check_tree_support(s.draft.model)
        pending, counts = s.draft_feed()
        u = level_uniforms(s, branching, output_size(s.draft.model), self.without_replacement)
        # the tree grown level by level (compiled: one graph call), [B, N], [B, 1 + N_int, V]
        tokens, q = s.draft.tree_levels(s.calls, pending, counts, branching, anc_d, draw_level,
                                        u, self.without_replacement, *warp.args)
        recent, read = tree_verify(
            s.target, s.calls, torch.cat([s.last_token, tokens], 1), anc_t, specinfer_verify,
            q, tokens, s.uniforms(tokens.shape, (s.batch, 1)), s.recent, branching,
            self.without_replacement, *warp.args)
        # the target keeps the chosen node of every level inside the verify (the loop crops it
        # to the accepted depth); the draft drops its tree and is fed the accepted path next
        s.draft_rewind()
        nodes = tuple(tree_nodes(self.params.branching[:n]) for n in lens)
        return StepResult.from_read(read, recent, ("accepted", "length"), proposed=nodes,
                                    depth=lens)


def specinfer_verify(logits: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor,
                     u: torch.Tensor, recent: torch.Tensor, branching: tuple[int, ...],
                     without_replacement: bool, temperature: float, top_k: int, top_p: float
                     ) -> tuple[torch.Tensor, ...]:
    """Kernel: the target's warped p at the root and every node (``logits [B, 1 + N, V]``),
    `tree_speculative_accept` of the draft's tree (``q [B, 1 + N_int, V]``, ``tokens [B, N]``,
    one uniform per node ``[B, N]``), the next token from the distribution it leaves (one
    uniform ``[B, 1]``; ``u``: the two, flat), and the block: ``(block [B, L+1], depth, length
    [B], path [B, 1+L], recent, read)``, path: the target tree's node per level (the root 0
    first; `block_out`: ``recent``, ``read``)."""
    p = warp_probs(logits, temperature, top_k, top_p)
    u_nodes, u_next = split_uniforms(u, tokens.shape, (tokens.shape[0], 1))
    depth, path, dist = tree_speculative_accept(p, q, tokens, branching, u_nodes,
                                                without_replacement)  # [B], [B, L], [B, V]
    block, length = block_tokens(tokens.gather(1, path), depth, sample_u(dist, u_next))
    return (block, depth, length, torch.cat([path.new_zeros(path.shape[0], 1), 1 + path], 1),
            *block_out(block, length, recent, depth, length))
