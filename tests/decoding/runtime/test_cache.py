import pytest
import torch

from mtad_energy.decoding.runtime import cache as kv
from mtad_energy.hf_cache import cache_kwargs


@pytest.mark.parametrize("pair", ["llama_pair", "opt_pair"])
def test_rollback_then_refeed_gives_the_logits_of_a_fresh_forward(request, pair):
    model = request.getfixturevalue(pair).target
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])
    with torch.no_grad():
        fresh = model(input_ids=ids).logits
        cache = kv.new_cache(model)
        model(input_ids=ids[:, :5], **cache_kwargs(cache), use_cache=True)
        model(input_ids=torch.tensor([[1, 2, 3]]), **cache_kwargs(cache), use_cache=True)  # rejected
        kv.crop(cache, 5)
        assert kv.cache_len(cache) == 5
        again = model(input_ids=ids[:, 5:], **cache_kwargs(cache), use_cache=True).logits
    assert torch.allclose(again, fresh[:, 5:], atol=1e-5)


def test_select_rows_keeps_a_beam_and_keep_positions_gathers_along_time(llama_pair):
    model = llama_pair.target
    with torch.no_grad():
        cache = kv.new_cache(model)
        model(input_ids=torch.tensor([[1, 2, 3]]), **cache_kwargs(cache), use_cache=True)
        kv.repeat_rows(cache, 3)
        model(input_ids=torch.tensor([[4], [5], [6]]), **cache_kwargs(cache), use_cache=True)
        kv.select_rows(cache, torch.tensor([1]))
        solo = kv.new_cache(model)
        model(input_ids=torch.tensor([[1, 2, 3, 5]]), **cache_kwargs(solo), use_cache=True)
    for a, b in zip(cache.layers, solo.layers, strict=False):
        assert torch.allclose(a.keys, b.keys, atol=1e-5)
        assert torch.allclose(a.values, b.values, atol=1e-5)
    before = cache.layers[0].keys.clone()
    kv.keep_positions(cache, torch.tensor([0, 2]))
    assert torch.equal(cache.layers[0].keys, before[:, :, [0, 2]])
    assert kv.cache_len(cache) == 2
