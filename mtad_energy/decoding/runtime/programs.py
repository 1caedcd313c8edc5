"""The decoders' multi-forward programs, written once: a draft's autoregressive chain, a token
tree grown level by level (SpecInfer's), a stochastic beam search (`rules.beam`) and a draft
head's token tree (EAGLE's).

A program is forwards and, between them, the decoder's pure tensor functions. It runs both
through a `Steps`, which says where they run:

* `runner.RunnerSteps`: each forward a call of a runner (`ModelRunner` and its batched and
  compiled kinds: ``runner(ids)``, ``runner.forward_tree``), each function through the
  generation's `calls.EagerCalls` (eager, or compiled one graph per function). The eager path, and the
  compiled runner's separate calls (a generation's shorter last chains and trees);
* `slot_forward.SlotSteps`: each forward a `slot_forward` on the static cache, the functions
  called as they are, inside one fused graph call (`slot_forward.forward_chain` and its kin).

So the eager and the compiled path run the same program on the same numbers (docs/design.md
section 7); only where the forwards and functions run differs. A program reads nothing back
to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from mtad_energy.decoding.rules.beam import first_scores, first_select, step_scores, step_select

# a beam search's uniforms: ``draws(scores [rows, C], at, n)`` -> the draw's uniforms (None: no
# draw), ``n`` vocabularies' worth from vocabulary ``at`` where they are drawn up front
Draws = Callable[[torch.Tensor, int, int], torch.Tensor | None]


class Steps(Protocol):
    """Where a program's forwards and pure functions run (see the module docstring). The
    program's first forward's input (ids, which of them are real, a head's features) is the
    steps' own, given when they are made."""

    call: Callable[..., Any]  # ``call(fn, *args)`` -> ``fn(*args)``: a pure function

    def first(self) -> torch.Tensor:
        """The first forward: logits ``[rows, k, V]``."""

    def first_hidden(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The first forward of a head (with its features): logits ``[rows, k, V]`` and the
        hidden states ``[rows, k, H]``."""

    def next(self, tokens: torch.Tensor, i: int) -> torch.Tensor:
        """The i-th forward after the first (i >= 1) of one token per row, ``tokens [r, 1]``
        (r: the rows, times the beams while a beam search runs): logits ``[r, 1, V]``."""

    def level(self, children: torch.Tensor, anc: torch.Tensor, fed: int) -> torch.Tensor:
        """A token tree's next level ``children [rows, K]`` after the ``fed`` = M nodes fed
        before it (``anc [K, M + K]``: node i sees tree node j): logits ``[rows, K, V]``."""

    def tree_then(self, tokens: torch.Tensor, anc: torch.Tensor, depths: torch.Tensor,
                  feats: torch.Tensor, f: Callable[..., Any], *f_args: Any) -> Any:
        """A head's tree forward of ``tokens [rows, K]`` after the nodes fed before (``anc
        [(rows,) K, M + K]``, ``depths [(rows,) K]``, ``feats [rows, K, F]``), then
        ``f(logits, hidden, *f_args)``."""

    def repeat_rows(self, n: int) -> None:
        """Each sequence's row becomes ``n`` identical rows (row b*n + w)."""

    def select_rows(self, rows: torch.Tensor, i: int) -> None:
        """The rows ``rows [rows * W]`` become the beams, after the i-th forward after the
        first (what the forwards since the first wrote moves with them)."""


def chain(steps: Steps, fn: Callable[..., Any], u: torch.Tensor,
          *args: Any) -> tuple[torch.Tensor, ...]:
    """A draft's autoregressive loop of S = ``u.shape[0]`` forwards: the first of the steps'
    input, each next of the token ``fn`` drew after the one before: ``fn(logits [B, k, V], u[i]
    [B, 1], *args) -> (token [B, 1], *extras)``. Returns ``(tokens [B, S], *extras stacked on
    dim 1: [B, S, ...])``."""
    us = u.unbind(0)
    outs = [steps.call(fn, steps.first(), us[0], *args)]
    for i in range(1, len(us)):
        outs.append(steps.call(fn, steps.next(outs[-1][0], i), us[i], *args))
    return (torch.cat([o[0] for o in outs], 1),
            *(torch.stack([o[j] for o in outs], 1) for j in range(1, len(outs[0]))))


def tree_levels(steps: Steps, branching: tuple[int, ...], anc: torch.Tensor,
                fn: Callable[..., Any], u: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
    """A draft token tree grown level by level (SpecInfer's): the first forward, then per level
    ``fn(logits [B, C, V], u_l [B, C, n], b, *args) -> (children [B, C*b], *extras [B, C, ...])``
    at the level's C nodes (the root: the input's last position) and, but after the leaves, a
    tree forward of the children (``anc [N, N]``: the whole tree's ancestors, levels in index
    order). ``u [B, P, n]``: each node's uniforms, P = the root and the internal nodes. Returns
    ``(tokens [B, N], *extras concatenated on dim 1: [B, P, ...])``; the cache ends as prefix +
    the internal nodes."""
    logits = steps.first()[:, -1:]  # [B, 1, V] at the root
    outs, fed, at = [], 0, 0  # at: the level's first node's row of uniforms
    for level, b in enumerate(branching):
        outs.append(steps.call(fn, logits, u[:, at:at + logits.shape[1]], b, *args))
        at += logits.shape[1]
        if level + 1 < len(branching):
            end = fed + outs[-1][0].shape[1]
            # [K, M + K]: the level after the M nodes fed
            logits = steps.level(outs[-1][0], anc[fed:end, :end], fed)
            fed = end
    return tuple(torch.cat([o[j] for o in outs], 1) for j in range(len(outs[0])))


def beam_search(steps: Steps, depth: int, width: int, warp_args: tuple, draws: Draws,
                eos_token_id: int | None = None, finish: Callable[..., tuple] | None = None,
                *finish_args: Any) -> tuple[torch.Tensor, ...]:
    """``depth`` steps of stochastic beam sampling (`rules.beam`) of W = ``width`` beams per
    sequence: the first forward, W first tokens, the rows expanded to W per sequence, then per
    step a forward of the W beams' last tokens ``[B*W, 1]``, W (beam, token) pairs and the rows
    reordered to their beams. ``warp_args``: ``(*Warp.args, stochastic)``; ``draws``: each
    draw's uniforms (`Draws`). Returns ``(tokens, parents, log_q [B, D, W], seqs, path_log_q
    [B, W, D])`` (`beams.BeamDraft`'s fields), or with ``finish`` only ``finish(tokens,
    parents, log_q, seqs, path_log_q, *finish_args)``: what the caller reads of the search (a
    CUDA graph hands back, and its host clones, only that)."""
    cand, log_q = steps.call(first_scores, steps.first(), width, *warp_args)  # [B, C]
    tok, parent, cum, seqs, paths = steps.call(first_select, cand, log_q, draws(log_q, 0, 1),
                                               width)
    tokens, parents, cums = [tok], [parent], [cum]
    if depth > 1:
        steps.repeat_rows(width)
    for i in range(1, depth):
        logits = steps.next(tok.reshape(-1, 1), i)  # [B*W, 1, V]
        cand, joint = steps.call(step_scores, logits, cum, tok, *warp_args, eos_token_id)
        tok, parent, cum, seqs, paths, rows = steps.call(
            step_select, cand, joint, draws(joint, 1 + (i - 1) * width, width), seqs, paths)
        steps.select_rows(rows, i)
        tokens.append(tok), parents.append(parent), cums.append(cum)
    out = (torch.stack(tokens, 1), torch.stack(parents, 1), torch.stack(cums, 1), seqs, paths)
    return out if finish is None else steps.call(finish, *out, *finish_args)


def grow_tree(steps: Steps, fn: Callable[..., Any], *args: Any) -> Any:
    """A draft head's token tree (EAGLE's): the first forward with the head's features, then the
    decoder's program ``fn(tree_then, call, logits [B, k, V], hidden [B, k, H], *args)``, which
    grows the tree in tree forwards (`Steps.tree_then`) and calls its pure functions through
    ``call``. Returns what ``fn`` returns."""
    logits, hidden = steps.first_hidden()
    return fn(steps.tree_then, steps.call, logits, hidden, *args)
