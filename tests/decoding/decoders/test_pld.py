"""Prompt lookup decoding (`pld`): the n-gram lookup, greedy-exactness, losslessness (chi-square,
with a broken variant rejected), per-row batching and its statistics.

Batched = batch 1 and compiled = eager for pld run in the registry-wide tests of test_batch.py,
test_compile.py and test_compile_batch.py; `test_those_tests_see_drafts_accepted_and_rejected`
checks that their prompts make pld draft, keep and reject."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest

import mtad_energy as me
from mtad_energy.decoding.decoders.pld import ngram_draft
from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.rules import chain
from mtad_energy.decoding.rules.sampling import Warp
from mtad_energy.decoding.runtime.generate import generate_ids, generate_rows
from tests.decoding.lossless import batched_row_pvalues, chi_square_pvalue, exact_joint

PROMPT = [5, 9, 11, 3, 7, 21, 2]  # the batch / compile tests' first prompt
ROWS = [[5, 9, 11, 3, 7, 21, 2], [4, 8], [30, 31, 32, 33, 34]]


@pytest.mark.parametrize(("tokens", "limit", "draft"), [
    ([1, 2, 3, 4, 1, 2], 10, [3, 4, 1, 2]),  # longest n first (n = 2: "1 2"), runs to the end
    ([1, 2, 9, 1, 2, 3, 7, 2], 2, [3, 7]),  # n = 1 ("2"): the most recent of two occurrences
    ([7, 1, 2, 8, 1, 2, 9, 1, 2], 1, [9]),  # n = 2: the latest occurrence, not the first
    ([5, 5, 5], 10, [5]),  # an occurrence overlapping the suffix continues into it
    ([1, 2, 3], 4, []),  # no earlier occurrence
    ([4], 4, []),  # nothing before the last token
    ([1, 2, 1, 2], 0, []),  # nothing left to draft
])
def test_ngram_draft_takes_the_latest_occurrence_of_the_longest_suffix(tokens, limit, draft):
    assert ngram_draft(tokens, 3, 1, limit) == draft


def test_ngram_draft_respects_the_ngram_bounds():
    tokens = [1, 2, 3, 9, 3]  # only the 1-gram "3" occurs earlier
    assert ngram_draft(tokens, 3, 1, 5) == [9, 3]
    assert ngram_draft(tokens, 3, 2, 5) == []
    tokens = [6, 1, 2, 3, 8, 5, 2, 3, 7, 1, 2, 3]  # "1 2 3" at 1, "2 3" later at 6
    assert ngram_draft(tokens, 3, 1, 2) == [8, 5]
    assert ngram_draft(tokens, 2, 1, 2) == [7, 1]


@pytest.mark.parametrize("pair", ["llama_pair", "opt_pair"])
def test_greedy_pld_is_greedy_ar_token_for_token(request, pair):
    pair = request.getfixturevalue(pair)
    ref = me.generate("ar", pair, PROMPT, max_new_tokens=40, temperature=0).token_ids
    gen = me.generate("pld", pair, PROMPT, max_new_tokens=40, temperature=0)
    assert gen.token_ids == ref
    assert gen.stats.draft_proposed > 0  # it drafted (a tiny model's greedy output repeats)


def test_those_tests_see_drafts_accepted_and_rejected(llama_pair):
    gen = generate_ids(get_decoder("pld", temperature=0), llama_pair, PROMPT, 24,
                       compute_perplexity=False)
    kept = [(s.accepted, s.draft_depth) for s in gen.steps]
    assert any(d and a == d for a, d in kept)  # a whole draft accepted
    assert any(d and a < d for a, d in kept)  # a draft cut short
    assert any(d == 0 for _, d in kept)  # an iteration without an occurrence: one target step


def test_the_statistics_contract(llama_pair):
    """proposed = draft_depth = the row's draft length (0 without an occurrence), no draft
    forwards and no draft time; every emitted block is the kept draft plus one token from p;
    acceptance is over the drafting iterations only."""
    rows = generate_rows(get_decoder("pld"), llama_pair, ROWS, 30, seed=2)
    for row in rows:
        s = row.stats
        assert s.draft_forwards == 0 and s.time_draft_s == 0.0
        assert s.target_forwards == s.iterations == len(row.steps)
        for st in row.steps:
            assert st.proposed == st.draft_depth <= 10
            assert st.accepted <= st.draft_depth and st.emitted == st.accepted + 1
        drafting = [st for st in row.steps if st.draft_depth]
        assert drafting and s.draft_depth == sum(st.draft_depth for st in row.steps)
        assert s.acceptance_rate == pytest.approx(s.draft_accepted / s.draft_depth)
        assert s.mean_accepted_length == pytest.approx(s.draft_accepted / len(drafting))
        assert s.block_efficiency == pytest.approx(s.tokens_emitted / s.target_forwards)


def test_a_row_never_drafts_past_its_end(llama_pair):
    """max_new_tokens 3: a row drafts at most what it can still emit, less the token from p."""
    rows = generate_rows(get_decoder("pld", temperature=0), llama_pair, [[3, 4, 3, 4, 3]] * 2, 3)
    for row in rows:
        assert len(row.token_ids) == 3
        assert row.steps[0].draft_depth == 2  # "3 4 3" is continued, capped at 3 - 1


# -- lossless under sampling (q one-hot at the draft tokens) ---------------------------------
REPEATS = [0, 1, 2, 1, 0]  # drafts "1 2 1" first, and p(1) = 0.58 there: often kept, often not


@pytest.fixture(scope="module")
def exact2(lossless_pair):
    return exact_joint(lossless_pair, Warp(), REPEATS, n_tokens=2)


def _counts(pair, n: int) -> tuple[Counter, int]:
    """Two-token outputs of n seeds, and how many generations drafted in their first
    iteration."""
    counts: Counter = Counter()
    drafted = 0
    for seed in range(n):
        g = generate_ids(get_decoder("pld", gamma=3), pair, REPEATS, 2, seed=seed,
                         compute_perplexity=False)
        counts[tuple(g.token_ids)] += 1
        drafted += g.steps[0].draft_depth > 0
    return counts, drafted


def test_pld_is_lossless(lossless_pair, exact2):
    counts, drafted = _counts(lossless_pair, 600)
    assert drafted == 600  # the test is about drafts, not about plain target steps
    assert chi_square_pvalue(counts, exact2) > 1e-3


def test_pld_with_residual_replaced_by_p_is_rejected(lossless_pair, exact2):
    with mock.patch.object(chain, "residual", lambda p, q: p):
        counts, _ = _counts(lossless_pair, 300)
    assert chi_square_pvalue(counts, exact2) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["lossless", "residual-broken"])
def test_batched_pld_is_lossless_per_row(lossless_pair, broken):
    """Rows of different lengths that draft different lengths in one verify: each row's 3-token
    continuations follow its own warped p; with the residual replaced by p they do not."""
    pvalues = batched_row_pvalues(lossless_pair, get_decoder("pld", gamma=3), chain, broken)
    if broken:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3, pvalues
