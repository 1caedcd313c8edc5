"""Tree decoders end to end: greedy equals greedy ``ar``, the KV caches stay exact, params checked."""

from __future__ import annotations

import copy

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.registry import get_decoder
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult
from mtad_energy.hf_cache import cache_of
from mtad_energy.models import ModelPair
from tests.tiny import llama, word_tokenizer

TREE_DECODERS = ["specinfer", "mcss", "mmtad"]
PROMPT = [3, 4, 5]


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    """A target and a lightly perturbed copy as draft, so drafts are often (not always) accepted."""
    target = llama(64, 0, init=0.3)
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(1)
    for prm in draft.parameters():
        prm.add_(torch.randn(prm.shape, generator=gen) * 0.05 * prm.std())
    return ModelPair(target, draft, word_tokenizer(64, eos=False), name="perturbed")


@pytest.mark.parametrize("name", TREE_DECODERS)
def test_greedy_equals_greedy_ar(pair, name):
    ref = me.generate("ar", pair, PROMPT, max_new_tokens=40, temperature=0,
                      compute_perplexity=False)
    out = me.generate(name, pair, PROMPT, max_new_tokens=40, temperature=0,
                      compute_perplexity=False)
    assert out.token_ids == ref.token_ids
    assert out.stats.draft_accepted > 10  # the tree paths were really accepted and kept


def _assert_cache_is_prefix(model, cache, ids: torch.Tensor) -> None:
    ref = cache_of(model(input_ids=ids[None], use_cache=True))
    for layer, ref_layer in zip(cache.layers, ref.layers, strict=True):
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=1e-5, rtol=0)


class CacheChecked(Decoder):
    """Wraps a decoder; before every step, both caches must equal a fresh run of their prefix."""

    name = "checked"
    help = "test wrapper"
    needs_draft = True

    def __init__(self, inner: Decoder, model_pair: ModelPair):
        super().__init__(inner.params)
        self.inner, self.pair, self.checks = inner, model_pair, 0

    @property
    def lookahead(self) -> int:
        return self.inner.lookahead

    def step(self, s: DecodeState) -> StepResult:
        assert len(s.target) == s.n - 1
        _assert_cache_is_prefix(self.pair.target, s.target.cache, s.ids[0, :s.n - 1])
        if len(s.draft):
            _assert_cache_is_prefix(self.pair.draft, s.draft.cache, s.ids[0, :len(s.draft)])
        self.checks += 1
        return self.inner.step(s)


@pytest.mark.parametrize("name", TREE_DECODERS)
def test_caches_equal_sequential_runs_after_every_step(pair, name):
    checked = CacheChecked(get_decoder(name, top_k=0, top_p=1.0), pair)
    out = me.generate(checked, pair, PROMPT, max_new_tokens=30, seed=3, compute_perplexity=False)
    assert checked.checks == out.stats.iterations > 3
    assert out.stats.draft_accepted > 0


@pytest.mark.parametrize("name", ["specinfer", "mcss"])
def test_stats_count_tree_nodes(pair, name):
    out = me.generate(name, pair, PROMPT, max_new_tokens=20, seed=0, compute_perplexity=False)
    first = out.steps[0]
    assert first.proposed == 4 + 8 + 16  # default branching 4,2,2
    assert first.target_forwards == 1 and first.draft_forwards == 3
    assert 0 <= first.accepted <= 3 and first.emitted == first.accepted + 1


def test_tree_depth_shrinks_at_the_end(pair):
    out = me.generate("specinfer", pair, PROMPT, max_new_tokens=3, seed=0,
                      compute_perplexity=False)
    assert len(out.token_ids) == 3 and out.steps[0].proposed == 4 + 8  # 2 levels left


def test_bad_parameters():
    with pytest.raises(ValueError, match="branching factor must be >= 1"):
        get_decoder("specinfer", branching="4,0,2")
    with pytest.raises(ValueError, match="at least one level"):
        get_decoder("mcss", branching="")
    with pytest.raises(ValueError, match="branching"):
        get_decoder("mcss", branching="4,x")
    with pytest.raises(ValueError, match="tree nodes"):
        get_decoder("specinfer", branching=(64, 32))
    assert get_decoder("mcss", branching=[3, 2]).params.branching == (3, 2)
