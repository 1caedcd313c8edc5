"""The schedule measured in vLLM (`bench.schedule_check`, `schedule --validate`): the comparison
table on hand-built rows with a known answer, the ``per_batch_size`` parameter (vLLM's dynamic
speculative decoding) as the engine seam takes it, and the sweep setting read back from rows. No
vLLM engine is started here (the real run is `experiments/results/engines/vllm_schedule/`)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from mtad_energy.bench import schedule_check as sc
from mtad_energy.config import DecoderSpec
from mtad_energy.engines import UnsupportedError, engine_kind
from mtad_energy.engines import vllm as ve
from mtad_energy.results.schedule import (
    DRAFT_AT_ZERO_NOTE,
    Schedule,
    ScheduleRange,
    build_schedule,
)

TRIPLES = [[1, 1, 3], [2, 3, 1], [4, 16, 0]]
SCHEDULED = {"gamma": 3, "per_batch_size": "1-1:3;2-3:1;4-16:0", "temperature": 0.0}
# tokens/s per (k, batch size): k = 0 is ar; the best fixed k falls with B
FIXED = {0: {1: 10.0, 2: 18.0, 4: 40.0}, 1: {1: 12.0, 2: 24.0, 4: 30.0},
         2: {1: 14.0, 2: 20.0, 4: 25.0}, 3: {1: 15.0, 2: 16.0, 4: 20.0}}
MINE = {1: 13.5, 2: 21.6, 4: 44.0}


def _plan() -> Schedule:
    ranges = (ScheduleRange(1, 1, 1, "spd(gamma=3)", "spd", 3, 1.5, 3, 1.5, 3),
              ScheduleRange(2, 3, 2, "spd(gamma=1)", "spd", 1, 1.3, 1, 1.3, 1),
              ScheduleRange(4, 16, 4, "ar", "ar", None, 1.0, 1, 0.75, 0))
    return Schedule("speed", "spd", ranges, "smollm2+vllm", 1)


def _row(decoder: str, params: dict, b: int, tps: float, repeat: int = 0, **extra) -> dict:
    label = decoder + ("(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"
                       if params else "")
    return {"decoder": decoder, "label": label, "params_json": json.dumps(params, sort_keys=True),
            "batch_size": b, "repeat": repeat, "tokens_per_s": tps, "block_efficiency": 2.0,
            "acceptance_rate": 0.5, "energy_per_token_j": None, "contended": False,
            "energy_reason": "no energy meter selected (meter='none')", **extra}


def validation_rows() -> list[dict]:
    rows = []
    for rep in (3, 4):  # two repeats; a far-off third of the schedule: the median keeps the truth
        for b in (1, 2, 4):
            rows.append(_row("spd", SCHEDULED, b, MINE[b], rep))
            rows += [_row("ar", {"temperature": 0.0}, b, FIXED[0][b], rep)]
            rows += [_row("spd", {"gamma": k, "temperature": 0.0}, b, FIXED[k][b], rep)
                     for k in (1, 2, 3)]
    rows += [_row("spd", SCHEDULED, b, 1e6, 5) for b in (1, 2, 4)]
    rows.append(_row("pld", {"gamma": 5}, 1, 1e6))  # another decoder: ignored
    rows[1]["contended"] = True  # ar at B = 1, repeat 3
    return rows


def test_the_table_compares_the_schedule_with_the_best_fixed_k_and_its_own_k_per_batch_size():
    t = sc.validation_table(validation_rows(), _plan()).set_index("batch_size")
    assert list(t.index) == [1, 2, 4]
    assert t["schedule_k"].tolist() == [3, 1, 0]
    assert t["best_fixed_k"].tolist() == [3, 1, 0]  # 15 > 14 > 12 > 10; 24; 40 (ar)
    assert t["schedule_tokens_per_s"].tolist() == [13.5, 21.6, 44.0]
    assert t["vs_best_fixed"].tolist() == pytest.approx([13.5 / 15, 21.6 / 24, 44 / 40])
    assert t["same_k_tokens_per_s"].tolist() == [15.0, 24.0, 40.0]
    assert t["ar_tokens_per_s"].tolist() == [10.0, 18.0, 40.0]
    assert t["repeats"].tolist() == [3, 3, 3]
    assert t["contended"].tolist() == [True, False, False]
    assert all(math.isnan(v) for v in t["schedule_j_per_token"])
    assert t["energy_reason"].str.contains("meter='none'").all()


def test_the_best_fixed_k_is_not_the_schedules_own_where_the_measurement_disagrees():
    rows = [r for r in validation_rows() if not (r["batch_size"] == 2 and r["label"] ==
                                                  "spd(gamma=2,temperature=0.0)")]
    rows += [_row("spd", {"gamma": 2, "temperature": 0.0}, 2, 30.0, rep) for rep in (3, 4)]
    t = sc.validation_table(rows, _plan()).set_index("batch_size")
    assert t.loc[2, "best_fixed_k"] == 2 and t.loc[2, "schedule_k"] == 1
    assert t.loc[2, "vs_best_fixed"] == pytest.approx(21.6 / 30)
    assert t.loc[2, "vs_same_k"] == pytest.approx(21.6 / 24)


def test_the_schedules_k_0_is_compared_with_k_0_measured_where_the_sweep_has_it():
    """spd at gamma=0 (the speculating engine at k = 0, a draft model still running) is a fixed
    configuration of its own: the schedule's k = 0 is compared with it, never with ar's figure,
    and ar stays ar."""
    rows = validation_rows() + [_row("spd", {"gamma": 0, "temperature": 0.0}, 4, 21.0, rep)
                                for rep in (3, 4)]
    t = sc.validation_table(rows, _plan()).set_index("batch_size")
    assert t.loc[4, "same_k_tokens_per_s"] == 21.0 and t.loc[4, "ar_tokens_per_s"] == 40.0
    assert t.loc[4, "vs_same_k"] == pytest.approx(44 / 21)
    assert t.loc[4, "best_fixed"] == "ar" and t.loc[4, "best_fixed_k"] == 0
    _, cells, _ = sc.validation_display(t.reset_index())
    assert cells[2][3] == "ar"
    faster = validation_rows() + [_row("spd", {"gamma": 0, "temperature": 0.0}, 4, 50.0, rep)
                                  for rep in (3, 4)]
    t = sc.validation_table(faster, _plan()).set_index("batch_size")
    assert t.loc[4, "best_fixed"] == "k=0"
    _, cells, _ = sc.validation_display(t.reset_index())
    assert cells[2][3] == "0"  # k = 0 measured, not ar


def test_the_table_needs_schedule_rows_and_fixed_rows_beside_them():
    with pytest.raises(ValueError, match="no rows of the schedule"):
        sc.validation_table([r for r in validation_rows() if "per_batch_size" not in
                             r["params_json"]], _plan())
    with pytest.raises(ValueError, match="at batch size 4"):
        sc.validation_table([r for r in validation_rows() if r["batch_size"] != 4
                             or "per_batch_size" in r["params_json"]], _plan())


def test_k_at_is_vllms_lookup():
    assert [sc.k_at(TRIPLES, b) for b in (1, 2, 3, 4, 16, 64)] == [3, 1, 1, 0, 0, 0]


def test_per_batch_size_is_a_vllm_parameter_given_only_and_refused_elsewhere():
    vllm = engine_kind("vllm")
    assert "per_batch_size" not in vllm.decoder_params("spd", {"gamma": "3"})  # old rows' keys
    assert vllm.decoder_params("spd", {"gamma": "3", "per_batch_size": "1-16:3"})[
        "per_batch_size"] == "1-16:3"
    with pytest.raises(UnsupportedError, match="no parameter 'per_batch_size'"):
        engine_kind("llamacpp").decoder_params("spd", {"per_batch_size": "1-16:3"})
    with pytest.raises(UnsupportedError, match="no parameter 'per_batch_size'"):
        vllm.decoder_params("ar", {"per_batch_size": "1-16:3"})
    config = ve.speculative_config("spd", {"gamma": 3, "per_batch_size": "1-1:3;2-3:1;4-16:0"},
                                   "/m", None)
    assert config["num_speculative_tokens_per_batch_size"] == TRIPLES
    assert ve.per_batch_size_text(TRIPLES) == "1-1:3;2-3:1;4-16:0"
    assert "," not in ve.per_batch_size_text(TRIPLES)  # a --set comma list would split it


def test_a_malformed_schedule_or_a_k_vllm_would_clamp_is_refused():
    with pytest.raises(UnsupportedError, match="START-END:K"):
        ve.per_batch_size_triples("1-4=3", 3)
    with pytest.raises(UnsupportedError, match="k=5 above gamma=3"):
        ve.per_batch_size_triples("1-4:5", 3)


def test_a_schedules_own_rows_are_never_a_fixed_gamma_of_the_next_schedule():
    rows = [dict(r, model="smollm2+vllm") for r in validation_rows() if r["decoder"] != "pld"]
    plan = build_schedule(rows, model="smollm2+vllm")
    assert [r.gamma for r in plan.ranges] == [3, 1, 0]  # the 1e6 schedule rows would win all


def test_the_sweep_setting_is_read_back_from_its_rows():
    common = {"model": "smollm2+vllm", "target_id": "t", "dataset": "mtbench",
              "max_new_tokens": 64, "meter": "none", "device": "cpu", "dtype": "bfloat16",
              "engine": "vllm"}
    rows = [dict(r, prompts=f"p{r['batch_size']}", seed=r["repeat"], **common)
            for r in validation_rows() if r["decoder"] != "pld"]
    s = sc.sweep_setting(pd.DataFrame(rows), _plan())
    assert s.sizes == (1, 2, 4) and s.next_repeat == 6 and s.seed == 0
    assert s.prompt_keys == {1: "p1", 2: "p2", 4: "p4"}
    assert [ve_k(x) for x in s.fixed] == [1, 2, 3]  # the schedule's own rows are no fixed k
    assert s.baseline == DecoderSpec.of("ar", temperature="0.0")
    spec = sc.schedule_spec(s, _plan())
    assert spec.param_dict == {"gamma": "3", "per_batch_size": "1-1:3;2-3:1;4-16:0",
                               "temperature": "0.0"}
    with pytest.raises(ValueError, match="--engine vllm"):
        sc.sweep_setting(pd.DataFrame([dict(r, engine="hf") for r in rows]), _plan())


def test_the_validation_starts_vllm_with_the_settings_the_sweep_ran_under():
    """A sweep run with --engine-option (compiled vLLM, a memory share): the validation's engine
    gets the same settings, read from the rows' engine_config; rows of two settings are refused."""
    common = {"model": "smollm2+vllm", "target_id": "t", "dataset": "mtbench",
              "max_new_tokens": 64, "meter": "none", "engine": "vllm"}
    config = {"model_dir": "/m", "dtype": "bfloat16", "enforce_eager": False,
              "max_model_len": 2048, "max_num_seqs": 16, "gpu_memory_utilization": 0.45,
              "env": {"VLLM_CPU_KVCACHE_SPACE": "4"}, "threads": 1}
    rows = [dict(r, prompts=f"p{r['batch_size']}", seed=r["repeat"], **common,
                 engine_config=json.dumps(config)) for r in validation_rows()
            if r["decoder"] != "pld"]
    s = sc.sweep_setting(pd.DataFrame(rows), _plan())
    assert s.engine_options == {"dtype": "bfloat16", "enforce_eager": False,
                                "max_model_len": 2048, "max_num_seqs": 16,
                                "gpu_memory_utilization": 0.45, "kv_cache_space_gib": 4}
    engine_kind("vllm").options(s.engine_options)  # every one a vLLM setting
    rows[0]["engine_config"] = json.dumps({**config, "enforce_eager": True})
    with pytest.raises(ValueError, match="several vLLM settings"):
        sc.sweep_setting(pd.DataFrame(rows), _plan())


