"""The speculation schedule, measured in vLLM (issue 26 item 4; `mtad-energy schedule --validate`).

`results.schedule` turns a vLLM decoding batch-size sweep (`sweep batch-size --engine vllm
--decoder ar,spd --set gamma=1,2,3`) into vLLM's ``num_speculative_tokens_per_batch_size``. That
schedule is a claim about vLLM; this module measures it. The validation is one more run of the
same sweep, through the same seam and into the same store (`bench.decode_batch
.decode_batch_sweep` with the vLLM engine): the sweep's setting (model, prompts, tokens, warp,
meter, batch sizes) read back from its rows, and per batch size, interleaved within the run:

- the **schedule**: the chain decoder with ``gamma`` = the schedule's largest k and
  ``per_batch_size`` = its triples (vLLM's dynamic speculative decoding: its scheduler looks k
  up from the number of requests in each step, so rows finishing early move k within a run);
- ``ar`` and the chain decoder at **every fixed gamma** the sweep measured, as new repeats of
  those configurations (numbered after the store's last), so the comparison is between rows
  measured beside each other, under the same load.

`validation_table` compares, per batch size B, the schedule's tokens/s with the best fixed
configuration (``ar`` counts as k = 0) and with the fixed k the schedule picks at B, from the
validation's rows only (medians over its repeats); J/token where a meter measured, else n/a
with the recorded reason. A vLLM that refuses or dies on the schedule is an `EngineError`
naming vLLM's version, the schedule and vLLM's error; rows measured before it stay stored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from mtad_energy.config import DecoderSpec
from mtad_energy.engines.registry import EngineError
from mtad_energy.engines.vllm import per_batch_size_text
from mtad_energy.results.schedule import BASELINE, Schedule, one_setting, runs_a_schedule

ENGINE = "vllm"


@dataclass(frozen=True)
class SweepSetting:
    """What the validation repeats of a sweep, read from its rows."""

    model: str  # the rows' model label (``smollm2+vllm``)
    pair_name: str  # the HF pair's name (``smollm2``, ``custom``)
    target_id: str
    dataset: str
    max_new_tokens: int
    sizes: tuple[int, ...]
    prompt_keys: Mapping[int, str]  # batch size -> the rows' prompt key (`stable_key` of the ids)
    baseline: DecoderSpec  # ar as the sweep ran it (its warp)
    fixed: tuple[DecoderSpec, ...]  # the chain decoder at each gamma the sweep ran
    meter: str
    seed: int  # the sweep's base seed (a row's seed is seed + repeat)
    next_repeat: int  # the first repeat number the store does not hold
    # vLLM's own settings the sweep ran under (`--engine-option`), from its rows' engine_config
    engine_options: Mapping[str, Any] = field(default_factory=dict)


def spec_of_label(label: str) -> DecoderSpec:
    """The `DecoderSpec` whose ``label`` is ``label`` (``spd(gamma=2,temperature=0)``): the sweep's
    own specs, so the validation's rows of a fixed gamma carry the sweep's labels."""
    name, _, rest = label.partition("(")
    params = dict(p.split("=", 1) for p in rest.rstrip(")").split(",") if p) if rest else {}
    return DecoderSpec.of(name, **params)


def _k_of(spec: DecoderSpec) -> int:
    return int(spec.param_dict.get("gamma", 0))


def sweep_setting(rows: pd.DataFrame, plan: Schedule, model: str | None = None) -> SweepSetting:
    """The setting of the sweep ``plan`` was built from (`one_setting`; ``model`` picks the label).

    Raises:
        ValueError: the rows are not vLLM's (the schedule is measured in the engine it is for),
            hold several variants of ``ar`` or of the chain decoder besides gamma, or no batch
            size has both.
    """
    _, df = one_setting(pd.DataFrame(rows), model)
    engines = sorted(set(df["engine"].dropna().astype(str))) if "engine" in df else []
    if engines != [ENGINE]:
        raise ValueError(f"--validate runs the schedule in vLLM beside the fixed draft lengths it "
                         f"came from, so it needs a vLLM sweep (rows of engine {ENGINE!r}; these are "
                         f"{', '.join(engines) or 'hf'}'s): sweep batch-size --engine vllm --decoder "
                         f"ar,{plan.decoder} --set gamma=1,2,3, then schedule that store")
    next_repeat = int(df["repeat"].max()) + 1  # after every stored repeat, a schedule's too
    settings = {json.dumps(sweep_engine_options(c), sort_keys=True)
                for c in df["engine_config"].dropna()} if "engine_config" in df else set()
    if len(settings) > 1:
        raise ValueError("the sweep's rows ran under several vLLM settings (--engine-option): "
                         + " vs ".join(sorted(settings)) + "; validate a store of one setting")
    df = df[~df["params_json"].map(runs_a_schedule)]
    base = sorted(set(df.loc[df["decoder"] == BASELINE, "label"]))
    chain = df[df["decoder"] == plan.decoder]
    variants = {spec_of_label(lb) for lb in set(chain["label"])}
    others = {DecoderSpec.of(s.name, **{k: v for k, v in s.params if k != "gamma"}) for s in variants}
    if len(base) != 1 or len(others) != 1:
        raise ValueError(f"the sweep holds several variants of {BASELINE} ({', '.join(base)}) or of "
                         f"{plan.decoder} besides gamma: validate a store of one warp")
    sizes = tuple(r.measured_batch_size for r in plan.ranges)
    keys = {int(b): str(g["prompts"].iloc[0]) for b, g in df.groupby("batch_size")}
    one = df.iloc[0]
    return SweepSetting(
        model=str(one["model"]), pair_name=str(one["model"]).split("+")[0],
        target_id=str(one["target_id"]), dataset=str(one["dataset"]),
        max_new_tokens=int(one["max_new_tokens"]), sizes=sizes,
        prompt_keys={b: keys[b] for b in sizes}, baseline=spec_of_label(base[0]),
        fixed=tuple(sorted(variants, key=_k_of)), meter=str(one["meter"]),
        seed=int(one["seed"]) - int(one["repeat"]), next_repeat=next_repeat,
        engine_options=json.loads(settings.pop()) if settings else {})


def sweep_engine_options(engine_config: str) -> dict[str, Any]:
    """The vLLM settings (`EngineKind.settings`) a row's ``engine_config`` JSON records, so the
    validation starts vLLM as the sweep did (compiled or eager, its memory share, ...); the CPU's
    KV cache space is read from the environment it recorded."""
    from mtad_energy.engines.registry import engine_kind

    config = json.loads(engine_config)
    out = {k: v for k, v in config.items() if k in engine_kind(ENGINE).settings}
    space = (config.get("env") or {}).get("VLLM_CPU_KVCACHE_SPACE")
    if space is not None:
        out["kv_cache_space_gib"] = int(space)
    return out


def schedule_spec(setting: SweepSetting, plan: Schedule) -> DecoderSpec:
    """The chain decoder running ``plan`` in vLLM: gamma = its largest k, per_batch_size = its
    triples (refused where speculation never pays: there is no schedule to run)."""
    config = plan.vllm_config()
    if config is None:
        raise ValueError(f"the schedule says to leave speculation off ({plan.decoder} never beats "
                         f"{BASELINE}): there is no schedule to run in vLLM")
    params = {k: v for k, v in setting.fixed[0].params if k != "gamma"}
    return DecoderSpec.of(plan.decoder, **params, gamma=str(config["num_speculative_tokens"]),
                          per_batch_size=per_batch_size_text(plan.triples))


def validation_specs(setting: SweepSetting, plan: Schedule) -> list[DecoderSpec]:
    """The schedule first (a vLLM that refuses it fails before minutes of fixed-k rows), then
    ``ar`` and each fixed gamma."""
    return [schedule_spec(setting, plan), setting.baseline, *setting.fixed]


def the_prompts(pair, setting: SweepSetting) -> list[list[int]]:
    """The sweep's prompt ids: its dataset's first n prompts, n found by matching the rows'
    prompt keys (a batch cycles n prompts to fill B, so n above the largest B changes nothing)."""
    from mtad_energy.bench.prompts import load_prompts
    from mtad_energy.decoding.runtime.generate import encode_prompt
    from mtad_energy.results.schema import stable_key

    top = max(setting.sizes)
    texts = [p.text for p in load_prompts(setting.dataset, top)]
    ids = [encode_prompt(pair, t) for t in texts]
    for n in range(1, len(ids) + 1):
        if all(stable_key({"ids": [ids[i % n] for i in range(b)]}) == key
               for b, key in setting.prompt_keys.items()):
            return ids[:n]
    raise ValueError(f"the sweep's prompts are not the first prompts of {setting.dataset!r} as this "
                     "tokenizer encodes them: re-run the sweep, then validate")


def run_validation(results: Path, rows: pd.DataFrame, plan: Schedule, model: str | None = None,
                   repeats: int = 1, progress: Callable[[dict, bool], object] | None = None
                   ) -> list[dict[str, Any]]:
    """Measure ``plan`` in vLLM beside every fixed gamma and ``ar`` (module docstring) into the
    store at ``results``; returns the validation's rows (new repeats only).

    Raises:
        ValueError: not a vLLM sweep, several warps, speculation off, prompts not found.
        EngineError: vLLM refused or died (its version, the schedule and its error).
    """
    from mtad_energy.bench.decode_batch import decode_batch_sweep
    from mtad_energy.config import ModelSpec
    from mtad_energy.engines import load_engine
    from mtad_energy.measure import get_meter, snapshot
    from mtad_energy.models import load_pair
    from mtad_energy.results import ResultStore

    setting = sweep_setting(rows, plan, model)
    specs = validation_specs(setting, plan)
    alias = None if setting.pair_name == "custom" else setting.pair_name
    target = setting.target_id if alias is None else None
    pair = load_pair(alias, target=target, with_draft=False)  # the prompts and perplexity only
    if pair.target_id != setting.target_id:
        raise ValueError(f"the sweep's target is {setting.target_id}, {pair.name} loads "
                         f"{pair.target_id}: validate where the sweep ran")
    prompts = the_prompts(pair, setting)
    store = ResultStore(results)
    snap = snapshot()
    store.write_env(snap.snapshot_id, snap.to_dict())
    meter = get_meter(setting.meter)
    engine = load_engine(ENGINE, ModelSpec(alias, target), setting.engine_options)
    try:
        report = decode_batch_sweep(
            pair, specs, list(setting.sizes), prompts, store, meter, model=pair.name,
            dataset=setting.dataset, max_new_tokens=setting.max_new_tokens, repeats=repeats,
            seed=setting.seed, env_id=snap.snapshot_id, progress=progress, engine=engine,
            first_repeat=setting.next_repeat)
    except EngineError as error:
        raise EngineError(f"{engine.version} could not run the schedule {specs[0].label} "
                          f"(num_speculative_tokens_per_batch_size={plan.triples}): {error}") from error
    finally:
        engine.close()
        meter.close()
    return report.rows


def k_at(triples: Sequence[Sequence[int]], batch_size: int) -> int:
    """The schedule's k at ``batch_size``, as vLLM's lookup gives it (the last range's k past
    its end; ranges are contiguous from 1)."""
    k = 0
    for low, _high, value in triples:
        if low <= batch_size:
            k = value
    return int(k)


def _median(frame: pd.DataFrame, column: str) -> float:
    values = pd.to_numeric(frame[column], errors="coerce") if column in frame else pd.Series([])
    return float(values.median()) if values.notna().any() else math.nan


def validation_table(rows: pd.DataFrame | Sequence[Mapping[str, Any]], plan: Schedule) -> pd.DataFrame:
    """Per batch size of the validation's rows: the schedule's k, tokens/s, block efficiency and
    acceptance; the best fixed configuration there (``ar`` as k = 0) and its tokens/s; the fixed
    k the schedule picks and its tokens/s; the ratios; J/token of the schedule and of the best
    fixed (NaN where no meter measured: ``energy_reason``); whether any row there was contended.
    Medians over repeats; rows of other decoders are ignored.

    Raises:
        ValueError: no schedule rows, or a batch size without fixed rows to compare with.
    """
    df = pd.DataFrame(rows)
    if df.empty or not df["params_json"].map(runs_a_schedule).any():
        raise ValueError("no rows of the schedule (per_batch_size) to compare: run schedule --validate")
    df = df.assign(scheduled=df["params_json"].map(runs_a_schedule))
    df = df[df["scheduled"] | df["decoder"].isin([BASELINE, plan.decoder])]
    # a fixed configuration: ar, or the chain decoder at one k (k = 0 where the sweep measured
    # the speculating engine at k = 0, which is not ar)
    df = df.assign(fixed=[BASELINE if d == BASELINE else f"k={int(json.loads(p).get('gamma', 0))}"
                          for d, p in zip(df["decoder"], df["params_json"], strict=True)])
    out = []
    for b, at in df.groupby("batch_size", sort=True):
        mine, fixed = at[at["scheduled"]], at[~at["scheduled"]]
        if mine.empty:
            continue
        if fixed.empty:
            raise ValueError(f"no fixed-gamma or {BASELINE} rows at batch size {b} beside the schedule")
        per = {name: _median(g, "tokens_per_s") for name, g in fixed.groupby("fixed")}
        best = max(per, key=lambda name: per[name])
        k = k_at(plan.triples, int(b))
        # the schedule's k measured alone; an unmeasured k = 0 is compared with ar
        same = BASELINE if k == 0 and "k=0" not in per else f"k={k}"
        tps = _median(mine, "tokens_per_s")
        out.append({
            "batch_size": int(b), "schedule_k": k, "schedule_tokens_per_s": tps,
            "schedule_block_efficiency": _median(mine, "block_efficiency"),
            "schedule_acceptance": _median(mine, "acceptance_rate"),
            "best_fixed": best, "best_fixed_k": 0 if best == BASELINE else int(best[2:]),
            "best_fixed_tokens_per_s": per[best], "vs_best_fixed": tps / per[best],
            "same_k_tokens_per_s": per.get(same, math.nan),
            "vs_same_k": tps / per[same] if same in per else math.nan,
            "ar_tokens_per_s": per.get(BASELINE, math.nan),
            "schedule_j_per_token": _median(mine, "energy_per_token_j"),
            "best_fixed_j_per_token": _median(fixed[fixed["fixed"] == best], "energy_per_token_j"),
            "energy_reason": next(iter(at["energy_reason"].dropna()), None)
            if "energy_reason" in at else None,
            "contended": bool(at["contended"].fillna(False).astype(bool).any())
            if "contended" in at else None,
            "repeats": int(mine["repeat"].nunique()) if "repeat" in mine else len(mine),
        })
    if not out:
        raise ValueError("no batch size has schedule rows")
    return pd.DataFrame(out)


DISPLAY = (("batch_size", "B"), ("schedule_k", "schedule k"),
           ("schedule_tokens_per_s", "schedule tok/s"), ("best_fixed_k", "best fixed k"),
           ("best_fixed_tokens_per_s", "best fixed tok/s"), ("vs_best_fixed", "vs best fixed"),
           ("vs_same_k", "vs fixed at its k"), ("ar_tokens_per_s", "ar tok/s"),
           ("schedule_block_efficiency", "block eff."), ("schedule_acceptance", "acceptance"),
           ("schedule_j_per_token", "J/token"))


def validation_display(table: pd.DataFrame) -> tuple[list[str], list[list[str]], str]:
    """The validation table as text for the console: columns, cells (``*`` on a contended batch
    size, a fixed k 0 shown as ar, J/token n/a) and a caption saying what was compared and why J/token
    is n/a."""
    cells = []
    for _, r in table.iterrows():
        row = []
        for col, _name in DISPLAY:
            v = r[col]
            if col == "batch_size":
                row.append(f"{int(v)}{'*' if r['contended'] else ''}")
            elif col == "schedule_k":  # the schedule's k 0 is not ar: a draft model still
                row.append(str(int(v)))  # runs at k 0 (DRAFT_AT_ZERO_NOTE)
            elif col == "best_fixed_k":  # ar, or the chain decoder at one k (k 0 measured)
                row.append(BASELINE if r["best_fixed"] == BASELINE else str(int(v)))
            elif v is None or v != v:
                row.append("n/a" if col == "schedule_j_per_token" else "-")
            else:
                row.append(f"{v:.2f}x" if col.startswith("vs_") else f"{v:.3g}")
        cells.append(row)
    reasons = sorted({str(x) for x in table["energy_reason"].dropna()})
    caption = ("the schedule's tokens/s over the best fixed configuration (ar = k 0) and over the "
               "fixed k it picks, measured beside it in this run (median of "
               f"{int(table['repeats'].min())} repeat(s)); vLLM looks k up per engine step from "
               "the requests still running"
               + ("\n* other processes used the cores during a window there" if
                  table["contended"].any() else "")
               + (f"\nJ/token n/a: {'; '.join(reasons)}" if reasons else ""))
    return [name for _col, name in DISPLAY], cells, caption
