"""Attribution: how the fitted energy roofline splits a measured decode window.

* **Fit columns** (`fit_columns`): the (E, T, W, Q) or (E, T, T_flop, T_mem) columns a batch
  study's rows give each form (`mtad_energy.energy.fit`): per run where the row was measured
  under the Yang et al. protocol, per window otherwise.
* **Validation** (`validate`): the roofline fit predicts the decode-window energy of every window
  that measured one, from its phase times and counted work (`mtad_energy.energy.work`); the error
  is predicted / measured - 1.
* **Attribution** (`attribute`): per decode window, the fitted model's joules of the draft
  forwards (pi0 x draft time + eps_flop x draft FLOPs + eps_byte x draft bytes), of the target
  forwards, and of the rest of the time (pi0 x other time), scaled by one factor so that they
  add up exactly to the measured decode energy (the factor is kept: its distance from 1 is the
  model's error on that window); the same prediction split into static / FLOP / memory joules;
  the draft joules per accepted draft token; and the joules spent on rejected draft tokens (each
  phase's joules split evenly over the tokens it processed: the draft's over the draft tokens
  proposed, the target's over those plus one token per iteration). Without a measured energy or a
  fit these are n/a with the reason (``attribution_reason``), never 0.

A window is a row of `WINDOW_COLUMNS` plus ``decode_energy_j``, ``energy_reason``, ``share`` (a
batched row's share of its batch's joules) and ``tokens``: `mtad_energy.results.breakdown` builds
them from a store. Pure pandas/numpy: no store, no torch, no meters.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mtad_energy.energy.fit import EnergyFit

PHASES = ("draft_energy_j", "target_energy_j", "other_energy_j")
TERMS = ("static_energy_j", "flop_energy_j", "mem_energy_j")
ATTRIBUTION_COLUMNS = (*PHASES, *TERMS, "attribution_scale", "energy_per_accepted_draft_token_j",
                       "rejected_draft_energy_j", "attribution_reason")
WINDOW_COLUMNS = ("time_draft_s", "time_target_s", "time_other_s", "draft_flops", "draft_bytes",
                   "target_flops", "target_bytes", "draft_proposed", "draft_accepted", "iterations")



def numeric(df: pd.DataFrame, col: str) -> pd.Series:
    if col not in df:
        return pd.Series(np.nan, index=df.index, dtype=float)
    return pd.to_numeric(df[col], errors="coerce").astype(float)



def fit_columns(batch: pd.DataFrame, form: str) -> tuple[np.ndarray, ...]:
    """(E, column, column, column) of batch rows for a form: per run where the row was measured
    under the mitigation protocol, per window otherwise (both bases are consistent per row)."""
    mitigated = numeric(batch, "mitigated").fillna(0.0) > 0
    per_run = mitigated & numeric(batch, "energy_per_run_j").notna() & \
        numeric(batch, "mitigated_time_per_run_s").notna()
    runs = numeric(batch, "runs").where(per_run, 1.0)  # divides window totals into per-run figures
    energy = numeric(batch, "energy_per_run_j").where(per_run, numeric(batch, "energy_j"))
    time_s = numeric(batch, "mitigated_time_per_run_s").where(per_run, numeric(batch, "time_s"))
    if form == "roofline":
        cols = (time_s, numeric(batch, "counted_flops") / runs, numeric(batch, "counted_bytes") / runs)
    else:  # profiled fractions of the measured window, applied to the row's time basis
        window = numeric(batch, "time_s")
        cols = (time_s, numeric(batch, "t_flop_s") / window * time_s,
                numeric(batch, "t_mem_s") / window * time_s)
    return (energy.to_numpy(), *(c.to_numpy() for c in cols))



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

