"""The decoding batch-size sweep: every decoder on B rows at once, tokens/s and J/token per B, and
the batch size from which a drafting decoder stops beating ``ar``.

One ``decode_batch`` row per (decoder, parameters, batch size, repeat): B prompts (the dataset's,
cycled to fill B) decoded together by `generate_rows`, the decode phase inside one meter window.
Per row: tokens (all B rows), decode time, tokens/s = tokens / decode time, decode energy and
J/token (or n/a with the reason), block efficiency (tokens per target forward of a row while it
decodes; rows done early ride along in the forwards, which tokens/s counts),
acceptance rate and the rows' mean perplexity under the unwarped target (outside the window).
The forward-only study (`batch_sweep.py`) is separate and unchanged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mtad_energy.bench.runner import PhaseWindows
from mtad_energy.config import DecoderSpec
from mtad_energy.decoding.generate import generate_rows
from mtad_energy.decoding.registry import check_batched
from mtad_energy.measure import EnergyMeter
from mtad_energy.models import ModelPair
from mtad_energy.results.schema import params_json, stable_key
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
) -> DecodeBatchReport:
    """Run every decoder at every batch size; rows the store holds already are not rerun, and a
    row another worker stores meanwhile (into the same store) counts as skipped, as in `Runner`.
    ``progress(row, ran)`` is called once per row (``ran``: measured now, not found stored)."""
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
    out, ran = [], 0
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
                row, measured = _stored_row(store, stored, key), False
                if row is None:
                    if not warm:  # first-call allocations at this batch size, unmeasured
                        generate_rows(decoder, pair, rows, min(8, max_new_tokens), seed=seed,
                                      compute_perplexity=False)
                        warm = True
                    row = _measure(decoder, pair, rows, max_new_tokens, seed + rep, meter, key)
                    row = {"row_key": key, "created_unix_s": time.time(), "env_id": env_id,
                           **identity, "label": spec.label, **row}
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


def _measure(decoder, pair: ModelPair, rows: list[list[int]], max_new_tokens: int, seed: int,
             meter: EnergyMeter, key: str) -> dict[str, Any]:
    windows = PhaseWindows(meter, key)
    try:
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
    }
