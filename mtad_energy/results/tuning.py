"""The choice of `mtad-energy tune`: each decoder's best setting on the validation prompts by a
criterion, and how sure that choice is.

Criteria (`CRITERIA`): ``ppl`` (the paper's: the lowest mean perplexity under the target),
``speed`` (the highest mean tokens/s) and ``energy`` (the lowest mean J/token), the last two among
the settings whose mean perplexity is at most ``max_ppl_ratio`` times the baseline's (``ar``) on
the same prompts. Every mean is over the validation prompts every compared setting (and the
baseline) has a row for, each prompt's value the mean of its repeats: settings are compared on the
same prompts only.

The uncertainty: the validation prompts are resampled with replacement (`RESAMPLES` times, a fixed
seed), the choice made again on each resample (budget included), and ``bootstrap_fraction`` is the
fraction of resamples in which the same setting wins. Ties go to the setting first in grid order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from mtad_energy.results.analysis import (
    config_labels,
    contended_mask,
    format_param,
    parse_params,
    random_rows,
)

# criterion -> (the runs column it reads, whether higher is better)
CRITERIA: dict[str, tuple[str, bool]] = {
    "ppl": ("perplexity", False),
    "speed": ("tokens_per_s", True),
    "energy": ("energy_per_token_j", False),
}
RESAMPLES = 1000


class NoSettingError(ValueError):
    """No setting of a decoder meets the perplexity budget, or none has the criterion's column."""


class IncompleteError(NoSettingError):
    """Too few validation rows to choose from (a spent ``--budget-s``): re-run to measure them."""


def prompt_matrix(runs: pd.DataFrame, column: str) -> pd.DataFrame:
    """``column`` per validation prompt (rows: dataset, prompt_id) and setting (columns:
    decoder, params_json), each cell the mean over the prompt's repeats."""
    return runs.pivot_table(index=["dataset", "prompt_id"], columns=["decoder", "params_json"],
                            values=column, aggfunc="mean", sort=False)


def winners(values: np.ndarray, ppl: np.ndarray, base_ppl: np.ndarray, higher: bool,
            max_ppl_ratio: float | None) -> np.ndarray:
    """The index of the winning setting per resample, -1 where none meets the budget.

    values, ppl: (R, S) means of the criterion and of perplexity per resample and setting;
    base_ppl: (R,) the baseline's mean perplexity per resample."""
    score = values if higher else -values
    score = np.where(np.isnan(score), -np.inf, score)
    if max_ppl_ratio is not None:
        ratio = ppl / base_ppl[:, None]  # (R, S)
        score = np.where(ratio <= max_ppl_ratio, score, -np.inf)
    best = np.argmax(score, axis=1)  # the first of tied settings: grid order
    return np.where(np.isfinite(score[np.arange(len(best)), best]), best, -1)


