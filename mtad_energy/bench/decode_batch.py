"""The decoding batch-size sweep: every decoder on B rows at once, tokens/s and J/token per B, and
the batch size from which a drafting decoder stops beating ``ar``.

One ``decode_batch`` row per (decoder, parameters, batch size, repeat): B prompts (the dataset's,
cycled to fill B) decoded together by `generate_rows`, the decode phase inside one meter window.
Per row: tokens (all B rows), ``decode_tokens`` (those the decode window holds: all of them for
the project's decoders; an engine's first tokens stream out of the prefill window), decode time,
tokens/s = decode_tokens / decode time, decode energy and J/token = decode energy / decode_tokens
(or n/a with the reason), block efficiency (tokens per target forward of a row while it
decodes; rows done early ride along in the forwards, which tokens/s counts),
acceptance rate and the rows' mean perplexity under the unwarped target (outside the window),
and what the energy attribution reads (`results.breakdown`): the batch's draft / target / other
seconds and counted FLOPs and bytes (those of the row that decoded longest: its forwards are the
batch's), and the rows' draft tokens proposed and accepted and iterations.
The forward-only study (`batch_sweep.py`) is separate and unchanged.

``compile``: the compiled path (static caches padded to row buckets, CUDA graphs on CUDA), stored
under model ``<model>+compile`` so its rows never pool with eager ones; each (decoder, B) first
runs a full-length unmeasured generation that compiles every shape: the (decoder, B)'s first
measured row carries its seconds (``compile_s``) and graphs (``graphs_compiled``), later repeats 0;
a row that still compiled inside its window is flagged ``compiled_in_window``
(``compile_in_window_s`` says how long, also counted in ``compile_s``). Every row
stores the batch's peak memory (``peak_memory_bytes``) and what other processes took during its
decode window (``others_cpu_s``, ``others_cores``, ``contended``: `measure.contention`). A batch
size whose caches would not fit in the free memory is skipped with the reason (``on_skip``), as is
one that runs out of memory: a sweep to B = 128 never ends in an out-of-memory crash.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mtad_energy.bench.budget import Budget
from mtad_energy.bench.phase_windows import FLAG_COMPILED_IN_WINDOW, measure_generation
from mtad_energy.config import DecoderSpec, compile_arg, compile_identity, compile_label
from mtad_energy.decoding.registry import expand_variants
from mtad_energy.decoding.runtime.stats import Generation
from mtad_energy.engines import Engine, WarmUp, open_hf
from mtad_energy.engines.base import EngineDecoder, known_sum, with_perplexity
from mtad_energy.measure import EnergyMeter
from mtad_energy.measure.contention import ContentionProbe, gpu_processes
from mtad_energy.models import ModelPair
from mtad_energy.results.schema import params_json, stable_key, without_unseen_energy
from mtad_energy.results.store import ResultStore, RowExistsError


@dataclass
class DecodeBatchReport:
    rows: list[dict[str, Any]]  # every row the sweep asked for (stored before or now)
    ran: int  # measured by this call
    skipped: int  # already stored (earlier, or by another worker meanwhile)


def decode_batch_sweep(
    pair: ModelPair,
    decoders: Sequence[DecoderSpec],
    sizes: Sequence[int],
    prompts: Sequence[list[int]],
    store: ResultStore,
    meter: EnergyMeter,
    *,
    model: str = "custom",
    dataset: str = "custom",
    max_new_tokens: int = 32,
    repeats: int = 1,
    seed: int = 0,
    env_id: str = "",
    progress: Callable[[dict[str, Any], bool], object] | None = None,
    compile: bool = False,
    on_skip: Callable[[str, int, str], object] | None = None,
    engine: Engine | None = None,
    first_repeat: int = 0,
    budget: Budget | None = None,
    compile_backend: str | None = None,
    compile_dynamic: bool = False,
) -> DecodeBatchReport:
    """Run every decoder (variants expanded, `decoding.registry.expand_variants`: the command
    line's specs arrive expanded by `cli.options.decoder_specs`, a library caller may give comma
    lists) at every batch size, the
    decoders interleaved within each repeat (so drift and load hit them alike); rows the
    store holds already are not rerun, and a row another worker stores meanwhile (into the same
    store) counts as skipped, as in `Runner`. ``progress(row, ran)`` is called once per row
    (``ran``: measured now, not found stored); ``on_skip(label, batch size, reason)`` hears of
    every size skipped for memory. ``engine``: decode with a loaded engine (`mtad_energy.engines`)
    instead of the project's decoders (``pair`` then gives the prompts' perplexity only); its rows
    are stored under model ``<model>+<engine>`` with the engine columns in their key. Once
    ``budget`` is spent no new row starts (`bench.budget`: counted in ``budget.left``).
    ``compile_backend`` / ``compile_dynamic``: how ``compile`` compiles (`config.compile_arg`);
    such rows are stored under ``<model>+compile-<backend>[-dynamic]``.
    ``first_repeat``: the repeats are numbered from it (new repeats of configurations the store
    holds, measured beside new ones: `bench.schedule_check`)."""
    compiling = compile_arg(compile, compile_backend, compile_dynamic)  # refuses them without it
    decoders = expand_variants(decoders)
    bad = [b for b in sizes if int(b) != b or b < 1]
    if bad or not sizes:
        raise ValueError(f"batch sizes must be positive integers, got {list(sizes) or 'none'}")
    if not prompts:
        raise ValueError("give at least one prompt")
    # the project's decoders unless another engine is given; every engine is held alike below
    engine = engine if engine is not None else open_hf(pair, compile=compiling, meter=meter)
    # refused before anything runs: --compile, a parameter, a size the engine cannot honour
    engine.check_compile(compiling)
    params = {spec: engine.params(spec) for spec in decoders}  # validates every parameter
    engine.check_batch(decoders, max(sizes))
    columns = engine.columns()
    probe = ContentionProbe(gpu_pids=gpu_processes(engine.device))  # others' share per window
    stored = store.load("decode_batch") if store.keys("decode_batch") else None
    label = model + engine.model_suffix + (
        compile_label(compile_backend, compile_dynamic) if compile else "")
    out, ran = [], 0
    for b in dict.fromkeys(int(s) for s in sizes):
        rows = [prompts[i % len(prompts)] for i in range(b)]  # shared, cheap at any size
        # what cannot fit is said before the rows' keys are hashed (at B = 10^7, minutes)
        skipped = _too_big(engine, decoders, rows, max_new_tokens, on_skip)
        if len(skipped) == len(decoders):
            continue
        rows = [list(r) for r in rows]
        warm: dict[DecoderSpec, WarmUp] = {}  # warmed up at this size: what each warm-up left
        # decoders interleaved per repeat (drift and load hit them alike), each warmed up once
        # at this size before its first measured row (compiled: every shape)
        for rep in range(first_repeat, first_repeat + repeats):
            for spec in decoders:
                if spec in skipped:
                    continue
                identity = {
                    "model": label, "target_id": pair.target_id, "draft_id": engine.draft_id(spec),
                    "decoder": spec.name, "params_json": params_json(params[spec]),
                    "batch_size": b, "dataset": dataset, "prompts": stable_key({"ids": rows}),
                    "max_new_tokens": max_new_tokens, "seed": seed + rep, "repeat": rep,
                    "meter": meter.name, "device": engine.device, "dtype": engine.dtype,
                    # eager rows keep their keys, compiled rows with the defaults theirs
                    **(compile_identity(compile_backend, compile_dynamic) if compile else {}),
                    **engine.key_columns(),  # hf adds nothing: its rows keep their old keys
                }
                key = stable_key(identity)
                row, measured = _stored_row(store, stored, key), False
                if row is None and budget is not None and budget.skip():
                    continue
                if row is None:
                    try:  # first calls (compiled: every shape), unmeasured; then the row, which
                        # gets the warm-up's compile cost (what cannot fit was skipped above; an
                        # engine says when it is full)
                        fresh = spec not in warm
                        if fresh:
                            warm[spec] = engine.warm_up(spec, rows, max_new_tokens, seed)
                        row = _measure(EngineDecoder(engine, spec), pair, rows, max_new_tokens,
                                       seed=seed + rep, meter=meter, key=key, probe=probe,
                                       warm=warm[spec].generations if fresh else ())
                    except torch.OutOfMemoryError as error:
                        skipped.add(spec)
                        if on_skip is not None:
                            on_skip(spec.label, b, _out_of_memory(b, error))
                        continue
                    row = without_unseen_energy({  # compiled + simulated: static joules alone
                        "row_key": key, "created_unix_s": time.time(), "env_id": env_id,
                        **identity, **columns, "label": spec.label, "compile": compile, **row,
                        **warm[spec].host_work})
                    try:
                        store.write("decode_batch", key, [row])
                        measured = True
                    except RowExistsError:  # another worker stored it while this one measured
                        row = _stored_row(store, None, key)
                out.append(row)
                ran += measured
                if progress is not None:
                    progress(row, measured)
    return DecodeBatchReport(out, ran, len(out) - ran)


def _stored_row(store: ResultStore, stored, key: str) -> dict[str, Any] | None:
    """The stored row with ``key``: from the frame loaded at the start, else from the store (a
    row another worker wrote since then), else None."""
    if stored is not None and (stored["row_key"] == key).any():
        return stored[stored["row_key"] == key].iloc[0].to_dict()
    if store.has("decode_batch", key):
        frame = store.load("decode_batch")
        return frame[frame["row_key"] == key].iloc[0].to_dict()
    return None


def _too_big(engine: Engine, decoders: Sequence[DecoderSpec], rows: list, max_new_tokens: int,
             on_skip: Callable[[str, int, str], object] | None) -> set[DecoderSpec]:
    """The decoders that ``engine`` says would not fit the free memory at ``len(rows)`` rows
    (`Engine.does_not_fit`), each reported through ``on_skip``."""
    out = set()
    for spec in decoders:
        why = engine.does_not_fit(spec, rows, max_new_tokens)
        if why is not None:
            out.add(spec)
            if on_skip is not None:
                on_skip(spec.label, len(rows), why)
    return out


def _out_of_memory(b: int, error: BaseException) -> str:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return f"out of memory at batch size {b}: {str(error).splitlines()[0][:160]}"


def known_max(values: Sequence[Any]) -> Any:
    """The largest count, None if any is unknown."""
    return None if any(v is None for v in values) else max(values)


def _measure(decoder: EngineDecoder, pair: ModelPair, rows: list[list[int]],
             max_new_tokens: int, *, seed: int, meter: EnergyMeter, key: str,
             warm: Sequence[Generation] = (),
             probe: ContentionProbe | None = None) -> dict[str, Any]:
    """One row of the sweep: the batch measured (`measure_generation`), its perplexities scored
    under the HF target outside the window, and the batch's figures."""
    measured = measure_generation(decoder.engine, decoder.spec, rows, max_new_tokens, seed, meter,
                                  key=key, probe=probe, warm=warm)
    gens = [with_perplexity(g, pair, r) for g, r in zip(measured.generations, rows, strict=True)]
    m = measured.windows.measurements["decode"]
    flags = set(m.flag_codes) | ({FLAG_COMPILED_IN_WINDOW} if measured.compiled_in_window
                                 else set())
    tokens = sum(g.stats.tokens_emitted for g in gens)
    # the decode window's tokens (a streaming engine's first tokens are the prefill window's)
    # over its seconds: each row's decode time runs from the window's start to its last token
    in_window = sum(g.stats.decode_tokens for g in gens)
    decode_s = max(g.stats.decode_time_s for g in gens)
    target_fw = known_max([g.stats.target_forwards for g in gens])  # None: the engine cannot tell
    depth, accepted = (known_sum([g.stats.draft_depth for g in gens]),
                       known_sum([g.stats.draft_accepted for g in gens]))
    ppl = [g.stats.perplexity for g in gens if g.stats.perplexity is not None]
    energy = m.energy_j
    last = max((g.stats for g in gens), key=lambda s: s.iterations)
    return {
        "tokens": tokens, "decode_tokens": in_window, "decode_time_s": decode_s,
        "tokens_per_s": in_window / decode_s if decode_s > 0 else float("inf"),
        "iterations": max(g.stats.iterations for g in gens), "target_forwards": target_fw,
        "draft_forwards": known_max([g.stats.draft_forwards for g in gens]),
        # per row: its tokens per target forward while it was decoding (a row done early rides
        # along in the batch's forwards: that costs time, counted in tokens/s, not here)
        "block_efficiency": (tokens / max(1, fw) if (fw := known_sum(
            [g.stats.target_forwards for g in gens])) is not None else None),
        # a server's counters give the batch's rate, not each row's counts
        "acceptance_rate": (accepted / depth if depth and accepted is not None
                            else gens[0].stats.acceptance_rate if depth is None else None),
        "perplexity": sum(ppl) / len(ppl) if ppl else None,
        "energy_j": energy,
        "energy_per_token_j": energy / in_window if energy is not None and in_window else None,
        "energy_reason": m.reason if energy is None else None,
        "energy_flags": json.dumps(sorted(flags)),
        "peak_memory_bytes": measured.peak_memory_bytes, **measured.compiling,
        "time_draft_s": last.time_draft_s, "time_target_s": last.time_target_s,
        "time_other_s": last.time_other_s, "draft_flops": last.draft_flops,
        "draft_bytes": last.draft_bytes, "target_flops": last.target_flops,
        "target_bytes": last.target_bytes,
        "draft_proposed": known_sum([g.stats.draft_proposed for g in gens]),
        "draft_accepted": accepted,
        "rows_iterations": sum(g.stats.iterations for g in gens),
        **measured.windows.contention_columns(("decode",)),  # the decode window's, as its time and joules
    }
