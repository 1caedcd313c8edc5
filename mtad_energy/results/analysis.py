"""Tidy summaries of a results store: per-decoder speed, quality and energy (`decoder_summary`),
with the flags every table carries (contended, random weights, launch-bound, implausible). The
paper's main table and its Markdown are `markdown`, the accepted-length histograms `accepted`, the
labels and the paper's decoder order `labels`: all re-exported here (``analysis.<name>``). The
batch-size axis (the paper's curve, the crossover of decoders across batch sizes) is `crossover`.

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

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from mtad_energy.results.accepted import accepted_length_histogram, accepted_length_stats
from mtad_energy.results.labels import (
    DECODER_ORDER,
    HIGHER_IS_BETTER,
    METRIC_NAMES,
    _sort_by_decoder,
    config_labels,
    decoder_rank,
    drafting_ids,
    format_param,
    numeric_columns,
    parse_params,
)
from mtad_energy.results.markdown import column_decimals, format_value, main_table, to_markdown
from mtad_energy.results.settings import setting_labels, with_setting
from mtad_energy.specs import random_weights

# This module's names and, re-exported so that ``analysis.<name>`` keeps working in notebooks,
# experiments and reports, those of `labels` (labels and ordering), `markdown` (the main table and
# its Markdown) and `accepted` (accepted-length statistics).
__all__ = ["accepted_length_histogram", "accepted_length_stats", "column_decimals",
           "COMPILE_COLUMNS", "compile_cost", "compile_note", "config_labels",
           "contended_mask", "contention_note", "decode_window_tokens", "DECODER_ORDER",
           "decoder_rank", "decoder_summary", "drafting_ids", "format_param",
           "format_value", "GROUP_KEYS", "HIGHER_IS_BETTER", "HOST_COLUMNS",
           "host_work", "implausible", "IMPLAUSIBLE_NOTE", "join_reasons",
           "launch_bound_mask", "LAUNCH_BOUND_NOTE", "main_table", "METRIC_NAMES",
           "numeric_columns", "others_cores_max", "parse_params", "random_rows",
           "short_reason", "to_markdown"]

# a row per configuration: the draft is part of it (two drafts are two systems, never pooled)
GROUP_KEYS = ("model", "dataset", "draft_id", "decoder", "params_json")


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
