"""Tiny random models of real architectures, built in the test session.

Target and draft share a tokenizer (a word-level vocabulary) by sharing the vocab size.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

from mtad_energy.models import ModelPair


def word_tokenizer(vocab: int, eos: bool = True, prefix: str = "w") -> PreTrainedTokenizerFast:
    """Tokens '<unk>', '<eos>' (optional), then '{prefix}0', '{prefix}1', ..."""
    names = ["<unk>"] + (["<eos>"] if eos else [])
    names += [f"{prefix}{i}" for i in range(vocab - len(names))]
    tk = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>",
                                   eos_token="<eos>" if eos else None)


def llama(vocab: int, seed: int, layers: int = 2, hidden: int = 32, init: float = 0.02,
          ctx: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=ctx, initializer_range=init,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def opt(vocab: int, seed: int, layers: int = 2, hidden: int = 32, init: float = 0.02,
        ctx: int = 256) -> OPTForCausalLM:
    torch.manual_seed(seed)
    cfg = OPTConfig(vocab_size=vocab, hidden_size=hidden, ffn_dim=2 * hidden,
                    num_hidden_layers=layers, num_attention_heads=4, word_embed_proj_dim=hidden,
                    max_position_embeddings=ctx, init_std=init)
    return OPTForCausalLM(cfg).eval().requires_grad_(False)


def save(model, tokenizer, path: Path) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def lossless_pair(vocab: int = 5, init: float = 0.25) -> ModelPair:
    """An in-memory pair with a tiny vocabulary and no EOS whose warped p and q differ a lot
    (used to test that sampled outputs follow warped p exactly)."""
    tok = word_tokenizer(vocab, eos=False)
    return ModelPair(llama(vocab, 0, layers=1, hidden=16, init=init),
                     llama(vocab, 7, layers=1, hidden=16, init=init), tok, name="lossless")


# -- draft heads in their public checkpoint layouts (written key by key, as the projects do) --

def save_medusa(target, path: Path, heads: int = 3, layers: int = 1, seed: int = 0,
                safetensors: bool = True) -> str:
    """A Medusa-1 checkpoint for ``target`` as FasterDecoding/Medusa writes it: config.json
    (medusa_num_heads, medusa_num_layers, base_model_name_or_path) and medusa_lm_head.safetensors
    (or .pt) with keys ``{k}.{l}.linear.weight|bias`` and ``{k}.{layers}.weight``. Initialised as
    Medusa's training starts (ResBlocks near zero, each head's output layer the target's LM head
    plus noise), so its proposals are sometimes right."""
    import json

    torch.manual_seed(seed)
    lm_head = target.get_output_embeddings().weight.detach().float()
    vocab, hidden = lm_head.shape
    state = {}
    for k in range(heads):
        for layer in range(layers):
            state[f"{k}.{layer}.linear.weight"] = 0.01 * torch.randn(hidden, hidden)
            state[f"{k}.{layer}.linear.bias"] = torch.zeros(hidden)
        state[f"{k}.{layers}.weight"] = lm_head + 0.02 * torch.randn(vocab, hidden)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "medusa_num_heads": heads, "medusa_num_layers": layers,
        "base_model_name_or_path": "tiny-target", "transformers_version": "4.34.0"}))
    if safetensors:
        from safetensors.torch import save_file

        save_file(state, str(path / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, path / "medusa_lm_head.pt")
    return str(path)


def save_eagle(target, path: Path, version: int = 3, seed: int = 0, draft_vocab: int | None = None,
               init: float = 0.05, safetensors: bool = False) -> str:
    """An EAGLE checkpoint for the Llama ``target`` as SafeAILab/EAGLE writes it: config.json (a
    one-layer Llama config; EAGLE-3 adds draft_vocab_size) and pytorch_model.bin (or
    model.safetensors). EAGLE-1 (cnets1.py): ``fc.weight|bias`` [H, 2H], ``layers.0.self_attn.*``,
    ``layers.0.mlp.*``, ``layers.0.post_attention_layernorm.weight`` (no input norm). EAGLE-3
    (cnets.py): ``fc.weight`` [H, 3H], ``midlayer.*`` with q/k/v over 2H, ``midlayer.hidden_norm``
    and ``input_layernorm``, ``norm.weight``, ``lm_head.weight`` [V', H], ``d2t`` [V'] (target id
    = d + d2t[d]) and ``t2d`` [V] (bool). Random weights (init std ``init``); EAGLE-3's lm_head
    is the target's rows of the draft vocabulary, so its proposals are sometimes right."""
    import json

    cfg = target.config
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    vocab = cfg.vocab_size
    torch.manual_seed(seed)

    def w(*shape):
        return init * torch.randn(*shape)

    attn_in = hidden if version == 1 else 2 * hidden
    layer = {"self_attn.q_proj.weight": w(heads * head_dim, attn_in),
             "self_attn.k_proj.weight": w(kv_heads * head_dim, attn_in),
             "self_attn.v_proj.weight": w(kv_heads * head_dim, attn_in),
             "self_attn.o_proj.weight": w(hidden, heads * head_dim),
             "mlp.gate_proj.weight": w(inter, hidden), "mlp.up_proj.weight": w(inter, hidden),
             "mlp.down_proj.weight": w(hidden, inter),
             "post_attention_layernorm.weight": torch.ones(hidden)}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": hidden, "intermediate_size": inter,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": vocab,
              "rope_theta": 10000.0, "bias": True, "torch_dtype": "float32"}
    if version == 1:
        state = {"fc.weight": w(hidden, 2 * hidden), "fc.bias": torch.zeros(hidden),
                 **{f"layers.0.{k}": v for k, v in layer.items()}}
    else:
        dv = draft_vocab or vocab
        # the draft vocabulary: dv of the target's tokens, in order (EAGLE-3 keeps the most
        # frequent ones); d2t maps draft id d to target id d + d2t[d]
        keep = torch.randperm(vocab)[:dv].sort().values if dv < vocab else torch.arange(vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[keep] = True
        lm = target.get_output_embeddings().weight.detach().float()[keep]
        state = {"fc.weight": w(hidden, 3 * hidden),
                 **{f"midlayer.{k}": v for k, v in layer.items()},
                 "midlayer.hidden_norm.weight": torch.ones(hidden),
                 "midlayer.input_layernorm.weight": torch.ones(hidden),
                 "norm.weight": torch.ones(hidden), "lm_head.weight": lm.clone(),
                 "d2t": keep - torch.arange(dv), "t2d": t2d}
        config["draft_vocab_size"] = dv
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if safetensors:
        from safetensors.torch import save_file

        save_file(state, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    return str(path)


def skip_without_head(name: str, pair) -> None:
    """Skip a registry-wide test for a head decoder whose head the pair lacks (EAGLE heads are
    for Llama-family targets: the OPT pair has none)."""
    import pytest

    from mtad_energy.decoding.registry import DECODERS

    kind = DECODERS[name].head
    if kind is not None and kind not in pair.heads:
        pytest.skip(f"{name}: the {type(pair.target).__name__} pair has no {kind} head")


# the compiled-path tests trace every shape a decoder runs (seconds each on CI's 2 cores): EAGLE
# with its published tree (6 expansions of 10, 60 tokens) runs ~10 shapes per model; a smaller
# tree runs the same code paths
COMPILE_PARAMS = {"eagle": {"depth": 2, "expand": 3, "total_tokens": 10}}


def compile_test_decoder(name: str, **params):
    """`get_decoder` with `COMPILE_PARAMS` for the compiled-path tests."""
    from mtad_energy.decoding.registry import get_decoder

    return get_decoder(name, **{**COMPILE_PARAMS.get(name, {}), **params})
