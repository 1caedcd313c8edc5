"""The speculative-decoding audit: acceptance theory with known answers, the under-acceptance flag,
the lossless check and the n-gram proposal rule (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from mtad_energy.decoding.rules.sampling import Warp
from mtad_energy.engines import audit
from mtad_energy.engines.audit import Measured


def test_alpha_known_answers():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert audit.alpha_dists(p, p).item() == pytest.approx(1.0)  # q = p: every draft accepted
    disjoint = torch.tensor([0.0, 0.0, 0.0, 1.0])
    assert audit.alpha_dists(p, disjoint).item() == 0.0
    q = torch.tensor([0.2, 0.2, 0.6, 0.0])  # hand table: min = .2 + .2 + .2
    assert audit.alpha_dists(p, q).item() == pytest.approx(0.6)
    assert audit.alpha_point(p[None], torch.tensor([1])).tolist() == pytest.approx([0.3])


def test_expected_accepted_length():
    assert audit.expected_accepted(torch.tensor([1.0, 1.0, 1.0])).item() == pytest.approx(3.0)
    assert audit.expected_accepted(torch.tensor([0.5, 0.5])).item() == pytest.approx(0.75)
    assert audit.expected_accepted(torch.tensor([0.0, 1.0])).item() == 0.0  # a chain stops at a rejection


def test_teacher_forced_alpha_on_a_tiny_pair(lossless_pair):
    """The model as its own draft: alpha 1 at every position, under any warp; a different draft:
    alpha equals sum min(p, q) computed by hand from the two models' logits."""
    pair = lossless_pair
    warp = Warp(temperature=0.8, top_k=0, top_p=1.0)
    prompt, out = [1, 2], [3, 0, 4, 1, 2, 2]
    p = audit.warped_along(pair.target, prompt, out, warp)
    q_self = audit.warped_along(pair.target, prompt, out, warp)
    chains = audit.every_position_chains(audit.alpha_dists(p, q_self), k=3)
    assert len(chains) == len(out) - 3 and all(c.alphas == pytest.approx((1.0,) * 3) for c in chains)
    q = audit.warped_along(pair.draft, prompt, out, warp)
    ids = torch.tensor([prompt + out])
    with torch.inference_mode():
        lp = (pair.target(input_ids=ids).logits[0, 1:-1] / 0.8).softmax(-1)
        lq = (pair.draft(input_ids=ids).logits[0, 1:-1] / 0.8).softmax(-1)
    hand = torch.minimum(lp, lq).sum(-1)
    assert audit.alpha_dists(p, q).tolist() == pytest.approx(hand.tolist(), abs=1e-5)
    assert 0.0 < float(hand.min()) and float(hand.max()) < 1.0
    # a greedy draft (argmax q, verified as a point mass): alpha = p~(argmax q~), below 1 even for q = p
    greedy = audit.alpha_point(p, q_self.argmax(-1))
    assert greedy.tolist() == pytest.approx(lp.max(-1).values.tolist(), abs=1e-5)
    assert float(greedy.max()) < 1.0


def test_ngram_chains_start_where_the_engine_drafted_with_the_target_on_each_proposal(lossless_pair):
    """Read off the output: a chain at position 1, the next after its accepted tokens (the output
    carries the draft token exactly where it was accepted) and the one emitted after them; each
    alpha is p~(d_i | context, d_<i) from a full forward over the context and the proposal."""
    target, warp = lossless_pair.target, Warp(temperature=0.8, top_k=0, top_p=1.0)
    prompt, out = [1, 2, 3, 1, 2, 4], [1, 2, 3, 0, 1, 2, 4, 4]
    p = audit.warped_along(target, prompt, out, warp)
    chains = audit.point_mass_chains(p, out, audit.ngram_proposer(prompt, out, 1, 2, 3))
    t, seen = 1, []
    while t < len(out):  # the engine's walk, by hand
        d = audit.ngram_propose(prompt + out[:t], 1, 2, 3)[: len(out) - t]
        if not d:
            t += 1
            continue
        a = next((i for i in range(len(d)) if out[t + i] != d[i]), len(d))
        full = audit.warped_along(target, prompt + out[:t], d, warp)  # p~ along the proposal
        seen.append((t, a, full[torch.arange(len(d)), torch.tensor(d)][: a + 1].tolist()))
        t += a + 1
    assert [(c.start, c.accepted) for c in chains] == [(t, a) for t, a, _ in seen]
    assert any(a for _, a, _ in seen) and any(a < 3 for _, a, _ in seen)  # accepts and rejects
    for c, (_, a, expected) in zip(chains, seen, strict=True):  # reached positions: exact
        assert list(c.alphas[: a + 1]) == pytest.approx(expected, abs=1e-5)
        assert [tr[2] for tr in c.trials()] == [True] * a + [False] * (a < len(c.alphas))


