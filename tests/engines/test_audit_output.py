"""The audit's checks of an engine's output against its story (issue 57, item 1): contradictions,
the pooled output tests, the counters-only test; fake engines that lie or sample wrongly
(tests/engines/speculation.py) beside correct ones."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from mtad_energy.decoding.rules.sampling import Warp
from mtad_energy.engines import audit
from mtad_energy.engines import audit_output as ao
from tests.engines import speculation as sp

WARP = Warp(temperature=0.8, top_k=0, top_p=1.0)
PROMPTS = [[1, 2, 3, 1], [2, 4, 1, 0], [3, 3, 1, 2], [0, 1, 2, 3], [4, 0, 4, 1], [1, 1, 0, 2],
           [2, 2, 4, 3], [0, 3, 1, 4], [3, 0, 2, 2], [4, 4, 1, 3], [1, 3, 0, 0], [2, 0, 3, 4],
           [0, 0, 4, 2], [3, 4, 2, 1], [4, 2, 0, 1], [1, 4, 3, 0]]


def test_rank_chi_square_is_pearsons_on_identical_rows_with_its_degrees_of_freedom():
    """Rows all alike: the pooled statistic with the exact covariance is Pearson's, on cells - 1
    degrees of freedom (scipy's chisquare); a token a row cannot give is infinite."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    tokens = [0] * 35 + [1] * 30 + [2] * 25 + [3] * 10
    got = ao.rank_chi_square(probs.expand(100, 4), tokens)
    ref = chisquare([35, 30, 25, 10], [40, 30, 20, 10])
    assert (got.stat, got.dof) == (pytest.approx(ref.statistic), 3)
    assert got.pvalue == pytest.approx(ref.pvalue, rel=1e-6)  # float32 probabilities
    assert ao.rank_chi_square(torch.tensor([[0.5, 0.5, 0.0]] * 20), [2] + [0] * 19).pvalue == 0.0


def test_the_score_tails_are_the_exact_binomial_where_the_normal_is_ten_times_off():
    """40 tokens, each with probability 0.8 of being the one of probability 0.8: the summed
    probability is 8 + 0.6 B, B ~ Binomial(40, 0.8); the saddlepoint tails between lattice points
    are the binomial's within 10 % at 2e-5 and 8e-3 (the normal says 2.7e-6 for the first;
    the saddlepoint's first term alone is 13 % off)."""
    from scipy.stats import binom

    rows = torch.tensor([[0.8, 0.2]] * 40, dtype=torch.float64).numpy()
    lower, _ = ao.saddlepoint_tails(rows, 8 + 0.6 * 20.5)
    _, upper = ao.saddlepoint_tails(rows, 8 + 0.6 * 37.5)
    assert lower == pytest.approx(binom.cdf(20, 40, 0.8), rel=0.10)
    assert upper == pytest.approx(binom.sf(37, 40, 0.8), rel=0.10)
    # at an end of the support, exact: both tokens the least likely one
    assert ao.saddlepoint_tails(torch.tensor([[0.5, 0.3, 0.2]] * 2).numpy(), 0.4) == \
        (pytest.approx(0.04), 1.0)


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(n, 6, generator=g)).softmax(-1)


def _draw(rows: torch.Tensor, seed: int) -> list[int]:
    return torch.multinomial(rows, 1, generator=torch.Generator().manual_seed(seed))[:, 0].tolist()


def test_pooled_output_tests_hold_their_level_and_catch_a_wrong_role():
    """Tokens drawn from rows that all differ: both pooled tests' p-values spread over (0, 1) (no
    more false alarms at 0.05 than its level allows). 5 % of 1,000 tokens, one role's, drawn from
    the previous row instead: caught at 1e-3 (Bonferroni over the four tests: every token and
    the role's, each by rank and by score) in 9 of 10 samples."""
    rows = _rows(1000, 0)
    ps = [[t(rows, _draw(rows, s)).pvalue for t in (ao.rank_chi_square, ao.score_test)]
          for s in range(100)]
    for col in zip(*ps, strict=True):
        assert sum(p < 0.05 for p in col) <= 12 and 0.35 < sum(col) / len(col) < 0.65
    caught, role = 0, torch.arange(1, 1000, 20)
    for s in range(10):
        wrong = rows.clone()
        wrong[role] = rows[role - 1]  # a role's token drawn from the previous row
        tokens = _draw(wrong, s)
        out = ao.OutputTests({"every token": ao.rank_chi_square(rows, tokens),
                              "every token score": ao.score_test(rows, tokens),
                              "role": ao.rank_chi_square(rows[role], [tokens[i] for i in role]),
                              "role score": ao.score_test(rows[role], [tokens[i] for i in role])})
        caught += out.pvalue < 1e-3
    assert caught >= 9


