"""MMTAD's rule on hand-built beam trees, the MTAD <= MMTAD theorem, and the decoder end to end."""

from __future__ import annotations

import math

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.rules.joint import joint_accept_length, lineage, tree_joint_accept
from tests.tiny import lossless_pair

LOG_TAU = math.log(0.5)
NEG = float("-inf")


def _select(log_p_tok, log_q, parents, best=0):
    eta, b, path = tree_joint_accept(torch.tensor(log_p_tok), torch.tensor(log_q),
                                torch.tensor(parents), torch.tensor(best), LOG_TAU)
    return int(eta), int(b), path[:int(eta)].tolist()


def test_normaliser_is_traced_through_ancestors_of_best_beam():
    # W=2, D=2. (1,0) is a child of (0,1); (1,1) a child of (0,0). y* = final beam 0 = (0,1)->(1,0),
    # so logQ*_1 = log_q[0, 1] = -2.0, not log_q[0, best=0] = -0.1 (which would fail depth 1).
    parents = [[0, 0], [1, 0]]
    log_q = [[-0.1, -2.0], [-2.5, -3.6]]
    log_p_tok = [[-1.0, -1.5], [-2.0, -0.2]]
    # depth 1: -1.0 + 2.0 = 1.0 and -1.5 + 2.0 = 0.5 pass. depth 2 (logQ*_2 = -2.5):
    # (1,0): -1.5 - 2.0 + 2.5 = -1.0 fails; (1,1): -1.0 - 0.2 + 2.5 = 1.3 passes via parent (0,0)
    assert _select(log_p_tok, log_q, parents) == (2, 1, [0, 1])
    # MTAD on the same draft only accepts y*_1: L_1 = 0.5 passes, L_2 = -1.0 fails
    y_lp = torch.tensor([-1.5, -2.0])
    y_lq = torch.tensor([-2.0, -0.5])
    assert int(joint_accept_length(y_lp, y_lq, LOG_TAU)) == 1
    # with a normaliser taken at index best instead, depth 1 would fail (-0.9, -1.4 < log 0.5)
    assert _select([[-1.0, -1.5]], [[-0.1, -2.0]], [[0, 0]], best=0)[0] == 0


def test_deepest_depth_wins_even_after_a_failing_depth():
    # a chain (W=1): L_1 fails, L_2 passes, L_3 fails -> eta = 2 (do not stop at the first failure)
    log_q = [[-1.0], [-2.0], [-3.0]]
    log_p_tok = [[-2.0], [0.5], [-5.0]]  # cumulative logP: -2.0, -1.5, -6.5
    assert _select(log_p_tok, log_q, [[0], [0], [0]]) == (2, 0, [0, 0])


def test_highest_target_logprob_then_lowest_index():
    log_q = [[-1.0, -1.2, -1.5]]
    assert _select([[-0.5, -0.9, -0.2]], log_q, [[0, 0, 0]]) == (1, 2, [2])  # all pass: max logP
    assert _select([[-2.0, -0.5, -0.5]], log_q, [[0, 0, 0]]) == (1, 1, [1])  # tie: lowest index


def test_dead_nodes_never_pass_and_nothing_passing_gives_zero():
    log_q = [[-1.0, NEG, -1.5]]
    assert _select([[-3.0, 0.0, -3.0]], log_q, [[0, 0, 0]]) == (0, 0, [])
    # a dead parent kills its subtree: (1,0) under dead (0,1) would pass on its logP alone
    log_q2 = [[-1.0, NEG], [NEG, -2.0]]
    assert _select([[-9.0, 0.0], [0.0, -9.0]], log_q2, [[0, 0], [1, 0]], best=1) == (0, 0, [])


def test_lineage_traces_parents():
    lin = lineage(torch.tensor([[0, 0, 0], [2, 0, 2], [1, 1, 0]]))
    assert lin[2, 0].tolist() == [0, 1, 0]  # (2,0) <- (1,1) <- (0,0)
    assert lin[2, 2].tolist() == [2, 0, 2]  # (2,2) <- (1,0) <- (0,2)
    assert lin[1, 2, :2].tolist() == [2, 2]


def _random_beam_tree(gen: torch.Generator, depth: int, width: int):
    """Random beam-tree tables as beam_sample makes them (cumulative log q, parents, dead nodes)."""
    parents = torch.randint(0, width, (depth, width), generator=gen)
    parents[0] = 0
    tok_lq = -torch.rand(depth, width, generator=gen) * 3
    tok_lq[torch.rand(depth, width, generator=gen) < 0.1] = NEG
    parents[:, 0], tok_lq[:, 0] = 0, -1.0  # beam_sample always keeps a live beam
    cum = [tok_lq[0]]
    for d in range(1, depth):
        cum.append(cum[-1][parents[d]] + tok_lq[d])
    log_q = torch.stack(cum)
    log_p_tok = -torch.rand(depth, width, generator=gen) * 3
    return log_p_tok, log_q, parents, log_q[-1].argmax()