def ve_k(spec: DecoderSpec) -> int:
    return int(spec.param_dict["gamma"])


def test_spec_of_label_gives_back_the_sweeps_spec():
    spec = DecoderSpec.of("spd", gamma="2", temperature="0")
    assert sc.spec_of_label(spec.label) == spec
    assert sc.spec_of_label("ar") == DecoderSpec.of("ar")


def test_cli_validate_refuses_a_sweep_that_is_not_vllms_in_one_json_document(tmp_path):
    """`schedule --validate` on the project's own (hf) sweep: exit 2, one line naming the fix,
    --json one document; the schedule itself is still written (it is valid for hf rows)."""
    from typer.testing import CliRunner

    from mtad_energy.cli import app
    from mtad_energy.results import ResultStore, stable_key
    from mtad_energy.results.schema import DECODE_BATCH

    store = ResultStore(tmp_path / "s")
    for i, row in enumerate(validation_rows()):
        if "per_batch_size" in row["params_json"] or row["decoder"] == "pld":
            continue
        key = stable_key({"i": i})
        store.write("decode_batch", key, [{c: None for c in DECODE_BATCH.required} | {
            "row_key": key, **row, "model": "smollm2", "engine": "hf", "target_id": "t",
            "dataset": "mtbench", "max_new_tokens": 8, "device": "cpu", "dtype": "float32"}])
    done = CliRunner().invoke(app, ["schedule", str(tmp_path / "s"), "--validate", "--json"])
    assert done.exit_code == 2, done.output
    doc = json.loads(done.stdout)
    assert "--engine vllm" in doc["error"] and "hf" in doc["error"]
    assert (tmp_path / "s-schedule-speed.json").exists()


