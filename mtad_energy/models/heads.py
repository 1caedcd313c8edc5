"""Draft heads that read the target's hidden states, in their public checkpoint layouts.

* **Medusa-1** (Cai et al. 2024; FasterDecoding/Medusa): K heads on the target's last hidden
  state (after the final norm), head k a stack of ResBlocks (x + SiLU(Linear(x))) and a
  Linear(H, V) predicting the token k + 2 positions ahead. Checkpoint: ``config.json`` with
  ``medusa_num_heads`` and ``medusa_num_layers``, weights ``medusa_lm_head.safetensors`` or
  ``medusa_lm_head.pt`` with keys ``{k}.{l}.linear.weight|bias`` and ``{k}.{L}.weight``.
* **EAGLE** (Li et al. 2024-2025; SafeAILab/EAGLE): one decoder layer over pairs (feature of
  position j, token j + 1) with its own KV cache. EAGLE-1/2 (``cnets1.py``): the feature is the
  target's last hidden state (after the final norm); ``fc`` (Linear(2H, H), bias) fuses
  [embedding, feature], then ``layers.0`` (a Llama layer without input norm), and the target's
  own LM head on its output. EAGLE-3 (``cnets.py``): the target features are the inputs of
  layers 2, L // 2 and L - 3, concatenated and reduced by ``fc`` (Linear(3H, H)); ``midlayer``
  attends over [input_layernorm(embedding), hidden_norm(feature)] (2H wide), ``norm`` and its
  own ``lm_head`` over a draft vocabulary mapped to the target's by ``d2t`` (target id = d +
  d2t[d]). Drafted positions feed the head's own output back as the feature. Checkpoint:
  ``config.json`` (a Llama config of one layer; EAGLE-3 adds ``draft_vocab_size``) and
  ``pytorch_model.bin`` or ``model.safetensors``; the embeddings come from the target unless
  the checkpoint has ``embed_tokens.weight``.

A head module is what a runner runs: `EagleHead` looks like a causal LM to them (ids, 4-D mask,
positions, a KV cache, plus ``features``) and returns its logits and, as ``hidden_states``, its
output feature; `MedusaHeads` has no cache (`decoding.head_runner.HeadRunner` runs it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mtad_energy.energy.work import HeadDims
from mtad_energy.hf_cache import cache_from, cache_kwargs
from mtad_energy.models.shapes import output_size

EAGLE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
HEAD_KINDS = ("eagle", "medusa")
# targets whose hidden states transformers returns by index and whose layers EAGLE's code taps
EAGLE_TARGETS = frozenset({"llama", "mistral", "qwen2"})


class HeadLoadError(ValueError):
    """A head checkpoint that cannot be used with this target (missing, other layout, shapes)."""


# --------------------------------------------------------------------------- Medusa

class ResBlock(nn.Module):
    """Medusa's residual block: x + SiLU(Linear(x))."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa-1 heads: ``forward(h [..., H]) -> logits [..., K, V]`` (head k predicts the
    token k + 2 positions after the one whose hidden state h is)."""

    cacheless = True  # no KV cache: `decoding.head_runner.HeadRunner` runs it

    def __init__(self, hidden: int, vocab: int, heads: int, layers: int = 1):
        super().__init__()
        self.config = {"medusa_num_heads": heads, "medusa_num_layers": layers,
                       "hidden_size": hidden, "vocab_size": vocab}
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(layers)],
                          nn.Linear(hidden, vocab, bias=False))
            for _ in range(heads))

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def dtype(self) -> torch.dtype:
        return self.heads[0][-1].weight.dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(hidden) for head in self.heads], -2)

    def work_dims(self) -> HeadDims:
        """Every head's ResBlocks and vocabulary projection on every token; no attention."""
        matrix, other = _params(self)
        vocab = self.heads[0][-1].out_features
        return HeadDims("medusa", matrix, other, 0, 0, 0, layers=0, heads=0, kv_heads=0,
                        head_dim=0, embed_dim=0, logits_per_token=self.num_heads * vocab,
                        elem_bytes=_elem_bytes(self))


