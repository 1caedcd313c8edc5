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


# -- oracle drafts: a target whose greedy continuation is known, and heads that predict it --

def successor_llama(vocab: int = 16, hidden: int = 32, layers: int = 3, seed: int = 0,
                    scale: float = 10.0) -> tuple[LlamaForCausalLM, list[int]]:
    """A tiny Llama whose greedy next token is ``succ[t]`` of the current token t, with ``succ``
    one cycle through the whole vocabulary (a random order): its greedy continuation of any
    prompt is that cycle, so a draft that proposes it is an oracle. Its layers keep their random
    weights (init 0.02: attention, MLP and tree masks run as usual) under one-hot embeddings
    (``e_t``, needs vocab <= hidden) and an LM head whose row succ[t] is ``scale * e_t``: every
    hidden state is close to e_t (after the final norm sqrt(H) e_t), far from any tie."""
    assert vocab <= hidden, "one-hot embeddings need vocab <= hidden"
    model = llama(vocab, seed, layers=layers, hidden=hidden)
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()
    succ = [0] * vocab
    for a, b in zip(order, order[1:] + order[:1], strict=True):
        succ[a] = b
    emb = torch.zeros(vocab, hidden)
    emb[:, :vocab] = torch.eye(vocab)
    head = torch.zeros(vocab, hidden)
    head[succ, torch.arange(vocab)] = scale
    model.get_input_embeddings().weight.copy_(emb)
    model.get_output_embeddings().weight.copy_(head)
    return model, succ


def _power(succ: list[int], k: int) -> list[int]:
    """succ applied k times, as a list: t -> succ^k(t)."""
    out = list(range(len(succ)))
    for _ in range(k):
        out = [succ[t] for t in out]
    return out


def _shift(hidden: int, succ: list[int]) -> torch.Tensor:
    """[H, H]: e_t -> e_succ[t] on the first len(succ) dimensions, 0 elsewhere."""
    m = torch.zeros(hidden, hidden)
    m[succ, torch.arange(len(succ))] = 1.0
    return m


def save_oracle_medusa(target, succ: list[int], path: Path, heads: int = 3) -> str:
    """A Medusa-1 checkpoint (`save_medusa`'s layout) for `successor_llama` whose heads predict
    what the target will emit: ResBlocks zero (the identity) and head k's output layer the
    target's LM head with its rows moved by succ^(k+1), so that head k on the carried hidden
    state of token t (sqrt(H) e_t) proposes succ^(k+2)[t], the token k + 2 positions on."""
    from safetensors.torch import load_file, save_file

    save_medusa(target, path, heads=heads, layers=1)
    file = path / "medusa_lm_head.safetensors"
    state = load_file(str(file))
    lm_head = target.get_output_embeddings().weight.detach().float()
    for k in range(heads):
        state[f"{k}.0.linear.weight"].zero_()
        state[f"{k}.0.linear.bias"].zero_()
        # row succ^(k+1)[j] of head k = row j of the LM head (which favours succ[t])
        out = torch.zeros_like(lm_head)
        out[_power(succ, k + 1)] = lm_head
        state[f"{k}.1.weight"] = out
    save_file(state, str(file))
    return str(path)


def save_oracle_eagle(target, succ: list[int], path: Path, version: int) -> str:
    """An EAGLE checkpoint (`save_eagle`'s layout) for `successor_llama` that predicts what the
    target will emit, through the features (the pair's token is not read): attention output and
    (EAGLE-1) MLP zero, so the layer passes its fused input on.

    EAGLE-1: fc moves the target feature of token t (sqrt(H) e_t) to sqrt(H) e_succ[t], the
    feature of the next position; the target's LM head on it gives the token after that.
    EAGLE-3: fc keeps the first tapped feature (~e_t); the MLP moves e_u to e_succ[u] (gate and
    up pick u's coordinate, down writes e_succ[u] - e_u); the head's own lm_head over a draft
    vocabulary in shuffled order (d2t a permutation) is the target's rows in that order. A
    drafted node's own output feature (H wide, past fc) moves on by one more token likewise."""
    save_eagle(target, path, version=version, init=0.05)
    file = path / "pytorch_model.bin"
    state = torch.load(file, weights_only=True)
    hidden = target.config.hidden_size
    vocab = len(succ)
    shift = _shift(hidden, succ)
    layer = "layers.0." if version == 1 else "midlayer."
    state[f"{layer}self_attn.o_proj.weight"].zero_()
    if version == 1:
        state["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), shift], 1)
        state["fc.bias"].zero_()
        state[f"{layer}mlp.down_proj.weight"].zero_()
    else:
        inter = target.config.intermediate_size
        state["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, 2 * hidden)], 1)
        pick = torch.zeros(inter, hidden)
        pick[torch.arange(vocab), torch.arange(vocab)] = 1.0
        gain = 10.0  # silu(gain * sqrt(H)) ~ gain * sqrt(H): the picked coordinate's product
        state[f"{layer}mlp.gate_proj.weight"] = gain * pick
        state[f"{layer}mlp.up_proj.weight"] = pick.clone()
        # the residual carries e_u (scale 1); the MLP adds e_succ[u] - e_u
        down = torch.zeros(hidden, inter)
        down[:, :hidden] = (shift - torch.eye(hidden)) / (gain * hidden)
        state[f"{layer}mlp.down_proj.weight"] = down
        keep = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))
        state["lm_head.weight"] = target.get_output_embeddings().weight.detach().float()[keep]
        state["d2t"] = keep - torch.arange(vocab)
        state["t2d"] = torch.ones(vocab, dtype=torch.bool)
    torch.save(state, file)
    return str(path)
