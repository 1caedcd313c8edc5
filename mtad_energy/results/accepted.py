"""Accepted lengths: how many draft tokens each drafting iteration accepted, per decoder
configuration (`accepted_length_histogram`), and their statistics (`accepted_length_stats`: mean,
median, share accepting nothing, longest). Pure pandas over the store's `steps` and `runs`
tables; re-exported by `analysis`."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mtad_energy.results.labels import _sort_by_decoder, config_labels, numeric_columns
from mtad_energy.results.settings import SETTING_COLUMNS


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
