"""The energy model over a results store: the rows it is fitted on and the windows it splits.

The model itself (counting, both fits, validation, attribution) is `mtad_energy.energy`; this
module only reads a store and hands its rows over:

* `fit_stores`: both forms fitted on every ``batch`` row (a batch study, ideally the identifying
  design of `bench.batch_sweep`: batch, context and chunk axes); `roofline_fit` the one
  attribution takes.
* `decode_windows` / `windows_from`: every ``runs`` and ``decode_batch`` row as a decode window
  (`mtad_energy.energy.attribution.WINDOW_COLUMNS`, named the way the summaries name a
  configuration), for `validate` and `attribute`.
* `attribution_summary`: the attributed windows per table, model, configuration and batch size.
* `ops_fractions_breakdown`: the paper's form applied to the decoders' profiled ``ops`` rows.

Pure pandas/numpy over the store: no torch, no decoders, no meters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from mtad_energy.energy.attribution import (
    PHASES,
    TERMS,
    WINDOW_COLUMNS,
    fit_columns,
    numeric,
)
from mtad_energy.energy.fit import FORMS, EnergyFit, fit_form
from mtad_energy.results.analysis import config_labels, decode_window_tokens
from mtad_energy.results.schema import TABLES
from mtad_energy.results.settings import setting_labels, settings_except, with_setting
from mtad_energy.results.store import load_results

# what makes two rows one: a store read twice, or a row copied into a second store, has the same
# key, time and environment; rows of one configuration measured again (elsewhere) differ in time
SAME_ROW = ("created_unix_s", "env_id")


def _load_all(dirs: Sequence[str | Path], table: str) -> pd.DataFrame:
    """The rows of ``table`` in ``dirs``, each row once: a store given twice (or under two
    names) is read once, and a row held by two stores (a copy) is counted once."""
    unique: dict[Path, str | Path] = {}
    for d in dirs:
        unique.setdefault(Path(d).resolve(), d)  # the first spelling of each
    frames = [load_results(d, table) for d in unique.values()]
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame()
    rows = pd.concat(frames, ignore_index=True, sort=False)
    same = [c for c in (TABLES[table].key, "iteration", *SAME_ROW) if c in rows]  # steps: per iteration
    return rows.drop_duplicates(same, ignore_index=True) if len(frames) > 1 else rows


DECOMPOSE_FIX = "pass that DIR (--fit-from DIR, or as one more RESULTS dir)"


def fit_stores(dirs: Sequence[str | Path], fix: str = DECOMPOSE_FIX
               ) -> tuple[dict[str, EnergyFit | str], int]:
    """Both forms fitted on every batch row in ``dirs``: form -> its fit, or the reason it
    cannot be fitted (missing columns, no energy); and the number of rows. ``fix``: where the
    caller takes a batch sweep from, said when ``dirs`` hold none (decompose's options)."""
    batch = _load_all(dirs, "batch")
    if batch.empty:
        decoding = not _load_all(dirs, "decode_batch").empty
        raise ValueError(f"no batch-sweep rows in {', '.join(map(str, dirs))}"
                         + (" (it holds a decoding sweep, `sweep batch-size --decoder`, whose rows "
                            "are checked against the fit, never fitted)" if decoding else "")
                         + "; run the forward-only study, `mtad-energy sweep batch-size --output "
                         "DIR` without --decoder (with --contexts and --chunks for the identifying "
                         f"design), and {fix}")
    needs = {"roofline": ("counted_flops", "counted_bytes", "re-run the batch sweep: rows stored "
                          "before counted work have no FLOPs/bytes"),
             "paper": ("t_flop_s", "t_mem_s", "re-run the sweep with --ops")}
    out: dict[str, EnergyFit | str] = {}
    for form in FORMS:
        a, b, fix = needs[form]
        if numeric(batch, a).isna().any() or numeric(batch, b).isna().any():
            out[form] = f"the batch rows lack {a} / {b}: {fix}"
            continue
        try:
            out[form] = fit_form(form, *fit_columns(batch, form))
        except ValueError as err:
            out[form] = str(err)
    return out, len(batch)


# -- decode windows: validation and attribution -------------------------------------------------
def roofline_fit(dirs: Sequence[str | Path], fix: str = DECOMPOSE_FIX) -> EnergyFit | str:
    """The roofline fit on the batch rows of ``dirs``, or why there is none (for attribution;
    ``fix``: `fit_stores`)."""
    try:
        fit = fit_stores(dirs, fix)[0]["roofline"]
    except ValueError as err:  # no batch rows
        return str(err)
    return fit


def decode_windows(dirs: Sequence[str | Path]) -> pd.DataFrame:
    """Every ``runs`` and ``decode_batch`` row of ``dirs`` as `windows_from` gives them."""
    return windows_from(_load_all(dirs, "runs"), _load_all(dirs, "decode_batch"))


def windows_from(runs: pd.DataFrame | None, decode_batch: pd.DataFrame | None = None) -> pd.DataFrame:
    """Rows of the ``runs`` and ``decode_batch`` tables with the columns validation and
    attribution read (``source`` names the table; ``share`` is a batched runs row's share of its
    batch's joules; model, dataset, draft_id, decoder and params_json identify a
    configuration)."""
    frames, apart = [], settings_except("batch_size")  # a column of its own here
    for table, df in (("runs", runs), ("decode_batch", decode_batch)):
        if df is None or df.empty:
            continue
        key = "run_key" if table == "runs" else "row_key"
        energy = numeric(df, "decode_energy_j") if table == "runs" else numeric(df, "energy_j")
        frames.append(pd.DataFrame({
            "source": table, "key": df[key], "model": df.get("model"), "dataset": df.get("dataset"),
            "params_json": df.get("params_json"), "decoder": df["decoder"],
            "draft_id": df.get("draft_id"),
            # runs: one label per configuration, as the summaries name it; a sweep's as stored
            "label": (config_labels(df, apart) if table == "runs" and "params_json" in df
                      else with_setting(df.get("label", df["decoder"]), setting_labels(df, apart))),
            "batch_size": numeric(df, "batch_size").fillna(1.0),
            "meter": df.get("meter"), "decode_energy_j": energy,
            "decode_time_s": numeric(df, "decode_time_s"),
            "tokens": decode_window_tokens(df, "tokens_emitted" if table == "runs" else "tokens"),
            "share": numeric(df, "energy_share").fillna(1.0),
            "energy_reason": df.get("energy_reason"),
            **{c: numeric(df, c) for c in WINDOW_COLUMNS}}))
        if table == "decode_batch":  # every row's iterations (the table's own is the batch's)
            frames[-1]["iterations"] = numeric(df, "rows_iterations")
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def simulated_rows(frame: pd.DataFrame) -> int:
    """Rows of ``frame`` whose joules came from meter ``simulated`` (a modelled GPU and power
    sensor: nothing was measured)."""
    return int((frame["meter"] == "simulated").sum()) if "meter" in frame and len(frame) else 0


def simulated_energy(fit_dirs: Sequence[str | Path], windows: pd.DataFrame) -> dict[str, Any]:
    """What of a decomposition is simulated: the batch rows of the fit (in ``fit_dirs``) and the
    decode windows that used the simulated meter, and a note saying so (None when none did)."""
    batch, runs = simulated_rows(_load_all(fit_dirs, "batch")), simulated_rows(windows)
    parts = [f"{n} of the fit's batch rows" if i == 0 else f"{n} of the {len(windows)} decode windows"
             for i, n in enumerate((batch, runs)) if n]
    note = (f"simulated: {' and '.join(parts)} used meter 'simulated', a modelled GPU and power "
            "sensor; their joules were not measured, so these fits and splits describe the model, "
            "not a machine") if parts else None
    return {"batch_rows": batch, "decode_windows": runs, "note": note}


SUMMARY_KEYS = ("source", "model", "label", "batch_size")


def attribution_summary(attributed: pd.DataFrame, keys: Sequence[str] = SUMMARY_KEYS) -> pd.DataFrame:
    """Per ``keys`` (default: table, model, label, batch size): windows, attributed windows, and
    the phase / term joules per token, joules per accepted draft token, the rejected share of
    the decode energy and the mean scale factor; n/a (NaN) with the reasons (``reason``) where
    nothing was attributed."""
    rows = []
    keys = list(keys)
    if attributed.empty:
        return pd.DataFrame()
    frame = attributed.assign(**{k: attributed[k].astype(object).where(attributed[k].notna(), "")
                                 for k in keys if k != "batch_size"})
    for k, g in frame.groupby(keys, sort=False):
        ok = g[g["attribution_reason"].isna()]
        tokens = float(ok["tokens"].mul(ok["share"]).sum()) if len(ok) else 0.0
        row = {**dict(zip(keys, k, strict=True)), "windows": len(g), "attributed": len(ok)}
        if "batch_size" in row:
            row["batch_size"] = int(row["batch_size"])
        for c in (*PHASES, *TERMS):
            row[c.replace("_energy_j", "_j_per_token")] = (ok[c].sum() / tokens if tokens > 0
                                                           else math.nan)
        acc = ok["draft_accepted"].mul(ok["share"]).sum()
        row["j_per_accepted_draft_token"] = (ok["draft_energy_j"].sum() / acc if acc > 0
                                             else math.nan)
        row["rejected_share"] = (ok["rejected_draft_energy_j"].sum() / ok["decode_energy_j"].sum()
                                 if len(ok) else math.nan)
        row["scale"] = ok["attribution_scale"].mean() if len(ok) else math.nan
        reasons = sorted({str(r) for r in g["attribution_reason"].dropna()})
        row["reason"] = "; ".join(reasons) if reasons else None
        rows.append(row)
    order = [k for k in ("source", "label", "batch_size") if k in keys]
    return pd.DataFrame(rows).sort_values(order, kind="stable", ignore_index=True)


def ops_fractions_breakdown(dirs: Sequence[str | Path], fit: EnergyFit) -> pd.DataFrame:
    """The paper's form applied to decoders: one row per (model, decoder configuration) with
    both runs and an ``ops`` row: measured and predicted joules per token and the static / flop /
    memory terms per token. A decoder's T_flop and T_mem are its ``ops`` row's fractions of
    profiled wall time (one profiled generation) applied to the measured time per token; the
    profiler syncs after every op, which inflates the time outside ops, so the fractions are lower
    bounds and the static term absorbs the rest."""
    runs, ops = _load_all(dirs, "runs"), _load_all(dirs, "ops")
    if runs.empty or ops.empty or fit.form != "paper":
        return pd.DataFrame()
    keys = ["model", "decoder", "params_json"]
    ops = ops.assign(frac_flop=numeric(ops, "t_flop_s") / numeric(ops, "wall_time_s"),
                     frac_mem=numeric(ops, "t_mem_s") / numeric(ops, "wall_time_s"))
    ops = ops.groupby(keys, as_index=False)[["frac_flop", "frac_mem"]].mean()
    runs = runs.assign(time_s=numeric(runs, "prefill_time_s") + numeric(runs, "decode_time_s"),
                       energy=numeric(runs, "energy_j"))
    label = "label" if "label" in runs else "decoder"
    per = runs.groupby(keys, as_index=False).agg(
        label=(label, "first"), tokens=("tokens_emitted", "sum"), time_s=("time_s", "sum"),
        energy_j=("energy", lambda s: s.sum(min_count=len(s))))
    per = per.merge(ops, on=keys, how="inner")
    out = []
    for _, r in per.iterrows():
        t = r["time_s"] / r["tokens"]
        static, flop, mem = fit.terms_j(t, r["frac_flop"] * t, r["frac_mem"] * t)
        out.append({"model": r["model"], "decoder": r["label"], "time_per_token_s": t,
                    "t_flop_share": r["frac_flop"], "t_mem_share": r["frac_mem"],
                    "static_j_per_token": static, "flop_j_per_token": flop, "mem_j_per_token": mem,
                    "predicted_j_per_token": static + flop + mem,
                    "measured_j_per_token": r["energy_j"] / r["tokens"]})
    return pd.DataFrame(out)
