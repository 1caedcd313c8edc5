"""SpecInfer and MCSS are lossless: their output follows the warped target exactly (chi-square).

Two levels: the pure tree walk on hand-made p/q tables (cheap, many samples, including q with
fewer tokens than children), and the full decoders on ``lossless_pair`` for the first 3 tokens,
which exercises drafting, tree attention, descent into the tree and cache keeping. Seeds are fixed,
so every p-value is deterministic; a deliberately broken walk must be rejected by the same test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from mtad_energy.decoding.decoders.specinfer import draw_children
from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.rules import tree as tree_rules
from mtad_energy.decoding.rules.sampling import Warp, sample
from mtad_energy.decoding.rules.tree import tree_speculative_accept
from tests.decoding.lossless import chi_square_pvalue, exact_joint, sample_counts
from tests.tiny import lossless_pair

P = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40, 0.00])
Q_WIDE = torch.tensor([0.40, 0.30, 0.20, 0.00, 0.05, 0.05])  # q > 0 where p = 0 and vice versa
Q_NARROW = torch.tensor([0.00, 0.70, 0.00, 0.00, 0.30, 0.00])  # 2 tokens for 4 children
OK, BROKEN = 1e-3, 1e-6


def walk_counts(p: torch.Tensor, q: torch.Tensor, children: int, without_replacement: bool,
                n: int, on_support: bool = False) -> Counter:
    """First emitted token of a one-level tree walk, n times. ``on_support``: children drawn
    over q's nonzero tokens only (`Warp.support` with top_k = their count), as the decoders
    draw after a top-k warp on the CPU."""
    gen = torch.Generator().manual_seed(0)
    support = None
    if on_support:
        support = Warp(1.0, int((q > 0).sum()), 1.0).support(q[None].log())
        assert support[0] is not None  # premise: the candidate path is taken
    p_rows = p[None].expand(1 + children, -1)  # children's own p only matter below them
    counts: Counter = Counter()
    for _ in range(n):
        tokens = draw_children(q[None], children, gen, without_replacement, support)[0]
        u = torch.rand(children, generator=gen)
        depth, path, dist = tree_speculative_accept(p_rows, q[None], tokens, (children,), u,
                                                    without_replacement)
        counts[(int(tokens[path[0]] if int(depth) else sample(dist, gen)),)] += 1
    return counts


def _exact(p: torch.Tensor) -> dict[tuple, float]:
    return {(i,): float(v) for i, v in enumerate(p) if v > 0}


@pytest.mark.parametrize("on_support", [False, True])
@pytest.mark.parametrize("without_replacement", [False, True])
@pytest.mark.parametrize("q", [Q_WIDE, Q_NARROW])
def test_walk_is_lossless(q, without_replacement, on_support):
    counts = walk_counts(P, q, 4, without_replacement, 3000, on_support)
    assert chi_square_pvalue(counts, _exact(P)) > OK


def test_walk_without_residual_is_rejected(monkeypatch):
    monkeypatch.setattr(tree_rules, "residual", lambda p, q: p)  # p not updated on rejection
    assert chi_square_pvalue(walk_counts(P, Q_WIDE, 4, False, 2000), _exact(P)) < BROKEN


def test_mcss_without_q_update_is_rejected(monkeypatch):
    monkeypatch.setattr(tree_rules, "remove_token", lambda q, x: q)  # the classic MCSS mistake
    assert chi_square_pvalue(walk_counts(P, Q_WIDE, 4, True, 2000), _exact(P)) < BROKEN


def test_walk_descends_and_takes_the_leaf_bonus_from_p():
    # q is one-hot on token 1 and p accepts it surely at both levels: depth 2, bonus from p[leaf]
    v = 4
    q = torch.zeros(3, v)
    q[:, 1] = 1.0
    p = torch.full((1 + 2 + 2, v), 0.25)
    p[0], p[1] = q[0], q[0]  # root and the first child accept token 1
    tokens = torch.tensor([1, 1, 1, 1])  # branching (2, 1) with i.i.d. (duplicate) children
    p2 = p.clone()
    p2[3] = torch.tensor([0.0, 0.0, 0.0, 1.0])  # leaf under the first child
    depth, path, dist = tree_speculative_accept(p2[:4], q, tokens[:3], (2, 1), torch.zeros(3))
    assert int(depth) == 2 and path.tolist() == [0, 2]
    assert dist.tolist() == [0.0, 0.0, 0.0, 1.0]


@pytest.fixture(scope="module")
def pair_and_exact():
    pair = lossless_pair()
    return pair, exact_joint(pair, Warp(), n_tokens=3)


@pytest.mark.parametrize("name", ["specinfer", "mcss"])
def test_decoder_is_lossless(pair_and_exact, name):
    pair, exact = pair_and_exact
    counts = sample_counts(get_decoder(name), pair, 800, n_tokens=3)
    assert chi_square_pvalue(counts, exact) > OK


def test_decoder_with_broken_residual_is_rejected(pair_and_exact, monkeypatch):
    pair, exact = pair_and_exact
    monkeypatch.setattr(tree_rules, "residual", lambda p, q: p)
    counts = sample_counts(get_decoder("specinfer"), pair, 600, n_tokens=3)
    assert chi_square_pvalue(counts, exact) < BROKEN
