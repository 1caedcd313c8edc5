"""The project's own decoders as an engine (``hf``), behind the contract vLLM and llama.cpp meet.

An `HfEngine` decodes with the project's decoders (`mtad_energy.decoding`) over a loaded
`ModelPair`: eager transformers with a dynamic cache, or the static-cache compiled path
(``compile``: `decoding.runtime.compiled.CompileOptions`). The runner and the batched sweep
hold it as they hold any `Engine`: one window sequence, one row mapping, no branch on which engine
generates. What only the project's decoders have lives here, behind the contract's hooks:

* the forwards' work is tapped for a meter that needs to see it (the simulated roofline device,
  `measure.simulated.tapped_apart`): in an untimed pass before a measured generation, whose
  windows are charged what it saw (mitigated repetitions: tapped as they run);
* the warm-up is full length when compiled (every shape compiles there, not inside a window) and
  its host work per iteration is counted (`counted_generation`), for the rows measured after it;
* shapes: compiled rows share graphs by row bucket and slot bucket (`shape_key`), and a compiled
  warm-up at a new row bucket first frees the static caches of the others (`release_graphs`);
* memory: a batch whose caches and logits would not fit is said before it runs (`does_not_fit`);
* FLOP/byte accounting of the project's forwards (`profile_ops`);
* rows keep the keys hf rows always had (`key_columns` adds nothing) and the model label none.

Decoders are built from their specs on first use (their parameters validated: `check` builds them
all up front) and kept for the engine's life.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mtad_energy.decoding.registry import build_decoder, check_batched, head_kinds
from mtad_energy.decoding.runtime.compiled import CompileOptions
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.generate import (
    PhaseHook,
    check_beams,
    generate_ids,
    generate_rows,
    slots_needed,
)
from mtad_energy.decoding.runtime.memory import does_not_fit
from mtad_energy.decoding.runtime.stats import Generation
from mtad_energy.engines.base import Engine, WarmUp, thread_settings
from mtad_energy.engines.registry import HF, engine_kind
from mtad_energy.measure.host_work import HostWork, HostWorkCounter
from mtad_energy.measure.simulated import tapped_apart

if TYPE_CHECKING:  # types only
    from mtad_energy.models import ModelPair
    from mtad_energy.specs import DecoderSpec


def warm_up_tokens(max_new_tokens: int, compile: object) -> int:
    """Tokens of a configuration's warm-up generation: full length when compiled (every shape
    the loop uses compiles there, not inside a measured window), a few when eager (first-call
    allocations and kernel selection). Its host work is counted over those iterations."""
    return max_new_tokens if compile else min(8, max_new_tokens)


def counted_generation(decoder: Decoder, pair: ModelPair, prompts: Sequence[list[int]],
                       max_new_tokens: int, seed: int = 0,
                       compile: bool | CompileOptions = False,
                       counter: HostWorkCounter | None = None
                       ) -> tuple[list[Generation], HostWork]:
    """Decode ``prompts`` together (`generate_rows`) with ``counter`` (a fresh
    `HostWorkCounter` by default) counting the decode phase, in a pass no timed window shares;
    its work is divided by the generation's iterations (the batch's: the most any row ran)."""
    counter = counter if counter is not None else HostWorkCounter()
    gens = generate_rows(decoder, pair, list(prompts), max_new_tokens, seed=seed,
                         compute_perplexity=False, on_phase=counter, compile=compile)
    return gens, counter.result(max(g.stats.iterations for g in gens))


class HfEngine(Engine):
    """The project's decoders over ``pair``; ``compile``: False (eager) or the compiled path's
    options; ``meter``: the meter whose windows measure the generations (tapped where it needs
    to see the forwards' work; None: no tap)."""

    name = HF

    def __init__(self, pair: ModelPair, *, compile: bool | CompileOptions = False,
                 meter: Any = None):
        self.kind = engine_kind(HF)
        self.model, self.options = None, {}
        self.pair, self.compile, self.meter = pair, compile, meter
        desc = pair.describe()
        self.device, self.dtype = desc["device"], desc["dtype"]
        self.context_length = None  # the pair's own (`ModelPair.context_length`)
        import transformers

        self.version = f"transformers {transformers.__version__}"
        self.config = {"decoders": "mtad-energy", "compile": bool(compile), **thread_settings()}
        self._decoders: dict[DecoderSpec, Decoder] = {}
        self._row_bucket: int | None = None  # of the last compiled warm-up (static caches held)

    # -- the decoders ---------------------------------------------------------------------
    def decoder(self, spec: DecoderSpec) -> Decoder:
        """``spec``'s decoder, built once (its parameters validated then)."""
        if spec not in self._decoders:
            self._decoders[spec] = build_decoder(spec)
        return self._decoders[spec]

    def check(self, specs: Sequence[DecoderSpec]) -> list[Decoder]:
        """Build every decoder of ``specs`` now: a bad parameter is refused before anything runs."""
        return [self.decoder(s) for s in specs]

    # -- identity -------------------------------------------------------------------------
    def params(self, spec: DecoderSpec) -> dict[str, Any]:
        return {k: v for k, v in self.decoder(spec).config().items() if k != "decoder"}

    def draft_id(self, spec: DecoderSpec) -> str | None:
        return self.pair.draft_id_for(self.decoder(spec))

    def lookahead(self, spec: DecoderSpec) -> int:
        return self.decoder(spec).lookahead

    def key_columns(self) -> dict[str, Any]:
        return {}  # hf rows keep the keys they had before engines existed

    # -- what a batch needs ---------------------------------------------------------------
    def check_batch(self, specs: Sequence[DecoderSpec], batch_size: int,
                    option: str = "--batch-size") -> None:
        """Beside the engine's batch size: decoders that cannot decode B > 1 rows, and more
        beams than the vocabulary (`check_beams`), refused before any row runs."""
        decoders = self.check(specs)
        if batch_size > 1:
            check_batched(decoders)
        for decoder in decoders:
            check_beams(decoder, self.pair)

    def check_compile(self, compile: object) -> None:
        if bool(compile) != bool(self.compile):
            raise ValueError(f"this hf engine was opened with compile={bool(self.compile)}; open "
                             f"one with compile={bool(compile)} for these rows")

    def shape_key(self, spec: DecoderSpec, prompts: Sequence[list[int]],
                  max_new_tokens: int) -> tuple:
        """Eager: the batch size; compiled: the row bucket and the static cache's slot bucket
        (prompts of similar length share graphs)."""
        if not self.compile:
            return (len(prompts),)
        from mtad_energy.decoding.runtime.static_graphs import row_bucket, slot_bucket

        slots = slots_needed(self.decoder(spec), [len(p) for p in prompts], max_new_tokens)
        return row_bucket(len(prompts)), slot_bucket(slots)

    def does_not_fit(self, spec: DecoderSpec, prompts: Sequence[list[int]],
                     max_new_tokens: int) -> str | None:
        return does_not_fit(self.pair, self.decoder(spec), [list(p) for p in prompts],
                            max_new_tokens, bool(self.compile))

    # -- running --------------------------------------------------------------------------
    def generate(self, spec: DecoderSpec, prompts: Sequence[list[int]], max_new_tokens: int,
                 seed: int = 0, on_phase: PhaseHook | None = None) -> list[Generation]:
        """`generate_rows` under the meter's work tap; perplexity is left to the caller (outside
        every window, as for every engine)."""
        decoder = self.decoder(spec)

        def run(hook: PhaseHook | None) -> list[Generation]:
            return generate_rows(decoder, self.pair, [list(p) for p in prompts], max_new_tokens,
                                 seed=seed, compute_perplexity=False, on_phase=hook,
                                 compile=self.compile)

        # the simulated device's tap never runs on the timed forwards (`tapped_apart`)
        return tapped_apart(self.meter, (self.pair.target, decoder.draft_model(self.pair)), run,
                            on_phase, compiled=bool(self.compile))

    def warm_up(self, spec: DecoderSpec, prompts: Sequence[list[int]], max_new_tokens: int,
                seed: int = 0) -> WarmUp:
        """One unmeasured generation, full length when compiled, its host work counted; a
        compiled warm-up at a new row bucket first frees the static caches of the others."""
        if self.compile:
            from mtad_energy.decoding.runtime.static_graphs import release_graphs, row_bucket

            bucket = row_bucket(len(prompts))
            if self._row_bucket != bucket:  # the caches of other buckets (and engines) freed
                release_graphs()
            self._row_bucket = bucket
        gens, work = counted_generation(self.decoder(spec), self.pair, prompts,
                                        warm_up_tokens(max_new_tokens, self.compile), seed,
                                        self.compile)
        return WarmUp(tuple(gens), work.columns())

    def profile_ops(self, spec: DecoderSpec, prompt_ids: list[int], max_new_tokens: int,
                    seed: int = 0) -> tuple[Any, Generation]:
        from mtad_energy.measure import profile_ops

        out: list[Generation] = []
        device = "cuda" if self.device.startswith("cuda") else "cpu"
        prof = profile_ops(lambda: out.append(generate_ids(
            self.decoder(spec), self.pair, prompt_ids, max_new_tokens, seed=seed,
            compute_perplexity=False)), device=device)
        return prof, out[0]


def project_decoders(engines: str | Sequence[str], specs: Sequence[DecoderSpec]) -> list[Decoder]:
    """The project's decoders of ``specs``, built (`registry.build_decoder`: a bad parameter is
    refused here, before any weight loads), where the engine hf runs them (``engines``: a name
    or a list, hf among them); none otherwise: another engine's values (vLLM's gamma=0) are its
    own to check, never hf's."""
    names = [engines] if isinstance(engines, str) else list(engines)
    return [build_decoder(spec) for spec in specs] if HF in names else []


def pair_roles(engine: str, specs: Sequence[DecoderSpec]) -> tuple[bool, tuple[str, ...]]:
    """What the pair must load for ``engine`` to decode ``specs``: (a draft model, the kinds of
    draft head). hf: what its decoders draft with (`project_decoders`); another engine: neither
    (its own model drafts; the pair gives prompt ids and perplexity)."""
    built = project_decoders(engine, specs)
    return any(d.needs_draft for d in built), head_kinds(built)


def open_hf(pair: ModelPair, specs: Sequence[DecoderSpec] = (), *,
            compile: bool | CompileOptions = False, meter: Any = None) -> HfEngine:
    """An `HfEngine` with ``specs``' decoders built (their parameters checked) up front."""
    engine = HfEngine(pair, compile=compile, meter=meter)
    engine.check(specs)
    return engine
