"""The decoding batch-size sweep: every decoder on B rows at once, tokens/s and J/token per B, and
the batch size from which a drafting decoder stops beating ``ar``.

One ``decode_batch`` row per (decoder, parameters, batch size, repeat): B prompts (the dataset's,
cycled to fill B) decoded together by `generate_rows`, the decode phase inside one meter window.
Per row: tokens (all B rows), decode time, tokens/s = tokens / decode time, decode energy and
J/token (or n/a with the reason), block efficiency (tokens per target forward of a row while it
decodes; rows done early ride along in the forwards, which tokens/s counts),
acceptance rate and the rows' mean perplexity under the unwarped target (outside the window),
and what the energy attribution reads (`results.breakdown`): the batch's draft / target / other
seconds and counted FLOPs and bytes (those of the row that decoded longest: its forwards are the
batch's), and the rows' draft tokens proposed and accepted and iterations.
The forward-only study (`batch_sweep.py`) is separate and unchanged.
"""

from __future__ import annotations

import itertools
import json
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

from mtad_energy.bench.runner import PhaseWindows
from mtad_energy.config import DecoderSpec
from mtad_energy.decoding.generate import generate_rows
from mtad_energy.decoding.registry import check_batched
from mtad_energy.measure import EnergyMeter, work_tap
from mtad_energy.models import ModelPair
from mtad_energy.results.schema import params_json, stable_key
from mtad_energy.results.store import ResultStore


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
    progress: Callable[[dict[str, Any]], object] | None = None,
) -> list[dict[str, Any]]:
    """Run every decoder (variants expanded, `expand_variants`) at every batch size; rows the
    store holds already are not rerun."""
    decoders = expand_variants(decoders)
    bad = [b for b in sizes if int(b) != b or b < 1]
    if bad or not sizes:
        raise ValueError(f"batch sizes must be positive integers, got {list(sizes) or 'none'}")
    if not prompts:
        raise ValueError("give at least one prompt")
    built = {spec: spec.build() for spec in decoders}  # validates every parameter up front
    if max(sizes) > 1:
        check_batched(built.values())
    desc = pair.describe()
    stored = store.load("decode_batch") if store.keys("decode_batch") else None
    out = []
    for spec, decoder in built.items():
        params = {k: v for k, v in decoder.config().items() if k != "decoder"}
        for b in dict.fromkeys(int(s) for s in sizes):
            rows = [list(prompts[i % len(prompts)]) for i in range(b)]
            warm = False
            for rep in range(repeats):
                identity = {
                    "model": model, "target_id": pair.target_id, "draft_id": pair.draft_id,
                    "decoder": spec.name, "params_json": params_json(params), "batch_size": b,
                    "dataset": dataset, "prompts": stable_key({"ids": rows}),
                    "max_new_tokens": max_new_tokens, "seed": seed + rep, "repeat": rep,
                    "meter": meter.name, "device": desc["device"], "dtype": desc["dtype"],
                }
                key = stable_key(identity)
                if stored is not None and (stored["row_key"] == key).any():
                    row = stored[stored["row_key"] == key].iloc[0].to_dict()
                else:
                    if not warm:  # first-call allocations at this batch size, unmeasured
                        generate_rows(decoder, pair, rows, min(8, max_new_tokens), seed=seed,
                                      compute_perplexity=False)
                        warm = True
                    row = _measure(decoder, pair, rows, max_new_tokens, seed + rep, meter, key)
                    row = {"row_key": key, "created_unix_s": time.time(), "env_id": env_id,
                           **identity, "label": spec.label, **row}
                    store.write("decode_batch", key, [row])
                out.append(row)
                if progress is not None:
                    progress(row)
    return out


def _measure(decoder, pair: ModelPair, rows: list[list[int]], max_new_tokens: int, seed: int,
             meter: EnergyMeter, key: str) -> dict[str, Any]:
    windows = PhaseWindows(meter, key)
    try:
        with work_tap(meter, pair.target, pair.draft):
            gens = generate_rows(decoder, pair, rows, max_new_tokens, seed=seed, on_phase=windows)
    finally:
        windows.close()
    m = windows.measurements["decode"]
    tokens = sum(g.stats.tokens_emitted for g in gens)
    decode_s = max(g.stats.decode_time_s for g in gens)
    target_fw = max(g.stats.target_forwards for g in gens)
    depth = sum(g.stats.draft_depth for g in gens)
    ppl = [g.stats.perplexity for g in gens if g.stats.perplexity is not None]
    energy = m.energy_j
    last = max((g.stats for g in gens), key=lambda s: s.iterations)
    return {
        "tokens": tokens, "decode_time_s": decode_s, "tokens_per_s": tokens / decode_s,
        "iterations": max(g.stats.iterations for g in gens), "target_forwards": target_fw,
        "draft_forwards": max(g.stats.draft_forwards for g in gens),
        # per row: its tokens per target forward while it was decoding (a row done early rides
        # along in the batch's forwards: that costs time, counted in tokens/s, not here)
        "block_efficiency": tokens / max(1, sum(g.stats.target_forwards for g in gens)),
        "acceptance_rate": (sum(g.stats.draft_accepted for g in gens) / depth) if depth else None,
        "perplexity": sum(ppl) / len(ppl) if ppl else None,
        "energy_j": energy, "energy_per_token_j": energy / tokens if energy is not None else None,
        "energy_reason": m.reason if energy is None else None,
        "energy_flags": json.dumps(sorted(m.flag_codes)),
        "time_draft_s": last.time_draft_s, "time_target_s": last.time_target_s,
        "time_other_s": last.time_other_s, "draft_flops": last.draft_flops,
        "draft_bytes": last.draft_bytes, "target_flops": last.target_flops,
        "target_bytes": last.target_bytes,
        "draft_proposed": sum(g.stats.draft_proposed for g in gens),
        "draft_accepted": sum(g.stats.draft_accepted for g in gens),
        "rows_iterations": sum(g.stats.iterations for g in gens),
    }
