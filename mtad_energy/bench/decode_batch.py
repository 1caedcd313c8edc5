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

import itertools
import json
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mtad_energy.bench.budget import Budget
from mtad_energy.bench.host_count import counted_generation, warm_up_tokens
from mtad_energy.bench.phase_windows import FLAG_COMPILED_IN_WINDOW, PhaseWindows, compile_columns
from mtad_energy.config import DecoderSpec, compile_arg, compile_identity, compile_label
from mtad_energy.decoding.registry import check_batched
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.generate import generate_rows, slots_needed
from mtad_energy.decoding.runtime.stats import Generation
from mtad_energy.engines import Engine, hf_columns
from mtad_energy.engines.base import EngineDecoder, with_perplexity
from mtad_energy.measure import EnergyMeter, peak_memory, work_tap
from mtad_energy.measure.contention import ContentionProbe, gpu_processes
from mtad_energy.measure.host_work import NO_HOST_WORK
from mtad_energy.models import ModelPair
from mtad_energy.models.shapes import free_memory_bytes
from mtad_energy.results.schema import params_json, stable_key, without_unseen_energy
from mtad_energy.results.store import ResultStore, RowExistsError


@dataclass
class DecodeBatchReport:
    rows: list[dict[str, Any]]  # every row the sweep asked for (stored before or now)
    ran: int  # measured by this call
    skipped: int  # already stored (earlier, or by another worker meanwhile)


def expand_variants(specs: Sequence[DecoderSpec]) -> list[DecoderSpec]:
    """One decoder per value of a comma list given to a scalar parameter (``--set gamma=1,2,3,5``:
    spd(gamma=1), ..., spd(gamma=5); several such parameters: their grid). A tuple-valued
    parameter (specinfer's ``branching=4,2,2``) keeps its comma list as one value."""
    from mtad_energy.decoding.registry import DECODERS

    out: list[DecoderSpec] = []
    for spec in specs:
        hints = typing.get_type_hints(DECODERS[spec.name].Params) if spec.name in DECODERS else {}
        axes = []
        for key, value in spec.params:
            scalar = typing.get_origin(hints.get(key)) is not tuple and hints.get(key) is not tuple
            if isinstance(value, str) and "," in value and scalar:
                axes.append([(key, v.strip()) for v in value.split(",") if v.strip()])
            else:
                axes.append([(key, value)])
        out += [DecoderSpec.of(spec.name, **dict(combo)) for combo in itertools.product(*axes)]
    return list(dict.fromkeys(out))


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
    """Run every decoder (variants expanded, `expand_variants`) at every batch size, the
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
    if engine is not None:  # refused before anything runs: a size or a parameter it lacks
        engine.kind.check_compile(compile)
        engine.kind.check_batch_size(max(sizes))
        built = {spec: EngineDecoder(engine, spec) for spec in decoders}
        desc = {"device": engine.device, "dtype": engine.dtype}
    else:
        built = {spec: spec.build() for spec in decoders}  # validates every parameter up front
        if max(sizes) > 1:
            check_batched(built.values())
        desc = pair.describe()
    columns = engine.columns() if engine is not None else hf_columns(compile)
    probe = ContentionProbe(gpu_pids=gpu_processes(desc["device"]))  # others' share per window
    stored = store.load("decode_batch") if store.keys("decode_batch") else None
    label = model + (f"+{engine.name}" if engine is not None else "") + (
        compile_label(compile_backend, compile_dynamic) if compile else "")
    out, ran = [], 0
    params = {spec: {k: v for k, v in d.config().items() if k != "decoder"}
              for spec, d in built.items()}
    for b in dict.fromkeys(int(s) for s in sizes):
        rows = [prompts[i % len(prompts)] for i in range(b)]  # shared, cheap at any size
        # what cannot fit is said before the rows' keys are hashed (at B = 10^7, minutes)
        skipped = _too_big(pair, built, rows, max_new_tokens, compile, on_skip) \
            if engine is None else set()
        if len(skipped) == len(built):
            continue
        rows = [list(r) for r in rows]
        warm: set[DecoderSpec] = set()  # warmed up at this size
        host: dict[DecoderSpec, dict[str, Any]] = {}  # host work per iteration, counted then
        released = False
        # decoders interleaved per repeat (drift and load hit them alike), each warmed up once
        # at this size before its first measured row (compiled: every shape, after freeing the
        # static caches of the other sizes once)
        for rep in range(first_repeat, first_repeat + repeats):
            for spec, decoder in built.items():
                if spec in skipped:
                    continue
                identity = {
                    "model": label, "target_id": pair.target_id,
                    "draft_id": (engine.draft_id(spec) if engine is not None
                                 else pair.draft_id_for(decoder)),
                    "decoder": spec.name, "params_json": params_json(params[spec]),
                    "batch_size": b, "dataset": dataset, "prompts": stable_key({"ids": rows}),
                    "max_new_tokens": max_new_tokens, "seed": seed + rep, "repeat": rep,
                    "meter": meter.name, "device": desc["device"], "dtype": desc["dtype"],
                    # eager rows keep their keys, compiled rows with the defaults theirs
                    **(compile_identity(compile_backend, compile_dynamic) if compile else {}),
                    **({"engine": columns} if engine is not None else {}),  # hf: old keys
                }
                key = stable_key(identity)
                row, measured = _stored_row(store, stored, key), False
                if row is None and budget is not None and budget.skip():
                    continue
                if row is None:
                    why, warm_gens = None, []
                    if spec not in warm:  # (what cannot fit was skipped above; an engine
                        try:  # says when it is full)
                            if engine is not None:
                                engine.warm_up(spec, rows, max_new_tokens, seed)
                            else:  # first calls (compiled: every shape), unmeasured
                                if compile and not released:
                                    _release()
                                    released = True
                                warm_gens, work = counted_generation(  # its host work
                                    decoder, pair, rows, warm_up_tokens(max_new_tokens, compiling),
                                    seed, compiling)
                                host[spec] = work.columns()
                        except torch.OutOfMemoryError as error:
                            why = _out_of_memory(b, error)
                    if why is None:
                        warm.add(spec)
                        try:  # the warm-up's compile cost goes to the row measured right after it
                            row = _measure(decoder, pair, rows, max_new_tokens, seed + rep, meter,
                                           key, compiling, warm_gens, probe)
                        except torch.OutOfMemoryError as error:
                            why = _out_of_memory(b, error)
                    if why is not None:
                        skipped.add(spec)
                        if on_skip is not None:
                            on_skip(spec.label, b, why)
                        continue
                    row = without_unseen_energy({  # compiled + simulated: static joules alone
                        "row_key": key, "created_unix_s": time.time(), "env_id": env_id,
                        **identity, **columns, "label": spec.label, "compile": compile, **row,
                        **host.get(spec, NO_HOST_WORK)})
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


def _release() -> None:
    """Free the static caches of the other batch sizes (compiled sweeps)."""
    from mtad_energy.decoding.runtime.static import release_engines

    release_engines()


def _too_big(pair: ModelPair, built: dict, rows: list, max_new_tokens: int, compile: bool,
             on_skip: Callable[[str, int, str], object] | None) -> set[DecoderSpec]:
    """The decoders whose caches and logits at ``len(rows)`` rows would not fit the free memory
    (`does_not_fit`), each reported through ``on_skip``."""
    out = set()
    for spec, decoder in built.items():
        why = does_not_fit(pair, decoder, rows, max_new_tokens, compile)
        if why is not None:
            out.add(spec)
            if on_skip is not None:
                on_skip(spec.label, len(rows), why)
    return out


def _out_of_memory(b: int, error: BaseException) -> str:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return f"out of memory at batch size {b}: {str(error).splitlines()[0][:160]}"


def kv_bytes_per_token(model) -> int:
    """Bytes one cached token of one row takes in ``model``'s KV cache (all layers)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    item = next(p.element_size() for p in model.parameters() if p.is_floating_point())
    return cfg.num_hidden_layers * 2 * heads * head_dim * item


