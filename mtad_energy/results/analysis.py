"""Tidy summaries of a results store: per-decoder speed, quality and energy, the paper's main table
(as Markdown) and accepted-length histograms. The batch-size axis (the paper's curve, the
crossover of decoders across batch sizes) is `crossover`.

Pure pandas on the frames `load_results` returns: nothing here imports the decoders or the meters,
so a notebook or report can analyse results on a machine without torch or a GPU.

Aggregation choices (the paper's "average tokens/second" and "average energy per token"):

- ``tokens_per_s`` is the mean of the per-run tokens/s, so every prompt counts equally whatever its
  length; ``tokens_per_s_pooled`` (total tokens / total decode time) is kept beside it because a
  few long generations dominate it, which is what a serving system would see.
- ``energy_per_token_j`` is total energy / total tokens over the runs that have an energy reading:
  energy adds up, per-run ratios do not, and short runs (few tokens, noisy meter windows) would
  otherwise weigh as much as long ones. It includes the prefill.
- Each ratio to the baseline is taken on one basis: ``speedup`` (decode tokens/s) beside
  ``energy_saving`` (decode-only J/token, ``decode_energy_per_token_j``); ``speedup_total``
  (end-to-end tokens/s, prefill included, ``tokens_per_s_total``) beside ``energy_saving_total``
  (total J/token).
- ``block_efficiency``, ``acceptance_rate`` and ``perplexity`` are means of the per-run values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from mtad_energy.results.settings import SETTING_COLUMNS, setting_labels, with_setting
from mtad_energy.specs import random_weights

# a row per configuration: the draft is part of it (two drafts are two systems, never pooled)
GROUP_KEYS = ("model", "dataset", "draft_id", "decoder", "params_json")

# The paper's order: baselines, then lossy, lossless and finally its own methods.
DECODER_ORDER = ("ar", "beam", "mtjd", "bild", "typical", "spd", "spectr", "specinfer", "mcss",
                 "mtad", "mmtad")

HIGHER_IS_BETTER: dict[str, bool] = {
    "tokens_per_s": True,
    "tokens_per_s_pooled": True,
    "speedup": True,
    "block_efficiency": True,
    "acceptance_rate": True,
    "rouge_l": True,
    "pass_at_1": True,
    "energy_saving": True,
    "energy_saving_total": True,
    "speedup_total": True,
    "tokens_per_s_total": True,
    "energy_per_token_j": False,
    "decode_energy_per_token_j": False,
    "perplexity": False,
}

METRIC_NAMES: dict[str, str] = {
    "tokens_per_s": "tokens/s",
    "tokens_per_s_pooled": "tokens/s (pooled)",
    "speedup": "speed-up",
    "block_efficiency": "block eff.",
    "acceptance_rate": "accepted/depth",
    "perplexity": "PPL",
    "energy_per_token_j": "J/token",
    "decode_energy_per_token_j": "J/token (decode)",
    "energy_saving": "energy saving (decode)",
    "energy_saving_total": "energy saving (total)",
    "tokens_per_s_total": "tokens/s (end to end)",
    "speedup_total": "speed-up (end to end)",
    "rouge_l": "Rouge-L",
    "pass_at_1": "pass@1",
    "batch_size": "batch size",
    "runs": "runs",
    "inputs": "inputs",
    "energy_j": "energy (J)",
    "energy_per_run_j": "energy/run (J)",
    "energy_per_input_j": "energy/input (J)",
    "time_s": "time (s)",
    "time_per_run_s": "time/run (s)",
    "time_per_input_s": "time/input (s)",
    "energy_per_run_rel": "energy/run vs smallest batch",
    "iterations": "drafting iterations",
    "mean_accepted": "mean accepted",
    "median_accepted": "median accepted",
    "fraction_zero": "share accepting 0",
    "max_accepted": "max accepted",
}

_NUMERIC_RUN_COLUMNS = ("tokens_emitted", "tokens_per_s", "block_efficiency", "acceptance_rate",
                        "perplexity", "energy_j", "energy_per_token_j", "decode_time_s",
                        "prefill_time_s", "rouge_l", "pass_at_1", "passed", "energy_ci_low_j",
                        "energy_ci_high_j", "decode_energy_j")


COMPILE_COLUMNS = ("compile_s", "graphs_compiled")

# host work per decode iteration (`measure.host_work`: counted in the untimed warm-up), and what
# the iteration cost over its forwards' own time (1 = nothing but forwards)
HOST_COLUMNS = ("host_overhead", "host_ops_per_iter", "graph_calls_per_iter",
                "host_reads_per_iter")


def host_work(rows: pd.DataFrame) -> dict[str, float]:
    """A group of rows' `HOST_COLUMNS`: means of the counted figures (NaN where none was
    counted: an engine's rows, or stored before the counts) and ``host_overhead``, the decode
    time over the forwards' time (draft + target), pooled over the rows."""
    out = {}
    for c in HOST_COLUMNS[1:]:
        v = pd.to_numeric(rows[c], errors="coerce") if c in rows else pd.Series(dtype=float)
        out[c] = float(v.mean()) if v.notna().any() else math.nan
    forwards = (pd.to_numeric(rows.get("time_draft_s"), errors="coerce").fillna(0.0)
                + pd.to_numeric(rows.get("time_target_s"), errors="coerce").fillna(0.0)
                ) if {"time_draft_s", "time_target_s"} <= set(rows) else pd.Series(dtype=float)
    decode = pd.to_numeric(rows.get("decode_time_s"), errors="coerce") \
        if "decode_time_s" in rows else pd.Series(dtype=float)
    ok = forwards.gt(0) & decode.notna() if len(forwards) else forwards.astype(bool)
    out["host_overhead"] = (float(decode[ok].sum() / forwards[ok].sum()) if ok.any()
                            else math.nan)
    return {c: out[c] for c in HOST_COLUMNS}


