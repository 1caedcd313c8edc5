"""The paper's main table (`main_table`: decoders as rows, a group of metric columns per dataset)
and its Markdown (`to_markdown`: best value per column in bold, second underlined), with the
number formatting every table shares (`column_decimals`, `format_value`). Pure pandas, no
`tabulate`; re-exported by `analysis`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from mtad_energy.results.labels import HIGHER_IS_BETTER, METRIC_NAMES, decoder_rank


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