def test_output_tests_combine_by_bonferroni():
    tests = {"a": audit.LosslessResult(1, 10, 6.0, 1), "b": audit.LosslessResult(1, 10, 1.0, 2),
             "none": audit.LosslessResult(0, 0, 0.0, 0)}
    out = ao.OutputTests(tests)
    assert out.made == 2 and out.pvalue == pytest.approx(2 * tests["a"].pvalue)


def test_step_roles_tile_the_output_and_name_what_does_not():
    roles, problems = ao.step_roles([(3, 1), (3, 3), (0, 0), (3, 0)], 9)
    T, A, R, B = ao.TARGET, ao.ACCEPTED, ao.RESAMPLED, ao.BONUS
    assert roles == [T, A, R, A, A, A, B, T, R] and problems == []
    assert ao.step_roles([(3, 3)], 3)[1] == []  # the last step cut at the token limit
    assert "emit 3 tokens, the output has 5" in ao.step_roles([(3, 1)], 5)[1][0]
    assert "past the output" in ao.step_roles([(3, 0), (3, 0), (3, 0)], 3)[1][0]
    assert "accepts 4 of 3" in ao.step_roles([(3, 4)], 9)[1][0]


def test_a_token_the_story_cannot_give_is_a_contradiction():
    """After a rejection the residual cannot give a token with p~ < q~ (the rejected draft token
    is one); an accepted draft token the engine reports must be the emitted one."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.6, 0.2], [0.3, 0.3, 0.4]])
    ok = ao.Served((0, 0, 2), p, q, ((2, 1),), drafts=((0, 1),))
    roles = ao.step_roles(ok.steps, 3)[0]
    assert roles == [ao.TARGET, ao.ACCEPTED, ao.RESAMPLED]
    assert ao.token_contradictions(ok, roles) == []
    lie = ao.Served((0, 0, 1), p, q, ((2, 1),), drafts=((0, 1),))  # emitted its rejected draft
    problems = ao.token_contradictions(lie, roles)
    assert len(problems) == 2 and "residual cannot give" in problems[0]
    assert "rejected, output has 1" in problems[1]
    assert "accepted, output has 0" in ao.token_contradictions(
        ao.Served((0, 0, 2), p, q, ((2, 1),), drafts=((2, 1),)), roles)[0]


def _run(seed: int, **kw) -> ao.Verdict:
    from tests import tiny

    return sp.served_run(tiny.lossless_pair(), PROMPTS[:6], 48, 3, WARP, kw.pop("accept", sp.exact),
                         seed, kw.pop("rule", sp.SAMPLED), **kw)


@pytest.mark.parametrize("rule", ["SAMPLED", "GREEDY"])
def test_an_engine_that_emits_its_drafts_and_reports_theory_is_flagged_as_contradicting(rule):
    """Issue 57, item 1 (a): the liar accepts by the exact test and reports it, but emits the
    rejected draft token: its steps contradict its output in every run; the correct engine's
    never do, and it is not flagged."""
    for seed in range(3):
        right = _run(seed, rule=getattr(sp, rule))
        assert right.contradictions == () and not right.flagged, right.flags
        liar = _run(seed, rule=getattr(sp, rule), lies=True)
        assert liar.flag == ao.CONTRADICTS and liar.contradictions


def test_an_engine_reporting_its_draft_tokens_is_held_to_them():
    liar = _run(0, lies=True, drafts_reported=True)
    assert any("rejected, output has" in c for c in liar.contradictions)
    assert _run(0, drafts_reported=True).contradictions == ()


@pytest.mark.parametrize("how", [{"rule": sp.SAMPLED}, {"rule": sp.GREEDY},
                                 {"rule": sp.SAMPLED, "steps_recorded": False}])
def test_counters_that_contradict_the_output_are_reported_whichever_test_decides(how):
    """(d): honest steps and output, counters one accepted token higher per rejecting chain: a
    sampled draft (its steps decide), a greedy one (its output decides) and counters alone."""
    v = _run(1, inflates=True, **how)
    assert ao.CONTRADICTS in v.flags and "counters" in v.contradictions[0]
    assert ao.CONTRADICTS not in _run(1, **how).flags


def test_the_counters_only_test_takes_its_theory_where_the_engine_drafted():
    """(c): no steps recorded: the accepted tokens against their distribution given the output
    are not flagged for a correct engine (p-values spread), are for one accepting half as often;
    the old every-position chains refuse instead of flagging it."""
    from tests import tiny

    runs = [_run(s, steps_recorded=False) for s in range(4)]
    assert not any(r.flagged for r in runs)
    assert all(r.counters.p_under > 1e-3 and r.counters.p_over > 1e-3 for r in runs)
    half = _run(0, accept=sp.half, steps_recorded=False)
    assert half.counters.p_under < 1e-6 and "under-accepts" in half.flags
    pair = tiny.lossless_pair()
    out, steps, _ = sp.speculate(pair.target, pair.draft, PROMPTS[0], 48, 3, WARP, sp.exact,
                                 torch.Generator().manual_seed(0))
    p, q = (audit.warped_along(m, PROMPTS[0], out, WARP) for m in (pair.target, pair.draft))
    row = audit.audit_row("every position", audit.every_position_chains(audit.alpha_dists(p, q), 3),
                          sp.counters(steps, 3), 3)
    assert row.refused and row.flag is None


def test_given_its_token_a_draft_position_was_accepted_with_min_over_p():
    """A lossless engine's token x at a draft position was an accepted draft with probability
    min(p~, q~)(x) / p~(x) (the accepted draft's share of p~(x); the rest is the residual's)."""
    p, q = torch.tensor([[0.5, 0.5]] * 2), torch.tensor([[0.9, 0.1]] * 2)
    assert ao.accept_given_token(p, q, [1, 0]).tolist() == pytest.approx([0.2, 1.0])


def test_accepted_distribution_is_the_chain_walk_enumerated():
    """Given the output, every walk of accept / reject over its draft positions (k = 2), weighted
    by its probability: the same pmf of the accepted tokens shown and of those plus what a cut
    chain hides."""
    acc, k = [0.0, 0.7, 0.2, 0.9, 0.5], 2
    shown, most = ao.accepted_distribution(acc, k)
    want_shown, want_most = [0.0] * 6, [0.0] * 8
    for outcome in itertools.product([True, False], repeat=4):
        w, depth, n = 1.0, 0, 0
        for t, ok in zip(range(1, 5), outcome, strict=True):
            if depth == k:  # a bonus position: no test
                w, depth = w * (ok is True), 0  # count each walk once
                continue
            w *= acc[t] if ok else 1 - acc[t]
            depth, n = (depth + 1, n + 1) if ok else (0, n)
        want_shown[n] += w
        want_most[n + (k - depth if 0 < depth < k else 0)] += w
    assert shown.tolist() == pytest.approx(want_shown)
    assert most.tolist() == pytest.approx(want_most)


def test_bonus_weights_follow_the_chain_walk():
    """P(position t is a bonus token | the output before it): every draft accepted (k = 3): the
    bonus after each 3 drafted positions; none accepted: never; half: 1/8 after three draft
    positions, from position 4 on."""
    assert ao.bonus_weights([1.0] * 10, 3).tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    assert ao.bonus_weights([0.0] * 6, 3).tolist() == [0] * 6
    assert ao.bonus_weights([0.5] * 6, 3).tolist()[:5] == pytest.approx([0, 0, 0, 0, 0.125])


def test_the_token_total_without_per_position_counters_is_tested_against_every_depth():
    """(c): without per-position counters the token total goes against the chains' exact
    distribution, not alpha_1: a correct engine is not flagged (it was, every time)."""
    chains = [audit.Chain(t, (0.6, 0.5, 0.4)) for t in range(100)]
    mean = 100 * (0.6 + 0.6 * 0.5 + 0.6 * 0.5 * 0.4)  # 102 accepted of 300 drafted
    row = audit.audit_row("rate", chains, audit.Measured(100, 300, round(mean)), 3)
    assert not row.flagged and 0.3 < row.pvalue_counters < 0.7
    assert audit.audit_row("low", chains, audit.Measured(100, 300, 60), 3).flag == "under-accepts"


@pytest.mark.slow  # 6 runs of 16 prompts x 64 tokens (~15 s)
def test_broken_samplers_are_caught_at_the_default_sample_size(lossless_pair):
    """(b): 16 prompts x 64 tokens: a bonus token drawn from the previous position's p~ (about
    7 % of the positions) and resampling from p~ instead of the residual are flagged lossy."""
    for seed in range(2):
        kw = dict(pair=lossless_pair, prompts=PROMPTS, n_tokens=64, k=3, warp=WARP,
                  accept=sp.exact, seed=seed)
        assert not sp.served_run(**kw).flagged
        assert "lossy" in sp.served_run(**kw, after=sp.bonus_from_previous).flags
        assert "lossy" in sp.served_run(**kw, after=sp.resample_from_p).flags


def test_floor_pvalue_is_the_least_likely_outcome():
    """The smallest p-value a weighted test can give: every token at the end of its values. Two
    rows (0.5, 0.3, 0.2) scored by their own probability: both at 0.5 has probability 0.25, both
    at 0.2 0.04; two-sided twice the likelier end, 0.08; the upper tail alone 0.25."""
    rows = torch.tensor([[0.5, 0.3, 0.2]] * 2, dtype=torch.float64)
    assert ao.floor_pvalue(rows, rows) == pytest.approx(0.08)
    assert ao.floor_pvalue(rows, rows, upper_only=True) == pytest.approx(0.25)
    assert ao.weighted_test(rows, rows, torch.tensor([2, 2])).pvalue == pytest.approx(0.08)


def _bonus_sample(rows: torch.Tensor, w: torch.Tensor, seed: int, wrong: bool) -> torch.Tensor:
    """Tokens x_t (t >= 1) from rows[t], each a bonus token with chance w_t; ``wrong``: a bonus
    token drawn from rows[t - 1] instead (the off-by-one)."""
    g = torch.Generator().manual_seed(100 + seed)
    bonus = torch.rand(len(w), generator=g, dtype=torch.float64) < w
    src = torch.where((bonus & wrong)[:, None], rows[:-1], rows[1:])
    return torch.multinomial(src, 1, generator=g)[:, 0]


def test_the_neighbour_test_holds_its_level_and_sees_a_bonus_from_the_previous_row():
    """Bonus positions known only by chance (w_t, mean 0.1, as a sampled draft's counters-only
    audit has them), rows as far apart as the tiny pair's: the previous-row log-likelihood ratio
    weighted by w is calibrated for correct draws (its p-values spread over (0, 1)) and catches
    1,000 tokens whose bonus tokens come from the previous row at 1e-3 in 9 of 10 samples or
    more."""
    rows = torch.randn(1001, 6, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64).softmax(-1)
    w = torch.rand(1000, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.2
    p, prev = rows[1:], rows[:-1]
    right = [ao.neighbour_test(p, prev, w, _bonus_sample(rows, w, s, False)).pvalue
             for s in range(60)]
    assert sum(x < 0.05 for x in right) <= 8 and 0.35 < sum(right) / len(right) < 0.65
    wrong = [_bonus_sample(rows, w, s, True) for s in range(10)]
    assert sum(ao.neighbour_test(p, prev, w, x).pvalue < 1e-3 for x in wrong) >= 9


def _role_served(steps: list[tuple[int, int]], seed: int) -> ao.Served:
    """A request whose tokens follow the roles its steps give (random p~, q~ over 6 tokens)."""
    n = 1 + sum(a + 1 for _, a in steps)
    p, q = _rows(n, seed), _rows(n, seed + 1)
    refs = ao.role_refs(p, q, ao.step_roles(steps, n)[0])
    return ao.Served(tuple(_draw(refs, seed)), p, q, tuple(steps))


def test_the_output_tests_say_what_they_could_not_test():
    """A role with no token, or too few for any test of it to reach the level after the
    correction, or under FEW_TOKENS, is named in ``untested``; the roles not known (no steps
    recorded) are too; enough of every role: nothing is."""
    many = _role_served([(3, 3), (3, 0), (3, 1)] * 20, 0)  # 20 bonus, 40 rejections, 80 accepted
    assert ao.output_tests([many]).untested == ()
    none = ao.output_tests([_role_served([(3, 0), (3, 1)] * 20, 0)]).untested
    assert none == ("bonus tokens: none in the output",)
    one = ao.output_tests([_role_served([(3, 3)] + [(3, 0), (3, 1)] * 20, 0)]).untested
    assert len(one) == 1 and "bonus tokens: 1 in the output, too few for any test" in one[0]
    few = ao.output_tests([_role_served([(3, 3), (3, 0), (3, 1)] * 12, 0)]).untested
    assert len(few) == 1 and "bonus tokens: 12 in the output, too few for their tests" in few[0]
    blind = ao.output_tests([ao.Served(many.output, many.p, many.q)], k=3).untested
    assert len(blind) == 1 and "steps not recorded" in blind[0]


def test_a_greedy_drafts_rare_bonus_tokens_are_said_untested_not_passed():
    """Issue 57, item 1: with a greedy draft on this pair a full chain is rare (0-4 bonus tokens
    in 1,024 positions): the verdict is not flagged, and says the bonus tokens were not tested."""
    v = _run(1, rule=sp.GREEDY)
    assert not v.flagged and any(u.startswith("bonus tokens:") for u in v.untested)
    assert v.as_dict()["untested"] == list(v.untested)


@pytest.mark.slow  # 4 runs of 16 prompts x 64 tokens (~25 s)
def test_a_bonus_from_the_previous_row_is_caught_without_the_steps(lossless_pair):
    """(b), counters alone: the engine's steps not recorded, so the bonus tokens' positions are
    known only by chance; 16 prompts x 64 tokens: the bonus from the previous position's p~
    is flagged lossy, the exact engine is not."""
    for seed in range(2):
        kw = dict(pair=lossless_pair, prompts=PROMPTS, n_tokens=64, k=3, warp=WARP,
                  accept=sp.exact, seed=seed, steps_recorded=False)
        assert not sp.served_run(**kw).flagged
        assert "lossy" in sp.served_run(**kw, after=sp.bonus_from_previous).flags


def test_a_greedy_engine_is_held_to_its_maxima_not_to_statistics():
    """T = 0 (``greedy``): the tokens are deterministic given the engine's numerics, so no
    statistical test may flag, the verdict says so in ``untested``, and a token that is not
    one of the greedy maxima (`audit.tied_greedy`) is a contradiction (alone: no `lossy`)."""
    p = audit.tied_greedy(torch.randn(40, 6, generator=torch.Generator().manual_seed(0)), 0.3)
    out, none = p.argmax(-1).tolist(), audit.Measured(0, 0, 0)
    right = ao.audit_served("t0", [ao.Served(tuple(out), p, p)], none, 3, always_drafts=False,
                            greedy=True)
    assert right.flags == () and right.untested[0].startswith("acceptance and the output's")
    out[5] = int(p[5].argmin())  # not a maximum
    wrong = ao.audit_served("t0", [ao.Served(tuple(out), p, p)], none, 3, always_drafts=False,
                            greedy=True)
    assert wrong.flags == (ao.CONTRADICTS,)
    assert wrong.contradictions == (f"position 5: token {out[5]} at T = 0, not a greedy maximum",)