def bootstrap_indices(n_prompts: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """(resamples + 1, n_prompts) prompt indices: row 0 the sample itself (every prompt once),
    then ``resamples`` rows drawn with replacement."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n_prompts, size=(resamples, n_prompts))
    return np.vstack([np.arange(n_prompts)[None, :], draws])


def choose(runs: pd.DataFrame, decoder: str, criterion: str, max_ppl_ratio: float | None = None,
           baseline: str = "ar", resamples: int = RESAMPLES, seed: int = 0,
           order: Sequence[str] = (), axes: Sequence[str] = ()) -> dict[str, Any]:
    """``decoder``'s best setting in ``runs`` (validation rows of every setting and the
    baseline) by ``criterion``; ``order`` lists its settings' params_json in grid order (ties);
    ``axes``, the grid's parameters, name each setting (``mtad(beam_width=4, gamma=3, tau=0.5)``;
    without them, the parameters that differ between its settings do).

    Returns a record: decoder, criterion, max_ppl_ratio, params (the chosen setting's parameters),
    params_json, label, value (its criterion mean), perplexity, ppl_ratio, bootstrap_fraction,
    resamples, n_prompts, and settings (each setting's label, value, perplexity, ppl_ratio,
    meets_budget, wins: the fraction of resamples it wins).

    Raises:
        NoSettingError: no setting meets the budget on the validation prompts, or no row has the
            criterion's column (joules).
        IncompleteError: fewer than two prompts are common to the settings and the baseline.
    """
    column, higher = CRITERIA[criterion]
    budget = max_ppl_ratio if criterion != "ppl" else None
    mine = runs[runs["decoder"].isin([decoder, baseline])].copy()
    mine["label"] = config_labels(mine)
    own = mine[mine["decoder"] == decoder]
    labels = dict(zip(own["params_json"], own["label"], strict=True))
    if axes:
        labels = {p: setting_label(decoder, parse_params(p), axes) for p in labels}
    ppl = prompt_matrix(mine, "perplexity")
    vals = prompt_matrix(mine, column)
    base_cols = [c for c in ppl.columns if c[0] == baseline]
    mine_cols = sorted((c for c in ppl.columns if c[0] == decoder),
                       key=lambda c: list(order).index(c[1]) if c[1] in order else len(order))
    if not base_cols or not mine_cols:
        raise IncompleteError(f"{decoder}: no validation rows of {'it' if base_cols else baseline} "
                             "to compare; re-run the same command to measure them")
    keep = ppl[[base_cols[0], *mine_cols]].notna().all(axis=1)
    if column != "perplexity":
        if vals[mine_cols].isna().all().all():
            raise NoSettingError(f"{decoder}: no validation row has {column}; the {criterion} "
                                 "criterion needs it (energy: a meter that measures joules, e.g. "
                                 "--meter simulated)")
        keep &= vals[mine_cols].notna().all(axis=1)
    n = int(keep.sum())
    if n < 2:
        raise IncompleteError(f"{decoder}: {n} validation prompt(s) have rows of every setting and "
                             f"of {baseline}; a choice needs two: re-run the same command (without "
                             "--budget-s, or a larger one) to measure the rest")
    idx = bootstrap_indices(n, resamples, seed)  # (R + 1, n)
    P = ppl.loc[keep, mine_cols].to_numpy(float)  # (n, S)
    V = vals.loc[keep, mine_cols].to_numpy(float)
    B = ppl.loc[keep, base_cols[0]].to_numpy(float)  # (n,)
    ppl_means, val_means, base_means = P[idx].mean(axis=1), V[idx].mean(axis=1), B[idx].mean(axis=1)
    won = winners(val_means, ppl_means, base_means, higher, budget)  # (R + 1,)
    ratios = ppl_means[0] / base_means[0]
    settings = [{"params_json": c[1], "label": labels.get(c[1], decoder),
                 "value": _num(val_means[0, s]), "perplexity": _num(ppl_means[0, s]),
                 "ppl_ratio": _num(ratios[s]),
                 "meets_budget": bool(budget is None or ratios[s] <= budget),
                 "wins": float(np.mean(won[1:] == s))} for s, c in enumerate(mine_cols)]
    if won[0] < 0:
        best = min(settings, key=lambda s: s["ppl_ratio"])
        raise NoSettingError(f"no {decoder} setting keeps perplexity within --max-ppl-ratio {budget:g} "
                             f"of {baseline}'s on the {n} validation prompts (the closest: "
                             f"{best['label']} at {best['ppl_ratio']:.3f}x); raise --max-ppl-ratio "
                             f"or tune by --criterion ppl")
    chosen = settings[int(won[0])]
    prompts = set(keep[keep].index)  # (dataset, prompt_id) the choice was made on
    used = mine[[p in prompts for p in zip(mine["dataset"], mine["prompt_id"], strict=True)]]
    return {**row_flags(used), "decoder": decoder, "criterion": criterion, "max_ppl_ratio": budget,
            "params": parse_params(chosen["params_json"]), "params_json": chosen["params_json"],
            "label": chosen["label"], "value": chosen["value"], "perplexity": chosen["perplexity"],
            "ppl_ratio": chosen["ppl_ratio"], "bootstrap_fraction": chosen["wins"],
            "resamples": resamples, "n_prompts": n, "settings": settings}


def row_flags(rows: pd.DataFrame) -> dict[str, int]:
    """What the rows a choice was made on carry, counted (they reach the record as they reach
    every table): ``rows``, ``contended_rows`` (measured on a busy machine: its speed and joules
    are not the decoder's alone) and ``random_weight_rows`` (acceptance and quality meaningless)."""
    return {"rows": len(rows), "contended_rows": int(contended_mask(rows).sum()),
            "random_weight_rows": int(random_rows(rows).sum())}


def setting_label(decoder: str, params: dict[str, Any], axes: Sequence[str]) -> str:
    """``decoder(axis=value, ...)``: a setting named by its grid's parameters."""
    return f"{decoder}(" + ", ".join(f"{k}={format_param(params.get(k))}" for k in axes) + ")"


def _num(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def default_params(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """``name``'s default setting in a tune record's terms: the parameters every setting of its
    grid shared (the tune's ``--set`` values), the grid's axes dropped so that the decoder's own
    defaults fill them."""
    grid = [dict(d["params"]) for d in doc["config"]["decoders"] if d["name"] == name]
    shared = grid[0] if grid else {}
    return {k: v for k, v in shared.items() if all(k in g and g[k] == v for g in grid)}


# -- tuned beside default, on the same held-out prompts ---------------------------------------------
SIDE_COLUMNS = ("block_efficiency", "acceptance_rate", "perplexity")


def _grid_params(decoder: str, params_json: Any) -> str:
    """The setting as its grid names it: only the grid's axes (``gamma=3``), "" for ``ar``."""
    from mtad_energy.decoding.grids import TUNING_GRIDS

    params = parse_params(params_json)
    axes = TUNING_GRIDS.get(decoder, {}) or {}
    return ", ".join(f"{k}={format_param(params[k])}" for k in axes if k in params)


def tuned_vs_default(tuned: pd.DataFrame, default: pd.DataFrame) -> pd.DataFrame:
    """One row per (dataset, decoder, side): ``side`` "default" or "tuned", ``params`` the
    setting (its grid's axes), the runs' means of `SIDE_COLUMNS` (per-run values, as
    `analysis.decoder_summary`), ``n_prompts`` and ``contended_rows``. ``tuned`` and ``default``
    are the runs of the two held-out stores (`compare --tuned` and the defaults on the same
    prompts); each decoder must have one setting per store. Sorted in the paper's decoder order,
    default before tuned. Speeds are left out: they depend on the machine's load."""
    from mtad_energy.results.analysis import decoder_rank

    rows = []
    for side, runs in (("default", default), ("tuned", tuned)):
        flagged = runs.assign(_contended=contended_mask(runs))
        for (dataset, decoder), g in flagged.groupby(["dataset", "decoder"], sort=False):
            if g["params_json"].nunique() != 1:
                raise ValueError(f"{side}: {decoder} has {g['params_json'].nunique()} settings on "
                                 f"{dataset}; one per store is compared")
            row = {"dataset": dataset, "decoder": decoder, "side": side,
                   "params": _grid_params(decoder, g["params_json"].iloc[0]),
                   "n_prompts": int(g["prompt_id"].nunique()),
                   "contended_rows": int(g["_contended"].sum())}
            for c in SIDE_COLUMNS:
                v = pd.to_numeric(g[c], errors="coerce") if c in g else pd.Series(dtype=float)
                row[c] = float(v.mean()) if v.notna().any() else math.nan
            rows.append(row)
    table = pd.DataFrame(rows)
    table["_rank"] = table["decoder"].map(decoder_rank)
    return table.sort_values(["dataset", "_rank", "decoder", "side"], kind="stable").drop(
        columns="_rank").reset_index(drop=True)


def tuned_vs_default_markdown(table: pd.DataFrame) -> str:
    """`tuned_vs_default`'s rows side by side, one line per (dataset, decoder): the default and
    tuned settings, then block efficiency, acceptance and PPL default | tuned."""
    from mtad_energy.results.analysis import format_value

    names = {"block_efficiency": "block eff.", "acceptance_rate": "acceptance", "perplexity": "PPL"}
    head = ["dataset", "decoder", "default setting", "tuned setting",
            *(f"{names[c]} {s}" for c in SIDE_COLUMNS for s in ("default", "tuned"))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":---"] * 4 + ["---:"] * 6) + "|"]
    for (dataset, decoder), g in table.groupby(["dataset", "decoder"], sort=False):
        side = {s: r for s, r in zip(g["side"], g.to_dict("records"), strict=True)}
        d, t = side.get("default", {}), side.get("tuned", {})
        cells = [dataset, decoder, f"`{d.get('params') or '-'}`", f"`{t.get('params') or '-'}`"]
        cells += [format_value(r.get(c, math.nan), 2) for c in SIDE_COLUMNS for r in (d, t)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