def test_stepped_chains_start_where_the_engine_steps_put_them():
    alphas = torch.linspace(0.1, 0.9, 10)
    chains = audit.stepped_chains(alphas, [(3, 1), (3, 3), (0, 0), (3, 0), (3, 2)])
    assert [(c.start, c.accepted) for c in chains] == [(1, 1), (3, 3), (8, 0), (9, 1)]
    assert chains[0].alphas == pytest.approx(tuple(alphas[1:4].tolist()))
    assert chains[-1].alphas == pytest.approx((float(alphas[9]),))  # cut at the output's end


def test_poisson_binomial_tails_known_answers():
    under, over = audit.poisson_binomial_tails([0.5] * 4, 1)
    assert (under, over) == pytest.approx((5 / 16, 15 / 16))
    assert audit.poisson_binomial_tails([1.0, 1.0], 1) == pytest.approx((0.0, 1.0))  # impossible
    assert audit.poisson_binomial_tails([0.2, 0.7], 0) == pytest.approx((0.8 * 0.3, 1.0))


def _chains(alphas: list[tuple[float, ...]], rate: float, seed: int) -> list[audit.Chain]:
    """Chains whose draft tokens are accepted with ``rate`` x alpha, one after the other."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for a in alphas:
        n = 0
        while n < len(a) and float(torch.rand((), generator=g)) < rate * a[n]:
            n += 1
        out.append(audit.Chain(1, a, n))
    return out


def test_the_flag_fires_at_its_level_for_a_correct_engine_and_catches_a_wrong_one():
    """Outcomes drawn with the right probabilities: p-values spread over (0, 1), so the flag
    fires about as often as its level; half the probability: flagged; q = p: any rejection is."""
    g = torch.Generator().manual_seed(0)
    alphas = [tuple((0.2 + 0.7 * torch.rand(3, generator=g)).tolist()) for _ in range(150)]
    k, counters = 3, audit.Measured(150, 450, 0, (0, 0, 0))
    rows = [audit.audit_row("right", _chains(alphas, 1.0, s), counters, k) for s in range(200)]
    pvalues = [r.test.p_under for r in rows]
    assert sum(p < 0.05 for p in pvalues) <= 20 and 0.35 < sum(pvalues) / len(pvalues) < 0.65
    assert sum(r.flagged for r in rows) <= 2  # level 1e-3 over 200 runs
    half = audit.audit_row("half", _chains(alphas, 0.5, 1), counters, k)
    assert half.flag == "under-accepts" and half.test.p_under < 1e-10
    ones = [(1.0, 1.0, 1.0)] * 10
    assert audit.audit_row("self", _chains(ones, 0.8, 3), counters, k).flag == "under-accepts"
    assert audit.audit_row("self", _chains(ones, 1.0, 3), counters, k).flag is None


def test_without_outcomes_the_counters_are_tested_at_the_chain_starts():
    chains = [audit.Chain(t, (0.9, 0.8, 0.7)) for t in range(1, 51)]
    ok = audit.audit_row("matching", chains, audit.Measured(500, 1500, 900, (452, 360, 250)), 3)
    assert not ok.flagged and ok.test is None and ok.pvalue_counters > 1e-3
    lo, hi = ok.first_pos_ci
    assert lo <= 0.9 <= hi
    low = audit.audit_row("under", chains, audit.Measured(500, 1500, 30, (20, 7, 3)), 3)
    assert low.flag == "under-accepts" and low.pvalue_counters < 1e-10
    # the tolerance: a bf16 engine's near-tie at T = 0 is no impossible event
    ones = [audit.Chain(t, (1.0, 1.0, 1.0), 3) for t in range(48)] + [audit.Chain(48, (1.0,), 0)]
    assert audit.audit_row("greedy", ones, audit.Measured(49, 145, 144, (48, 48, 48)), 3).flagged
    assert not audit.audit_row("greedy", ones, audit.Measured(49, 145, 144, (48, 48, 48)), 3,
                               tolerance=0.01).flagged


@pytest.mark.slow  # 22 fake-engine runs per kind (~30-50 s); the 20-seed study is the experiment's
@pytest.mark.parametrize("rule", ["SAMPLED", "GREEDY"])
def test_a_fake_engine_is_flagged_at_the_nominal_rate_and_a_broken_one_is_caught(lossless_pair,
                                                                                  rule):
    """Issue 41, item 0: the exact rejection sampler (T = 0.8) is flagged at about the audit's
    level, an engine accepting with half the right probability is caught in every run, one
    skipping every other position's test is flagged as over-accepting (sampled: its recorded
    steps; greedy: the chains read off the output alone). The calibration over 20 seeds per row is
    experiments/audit_calibration.py's; here 12 correct runs, 4 halved and 6 skipping (the old
    all-position theory flagged every correct run)."""
    from tests.engines import speculation as sp

    draft, warp, prompts = getattr(sp, rule), Warp(temperature=0.8, top_k=0, top_p=1.0), [
        [1, 2, 3, 1], [2, 4, 1, 0], [3, 3, 1, 2], [0, 1, 2, 3], [4, 0, 4, 1], [1, 1, 0, 2]]

    def runs(accept, seeds):
        return [sp.audit_run(lossless_pair, prompts, 48, 3, warp, accept, s, draft)[0]
                for s in range(seeds)]

    right = runs(sp.exact, 12)
    assert sum(r.flagged for r in right) <= 1  # level 1e-3: 0.012 expected in 12 runs
    assert sum(r.test.p_under < 0.05 for r in right) <= 3  # level 0.05: 0.6 expected
    assert all(r.flag == "under-accepts" for r in runs(sp.half, 4))
    assert sum(r.flag == "over-accepts" for r in runs(sp.skips_odd, 6)) >= 4


def test_measured_counters_are_checked():
    with pytest.raises(ValueError, match="diffed"):
        Measured(10, 30, 31)


def _exact(vocab: int = 6) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {x1: torch.rand(vocab, generator=g).softmax(-1) for x1 in range(3)}


def _draw(exact, n: int, drop_top: bool, seed: int = 1) -> list[tuple[int, int]]:
    """Samples of (x1, x2); ``drop_top`` mimics an engine that never emits the draft token (the
    most likely one) at the speculated position: its residual drawn without the token."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        x1 = int(torch.randint(0, len(exact), (1,), generator=g))
        p = exact[x1].clone()
        if drop_top:
            p[p.argmax()] = 0.0
        pairs.append((x1, int(torch.multinomial(p, 1, generator=g))))
    return pairs