# --------------------------------------------------------------------------- EAGLE

@dataclass
class EagleOutput:
    """What a runner reads from a head's forward (as from a causal LM's)."""

    logits: torch.Tensor  # [B, k, V'] over the head's vocabulary
    hidden_states: tuple[torch.Tensor, ...]  # (its output feature [B, k, H],)


class EagleLayer(nn.Module):
    """The head's one decoder layer, named as in the public checkpoints (EAGLE-1 ``layers.0``,
    EAGLE-3 ``midlayer``); attention and MLP are transformers' Llama modules, so the head runs
    on any runner's cache (dynamic or static) with a custom 4-D mask."""

    def __init__(self, config, version: int):
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        super().__init__()
        hidden = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        if version == 3:  # q, k, v read [embedding, feature]: 2H wide
            attn = self.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(2 * hidden, old.out_features, bias=False))
            self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.version = version

    def forward(self, emb: torch.Tensor, feature: torch.Tensor, position_embeddings,
                attention_mask, cache) -> torch.Tensor:
        residual = feature
        if self.version == 3:
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], -1)
        else:  # EAGLE-1: the fused input goes in as it is (layer 0 has no input norm)
            x = feature
        attn, _ = self.self_attn(x, position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, **cache_kwargs(cache))
        x = residual + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 draft head (see the module docstring) over a target model.

    ``forward(input_ids [B, k], features [B, k, F], attention_mask, position_ids, cache)``:
    position j's pair is (feature of position j, token j + 1); F is the
    target's feature width (H, or 3H for EAGLE-3) or the head's own H (drafted positions)."""

    def __init__(self, config, version: int, target, fc_bias: bool = True):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        self.config = config
        self.version = version
        hidden = config.hidden_size
        self.target_hidden = _hidden_size(target.config)
        self.embed_tokens = target.get_input_embeddings()  # replaced if the checkpoint has one
        self.rotary_emb = LlamaRotaryEmbedding(config)
        if version == 1:
            self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
            self.layers = nn.ModuleList([EagleLayer(config, 1)])
            self.lm_head = target.get_output_embeddings()  # EAGLE-1 decodes with the target's
        else:
            self.fc = nn.Linear(3 * self.target_hidden, hidden, bias=False)
            self.midlayer = EagleLayer(config, 3)
            self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.target_layers_total = target.config.num_hidden_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def layer(self) -> EagleLayer:
        return self.layers[0] if self.version == 1 else self.midlayer

    def work_dims(self) -> HeadDims:
        """Its decoder layer and LM head on every token, counted from the loaded weights (2H-wide
        q/k/v, a draft vocabulary); EAGLE-1's ``fc`` on every token too, EAGLE-3's only on the
        forwards fed the target's features (its own are H wide and skip it)."""
        layer_matrix, layer_other = _params(self.layer, self.lm_head,
                                            *(() if self.version == 1 else (self.norm,)))
        fc_matrix, fc_other = _params(self.fc)
        attn = self.layer.self_attn
        common = {"layers": 1, "heads": self.config.num_attention_heads,
                  "kv_heads": self.config.num_key_value_heads, "head_dim": attn.head_dim,
                  "embed_dim": self.embed_tokens.embedding_dim,
                  "logits_per_token": self.lm_head.out_features, "elem_bytes": _elem_bytes(self)}
        if self.version == 1:
            return HeadDims("eagle-1", layer_matrix + fc_matrix, layer_other + fc_other, 0, 0, 0,
                            **common)
        return HeadDims("eagle-3", layer_matrix, layer_other, fc_matrix, fc_other,
                        self.fc.in_features, **common)

    def target_hidden_states(self) -> tuple[int, ...]:
        """The target's hidden states the head reads (`ModelRunner` indices): the last layer's
        output after the final norm (EAGLE-1), or the inputs of layers 2, L // 2 and L - 3
        (EAGLE-3, as SafeAILab's modeling_llama_kv taps them)."""
        n = self.target_layers_total
        return (-1,) if self.version == 1 else tuple(sorted({2, n // 2, n - 3}))

    @property
    def d2t_map(self) -> torch.Tensor | None:
        """EAGLE-3's draft-to-target offsets ``[V']`` (None: EAGLE-1 shares the vocabulary)."""
        return self.d2t if self.version == 3 else None

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Head vocabulary ids -> target ids (`draft_to_target` with `d2t_map`)."""
        return draft_to_target(ids, self.d2t_map)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache=None,
                use_cache: bool = True, output_hidden_states: Any = None,
                **kwargs) -> EagleOutput:
        # the runner names the cache as the installed transformers does (`hf_cache`)
        cache = cache_from({"cache": cache, **kwargs})
        emb = self.embed_tokens(input_ids).to(self.dtype)
        feature = features.to(self.dtype)
        if self.version == 1:
            feature = self.fc(torch.cat([emb, feature], -1))
        elif feature.shape[-1] != self.config.hidden_size:  # the target's 3 layers
            feature = self.fc(feature)
        if position_ids is None:  # a plain chain after the cache (as a causal LM does)
            k = input_ids.shape[1]
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = past + torch.arange(k, device=input_ids.device)[None]
            if attention_mask is None and k > 1:
                cols = torch.arange(past + k, device=input_ids.device)
                allowed = cols[None, :] <= position_ids[0, :, None]  # [k, past + k]
                attention_mask = torch.zeros(allowed.shape, dtype=self.dtype,
                                             device=allowed.device).masked_fill(
                    ~allowed, torch.finfo(self.dtype).min)[None, None]
        pos = self.rotary_emb(feature, position_ids=position_ids)
        out = self.layer(emb, feature, pos, attention_mask, cache)
        logits = self.lm_head(out if self.version == 1 else self.norm(out))
        return EagleOutput(logits, (out,))


def draft_to_target(ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Head vocabulary ids -> target ids: ``ids + d2t[ids]`` (EAGLE-3's offsets), or ``ids``
    (``d2t`` None). Pure: a compiled kernel maps its draws with it."""
    return ids if d2t is None else ids + d2t[ids]


def _params(*modules: nn.Module) -> tuple[int, int]:
    """(matrix weights, other parameters) of ``modules``: every Linear's weight counts as a
    matrix, its bias and every norm's weight as other; embeddings are left out (a forward
    gathers rows of them, it does not read them whole)."""
    matrix = other = 0
    for module in modules:
        for m in module.modules():
            if isinstance(m, nn.Embedding):
                continue
            own = dict(m.named_parameters(recurse=False))
            if isinstance(m, nn.Linear):
                matrix += own.pop("weight").numel()
            other += sum(p.numel() for p in own.values())
    return matrix, other


def _elem_bytes(module: nn.Module) -> int:
    return next(p.element_size() for p in module.parameters() if p.is_floating_point())


def _hidden_size(config) -> int:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return cfg.hidden_size


# --------------------------------------------------------------------------- loading

def head_dir(source: str, kind: str) -> Path:
    """A local directory holding a head checkpoint: ``source`` itself, or a hub id's snapshot in
    the local Hugging Face cache (no download: the project's machines have no hub access)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or source.startswith(("/", "./", "../", "~")) or source.count("/") > 1:
        raise HeadLoadError(f"{kind} head {source!r}: no such directory; pass the directory "
                            f"that holds the {kind} checkpoint (config.json and its weights)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or not a valid repo id
        raise HeadLoadError(
            f"{kind} head {source!r} is not available offline: it is not a local directory and "
            "not in the Hugging Face cache. Fix: on a machine with internet run `hf download "
            f"{source}` (it is then cached), or pass a local directory: --draft {kind}:DIR"
        ) from None


def _weights(directory: Path, names: tuple[str, ...], kind: str) -> dict[str, torch.Tensor]:
    for name in names:
        path = directory / name
        if path.is_file():
            try:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    return load_file(str(path))
                return torch.load(path, map_location="cpu", weights_only=True)
            except Exception as err:  # SafetensorError, UnpicklingError, EOFError, ...
                raise HeadLoadError(f"{kind} head: cannot read the weights file {path} "
                                    f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                                    f"it is damaged or not a {kind} checkpoint: download it "
                                    "again") from None
    files = ", ".join(sorted(p.name for p in directory.iterdir())[:10]) or "none"
    raise HeadLoadError(f"{kind} head in {directory}: no weights file ({' or '.join(names)}); "
                        f"files there: {files}")


def _config(directory: Path, kind: str) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise HeadLoadError(f"{kind} head in {directory}: no config.json (the {kind} checkpoint "
                            "layout has one beside the weights)")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, OSError) as err:
        raise HeadLoadError(f"{kind} head: {path} is not valid JSON ({err}); restore the "
                            f"checkpoint's config.json") from None
    if not isinstance(cfg, dict):
        raise HeadLoadError(f"{kind} head: {path} holds {type(cfg).__name__}, not a JSON object; "
                            "restore the checkpoint's config.json")
    return cfg


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise HeadLoadError(message)


def load_medusa(directory: Path, target) -> MedusaHeads:
    """Medusa-1 heads from ``directory`` (see the module docstring), on the target's device and
    dtype, checked against its hidden size and vocabulary."""
    cfg = _config(directory, "medusa")
    _check("medusa_num_heads" in cfg, f"medusa head in {directory}: config.json has no "
           "medusa_num_heads (is it a Medusa-1 checkpoint?)")
    state = {k.removeprefix("medusa_head."): v
             for k, v in _weights(directory, MEDUSA_WEIGHTS, "medusa").items()}
    heads, layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    out = state.get(f"0.{layers}.weight")
    _check(out is not None, f"medusa head in {directory}: no '0.{layers}.weight' for "
           f"medusa_num_layers={layers}; keys: {sorted(state)[:6]}")
    vocab, hidden = out.shape
    t_vocab, t_hidden = target.get_output_embeddings().weight.shape  # what the LM head reads
    _check(hidden == t_hidden and vocab == t_vocab,
           f"medusa head in {directory} is for hidden size {hidden} and {vocab} tokens; the "
           f"target has {t_hidden} and {t_vocab}: use the heads trained for this target")
    module = MedusaHeads(hidden, vocab, heads, layers)
    missing, unexpected = module.heads.load_state_dict(state, strict=False)
    _check(not missing and not unexpected,
           f"medusa head in {directory}: weights do not match medusa_num_heads={heads}, "
           f"medusa_num_layers={layers} (missing {missing[:4]}, unexpected {unexpected[:4]})")
    return _place(module, target)


def check_eagle_target(model_type: str, target: str) -> None:
    """Refuse an EAGLE head for a target outside the Llama family (its layer is a Llama layer
    over the target's hidden states): a `HeadLoadError` naming the target and what to use."""
    _check(model_type in EAGLE_TARGETS,
           f"EAGLE heads are for Llama-family targets ({', '.join(sorted(EAGLE_TARGETS))}); the "
           f"target {target} is model_type={model_type!r}: drop the eagle: head (and the eagle "
           "decoder), or use a Llama-family target (e.g. random:tiny-llama, random:llama3.1-8b)")


def load_eagle(directory: Path, target) -> EagleHead:
    """An EAGLE-1 or EAGLE-3 head from ``directory`` (the version is read from its keys), on the
    target's device and dtype, checked against the target."""
    from transformers import LlamaConfig

    check_eagle_target(getattr(target.config, "model_type", "?"), type(target).__name__)
    raw = _config(directory, "eagle")
    state = _weights(directory, EAGLE_WEIGHTS, "eagle")
    if any(k.startswith("midlayer.") for k in state):
        version = 3
    elif any(k.startswith("layers.0.") for k in state):
        version = 1
    else:
        raise HeadLoadError(f"eagle head in {directory}: neither an EAGLE-1 (layers.0.*) nor an "
                            f"EAGLE-3 (midlayer.*) checkpoint; keys: {sorted(state)[:6]}")
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**{**fields, "num_hidden_layers": 1})
    config._attn_implementation = getattr(target.config, "_attn_implementation", None) or "sdpa"
    t_hidden, t_vocab = _hidden_size(target.config), output_size(target)
    if version == 1 or "embed_tokens.weight" not in state:  # it reads the target's embeddings
        _check(config.hidden_size == t_hidden, f"EAGLE-{version} head in {directory} has hidden "
               f"size {config.hidden_size}, the target {t_hidden}: use the head trained for it")
    _check(config.vocab_size == t_vocab, f"eagle head in {directory} is for {config.vocab_size} "
           f"tokens, the target has {t_vocab}: use the head trained for this target")
    taps = {2, target.config.num_hidden_layers // 2, target.config.num_hidden_layers - 3}
    _check(version == 1 or len(taps) == 3 and min(taps) >= 0,
           f"EAGLE-3 head in {directory}: it reads the inputs of layers 2, L // 2 and L - 3 of "
           f"the target, which are not 3 distinct layers for its L = "
           f"{target.config.num_hidden_layers}")
    bias = bool(raw.get("bias", True)) and "fc.bias" in state
    head = EagleHead(config, version, target, fc_bias=bias)
    if "embed_tokens.weight" in state:
        head.embed_tokens = nn.Embedding(*state["embed_tokens.weight"].shape)
    own = {k: v for k, v in state.items() if not (version == 1 and k.startswith("lm_head."))}
    missing, unexpected = head.load_state_dict(own, strict=False)
    shared = ("embed_tokens.", "rotary_emb.") + (("lm_head.",) if version == 1 else ())
    if version == 3 and head.lm_head.out_features == config.vocab_size:
        shared += ("d2t", "t2d")  # a full-vocabulary head: the maps are the identity (zeros)
    missing = [k for k in missing if not k.startswith(shared)]
    _check(not missing and not unexpected,
           f"eagle head in {directory} (EAGLE-{version}): weights do not match its config "
           f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    return _place(head, target)



def _place(module: nn.Module, target) -> nn.Module:
    param = next(target.parameters())
    return module.to(device=param.device, dtype=param.dtype).eval().requires_grad_(False)


# head sources that build random weights at the target's shapes instead of loading a checkpoint
# (timing at real shapes, as `--target random:SHAPE`): ``eagle:random`` an EAGLE-3 head whose
# draft vocabulary has 32000 tokens (as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; the target's if
# smaller), ``eagle:random-v1`` an EAGLE-1 head, ``medusa:random`` four Medusa-1 heads
RANDOM_HEADS = {"eagle": ("random", "random-v1"), "medusa": ("random",)}
EAGLE3_DRAFT_VOCAB = 32000


def random_head(kind: str, source: str, target) -> nn.Module:
    """The random-weight head a ``random`` source names (`RANDOM_HEADS`)."""
    if source not in RANDOM_HEADS[kind]:
        raise ValueError(f"{kind}:{source}: random {kind} heads are "
                         f"{', '.join(f'{kind}:{s}' for s in RANDOM_HEADS[kind])}")
    if kind == "medusa":
        return random_medusa(target, 4, seed=3)
    if source == "random-v1":
        return random_eagle(target, 1, seed=2)
    layers = target.config.num_hidden_layers
    taps = {2, layers // 2, layers - 3}
    if len(taps) < 3 or min(taps) < 0:
        raise ValueError(f"eagle:random is an EAGLE-3 head, which reads layers 2, L // 2 and L - 3: "
                         f"the target has {layers} layers; use eagle:random-v1 (EAGLE-1) for it")
    vocab = target.get_output_embeddings().weight.shape[0]
    return random_eagle(target, 3, seed=2, draft_vocab=EAGLE3_DRAFT_VOCAB if vocab > EAGLE3_DRAFT_VOCAB
                        else None)


def load_head(kind: str, source: str, target) -> nn.Module:
    """A ``kind`` ("eagle" / "medusa") head from a directory or a cached hub id, or a random
    one (`RANDOM_HEADS`)."""
    if source.startswith("random"):
        return random_head(kind, source, target)
    directory = head_dir(source, kind)
    return load_eagle(directory, target) if kind == "eagle" else load_medusa(directory, target)


def _is_head(part: str) -> bool:
    kind, sep, _ = part.partition(":")
    return bool(sep) and kind in HEAD_KINDS


def _draft_parts(spec: str) -> list[str]:
    """``spec`` split at its commas, except those inside a self-draft's list (``self:layers=0,2``:
    a piece that is not a head and follows one that is not a head continues it)."""
    parts: list[str] = []
    for piece in (p.strip() for p in spec.split(",")):
        if parts and not _is_head(piece) and not _is_head(parts[-1]):
            parts[-1] += "," + piece
        elif piece:
            parts.append(piece)
    return parts


def split_draft_spec(spec: str | None) -> tuple[str | None, dict[str, str]]:
    """``'self:int8,eagle:DIR,medusa:DIR'`` -> (the draft model, {head kind: source}). Each part
    is a draft model (hub id, directory, ``self:...``, whose own lists keep their commas:
    ``self:layers=0,2``) or ``KIND:SOURCE`` for a head; at most one draft model and one head of
    each kind."""
    if not spec:
        return None, {}
    model, heads = None, {}
    for part in _draft_parts(spec):
        kind, _, source = part.partition(":")
        if _is_head(part):
            if not source:
                raise ValueError(f"draft {part!r}: give the {kind} head's directory or hub id, "
                                 f"e.g. {kind}:path/to/{kind}-head")
            if kind in heads:
                raise ValueError(f"draft {spec!r} names two {kind} heads; give one")
            heads[kind] = source
        elif model is not None:
            raise ValueError(f"draft {spec!r} names two draft models ({model!r}, {part!r}); "
                             "give one, plus at most one eagle: and one medusa: head")
        else:
            model = part
    return model, heads


def random_eagle(target, version: int = 3, seed: int = 0,
                 draft_vocab: int | None = None) -> EagleHead:
    """An EAGLE head of the target's shapes with random weights (timing at real shapes: the
    GPU kit), on the target's device and dtype; EAGLE-3's lm_head over ``draft_vocab`` tokens
    (the target's first ones; all of them if None; EAGLE-3's Llama-3.1-8B head has 32000)."""
    from transformers import LlamaConfig

    t = target.config.get_text_config() if hasattr(target.config, "get_text_config") \
        else target.config
    config = LlamaConfig(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                         num_attention_heads=t.num_attention_heads,
                         num_key_value_heads=t.num_key_value_heads,
                         head_dim=getattr(t, "head_dim", None), num_hidden_layers=1,
                         vocab_size=t.vocab_size, rms_norm_eps=t.rms_norm_eps,
                         max_position_embeddings=t.max_position_embeddings,
                         rope_parameters=getattr(t, "rope_parameters", None))
    if version == 3 and draft_vocab:
        config.draft_vocab_size = draft_vocab
    config._attn_implementation = getattr(target.config, "_attn_implementation", None) or "sdpa"
    torch.manual_seed(seed)
    device = next(target.parameters()).device
    with torch.device(device):
        head = EagleHead(config, version, target)
    return _place(head, target)


def random_medusa(target, heads: int = 4, seed: int = 0) -> MedusaHeads:
    """Medusa-1 heads of the target's shapes with random weights (the GPU kit)."""
    torch.manual_seed(seed)
    vocab, hidden = target.get_output_embeddings().weight.shape
    with torch.device(next(target.parameters()).device):
        module = MedusaHeads(hidden, vocab, heads)
    return _place(module, target)


def describe(kind: str, head: nn.Module) -> str:
    """One line naming a loaded head's kind and size."""
    if isinstance(head, EagleHead):
        return f"EAGLE-{head.version} head ({head.config.hidden_size} hidden)"
    return f"Medusa-1 heads ({head.num_heads} heads)"

