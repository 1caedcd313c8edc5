"""Energy decomposition over stored results: fit the power model on batch-sweep rows, then split
each decoder's measured energy into P_static*T, PW_flop*T_flop and PW_mem*T_mem.

A decoder's T_flop and T_mem come from its ``ops`` row (one profiled generation): the fractions of
profiled wall time spent in compute- and memory-bound ops, applied to the measured (unprofiled)
time per token. The profiler synchronises after every op, which inflates the time outside ops, so
the fractions are lower bounds and the static term absorbs the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from mtad_energy.measure.decompose import EnergyFit, breakdown, fit_energy_model
from mtad_energy.results.store import load_results


def _load_all(dirs: Sequence[str | Path], table: str) -> pd.DataFrame:
    frames = [load_results(d, table) for d in dirs]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True, sort=False) if frames else pd.DataFrame()


def fit_from_stores(dirs: Sequence[str | Path]) -> tuple[EnergyFit, int]:
    """Fit the power model on every batch-sweep row in ``dirs``."""
    batch = _load_all(dirs, "batch")
    if batch.empty:
        raise ValueError(f"no batch-sweep rows in {', '.join(map(str, dirs))}; run `mtad-energy sweep "
                         "batch-size --output DIR` and pass that DIR")
    for col in ("t_flop_s", "t_mem_s"):
        if col not in batch or batch[col].isna().all():
            raise ValueError(f"the batch-sweep rows have no {col}: re-run the sweep with --ops")
    energy = pd.to_numeric(batch["energy_j"], errors="coerce")
    return fit_energy_model(energy.to_numpy(dtype=float), batch["time_s"].to_numpy(dtype=float),
                            batch["t_flop_s"].to_numpy(dtype=float),
                            batch["t_mem_s"].to_numpy(dtype=float)), len(batch)


def decoder_breakdown(dirs: Sequence[str | Path], fit: EnergyFit) -> pd.DataFrame:
    """One row per (model, decoder configuration) that has both runs and an ``ops`` row: measured
    and predicted joules per token, and the static / flop / memory terms per token."""
    runs, ops = _load_all(dirs, "runs"), _load_all(dirs, "ops")
    if runs.empty or ops.empty:
        return pd.DataFrame()
    keys = ["model", "decoder", "params_json"]
    ops = ops.assign(frac_flop=ops["t_flop_s"] / ops["wall_time_s"],
                     frac_mem=ops["t_mem_s"] / ops["wall_time_s"])
    ops = ops.groupby(keys, as_index=False)[["frac_flop", "frac_mem"]].mean()
    runs = runs.assign(time_s=runs["prefill_time_s"] + runs["decode_time_s"],
                       energy=pd.to_numeric(runs["energy_j"], errors="coerce"))
    label = "label" if "label" in runs else "decoder"
    per = runs.groupby(keys, as_index=False).agg(
        label=(label, "first"), tokens=("tokens_emitted", "sum"), time_s=("time_s", "sum"),
        energy_j=("energy", lambda s: s.sum(min_count=len(s))))
    per = per.merge(ops, on=keys, how="inner")
    out = []
    for _, r in per.iterrows():
        t = r["time_s"] / r["tokens"]
        b = breakdown(fit, t, r["frac_flop"] * t, r["frac_mem"] * t)
        measured = r["energy_j"] / r["tokens"] if not np.isnan(r["energy_j"]) else np.nan
        out.append({"model": r["model"], "decoder": r["label"], "time_per_token_s": t,
                    "t_flop_share": r["frac_flop"], "t_mem_share": r["frac_mem"],
                    "static_j_per_token": b.static_j, "flop_j_per_token": b.flop_j,
                    "mem_j_per_token": b.mem_j, "predicted_j_per_token": b.predicted_j,
                    "measured_j_per_token": measured})
    return pd.DataFrame(out)
