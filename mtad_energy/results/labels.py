"""How rows are named and ordered in every table: the paper's decoder order, the metrics'
display names and which way is better, a readable label per configuration (`config_labels`) and
the numeric clean-up of stored columns. Pure pandas; `analysis`, `markdown` and `accepted` build
on it (and `analysis` re-exports it, so ``analysis.<name>`` keeps working)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from mtad_energy.results.settings import SETTING_COLUMNS, setting_labels, with_setting

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

