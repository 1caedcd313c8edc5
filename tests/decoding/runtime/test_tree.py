"""Tree attention: one forward over a token tree equals sequential runs of every node's path."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.timer import PhaseTimer
from mtad_energy.decoding.runtime.tree import (
    ancestors,
    check_tree_support,
    depths,
    keep_path,
    level_parents,
    tree_forward,
    tree_mask,
)
from mtad_energy.hf_cache import cache_of
from tests.tiny import llama, opt

VOCAB = 40


def _mistral(vocab: int, seed: int):
    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        sliding_window=None, initializer_range=0.3)
    return MistralForCausalLM(cfg).eval().requires_grad_(False)


def _qwen2(vocab: int, seed: int):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)
    return Qwen2ForCausalLM(cfg).eval().requires_grad_(False)


BUILDERS = {"llama": lambda: llama(VOCAB, 3, init=0.3), "opt": lambda: opt(VOCAB, 3, init=0.3),
            "mistral": lambda: _mistral(VOCAB, 3), "qwen2": lambda: _qwen2(VOCAB, 3)}


def _model(arch: str, attn: str):
    model = BUILDERS[arch]()
    model.set_attn_implementation(attn)
    return model


def _runner(model) -> ModelRunner:
    return ModelRunner(model, PhaseTimer(torch.device("cpu")), "target")


def _random_parents(n: int, gen: torch.Generator, roots: int = 1) -> torch.Tensor:
    """Topologically ordered random tree: the first ``roots`` nodes hang off the prefix."""
    par = [-1] * roots + [int(torch.randint(0, i, (), generator=gen)) for i in range(roots, n)]
    return torch.tensor(par)


def _path(anc: torch.Tensor, i: int) -> torch.Tensor:
    return anc[i].nonzero().squeeze(1)  # ancestors in index (= depth) order


def _kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_structure_helpers():
    par = torch.tensor([-1, 0, 0, 1, 3, -1])
    anc = ancestors(par)
    assert anc[4].nonzero().squeeze(1).tolist() == [0, 1, 3, 4]
    assert anc[5].nonzero().squeeze(1).tolist() == [5]
    assert depths(anc).tolist() == [1, 2, 2, 3, 4, 1]
    mask = tree_mask(anc[3:], 2, torch.float32)  # nodes 3..5 new, 0..2 cached after 2 prefix
    assert mask.shape == (1, 1, 3, 2 + 6)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 1, 1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0, 1]]
    assert level_parents((3, 2)).tolist() == [-1, -1, -1, 0, 0, 1, 1, 2, 2]
    assert level_parents((2, 1, 2)).tolist() == [-1, -1, 0, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "opt", "mistral", "qwen2"])
def test_tree_forward_matches_sequential_paths(arch, attn):
    model = _model(arch, attn)
    gen = torch.Generator().manual_seed(1)
    for trial in range(2):
        prefix = torch.randint(0, VOCAB, (6 + trial,), generator=gen)
        n = 14
        parents = _random_parents(n, gen, roots=1 + trial)  # trial 1: a forest on the prefix
        tokens = torch.randint(0, VOCAB, (n,), generator=gen)
        anc = ancestors(parents)
        runner = _runner(model)
        with torch.inference_mode():
            runner(prefix[None])
            m = 5  # feed the tree in two forwards: the second one sees cached tree nodes
            logits = torch.cat([tree_forward(runner, tokens[:m], anc[:m, :m], len(prefix)),
                                tree_forward(runner, tokens[m:], anc, len(prefix))])
            for i in range(n):
                seq = torch.cat([prefix, tokens[_path(anc, i)]])
                ref = model(input_ids=seq[None]).logits[0, -1]
                torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_keep_path_equals_sequential_cache(arch):
    model = _model(arch, "sdpa")
    gen = torch.Generator().manual_seed(2)
    for node in (0, 7, 11):
        prefix = torch.randint(0, VOCAB, (5,), generator=gen)
        parents = _random_parents(12, gen)
        tokens = torch.randint(0, VOCAB, (12,), generator=gen)
        anc = ancestors(parents)
        runner = _runner(model)
        with torch.inference_mode():
            runner(prefix[None, :-1])
            # the target convention: the last prefix token is the root of the fed tree
            tree_forward(runner, torch.cat([prefix[-1:], tokens[1:]]), anc, len(prefix) - 1)
            path = _path(anc, node)
            keep_path(runner, len(prefix) - 1, path)
            seq = torch.cat([prefix, tokens[path[1:]]])
            ref = cache_of(model(input_ids=seq[None], use_cache=True))
        assert len(runner) == len(seq)
        for (k, v), (rk, rv) in zip(_kv(runner.cache), _kv(ref), strict=True):
            torch.testing.assert_close(k, rk, atol=1e-5, rtol=0)
            torch.testing.assert_close(v, rv, atol=1e-5, rtol=0)


def test_unsupported_architecture_is_named():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(NotImplementedError, match="GPT2LMHeadModel.*gpt2"):
        check_tree_support(gpt2)
    model = llama(VOCAB, 0)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(NotImplementedError, match="LlamaForCausalLM.*flash_attention_2"):
        check_tree_support(model)


def test_cache_length_mismatch_is_explained():
    runner = _runner(llama(VOCAB, 0))
    with torch.inference_mode():
        runner(torch.tensor([[1, 2, 3]]))
        anc = ancestors(torch.tensor([-1, 0]))
        with pytest.raises(ValueError, match="cache holds 3 positions"):
            tree_forward(runner, torch.tensor([4, 5]), anc, 2)
