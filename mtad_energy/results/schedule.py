"""The speculation schedule a serving engine can use: from a decoding batch-size sweep, the best
decoder and draft length per batch-size range, and vLLM's ``num_speculative_tokens_per_batch_size``.

Input: ``decode_batch`` rows (`mtad-energy sweep batch-size --decoder ar,spd --set
gamma=1,2,3,5`): per (decoder configuration, batch size), the median over repeats of the decode
tokens/s and of the decode J/token. Per measured batch size B:

* **objective** ``speed``: the configuration with the most tokens/s wins; its gain is the
  speed-up over ``ar`` at B. ``energy``: the fewest J/token wins; its gain is the energy saving
  1 - J/token / ``ar``'s at B.
* the **chain decoder** (``spd`` by default, the draft-model speculation vLLM runs): its best gamma
  at B under the objective, or 0 where it does not beat ``ar`` (speed-up <= 1, or saving <= 0).

Batch-size ranges are inclusive, one per measured size: [1 or the first size, the next size - 1],
..., [the largest size, ``max_batch_size``]; the vLLM mapping merges neighbouring ranges that share
a gamma. vLLM (PR 32374) reads ``num_speculative_tokens_per_batch_size`` as inclusive
``"low-high": k`` ranges, 0 = no speculation, gaps inheriting the previous range's k, and clamps k
to ``num_speculative_tokens`` (the startup maximum): the document written here carries both.
Pure pandas: no torch, no decoders.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

OBJECTIVES = ("speed", "energy")
BASELINE = "ar"


@dataclass(frozen=True)
class ScheduleRange:
    """One batch-size range (inclusive) and what the measurement at ``measured_batch_size`` says.

    Attributes:
        best_label / best_decoder / best_gamma: the winning configuration under the objective
            (``ar`` included; gamma None where it has none).
        best_gain: its speed-up (speed) or energy saving (energy) over ``ar`` at that size.
        chain_gamma / chain_gain: the chain decoder's best gamma there and its gain, also where
            it loses to ``ar`` (None where it was not measured at that size).
        gamma: the schedule's draft length for this range (``chain_gamma``, or 0 where ``ar``
            wins).
    """

    low: int
    high: int
    measured_batch_size: int
    best_label: str
    best_decoder: str
    best_gamma: int | None
    best_gain: float
    chain_gamma: int | None
    chain_gain: float | None
    gamma: int


@dataclass(frozen=True)
class Schedule:
    objective: str
    decoder: str
    ranges: tuple[ScheduleRange, ...]
    setting: str = ""  # the sweep's setting (model · dataset · tokens · device), one per schedule

    @property
    def mapping(self) -> dict[str, int]:
        """vLLM's ``num_speculative_tokens_per_batch_size``: neighbouring ranges with one gamma
        merged, keys ``"low-high"`` (inclusive)."""
        merged: list[list[int]] = []
        for r in self.ranges:
            if merged and merged[-1][2] == r.gamma and merged[-1][1] + 1 == r.low:
                merged[-1][1] = r.high
            else:
                merged.append([r.low, r.high, r.gamma])
        return {f"{lo}-{hi}": k for lo, hi, k in merged}

    @property
    def never_pays(self) -> bool:
        """The chain decoder loses to ``ar`` at every measured size: leave speculation off."""
        return all(r.gamma == 0 for r in self.ranges)

    def vllm_config(self) -> dict[str, Any]:
        """The part of vLLM's ``speculative_config`` this schedule sets."""
        return {"num_speculative_tokens": max((r.gamma for r in self.ranges), default=0),
                "num_speculative_tokens_per_batch_size": self.mapping}

    def to_dict(self) -> dict[str, Any]:
        return {"objective": self.objective, "decoder": self.decoder, "setting": self.setting,
                "ranges": [asdict(r) for r in self.ranges], "speculative_config": self.vllm_config()}


def _gamma(params: Any) -> int | None:
    try:
        value = json.loads(params).get("gamma") if isinstance(params, str) and params else None
    except (ValueError, AttributeError):
        return None
    return int(value) if value is not None else None


def _medians(rows: pd.DataFrame) -> pd.DataFrame:
    df = rows.copy()
    if "params_json" not in df:
        df["params_json"] = "{}"
    df["params_json"] = df["params_json"].fillna("{}")
    for c in ("tokens_per_s", "energy_per_token_j"):
        df[c] = pd.to_numeric(df[c], errors="coerce") if c in df else math.nan
    med = (df.groupby(["label", "decoder", "params_json", "batch_size"], sort=False)
           [["tokens_per_s", "energy_per_token_j"]].median().reset_index())
    med["gamma"] = med["params_json"].map(_gamma)
    med["batch_size"] = med["batch_size"].astype(int)
    return med


