"""The tree a head decoder verifies is the tree its rule defines, node tokens and parents:
Medusa's cartesian tree (level k + 1 holds, below every node of level k, the top-b_k tokens of
head k), EAGLE-1's static tree (each node of level l gets the top-b_l tokens of its own draft
output) and EAGLE-2's dynamic tree (expand the best nodes by cumulative draft log-prob, verify
the total_tokens - 1 best candidates).

The expected trees are built here from the rule alone (`itertools.product`, plain loops over a
top-k table) and compared with what the target's verify forward was given: its node tokens and
the parents read from its ancestor matrix. A tree with the right top token on every level but
the wrong siblings (the greedy oracle tests cannot see that) fails here."""

from __future__ import annotations

import itertools

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.decoders import eagle as eagle_mod
from mtad_energy.decoding.decoders import medusa as medusa_mod
from mtad_energy.decoding.decoders.medusa import candidate_tokens
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.tree import rooted_tree


def cartesian(tops: list[list[int]]) -> list[tuple[int, ...]]:
    """Medusa's rule: the paths of the tree whose level l is, below every node of level l - 1,
    the tokens ``tops[l - 1]`` in rank order; levels in order, children of a node contiguous."""
    return [path for depth in range(1, len(tops) + 1)
            for path in itertools.product(*tops[:depth])]


def verified_paths(full: torch.Tensor, anc: torch.Tensor) -> list[tuple[int, ...]]:
    """The token path from the root (excluded) of every node of one verified tree:
    ``full [1 + N]`` node tokens (root first), ``anc [(1,) 1 + N, 1 + N]`` ancestors-or-self
    (a dynamic tree's is per row)."""
    anc = anc[0] if anc.dim() == 3 else anc
    out = []
    for i in range(1, full.shape[0]):
        line = anc[i].nonzero()[:, 0].tolist()  # ancestors-or-self in index order
        out.append(tuple(int(full[j]) for j in line if j != 0))
    return out


def parents_of(anc: torch.Tensor) -> list[int]:
    """Each node's parent (-1 for the root): its deepest proper ancestor."""
    depth = anc.sum(-1)
    out = []
    for i in range(anc.shape[0]):
        up = [j for j in anc[i].nonzero()[:, 0].tolist() if j != i]
        out.append(max(up, key=lambda j: int(depth[j])) if up else -1)
    return out


def test_medusas_cartesian_tree_on_a_known_table():
    """Head k ranks the 6 tokens in a known order; branching 2,3,2: 2 + 6 + 12 nodes, level 2
    below each of the 2 level-1 nodes the same 3 tokens, and so on."""
    ranks = [[4, 1, 0, 5, 2, 3], [2, 5, 3, 0, 1, 4], [0, 3, 1, 2, 4, 5]]  # best first
    logits = torch.zeros(1, 3, 6)
    for k, order in enumerate(ranks):
        logits[0, k, order] = torch.arange(6, 0, -1, dtype=torch.float)
    branching = (2, 3, 2)
    tokens = candidate_tokens(logits, branching)[0].tolist()
    parents, anc = rooted_tree(branching, torch.device("cpu"))
    tops = [ranks[k][:b] for k, b in enumerate(branching)]
    expected = cartesian(tops)
    assert tokens == [path[-1] for path in expected]
    full = torch.tensor([0, *tokens])
    assert verified_paths(full, anc) == expected
    # the parent of every node is the node of its path without the last token
    index = {path: i + 1 for i, path in enumerate(expected)}
    assert parents.tolist() == [-1] + [index.get(path[:-1], 0) for path in expected]
    assert tokens[2:8] == [2, 5, 3, 2, 5, 3]  # below 4 and below 1: the same top-3 of head 1