def memory_needed_bytes(pair: ModelPair, decoder: Decoder, rows: int, slots: int,
                        compile: bool, max_new_tokens: int | None = None) -> int:
    """An estimate (on the high side) of the memory B rows need beyond the weights: each model's
    KV cache (compiled: rows padded to their bucket, times the rows a sequence expands to, over
    the slot bucket; eager: twice, as a dynamic cache is copied when it grows) and the float32
    logits of the widest forward with their warps."""
    from mtad_energy.decoding.runtime.static import row_bucket, slot_bucket

    total = 0
    # a chain verifies its effective draft (`Decoder.lookahead_for`) plus one; a tree its nodes
    chain = (decoder.lookahead_for(max_new_tokens) + 1
             if max_new_tokens is not None and decoder.verify_width == decoder.lookahead + 1 else 0)
    draft = decoder.draft_model(pair)  # a draft model, a head with a cache (EAGLE), or none
    roles = [("target", pair.target)] + ([("draft", draft)] if draft is not None
                                         and not getattr(draft, "cacheless", False) else [])
    for role, model in roles:
        r = (row_bucket(rows) if compile else rows) * decoder.cache_rows(role)
        cache = kv_bytes_per_token(model) * r * (slot_bucket(slots) if compile else 2 * slots)
        width = max(decoder.verify_width if not chain else chain, 32)  # trees: wider than deep
        total += cache + 4 * r * width * model.config.vocab_size * 4
    return total


