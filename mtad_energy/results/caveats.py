"""The caveats a terminal table shows, carried into every artefact made from the same rows: rows
measured on a busy machine (``*``, `analysis.contention_note`), speed-ups that cannot be the
decoder's (``!``, `analysis.implausible`) and rows on random weights (``random:SHAPE`` models,
random heads: `config.random_weights`), whose acceptance and quality mean nothing.

A markdown table (compare's, the report's) marks the cells and rows the terminal marks and says
why under the table; it never ranks (bold / underline) an implausible figure, nor any figure of
a random-weight row (its speed rests on acceptance too). Pure pandas, as `analysis`.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from mtad_energy.results import analysis
from mtad_energy.specs import RANDOM_NOTE

SPEED_METRICS = ("tokens_per_s", "tokens_per_s_pooled", "speedup", "speedup_total",
                 "tokens_per_s_total")  # what an implausible speed-up makes doubtful
RANDOM_MARK = "†"
RANDOM_ROWS_NOTE = (f"{RANDOM_MARK}: {RANDOM_NOTE}; rows on random weights are not ranked "
                    "(their speed rests on their acceptance too)")


def random_note(*frames: pd.DataFrame) -> list[str]:
    """`config.RANDOM_NOTE` where any row of ``frames`` (stored rows, or summaries with
    ``random_weights``) has random weights."""
    for frame in frames:
        flags = frame["random_weights"] if "random_weights" in frame else analysis.random_rows(frame)
        if len(frame) and flags.fillna(False).astype(bool).any():
            return [RANDOM_NOTE]
    return []


def marked_main_table(summary: pd.DataFrame, metrics: Sequence[str] | None = None,
                      baseline: str = "ar") -> str:
    """`analysis.main_table` of ``summary`` (a `analysis.decoder_summary`) in markdown with the
    terminal's caveats: ``*`` after every figure of a (decoder, dataset) with contended runs,
    `` !`` after an implausible row's speed figures (never ranked), ``†`` after the label of a
    random-weight row (never ranked), and under the table the line saying what each mark means."""
    table = analysis.main_table(summary, list(metrics or ("tokens_per_s", "energy_per_token_j",
                                                          "perplexity")))
    marks = pd.DataFrame("", index=table.index, columns=table.columns)
    unranked = pd.DataFrame(False, index=table.index, columns=table.columns)
    keys = list(table.index.names)
    implausible = summary["implausible"].fillna(False).astype(bool) if "implausible" in summary \
        else pd.Series(False, index=summary.index)
    rand = summary["random_weights"].fillna(False).astype(bool) if "random_weights" in summary \
        else pd.Series(False, index=summary.index)
    randoms = set()
    for i, r in summary.iterrows():
        key = tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]
        for c in (c for c in table.columns if c[0] == r["dataset"]):
            if r.get("n_contended"):
                marks.loc[key, c] += "\\*"
            if implausible[i] and c[1] in SPEED_METRICS:
                marks.loc[key, c] += " !"
                unranked.loc[key, c] = True
        if rand[i]:
            unranked.loc[key, :] = True
            randoms.add(key)

    def label(k):
        if k not in randoms:
            return k
        return (*k[:-1], f"{k[-1]}{RANDOM_MARK}") if isinstance(k, tuple) else f"{k}{RANDOM_MARK}"

    labels = [label(k) for k in table.index]
    shown = table.set_axis(pd.MultiIndex.from_tuples(labels, names=keys) if len(keys) > 1
                           else pd.Index(labels, name=keys[0]), axis=0)
    marks.index = unranked.index = shown.index
    md = analysis.to_markdown(shown, marks=marks, unranked=unranked)
    notes = [(analysis.contention_note(summary) or "").replace("*:", "\\*:", 1),
             analysis.IMPLAUSIBLE_NOTE.format(baseline=baseline) + "; not ranked"
             if implausible.any() else "", RANDOM_ROWS_NOTE if randoms else ""]
    return md + "".join(f"\n{n}.\n" for n in notes if n)