def compile_cost(rows: pd.DataFrame, one_per_batch: bool = False) -> dict[str, float]:
    """What compiling cost a group of rows: ``compile_s`` the seconds spent compiling (the
    warm-ups before their windows and any compile inside them), ``graphs_compiled`` the graphs.
    A `runs` row carries its batch's figures (every row of a B-row batch, as it carries the
    batch's decode time), so each counts 1 / batch_size of them; a `decode_batch` row is a whole
    batch (``one_per_batch``). NaN for rows stored before the figures were kept."""
    share = 1.0 if one_per_batch else 1.0 / pd.to_numeric(
        rows["batch_size"], errors="coerce").fillna(1).clip(lower=1) if "batch_size" in rows else 1.0
    out = {}
    for c in COMPILE_COLUMNS:
        v = pd.to_numeric(rows[c], errors="coerce") if c in rows else pd.Series(dtype=float)
        out[c] = float((v * share).sum()) if v.notna().any() else math.nan
    return out


def compile_note(table: pd.DataFrame) -> str:
    """A caption line naming each configuration's seconds compiling (empty when none did)."""
    if "compile_s" not in table or not (pd.to_numeric(table["compile_s"], errors="coerce") > 0).any():
        return ""
    parts = []
    for label, g in table.groupby("label", sort=False):
        spent = pd.to_numeric(g["compile_s"], errors="coerce").sum()
        graphs = pd.to_numeric(g.get("graphs_compiled"), errors="coerce").sum()
        parts.append(f"{label} {spent:.1f} s ({graphs:.0f} graphs)")
    return "compiling (warm-ups before the windows; left out of tok/s): " + ", ".join(parts)