def test_a_draft_model_schedule_with_k_0_says_what_k_0_costs_in_vllm():
    """Measured: with a draft model, vLLM at k = 0 still runs a draft forward per step (0.48x of
    ar); the schedule says so where it has a range with k = 0, and only there."""
    plan = _plan()
    assert plan.repeats == 1 and DRAFT_AT_ZERO_NOTE in plan.notes
    pld = Schedule("speed", "pld", plan.ranges, plan.setting, 3)
    assert pld.notes == pld.caveats  # n-gram at k = 0: 0.96-0.98x of ar (vllm_options.py k0)
    on = Schedule("speed", "spd", plan.ranges[:2], plan.setting, 3)
    assert on.notes == on.caveats  # (the sizes past those measured: extrapolated)


def test_a_vllm_that_fails_on_the_schedule_is_one_error_naming_its_version(tmp_path, monkeypatch):
    """The error path only (what vLLM does is the engine test's and the committed run's): an
    engine error during the validation names vLLM's version, the schedule and vLLM's error, and
    the engine is closed."""
    import mtad_energy.bench.decode_batch as db
    import mtad_energy.engines as engines
    import mtad_energy.models as models
    from mtad_energy.engines import EngineError

    common = {"model": "smollm2+vllm", "target_id": "t", "dataset": "mtbench",
              "max_new_tokens": 8, "meter": "none", "device": "cpu", "dtype": "bfloat16",
              "engine": "vllm", "engine_config": json.dumps({"enforce_eager": False})}
    rows = pd.DataFrame([dict(r, prompts="p", seed=r["repeat"], **common)
                         for r in validation_rows() if r["decoder"] != "pld"])
    closed, loaded = [], []

    class Engine:
        version = "vllm 0.32.0"

        def close(self):
            closed.append(True)

    def dies(*args, **kwargs):
        raise EngineError("vLLM died during spd: worker crashed")

    monkeypatch.setattr(models, "load_pair", lambda *a, **k: type("P", (), {
        "target_id": "t", "name": "smollm2"})())
    monkeypatch.setattr(sc, "the_prompts", lambda pair, setting: [[1, 2, 3]])
    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: loaded.append(a) or Engine())
    monkeypatch.setattr(db, "decode_batch_sweep", dies)
    with pytest.raises(EngineError) as error:
        sc.run_validation(tmp_path / "s", rows, _plan())
    text = str(error.value)
    assert "vllm 0.32.0" in text and "[[1, 1, 3], [2, 3, 1], [4, 16, 0]]" in text
    assert "worker crashed" in text and closed == [True]
    assert loaded[0][2] == {"enforce_eager": False}  # vLLM started as the sweep ran it


def test_the_display_marks_contended_sizes_says_why_j_is_na_and_never_calls_k_0_ar():
    columns, cells, caption = sc.validation_display(sc.validation_table(validation_rows(), _plan()))
    by_b = {row[0]: dict(zip(columns, row, strict=True)) for row in cells}
    assert set(by_b) == {"1*", "2", "4"}  # ar at B = 1 ran on a busy machine
    assert by_b["4"]["schedule k"] == "0" and by_b["4"]["best fixed k"] == "ar"
    assert by_b["1*"]["vs best fixed"] == "0.90x" and by_b["1*"]["J/token"] == "n/a"
    assert "meter='none'" in caption and "other processes" in caption
