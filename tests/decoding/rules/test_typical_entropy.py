"""Medusa's typical acceptance where its entropy term decides: x passes if
p(x) > min(eps, delta * exp(-H(p))). With the defaults (eps 0.09, delta 0.3) the entropy term is
the smaller one only when H > ln(delta / eps) = 1.20 nats: a token of p = 0.08 passes under a
spread-out p (H = 1.54: threshold 0.3 e^-1.54 = 0.064) and fails under a peaked one (H = 0.55:
threshold eps = 0.09). Greedy tests cannot see the sign of the exponent (H = 0 there), and a
hand-made tree whose tokens sit far from both thresholds passes with either sign."""

from __future__ import annotations

import math

import pytest
import torch

from mtad_energy.decoding.rules.chain import typical_accept_length
from mtad_energy.decoding.rules.tree import tree_typical_accept
from mtad_energy.decoding.runtime.tree import ancestors

EPS, DELTA = 0.09, 0.3
SPREAD = [0.30, 0.08, 0.22, 0.20, 0.20]  # token 1 at 0.08, H = 1.54
SPREAD_2 = [0.30, 0.22, 0.08, 0.20, 0.20]  # token 2 at 0.08, H = 1.54
PEAKED = [0.84, 0.08, 0.08, 0.00, 0.00]  # tokens 1 and 2 at 0.08, H = 0.55


def entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


def test_the_tables_sit_where_the_entropy_term_decides():
    for p, token in ((SPREAD, 1), (SPREAD_2, 2)):
        assert DELTA * math.exp(-entropy(p)) < p[token] < EPS  # passes only by the entropy term
    assert min(EPS, DELTA * math.exp(-entropy(PEAKED))) == EPS > PEAKED[1]


# root 0 -> node 1 (token 1) -> node 2 (token 2)
PARENTS = torch.tensor([-1, 0, 1])
TOKENS = torch.tensor([[0, 1, 2]])


@pytest.mark.parametrize(("at_root", "at_node1", "depth"),
                         [(SPREAD, SPREAD_2, 2), (SPREAD, PEAKED, 1), (PEAKED, SPREAD_2, 0)])
def test_medusa_tree_typical_rule_where_the_entropy_term_decides(at_root, at_node1, depth):
    """Node 1 is tested under p at the root, node 2 under p at node 1: a 0.08 token passes
    under the spread p and fails under the peaked one, whatever its ancestors did."""
    p = torch.tensor([[at_root, at_node1, [0.2] * 5]])  # [1, 3, V]: p at root, node 1, node 2
    got, path, node = tree_typical_accept(p, TOKENS, PARENTS, ancestors(PARENTS),
                                          torch.tensor([2]), 2, EPS, DELTA)
    assert (int(got), int(node)) == (depth, depth)


@pytest.mark.parametrize(("rows", "length"),
                         [((SPREAD, SPREAD_2), 2), ((SPREAD, PEAKED), 1), ((PEAKED, SPREAD_2), 0)])
def test_the_chain_typical_rule_where_the_entropy_term_decides(rows, length):
    """The `typical` decoder's chain rule, on the same tables: draft tokens 1 then 2."""
    p = torch.tensor(rows)  # [gamma = 2, V]
    assert int(typical_accept_length(p, torch.tensor([1, 2]), EPS, DELTA)) == length