@pytest.mark.parametrize("branching", [(3, 2, 2), (2, 3)])
def test_medusa_verifies_the_cartesian_tree_of_its_heads(llama_pair, monkeypatch, branching):
    """Every iteration, the tree the target verifies is the cartesian tree of the heads' top-k
    at that iteration (the heads' logits recorded as they ran)."""
    heads = llama_pair.heads["medusa"]
    seen_logits, seen_trees = [], []
    real_forward, real_tree = heads.forward, medusa_mod.tree_verify

    def heads_spy(hidden):
        out = real_forward(hidden)
        seen_logits.append(out.clone())
        return out

    def tree_spy(runner, calls, tokens, anc, *args):
        seen_trees.append((tokens.clone(), anc.clone()))
        return real_tree(runner, calls, tokens, anc, *args)

    monkeypatch.setattr(heads, "forward", heads_spy)
    monkeypatch.setattr(medusa_mod, "tree_verify", tree_spy)
    me.generate("medusa", llama_pair, [5, 9, 11, 3], max_new_tokens=12, seed=1,
                branching=branching, compute_perplexity=False)
    assert len(seen_logits) == len(seen_trees) >= 3
    for logits, (full, anc) in zip(seen_logits, seen_trees, strict=True):
        if full.shape[1] != 1 + sum(itertools.accumulate(branching, lambda a, b: a * b)):
            continue  # a shortened tree near the end
        tops = [logits[0, k].topk(b).indices.tolist() for k, b in enumerate(branching)]
        assert verified_paths(full[0], anc) == cartesian(tops)


@torch.inference_mode()
def head_chain_logits(pair, prompt: list[int], path: tuple[int, ...]) -> torch.Tensor:
    """The EAGLE head's logits after ``path`` (target ids) in the first iteration after
    ``prompt``, run as a plain chain on a fresh cache: the prompt's pairs (the target's features
    of positions 0..n-2, tokens 1..n-1), then each path token paired with the head's own output
    feature of the position before. What a tree node's draft output must equal: its input
    feature is its parent's output, and it attends to its ancestors only."""
    from transformers import DynamicCache

    head = pair.heads["eagle"]
    ids = torch.tensor([prompt])
    out = pair.target(input_ids=ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in head.target_hidden_states()], -1)
    cache = DynamicCache(config=head.config)
    step = head(ids[:, 1:], feats[:, :-1], past_key_values=cache)
    t2d = {int(t): d for d, t in enumerate(head.to_target(torch.arange(head.lm_head.out_features)))}
    for token in path:
        assert token in t2d  # a drafted token is in the head's vocabulary
        step = head(torch.tensor([[token]]), step.hidden_states[0][:, -1:], past_key_values=cache)
    return step.logits[0, -1]


def _record_draft_trees(monkeypatch) -> tuple[list, list, list]:
    """Spies on EAGLE: the catch-up's logits at the root, the head's tree forwards (fed tokens and output
    logits, in order) and the target's verified trees, one entry per call."""
    roots, draft_calls, verified = [], [], []
    real_grow, real_tree = ModelRunner.grow_tree, eagle_mod.tree_verify
    real_forward_tree = ModelRunner.forward_tree

    def grow_tree(self, calls, input_ids, counts, features, nodes, fn, *args):
        def program(tree_then, call, logits, *rest):  # the catch-up's output at the root
            roots.append(logits[:, -1].clone())
            draft_calls.append([])
            return fn(tree_then, call, logits, *rest)

        return real_grow(self, calls, input_ids, counts, features, nodes, program, *args)

    def forward_tree(self, input_ids, anc_rows, depths, features=None):
        out = real_forward_tree(self, input_ids, anc_rows, depths, features)
        if self._phase == "draft":
            draft_calls[-1].append((input_ids.clone(), out.clone()))
        return out

    def tree(runner, calls, tokens, anc, *args):
        verified.append((tokens.clone(), anc.clone()))
        return real_tree(runner, calls, tokens, anc, *args)

    monkeypatch.setattr(ModelRunner, "grow_tree", grow_tree)
    monkeypatch.setattr(ModelRunner, "forward_tree", forward_tree)
    monkeypatch.setattr(eagle_mod, "tree_verify", tree)
    return roots, draft_calls, verified