# -- labels and ordering ---------------------------------------------------------------------------
def format_param(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ",".join(format_param(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    return str(value)


def parse_params(text: Any) -> dict[str, Any]:
    if not isinstance(text, str) or not text.strip():
        return {}
    try:
        parsed = json.loads(text)
    except ValueError:
        return {"params": text}  # not JSON: show it whole rather than drop it
    return parsed if isinstance(parsed, dict) else {"params": parsed}


def config_labels(runs: pd.DataFrame, settings: Mapping = SETTING_COLUMNS) -> pd.Series:
    """A readable label per row: the decoder name, plus the parameters that differ between the
    configurations of that decoder present in ``runs`` (``mtad(tau=0.3)``). The store does not say
    which values are defaults, so "non-default" is judged from the data: a parameter that every
    configuration shares tells the reader nothing. Likewise the draft (``spd@self:int8``) where a
    decoder's rows in ``runs`` have more than one. A ``label`` column stored by the runner (the
    parameters as typed) is not used: two spellings of one configuration must share a row. Rows
    measured under other ``settings`` (meter, tokens, device, dtype, engine, batch size:
    `settings.setting_labels`) get them in brackets, ``spd [meter simulated]``."""
    labels = _param_labels(runs)
    if "draft_id" in runs:
        drafts = drafting_ids(runs).astype(object)
        drafts = drafts.where(drafts.notna(), "")
        several = drafts.groupby(runs["decoder"]).transform("nunique") > 1
        labels = labels.where(~several, labels + "@" + drafts.map(str))
    return with_setting(labels, setting_labels(runs, settings)).rename("label")


def drafting_ids(runs: pd.DataFrame) -> pd.Series:
    """Each row's ``draft_id``, None for a decoder that drafts without the pair's draft model
    (``ar``, ``beam``, ``pld``: `decoding.registry`): rows stored before such decoders stopped
    naming the pair's draft are the same configuration as those after."""
    from mtad_energy.decoding.registry import DECODERS

    free = [n for n, c in DECODERS.items() if not c.needs_draft and c.head is None]
    ids = runs["draft_id"] if "draft_id" in runs else pd.Series(None, index=runs.index)
    return ids.astype(object).where(~runs["decoder"].isin(free) & ids.notna(), None)


def _param_labels(runs: pd.DataFrame) -> pd.Series:
    pairs = runs[["decoder", "params_json"]].astype(object)
    pairs = pairs.where(pairs.notna(), "")
    labels: dict[tuple[str, str], str] = {}
    for decoder, group in pairs.groupby("decoder", sort=False):
        configs = sorted(set(group["params_json"]))
        if len(configs) == 1:
            labels[(decoder, configs[0])] = str(decoder)
            continue
        parsed = {c: parse_params(c) for c in configs}
        keys = sorted({k for p in parsed.values() for k in p})
        varying = [k for k in keys if len({json.dumps(p.get(k), sort_keys=True, default=str)
                                           for p in parsed.values()}) > 1]
        for c, p in parsed.items():
            shown = ", ".join(f"{k}={format_param(p[k])}" for k in varying if k in p)
            labels[(decoder, c)] = f"{decoder}({shown})" if shown else f"{decoder}({c})"
    return pd.Series([labels[(d, p)] for d, p in zip(pairs["decoder"], pairs["params_json"], strict=True)],
                     index=runs.index, name="label", dtype=object)


def decoder_rank(decoder: str) -> int:
    """Position of a decoder in the paper's order; unknown decoders go last."""
    return DECODER_ORDER.index(decoder) if decoder in DECODER_ORDER else len(DECODER_ORDER)


def _sort_by_decoder(frame: pd.DataFrame, then: Sequence[str] = ()) -> pd.DataFrame:
    order = frame["decoder"].map(decoder_rank)
    keys = [c for c in ("model", "dataset") if c in frame.columns and c not in then]
    tmp = frame.assign(_rank=order)
    return tmp.sort_values([*keys, "_rank", "decoder", "label", *then], kind="stable").drop(
        columns="_rank").reset_index(drop=True)


def numeric_columns(frame: pd.DataFrame, columns: Iterable[str]) -> pd.DataFrame:
    out = frame.copy()
    for c in columns:
        if c in out.columns:
            # None-only part files come back as object columns; make them float NaN
            out[c] = pd.to_numeric(out[c], errors="coerce").astype(float)
    return out


# -- per-decoder summary ---------------------------------------------------------------------------
IMPLAUSIBLE_NOTE = ("!: implausible: faster than {baseline} with no draft token accepted (block "
                    "efficiency 1.00), so load or drift on the machine, not the decoder, made the "
                    "difference; re-run with --repeats 3 or more on a quiet machine")


def implausible(frame: pd.DataFrame, baseline: str = "ar") -> pd.Series:
    """Rows whose speed-up over ``baseline`` is above 1 although every target forward emitted one
    token (block efficiency 1.00: nothing drafted was accepted): such a decoder did the baseline's
    work plus its drafting, so its speed-up cannot be its own."""
    speedup = pd.to_numeric(frame.get("speedup"), errors="coerce")
    block = pd.to_numeric(frame.get("block_efficiency"), errors="coerce")
    return ((speedup > 1.0) & (block < 1.005) & (frame["decoder"] != baseline)).fillna(False) \
        .astype(bool)


def short_reason(reason: Any) -> str:
    """The first clause of a (possibly long or multi-line) meter or energy reason, for one table
    line, caption or figure; reports list the whole reason."""
    lines = str(reason or "").strip().splitlines()
    return lines[0].split(";")[0].split(". ")[0].strip() if lines else "no energy measured"


def join_reasons(values: pd.Series) -> str | None:
    reasons = sorted({str(v) for v in values.dropna() if str(v).strip()})
    return "; ".join(reasons) if reasons else None


def decode_window_tokens(frame: pd.DataFrame, total: str = "tokens_emitted") -> pd.Series:
    """Per stored row, the tokens its decode window holds (``decode_tokens``: an engine's first
    token streams out of the prefill window); rows stored before the column count all of
    ``total`` (the project's decoders: the same number)."""
    all_tokens = pd.to_numeric(frame[total], errors="coerce").astype(float)
    if "decode_tokens" not in frame:
        return all_tokens
    return pd.to_numeric(frame["decode_tokens"], errors="coerce").astype(float).fillna(all_tokens)


def _decode_jpt(g: pd.DataFrame) -> float:
    """Decode-phase energy / the decode window's tokens over the runs with a decode energy
    reading."""
    if "decode_energy_j" not in g:
        return math.nan
    ok = g["decode_energy_j"].notna()
    tokens = float(decode_window_tokens(g.loc[ok]).sum())
    return float(g.loc[ok, "decode_energy_j"].sum()) / tokens if tokens > 0 else math.nan


def contended_mask(frame: pd.DataFrame) -> pd.Series:
    """Rows measured on a busy machine (``contended`` true; rows stored before the column, or
    unprobed, count as not flagged)."""
    if "contended" not in frame:
        return pd.Series(False, index=frame.index)
    return frame["contended"].map(lambda v: bool(v) if v is not None and v == v else False)


def random_rows(frame: pd.DataFrame) -> pd.Series:
    """Stored rows whose target, draft or heads have random weights (`config.random_weights`):
    their acceptance, block efficiency and quality mean nothing."""
    mask = pd.Series(False, index=frame.index)
    for column in ("model", "target_id", "draft_id"):
        if column in frame:
            mask |= frame[column].map(random_weights).astype(bool)
    return mask


def others_cores_max(frame: pd.DataFrame, column: str = "others_cores") -> float:
    if column not in frame:
        return math.nan
    values = pd.to_numeric(frame[column], errors="coerce")
    return float(values.max()) if values.notna().any() else math.nan


def contention_note(frame: pd.DataFrame, what: str = "runs") -> str | None:
    """One line for a table's caption when some of ``frame``'s rows (a summary with
    ``n_contended``, or stored rows with ``contended``) were measured on a busy machine."""
    if frame.empty:
        return None
    if "n_contended" in frame:
        n = int(pd.to_numeric(frame["n_contended"], errors="coerce").fillna(0).sum())
        most = others_cores_max(frame, "others_cores_max")
    else:
        n, most = int(contended_mask(frame).sum()), others_cores_max(frame)
    if n == 0:
        return None
    figure = f", up to {most:.2f} core(s)" if math.isfinite(most) else ""
    return (f"*: {n} of the {what} were measured while other processes used the machine "
            f"(contended{figure}); their speed and energy are not the decoder's alone")


LAUNCH_BOUND_NOTE = ("launch-bound: the project's decoders ran eager on a GPU (--eager), where a "
                     "forward costs its kernel launches (an 8B forward 36-44 ms eager against 6.5 "
                     "ms compiled on an H200), not the algorithm: drop --eager for the compiled "
                     "path")


def launch_bound_mask(frame: pd.DataFrame) -> pd.Series:
    """Rows of the project's own decoders (engine hf) run eager on a GPU: their speed and joules
    measure kernel launches, not the algorithm (`LAUNCH_BOUND_NOTE`)."""
    if "device" not in frame:
        return pd.Series(False, index=frame.index)
    gpu = frame["device"].astype(str).str.startswith("cuda")
    compiled = frame["compile"].fillna(False).astype(bool) if "compile" in frame else False
    own = frame["engine"].fillna("hf").astype(str).eq("hf") if "engine" in frame else True
    return gpu & ~compiled & own


def _summarise_group(g: pd.DataFrame, optional: Sequence[str]) -> dict[str, Any]:
    tokens = g["tokens_emitted"]
    total_tokens = float(tokens.sum())
    total_decode_s = float(g["decode_time_s"].sum())
    has_energy = g["energy_j"].notna()
    energy_tokens = float(tokens[has_energy].sum())
    total_energy_j = float(g.loc[has_energy, "energy_j"].sum()) if has_energy.any() else math.nan
    row: dict[str, Any] = {
        "label": g["label"].iloc[0],
        "n_runs": len(g),
        "n_prompts": g["prompt_id"].nunique(),
        "total_tokens": total_tokens,
        "total_decode_time_s": total_decode_s,
        "tokens_per_s": g["tokens_per_s"].mean(),
        "tokens_per_s_std": g["tokens_per_s"].std(ddof=1) if len(g) > 1 else math.nan,
        "tokens_per_s_pooled": (float(decode_window_tokens(g).sum()) / total_decode_s
                                if total_decode_s > 0 else math.nan),
        "block_efficiency": g["block_efficiency"].mean(),
        "acceptance_rate": g["acceptance_rate"].mean(),
        "perplexity": g["perplexity"].mean(),
        "n_energy_runs": int(has_energy.sum()),
        "total_energy_j": total_energy_j,
        "energy_per_token_j": total_energy_j / energy_tokens if energy_tokens > 0 else math.nan,
        "decode_energy_per_token_j": _decode_jpt(g),
        "tokens_per_s_total": (tokens / (g["decode_time_s"] + g["prefill_time_s"].fillna(0.0))
                               ).mean() if "prefill_time_s" in g else math.nan,
        # why energy is missing, only for the runs that lack it
        "energy_reason": join_reasons(g.loc[~has_energy, "energy_reason"]),
        "meter": join_reasons(g["meter"]),
        # measured on a busy machine (`measure.contention`): counted, never pooled silently
        "n_contended": int(contended_mask(g).sum()),
        "others_cores_max": others_cores_max(g),
        "launch_bound": bool(launch_bound_mask(g).any()),
        # random weights at real shapes: acceptance and quality are not the model's
        "random_weights": bool(random_rows(g).any()),
    }
    if "energy_ci_low_j" in optional:
        # summing per-run bounds gives a conservative (too wide, never too narrow) interval; only
        # when every run behind the J/token has bounds, so both describe the same runs
        ok = has_energy & g["energy_ci_low_j"].notna() & g["energy_ci_high_j"].notna()
        ok_tokens = float(tokens[ok].sum()) if ok.sum() == has_energy.sum() else 0.0
        row["energy_per_token_ci_low_j"] = (g.loc[ok, "energy_ci_low_j"].sum() / ok_tokens
                                            if ok_tokens > 0 else math.nan)
        row["energy_per_token_ci_high_j"] = (g.loc[ok, "energy_ci_high_j"].sum() / ok_tokens
                                             if ok_tokens > 0 else math.nan)
    if "compile_s" in optional:
        row.update(compile_cost(g))
    row.update(host_work(g))
    if "rouge_l" in optional:
        row["rouge_l"] = g["rouge_l"].mean()
    if "pass_at_1" in optional:
        row["pass_at_1"] = g["pass_at_1"].mean()
    return row


def _baseline_rows(summary: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """The baseline configuration per (model, dataset): ``baseline`` names a label or, failing
    that, a decoder; of several matching configurations the one with most runs is used."""
    match = (summary["label"] == baseline) | (summary["label"] == with_setting(
        pd.Series(baseline, index=summary.index), summary["setting"]))
    if not match.any():
        match = summary["decoder"] == baseline
    base = summary[match].sort_values(["n_runs", "params_json"], ascending=[False, True], kind="stable")
    return base.drop_duplicates(["model", "dataset", "setting"])[[
        "model", "dataset", "setting", "tokens_per_s", "energy_per_token_j",
        "decode_energy_per_token_j", "tokens_per_s_total"]]


def decoder_summary(runs: pd.DataFrame, baseline: str = "ar") -> pd.DataFrame:
    """One row per (model, dataset, draft_id, decoder, params_json) with speed, quality and
    energy.

    Columns: model, dataset, draft_id (what drafted; None without a draft), decoder,
    params_json, label, n_runs, n_prompts, total_tokens,
    total_decode_time_s, tokens_per_s (mean of per-run tokens/s), tokens_per_s_std,
    tokens_per_s_pooled (total tokens / total decode time), speedup (tokens_per_s over the
    baseline's on the same model and dataset; NaN without a baseline), block_efficiency,
    acceptance_rate, perplexity (means), n_energy_runs, total_energy_j, energy_per_token_j (total
    energy / total tokens of the runs with energy; NaN when none has), energy_saving
    (1 - J/token / baseline J/token), energy_reason (why energy is missing, if it is), meter,
    n_contended (runs measured on a busy machine: `measure.contention`), others_cores_max (the
    most core-equivalents other processes took during one of them), launch_bound (eager on a
    GPU: `launch_bound_mask`) and random_weights (its target, draft or heads have random
    weights: `config.random_weights`);
    and when ``runs`` has them: energy_per_token_ci_low_j / _high_j, rouge_l, pass_at_1 (the mean
    of a ``pass_at_1`` or per-row 0/1 ``passed`` column), compile_s / graphs_compiled
    (`compile_cost`); always host_overhead, host_ops_per_iter, graph_calls_per_iter and
    host_reads_per_iter (`host_work`; NaN where not counted).
    """
    optional = []
    runs = runs.copy()
    if "pass_at_1" not in runs.columns and "passed" in runs.columns:
        runs["pass_at_1"] = runs["passed"]
    for c in ("rouge_l", "pass_at_1"):
        if c in runs.columns:
            optional.append(c)
    if {"energy_ci_low_j", "energy_ci_high_j"} <= set(runs.columns):
        optional.append("energy_ci_low_j")
    if "compile_s" in runs.columns:
        optional.append("compile_s")
    columns = [*GROUP_KEYS, "setting", "label", "n_runs", "n_prompts", "total_tokens", "total_decode_time_s",
               "tokens_per_s", "tokens_per_s_std", "tokens_per_s_pooled", "speedup",
               "block_efficiency", "acceptance_rate", "perplexity", "n_energy_runs", "total_energy_j",
               "energy_per_token_j", "decode_energy_per_token_j", "energy_saving",
               "tokens_per_s_total", "speedup_total", "energy_saving_total", "energy_reason", "meter",
               "n_contended", "others_cores_max", "launch_bound", "random_weights"]
    if "energy_ci_low_j" in optional:
        columns[columns.index("energy_saving"):columns.index("energy_saving")] = [
            "energy_per_token_ci_low_j", "energy_per_token_ci_high_j"]
    columns += [c for c in ("rouge_l", "pass_at_1") if c in optional]
    columns += list(COMPILE_COLUMNS) if "compile_s" in optional else []
    columns += list(HOST_COLUMNS)
    if runs.empty:
        return pd.DataFrame(columns=columns)

    runs = numeric_columns(runs, _NUMERIC_RUN_COLUMNS)
    runs["draft_id"] = drafting_ids(runs)
    for c in GROUP_KEYS:
        runs[c] = runs[c].astype(object).where(runs[c].notna(), "")
    runs["label"] = config_labels(runs)
    runs["setting"] = setting_labels(runs)  # never averaged over: a row of its own, and its baseline
    rows = []
    for keys, g in runs.groupby([*GROUP_KEYS, "setting"], sort=False):
        rows.append({**dict(zip([*GROUP_KEYS, "setting"], keys, strict=True)),
                     **_summarise_group(g, optional)})
    summary = pd.DataFrame(rows)
    summary["draft_id"] = summary["draft_id"].map(lambda v: v or None)  # "" grouped: no draft

    base = _baseline_rows(summary, baseline).rename(columns={
        "tokens_per_s": "_base_tps", "energy_per_token_j": "_base_jpt",
        "decode_energy_per_token_j": "_base_dec_jpt", "tokens_per_s_total": "_base_tps_total"})
    summary = summary.merge(base, on=["model", "dataset", "setting"], how="left")
    # each ratio on one basis: decode with decode, end to end with total
    summary["speedup"] = summary["tokens_per_s"] / summary["_base_tps"]
    summary["energy_saving"] = 1.0 - summary["decode_energy_per_token_j"] / summary["_base_dec_jpt"]
    summary["speedup_total"] = summary["tokens_per_s_total"] / summary["_base_tps_total"]
    summary["energy_saving_total"] = 1.0 - summary["energy_per_token_j"] / summary["_base_jpt"]
    summary = summary.drop(columns=["_base_tps", "_base_jpt", "_base_dec_jpt", "_base_tps_total"])
    summary["implausible"] = implausible(summary, baseline)
    return _sort_by_decoder(summary[[*columns, "implausible"]])


# -- the paper's main table ------------------------------------------------------------------------
def main_table(summary: pd.DataFrame,
               metrics: Sequence[str] = ("tokens_per_s", "energy_per_token_j", "perplexity")
               ) -> pd.DataFrame:
    """Decoders (labels) as rows, for each dataset a group of metric columns: columns are a
    (dataset, metric) MultiIndex. With several models the rows are (model, label)."""
    metrics = list(metrics)
    missing = [m for m in metrics if m not in summary.columns]
    if missing:
        raise KeyError(f"summary has no column(s) {', '.join(missing)}")
    multi_model = summary["model"].nunique() > 1
    index = ["model", "label"] if multi_model else ["label"]
    rows_info = summary[[*index, "decoder"]].drop_duplicates(index)
    rows_info = rows_info.assign(_rank=rows_info["decoder"].map(decoder_rank)).sort_values(
        [*index[:-1], "_rank", "decoder", "label"], kind="stable")
    row_order = [tuple(r) for r in rows_info[index].to_numpy().tolist()]
    datasets = sorted(summary["dataset"].unique())
    wide = summary.set_index([*index, "dataset"])[metrics].unstack("dataset")
    wide.columns = wide.columns.swaplevel(0, 1)
    wide = wide.reindex(columns=pd.MultiIndex.from_product([datasets, metrics],
                                                           names=["dataset", "metric"]))
    rows = pd.MultiIndex.from_tuples(row_order, names=index) if multi_model else \
        pd.Index([r[0] for r in row_order], name="label")
    return wide.reindex(rows)


def column_decimals(values: Iterable[Any]) -> int:
    """Decimals that give the largest value of a column about three significant digits, like the
    paper (23.8 tokens/s, 7.8 J/token, 4.15 score, 0.0123 J/token): one precision per column so
    its numbers line up and compare at a glance."""
    if isinstance(values, pd.Series) and pd.api.types.is_integer_dtype(values.dtype):
        return 0  # counts (iterations, batch sizes) have no decimals to show
    finite = [abs(float(v)) for v in values
              if isinstance(v, int | float | np.number) and not isinstance(v, bool) and math.isfinite(v)]
    top = max(finite, default=0.0)
    if top == 0.0:
        return 2
    return max(0, 2 - math.floor(math.log10(top)))


def format_value(value: Any, decimals: int | None = None) -> str:
    """A number with ``decimals`` places (default: three significant digits), thousands separated;
    NaN and None print as n/a."""
    if value is None:
        return "n/a"
    if not isinstance(value, int | float | np.number) or isinstance(value, bool):
        return str(value)
    v = float(value)
    if math.isnan(v):
        return "n/a"
    if decimals is None:
        decimals = column_decimals([v])
    return f"{v:,.{decimals}f}"


def _ranks(values: pd.Series, decimals: int, higher: bool) -> pd.Series:
    """Competition ranks (1, 1, 3, ...) of the values as displayed, so numbers that print the same
    are marked the same, and a tie for best leaves no second best (the paper's convention)."""
    shown = values.map(lambda v: float(format_value(v, decimals).replace(",", ""))
                       if math.isfinite(v) else math.nan)
    if shown.notna().sum() < 2:  # a lone number is not a comparison: mark nothing
        return pd.Series(math.nan, index=values.index)
    return shown.rank(method="min", ascending=not higher)


def _escape(text: Any) -> str:
    return str(text).replace("|", "\\|")


def to_markdown(table: pd.DataFrame, higher_is_better: Mapping[str, bool] | None = None,
                marks: pd.DataFrame | None = None, unranked: pd.DataFrame | None = None) -> str:
    """A Markdown table: best value per column in **bold**, second best <u>underlined</u>.

    ``higher_is_better`` maps metric names (the last level of the columns) to True/False and is
    merged over `HIGHER_IS_BETTER`; columns of other metrics are not marked. Ties (judged on the
    displayed digits) share the mark; NaN prints as n/a and is never marked. With a (model, label)
    row index, best and second best are picked within each model. ``marks`` (text, aligned with
    ``table``) is written after a cell's value; a cell True in ``unranked`` (aligned) is never
    bold or underlined, nor counted in the others' ranks (`caveats`). No `tabulate` needed.
    """
    better = {**HIGHER_IS_BETTER, **(higher_is_better or {})}
    cells = pd.DataFrame(index=table.index, columns=table.columns, dtype=object)
    groups = (table.index.get_level_values(0) if isinstance(table.index, pd.MultiIndex)
              and table.index.nlevels > 1 else pd.Index(["all"] * len(table)))
    for col in table.columns:
        metric = col[-1] if isinstance(col, tuple) else col
        values = table[col]
        numeric = pd.to_numeric(values, errors="coerce")
        decimals = column_decimals(numeric)
        numeric = numeric.astype(float)
        if unranked is not None:
            numeric = numeric.mask(unranked[col].to_numpy(dtype=bool))
        text = values.map(lambda v, d=decimals: format_value(v, d))
        if metric in better:
            for g in pd.unique(groups):
                positions = np.flatnonzero(np.asarray(groups == g))
                ranks = _ranks(numeric.iloc[positions], decimals, better[metric])
                for pos, r in zip(positions, ranks, strict=True):
                    if r == 1:
                        text.iloc[pos] = f"**{text.iloc[pos]}**"
                    elif r == 2:
                        text.iloc[pos] = f"<u>{text.iloc[pos]}</u>"
        cells[col] = (text + marks[col]).to_numpy() if marks is not None else text.to_numpy()

    index_names = [METRIC_NAMES.get(n, n) if n else "" for n in table.index.names]
    headers = [*index_names]
    for col in table.columns:
        parts = list(col) if isinstance(col, tuple) else [col]
        metric = parts[-1]
        name = METRIC_NAMES.get(metric, str(metric))
        arrow = {True: " ↑", False: " ↓"}.get(better.get(metric), "")
        headers.append(": ".join([*map(str, parts[:-1]), name + arrow]))
    lines = ["| " + " | ".join(_escape(h) for h in headers) + " |",
             "|" + "|".join([":---"] * len(index_names) + ["---:"] * len(table.columns)) + "|"]
    for idx, row in cells.iterrows():
        keys = list(idx) if isinstance(idx, tuple) else [idx]
        lines.append("| " + " | ".join([*(_escape(k) for k in keys), *row.tolist()]) + " |")
    return "\n".join(lines) + "\n"


# -- accepted lengths ------------------------------------------------------------------------------
def accepted_length_histogram(steps: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """How many draft tokens each iteration accepted, per decoder configuration: columns decoder,
    label, accepted, count, fraction (fractions of one label sum to 1). Only iterations that
    proposed draft tokens count (``ar``/``beam`` never do, and a drafting decoder's last step may
    not), and every length from 0 to the longest seen is listed so bars line up across decoders."""
    columns = ["decoder", "label", "accepted", "count", "fraction"]
    if steps.empty or runs.empty:
        return pd.DataFrame(columns=columns)
    info = runs[[c for c in ("run_key", "decoder", "params_json", "draft_id", *SETTING_COLUMNS)
                 if c in runs]].copy()
    info["label"] = config_labels(info)  # the draft in it where a decoder ran with several
    merged = numeric_columns(steps[["run_key", "accepted", "proposed"]], ("accepted", "proposed")).merge(
        info[["run_key", "decoder", "label"]], on="run_key", how="inner")
    merged = merged[(merged["proposed"] > 0) & merged["accepted"].notna()]
    if merged.empty:
        return pd.DataFrame(columns=columns)
    merged["accepted"] = merged["accepted"].astype(int)
    frames = []
    for (decoder, label), g in merged.groupby(["decoder", "label"], sort=False):
        counts = g["accepted"].value_counts().reindex(range(int(g["accepted"].max()) + 1), fill_value=0)
        frames.append(pd.DataFrame({"decoder": decoder, "label": label, "accepted": counts.index,
                                    "count": counts.to_numpy().astype(int),
                                    "fraction": counts.to_numpy() / counts.sum()}))
    return _sort_by_decoder(pd.concat(frames, ignore_index=True), then=["accepted"])[columns]


def _counted_median(values: pd.Series, counts: pd.Series) -> float:
    """The median of ``values`` each repeated ``counts`` times (values ascending): the middle
    one, or the mean of the two middle ones of an even count."""
    cum, v = np.cumsum(counts.to_numpy()), values.to_numpy()
    n = int(cum[-1])
    return float(v[np.searchsorted(cum, (n + 1) // 2)] + v[np.searchsorted(cum, n // 2 + 1)]) / 2


def accepted_length_stats(histogram: pd.DataFrame) -> pd.DataFrame:
    """Per label: iterations, mean and median accepted length (of an even count, the mean of the
    two middle values, as everywhere else), share of iterations that accepted nothing, longest
    accepted run."""
    rows = []
    for (decoder, label), g in histogram.groupby(["decoder", "label"], sort=False):
        rows.append({"decoder": decoder, "label": label, "iterations": int(g["count"].sum()),
                     "mean_accepted": float((g["accepted"] * g["fraction"]).sum()),
                     "median_accepted": _counted_median(g["accepted"], g["count"]),
                     "fraction_zero": float(g.loc[g["accepted"] == 0, "fraction"].sum()),
                     "max_accepted": int(g.loc[g["count"] > 0, "accepted"].max())})
    return pd.DataFrame(rows, columns=["decoder", "label", "iterations", "mean_accepted",
                                       "median_accepted", "fraction_zero", "max_accepted"])
