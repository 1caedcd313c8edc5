"""The draft axis: each draft's rows side by side (`draft_rows`, `draft_table`); the figure
of a draft study is `figures.plot_drafts`.

A draft is part of a configuration (`analysis.GROUP_KEYS` has ``draft_id``): rows made with two
drafts are never pooled. Per draft (and model, dataset) the table gives

- ``draft_cost``: c = (seconds per draft forward of its ``spd`` rows, or its head decoder's rows
  for a head) / (seconds per target forward of the baseline's rows): the forward time ratio of
  Leviathan et al.'s speed-up model, measured on this machine;
- ``spd_acceptance``: ``spd``'s accepted / drafted positions with this draft (how often the draft
  agrees with the target, the x of the study);
- per drafting decoder: ``block_efficiency`` (tokens per target forward), ``speedup`` over the
  baseline, ``perplexity``, and ``be_vs_spd`` / ``ppl_vs_spd`` (over ``spd``'s with the same
  draft: the paper's comparison, MTAD 3.17 vs SpD 2.02 = 1.57x).
"""

from __future__ import annotations

import math

import pandas as pd

from mtad_energy.results.analysis import DECODER_ORDER
from mtad_energy.results.caveats import RANDOM_MARK

HEAD_DECODERS = ("eagle", "medusa")
_KEYS = ["model", "dataset", "draft_id"]


def _per_forward(rows: pd.DataFrame, time: str, forwards: str) -> float:
    if rows.empty or time not in rows or forwards not in rows:
        return math.nan
    n = pd.to_numeric(rows[forwards], errors="coerce").sum()
    return float(pd.to_numeric(rows[time], errors="coerce").sum()) / n if n > 0 else math.nan


def draft_rows(summary: pd.DataFrame, runs: pd.DataFrame, baseline: str = "ar") -> pd.DataFrame:
    """Long form: one row per (model, dataset, draft_id, decoder) of the drafting decoders in
    ``summary`` (`analysis.decoder_summary`), with the draft's ``draft_cost`` and
    ``spd_acceptance`` and the decoder's ratios over ``spd`` (module docstring). ``runs``: the
    stored rows the summary was made of (for the forward times)."""
    columns = [*_KEYS, "decoder", "config", "label", "draft_cost", "spd_acceptance",
               "block_efficiency", "speedup", "perplexity", "be_vs_spd", "ppl_vs_spd", "n_runs",
               "n_contended", "implausible", "random_weights"]
    drafted = summary[summary["draft_id"].notna()] if "draft_id" in summary else summary.iloc[:0]
    if drafted.empty:
        return pd.DataFrame(columns=columns)
    runs = runs.assign(draft_id=runs["draft_id"] if "draft_id" in runs else None)
    out = []
    for (model, dataset, draft), g in drafted.groupby(_KEYS, sort=False):
        here = runs[(runs["model"] == model) & (runs["dataset"] == dataset)]
        base = here[here["decoder"] == baseline]
        mine = here[here["draft_id"] == draft]
        cost_rows = mine[mine["decoder"].isin(("spd", *HEAD_DECODERS))]
        cost = (_per_forward(cost_rows, "time_draft_s", "draft_forwards")
                / _per_forward(base, "time_target_s", "target_forwards"))
        spd = g[g["decoder"] == "spd"].sort_values("n_runs", ascending=False, kind="stable")
        spd_be = float(spd["block_efficiency"].iloc[0]) if len(spd) else math.nan
        spd_ppl = float(spd["perplexity"].iloc[0]) if len(spd) else math.nan
        acceptance = float(spd["acceptance_rate"].iloc[0]) if len(spd) else math.nan
        for r in g.to_dict("records"):
            out.append({"model": model, "dataset": dataset, "draft_id": draft,
                        "decoder": r["decoder"], "label": r["label"],
                        "config": r["label"].removesuffix(f"@{draft}"), "draft_cost": cost,
                        "spd_acceptance": acceptance, "block_efficiency": r["block_efficiency"],
                        "speedup": r["speedup"], "perplexity": r["perplexity"],
                        "be_vs_spd": r["block_efficiency"] / spd_be,
                        "ppl_vs_spd": r["perplexity"] / spd_ppl, "n_runs": r["n_runs"],
                        "n_contended": r.get("n_contended", 0),
                        "implausible": bool(r.get("implausible", False)),
                        "random_weights": bool(r.get("random_weights", False))})
    frame = pd.DataFrame(out, columns=columns)
    rank = frame["decoder"].map(lambda d: DECODER_ORDER.index(d) if d in DECODER_ORDER else 99)
    return (frame.assign(_rank=rank)
            .sort_values(["model", "dataset", "spd_acceptance", "draft_id", "_rank"],
                         kind="stable", na_position="last")
            .drop(columns="_rank").reset_index(drop=True))


