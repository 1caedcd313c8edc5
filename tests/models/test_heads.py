"""Draft heads (`mtad_energy.models.heads`): the public checkpoint layouts (written key by key in
tests/tiny.py, as FasterDecoding/Medusa and SafeAILab/EAGLE save them) load through
``load_pair(draft='KIND:DIR')``, compute what those projects' code computes, and bad input gets
an error naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mtad_energy.hf_cache import cache_kwargs
from mtad_energy.models import load_pair
from mtad_energy.models.heads import EagleHead, HeadLoadError, MedusaHeads, split_draft_spec
from tests import tiny


@pytest.fixture(scope="module")
def llama(model_dirs):
    return load_pair(target=model_dirs["llama"], device="cpu").target


def _state(directory) -> dict:
    path = next(p for p in directory.iterdir() if p.suffix in (".bin", ".safetensors", ".pt"))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True)


def test_the_pairs_load_their_heads_through_the_draft_spec(model_dirs):
    pair = load_pair(target=model_dirs["llama"],
                     draft=f"{model_dirs['llama-draft']},eagle:{model_dirs['llama-eagle']},"
                           f"medusa:{model_dirs['llama-medusa']}", device="cpu")
    assert pair.draft is not None and pair.draft_id == model_dirs["llama-draft"]
    assert isinstance(pair.heads["eagle"], EagleHead) and pair.heads["eagle"].version == 3
    assert isinstance(pair.heads["medusa"], MedusaHeads) and pair.heads["medusa"].num_heads == 3
    assert pair.describe()["heads"] == {"eagle": model_dirs["llama-eagle"],
                                        "medusa": model_dirs["llama-medusa"]}
    alone = load_pair(target=model_dirs["llama"], draft=f"eagle:{model_dirs['llama-eagle1']}",
                      device="cpu")
    assert alone.draft is None and alone.heads["eagle"].version == 1  # no draft model asked for


@torch.inference_mode()
def test_medusa_heads_compute_resblocks_then_the_output_layer(model_dirs, llama, tmp_path):
    """Head k = Linear_out(x + SiLU(Linear(x))), Medusa's ResBlock; .pt and .safetensors alike."""
    pt = tiny.save_medusa(llama, tmp_path / "pt", heads=2, layers=2, safetensors=False)
    for path in (model_dirs["llama-medusa"], pt):
        heads = load_pair(target=model_dirs["llama"], draft=f"medusa:{path}",
                          device="cpu").heads["medusa"]
        state, layers = _state(Path(path)), heads.config["medusa_num_layers"]
        h = torch.randn(3, 32)
        out = heads(h)  # [3, K, V]
        for k in range(heads.num_heads):
            x = h
            for j in range(layers):
                x = x + F.silu(x @ state[f"{k}.{j}.linear.weight"].T + state[f"{k}.{j}.linear.bias"])
            torch.testing.assert_close(out[:, k], x @ state[f"{k}.{layers}.weight"].T)


@torch.inference_mode()
@pytest.mark.parametrize("version", [1, 3])
def test_an_eagle_head_computes_its_published_formula(model_dirs, llama, version):
    """With its attention output and MLP zeroed, the layer is the identity on its residual, so
    the head's output is: EAGLE-1 fc([embedding, feature]) and the target's LM head on it;
    EAGLE-3 fc(feature) (3H -> H) and its own lm_head after its final norm, over the draft
    vocabulary, mapped to target ids by d2t."""
    path = model_dirs[f"llama-eagle{'' if version == 3 else '1'}"]
    head = load_pair(target=model_dirs["llama"], draft=f"eagle:{path}", device="cpu").heads["eagle"]
    state = _state(Path(path))
    head.layer.self_attn.o_proj.weight.zero_()
    head.layer.mlp.down_proj.weight.zero_()
    ids = torch.tensor([[3, 9, 27]])
    width = 32 if version == 1 else 96
    feat = torch.randn(1, 3, width)
    out = head(ids, feat)
    emb = llama.get_input_embeddings()(ids)
    if version == 1:
        fused = torch.cat([emb, feat], -1) @ state["fc.weight"].T + state["fc.bias"]
        logits = llama.get_output_embeddings()(fused)
    else:
        fused = feat @ state["fc.weight"].T
        logits = head.norm(fused) @ state["lm_head.weight"].T
        d = torch.tensor([0, 5, 47])
        assert head.to_target(d).tolist() == (d + state["d2t"][d]).tolist()
        assert logits.shape[-1] == 48 and head.to_target(torch.arange(48)).max() < 64
    torch.testing.assert_close(out.hidden_states[0], fused)
    torch.testing.assert_close(out.logits, logits)
    assert head.target_hidden_states() == ((-1,) if version == 1 else (0, 1, 2))