def test_eagle_static_verifies_the_tree_of_each_nodes_own_top_k(llama_pair, monkeypatch):
    """EAGLE-1's tree: level 1 is the top-b_0 of the catch-up's output; every node of level l
    has as children the top-b_l tokens of the head's output at that node (the head fed the
    level's tokens in node order), in the head's vocabulary mapped to the target's."""
    head = llama_pair.heads["eagle"]
    branching = (3, 2, 2)
    roots, draft_calls, verified = _record_draft_trees(monkeypatch)
    prompt = [5, 9, 11, 3]
    me.generate("eagle", llama_pair, prompt, max_new_tokens=16, seed=1, tree="static",
                branching=branching, compute_perplexity=False)
    full_trees = [i for i, (full, _) in enumerate(verified) if full.shape[1] == 1 + 3 + 6 + 12]
    assert len(full_trees) >= 3 and full_trees[0] == 0
    torch.testing.assert_close(roots[0][0], head_chain_logits(llama_pair, prompt, ()),
                               atol=1e-4, rtol=0)
    for i in full_trees:
        level = head.to_target(roots[i][0].topk(branching[0]).indices).tolist()
        paths = [[(t,) for t in level]]
        assert len(draft_calls[i]) == len(branching) - 1
        for (fed, out), b in zip(draft_calls[i], branching[1:], strict=True):
            assert fed[0].tolist() == [p[-1] for p in paths[-1]]  # the level, in node order
            if i == 0:  # each node's output is the head's after its own path
                for path, row in zip(paths[-1], out[0], strict=True):
                    torch.testing.assert_close(row, head_chain_logits(llama_pair, prompt, path),
                                               atol=1e-4, rtol=0)
            paths.append([p + (int(t),) for p, row in zip(paths[-1], out[0], strict=True)
                          for t in head.to_target(row.topk(b).indices).tolist()])
        full, anc = verified[i]
        assert verified_paths(full[0], anc) == [p for level in paths for p in level]


@pytest.mark.parametrize("pair", ["llama_pair", "small3_pair"])
def test_eagle_dynamic_verifies_the_best_candidates_by_cumulative_log_prob(
        request, pair, monkeypatch):
    """EAGLE-2's tree (``topK_genrate``): candidates are the top-k children of the root and of
    each expanded node, scored by cumulative draft log-prob; each step expands the k best
    children of the last step; the verified tree is the total_tokens - 1 best candidates."""
    pair = request.getfixturevalue(pair)
    head = pair.heads["eagle"]
    k, steps, total = 3, 2, 9
    roots, draft_calls, verified = _record_draft_trees(monkeypatch)
    prompt = [3, 1, 4, 1]
    me.generate("eagle", pair, prompt, max_new_tokens=24, seed=1, tree="dynamic",
                depth=steps, expand=k, total_tokens=total, compute_perplexity=False)
    assert len(verified) >= 3
    torch.testing.assert_close(roots[0][0], head_chain_logits(pair, prompt, ()), atol=1e-4,
                               rtol=0)
    for i in range(3):  # early iterations: no row cap on the depth
        lp = roots[i][0].float().log_softmax(-1)
        top = lp.topk(k)
        frontier = [(float(v), (int(t),)) for v, t in zip(top.values, head.to_target(top.indices),
                                                           strict=True)]
        pool = list(frontier)
        assert len(draft_calls[i]) == steps
        for fed, out in draft_calls[i]:
            assert fed[0].tolist() == [path[-1] for _, path in frontier]
            if i == 0:  # each expanded node's output is the head's after its own path
                for (_, path), row in zip(frontier, out[0], strict=True):
                    torch.testing.assert_close(row, head_chain_logits(pair, prompt, path),
                                               atol=1e-4, rtol=0)
            children = []
            for (score, path), row in zip(frontier, out[0], strict=True):
                top = row.float().log_softmax(-1).topk(k)
                children += [(score + float(v), path + (int(t),)) for v, t in
                             zip(top.values, head.to_target(top.indices), strict=True)]
            pool += children
            frontier = sorted(children, key=lambda c: -c[0])[:k]
        best = sorted(pool, key=lambda c: -c[0])[:total - 1]
        full, anc = verified[i]
        assert sorted(verified_paths(full[0], anc)) == sorted(path for _, path in best)
