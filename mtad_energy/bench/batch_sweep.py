"""The paper's batch-size study: a fixed number of target runs at batch size b in {1, 2, 4, 8, 16}.

Definitions (the paper's table "effect of batch size": OPT-13b on an L40):

* a **run** is `forwards_per_run` decode forward passes of the target model, each feeding one new
  token per row, over a KV cache pre-filled with `context_len` prompt tokens per row. After every
  run the cache is cropped back to `context_len` positions, so every run does identical work.
* the token fed at forward k+1 is the argmax of forward k's logits (greedy); each run starts from
  the argmax of the prefill logits. The argmax stays on the device, so the measured loop has no
  host synchronisation (no ``.item()``, no data-dependent Python branching).
* the prompt batch [B, context_len] holds random token ids; row i comes from its own seeded
  generator (seed, i), so batch B's rows are the first B rows of batch 16's.
* an **input** is one row of one run: inputs = runs x batch size.

The identifying design (docs/design.md section 8) adds two axes beside the batch sizes, so that FLOPs
and bytes vary apart and the energy roofline can be fitted (`energy.fit`):

* **context** (``contexts``): decode runs at batch size 1 over ``c`` cached tokens: KV bytes grow
  with ``c`` at nearly fixed FLOPs;
* **chunk** (``chunks``): prefill-like runs at batch size 1: one forward of ``n`` new tokens over
  the ``context_len`` cached ones: FLOPs grow with ``n`` at nearly fixed weight bytes.

Every row carries its counted work (`mtad_energy.energy.work`): ``counted_flops`` / ``counted_bytes``
of the measured window, and per run.

Per point: prefill (unmeasured), one warm-up run (unmeasured), then one meter window around
`runs` runs. Optionally the Yang et al. mitigation protocol (`measure.measure_mitigated`) runs the
same workload again for a per-run energy with a confidence interval, and `measure.profile_ops`
accounts FLOPs/bytes of one run (outside the window) to split the measured time into T_flop, T_mem
and T_other for the energy decomposition (`energy.fit`).

Each batch size's row is written to the store's ``batch`` table as soon as it is finished; a
re-run with the same identity finds the row and skips that batch size (resume).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from mtad_energy.bench.budget import Budget
from mtad_energy.decoding.runtime.cache import cache_len, crop, new_cache
from mtad_energy.energy.work import ModelDims, shapes_work
from mtad_energy.hf_cache import cache_kwargs
from mtad_energy.measure import (
    DevicePeaks,
    EnergyMeter,
    MitigationConfig,
    measure_mitigated,
    no_sync,
    profile_ops,
    window,
    work_tap,
)
from mtad_energy.measure.base import SyncFn
from mtad_energy.measure.contention import ContentionProbe, gpu_processes, row_contention
from mtad_energy.models import ModelPair
from mtad_energy.results.crossover import batch_axis
from mtad_energy.results.schema import stable_key
from mtad_energy.results.store import ResultStore

DEFAULT_SIZES = (1, 2, 4, 8, 16)

TABLE_COLUMNS: dict[str, str] = {
    "batch_size": "Batch Size",
    "energy_j": "Energy (J)",
    "energy_per_run_j": "Energy/run (J)",
    "energy_per_input_j": "Energy/input (J)",
    "time_s": "Time (s)",
    "time_per_run_s": "Time/run (s)",
    "time_per_input_s": "Time/input (s)",
}
"""batch-table column -> the paper's column header, in the paper's order."""

# columns that must agree for rows to belong to one table of the paper's shape
_CONFIG_COLUMNS = ("model", "target_id", "runs", "forwards_per_run", "context_len", "meter", "device",
                   "dtype", "seed", "sweep")


def prompt_ids(batch_size: int, context_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Random prompt token ids [batch_size, context_len] (int64, CPU).

    Row i is drawn from a generator seeded with (seed, i), so it does not depend on batch_size.
    """
    rows = [np.random.default_rng([seed, i]).integers(0, vocab_size, size=context_len)
            for i in range(batch_size)]
    return torch.from_numpy(np.stack(rows)).to(torch.int64)


