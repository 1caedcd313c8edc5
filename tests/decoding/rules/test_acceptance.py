import math

import torch

from mtad_energy.decoding.rules.chain import speculative_accept
from mtad_energy.decoding.rules.joint import joint_accept, joint_accept_length


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_joint_accept_takes_the_longest_passing_prefix_not_the_first_failure():
    # L = [-1, -2, -0.5]: prefix 1 and 2 fail log(0.5) = -0.69, prefix 3 passes
    log_p = t([-1.0, -1.0, 0.0])
    log_q = t([0.0, 0.0, -1.5])
    assert joint_accept_length(log_p, log_q, math.log(0.5)).item() == 3


def test_joint_accept_is_strict_and_zero_when_nothing_passes():
    log_tau = math.log(0.5)
    assert joint_accept_length(t([log_tau]), t([0.0]), log_tau).item() == 0  # L == log tau
    assert joint_accept_length(t([log_tau + 1e-4]), t([0.0]), log_tau).item() == 1
    assert joint_accept_length(t([-3.0, -1.0]), t([0.0, 0.0]), log_tau).item() == 0
    assert joint_accept_length(t([float("-inf"), 0.0]), t([-1.0, -1.0]), log_tau).item() == 0


def test_mtad_bonus_is_drawn_from_warped_p_after_the_accepted_prefix():
    y = torch.tensor([0, 1])
    cum_log_q = torch.log(t([0.9, 0.9 * 0.9]))
    p = t([[0.8, 0.1, 0.1],      # p(y1) = .8: L1 = log(.8/.9) passes
           [0.1, 0.05, 0.85],    # p(y2) = .05: L2 fails
           [0.2, 0.2, 0.6]])
    g = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(3000):
        eta, nxt = joint_accept(p, y, cum_log_q, math.log(0.5), g)
        assert eta.item() == 1
        draws.append(nxt.item())
    freq = torch.bincount(torch.tensor(draws), minlength=3) / len(draws)
    assert torch.allclose(freq, p[1], atol=0.02)


def test_speculative_accept_accepts_when_p_dominates_and_rejects_impossible_tokens():
    p = t([[0.6, 0.4, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = t([[0.5, 0.5, 0.0], [0.2, 0.8, 0.0]])
    g = torch.Generator().manual_seed(0)
    # token 0 at position 1 always accepted (p >= q); token 1 at position 2 never (p = 0)
    for _ in range(200):
        n, nxt = speculative_accept(p, q, torch.tensor([0, 1]), g)
        assert n.item() == 1
        assert nxt.item() == 2  # residual of [0,0,1] - [.2,.8,0] is all on token 2
    n, nxt = speculative_accept(p, t([[1.0, 0, 0], [0, 0, 1.0]]), torch.tensor([0, 2]), g)
    assert (n.item(), nxt.item()) == (2, 0)  # all accepted: bonus from p[gamma]


def test_speculative_accept_rate_is_min_one_p_over_q():
    p = t([[0.3, 0.7], [0.5, 0.5]])
    q = t([[0.6, 0.4]])
    g = torch.Generator().manual_seed(3)
    acc = sum(speculative_accept(p, q, torch.tensor([0]), g)[0].item() for _ in range(5000))
    assert abs(acc / 5000 - 0.5) < 0.02
