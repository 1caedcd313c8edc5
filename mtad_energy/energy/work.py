"""FLOPs and bytes of one forward of a dense decoder-only transformer, counted from its config.

The counting rule (docs/design.md section 8), for one forward of ``rows`` rows of ``new`` tokens each
over a KV cache that the forward's attention spans ``kv_columns`` columns of (the ``cached``
columns before it plus the ``new`` ones; a token tree of N nodes is ``new = N``; padding rows,
padded widths and invalid cache columns are real work and count):

* **FLOPs** = 2 x (tokens) x (weights of every linear layer, the LM head included) plus the
  attention's 4 x rows x layers x heads x head_dim x new x kv_columns (Q K^T and P V; grouped-query
  attention changes the KV bytes, not these FLOPs). Biases, norms, activations and softmax are
  not counted (torch's FLOP formulas count the matrix products only, and so does this rule).
* **weight bytes**: every parameter read once per forward, not per row; an embedding table is
  read as the rows it gathers (one per token), while the LM head reads its whole matrix (a tied
  table is read in full there).
* **KV bytes**: the attention reads all ``kv_columns`` columns of keys and values of every
  layer; the forward writes the ``new`` columns (a static cache, written in place) or, with
  transformers' ``DynamicCache``, which appends by concatenation, reads the ``cached`` columns and
  writes all ``kv_columns`` into a new tensor.
* **logits bytes**: ``rows x new x vocabulary`` written in the model's dtype.

Activations passed between kernels are not counted: a decode step's stay in on-chip caches; at
long prefill chunks they are traffic this rule leaves to the static and FLOP terms.

Exact for the model types llama, mistral (full attention), qwen2 and opt; others are refused by
name. Draft heads on the target's hidden states (EAGLE, Medusa) count by the same rule from
their loaded weights (`HeadDims`): every matrix a token goes through, EAGLE-3's fusion layer
only on forwards fed the target's features, one attention layer and its cache (EAGLE), and the
logits of every head (Medusa) or of the draft vocabulary (EAGLE).

Pure host arithmetic on ints: the decode loop calls it per forward at no device cost. This module
imports only torch (for dtype sizes) and is shared by ``decoding`` and ``measure``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Protocol

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "opt")


class Forward(NamedTuple):
    """What a runner records per forward: ``rows`` rows of ``new`` tokens over ``kv_columns``
    attended KV columns; ``features``: the width of the feature input a draft head was given
    (0 for a language model's forward)."""

    rows: int
    new: int
    kv_columns: int
    features: int = 0


@dataclass(frozen=True)
class ModelDims:
    """What the counting rule needs of a model: sizes, biases, and bytes per element.

    ``weight_elem_bytes`` is the size of a linear layer's weight element (1 for a dynamically
    int8-quantised model), ``elem_bytes`` that of everything else (activations, KV, norms,
    embeddings, logits)."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool  # llama-style gate/up/down projections (3 matrices) vs OPT's fc1/fc2 (2)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    norm_params_per_layer: int  # parameters of a layer's norms (RMSNorm: d each; LayerNorm: 2d)
    final_norm_params: int
    embed_dim: int  # width of the token embedding and of the LM head's input (OPT's proj dim)
    learned_positions: bool  # OPT: a position embedding gathered per token
    elem_bytes: int
    weight_elem_bytes: int

    @classmethod
    def from_config(cls, config: Any, elem_bytes: int = 4,
                    weight_elem_bytes: int | None = None) -> ModelDims:
        """Dims of a transformers config (its text config for multimodal ones)."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_type = getattr(cfg, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"FLOP/byte counting supports model types {', '.join(SUPPORTED_MODEL_TYPES)}"
                             f", not {model_type!r}; its counts would be guesses")
        d, h = int(cfg.hidden_size), int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or h)
        head_dim = int(getattr(cfg, "head_dim", None) or d // h)
        common = {"model_type": model_type, "layers": int(cfg.num_hidden_layers), "hidden": d,
                  "heads": h, "kv_heads": kv, "head_dim": head_dim, "vocab": int(cfg.vocab_size),
                  "elem_bytes": elem_bytes,
                  "weight_elem_bytes": elem_bytes if weight_elem_bytes is None else weight_elem_bytes}
        if model_type == "opt":
            bias = bool(getattr(cfg, "enable_bias", True))
            affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
            ln = 2 * d if affine else 0
            final = (ln if getattr(cfg, "do_layer_norm_before", True)
                     and not getattr(cfg, "_remove_final_layer_norm", False) else 0)
            return cls(**common, intermediate=int(cfg.ffn_dim), gated_mlp=False, qkv_bias=bias,
                       o_bias=bias, mlp_bias=bias, norm_params_per_layer=2 * ln,
                       final_norm_params=final,
                       embed_dim=int(getattr(cfg, "word_embed_proj_dim", None) or d),
                       learned_positions=True)
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(**common, intermediate=int(cfg.intermediate_size), gated_mlp=True,
                   qkv_bias=attn_bias or model_type == "qwen2", o_bias=attn_bias,
                   mlp_bias=bool(getattr(cfg, "mlp_bias", False)), norm_params_per_layer=2 * d,
                   final_norm_params=d, embed_dim=d, learned_positions=False)

    @classmethod
    def from_model(cls, model: Any) -> ModelDims:
        """Dims of a loaded model: its config, its floating dtype, and 1-byte linear weights when
        its linear layers are dynamically int8-quantised (`models.int8_draft`)."""
        why = getattr(model, "not_counted", None)  # a module the rule does not describe
        if why:
            raise ValueError(why)
        elem = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
        modules = model.modules() if hasattr(model, "modules") else ()  # a wrapper may lack them
        quantized = any(callable(getattr(m, "weight", None)) for m in modules)
        return cls.from_config(model.config, elem, 1 if quantized else None)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_matrix_params(self) -> int:
        """Weights of one layer's linear layers (no biases)."""
        d = self.hidden
        attn = d * self.q_width + 2 * d * self.kv_width + self.q_width * d
        return attn + (3 if self.gated_mlp else 2) * d * self.intermediate

    @property
    def layer_bias_params(self) -> int:
        return ((self.q_width + 2 * self.kv_width if self.qkv_bias else 0)
                + (self.hidden if self.o_bias else 0)
                + ((2 if self.gated_mlp else 1) * self.intermediate + self.hidden
                   if self.mlp_bias else 0))

    @property
    def head_params(self) -> int:
        """The LM head's matrix plus OPT's projections between the embedding and hidden widths."""
        proj = 2 * self.embed_dim * self.hidden if self.embed_dim != self.hidden else 0
        return self.embed_dim * self.vocab + proj

    @property
    def matrix_params(self) -> int:
        """Weights of every matrix product a token goes through (the FLOPs' 'parameters')."""
        return self.layers * self.layer_matrix_params + self.head_params

    def kv_bytes_per_column(self, rows: int) -> int:
        """Keys and values of one cache column over all layers and ``rows`` rows."""
        return rows * self.layers * 2 * self.kv_width * self.elem_bytes

    # -- what `forward_work` asks of any dims (`Dims`) ---------------------------------------
    def token_matrix_params(self, features: int = 0) -> int:
        return self.matrix_params

    def read_once_bytes(self, features: int = 0) -> int:
        """Parameters read once per forward: the matrices, biases and norms."""
        eb = self.elem_bytes
        return (self.weight_elem_bytes * self.matrix_params
                + eb * (self.layers * (self.layer_bias_params + self.norm_params_per_layer)
                        + self.final_norm_params))

    @property
    def gathered_bytes_per_token(self) -> int:
        """The embedding rows a token gathers (OPT: its learned position's too)."""
        return self.elem_bytes * (self.embed_dim + (self.hidden if self.learned_positions else 0))

    @property
    def logits_per_token(self) -> int:
        return self.vocab


@dataclass(frozen=True)
class HeadDims:
    """What the counting rule needs of a draft head on the target's hidden states
    (`mtad_energy.models.heads`; the head module's ``work_dims()`` builds it). Its matrices are counted
    from the loaded weights, not from a config, so EAGLE's 2H-wide q/k/v, its fusion layer and a
    draft vocabulary count as they are:

    * ``matrix_params``: the weights every token goes through (Medusa: all K heads' ResBlocks and
      vocabulary projections; EAGLE: the decoder layer and the LM head, EAGLE-1's ``fc`` too);
    * ``fused_params`` / ``fused_other_params``: EAGLE-3's ``fc`` (3H -> H) weights and bias, run
      (and read) only by a forward fed the target's ``fused_width``-wide features, not the
      head's own;
    * one attention layer (EAGLE) or none (Medusa) with its KV cache; ``embed_dim`` the token
      embedding width gathered per token (0: Medusa reads features only); ``logits_per_token``
      K x V (Medusa) or the draft vocabulary (EAGLE)."""

    kind: str
    matrix_params: int
    other_params: int
    fused_params: int
    fused_other_params: int
    fused_width: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    embed_dim: int
    logits_per_token: int
    elem_bytes: int

    def _fused(self, features: int) -> bool:
        return self.fused_params > 0 and features == self.fused_width

    def token_matrix_params(self, features: int = 0) -> int:
        return self.matrix_params + (self.fused_params if self._fused(features) else 0)

    def read_once_bytes(self, features: int = 0) -> int:
        fused = self.fused_other_params if self._fused(features) else 0
        return self.elem_bytes * (self.token_matrix_params(features) + self.other_params + fused)

    @property
    def gathered_bytes_per_token(self) -> int:
        return self.elem_bytes * self.embed_dim

    def kv_bytes_per_column(self, rows: int) -> int:
        return rows * self.layers * 2 * self.kv_heads * self.head_dim * self.elem_bytes


class Dims(Protocol):
    """What `forward_work` asks of a model's or a head's dims."""

    layers: int
    heads: int
    head_dim: int
    elem_bytes: int

    def token_matrix_params(self, features: int = 0) -> int: ...
    def read_once_bytes(self, features: int = 0) -> int: ...
    @property
    def gathered_bytes_per_token(self) -> int: ...
    @property
    def logits_per_token(self) -> int: ...
    def kv_bytes_per_column(self, rows: int) -> int: ...


def dims_of(model: Any) -> Dims:
    """The dims of a loaded model (`ModelDims.from_model`) or of a draft head that describes
    itself (``work_dims()``). Raises ValueError for a model the rule cannot count."""
    own = getattr(model, "work_dims", None)
    return own() if callable(own) else ModelDims.from_model(model)


@dataclass(frozen=True)
class Work:
    """FLOPs and bytes moved, by what moves them; adds up over forwards with ``+``."""

    flops: int = 0
    weight_bytes: int = 0
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0
    logits_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.logits_bytes

    def __add__(self, other: Work) -> Work:
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Work)))


