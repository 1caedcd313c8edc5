import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mtad_energy.decoding.rules.sampling import (
    Warp,
    gumbel_topk,
    on_vocab,
    residual,
    sample,
    warp_probs,
    warp_support,
)


def test_top_p_drops_a_token_once_the_mass_before_it_exceeds_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # mass before each token: 0, .5, .8, .95 -> with p=0.81 the third token stays, the fourth goes
    out = warp_probs(probs.log(), temperature=1.0, top_k=0, top_p=0.81)
    assert torch.allclose(out, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    out = warp_probs(probs.log(), temperature=1.0, top_k=0, top_p=0.79)
    assert torch.allclose(out, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)


def test_top_token_always_kept_even_when_it_alone_exceeds_p():
    out = warp_probs(torch.tensor([0.95, 0.04, 0.01]).log(), top_k=0, top_p=0.1)
    assert out.tolist() == [1.0, 0.0, 0.0]


def test_top_k_then_top_p_as_in_the_paper():
    probs = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    out = warp_probs(probs.log(), temperature=1.0, top_k=3, top_p=0.6)
    # top-3 renormalised: .4, .333, .267; mass before: 0, .4, .733 -> the third is dropped
    assert torch.allclose(out, torch.tensor([0.3, 0.25, 0, 0, 0]) / 0.55)


def test_temperature_scales_logits_and_zero_is_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    out = warp_probs(logits, temperature=2.0, top_k=0, top_p=1.0)
    assert torch.allclose(out, (logits / 2).softmax(-1))
    assert warp_probs(logits, temperature=0).tolist() == [[1, 0, 0], [0, 1, 0]]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=30), st.integers(0, 12),
       st.floats(0.05, 1.0), st.floats(0.3, 2.0))
# a denormal logit that the temperature rounds to 0 ties with the logit 0 at the cut (found by
# hypothesis under transformers 5.17's CI step): ties are counted on what the warp ranks
@example(logits=[0.0, 1.0, 1.0, 1.401298464324817e-45], k=3, p=1.0, t=2.0)
def test_warp_is_a_distribution_on_a_subset_of_the_top_k(logits, k, p, t):
    logits = torch.tensor(logits)
    out = warp_probs(logits, t, k, p)
    assert math.isclose(out.sum().item(), 1.0, rel_tol=1e-5)
    assert out[logits == logits.max()].sum() > 0  # a most likely token (ties: any) is kept
    if 0 < k < len(logits):
        ranked = logits.float() / t  # the warp's top-k ranks the scaled logits
        assert (out > 0).sum() <= k + (ranked == ranked.topk(k).values[-1]).sum() - 1


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_k": -2}, "top_k must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
])
def test_bad_warp_parameters_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        Warp(**kwargs)


def test_residual_is_normalised_positive_part_and_falls_back_to_p():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual(p, p), p)


def test_gumbel_topk_samples_without_replacement_in_proportion():
    w = torch.tensor([0.5, 0.3, 0.2])
    g = torch.Generator().manual_seed(0)
    n = 20000
    pairs = torch.stack([gumbel_topk(w.log(), 2, g) for _ in range(n)])
    assert (pairs[:, 0] != pairs[:, 1]).all()
    first = torch.bincount(pairs[:, 0], minlength=3) / n
    assert torch.allclose(first, w, atol=0.015)
    # P(set {0,1}) = .5*.3/.5 + .3*.5/.7 for sequential sampling without replacement
    sets = (pairs.sort(1).values == torch.tensor([0, 1])).all(1).float().mean()
    assert abs(sets.item() - (0.5 * 0.3 / 0.5 + 0.3 * 0.5 / 0.7)) < 0.015
    det = gumbel_topk(w.log(), 2, stochastic=False)
    assert det.tolist() == [0, 1]


def test_sample_follows_probs():
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.1, 0.0, 0.9])
    draws = torch.stack([sample(probs, g) for _ in range(4000)])
    assert (draws != 1).all()
    assert abs((draws == 2).float().mean().item() - 0.9) < 0.02


def test_top_p_keeps_the_top_logit_when_float32_probabilities_tie():
    # found by hypothesis: the two probabilities are equal in float32, the logits are not
    logits = torch.tensor([0.0, 2.275717378754497e-13], dtype=torch.float64)
    assert warp_probs(logits, 1.0, 0, 0.25).tolist() == [0.0, 1.0]


def _reference_warp(logits, top_k, top_p):
    """Top-k mask (ties at the cut kept), softmax, then the nucleus by a full sort."""
    kth = logits.topk(top_k, -1).values[..., -1:]
    masked = logits.masked_fill(logits < kth, float("-inf"))
    probs = masked.softmax(-1)
    order = masked.argsort(-1, descending=True)
    sorted_p = probs.gather(-1, order)
    drop_sorted = sorted_p.cumsum(-1) - sorted_p > top_p
    probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("ties", [False, True])
def test_top_k_warp_matches_a_full_sort_with_and_without_ties_at_the_cut(ties):
    """The top-k paths (all work within the k candidates when nothing ties with the k-th
    logit; the O(V + k^2) nucleus otherwise) give the full-sort warp. Which of several tied
    tokens the nucleus keeps is arbitrary, so the sorted distributions are compared."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(400):
        vocab = int(torch.randint(3, 40, (), generator=gen))
        logits = (torch.randint(-3, 3, (3, vocab), generator=gen).float() if ties
                  else torch.randn(3, vocab, generator=gen))
        top_k = int(torch.randint(1, vocab, (), generator=gen))
        top_p = float(torch.rand((), generator=gen)) * 0.99 + 0.005
        got = warp_probs(logits, 1.0, top_k, top_p)
        want = _reference_warp(logits, top_k, top_p)
        torch.testing.assert_close(got.sort(-1).values, want.sort(-1).values, atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_support_shortcut_equals_the_full_warp_with_a_nucleus(temperature, top_p):
    """The top-k support shortcut (`warp_support`: the warp computed on the k candidates alone,
    and `warp_probs`' own top-k path) is the full-sort warp of the scaled logits, nucleus
    included: top_p < 1 drops candidates there too. Distinct logits, so the shortcut is taken
    and the kept set is unique."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 40, generator=gen) * 2  # [R, V]
    top_k = 12
    want = _reference_warp(logits / temperature, top_k, top_p)
    tokens, probs = warp_support(logits, temperature, top_k, top_p)
    assert tokens is not None and tokens.shape == (64, top_k)  # premise: the shortcut ran
    torch.testing.assert_close(on_vocab(tokens, probs, 40), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(warp_probs(logits, temperature, top_k, top_p), want, atol=1e-6,
                               rtol=0)
    assert ((want > 0).sum(-1) < top_k).any()  # premise: the nucleus cut inside the k
