"""The speculation schedule (`mtad-energy schedule`) on synthetic sweep rows with a known answer,
and the gamma variants the decoding sweep expands (`--set gamma=1,2,3,5`)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from mtad_energy.bench.decode_batch import expand_variants
from mtad_energy.cli import app
from mtad_energy.config import DecoderSpec
from mtad_energy.results import ResultStore, stable_key
from mtad_energy.results.schedule import build_schedule, schedule_table
from mtad_energy.results.schema import DECODE_BATCH

SIZES = (1, 2, 4, 8, 16, 32)
AR_TPS = {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0, 16: 160.0, 32: 320.0}
AR_JPT = {b: 1.0 / b for b in SIZES}
# speed-up and energy saving over ar per (gamma, batch size): the best gamma falls with the batch
SPEEDUP = {1: {1: 1.3, 2: 1.1, 4: 1.05, 8: 1.2, 16: 0.9, 32: 0.8},
           2: {1: 1.6, 2: 1.3, 4: 1.1, 8: 1.1, 16: 0.8, 32: 0.7},
           3: {1: 1.8, 2: 1.5, 4: 1.25, 8: 1.0, 16: 0.7, 32: 0.6},
           5: {1: 2.0, 2: 1.4, 4: 1.2, 8: 0.9, 16: 0.6, 32: 0.5}}
SAVING = {1: {1: 0.2, 2: 0.15, 4: 0.1, 8: 0.05, 16: -0.1, 32: -0.2},
          2: {1: 0.3, 2: 0.25, 4: 0.12, 8: 0.02, 16: -0.2, 32: -0.3},
          3: {1: 0.25, 2: 0.2, 4: 0.05, 8: -0.1, 16: -0.3, 32: -0.4},
          5: {1: 0.1, 2: 0.0, 4: -0.1, 8: -0.2, 16: -0.4, 32: -0.5}}


def _row(decoder: str, params: dict, b: int, tps: float, jpt: float | None, repeat: int = 0) -> dict:
    label = decoder + (f"(gamma={params['gamma']})" if "gamma" in params else "")
    return {"decoder": decoder, "label": label, "params_json": json.dumps(params), "batch_size": b,
            "repeat": repeat, "tokens_per_s": tps, "energy_per_token_j": jpt, "meter": "nvml",
            "energy_reason": None if jpt is not None else "meter 'none' measures no energy"}


def sweep_rows(energy: bool = True) -> list[dict]:
    rows = [_row("ar", {}, b, AR_TPS[b], AR_JPT[b] if energy else None) for b in SIZES]
    for g in SPEEDUP:
        for b in SIZES:
            rows.append(_row("spd", {"gamma": g}, b, AR_TPS[b] * SPEEDUP[g][b],
                             AR_JPT[b] * (1 - SAVING[g][b]) if energy else None))
            # two more repeats, one far off: the median keeps the truth
            rows.append(_row("spd", {"gamma": g}, b, AR_TPS[b] * SPEEDUP[g][b], AR_JPT[b] * (
                1 - SAVING[g][b]) if energy else None, repeat=1))
            rows.append(_row("spd", {"gamma": g}, b, 1e6, 1e-9 if energy else None, repeat=2))
    # typical beats every spd variant at B = 4 (the best decoder there is not the chain's)
    rows.append(_row("typical", {}, 4, AR_TPS[4] * 1.4, AR_JPT[4] * 0.8 if energy else None))
    return rows


def test_the_speed_schedule_picks_the_best_gamma_per_range_and_0_where_ar_wins():
    plan = build_schedule(sweep_rows(), "speed")
    assert [(r.low, r.high, r.gamma) for r in plan.ranges] == [
        (1, 1, 5), (2, 3, 3), (4, 7, 3), (8, 15, 1), (16, 31, 0), (32, 32, 0)]
    assert plan.mapping == {"1-1": 5, "2-7": 3, "8-15": 1, "16-32": 0}
    assert plan.vllm_config()["num_speculative_tokens"] == 5
    at4 = plan.ranges[2]
    assert (at4.best_label, at4.best_gain) == ("typical", pytest.approx(1.4))
    assert (at4.chain_gamma, at4.chain_gain) == (3, pytest.approx(1.25))  # spd(gamma=3) measured
    at16 = plan.ranges[4]  # ar wins; spd's best (gamma 1) is 0.9x: shown, not scheduled
    assert (at16.best_label, at16.gamma, at16.chain_gamma) == ("ar", 0, 1)
    assert at16.chain_gain == pytest.approx(0.9) and not plan.never_pays
    wide = build_schedule(sweep_rows(), "speed", max_batch_size=4096)
    assert list(wide.mapping)[-1] == "16-4096"


def test_the_energy_schedule_minimises_joules_per_token():
    plan = build_schedule(sweep_rows(), "energy")
    assert plan.mapping == {"1-7": 2, "8-15": 1, "16-32": 0}
    assert plan.ranges[0].chain_gain == pytest.approx(0.3)
    assert plan.ranges[2].best_label == "typical" and plan.ranges[2].best_gain == pytest.approx(0.2)
    table = schedule_table(plan)
    assert list(table.columns) == ["batch sizes", "at B", "best", "saving", "best spd gamma",
                                   "spd saving", "vLLM gamma"]
    assert table["vLLM gamma"].tolist() == [2, 2, 2, 1, 0, 0]


def test_a_chain_decoder_that_never_pays_gets_0_everywhere():
    rows = [r for r in sweep_rows() if r["decoder"] != "typical"]
    slow = [{**r, "tokens_per_s": r["tokens_per_s"] * 0.4} if r["decoder"] == "spd" else r
            for r in rows]
    plan = build_schedule(slow, "speed")
    assert plan.never_pays and plan.mapping == {"1-32": 0}
    assert plan.vllm_config()["num_speculative_tokens"] == 0


def test_what_the_schedule_cannot_answer_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"no decode energy in the sweep's rows \(meter 'none' measures"
                                         r" no energy\): --objective energy needs a meter"):
        build_schedule(sweep_rows(energy=False), "energy")
    assert build_schedule(sweep_rows(energy=False), "speed").mapping["1-1"] == 5
    with pytest.raises(ValueError, match="no `mtad` rows with a gamma in the sweep"):
        build_schedule(sweep_rows(), "speed", decoder="mtad")
    with pytest.raises(ValueError, match="objective must be speed or energy"):
        build_schedule(sweep_rows(), "joules")
    with pytest.raises(ValueError, match="no `ar` rows"):
        build_schedule([r for r in sweep_rows() if r["decoder"] != "ar"], "speed")
    with pytest.raises(ValueError, match="below the largest measured batch size 32"):
        build_schedule(sweep_rows(), "speed", max_batch_size=16)


def test_settings_are_never_pooled_into_one_schedule():
    """Eager and compiled sweeps (or other datasets) in one store are two experiments: pooled, the
    medians would mix them; the schedule refuses, naming both, and schedules the one picked."""
    eager = [r | {"model": "pair", "dataset": "mtbench", "max_new_tokens": 32} for r in sweep_rows()]
    # the compiled setting: spd at gamma 1 wins at every size
    compiled = [r | {"model": "pair+compile", "tokens_per_s": r["tokens_per_s"] * (
        3.0 if r["label"] == "spd(gamma=1)" else 1.0)} for r in eager]
    with pytest.raises(ValueError, match=r"the sweep holds 2 settings, which one schedule must not "
                                         r"pool: pair · mtbench · 32 tokens; pair\+compile · "
                                         r"mtbench · 32 tokens\. Pick one model label with --model"):
        build_schedule(eager + compiled, "speed")
    assert build_schedule(eager + compiled, "speed", model="pair").mapping == build_schedule(
        eager, "speed").mapping == {"1-1": 5, "2-7": 3, "8-15": 1, "16-32": 0}
    plan = build_schedule(eager + compiled, "speed", model="pair+compile")
    assert plan.mapping == {"1-32": 1}
    assert plan.setting == "pair+compile · mtbench · 32 tokens"
    with pytest.raises(ValueError, match=r"no rows of model 'x' in the sweep \(models: pair, "
                                         r"pair\+compile\)"):
        build_schedule(eager + compiled, "speed", model="x")


def test_cli_schedule_writes_vllms_mapping(tmp_path):
    store = ResultStore(tmp_path / "sweep")
    for i, row in enumerate(sweep_rows()):
        key = stable_key({"i": i})
        store.write("decode_batch", key, [{c: None for c in DECODE_BATCH.required} | {"row_key": key,
                                                                                   **row}])
    res = CliRunner().invoke(app, ["schedule", str(tmp_path / "sweep"), "--objective", "energy",
                                   "--max-batch-size", "4096", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["speculative_config"]["num_speculative_tokens_per_batch_size"] == {
        "1-7": 2, "8-15": 1, "16-4096": 0}
    written = json.loads((tmp_path / "sweep-schedule-energy.json").read_text())
    assert written == doc["speculative_config"]
    res = CliRunner().invoke(app, ["schedule", str(tmp_path / "sweep")], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert '"1-1": 5' in res.output and "2.00x" in res.output and "typical" in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    empty = tmp_path / "empty"
    ResultStore(empty)
    res = CliRunner().invoke(app, ["schedule", str(empty), "--json"])
    assert res.exit_code == 2 and "no decoding batch-size rows" in json.loads(res.stdout)["error"]


def test_the_report_has_the_schedule(tmp_path, store_dir):
    from mtad_energy.results.report import write_report

    md = write_report(store_dir, tmp_path / "rep").read_text()
    section = md.split("### Speculation schedule")[1].split("\n## ")[0]
    # the fixture's spd (gamma 4) beats ar at 1 and 2, not from 4 on
    assert '"num_speculative_tokens_per_batch_size": {"1-3": 4, "4-8": 0}' in section
    assert "**energy**:" in section and "**speed**:" in section


def test_comma_lists_of_a_scalar_parameter_become_variants():
    specs = expand_variants([DecoderSpec("ar"), DecoderSpec.of("spd", gamma="1,2,3,5")])
    assert [s.label for s in specs] == ["ar", "spd(gamma=1)", "spd(gamma=2)", "spd(gamma=3)",
                                        "spd(gamma=5)"]
    grid = expand_variants([DecoderSpec.of("mtad", gamma="2,4", tau="0.3,0.5")])
    assert len(grid) == 4 and DecoderSpec.of("mtad", gamma="4", tau="0.3") in grid
    tree = expand_variants([DecoderSpec.of("specinfer", branching="4,2,2")])
    assert tree == [DecoderSpec.of("specinfer", branching="4,2,2")]  # a tuple: one value
    assert tree[0].build().params.branching == (4, 2, 2)
    assert pd.Series([s.build().params.gamma for s in specs[1:]]).tolist() == [1, 2, 3, 5]