def test_lossless_check_passes_the_exact_distribution_and_catches_a_broken_one():
    exact = _exact()
    good = audit.speculated_position_test(_draw(exact, 1500, False), exact)
    assert good.groups == 3 and good.samples == 1500 and good.pvalue > 1e-3
    bad = audit.speculated_position_test(_draw(exact, 1500, True), exact)
    assert bad.pvalue < 1e-6


def test_pooled_chi_square_outside_support_is_infinite():
    stat, _ = audit.pooled_chi_square(__import__("collections").Counter({2: 5}),
                                      torch.tensor([0.5, 0.5, 0.0]))
    assert stat == float("inf")


def test_ngram_proposal_rule():
    # suffix [7, 8] occurred at 1: propose what followed it
    assert audit.ngram_propose([5, 7, 8, 9, 4, 3, 7, 8], 1, 3, k=3) == [9, 4, 3]
    # the longest match wins over a shorter, earlier one: [2, 3] at 3 beats [3] at 0
    assert audit.ngram_propose([3, 9, 1, 2, 3, 6, 2, 3], 1, 2, k=1) == [6]
    assert audit.ngram_propose([1, 2, 3], 1, 2, k=2) == []
    assert audit.ngram_propose([1, 2, 1], 1, 2, k=5) == [2, 1]  # the context ends