def test_mmtad_accepts_at_least_mtad_on_random_trees():
    gen = torch.Generator().manual_seed(0)
    longer = 0
    for _ in range(300):
        depth, width = int(torch.randint(1, 6, (), generator=gen)), 4
        log_p_tok, log_q, parents, best = _random_beam_tree(gen, depth, width)
        # MTAD scores y* alone: trace its nodes by hand (independent of rules.joint.lineage)
        nodes = [int(best)]
        for d in range(depth - 1, 0, -1):
            nodes.insert(0, int(parents[d, nodes[0]]))
        idx = torch.arange(depth)
        y_lq = torch.diff(log_q[idx, nodes], prepend=torch.zeros(1))
        eta_mtad = int(joint_accept_length(log_p_tok[idx, nodes], y_lq, LOG_TAU))
        eta, _, _ = tree_joint_accept(log_p_tok, log_q, parents, best, LOG_TAU)
        assert int(eta) >= eta_mtad
        longer += int(eta) > eta_mtad
    assert longer > 10  # the extra candidates do help sometimes


def test_decoder_first_step_accepts_at_least_mtad_on_the_same_draft():
    pair = lossless_pair()
    for seed in range(12):  # same seed -> same beam draft in the first iteration
        runs = [me.generate(get_decoder(name), pair, [1, 2], max_new_tokens=5, seed=seed,
                            compute_perplexity=False) for name in ("mtad", "mmtad")]
        assert runs[1].steps[0].accepted >= runs[0].steps[0].accepted
        assert runs[1].steps[0].proposed == 16  # W * gamma nodes shown to the target


def test_bad_parameters():
    with pytest.raises(ValueError, match="tau"):
        get_decoder("mmtad", tau=1.5)
    with pytest.raises(ValueError, match="gamma"):
        get_decoder("mmtad", gamma=0)
    with pytest.raises(ValueError, match="beam_width"):
        get_decoder("mmtad", beam_width="0")


def test_a_node_past_the_rows_own_depth_is_never_accepted():
    """`mmtad_verify` on two identical beam trees (W = 2, D = 2) whose only passing node is
    (1, 1) at depth 2: the row that may draft 2 accepts it with its path; the row whose own
    depth is 1 (near its end) accepts nothing, its path and next token from the root, not from
    the deeper node. tau = 1: depth 1 fails (0.3 / 0.5), (1, 1) passes (0.3 * 0.99 / 0.25),
    (1, 0) fails (0.3 * 0.1 / 0.25)."""
    from mtad_energy.decoding.decoders.mmtad import mmtad_verify

    def dist(**at):  # a distribution over 6 tokens with the given masses, the rest spread
        rest = (1 - sum(at.values())) / (6 - len(at))
        return [at.get(f"t{i}", rest) for i in range(6)]

    p = torch.tensor([dist(t1=0.3, t2=0.3), dist(t3=0.1), dist(t4=0.99), dist(), dist()])
    tree = torch.tensor([[0, 1, 2, 3, 4]] * 2)  # root, (0,0), (0,1), (1,0), (1,1)
    tokens = torch.tensor([[[1, 2], [3, 4]]] * 2)  # [B, D, W]
    parents = torch.tensor([[[0, 0], [0, 1]]] * 2)  # (1,0) under (0,0), (1,1) under (0,1)
    log_q = torch.tensor([[[0.5, 0.5], [0.25, 0.25]]] * 2).log()  # cumulative
    seqs = torch.tensor([[[1, 3], [2, 4]]] * 2)  # [B, W, D]
    block, eta, length, nodes, *_ = mmtad_verify(
        p.log().expand(2, -1, -1), tree, tokens, parents, log_q, seqs, torch.tensor([1, 2]),
        torch.full((2, 1), 0.5), torch.zeros(2, 1, dtype=torch.long), 0.0, 1.0, 0, 1.0)
    assert eta.tolist() == [0, 2] and length.tolist() == [1, 3]
    assert nodes[1].tolist() == [0, 2, 4] and block[1, :2].tolist() == [2, 4]
    assert nodes[0, 0] == 0 and block[0, 0] == 2  # from the root's p (u = 0.5: token 2)