def device_sync(device: torch.device) -> SyncFn:
    """Waits for all queued work: every visible GPU on CUDA (a model may span several), no-op on CPU."""
    if device.type != "cuda":
        return no_sync
    n_devices = torch.cuda.device_count()

    def sync() -> None:
        for i in range(n_devices):
            torch.cuda.synchronize(i)

    return sync


def run_shapes(batch_size: int, context_len: int, forwards_per_run: int, new_tokens: int = 1
               ) -> list[tuple[int, int, int]]:
    """(rows, new tokens, KV columns attended) of each forward of one run of a point
    (`BatchWorkload`): what its counted work is computed from, here or from a stored row."""
    return [(batch_size, new_tokens, context_len + (k + 1) * new_tokens)
            for k in range(forwards_per_run)]


class BatchWorkload:
    """The fixed work of one point: a prefilled KV cache and `run()` (one run).

    Args:
        model: a Hugging Face causal LM (eval mode) with full-attention layers.
        batch_size: rows B.
        context_len: prompt tokens per row (cache length between runs).
        forwards_per_run: forward passes per run.
        seed: prompt seed (see `prompt_ids`).
        new_tokens: tokens per row per forward: 1 decodes (each forward feeds the previous
            one's greedy token), n > 1 feeds a fixed chunk of n random tokens (a prefill chunk).

    Attributes:
        cache: the DynamicCache, `context_len` positions long between runs.
        first_ids: greedy token after the prompt [B, 1] (each run starts from it).
        last_ids: the token a run's last forward chose [B, 1] (device tensor, never synced).
    """

    def __init__(self, model: Any, batch_size: int, *, context_len: int = 128, forwards_per_run: int = 8,
                 seed: int = 0, new_tokens: int = 1):
        self.model = model
        self.batch_size = batch_size
        self.context_len = context_len
        self.forwards_per_run = forwards_per_run
        self.new_tokens = new_tokens
        device = next(model.parameters()).device
        vocab = int(model.config.vocab_size)
        ids = prompt_ids(batch_size, context_len, vocab, seed).to(device)
        # a chunk run feeds the same random tokens every forward (no data dependence needed)
        self.chunk = (prompt_ids(batch_size, new_tokens, vocab, seed + 1).to(device)
                      if new_tokens > 1 else None)
        self.cache = new_cache(model)
        with torch.no_grad():
            logits = model(input_ids=ids, **cache_kwargs(self.cache), use_cache=True).logits
            self.first_ids = logits[:, -1:].argmax(-1)
        self.last_ids = self.first_ids

    def run(self) -> None:
        """One run: `forwards_per_run` forwards (greedy decode steps, or chunks), then crop the
        cache back."""
        ids = self.first_ids
        # no_grad, not inference_mode: under inference_mode aten.linear reaches profile_ops'
        # dispatch mode undecomposed and its matmul FLOPs are not counted
        with torch.no_grad():
            for _ in range(self.forwards_per_run):
                feed = ids if self.chunk is None else self.chunk
                logits = self.model(input_ids=feed, **cache_kwargs(self.cache), use_cache=True).logits
                ids = logits[:, -1:].argmax(-1)
            crop(self.cache, self.context_len)
        self.last_ids = ids

    def shapes(self) -> list[tuple[int, int, int]]:
        """(rows, new tokens, KV columns attended) of a run's forwards (`mtad_energy.energy.work`)."""
        return run_shapes(self.batch_size, self.context_len, self.forwards_per_run, self.new_tokens)

    def cache_len(self) -> int:
        """Cached positions now (`context_len` between runs)."""
        return cache_len(self.cache)

    def close(self) -> None:
        """Drop the cache and tensors (big batches hold gigabytes of KV cache on a GPU)."""
        self.cache = None
        self.first_ids = self.last_ids = None


