"""EAGLE (Li et al. 2024-2025): a feature-level draft head that reads the target's hidden states
(`models.heads.EagleHead`: EAGLE-1, or EAGLE-3 with fused low/mid/high features and its own draft
vocabulary), drafts a token tree, and the target verifies it in one tree-attention forward.

The head runs over pairs (target feature of position j, token j + 1) with its own KV cache (the
draft runner's: eager, batched or compiled like any draft model). Each iteration:

1. **catch up**: feed the pairs the head has not seen (the root and the accepted nodes of the
   last verify, whose target features that forward returned); the output at the last pair
   gives the distribution of the first draft level (one draft forward);
2. **draft a tree** (``tree``): ``dynamic`` (EAGLE-2 / EAGLE-3): take the top ``expand`` tokens,
   then ``depth`` times feed the frontier (each node's input feature is its parent's output,
   tree attention over the head's cache) and keep the ``expand`` best children by cumulative
   draft log-probability; the verified tree is the ``total_tokens - 1`` best of all candidates
   (EAGLE's ``topK_genrate``). ``static`` (EAGLE-1): every node of level l gets the top
   ``branching[l]`` tokens of its own output (one draft forward per level). Steps 1-2 are one
   `ModelRunner.grow_tree` (the programs `eagle_dynamic`, `eagle_static`): compiled, one graph
   call;
3. **verify** [last token] + tree in one target forward (which returns the features of every
   node) with the rule for chosen (not sampled) candidates, q one-hot at their token
   (`rules.tree.tree_candidates_accept`): lossless w.r.t. warped p, and greedy-exact;
4. the head cache drops the tree (it was fed draft features; the accepted positions are fed
   again next time with the target's).

Stats: ``proposed`` = draft nodes shown to the target (per row, those within its depth),
``draft_depth`` = the tree's depth, ``accepted`` = the accepted depth; draft forwards are the
head's (catch-up + expansions), timed as draft.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mtad_energy.decoding.rules.sampling import split_uniforms, warp_probs
from mtad_energy.decoding.rules.tree import tree_candidates_accept_u
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.head_runner import prefill_features
from mtad_energy.decoding.runtime.params import DecoderParams, param, require
from mtad_energy.decoding.runtime.state import DecodeState, to_device
from mtad_energy.decoding.runtime.step import StepResult, block_out, block_tokens, depth_fields
from mtad_energy.decoding.runtime.tree import (
    MAX_TREE_NODES,
    ancestors,
    depths,
    rooted_tree,
    set_branching,
    tree_nodes,
    tree_verify,
)
from mtad_energy.models.heads import draft_to_target

TREES = ("dynamic", "static")


@dataclass(frozen=True)
class EagleParams(DecoderParams):
    tree: str = param("dynamic", "dynamic (EAGLE-2/3: best nodes by cumulative draft "
                                 "log-prob) or static (EAGLE-1: the branching tree)")
    depth: int = param(6, "dynamic: expansion steps (tree depth <= depth + 1)", ("tree", "dynamic"))
    expand: int = param(10, "dynamic: nodes expanded per step, children kept per node (top-k)",
                        ("tree", "dynamic"))
    total_tokens: int = param(60, "dynamic: tokens verified per iteration, the root included",
                              ("tree", "dynamic"))
    branching: tuple[int, ...] = param((4, 2, 2, 1), "static: children per node at each level",
                                       ("tree", "static"))

    def validate(self) -> None:
        set_branching(self)
        require(self.tree in TREES, f"tree must be one of {', '.join(TREES)}, got {self.tree!r}")
        require(self.depth >= 0, f"depth must be >= 0, got {self.depth}")
        require(self.expand >= 1, f"expand must be >= 1, got {self.expand}")
        pool = self.expand + self.depth * self.expand ** 2
        require(2 <= self.total_tokens <= min(pool, MAX_TREE_NODES - 1) + 1,
                f"total_tokens must be in [2, {min(pool, MAX_TREE_NODES - 1) + 1}] (the root "
                f"plus at most the {pool} candidates of expand={self.expand}, "
                f"depth={self.depth}), got {self.total_tokens}")


def eagle_root(logits: torch.Tensor, d2t: torch.Tensor | None, k: int
               ) -> tuple[torch.Tensor, ...]:
    """Kernel: the first frontier from the head's output at the root (``logits [B, V']``): its
    k best tokens ``[B, k]``, their log-probabilities, parents (-1: the root), pool indices
    (0..k-1) and depths (1), and their ancestors among the fed nodes ``[B, k, k]`` (none but
    themselves), twice: the frontier's rows, and all fed nodes' (`eagle_expand`'s last two)."""
    rows = logits.shape[0]
    top = logits.float().log_softmax(-1).topk(k, -1)
    eye = torch.eye(k, dtype=torch.bool, device=logits.device)[None].repeat(rows, 1, 1)
    index = torch.arange(k, device=logits.device)[None].repeat(rows, 1)
    return (draft_to_target(top.indices, d2t), top.values, torch.full_like(index, -1), index,
            torch.ones_like(index), eye, eye)


def eagle_expand(logits: torch.Tensor, feats: torch.Tensor, score: torch.Tensor,
                 index: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor, base: int,
                 d2t: torch.Tensor | None, *choose: Any) -> tuple[torch.Tensor, ...]:
    """Kernel: one expansion after the head's forward of the frontier (``logits [B, k, V']``,
    output features ``feats [B, k, H]``; the frontier's cumulative log-probabilities ``score
    [B, k]``, pool indices ``index [B, k]`` and depths ``depth [B, k]``; ``anc [B, M + k, M +
    k]``: the ancestors among the fed nodes, the frontier last). Each frontier node's k best
    children (scored strictly below their parent), pool indices from ``base``; the k best of
    them are the next frontier. Returns ``(children [B, k*k], their scores, their parents' pool
    indices, then the next frontier: tokens, scores, parents' output features [B, k, H], pool
    indices, depths, ancestors [B, k, M + 2k], and every fed node's [B, M + 2k, M + 2k])``;
    with ``choose`` (``caps, n`` and the pools so far, `eagle_choose`'s arguments): the last
    expansion, what `eagle_choose` returns with these children in the pool."""
    rows, k = score.shape
    m = anc.shape[-1] - k  # nodes fed before this frontier
    lp = logits.float().log_softmax(-1).topk(k, -1)  # children of each fed node
    cu = (score[..., None] + lp.values - 1e-6).reshape(rows, k * k)  # strictly below parent
    child = draft_to_target(lp.indices, d2t).reshape(rows, k * k)
    parent = index.repeat_interleave(k, 1)
    if choose:
        caps, n, *pools = choose
        s = len(pools) // 3
        return eagle_choose(caps, n, *pools[:s], child, *pools[s:2 * s], cu, *pools[2 * s:],
                            parent)
    best = cu.topk(k, -1).indices  # [B, k]: the next frontier
    up = best // k  # its parents among the frontier
    feat = feats.gather(1, up[..., None].expand(-1, -1, feats.shape[-1]))
    eye = torch.eye(k, dtype=torch.bool, device=anc.device).expand(rows, k, k)
    new = torch.cat([anc.gather(1, (m + up)[..., None].expand(-1, -1, m + k)), eye], 2)
    fed = torch.cat([torch.nn.functional.pad(anc, (0, k)), new], 1)  # [B, M + 2k, M + 2k]
    return (child, cu, parent, child.gather(1, best), cu.gather(1, best), feat, base + best,
            depth + 1, new, fed)


def eagle_choose(caps: torch.Tensor, n: int, *pools: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Kernel: the verified tree, the ``n`` best candidates of the pool (EAGLE's
    ``topK_genrate``) within each row's depth ``caps [B]``. ``pools``: the tokens of each
    depth's candidates (the root's children first), then their scores, then their parents'
    pool indices. Returns ``(tokens [B, n], ancestors [B, 1 + n, 1 + n], parents [B, 2 + n])``:
    parents before children (the root at 0), then the chosen tree's depth in the last column
    (packed: what only the verify reads, one tensor; `tree_parents`)."""
    s = len(pools) // 3
    tok_all, score_all, parent_all = (torch.cat(pools[j * s:(j + 1) * s], 1) for j in range(3))
    depth_all = torch.cat([torch.full((t.shape[1],), d + 1, device=caps.device)
                           for d, t in enumerate(pools[:s])])  # [P]
    rows = caps.shape[0]
    score_all = score_all.masked_fill(depth_all[None] > caps[:, None], float("-inf"))
    chosen = score_all.topk(n, -1).indices.sort(-1).values  # [B, N]: parents before children
    parent = parent_all.gather(1, chosen)
    pos = torch.searchsorted(chosen, parent.clamp_min(0))  # the parent's place among chosen
    parents = torch.cat([torch.full((rows, 1), -1, device=caps.device, dtype=torch.long),
                         torch.where(parent < 0, 0, pos + 1)], 1)
    chosen_depth = depth_all[chosen]  # [B, N]
    depth = chosen_depth.masked_fill(chosen_depth > caps[:, None], 0).amax(-1)  # [B]
    return tok_all.gather(1, chosen), ancestors(parents), torch.cat([parents, depth[:, None]], 1)


def tree_parents(parents: torch.Tensor, packed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kernel: ``(parents [B, 1 + N], depth [B] or None)`` of `eagle_choose`'s ``parents [B, 2 +
    N]`` (``packed``: the chosen tree's depth in its last column) or of a static tree's ``[(B,)
    1 + N]`` (no depth: the host knows it)."""
    return (parents[:, :-1], parents[:, -1]) if packed else (parents, None)


def eagle_verify(logits: torch.Tensor, hidden: torch.Tensor, full: torch.Tensor,
                 parents: torch.Tensor, anc: torch.Tensor, caps: torch.Tensor, levels: int,
                 u: torch.Tensor, recent: torch.Tensor, packed: bool,
                 temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, ...]:
    """Kernel: the verify's warped p (``logits [B, 1 + N, V]``) and the rule for chosen
    candidates (`tree_candidates_accept_u`; ``u``: its uniforms ``[B (1 + N), 1]`` then the next
    token's ``[B, 1]``, flat) over ``full [B, 1 + N]`` (the root first; ``parents``, ``anc``:
    its tree) -> ``(block [B, L + 1], accepted depth [B], length [B], kept nodes [B, 1 + L]
    (root first), their features [B, 1 + L, H] right-aligned (row b's 1 + depth[b] last: the
    next catch-up's, `Eagle._catch_up`; ``hidden``: every node's), recent, read)`` (`block_out`;
    ``packed``: ``parents`` ends with the depth only the device knows, `tree_parents`, which
    ``read`` then holds)."""
    parents, tree_depth = tree_parents(parents, packed)
    p = warp_probs(logits, temperature, top_k, top_p)
    depth, path, nxt, _ = tree_candidates_accept_u(
        p, full, parents, anc, caps, levels, *split_uniforms(u, (full.numel(), 1),
                                                              (full.shape[0], 1)))
    kept = torch.cat([torch.zeros_like(path[:, :1]), path], 1)  # [B, 1 + L]: root first
    width = kept.shape[1]
    right = kept.gather(1, (torch.arange(width, device=kept.device)
                            - (width - 1 - depth)[:, None]).clamp_min(0))  # [B, 1 + L]
    feat = hidden.gather(1, right[..., None].expand(-1, -1, hidden.shape[-1]))
    block, length = block_tokens(full.gather(1, path), depth, nxt)
    counts = (depth, length) + (() if tree_depth is None else (tree_depth,))
    return block, depth, length, kept, feat, *block_out(block, length, recent, *counts)


def eagle_dynamic(tree_then: Callable[..., Any], call: Callable[..., Any], logits: torch.Tensor,
                  hidden: torch.Tensor, d2t: torch.Tensor | None, k: int, steps: int,
                  caps: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """EAGLE-2's tree from the catch-up's output (``logits [B, c, V']``, ``hidden [B, c, H]``:
    the root at the last position), a `ModelRunner.grow_tree` program: the root's k best tokens
    are the first frontier (`eagle_root`); each of ``steps`` expansions is the head's tree
    forward of the frontier and `eagle_expand` (one ``tree_then``); the last one also chooses
    the verified tree (`eagle_choose`): n nodes within each row's depth ``caps [B]``. Returns
    what `eagle_choose` returns: ``(tokens [B, n], ancestors, parents and depth [B, 2 + n])``."""
    tok, score, parent, index, depth, rows_anc, anc = call(eagle_root, logits[:, -1], d2t, k)
    pools = [(tok, score, parent)]
    feat = hidden[:, -1:].expand(-1, k, -1)  # [B, k, H]: the frontier's parents' features
    for i in range(steps):
        last = () if i + 1 < steps else (caps, n, *_flat(pools))
        out = tree_then(tok, rows_anc, depth, feat, eagle_expand, score, index, anc, depth,
                        k + i * k * k, d2t, *last)  # pool index of this expansion's first child
        if last:
            return out
        child, cu, parent, tok, score, feat, index, depth, rows_anc, anc = out
        pools.append((child, cu, parent))
    return call(eagle_choose, caps, n, *_flat(pools))  # no expansion: the root's children


def eagle_static(tree_then: Callable[..., Any], call: Callable[..., Any], logits: torch.Tensor,
                 hidden: torch.Tensor, branching: tuple[int, ...], anc: torch.Tensor,
                 d2t: torch.Tensor | None) -> torch.Tensor:
    """EAGLE-1's tree from the catch-up's output (as in `eagle_dynamic`), a
    `ModelRunner.grow_tree` program: every node of level l gets the ``branching[l]`` best tokens
    of its own output (`eagle_level`), a tree forward per level but the leaves (``anc [1 + N, 1
    + N]``: the rooted tree's ancestors). Returns the tree's tokens ``[B, N]``, level by level."""
    tok, feat = call(eagle_level, logits[:, -1:], hidden[:, -1:], branching[0], d2t)
    tokens, fed = [tok], 0
    for b in branching[1:]:
        width = tok.shape[1]
        rows = anc[1 + fed:1 + fed + width, 1:1 + fed + width]  # [w, M + w] after the M fed
        tok, feat = tree_then(tok, rows, depths(rows), feat, eagle_level, b, d2t)
        tokens.append(tok)
        fed += width
    return torch.cat(tokens, 1)


def eagle_level(logits: torch.Tensor, hidden: torch.Tensor, b: int, d2t: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel: a static tree's next level from its w nodes' outputs (``logits [B, w, V']``,
    ``hidden [B, w, H]``): each node's b best tokens ``[B, w b]`` (children of a node together)
    and their parents' output features ``[B, w b, H]``."""
    rows, w = logits.shape[:2]
    children = draft_to_target(logits.topk(b, -1).indices, d2t).reshape(rows, w * b)
    return children, hidden.repeat_interleave(b, 1)


def _flat(pools: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Pools of (tokens, scores, parents) as `eagle_choose` takes them: every depth's tokens,
    then scores, then parents."""
    return tuple(t for j in range(3) for t in (p[j] for p in pools))


class Eagle(Decoder):
    name = "eagle"
    help = ("EAGLE: a feature-level draft head on the target's hidden states drafts a dynamic "
            "(EAGLE-2/3) or static (EAGLE-1) tree; lossless; --draft eagle:DIR")
    Params = EagleParams
    batched = True
    drafts_without_model = True
    head = "eagle"

    @property
    def lookahead(self) -> int:
        prm = self.params
        return prm.depth + 1 if prm.tree == "dynamic" else len(prm.branching)

    @property
    def verify_width(self) -> int:
        prm = self.params
        return prm.total_tokens if prm.tree == "dynamic" else 1 + tree_nodes(prm.branching)

    def target_hidden(self, pair) -> tuple[int, ...]:
        head = pair.heads.get("eagle")
        return head.target_hidden_states() if head is not None else ()

    def draft_hidden(self) -> tuple[int, ...]:
        return (-1,)  # the head's output feature: the input of its children

    def warm_forwards(self, role: str, pair) -> tuple[tuple, ...]:
        """What a compiled generation meets only inside its loop, compiled before its windows:
        the target's verify (a tree of `verify_width` nodes, one per sequence when dynamic);
        the head's catch-ups (1 .. lookahead + 1 pairs, with the target's features) and its
        tree's later forwards at full depth (`ModelRunner.grow_tree`'s ``nodes``, with its own
        output features; one tree per sequence, as `StaticRunner._warm_later` runs them, and
        a static tree's levels also shared by the rows, as a shallower tree runs them apart)."""
        head, prm = pair.heads.get("eagle"), self.params
        if head is None:
            return ()
        dynamic = prm.tree == "dynamic"
        if role == "target":
            return ((self.verify_width, 0, None, dynamic),)
        nodes = ((prm.expand,) * prm.depth if dynamic else
                 tuple(math.prod(prm.branching[:i + 1]) for i in range(len(prm.branching) - 1)))
        width = head.config.hidden_size * len(self.draft_hidden())
        return (tuple((c, None, _feature_width(head)) for c in range(1, self.lookahead + 2))
                + tuple((c, sum(nodes[:i]), width, per_seq) for i, c in enumerate(nodes)
                        for per_seq in ((True,) if dynamic else (True, False))))

    # -- priming: the prompt's pairs ------------------------------------------------------------
    def prefill(self, s: DecodeState) -> None:
        """Feed the head the prompt's pairs but the last (which each step feeds first), from
        the target prefill's features; carry the last pair's feature."""
        head_model = s.draft.model
        prm = self.params
        vocab = head_model.lm_head.out_features  # the head's (draft) vocabulary
        widest = prm.expand if prm.tree == "dynamic" else max(prm.branching)
        require(widest <= vocab, f"eagle: {widest} children per node asked for, but the head "
                f"proposes from {vocab} tokens; lower expand / branching")
        width = s.target.hidden.shape[-1] if s.target.hidden is not None else 0
        if width:
            n_max = max(s.prompt_lens)
            k = n_max - 2  # pairs 0 .. n-3 of the longest prompt
            if k >= 1:
                counts = [max(0, n - 2) for n in s.prompt_lens]
                idx = to_device([n - 1 - k for n in s.prompt_lens], s.device)[:, None] \
                    + torch.arange(k, device=s.device)  # tokens 1 .. n-2, right-aligned
                feats = s.target.hidden[:, :k]
                s.draft.prefill(s.ids.gather(1, idx.clamp_min(0)), counts if s.batch > 1 else None,
                                features=feats)
        else:
            width = _feature_width(head_model)
        s.carry["feat"] = prefill_features(s, width)  # [B, 1, F]

    # -- one iteration --------------------------------------------------------------------------
    def step(self, s: DecodeState) -> StepResult:
        warp = self.params.warp
        counts = [n - 1 - c for n, c in zip(s.lengths, s.draft.row_lengths, strict=True)]
        lens = [cap if c > 0 else 0 for cap, c in zip(self.draft_lens(s), counts, strict=True)]
        levels = max(lens)
        if levels == 0:  # nothing to draft from, or one token left
            out = target_step(s, warp)
            s.carry["feat"] = s.target.hidden[:, -1:]
            return out
        ids, feats = self._catch_up(s, counts)
        ragged = counts if s.batch > 1 else None
        caps = s.on_device(lens)
        dynamic = self.params.tree == "dynamic"
        if dynamic:  # the chosen tree's depth, known on the device only, packed with its parents
            tokens, anc, parents, proposed = self._dynamic(s, ids, ragged, feats, lens, caps)
        else:
            tokens, parents, anc, proposed = self._static(s, ids, ragged, feats, lens)
        full = torch.cat([s.last_token, tokens], 1)  # [B, 1 + N]
        # the verify's forward (returning every node's features) and its rule: one graph call
        feat, recent, read = tree_verify(
            s.target, s.calls, full, anc, eagle_verify, full, parents, anc, caps, levels,
            s.uniforms((full.numel(), 1), (s.batch, 1)), s.recent, dynamic, *warp.args)
        s.carry["feat"] = feat  # the root's and the accepted nodes', right-aligned: next catch-up
        s.draft.crop_rows([n - 1 for n in s.lengths])  # the head keeps its pairs, not the tree
        # dynamic: the depth the device read back with the block (`device_depth`)
        packed = ("accepted", "length") + (("device_depth",) if dynamic else ())
        depth = {} if dynamic else depth_fields(lens, s.batch)
        return StepResult.from_read(read, recent, packed, proposed=tuple(proposed), **depth)

    def _catch_up(self, s: DecodeState, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """What the head is fed first: the pairs it has not seen (tokens j + 1, carried
        features j), right-aligned: ``(ids [B, c], features [B, c, F])`` (the carried features
        are: the verify's, the prefill's or a target step's last); its output at each row's
        last pair is the root of the tree it grows (`ModelRunner.grow_tree`)."""
        k = max(counts)
        feat = s.carry["feat"]  # [B, >= k, F]
        assert feat.shape[1] >= k, f"{k} pairs to feed, {feat.shape[1]} features carried"
        return s.last_tokens(k), feat[:, feat.shape[1] - k:]

    def _dynamic(self, s: DecodeState, ids: torch.Tensor, counts: list[int] | None,
                 feats: torch.Tensor, lens: list[int], caps: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
        """EAGLE-2's tree (`eagle_dynamic`): returns ``(tokens [B, N], anc [B, 1 + N, 1 + N],
        parents [B, 2 + N], proposed per row)``, the parents followed by the depth of the chosen
        tree within each row's cap (a tree of unsure drafts is wide and shallow; known on the
        device only; `tree_parents`). Compiled, the catch-up and every expansion are one graph
        call."""
        prm = self.params
        k = prm.expand
        steps = min(prm.depth, max(lens) - 1)  # expansions a row can still use
        n = min(prm.total_tokens - 1, k + steps * k * k)
        tokens, tree_anc, parents = s.draft.grow_tree(
            s.calls, ids, counts, feats, (k,) * steps, eagle_dynamic, s.draft.model.d2t_map,
            k, steps, caps, n)
        live = [k + (cap - 1) * k * k if cap else 0 for cap in lens]  # candidates within depth
        return tokens, tree_anc, parents, [min(n, c) for c in live]

    def _static(self, s: DecodeState, ids: torch.Tensor, counts: list[int] | None,
                feats: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, ...]:
        """EAGLE-1's tree (`eagle_static`): ``(tokens [B, N], parents, anc, proposed per
        row)``; compiled, the catch-up and every level are one graph call."""
        branching = self.params.branching[:max(lens)]
        parents, anc = rooted_tree(branching, s.device)
        nodes = tuple(math.prod(branching[:i + 1]) for i in range(len(branching) - 1))
        tokens = s.draft.grow_tree(s.calls, ids, counts, feats, nodes, eagle_static,
                                   branching, anc, s.draft.model.d2t_map)
        proposed = [tree_nodes(branching[:n]) for n in lens]
        return tokens, parents, anc, proposed


def _feature_width(head) -> int:
    """The width of the target features the head reads (H, or 3H for EAGLE-3)."""
    return head.fc.in_features - (head.config.hidden_size if head.version == 1 else 0)