def one_setting(rows: pd.DataFrame, model: str | None = None) -> tuple[str, pd.DataFrame]:
    """The rows of one sweep setting (`analysis.CROSSOVER_SETTING`: model label, target, dataset,
    tokens, device, dtype) and its title: rows of other settings (eager and ``+compile`` runs,
    other datasets or lengths) are other experiments, never pooled into one schedule. ``model``
    picks the model label.

    Raises:
        ValueError: ``model`` matches no row, or the rows hold several settings (naming them).
    """
    from mtad_energy.results.analysis import crossover_settings

    if model is not None:
        have = sorted(set(rows["model"].astype(str))) if "model" in rows else []
        if model not in have:
            raise ValueError(f"no rows of model {model!r} in the sweep (models: {', '.join(have)})")
        rows = rows[rows["model"] == model]
    parts = crossover_settings(rows)
    if len(parts) > 1:
        raise ValueError(f"the sweep holds {len(parts)} settings, which one schedule must not pool: "
                         + "; ".join(title for title, _ in parts) + ". Pick one model label with "
                         "--model, or sweep each setting into its own --output")
    return parts[0] if parts else ("", rows)


def build_schedule(rows: pd.DataFrame | Sequence[Mapping[str, Any]], objective: str = "speed",
                   decoder: str = "spd", max_batch_size: int | None = None,
                   model: str | None = None) -> Schedule:
    """The schedule of a decoding batch-size sweep (module docstring), of one setting
    (`one_setting`; ``model`` picks the model label).

    Raises:
        ValueError: unknown objective, several settings, no ``ar`` rows, no rows of ``decoder``
            (or none with a gamma), no energy for the energy objective (with the recorded
            reasons), or a ``max_batch_size`` below the largest measured size.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be {' or '.join(OBJECTIVES)}, got {objective!r}")
    df = pd.DataFrame(rows)
    if df.empty:
        raise ValueError("no decoding batch-size rows: run `mtad-energy sweep batch-size --decoder "
                         "ar,spd --set gamma=1,2,3,5 --output DIR` and pass that DIR")
    setting, df = one_setting(df, model)
    med = _medians(df)
    base = med[med["decoder"] == BASELINE].groupby("batch_size").first()
    if base.empty:
        raise ValueError(f"no `{BASELINE}` rows to compare with: the sweep adds them; re-run it")
    chain = med[(med["decoder"] == decoder) & med["gamma"].notna()]
    if chain.empty:
        have = ", ".join(sorted(set(med["decoder"])))
        raise ValueError(f"no `{decoder}` rows with a gamma in the sweep (decoders: {have}); sweep it "
                         f"with --decoder ar,{decoder} --set gamma=1,2,3,5, or pick --decoder")
    metric = "tokens_per_s" if objective == "speed" else "energy_per_token_j"
    if objective == "energy" and med[metric].isna().all():
        reasons = sorted({str(r) for r in df.get("energy_reason", pd.Series(dtype=object)).dropna()})
        raise ValueError("no decode energy in the sweep's rows (" + ("; ".join(reasons) or
                         "no reason recorded") + "): --objective energy needs a meter that measures "
                         "energy; --objective speed works without one")
    sizes = sorted(set(base.index) & set(med.loc[med["decoder"] != BASELINE, "batch_size"]))
    if not sizes:
        raise ValueError(f"no batch size has both `{BASELINE}` and another decoder")
    top = max_batch_size if max_batch_size is not None else sizes[-1]
    if top < sizes[-1]:
        raise ValueError(f"max_batch_size {top} is below the largest measured batch size {sizes[-1]}")

    def gain(value: float, b: int) -> float:
        ref = base.loc[b, metric]
        return value / ref if objective == "speed" else 1.0 - value / ref

    ranges = []
    for i, b in enumerate(sizes):
        at = med[(med["batch_size"] == b) & med[metric].notna()]
        best = at.loc[at[metric].idxmax() if objective == "speed" else at[metric].idxmin()]
        mine = at[(at["decoder"] == decoder) & at["gamma"].notna()]
        pick = (mine.loc[mine[metric].idxmax() if objective == "speed" else mine[metric].idxmin()]
                if len(mine) else None)
        chain_gain = gain(pick[metric], b) if pick is not None else None
        wins = chain_gain is not None and chain_gain > (1.0 if objective == "speed" else 0.0)
        ranges.append(ScheduleRange(
            low=1 if i == 0 else b, high=sizes[i + 1] - 1 if i + 1 < len(sizes) else top,
            measured_batch_size=b, best_label=str(best["label"]), best_decoder=str(best["decoder"]),
            best_gamma=None if pd.isna(best["gamma"]) else int(best["gamma"]),
            best_gain=gain(best[metric], b),
            chain_gamma=int(pick["gamma"]) if pick is not None else None, chain_gain=chain_gain,
            gamma=int(pick["gamma"]) if wins else 0))
    return Schedule(objective, decoder, tuple(ranges), setting)


def schedule_table(schedule: Schedule) -> pd.DataFrame:
    """One row per range: the range, the best configuration and its gain, the chain decoder's
    best gamma and its gain (also where it loses), and the schedule's gamma; gains are speed-ups
    or energy savings over ``ar`` measured at batch size ``at B``."""
    what = "speed-up" if schedule.objective == "speed" else "saving"
    d = schedule.decoder
    return pd.DataFrame([{
        "batch sizes": f"{r.low}-{r.high}", "at B": r.measured_batch_size, "best": r.best_label,
        what: r.best_gain, f"best {d} gamma": r.chain_gamma, f"{d} {what}": r.chain_gain,
        "vLLM gamma": r.gamma,
    } for r in schedule.ranges])
