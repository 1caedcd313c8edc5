"""SpecInfer (Miao et al. 2024): a draft token tree verified with multi-step speculative sampling.

The draft builds a static tree level by level (branching per level, default 4,2,2 = 28 nodes):
children are drawn i.i.d. from ~q at their parent. Each level is one draft forward with tree
attention over the draft cache (the leaves need none), so depth L costs L draft forwards, as a
chain of L tokens does in spd. The target scores root + all nodes in one tree-attention forward;
``rules.tree.tree_speculative_accept`` walks the tree. Lossless w.r.t. ~p.

Stats: ``proposed`` = all draft tree nodes shown to the target (28 by default); ``accepted`` =
accepted path length.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from mtad_energy.decoding.rules.sampling import Warp, log_probs, on_vocab, sample_u, warp_probs
from mtad_energy.decoding.rules.tree import tree_speculative_accept
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.params import DecoderParams, param
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult, block_tokens
from mtad_energy.decoding.runtime.tree import (
    ancestors,
    level_parents,
    set_branching,
    tree_forward,
    tree_nodes,
    tree_verify,
)


@dataclass(frozen=True)
class SpecInferParams(DecoderParams):
    branching: tuple[int, ...] = param((4, 2, 2), "children per node at each tree level (4,2,2)")

    def validate(self) -> None:
        set_branching(self)


@lru_cache(maxsize=32)
def tree_structure(branching: tuple[int, ...], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor matrices of the static tree: draft ``[N, N]`` (levels on the prefix) and target
    ``[1 + N, 1 + N]`` (the last emitted token at the root)."""
    parents = level_parents(branching, device)
    return ancestors(parents), ancestors(torch.cat([parents.new_full((1,), -1), parents + 1]))


def draw_children(q: torch.Tensor, b: int, generator: torch.Generator,
                  without_replacement: bool,
                  support: tuple[torch.Tensor | None, torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """``[C, V]`` -> ``[C, b]`` children per row: i.i.d., or without replacement (Gumbel-top-k:
    exactly sequential sampling; slots beyond q's support get q = 0 tokens). ``support``:
    `Warp.support`'s ``(tokens [C, k], probs [C, k])`` of the same q (tokens None: the whole
    vocabulary): the draws run over those k candidates, which hold all of q's mass (the same
    law; without replacement only where k >= b, so that the b slots fit)."""
    tokens, probs = support if support is not None else (None, q)
    if tokens is not None and without_replacement and tokens.shape[-1] < b:
        tokens, probs = None, q
    if not without_replacement:
        pick = torch.multinomial(probs, b, replacement=True, generator=generator)
    else:
        u = torch.rand(probs.shape, generator=generator, device=probs.device)
        keys = log_probs(probs) - torch.log(-torch.log(u.clamp_min(1e-20)))
        pick = keys.topk(b, -1).indices
    return pick if tokens is None else tokens.gather(-1, pick)


def draft_tree(draft: ModelRunner, pending: torch.Tensor, branching: tuple[int, ...],
               anc: torch.Tensor, warp: Warp, generator: torch.Generator,
               without_replacement: bool, counts: list[int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Grow one tree per sequence level by level after feeding ``pending [B, k]`` (row b's last
    counts[b] tokens real) -> ``(tokens [B, N], q [B, 1 + N_int, V])``.

    The draft cache ends as prefix + the internal nodes (in index order). anc: ``[N, N]``.
    """
    rows = pending.shape[0]
    logits = draft(pending, counts)[:, -1:]  # [B, 1, V] at the root
    vocab = logits.shape[-1]
    tokens: list[torch.Tensor] = []
    qs: list[torch.Tensor] = []
    fed = 0
    for level, b in enumerate(branching):
        cand, probs = warp.support(logits)  # [B, C, k] (or the vocabulary)
        q = on_vocab(cand, probs, vocab)  # [B, C, V]
        qs.append(q)
        flat = None if cand is None else cand.reshape(-1, cand.shape[-1])
        children = draw_children(q.reshape(-1, vocab), b, generator, without_replacement,
                                 (flat, probs.reshape(-1, probs.shape[-1]))
                                 ).reshape(rows, -1)  # [B, C*b]
        tokens.append(children)
        if level + 1 < len(branching):
            end = fed + children.shape[1]
            logits = tree_forward(draft, children, anc[:end, :end])
            fed = end
    return torch.cat(tokens, 1), torch.cat(qs, 1)


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

    def step(self, s: DecodeState) -> StepResult:
        warp = self.params.warp
        lens = self.draft_lens(s)  # per row: tree depth it would draft alone (lossless)
        branching = self.params.branching[:max(lens)]
        if not branching:  # one token left: no point drafting
            return target_step(s, warp)
        anc_d, anc_t = tree_structure(branching, s.ids.device)
        pending, counts = s.draft_feed()
        tokens, q = draft_tree(s.draft, pending, branching, anc_d, warp, s.generator,
                               self.without_replacement, counts)  # [B, N], [B, 1 + N_int, V]
        block, depth, length, path = tree_verify(
            s.target, s.kernels, torch.cat([s.last_token, tokens], 1), anc_t, specinfer_verify,
            q, tokens, s.uniform(*tokens.shape), s.uniform(tokens.shape[0], 1), branching,
            self.without_replacement, *warp.args)
        # keep the chosen node of every level; the loop then crops both caches to the accepted
        # depth, so depth never has to be read back here
        s.target.keep_tree(1 + tokens.shape[1], path)
        s.draft.keep_tree(q.shape[1] - 1, path[:, 1:len(branching)] - 1)  # internal nodes fed
        nodes = tuple(tree_nodes(self.params.branching[:n]) for n in lens)
        return StepResult(block, nodes, depth, length, depth=lens)


def specinfer_verify(logits: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor,
                     u: torch.Tensor, u_next: torch.Tensor, branching: tuple[int, ...],
                     without_replacement: bool, temperature: float, top_k: int, top_p: float
                     ) -> tuple[torch.Tensor, ...]:
    """Kernel: the target's warped p at the root and every node (``logits [B, 1 + N, V]``),
    `tree_speculative_accept` of the draft's tree (``q [B, 1 + N_int, V]``, ``tokens [B, N]``,
    one uniform per node ``u [B, N]``), the next token from the distribution it leaves
    (``u_next [B, 1]``), and the block: ``(block [B, L+1], depth, length [B], path [B, 1+L])``,
    path: the target tree's node per level (the root 0 first)."""
    p = warp_probs(logits, temperature, top_k, top_p)
    depth, path, dist = tree_speculative_accept(p, q, tokens, branching, u,
                                                without_replacement)  # [B], [B, L], [B, V]
    block, length = block_tokens(tokens.gather(1, path), depth, sample_u(dist, u_next))
    return block, depth, length, torch.cat([path.new_zeros(path.shape[0], 1), 1 + path], 1)
