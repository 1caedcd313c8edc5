"""Energy models over stored results: fit both forms on a batch study's rows, check the fit on
decoding windows it never saw, and split every measured decode window into phases and terms.

* **Fit** (`fit_stores`): the ``batch`` rows (a batch study, ideally the identifying design of
  `bench.batch_sweep`: batch, context and chunk axes). A mitigated row gives its per-run energy
  and time (the Yang et al. protocol), another its window; the roofline form takes the counted
  FLOPs and bytes (`mtad_energy.work`), the paper's form the profiled T_flop / T_mem.
* **Validation** (`validate`): the roofline fit predicts the decode-window energy of every
  ``runs`` and ``decode_batch`` row that measured one, from its decode time and counted work;
  the error is predicted / measured - 1.
* **Attribution** (`attribute`): per decode window, the fitted model's joules of the draft
  forwards (pi0 x draft time + eps_flop x draft FLOPs + eps_byte x draft bytes), of the target
  forwards, and of the rest of the time (pi0 x other time), scaled by one factor so that they
  add up exactly to the measured decode energy (the factor is kept: its distance from 1 is the
  model's error on that window); the same prediction split into static / FLOP / memory joules;
  the draft joules per accepted draft token; and the joules spent on rejected draft tokens (each
  phase's joules split evenly over the tokens it processed: the draft's over the draft tokens
  proposed, the target's over those plus one token per iteration). Without a measured energy or a
  fit these are n/a with the reason (``attribution_reason``), never 0.

Pure pandas/numpy over the store: no torch, no decoders, no meters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from mtad_energy.measure.decompose import FORMS, EnergyFit, fit_form
from mtad_energy.results.analysis import config_labels
from mtad_energy.results.store import load_results

PHASES = ("draft_energy_j", "target_energy_j", "other_energy_j")
TERMS = ("static_energy_j", "flop_energy_j", "mem_energy_j")
ATTRIBUTION_COLUMNS = (*PHASES, *TERMS, "attribution_scale", "energy_per_accepted_draft_token_j",
                       "rejected_draft_energy_j", "attribution_reason")
_WINDOW_COLUMNS = ("time_draft_s", "time_target_s", "time_other_s", "draft_flops", "draft_bytes",
                   "target_flops", "target_bytes", "draft_proposed", "draft_accepted", "iterations")


def _load_all(dirs: Sequence[str | Path], table: str) -> pd.DataFrame:
    frames = [load_results(d, table) for d in dirs]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True, sort=False) if frames else pd.DataFrame()


def _num(df: pd.DataFrame, col: str) -> pd.Series:
    if col not in df:
        return pd.Series(np.nan, index=df.index, dtype=float)
    return pd.to_numeric(df[col], errors="coerce").astype(float)


def fit_columns(batch: pd.DataFrame, form: str) -> tuple[np.ndarray, ...]:
    """(E, column, column, column) of batch rows for a form: per run where the row was measured
    under the mitigation protocol, per window otherwise (both bases are consistent per row)."""
    mitigated = _num(batch, "mitigated").fillna(0.0) > 0
    per_run = mitigated & _num(batch, "energy_per_run_j").notna() & \
        _num(batch, "mitigated_time_per_run_s").notna()
    runs = _num(batch, "runs").where(per_run, 1.0)  # divides window totals into per-run figures
    energy = _num(batch, "energy_per_run_j").where(per_run, _num(batch, "energy_j"))
    time_s = _num(batch, "mitigated_time_per_run_s").where(per_run, _num(batch, "time_s"))
    if form == "roofline":
        cols = (time_s, _num(batch, "counted_flops") / runs, _num(batch, "counted_bytes") / runs)
    else:  # profiled fractions of the measured window, applied to the row's time basis
        window = _num(batch, "time_s")
        cols = (time_s, _num(batch, "t_flop_s") / window * time_s, _num(batch, "t_mem_s") / window * time_s)
    return (energy.to_numpy(), *(c.to_numpy() for c in cols))


def fit_stores(dirs: Sequence[str | Path]) -> tuple[dict[str, EnergyFit | str], int]:
    """Both forms fitted on every batch row in ``dirs``: form -> its fit, or the reason it
    cannot be fitted (missing columns, no energy); and the number of rows."""
    batch = _load_all(dirs, "batch")
    if batch.empty:
        decoding = not _load_all(dirs, "decode_batch").empty
        raise ValueError(f"no batch-sweep rows in {', '.join(map(str, dirs))}"
                         + (" (it holds a decoding sweep, `sweep batch-size --decoder`, whose rows "
                            "are checked against the fit, never fitted)" if decoding else "")
                         + "; run the forward-only study, `mtad-energy sweep batch-size --output "
                         "DIR` without --decoder (with --contexts and --chunks for the identifying "
                         "design), and pass that DIR (--fit-from DIR, or as one more RESULTS dir)")
    needs = {"roofline": ("counted_flops", "counted_bytes", "re-run the batch sweep: rows stored "
                          "before counted work have no FLOPs/bytes"),
             "paper": ("t_flop_s", "t_mem_s", "re-run the sweep with --ops")}
    out: dict[str, EnergyFit | str] = {}
    for form in FORMS:
        a, b, fix = needs[form]
        if _num(batch, a).isna().any() or _num(batch, b).isna().any():
            out[form] = f"the batch rows lack {a} / {b}: {fix}"
            continue
        try:
            out[form] = fit_form(form, *fit_columns(batch, form))
        except ValueError as err:
            out[form] = str(err)
    return out, len(batch)


# -- decode windows: validation and attribution -------------------------------------------------
def roofline_fit(dirs: Sequence[str | Path]) -> EnergyFit | str:
    """The roofline fit on the batch rows of ``dirs``, or why there is none (for attribution)."""
    try:
        fit = fit_stores(dirs)[0]["roofline"]
    except ValueError as err:  # no batch rows
        return str(err)
    return fit


def decode_windows(dirs: Sequence[str | Path]) -> pd.DataFrame:
    """Every ``runs`` and ``decode_batch`` row of ``dirs`` as `windows_from` gives them."""
    return windows_from(_load_all(dirs, "runs"), _load_all(dirs, "decode_batch"))


def windows_from(runs: pd.DataFrame | None, decode_batch: pd.DataFrame | None = None) -> pd.DataFrame:
    """Rows of the ``runs`` and ``decode_batch`` tables with the columns validation and
    attribution read (``source`` names the table; ``share`` is a batched runs row's share of its
    batch's joules; model, dataset, decoder and params_json identify a configuration)."""
    frames = []
    for table, df in (("runs", runs), ("decode_batch", decode_batch)):
        if df is None or df.empty:
            continue
        key = "run_key" if table == "runs" else "row_key"
        energy = _num(df, "decode_energy_j") if table == "runs" else _num(df, "energy_j")
        frames.append(pd.DataFrame({
            "source": table, "key": df[key], "model": df.get("model"), "dataset": df.get("dataset"),
            "params_json": df.get("params_json"), "decoder": df["decoder"],
            # runs: one label per configuration, as the summaries name it; a sweep's as stored
            "label": (config_labels(df) if table == "runs" and "params_json" in df
                      else df.get("label", df["decoder"])),
            "batch_size": _num(df, "batch_size").fillna(1.0),
            "meter": df.get("meter"), "decode_energy_j": energy,
            "decode_time_s": _num(df, "decode_time_s"),
            "tokens": _num(df, "tokens_emitted" if table == "runs" else "tokens"),
            "share": _num(df, "energy_share").fillna(1.0),
            "energy_reason": df.get("energy_reason"),
            **{c: _num(df, c) for c in _WINDOW_COLUMNS}}))
        if table == "decode_batch":  # every row's iterations (the table's own is the batch's)
            frames[-1]["iterations"] = _num(df, "rows_iterations")
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _countable(w: pd.DataFrame) -> pd.Series:
    """Windows with counted work and phase times for both models (0 for a decoder without a
    draft; missing where a row predates them or a runner recorded no shapes)."""
    return w[["draft_flops", "draft_bytes", "target_flops", "target_bytes", "time_draft_s",
              "time_target_s", "time_other_s"]].notna().all(axis=1)


def _prediction(fit: EnergyFit, w: pd.DataFrame) -> dict[str, pd.Series]:
    """The roofline model's joules per phase and per term of each window (its own share)."""
    pi0, eps_f, eps_b = (fit.value(n) for n in ("pi0_w", "eps_flop_j", "eps_byte_j"))
    share = w["share"]
    draft_flops, draft_bytes = w["draft_flops"], w["draft_bytes"]
    return {
        "draft": share * (pi0 * w["time_draft_s"] + eps_f * draft_flops + eps_b * draft_bytes),
        "target": share * (pi0 * w["time_target_s"] + eps_f * w["target_flops"]
                           + eps_b * w["target_bytes"]),
        "other": share * pi0 * w["time_other_s"],
        "static": share * pi0 * (w["time_draft_s"] + w["time_target_s"] + w["time_other_s"]),
        "flop": share * eps_f * (draft_flops + w["target_flops"]),
        "mem": share * eps_b * (draft_bytes + w["target_bytes"]),
    }


def _roofline(fit: EnergyFit | str | None) -> EnergyFit | None:
    return fit if isinstance(fit, EnergyFit) and fit.form == "roofline" else None


def validate(fit: EnergyFit, windows: pd.DataFrame) -> pd.DataFrame:
    """Predicted vs measured decode energy of every window that measured one and has counted
    work: columns of `decode_windows` plus predicted_j and error (predicted / measured - 1)."""
    if _roofline(fit) is None:
        raise ValueError("validation predicts from counted work: it takes the roofline fit")
    if windows.empty:
        return windows.assign(predicted_j=[], error=[])
    w = windows[windows["decode_energy_j"].notna() & _countable(windows)].copy()
    p = _prediction(fit, w)
    w["predicted_j"] = p["draft"] + p["target"] + p["other"]
    w["error"] = w["predicted_j"] / w["decode_energy_j"] - 1.0
    return w.reset_index(drop=True)


def _no_attribution(windows: pd.DataFrame, fit: EnergyFit | str | None) -> pd.Series:
    """Why a window gets no attribution (None where it gets one)."""
    if isinstance(fit, str):
        no_fit = f"no energy model: {fit}"
    elif fit is None:
        no_fit = ("no energy model: run `mtad-energy sweep batch-size --contexts ... --chunks ...` "
                  "into the store (or pass one) to fit it")
    else:
        no_fit = None
    reasons = []
    countable = _countable(windows)
    for i, r in windows.iterrows():
        if pd.isna(r["decode_energy_j"]):
            why = str(r["energy_reason"]) if isinstance(r["energy_reason"], str) and \
                r["energy_reason"] else "no energy measured"
            reasons.append(f"no decode energy measured: {why}")
        elif no_fit is not None:
            reasons.append(no_fit)
        elif not countable[i]:
            reasons.append("no counted work or phase times on this row (stored before they were "
                           "recorded, or a model type the counting rule refuses)")
        else:
            reasons.append(None)
    return pd.Series(reasons, index=windows.index, dtype=object)


def attribute(windows: pd.DataFrame, fit: EnergyFit | str | None) -> pd.DataFrame:
    """`decode_windows` plus the attribution columns (`ATTRIBUTION_COLUMNS`; module docstring):
    phase and term joules that add up to the measured decode energy, the scale factor, joules per
    accepted draft token and joules on rejected draft tokens; NaN with ``attribution_reason``
    where a window has no measured energy, no counted work, or there is no roofline fit."""
    out = windows.copy()
    if out.empty:
        return out.assign(**{c: [] for c in ATTRIBUTION_COLUMNS})
    fit_or_reason = fit if isinstance(fit, str) else _roofline(fit)
    if fit is not None and not isinstance(fit, str) and fit_or_reason is None:
        fit_or_reason = "attribution takes the roofline fit"
    out["attribution_reason"] = _no_attribution(out, fit_or_reason)
    for c in ATTRIBUTION_COLUMNS[:-1]:
        out[c] = np.nan
    ok = out["attribution_reason"].isna()
    if not ok.any():
        return out
    w = out[ok]
    p = _prediction(fit_or_reason, w)
    predicted = p["draft"] + p["target"] + p["other"]
    scale = w["decode_energy_j"] / predicted
    for col, part in zip(PHASES, ("draft", "target", "other"), strict=True):
        out.loc[ok, col] = p[part] * scale
    for col, part in zip(TERMS, ("static", "flop", "mem"), strict=True):
        out.loc[ok, col] = p[part] * scale
    out.loc[ok, "attribution_scale"] = scale
    draft_j, target_j = p["draft"] * scale, p["target"] * scale
    proposed, accepted = w["draft_proposed"].fillna(0.0), w["draft_accepted"].fillna(0.0)
    rejected = (proposed - accepted).clip(lower=0.0)
    scored = proposed + w["iterations"].fillna(0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out.loc[ok, "rejected_draft_energy_j"] = (
            np.where(proposed > 0, draft_j * rejected / proposed, 0.0)
            + np.where(scored > 0, target_j * rejected / scored, 0.0))
        out.loc[ok, "energy_per_accepted_draft_token_j"] = np.where(accepted > 0,
                                                                    draft_j / accepted, np.nan)
    return out


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
    ops = ops.assign(frac_flop=_num(ops, "t_flop_s") / _num(ops, "wall_time_s"),
                     frac_mem=_num(ops, "t_mem_s") / _num(ops, "wall_time_s"))
    ops = ops.groupby(keys, as_index=False)[["frac_flop", "frac_mem"]].mean()
    runs = runs.assign(time_s=_num(runs, "prefill_time_s") + _num(runs, "decode_time_s"),
                       energy=_num(runs, "energy_j"))
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