def draft_flags(rows: pd.DataFrame) -> str:
    """The caveat marks of a draft's rows, as every table of the tool prints them
    (`results.caveats`): ``*`` measured on a busy machine, ``!`` an implausible speed-up, ``†``
    random weights."""
    return (("*" if pd.to_numeric(rows["n_contended"], errors="coerce").fillna(0).gt(0).any()
             else "") + ("!" if rows["implausible"].fillna(False).astype(bool).any() else "")
            + (RANDOM_MARK if rows["random_weights"].fillna(False).astype(bool).any() else ""))


def draft_notes(rows: pd.DataFrame) -> list[str]:
    """What the marks of `draft_flags` in ``rows`` mean, one line each (as under every table)."""
    from mtad_energy.results.analysis import IMPLAUSIBLE_NOTE
    from mtad_energy.specs import RANDOM_NOTE

    contended = pd.to_numeric(rows["n_contended"], errors="coerce").fillna(0)
    return ([f"*: {int(contended.sum())} of {int(rows['n_runs'].sum())} runs were measured on a "
             "busy machine (their speed-ups and draft cost are doubtful)"] if contended.gt(0).any()
            else []) + ([IMPLAUSIBLE_NOTE.format(baseline="the baseline")]
                        if rows["implausible"].fillna(False).astype(bool).any() else []) + (
        [f"{RANDOM_MARK}: {RANDOM_NOTE}"] if rows["random_weights"].fillna(False).astype(bool).any()
        else [])


def draft_table(rows: pd.DataFrame) -> pd.DataFrame:
    """`draft_rows` wide: one row per (model, dataset, draft), its caveat marks (`draft_flags`),
    the draft's cost and SpD acceptance, then each decoder configuration's block efficiency and
    speed-up (``mtad BE``, ``mtad x``; configurations of one decoder stay apart, as
    ``mtad(tau=0.3) BE``), weakest draft (lowest SpD acceptance) first."""
    if rows.empty:
        return pd.DataFrame(columns=["model", "dataset", "draft", "flags", "draft_cost",
                                     "spd_acceptance"])
    drafts = rows.drop_duplicates(_KEYS)[[*_KEYS, "draft_cost", "spd_acceptance"]]
    flags = rows.groupby(_KEYS, sort=False).apply(draft_flags, include_groups=False)
    drafts.insert(3, "flags", [flags.get(tuple(k), "") for k in drafts[_KEYS].to_numpy()])
    wide = rows.pivot_table(index=_KEYS, columns="config", values=["block_efficiency", "speedup"],
                            sort=False)
    configs = list(dict.fromkeys(rows["config"]))
    wide = wide.reindex(columns=[(m, c) for c in configs for m in ("block_efficiency", "speedup")])
    wide.columns = [f"{c} {'BE' if m == 'block_efficiency' else 'x'}" for m, c in wide.columns]
    wide = drafts.merge(wide.reset_index(), on=_KEYS, how="left")
    return wide.rename(columns={"draft_id": "draft"})