def _plain(value: Any) -> Any:
    """numpy scalars -> Python; NaN/NA -> None (Parquet turns None into NaN in float columns)."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _merge_flags(*groups: Iterable[str]) -> str:
    codes: list[str] = []
    for group in groups:
        codes += [c for c in group if c not in codes]
    return json.dumps(codes)


def batch_sweep(
    pair: ModelPair,
    sizes: Sequence[int],
    runs: int,
    store: ResultStore,
    meter: EnergyMeter,
    *,
    model: str = "custom",
    context_len: int = 128,
    forwards_per_run: int = 8,
    seed: int = 0,
    mitigation: MitigationConfig | None = None,
    profile: bool = True,
    sweep: str = "batch-size",
    env_id: str = "",
    progress: Callable[[int, dict[str, Any]], object] | None = None,
    peaks: DevicePeaks | None = None,
    contexts: Sequence[int] = (),
    chunks: Sequence[int] = (),
    budget: Budget | None = None,
) -> list[dict[str, Any]]:
    """Measure `runs` runs of the target at each point of the design; one ``batch`` row per point:
    every batch size in `sizes` at `context_len` (axis ``batch``), batch size 1 at every cache
    length in `contexts` (axis ``context``) and one forward of every chunk length in `chunks`
    over `context_len` cached tokens (axis ``chunk``); a point on two axes is measured once.

    Args:
        pair: the model pair; only `pair.target` runs.
        sizes: batch sizes (positive; duplicates are measured once).
        runs: runs per batch size inside the measured window (the paper fixes it across sizes).
        store: results store; rows go to its ``batch`` table, keyed by the configuration.
        meter: energy meter (an open `EnergyMeter`; ``none`` gives time only).
        model: model label stored in the rows (e.g. the CLI alias).
        context_len / forwards_per_run / seed: the run definition (module docstring).
        mitigation: also run the mitigation protocol; its per-repetition energy becomes
            energy_per_run_j (with a CI, idle power and dynamic energy columns).
        profile: account one run's ops (outside the window) for the t_flop_s / t_mem_s /
            t_other_s columns, scaled to the measured window time.
        sweep / env_id: labels stored in the rows (`sweep` is part of the row identity).
        progress: called as progress(batch_size, row) after each point (also for resumed rows).
        peaks: roofline peaks for the profile (default: measured once per device, then cached).
        contexts / chunks: the context-length and prefill-chunk axes (module docstring).
        budget: once spent, no new point starts (`bench.budget`; counted in ``budget.left``).

    Returns:
        One row dict per point, batch axis first. A point whose row the store already holds is
        not rerun: its stored row is returned.
    """
    if runs < 1 or context_len < 1 or forwards_per_run < 1:
        raise ValueError(f"runs, context_len and forwards_per_run must be >= 1; got runs={runs}, "
                         f"context_len={context_len}, forwards_per_run={forwards_per_run}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    for name, values in (("batch sizes", sizes), ("context lengths", contexts),
                         ("chunk lengths", chunks)):
        bad = [v for v in values if int(v) != v or v < 1]
        if bad:
            raise ValueError(f"{name} must be positive integers, got {bad}")
    points = design_points(sizes, contexts, chunks, context_len, forwards_per_run)
    max_len = pair.context_length
    longest = max(c + f * n for _, _, c, n, f in points)
    if max_len is not None and longest > max_len:
        raise ValueError(f"the design reaches {longest} positions (context + new tokens of a run), "
                         f"which exceeds the model's {max_len}; lower --context-len, --contexts or "
                         "--chunks")

    target = pair.target
    device = pair.device
    dtype = str(target.dtype).removeprefix("torch.")
    sync = device_sync(device)
    probe = ContentionProbe(gpu_pids=gpu_processes(str(device)))  # others' share per window
    stored: pd.DataFrame | None = None
    out: list[dict[str, Any]] = []
    done: list[int] = []
    for axis, b, ctx, new, fwd in points:
        identity: dict[str, Any] = {
            "model": model, "target_id": pair.target_id, "batch_size": b, "runs": runs,
            "forwards_per_run": fwd, "context_len": ctx, "meter": meter.name,
            "device": str(device), "dtype": dtype, "seed": seed, "sweep": sweep,
            **({"new_tokens": new} if new != 1 else {}),  # decode rows keep their old keys
        }
        if mitigation is not None:  # a mitigated row answers a different question
            identity["mitigation"] = mitigation.to_dict()
        row_key = stable_key(identity)
        if store.has("batch", row_key):
            if stored is None or not (stored["row_key"] == row_key).any():
                stored = store.load("batch")  # once, or again if another process added the row
            match = stored[stored["row_key"] == row_key]
            row = {k: _plain(v) for k, v in match.iloc[0].items()}
        elif budget is not None and budget.skip():
            continue
        else:
            try:
                with work_tap(meter, pair.target):
                    row = _measure_one(pair, b, runs, meter, sync, context_len=ctx,
                                       forwards_per_run=fwd, seed=seed, mitigation=mitigation,
                                       profile=profile, peaks=peaks, new_tokens=new, probe=probe)
            except torch.cuda.OutOfMemoryError as err:
                raise RuntimeError(
                    f"the point B={b}, context {ctx}, {new} new token(s) ran out of GPU memory ({err}); "
                    f"the rows of {done or 'no point'} are stored. Re-run with smaller batch sizes, "
                    "contexts or chunks") from err
            row = {"row_key": row_key, "sweep": sweep, "created_unix_s": time.time(), "env_id": env_id,
                   **identity, "new_tokens": new, "axis": axis, **row}
            if mitigation is not None:
                row["mitigation"] = json.dumps(mitigation.to_dict(), sort_keys=True)
            store.write("batch", row_key, [row])
        done.append((b, ctx, new))
        out.append(row)
        if progress is not None:
            progress(b, row)
    return out


def _measure_one(
    pair: ModelPair,
    batch_size: int,
    runs: int,
    meter: EnergyMeter,
    sync: SyncFn,
    *,
    context_len: int,
    forwards_per_run: int,
    seed: int,
    mitigation: MitigationConfig | None,
    profile: bool,
    peaks: DevicePeaks | None,
    new_tokens: int = 1,
    probe: ContentionProbe | None = None,
) -> dict[str, Any]:
    """Measure one point; returns the measured columns (no identity columns), with what other
    processes took during its windows (``probe``: the contention columns of every window)."""
    probe = probe or ContentionProbe()
    readings = []
    device = pair.device
    work = BatchWorkload(pair.target, batch_size, context_len=context_len,
                         forwards_per_run=forwards_per_run, seed=seed, new_tokens=new_tokens)
    counted = shapes_work(ModelDims.from_model(pair.target), work.shapes())
    try:
        work.run()  # warm-up: allocator, kernel selection, clocks
        probe.begin("batch")  # opened outside the meter's window, as the decoding windows' probe
        with window(meter, f"batch{batch_size}", sync) as w:
            for _ in range(runs):
                work.run()
        readings.append(probe.end("batch"))
        m = w.result()
        inputs = runs * batch_size
        energy = m.energy_j
        per_run = None if energy is None else energy / runs
        row: dict[str, Any] = {
            "inputs": inputs,
            "forwards": runs * forwards_per_run,
            "tokens": inputs * forwards_per_run * new_tokens,
            "counted_flops_per_run": counted.flops,
            "counted_bytes_per_run": counted.bytes,
            "counted_flops": counted.flops * runs,
            "counted_bytes": counted.bytes * runs,
            "time_s": m.time_s,
            "energy_j": energy,
            "power_w": m.power_w,
            "energy_per_run_j": per_run,
            "energy_per_input_j": None if per_run is None else per_run / batch_size,
            "time_per_run_s": m.time_s / runs,
            "time_per_input_s": m.time_s / inputs,
            "energy_reason": m.reason,
            "energy_flags": _merge_flags(m.flag_codes),
            "mitigated": False,
            "energy_per_run_ci_low_j": None,
            "energy_per_run_ci_high_j": None,
            "idle_power_w": None,
            "dynamic_energy_per_run_j": None,
            "mitigated_time_per_run_s": None,
            "mitigated_runs": None,
        }
        if mitigation is not None:
            probe.begin("mitigated")
            mit = measure_mitigated(work.run, meter, mitigation, sync=sync)
            readings.append(probe.end("mitigated"))
            row.update(
                energy_per_run_ci_low_j=mit.ci_low_j,
                energy_per_run_ci_high_j=mit.ci_high_j,
                idle_power_w=mit.idle_power_w,
                dynamic_energy_per_run_j=mit.dynamic_energy_per_rep_j,
                mitigated_time_per_run_s=mit.time_per_rep_s,
                mitigated_runs=mit.repetitions_kept,
                energy_flags=_merge_flags(m.flag_codes, (f.code for f in mit.flags)),
            )
            if mit.energy_per_rep_j is not None:
                # the protocol's estimate replaces the single window's for the per-run figures
                row.update(mitigated=True, energy_per_run_j=mit.energy_per_rep_j,
                           energy_per_input_j=mit.energy_per_rep_j / batch_size)
            elif row["energy_reason"] is None:
                row["energy_reason"] = mit.reason
        row.update(row_contention(readings))
        row.update(t_flop_s=None, t_mem_s=None, t_other_s=None, flops_per_run=None, bytes_per_run=None,
                   ridge_flop_per_byte=None, profile_wall_time_s=None)
        if profile:
            pr = profile_ops(work.run, peaks=peaks, device=str(device), sync=sync)
            # per-op syncs make the profiled run slower than a measured one: keep its fractions only
            wall = pr.wall_time_s if pr.wall_time_s > 0 else 1.0
            t_flop = pr.t_flop_s / wall * m.time_s
            t_mem = pr.t_mem_s / wall * m.time_s
            row.update(t_flop_s=t_flop, t_mem_s=t_mem, t_other_s=max(m.time_s - t_flop - t_mem, 0.0),
                       flops_per_run=int(pr.total_flops), bytes_per_run=int(pr.total_bytes),
                       ridge_flop_per_byte=pr.peaks.ridge_flop_per_byte,
                       profile_wall_time_s=pr.wall_time_s)
        return row
    finally:
        work.close()
        del work
        if device.type == "cuda":
            torch.cuda.empty_cache()  # hand the KV cache back before the next (bigger) batch


def design_points(sizes: Sequence[int], contexts: Sequence[int], chunks: Sequence[int],
                  context_len: int, forwards_per_run: int) -> list[tuple[str, int, int, int, int]]:
    """(axis, batch size, context length, new tokens, forwards per run) of every point, in order,
    each point once (the first axis that lists it names it)."""
    points = [("batch", int(b), context_len, 1, forwards_per_run) for b in sizes]
    points += [("context", 1, int(c), 1, forwards_per_run) for c in contexts]
    points += [("chunk", 1, context_len, int(n), 1) for n in chunks]
    first: dict[tuple[int, int, int, int], tuple[str, int, int, int, int]] = {}
    for p in points:
        first.setdefault(p[1:], p)
    return list(first.values())


def batch_table(rows_or_df: pd.DataFrame | Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """The paper's table: one row per batch size, sorted, with its column headers in order.

    Columns: Batch Size, Energy (J), Energy/run (J), Energy/input (J), Time (s), Time/run (s),
    Time/input (s). Missing energies are NaN. Only the batch axis of a design counts. Rows of
    different configurations (model, meter, runs, ...) cannot share one table: filter them first.
    """
    df = rows_or_df.copy() if isinstance(rows_or_df, pd.DataFrame) else pd.DataFrame(list(rows_or_df))
    df = batch_axis(df)
    missing = [c for c in TABLE_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"batch rows lack column(s) {', '.join(missing)}")
    varying = [c for c in _CONFIG_COLUMNS if c in df.columns and df[c].astype(str).nunique() > 1]
    if df["batch_size"].duplicated().any():
        raise ValueError(
            "the rows hold more than one row per batch size"
            + (f" (they differ in {', '.join(varying)})" if varying else "")
            + "; filter them to one configuration first, e.g. df[df.meter == 'zeus']")
    table = df[list(TABLE_COLUMNS)].rename(columns=TABLE_COLUMNS)
    table["Batch Size"] = table["Batch Size"].astype(int)
    for col in list(TABLE_COLUMNS.values())[1:]:
        table[col] = pd.to_numeric(table[col], errors="coerce").astype(float)
    return table.sort_values("Batch Size", kind="stable").reset_index(drop=True)