def forward_work(dims: Dims, rows: int, new: int, kv_columns: int,
                 concat_cache: bool = True, features: int = 0) -> Work:
    """The work of one forward: ``rows`` rows of ``new`` tokens over ``kv_columns`` attended
    columns (``kv_columns - new`` were cached before it). ``concat_cache``: the KV cache appends
    by concatenation (transformers' ``DynamicCache``: a copy of the cache per forward); False for
    a static cache written in place. ``features``: a head's feature input width (`HeadDims`)."""
    if rows < 0 or new < 0 or kv_columns < new:
        raise ValueError(f"a forward needs rows >= 0, new >= 0 and kv_columns >= new; got rows={rows}, "
                         f"new={new}, kv_columns={kv_columns}")
    tokens = rows * new
    cached = kv_columns - new
    attention = 4 * rows * dims.layers * dims.heads * dims.head_dim * new * kv_columns
    column = dims.kv_bytes_per_column(rows)
    return Work(
        flops=2 * tokens * dims.token_matrix_params(features) + attention,
        weight_bytes=dims.read_once_bytes(features) + tokens * dims.gathered_bytes_per_token,
        kv_read_bytes=column * (kv_columns + (cached if concat_cache else 0)),
        kv_write_bytes=column * (kv_columns if concat_cache else new),
        logits_bytes=dims.elem_bytes * tokens * dims.logits_per_token,
    )


def shapes_work(dims: Dims, shapes: Iterable[tuple[int, ...]], concat_cache: bool = True) -> Work:
    """The summed work of recorded forwards (`Forward`, or plain ``(rows, new, kv_columns)``)."""
    total = Work()
    for shape in shapes:
        f = Forward(*shape)
        total = total + forward_work(dims, f.rows, f.new, f.kv_columns, concat_cache, f.features)
    return total