def rows_memory_bytes(pair: ModelPair, decoder: Decoder, rows: list[list[int]],
                      max_new_tokens: int, compile: bool) -> int:
    """`memory_needed_bytes` of decoding ``rows`` (token ids) for ``max_new_tokens``: compiled,
    over the static caches' slots; eager, over what the rows write, with the effective draft
    (`Decoder.lookahead_for`: ``gamma=100000`` with 4 new tokens drafts at most 3)."""
    slots = slots_needed(decoder, [len(r) for r in rows], max_new_tokens)
    if not compile:  # a dynamic cache grows with what the rows write
        slots += decoder.lookahead_for(max_new_tokens) - decoder.lookahead
    return memory_needed_bytes(pair, decoder, len(rows), slots, compile, max_new_tokens)


def does_not_fit(pair: ModelPair, decoder: Decoder, rows: list[list[int]], max_new_tokens: int,
                  compile: bool) -> str | None:
    need = rows_memory_bytes(pair, decoder, rows, max_new_tokens, compile)
    free = free_memory_bytes(pair.describe()["device"])
    if free is None or need <= 0.9 * free:
        return None
    return (f"needs about {need / 2**30:.1f} GiB for its caches and logits at batch size "
            f"{len(rows)}, {free / 2**30:.1f} GiB free")


def _measure(decoder, pair: ModelPair, rows: list[list[int]], max_new_tokens: int, seed: int,
             meter: EnergyMeter, key: str, compile: bool = False,
             warm: Sequence[Generation] = (),
             probe: ContentionProbe | None = None) -> dict[str, Any]:
    windows = PhaseWindows(meter, key, probe,  # an engine's processes are the window's own
                           decoder.engine.processes(decoder.spec)
                           if isinstance(decoder, EngineDecoder) else ())
    with peak_memory(pair.describe()["device"]) as peak:
        try:
            if isinstance(decoder, EngineDecoder):
                gens = decoder.engine.generate(decoder.spec, rows, max_new_tokens, seed, windows)
            else:
                with work_tap(meter, pair.target, decoder.draft_model(pair), compiled=bool(compile)):
                    gens = generate_rows(decoder, pair, rows, max_new_tokens, seed=seed,
                                         on_phase=windows, compile=compile)
        finally:
            windows.close()
    if isinstance(decoder, EngineDecoder):  # outside the window, under the HF target
        gens = [with_perplexity(g, pair, r) for g, r in zip(gens, rows, strict=True)]
    m = windows.measurements["decode"]
    compiling = compile_columns(warm, gens)
    flags = set(m.flag_codes) | ({FLAG_COMPILED_IN_WINDOW} if compiling["compile_in_window_s"] > 0
                                 else set())
    tokens = sum(g.stats.tokens_emitted for g in gens)
    # the decode window's tokens (a streaming engine's first tokens are the prefill window's)
    # over its seconds: each row's decode time runs from the window's start to its last token
    in_window = sum(g.stats.decode_tokens for g in gens)
    decode_s = max(g.stats.decode_time_s for g in gens)
    target_fw = max(g.stats.target_forwards for g in gens)
    depth = sum(g.stats.draft_depth for g in gens)
    ppl = [g.stats.perplexity for g in gens if g.stats.perplexity is not None]
    energy = m.energy_j
    last = max((g.stats for g in gens), key=lambda s: s.iterations)
    return {
        "tokens": tokens, "decode_tokens": in_window, "decode_time_s": decode_s,
        "tokens_per_s": in_window / decode_s if decode_s > 0 else float("inf"),
        "iterations": max(g.stats.iterations for g in gens), "target_forwards": target_fw,
        "draft_forwards": max(g.stats.draft_forwards for g in gens),
        # per row: its tokens per target forward while it was decoding (a row done early rides
        # along in the batch's forwards: that costs time, counted in tokens/s, not here)
        "block_efficiency": tokens / max(1, sum(g.stats.target_forwards for g in gens)),
        "acceptance_rate": (sum(g.stats.draft_accepted for g in gens) / depth) if depth else None,
        "perplexity": sum(ppl) / len(ppl) if ppl else None,
        "energy_j": energy,
        "energy_per_token_j": energy / in_window if energy is not None and in_window else None,
        "energy_reason": m.reason if energy is None else None,
        "energy_flags": json.dumps(sorted(flags)),
        "peak_memory_bytes": peak.bytes, **compiling,
        "time_draft_s": last.time_draft_s, "time_target_s": last.time_target_s,
        "time_other_s": last.time_other_s, "draft_flops": last.draft_flops,
        "draft_bytes": last.draft_bytes, "target_flops": last.target_flops,
        "target_bytes": last.target_bytes,
        "draft_proposed": sum(g.stats.draft_proposed for g in gens),
        "draft_accepted": sum(g.stats.draft_accepted for g in gens),
        "rows_iterations": sum(g.stats.iterations for g in gens),
        **windows.contention_columns(("decode",)),  # the decode window's, as its time and joules
    }
