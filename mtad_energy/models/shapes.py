"""Random-weight models of real architectures, for timing and energy at real shapes.

The arithmetic and memory traffic of a forward pass do not depend on the weight values, so a
randomly initialised Llama-3.1-8B costs what the real one costs per forward; its outputs are
noise, so acceptance rates, block efficiencies and quality measured on it mean nothing. Combine
per-iteration costs measured here with block efficiencies measured on real pairs (docs/design.md section 7).

Shapes are written out (no hub access needed); ``tiny-*`` shapes serve CPU smoke runs. A model
spec ``random:SHAPE`` (``--target random:llama3.1-8b --draft random:llama3.2-1b``) loads one
through `models.load_pair`, which also builds `random_pair`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    """An architecture at the size of a published checkpoint (config fields only)."""

    family: str  # "llama" | "opt"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool = False
    note: str = ""


SHAPES: dict[str, Shape] = {
    "llama3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, note="meta-llama/Llama-3.1-8B"),
    "llama3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 128256, tie_embeddings=True,
                         note="meta-llama/Llama-3.2-1B"),
    "opt-13b": Shape("opt", 5120, 20480, 40, 40, 40, 50272, tie_embeddings=True,
                     note="facebook/opt-13b"),
    "opt-125m": Shape("opt", 768, 3072, 12, 12, 12, 50272, tie_embeddings=True,
                      note="facebook/opt-125m"),
    "tiny-llama": Shape("llama", 64, 128, 2, 4, 2, 256, note="CPU smoke runs"),
    "tiny-llama-draft": Shape("llama", 32, 64, 1, 4, 2, 256, note="CPU smoke runs"),
    "tiny-opt": Shape("opt", 64, 128, 2, 4, 4, 256, tie_embeddings=True, note="CPU smoke runs"),
    # the layer counts of Llama-3.1-8B / 3.2-1B at a tiny width: host work per iteration (cache
    # bookkeeping per layer) is the real pair's, forwards cost nothing (`engines.hf.counted_generation`)
    "tiny-llama-l32": Shape("llama", 32, 64, 32, 4, 2, 256, note="host-work counts (8B's layers)"),
    "tiny-llama-l16": Shape("llama", 32, 64, 16, 4, 2, 256, tie_embeddings=True,
                            note="host-work counts (1B's layers)"),
}
# Llama-3-8B and Llama-3.1-8B have the same tensor shapes (they differ in RoPE scaling only).
SHAPES["llama3-8b"] = SHAPES["llama3.1-8b"]


def get_shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]


def config_for(shape: Shape | str, max_positions: int = 4096) -> Any:
    """A transformers config with the shape's sizes (``max_positions`` bounds RoPE tables)."""
    from transformers import LlamaConfig, OPTConfig

    s = get_shape(shape) if isinstance(shape, str) else shape
    if s.family == "llama":
        return LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                           num_hidden_layers=s.layers, num_attention_heads=s.heads,
                           num_key_value_heads=s.kv_heads, max_position_embeddings=max_positions,
                           rope_theta=500000.0, tie_word_embeddings=s.tie_embeddings,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if s.family == "opt":
        return OPTConfig(vocab_size=s.vocab, hidden_size=s.hidden, ffn_dim=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads,
                         word_embed_proj_dim=s.hidden, max_position_embeddings=max_positions,
                         tie_word_embeddings=s.tie_embeddings, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    raise ValueError(f"unknown family {s.family!r}")


def weight_bytes(shape: Shape | str, dtype: torch.dtype = torch.float32,
                 max_positions: int = 4096) -> int:
    """The bytes of a ``shape`` model's weights in ``dtype`` (counted on the meta device: nothing
    allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_for(shape, max_positions), dtype=dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def free_memory_bytes(device: str) -> int | None:
    """Free memory on ``device``: CUDA's free bytes plus what PyTorch's allocator holds unused;
    on the CPU, Linux's ``MemAvailable`` (None where unknown)."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(shape: Shape | str, name: str, device: torch.device, dtype: torch.dtype,
               max_positions: int = 4096) -> None:
    """Refuse a ``shape`` model (``name``: how the user gave it) whose weights need more memory
    than ``device`` has free, with the bytes it needs, before they are allocated (an 8B model in
    fp32 is 32 GB)."""
    need = weight_bytes(shape, dtype, max_positions)
    free = free_memory_bytes(str(device))
    if free is not None and need > free:
        raise ValueError(
            f"{name} needs {need / 2**30:.1f} GiB for its weights in "
            f"{str(dtype).removeprefix('torch.')} on {device}, and {free / 2**30:.1f} GiB is free: "
            "pick a smaller shape (e.g. random:llama3.2-1b, random:tiny-llama), --dtype bf16, "
            "or a machine with more memory")


@torch.no_grad()
def random_model(shape: Shape | str, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0, max_positions: int = 4096,
                 attn_implementation: str = "sdpa"):
    """A causal LM of ``shape`` with random weights, built directly on ``device`` (an 8B model
    never touches host memory). Weights are N(0, 0.02), so activations stay finite in bf16."""
    from transformers import AutoModelForCausalLM

    config = config_for(shape, max_positions)
    config._attn_implementation = attn_implementation
    device = torch.device(device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:  # norms and biases
            p.fill_(1.0 if "norm" in name or "layer_norm" in name else 0.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    for module in model.modules():  # non-persistent buffers (rotary inv_freq) were left empty
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            with torch.device(device):
                fresh = type(module)(module.config)
            for buf_name, buf in fresh.named_buffers(recurse=False):
                setattr(module, buf_name, buf)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def synthetic_tokenizer(vocab: int):
    """A real word-level fast tokenizer with ``vocab`` tokens ('t0', 't1', ...) and no EOS, so
    random-weight generations run to max_new_tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<unk>"] + [f"t{i}" for i in range(vocab - 1)]
    tk = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def output_size(model) -> int:
    """The width of ``model``'s logits: its output embedding's rows (a dynamically quantized
    head's packed weight included)."""
    head = model.get_output_embeddings()
    weight = head.weight() if callable(getattr(head, "weight", None)) else head.weight
    return weight.shape[0]