def test_chi_square_degrees_of_freedom_on_a_known_answer():
    """Issue 57, item 4: cells expecting 40, 30, 20, 10 of 100 tokens and seeing 35, 30, 25, 10
    give Pearson's 25/40 + 25/20 = 1.875 on 3 degrees of freedom, p = 0.59875 (scipy's
    chisquare); one group of the lossless test is that, two groups sum statistics and degrees
    of freedom. (A mutant adding one degree of freedom made every p-value too large.)"""
    from collections import Counter

    from scipy.stats import chi2, chisquare

    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    counts = Counter({0: 35, 1: 30, 2: 25, 3: 10})
    ref = chisquare([35, 30, 25, 10], [40, 30, 20, 10])
    assert audit.pooled_chi_square(counts, probs) == (pytest.approx(1.875), 3)
    assert ref.statistic == pytest.approx(1.875) and ref.pvalue == pytest.approx(0.59875, abs=1e-5)
    pairs = [(7, x) for x, c in counts.items() for _ in range(c)]
    one = audit.speculated_position_test(pairs, {7: probs})
    assert (one.dof, one.pvalue) == (3, pytest.approx(ref.pvalue, rel=1e-9))
    two = audit.speculated_position_test(pairs + [(8, x) for _, x in pairs], {7: probs, 8: probs})
    assert (two.dof, two.pvalue) == (6, pytest.approx(chi2.sf(2 * 1.875, 6), rel=1e-9))


def test_tied_greedy_shares_the_near_ties_of_the_top():
    """T = 0 against an engine in other numerics: tokens within the gap of the top logit are
    ties (uniform); gap 0 is the argmax (exact ties aside)."""
    logits = torch.tensor([[2.0, 1.8, 0.5], [1.0, 3.0, 2.95]])
    assert audit.tied_greedy(logits, 0.25).tolist() == [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]]
    assert audit.tied_greedy(logits, 0.0).tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]


def test_warped_along_at_t0_shares_the_ties_only_when_asked(lossless_pair):
    greedy, args = Warp(temperature=0.0, top_k=0, top_p=1.0), (lossless_pair.target, [1, 2], [3, 4])
    assert audit.warped_along(*args, greedy).max(-1).values.tolist() == [1.0, 1.0]
    wide = audit.warped_along(*args, greedy, tie_gap=1e6)  # every token within the gap
    assert wide.flatten().tolist() == pytest.approx([0.2] * 10)


def test_a_greedy_draft_in_other_numerics_is_read_with_its_ties():
    """Where the output's token is one of q~'s tied maxima the draft may have proposed it (a
    bf16 draft where the fp32 audit's argmax is the other): the proposal is the output's token,
    so the engine's accepted chain is read as accepted, not as a rejection."""
    q = audit.tied_greedy(torch.tensor([[0.0, 0.0, 0.0], [5.0, 4.9, 0.0], [0.0, 3.0, 0.0],
                                        [0.0, 0.0, 2.0]]), 0.25)
    out = [2, 1, 1, 2]  # position 1: token 1, tied with token 0 (the argmax)
    assert audit.greedy_proposer(q, 2)(1) == [0, 1]  # without the output: the first maximum
    assert audit.greedy_proposer(q, 2, out)(1) == [1, 1]
    chains = audit.point_mass_chains(q, out, audit.greedy_proposer(q, 2, out))
    assert [(c.start, c.accepted) for c in chains] == [(1, 2)]
