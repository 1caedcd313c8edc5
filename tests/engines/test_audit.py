"""The speculative-decoding audit: acceptance theory with known answers, the under-acceptance flag,
the lossless check and the n-gram proposal rule (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from mtad_energy.decoding.sampling import Warp
from mtad_energy.engines import audit
from mtad_energy.engines.audit import Measured, Theory


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
    th = audit.theory_from_chains([torch.tensor([1.0, 0.5]), torch.tensor([0.5])], k=2)
    assert th.depth == pytest.approx((0.75, 0.25)) and th.mean_draft_tokens == 1.5
    assert th.accept_rate == pytest.approx(1.0 / 1.5)


def test_teacher_forced_alpha_on_a_tiny_pair(lossless_pair):
    """The model as its own draft: alpha 1 at every position, under any warp; a different draft:
    alpha equals sum min(p, q) computed by hand from the two models' logits."""
    pair = lossless_pair
    warp = Warp(temperature=0.8, top_k=0, top_p=1.0)
    prompt, out = [1, 2], [3, 0, 4, 1, 2, 2]
    p = audit.warped_along(pair.target, prompt, out, warp)
    q_self = audit.warped_along(pair.target, prompt, out, warp)
    chains = audit.draft_model_chains(p, q_self, k=3)
    assert len(chains) == len(out) - 3 and all(c.tolist() == pytest.approx([1.0] * 3) for c in chains)
    q = audit.warped_along(pair.draft, prompt, out, warp)
    ids = torch.tensor([prompt + out])
    with torch.inference_mode():
        lp = (pair.target(input_ids=ids).logits[0, 1:-1] / 0.8).softmax(-1)
        lq = (pair.draft(input_ids=ids).logits[0, 1:-1] / 0.8).softmax(-1)
    hand = torch.minimum(lp, lq).sum(-1)
    assert audit.alpha_dists(p, q).tolist() == pytest.approx(hand.tolist(), abs=1e-5)
    assert 0.0 < float(hand.min()) and float(hand.max()) < 1.0
    # a greedy draft (argmax q, verified as a point mass): alpha = p~(argmax q~), below 1 even for q = p
    greedy = audit.draft_model_chains(p, q_self, k=1, greedy_draft=True)
    assert [c.item() for c in greedy] == pytest.approx(lp.max(-1).values[1:].tolist(), abs=1e-5)
    assert max(c.item() for c in greedy) < 1.0


def test_ngram_chains_are_the_target_on_each_proposal(lossless_pair):
    """The cached chains equal p~(d_i | context, d_<i) from a full forward over each context and
    proposal, where the proposal follows the output and where it leaves it."""
    target, warp = lossless_pair.target, Warp(temperature=0.8, top_k=0, top_p=1.0)
    prompt, out = [1, 2, 3, 1, 2, 4], [1, 2, 3, 0, 1, 2]
    chains = audit.ngram_chains(target, prompt, out, warp, k=3, min_n=1, max_n=2)
    expected, follows = [], set()
    for t in range(1, len(out)):
        ctx = prompt + out[:t]
        d = audit.ngram_propose(ctx, 1, 2, 3)
        if d:
            p = audit.warped_along(target, ctx, d, warp)
            expected.append(p[torch.arange(len(d)), torch.tensor(d)])
            follows.add(d[:-1] == out[t:t + len(d) - 1])
    assert len(chains) == len(expected) >= 3 and follows == {True, False}  # both paths
    for c, e in zip(chains, expected, strict=True):
        assert c.tolist() == pytest.approx(e.tolist(), abs=1e-5)


def _matching(theory: Theory, drafts: int, seed: int = 0) -> Measured:
    """Counters an engine meeting theory would report: each chain accepted to depth j with
    theory.depth[j] (drawn as a chain: depth j+1 only after depth j)."""
    g = torch.Generator().manual_seed(seed)
    depth = torch.tensor(theory.depth)
    cond = torch.cat([depth[:1], depth[1:] / depth[:-1].clamp_min(1e-12)])
    acc = (torch.rand((drafts, len(depth)), generator=g) < cond).long().cumprod(-1)  # [drafts, k]
    per_pos = tuple(acc.sum(0).tolist())
    return Measured(drafts, drafts * len(depth), sum(per_pos), per_pos)


def test_flag_under_accepting_engine_and_not_a_matching_one():
    theory = audit.theory_from_chains([torch.tensor([0.9, 0.8, 0.7])] * 50, k=3)
    ok = audit.audit_row("matching", theory, _matching(theory, 500))
    assert not ok.flagged and ok.pvalue > 1e-3
    lo, hi = ok.first_pos_ci
    assert lo <= 0.9 <= hi
    low = audit.audit_row("under", theory, Measured(500, 1500, 30, (20, 7, 3)))
    assert low.flagged and low.pvalue < 1e-10
    # q = p (theory 1): a single rejection is already impossible under theory
    ones = audit.theory_from_chains([torch.ones(3)] * 10, k=3)
    assert audit.audit_row("self", ones, Measured(491, 1473, 13, (9, 3, 1))).flagged
    assert not audit.audit_row("self", ones, Measured(10, 30, 30, (10, 10, 10))).flagged
    # without per-position counters the token rate is tested
    assert audit.audit_row("tokens", theory, Measured(500, 1500, 30)).flagged


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
