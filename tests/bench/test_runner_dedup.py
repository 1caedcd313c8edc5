"""Work asked for twice runs once; a row another worker stores meanwhile is skipped, not an error."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mtad_energy.bench.prompts import Prompt
from mtad_energy.bench.runner import Runner, run_profile, work_units
from mtad_energy.cli import app
from mtad_energy.config import DecoderSpec, MeasureConfig, ModelSpec, RunConfig
from mtad_energy.measure import NoneMeter
from mtad_energy.results import ResultStore, load_results
from mtad_energy.results.store import RowExistsError, StoreError

PROMPTS = [Prompt(f"p{i}", f"w{i + 3} w9 w{i + 20}", "toy") for i in range(3)]
AR, SPD = DecoderSpec("ar"), DecoderSpec.of("spd", gamma="3")


def config(decoders=(AR, SPD)) -> RunConfig:
    return RunConfig(decoders=decoders, model=ModelSpec(alias=None), datasets=("toy",), n_prompts=3,
                     max_new_tokens=3, measure=MeasureConfig("none", "off"))


def test_units_asked_for_twice_run_once(tmp_path, llama_pair):
    # a decoder listed twice, the same parameters spelled two ways, a dataset listed twice
    cfg = config((DecoderSpec("ar"), DecoderSpec("ar"), SPD, DecoderSpec.of("spd", gamma=3)))
    assert len(work_units(cfg, PROMPTS + PROMPTS)) == 3 * 3  # exact duplicates dropped up front
    rep = run_profile(cfg, ResultStore(tmp_path), pair=llama_pair, meter=NoneMeter(),
                      prompts=PROMPTS + PROMPTS)
    assert (rep.ran, rep.skipped) == (6, 0)  # spd(gamma="3") and spd(gamma=3) are one row
    runs = load_results(tmp_path)
    assert len(runs) == 6 and runs["run_key"].is_unique


def test_a_row_another_worker_stored_meanwhile_is_skipped(tmp_path, llama_pair):
    cfg = config()
    units = work_units(cfg, PROMPTS)
    a = Runner(cfg, ResultStore(tmp_path), pair=llama_pair, meter=NoneMeter())
    mine = a.iter_run(units)
    assert next(mine)[0] is not None  # a stores the first row, then another worker does the rest
    other = run_profile(cfg, ResultStore(tmp_path), pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS)
    assert (other.ran, other.skipped) == (5, 1)
    assert [row for row, _ in mine] == [None] * 5  # a finds them stored: skipped, not an error

    # the race: the other worker's row lands between the check and the write
    store = ResultStore(tmp_path)
    store.has = lambda table, key: False
    store.keys = lambda table: set()
    late = run_profile(cfg, store, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS)
    assert (late.ran, late.skipped) == (0, 6)
    assert len(load_results(tmp_path)) == 6


def test_a_stored_key_is_refused_atomically(tmp_path):
    store = ResultStore(tmp_path)
    key = "0123456789abcdef"
    row = {"run_key": key, "iteration": 0, "emitted": 1, "proposed": 0, "accepted": 0,
           "draft_forwards": 0, "target_forwards": 1}
    store.write("steps", key, [row])
    with pytest.raises(RowExistsError, match="never written twice"):
        store.write("steps", key, [row])
    assert issubclass(RowExistsError, StoreError)
    assert [p.name for p in (tmp_path / "steps").iterdir()] == [f"{key}.parquet"]  # no temporaries


def test_cli_decoder_and_dataset_listed_twice(model_dirs, tmp_path):
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"w{i + 3} w9"}) + "\n" for i in range(2)))
    args = ["profile", "--decoder", "ar,ar", "--target", model_dirs["llama"], "--meter", "none",
            "--max-new-tokens", "3", "--dataset", f"{data},{data}", "--n-prompts", "2",
            "--output", str(tmp_path / "out"), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert (json.loads(res.stdout)["ran"], json.loads(res.stdout)["skipped"]) == (2, 0)
    assert len(load_results(tmp_path / "out")) == 2
