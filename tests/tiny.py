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
