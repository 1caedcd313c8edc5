"""The batch-size axis of a results store: the paper's batch-size curve (the forward-only study's
``batch`` rows) and, for decoders decoding B prompts at once (the ``decode_batch`` rows), the
speed-up over ``ar`` per batch size and the crossover: the batch size from which speculation no
longer pays.

Pure pandas, like `analysis` (whose per-decoder helpers it reuses): no decoders, no meters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from mtad_energy.results.analysis import (
    IMPLAUSIBLE_NOTE,
    compile_cost,
    compile_note,
    config_labels,
    contended_mask,
    decoder_rank,
    implausible,
    join_reasons,
    numeric_columns,
    others_cores_max,
    parse_params,
)
from mtad_energy.results.settings import setting_labels, settings_except, with_setting

# -- batch size ------------------------------------------------------------------------------------
BATCH_COLUMNS = ("batch_size", "runs", "inputs", "energy_j", "energy_per_run_j", "energy_per_input_j",
                 "time_s", "time_per_run_s", "time_per_input_s")


def batch_axis(df: pd.DataFrame) -> pd.DataFrame:
    """The batch-size axis of a batch study's rows: not its context-length or prefill-chunk
    points (rows stored before those axes existed have no ``axis`` and all count)."""
    if "axis" not in df.columns:
        return df
    return df[df["axis"].isna() | (df["axis"] == "batch")]


# a batch row's setting besides its model (`settings`): rows that differ in it are never averaged
BATCH_SETTING = {**settings_except("max_new_tokens", "engine", "batch_size"),
                 "context_len": lambda v: f"context {v if v is not None else 'unrecorded'}"}


def batch_curve(batch: pd.DataFrame) -> pd.DataFrame:
    """The paper's batch-size table: one row per (model, batch size), sorted by batch size, with
    the total, per-run and per-input energy and time (means when a size was measured more than
    once, ``n_rows`` says how often) and ``energy_per_run_rel``, energy per run relative to the
    smallest batch size (the paper's point: it grows much more slowly than the batch). Only the
    batch axis of a design (`batch_axis`) counts. Rows of another meter, device, dtype or
    context length (`BATCH_SETTING`) are another model row: ``opt-13b [meter simulated]``."""
    columns = ["model", *BATCH_COLUMNS, "energy_per_run_rel", "energy_reason", "n_rows"]
    if batch.empty:
        return pd.DataFrame(columns=columns)
    numeric = [c for c in BATCH_COLUMNS if c != "inputs"]
    b = numeric_columns(batch_axis(batch), numeric)
    b["model"] = b["model"].astype(object).where(b["model"].notna(), "")
    b["model"] = with_setting(b["model"], setting_labels(b, BATCH_SETTING))  # never averaged over
    rows = []
    for (model, size), g in b.groupby(["model", "batch_size"], sort=True):
        row = {"model": model, **{c: g[c].mean() for c in numeric if c != "batch_size"},
               "batch_size": int(size), "energy_reason": join_reasons(g["energy_reason"]),
               "n_rows": len(g)}
        row["inputs"] = row["runs"] * size
        rows.append(row)
    curve = pd.DataFrame(rows)
    first = curve.groupby("model")["energy_per_run_j"].transform("first")
    curve["energy_per_run_rel"] = curve["energy_per_run_j"] / first
    return curve.sort_values(["batch_size", "model"], kind="stable").reset_index(drop=True)[columns]


# -- decoders across batch sizes (the decode_batch table) ----------------------------------------
# What makes two decoding sweeps comparable: rows that differ in any of these are another
# experiment (other prompts, lengths or hardware) and are never pooled into one median.
CROSSOVER_SETTING = ("model", "target_id", "dataset", "max_new_tokens", "device", "dtype", "meter")
# a decoder's speed-up is taken over the baseline configuration that warps the same way
WARP_PARAMS = ("temperature", "top_k", "top_p")
CROSSOVER_RULE = ("the smallest batch size from which on (at it and at every larger size measured) "
                  "the median speed-up over {baseline} across the repeats is at most 1")


def _warp(params_json_text: Any) -> str:
    p = parse_params(params_json_text)
    return json.dumps({k: p.get(k) for k in WARP_PARAMS}, sort_keys=True, default=str)


def _crossover(sizes: Sequence[int], speedups: Sequence[float]) -> float:
    """`CROSSOVER_RULE` over one label's (batch size, median speed-up) points; NaN when it still
    beats the baseline at the largest size with a speed-up (sizes without one are skipped)."""
    cross = math.nan
    for size, speedup in sorted(zip(sizes, speedups, strict=True), reverse=True):
        if not math.isfinite(speedup):
            continue
        if speedup > 1.0:
            break
        cross = float(size)  # no faster here and at every larger size
    return cross


def batch_crossover(rows: pd.DataFrame | Sequence[Mapping[str, Any]], baseline: str = "ar"
                    ) -> pd.DataFrame:
    """Per (setting, decoder configuration, batch size): medians over the repeats and the speed-up
    over ``baseline`` at the same batch size, and each configuration's crossover batch size.

    Settings (`CROSSOVER_SETTING`: model, target, dataset, tokens, device, dtype) are kept apart:
    two sweeps of other datasets or lengths in one store are two experiments, never pooled.
    Labels come from the decoder and its parameters (`config_labels`), so two sweeps of one
    decoder with other parameters (``--set temperature=0``) are two labels. Each configuration
    is compared with the ``baseline`` configuration of its setting that warps alike
    (temperature, top_k, top_p), else the one with most rows (``baseline_label``).

    Columns: the setting, label, decoder, params_json, batch_size, repeats, tokens_per_s
    (median), speedup (median over repeats of tokens/s over the baseline's tokens/s of the same
    repeat, i.e. the same seed and prompts; the baseline's median where it lacks that repeat),
    speedup_min / speedup_max (the spread over repeats), energy_per_token_j (median),
    energy_saving (1 - that / the baseline's median), block_efficiency, perplexity (medians),
    beats_baseline (median speed-up > 1), crossover_batch_size (`CROSSOVER_RULE`; NaN: still
    faster at the largest size), baseline_label, energy_reason, meter, n_contended (rows measured
    on a busy machine), baseline_contended (the baseline's at that size were) and
    others_cores_max."""
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df = numeric_columns(df, ("tokens_per_s", "energy_per_token_j", "block_efficiency", "perplexity",
                       "batch_size", "repeat", "max_new_tokens"))
    setting = [c for c in CROSSOVER_SETTING if c in df.columns]
    for c in [*setting, "params_json"]:
        if c not in df.columns:
            df[c] = ""
        df[c] = df[c].astype(object).where(df[c].notna(), "")
    if "repeat" not in df.columns:
        df["repeat"] = 0.0
    for c in ("energy_reason", "meter", "energy_per_token_j", "block_efficiency", "perplexity"):
        if c not in df.columns:
            df[c] = None
    df = numeric_columns(df, ("energy_per_token_j", "block_efficiency", "perplexity"))
    df["label"] = config_labels(df, settings_except(*CROSSOVER_SETTING, "batch_size"))
    df["batch_size"] = df["batch_size"].astype(int)
    out = []
    for skey, part in df.groupby(setting, sort=False) if setting else [((), df)]:
        skey = skey if isinstance(skey, tuple) else (skey,)
        base_cfgs = part[(part["decoder"] == baseline) | (part["label"] == baseline)]
        counts = base_cfgs.groupby("label").size().sort_values(ascending=False, kind="stable")
        base_by_warp = {}
        for label in counts.index:  # most rows first: that one wins a tie of warps
            base_by_warp.setdefault(_warp(base_cfgs[base_cfgs["label"] == label]
                                          ["params_json"].iloc[0]), label)
        fallback = counts.index[0] if len(counts) else None
        # one value per (configuration, size, repeat), whatever wrote a repeat twice
        reps = part.groupby(["label", "batch_size", "repeat"], sort=False, as_index=False)[
            "tokens_per_s"].median()
        for (label, decoder, params, size), g in part.groupby(
                ["label", "decoder", "params_json", "batch_size"], sort=False):
            base_label = base_by_warp.get(_warp(params), fallback)
            mine = reps[(reps["label"] == label) & (reps["batch_size"] == size)]
            theirs = reps[(reps["label"] == base_label) & (reps["batch_size"] == size)]
            base_median = theirs["tokens_per_s"].median() if len(theirs) else math.nan
            by_rep = dict(zip(theirs["repeat"], theirs["tokens_per_s"], strict=True))
            ratios = np.array([t / by_rep.get(r, base_median)
                               for r, t in zip(mine["repeat"], mine["tokens_per_s"], strict=True)])
            base_rows = part[(part["label"] == base_label) & (part["batch_size"] == size)]
            jpt = g["energy_per_token_j"].median()
            out.append({
                **dict(zip(setting, skey, strict=True)), "label": label, "decoder": decoder,
                "params_json": params, "batch_size": int(size), "repeats": len(mine),
                "tokens_per_s": g["tokens_per_s"].median(),
                "speedup": float(np.median(ratios)) if len(ratios) else math.nan,
                "speedup_min": float(ratios.min()) if len(ratios) else math.nan,
                "speedup_max": float(ratios.max()) if len(ratios) else math.nan,
                "energy_per_token_j": jpt,
                "energy_saving": 1.0 - jpt / base_rows["energy_per_token_j"].median()
                if len(base_rows) else math.nan,
                "block_efficiency": g["block_efficiency"].median(),
                "perplexity": g["perplexity"].median(),
                **compile_cost(g, one_per_batch=True),
                "baseline_label": base_label,
                "energy_reason": join_reasons(g.loc[g["energy_per_token_j"].isna(), "energy_reason"]),
                "meter": join_reasons(g["meter"]),
                # this point's or its baseline's rows measured on a busy machine
                "n_contended": int(contended_mask(g).sum()),
                "baseline_contended": bool(contended_mask(base_rows).any()),
                "others_cores_max": others_cores_max(pd.concat([g, base_rows])),
            })
    agg = pd.DataFrame(out)
    agg["beats_baseline"] = agg["speedup"] > 1.0
    agg["implausible"] = implausible(agg, baseline)
    agg["crossover_batch_size"] = math.nan
    for _, g in agg.groupby([*setting, "label"], sort=False):
        if (g["label"] != g["baseline_label"]).all():  # the baseline has no crossover with itself
            agg.loc[g.index, "crossover_batch_size"] = _crossover(g["batch_size"].tolist(),
                                                                  g["speedup"].tolist())
    agg = agg.assign(_rank=agg["decoder"].map(decoder_rank)).sort_values(
        [*setting, "_rank", "label", "batch_size"], kind="stable").drop(columns="_rank")
    return agg.reset_index(drop=True)


def crossover_settings(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """`batch_crossover`'s table split by setting, each with a title naming it
    ("smollm2 · mtbench · 32 tokens · cpu (torch.float32)")."""
    setting = [c for c in CROSSOVER_SETTING if c in table.columns]
    if table.empty:
        return []
    parts = table.groupby(setting, sort=False) if setting else [((), table)]
    several_targets = "target_id" in table and table["target_id"].nunique() > 1
    several_meters = "meter" in table and table["meter"].astype(str).nunique() > 1
    out = []
    for _, g in parts:
        r = g.iloc[0]
        bits = [str(r.get("model", "")), str(r["target_id"]) if several_targets else "",
                str(r.get("dataset", ""))]
        if str(r.get("max_new_tokens", "")) != "":
            bits.append(f"{int(r['max_new_tokens'])} tokens")
        if str(r.get("device", "")) != "":
            bits.append(f"{r['device']} ({r['dtype']})" if str(r.get("dtype", "")) else str(r["device"]))
        if several_meters:
            bits.append(f"meter {r['meter'] or 'unrecorded'}")
        out.append((" · ".join(b for b in bits if b), g.reset_index(drop=True)))
    return out


CROSSOVER_COLUMNS = ("decoder", "B", "repeats", "tok/s", "speed-up", "min-max", "J/tok",
                     "energy saving", "block eff.", "stops beating ar at B")


def crossover_display(table: pd.DataFrame, baseline: str = "ar", compact: bool = True) -> pd.DataFrame:
    """`batch_crossover`'s rows as the text every view prints (the CLI, the report, the notebook):
    batch sizes as integers, speed-ups as "1.14x", the spread over repeats as "0.95-1.30" ("-"
    with one repeat), J/token "n/a" without a reading, the crossover as a batch size, "never"
    (still faster at the largest size) or "n/a" (no baseline at any size); the baseline's own
    rows show "-" there (its speed-up is 1 by definition). ``compact`` leaves out the columns
    that say nothing (so the table fits 80 columns more often): repeats when every point has
    the same number (`crossover_title` says it), the spread with one repeat, J/token and energy
    saving when nothing has an energy reading (the caption gives the reason)."""
    rows = []
    for _, r in table.iterrows():
        is_base = r["label"] == r.get("baseline_label") or r["decoder"] == baseline
        cross = r["crossover_batch_size"]
        has_speedup = table.loc[table["label"] == r["label"], "speedup"].notna().any()
        rows.append({
            "decoder": str(r["label"]), "B": str(int(r["batch_size"])), "repeats": str(int(r["repeats"])),
            "tok/s": _fmt(r["tokens_per_s"], "{:.1f}") + ("*" if r.get("n_contended", 0) else ""),
            "speed-up": _fmt(r["speedup"], "{:.2f}x") + ("*" if _busy_point(r) else "")
            + (" !" if str(r.get("implausible")) == "True" else ""),
            "min-max": "-" if r["repeats"] < 2 or is_base else
            f"{_fmt(r['speedup_min'], '{:.2f}')}-{_fmt(r['speedup_max'], '{:.2f}')}",
            "J/tok": _fmt(r["energy_per_token_j"], "{:.4g}", "n/a"),
            "energy saving": "-" if is_base else _fmt(r["energy_saving"], "{:.0%}"),
            "block eff.": _fmt(r["block_efficiency"], "{:.2f}"),
            "stops beating ar at B".replace("ar", baseline):
                "-" if is_base else "n/a" if not has_speedup else
                "never" if not math.isfinite(cross) else str(int(cross)),
        })
    shown = pd.DataFrame(rows, columns=[c.replace("ar at", f"{baseline} at") for c in CROSSOVER_COLUMNS])
    if compact and not table.empty:
        drop = []
        if table["repeats"].nunique() == 1:
            drop.append("repeats")
        if table["repeats"].max() < 2:
            drop.append("min-max")
        if table["energy_per_token_j"].isna().all():
            drop += ["J/tok", "energy saving"]
        shown = shown.drop(columns=drop)
    return shown


def _busy_point(r: Mapping[str, Any]) -> bool:
    """A crossover point whose rows or whose baseline's rows were contended."""
    return bool(r.get("n_contended", 0)) or bool(r.get("baseline_contended", False))


def crossover_title(table: pd.DataFrame) -> str:
    """"decoders vs batch size", and the repeats behind each median when all points share it."""
    n = table["repeats"].unique() if not table.empty else []
    if len(n) != 1:
        return "decoders vs batch size"
    return f"decoders vs batch size ({'one repeat' if n[0] == 1 else f'median of {int(n[0])} repeats'})"


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    v = pd.to_numeric(value, errors="coerce") if value is not None else math.nan
    return missing if not math.isfinite(v) else spec.format(v)


def crossover_notes(table: pd.DataFrame, baseline: str = "ar") -> list[str]:
    """What the reader of a crossover table must know: the rule, one repeat (a single noisy
    measurement can move the crossover), repeats that disagree on which side of 1 a point lies,
    and a baseline alone (nothing to compare)."""
    if table.empty:
        return []
    notes = [f"crossover: {CROSSOVER_RULE.format(baseline=baseline)}"]
    others = table[table["label"] != table["baseline_label"]]
    if others.empty:
        notes.append(f"only {baseline} was measured: there is no decoder to compare with it")
        return notes
    if (others["repeats"] < 2).any():
        notes.append("one repeat: a single noisy measurement decides each point and can move the "
                     "crossover; re-run with --repeats 3 or more (points are medians over repeats)")
    straddle = others[(others["repeats"] > 1) & (others["speedup_min"] <= 1.0)
                      & (others["speedup_max"] > 1.0)]
    for label, g in straddle.groupby("label", sort=False):
        sizes = ", ".join(str(int(b)) for b in g["batch_size"])
        notes.append(f"{label}: the repeats disagree on beating {baseline} at B = {sizes} (min-max "
                     "spans 1); more repeats would settle the crossover")
    if table["baseline_label"].isna().all():
        notes.append(f"no {baseline} rows: no speed-up and no crossover")
    if note := compile_note(table):
        notes.append(note)
    busy = table[table.apply(_busy_point, axis=1)] if "n_contended" in table else table.iloc[:0]
    if len(busy):
        points = "; ".join(f"{label} at B = {', '.join(str(int(b)) for b in g['batch_size'])}"
                           for label, g in busy.groupby("label", sort=False))
        notes.append(f"contended (*): {points} measured while other processes used the machine "
                     f"(up to {busy['others_cores_max'].max():.2f} core(s)); those speed-ups are "
                     "not the decoders' alone: re-run on a quiet machine")
    if "implausible" in table and table["implausible"].eq(True).any():
        notes.append(IMPLAUSIBLE_NOTE.format(baseline=baseline))
    return notes
