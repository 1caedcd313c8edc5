"""Typical acceptance: the threshold min(eps, delta * exp(-H(p))) on hand-built tables, greedy
equivalence with ar, and the decoder's behaviour."""

from __future__ import annotations

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.rules.chain import typical_accept_length
from mtad_energy.models import ModelPair

PROMPT = [5, 9, 12, 3]



def accepted(rows: list[list[float]], draft: list[int], eps=0.09, delta=0.3) -> int:
    return int(typical_accept_length(torch.tensor(rows), torch.tensor(draft), eps, delta))


PEAKED = [0.9, 0.05, 0.05]  # H = 0.394: delta * exp(-H) = 0.202, so eps = 0.09 binds
FLAT = [0.05] * 20  # H = log 20: delta * exp(-H) = 0.015 binds


def test_eps_binds_on_a_peaked_distribution():
    assert accepted([PEAKED], [0]) == 1
    assert accepted([PEAKED], [1]) == 0  # 0.05 < 0.09


def test_entropy_term_binds_on_a_flat_distribution():
    """0.05 is below eps = 0.09, yet above 0.3 / 20: accepted because p is uncertain."""
    assert accepted([FLAT], [7]) == 1
    assert accepted([FLAT], [7], delta=2.0) == 0  # threshold min(0.09, 0.1) = 0.09


def test_threshold_is_strict():
    uniform4 = [0.25] * 4
    assert accepted([uniform4], [2], eps=0.25, delta=10.0) == 0  # p == min(0.25, 2.5)
    assert accepted([uniform4], [2], eps=0.24, delta=10.0) == 1


def test_one_hot_accepts_only_its_token():
    assert accepted([[0.0, 1.0, 0.0]], [1]) == 1  # H = 0, no NaN from 0 log 0
    assert accepted([[0.0, 1.0, 0.0]], [0]) == 0


def test_longest_accepted_prefix_stops_at_the_first_failure():
    assert accepted([PEAKED, PEAKED, PEAKED], [0, 1, 0]) == 1
    rows = [PEAKED + [0.0], [0.05, 0.05, 0.05, 0.85], PEAKED + [0.0]]
    assert accepted(rows, [0, 3, 0]) == 3
    assert accepted(rows, [0, 3, 3]) == 2


@pytest.fixture(scope="module")
def self_draft_pair(llama_pair):
    return ModelPair(llama_pair.target, llama_pair.target, llama_pair.tokenizer)


@pytest.mark.parametrize("pair", ["llama_pair", "opt_pair", "self_draft_pair"])
def test_greedy_typical_equals_greedy_ar(request, pair):
    pair = request.getfixturevalue(pair)
    ref = me.generate("ar", pair, PROMPT, max_new_tokens=24, temperature=0).token_ids
    out = me.generate("typical", pair, PROMPT, max_new_tokens=24, temperature=0, seed=3)
    assert out.token_ids == ref
    if pair.target is pair.draft:
        assert out.stats.acceptance_rate == 1.0


def test_tiny_eps_accepts_every_draft_token(llama_pair):
    """The test uses the untruncated softmax: every token has p > 0 > ... > 1e-12."""
    g = me.generate("typical", llama_pair, PROMPT, max_new_tokens=20, seed=1, eps=1e-12)
    assert all(st.accepted == st.proposed for st in g.steps)
    assert g.stats.draft_accepted > 0


def test_unreachable_threshold_accepts_nothing(llama_pair):
    g = me.generate("typical", llama_pair, PROMPT, max_new_tokens=12, seed=1, eps=1.0, delta=1e9)
    assert g.stats.draft_accepted == 0 and all(st.emitted == 1 for st in g.steps)
    assert g.stats.draft_proposed > 0


@pytest.mark.parametrize("params, word", [({"eps": 0.0}, "eps"), ({"eps": 1.5}, "eps"),
                                          ({"delta": 0.0}, "delta"), ({"gamma": 0}, "gamma"),
                                          ({"delta": "big"}, "delta")])
def test_bad_parameters_are_refused_by_name(params, word):
    with pytest.raises(ValueError, match=word):
        get_decoder("typical", **params)