@torch.inference_mode()
@pytest.mark.parametrize("name", ["llama-eagle", "llama-eagle1"])
def test_an_eagle_head_on_its_cache_gives_the_logits_of_one_forward(model_dirs, name):
    """Pairs fed one at a time through a KV cache (positions from the cache, as a causal LM)
    give the logits of all pairs at once: its attention is causal over its own pairs."""
    from transformers import DynamicCache

    head = load_pair(target=model_dirs["llama"], draft=f"eagle:{model_dirs[name]}",
                     device="cpu").heads["eagle"]
    ids = torch.tensor([[3, 9, 27, 4, 11]])
    feat = torch.randn(1, 5, head.fc.in_features - (32 if head.version == 1 else 0))
    whole = head(ids, feat).logits
    cache = DynamicCache(config=head.config)
    first = head(ids[:, :2], feat[:, :2], **cache_kwargs(cache)).logits
    steps = [head(ids[:, i:i + 1], feat[:, i:i + 1], **cache_kwargs(cache)).logits
             for i in range(2, 5)]
    torch.testing.assert_close(torch.cat([first, *steps], 1), whole, atol=1e-5, rtol=0)


def test_split_draft_spec():
    assert split_draft_spec("self:int8,eagle:/a,medusa:/b") == ("self:int8", {"eagle": "/a",
                                                                             "medusa": "/b"})
    assert split_draft_spec("eagle:org/name") == (None, {"eagle": "org/name"})
    assert split_draft_spec(None) == (None, {})
    # a self-draft's own lists keep their commas, before or after a head
    assert split_draft_spec("self:layers=0,2,eagle:/a") == ("self:layers=0,2", {"eagle": "/a"})
    assert split_draft_spec("medusa:/b,self:skip=3,7") == ("self:skip=3,7", {"medusa": "/b"})
    assert split_draft_spec("self:layers=0-11,20") == ("self:layers=0-11,20", {})
    for bad, why in [("eagle:/a,m1,medusa:/b,m2", "two draft models"),
                     ("eagle:/a,eagle:/b", "two eagle heads"),
                     ("medusa:", "give the medusa head's directory")]:
        with pytest.raises(ValueError, match=why):
            split_draft_spec(bad)


def test_bad_head_checkpoints_are_refused_by_name(model_dirs, tmp_path, llama):
    def load(draft, target=model_dirs["llama"]):
        return load_pair(target=target, draft=draft, device="cpu")

    with pytest.raises(HeadLoadError, match="not available offline.*hf download org/eagle-x"):
        load("eagle:org/eagle-x")
    with pytest.raises(HeadLoadError, match="no such directory"):
        load(f"medusa:{tmp_path / 'missing' / 'dir'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(HeadLoadError, match="no config.json"):
        load(f"eagle:{empty}")
    (empty / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    with pytest.raises(HeadLoadError, match=r"no weights file \(medusa_lm_head.safetensors or "
                                            r"medusa_lm_head.pt\); files there: config.json"):
        load(f"medusa:{empty}")
    with pytest.raises(HeadLoadError, match="EAGLE heads are for Llama-family targets.*'opt'"):
        load(f"eagle:{model_dirs['llama-eagle']}", target=model_dirs["opt"])
    wide = tiny.save_medusa(tiny.llama(64, 3, hidden=48), tmp_path / "wide")
    with pytest.raises(HeadLoadError, match="hidden size 48 and 64 tokens; the target has 32"):
        load(f"medusa:{wide}")
    other = tiny.save_eagle(tiny.llama(64, 3, hidden=48), tmp_path / "other", version=1)
    with pytest.raises(HeadLoadError, match="hidden size 48, the target 32"):
        load(f"eagle:{other}")
    mixed = tmp_path / "mixed"
    tiny.save_eagle(llama, mixed, version=1)
    state = torch.load(mixed / "pytorch_model.bin", weights_only=True)
    torch.save({k.replace("layers.0.", "decoder."): v for k, v in state.items()},
               mixed / "pytorch_model.bin")
    with pytest.raises(HeadLoadError, match=r"neither an EAGLE-1 \(layers.0.\*\) nor an EAGLE-3"):
        load(f"eagle:{mixed}")
    torch.save({**state, "layers.0.extra.weight": torch.zeros(2)}, mixed / "pytorch_model.bin")
    with pytest.raises(HeadLoadError, match=r"EAGLE-1\): weights do not match.*layers.0.extra"):
        load(f"eagle:{mixed}")
