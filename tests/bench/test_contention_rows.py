"""Rows carry what other processes took during their windows (`measure.contention`): the phase
windows attach the probe, the runner's and the decoding sweep's rows store the figures, and
`profile` measures its baseline beside the decoders it was given (README's main job)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from mtad_energy.bench.phase_windows import PhaseWindows
from mtad_energy.bench.work_units import with_baseline
from mtad_energy.cli import app
from mtad_energy.measure.contention import ContentionProbe
from mtad_energy.measure.none import NoneMeter
from mtad_energy.results import load_results

runner = CliRunner()


def test_the_phase_windows_flag_a_window_another_process_spun_through():
    windows = PhaseWindows(NoneMeter(), "row", ContentionProbe())
    windows("prefill")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # spinning before the decode window opens
        windows("decode")
        time.sleep(1.5)
        windows("done")
    finally:
        spinner.kill()
        spinner.wait()
    assert set(windows.contention) == {"prefill", "decode"}
    assert windows.contention["decode"].contended
    cols = windows.contention_columns()
    assert cols["contended"] is True and cols["others_cpu_s"] >= 0.25 * 1.5
    assert set(windows.measurements) == {"prefill", "decode"}  # the meter's windows as before
    unprobed = PhaseWindows(NoneMeter(), "row")
    unprobed("decode")
    unprobed.close()
    assert unprobed.contention_columns()["contended"] is None


def test_decoding_sweep_rows_store_the_contention_figures(tmp_path, llama_pair):
    from mtad_energy.bench.decode_batch import decode_batch_sweep
    from mtad_energy.config import DecoderSpec
    from mtad_energy.results import ResultStore

    rep = decode_batch_sweep(llama_pair, [DecoderSpec("ar")], [2], [[5, 9, 4]],
                             ResultStore(tmp_path / "s"), NoneMeter(), max_new_tokens=4)
    (row,) = load_results(tmp_path / "s", "decode_batch").to_dict("records")
    assert row["contended"] in (True, False) and row["others_cpu_s"] >= 0.0
    assert row["others_cores"] >= 0.0 and json.loads(row["gpu_other_pids"]) == []
    assert rep.rows[0]["contended"] == row["contended"]


def test_with_baseline_adds_it_first_unless_listed_or_none():
    assert with_baseline(["mtad"], "ar") == ["ar", "mtad"]
    assert with_baseline(["spd", "ar"], "ar") == ["spd", "ar"]
    assert with_baseline(["mtad"], "none") == ["mtad"]
    assert with_baseline(["mtad"], "spd") == ["spd", "mtad"]
    with pytest.raises(ValueError, match="--baseline 'nope' is not a decoder.*or none"):
        with_baseline(["mtad"], "nope")


def _profile(model_dirs, prompts_file, out, *extra, decoder="spd"):
    res = runner.invoke(app, ["profile", "--decoder", decoder, "--target", model_dirs["llama"],
                              "--draft", model_dirs["llama-draft"], "--meter", "none",
                              "--max-new-tokens", "4", "--dataset", prompts_file, "--n-prompts",
                              "2", "--output", str(out), "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": f"w{i + 3} w{i + 9} w{i + 4}"})
                              for i in range(2)) + "\n")
    return str(path)


def test_profile_measures_ar_beside_a_drafting_decoder_for_its_speed_up(model_dirs, prompts_file,
                                                                         tmp_path):
    doc = _profile(model_dirs, prompts_file, tmp_path / "p")
    summary = {r["decoder"]: r for r in doc["summary"]}
    assert set(summary) == {"ar", "spd"} and doc["ran"] == 4
    assert summary["spd"]["speedup"] == pytest.approx(
        summary["spd"]["tokens_per_s"] / summary["ar"]["tokens_per_s"])
    assert summary["ar"]["speedup"] == pytest.approx(1.0)
    runs = load_results(tmp_path / "p")
    assert sorted(runs["decoder"]) == ["ar", "ar", "spd", "spd"]  # ordinary rows of the store
    assert runs["contended"].isin([True, False]).all() and (runs["others_cpu_s"] >= 0).all()
    assert set(doc["machine_load"]) == {"others_cores", "contended", "warning"}


def test_profile_baseline_none_runs_only_the_decoders_given(model_dirs, prompts_file, tmp_path):
    doc = _profile(model_dirs, prompts_file, tmp_path / "p", "--baseline", "none")
    assert [r["decoder"] for r in doc["summary"]] == ["spd"] and doc["ran"] == 2
    assert doc["summary"][0]["speedup"] is None
    assert set(load_results(tmp_path / "p")["decoder"]) == {"spd"}
    listed = _profile(model_dirs, prompts_file, tmp_path / "p", "--baseline", "none",
                      decoder="ar,spd")  # ar given by hand: speed-ups over it, as ever
    assert {r["decoder"]: r["speedup"] is not None for r in listed["summary"]} == {
        "ar": True, "spd": True}
    bad = runner.invoke(app, ["profile", "--decoder", "spd", "--baseline", "nope", "--json",
                              "--output", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--baseline 'nope' is not a decoder" in bad.stdout
