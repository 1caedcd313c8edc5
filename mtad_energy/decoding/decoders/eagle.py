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
   ``branching[l]`` tokens of its own output (one draft forward per level);
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

from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.tree import tree_candidates_accept
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.head_runner import prefill_features
from mtad_energy.decoding.runtime.params import DecoderParams, param, require
from mtad_energy.decoding.runtime.state import DecodeState, to_device
from mtad_energy.decoding.runtime.step import StepResult
from mtad_energy.decoding.runtime.tree import (
    MAX_TREE_NODES,
    ancestors,
    rooted_tree,
    set_branching,
    tree_forward,
    tree_nodes,
)

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


def _right_aligned(carry: torch.Tensor, counts: list[int], width: int) -> torch.Tensor:
    """``carry [B, m, F]`` (row b's first counts[b] entries valid) placed at the last counts[b]
    of ``width`` columns ``[B, width, F]`` (the runner's left padding before them)."""
    dev = carry.device
    shift = width - to_device(counts, dev)  # [B]
    idx = (torch.arange(width, device=dev)[None] - shift[:, None]).clamp(0, carry.shape[1] - 1)
    return carry.gather(1, idx[..., None].expand(-1, -1, carry.shape[-1]))


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
                idx = to_device([n - 1 - k for n in s.prompt_lens], s.ids.device)[:, None] \
                    + torch.arange(k, device=s.ids.device)  # tokens 1 .. n-2, right-aligned
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
        head = s.draft.model
        root_logits, root_feat = self._catch_up(s, counts)  # [B, V'], [B, H]
        if self.params.tree == "dynamic":
            tokens, parents, anc, proposed, depths = self._dynamic(s, root_logits, root_feat,
                                                                   lens, head)
        else:
            tokens, parents, anc, proposed = self._static(s, root_logits, root_feat, lens, head)
            depths = lens
        full = torch.cat([s.last_token, tokens], 1)  # [B, 1 + N]
        logits = tree_forward(s.target, full, anc)  # [B, 1 + N, V], features of every node
        caps = to_device(lens, s.ids.device)
        depth, path, nxt, _ = tree_candidates_accept(warp.probs(logits), full, parents, anc, caps,
                                                     levels, s.generator)
        kept = torch.cat([torch.zeros_like(path[:, :1]), path], 1)  # [B, 1 + L]: root first
        s.target.keep_tree(full.shape[1], kept)
        hidden = s.target.hidden  # the root's and the accepted nodes' features: next catch-up
        s.carry["feat"] = hidden.gather(1, kept[..., None].expand(-1, -1, hidden.shape[-1]))
        head_valid = s.lengths_on_device() - 1  # the head keeps its pairs, not the tree
        return StepResult.block(full.gather(1, path), depth, nxt, proposed, head_valid,
                                depth=depths)

    def _catch_up(self, s: DecodeState, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the head the pairs it has not seen (tokens j + 1, carried features j), right-
        aligned -> the output at each row's last pair: ``(logits [B, V'], feature [B, H])``."""
        k = max(counts)
        idx = s.lengths_on_device()[:, None] - k + torch.arange(k, device=s.ids.device)
        ids = s.ids.gather(1, idx.clamp_min(0))  # [B, k]: each row's last k tokens
        feats = _right_aligned(s.carry["feat"], counts, k)
        logits = s.draft(ids, counts if s.batch > 1 else None, features=feats)
        return logits[:, -1], s.draft.hidden[:, -1]

    def _dynamic(self, s: DecodeState, root_logits: torch.Tensor, root_feat: torch.Tensor,
                 lens: list[int], head) -> tuple[torch.Tensor, ...]:
        """EAGLE-2's tree: returns ``(tokens [B, N], parents [B, 1 + N], anc [B, 1 + N, 1 + N],
        proposed per row, depth [B])``: the depth of the chosen tree within each row's cap (a
        tree of unsure drafts is wide and shallow; known on the device only)."""
        prm = self.params
        k, rows, dev = prm.expand, s.batch, s.ids.device
        steps = min(prm.depth, max(lens) - 1)  # expansions a row can still use
        top = root_logits.float().log_softmax(-1).topk(k, -1)  # [B, k]
        scores, tok = top.values, head.to_target(top.indices)  # [B, k]
        pool_tok, pool_score = [tok], [scores]
        pool_parent = [torch.full((rows, k), -1, device=dev, dtype=torch.long)]
        pool_depth = [1]
        front_feat = root_feat[:, None].expand(-1, k, -1)  # parents' output features
        front_tok, front_score = tok, scores
        front_global = torch.arange(k, device=dev).expand(rows, k)  # pool index of the frontier
        fed_anc = torch.zeros(rows, 0, 0, dtype=torch.bool, device=dev)
        front_parent_fed = None
        base = k
        for i in range(steps):
            m = fed_anc.shape[-1]
            new = torch.zeros(rows, k, m + k, dtype=torch.bool, device=dev)
            if front_parent_fed is not None:  # a frontier node sees its parent's ancestors
                new[:, :, :m] = fed_anc.gather(1, front_parent_fed[..., None].expand(-1, -1, m))
            new[:, :, m:] = torch.eye(k, dtype=torch.bool, device=dev)
            fed_anc = torch.cat([torch.nn.functional.pad(fed_anc, (0, k)), new], 1)
            depths = torch.full((rows, k), i + 1, device=dev, dtype=torch.long)
            out = s.draft.forward_tree(front_tok, new, depths, front_feat)  # [B, k, V']
            out_feat = s.draft.hidden  # [B, k, H]
            lp = out.float().log_softmax(-1).topk(k, -1)  # children of each fed node
            cu = front_score[..., None] + lp.values - 1e-6  # [B, k, k]: strictly below parent
            child_tok = head.to_target(lp.indices).reshape(rows, k * k)
            cu = cu.reshape(rows, k * k)
            pool_tok.append(child_tok)
            pool_score.append(cu)
            pool_parent.append(front_global.repeat_interleave(k, 1))
            pool_depth.append(i + 2)
            best = cu.topk(k, -1).indices  # [B, k]: the next frontier
            front_parent_fed = m + best // k  # its parents' index among the fed nodes
            front_feat = out_feat.gather(1, (best // k)[..., None].expand(-1, -1, out_feat.shape[-1]))
            front_tok, front_score = child_tok.gather(1, best), cu.gather(1, best)
            front_global = base + best
            base += k * k
        tok_all = torch.cat(pool_tok, 1)  # [B, P]
        score_all = torch.cat(pool_score, 1)
        parent_all = torch.cat(pool_parent, 1)
        depth_all = torch.cat([torch.full((t.shape[1],), d, device=dev)
                               for t, d in zip(pool_tok, pool_depth, strict=True)])  # [P]
        caps = to_device(lens, dev)
        score_all = score_all.masked_fill(depth_all[None] > caps[:, None], float("-inf"))
        n = min(prm.total_tokens - 1, tok_all.shape[1])
        chosen = score_all.topk(n, -1).indices.sort(-1).values  # [B, N]: parents before children
        parent = parent_all.gather(1, chosen)
        pos = torch.searchsorted(chosen, parent.clamp_min(0))  # the parent's place among chosen
        parents = torch.cat([torch.full((rows, 1), -1, device=dev, dtype=torch.long),
                             torch.where(parent < 0, 0, pos + 1)], 1)
        live = [k + (cap - 1) * k * k if cap else 0 for cap in lens]  # candidates within depth
        proposed = [min(n, c) for c in live]
        chosen_depth = depth_all[chosen]  # [B, N]
        depth = chosen_depth.masked_fill(chosen_depth > caps[:, None], 0).amax(-1)  # [B]
        return tok_all.gather(1, chosen), parents, ancestors(parents), proposed, depth

    def _static(self, s: DecodeState, root_logits: torch.Tensor, root_feat: torch.Tensor,
                lens: list[int], head) -> tuple[torch.Tensor, ...]:
        """EAGLE-1's tree: every node of a level gets the top tokens of its own output."""
        branching = self.params.branching[:max(lens)]
        rows, dev = s.batch, s.ids.device
        parents, anc = rooted_tree(branching, dev)
        level_tok = head.to_target(root_logits.topk(branching[0], -1).indices)  # [B, b0]
        tokens, fed = [level_tok], 0
        feats = root_feat[:, None].expand(-1, branching[0], -1)
        for level, b in enumerate(branching[1:], 1):
            width = level_tok.shape[1]
            rows_anc = anc[1 + fed:1 + fed + width, 1:1 + fed + width]  # [w, M + w]
            out = s.draft.forward_tree(level_tok, rows_anc, torch.full((width,), level, device=dev),
                                       feats)
            level_tok = head.to_target(out.topk(b, -1).indices).reshape(rows, width * b)
            tokens.append(level_tok)
            feats = s.draft.hidden.repeat_interleave(b, 1)  # each child's parent's output
            fed += width
        proposed = [tree_nodes(branching[:n]) for n in lens]
        return torch.cat(tokens, 1), parents, anc, proposed


def _feature_width(head) -> int:
    """The width of the target features the head reads (H, or 3H for EAGLE-3)."""
    return head.fc.in_features - (head.config.hidden_size if head.version == 1 else 0)
