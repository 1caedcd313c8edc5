"""`mtad-energy calibrate` end to end: on a simulated GPU (record stored, later runs reference it
and flag short windows), and on a machine without a GPU (what it cannot measure, and why)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.measure.probes import ROLES
from mtad_energy.results import ResultStore, load_results

runner = CliRunner()
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")


def calibrate(*args: str):
    return runner.invoke(app, ["calibrate", "--quick", "--model", "tiny-llama", *args])


def test_simulated_calibration_is_stored_and_referenced_by_later_runs(model_dirs, calibration_records,
                                                                      tmp_path):
    res = calibrate("--meter", "simulated", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rec = doc["record"]
    assert rec["device_id"] == "simulated-a100-h100" and rec["simulated"] is True
    assert rec["trusted_meter"] in ROLES and rec["min_window_s"] > 0.1
    assert doc["record_path"] == str(calibration_records / "simulated-a100-h100.json")
    assert doc["verdict"][0].startswith(f"trust {rec['trusted_meter']}: ")
    assert doc["floor"][0]["model"] == "tiny-llama" and doc["floor"][0]["error"] is None
    assert doc["copy_bandwidth_bytes_per_s"] > 0
    # a later run with the simulated meter: its snapshot references the record, its short
    # windows (milliseconds of a tiny model) are flagged
    out = tmp_path / "store"
    run = runner.invoke(app, ["profile", "--decoder", "ar", "--target", model_dirs["llama"],
                              "--draft", model_dirs["llama-draft"], "--meter", "simulated",
                              "--mitigate", "off", "--max-new-tokens", "3", "--n-prompts", "1",
                              "--output", str(out)])
    assert run.exit_code == 0, run.output
    envs = ResultStore(out).envs()
    [env] = [e for e in envs.values() if e.get("calibrations")]
    assert [c["record_id"] for c in env["calibrations"]] == [rec["record_id"]]
    runs = load_results(out)
    assert runs["env_id"].isin([k for k, e in envs.items() if e.get("calibrations")]).all()
    assert all("below-calibrated-min" in json.loads(cell) for cell in runs["energy_flags"])


def test_simulated_calibration_prints_tables_and_the_verdict():
    res = calibrate("--meter", "simulated", "--preset", "v100")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "meters side by side" in text and "window length sweep" in text
    assert "verdict: trust " in text and "the energy counter updates every 20 ms" in text
    assert "simulated-v100.json" in text.replace(" ", "")


@CPU_ONLY
def test_without_a_gpu_it_says_what_it_cannot_measure_and_why(no_nvml, calibration_records):
    res = calibrate("--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    # once, with calibrate's own fix (issue 41: five times, advising --meter rapl, which
    # calibrate refuses)
    why = ("NVML could not start (NVML Shared Library Not Found); this machine has no usable NVIDIA "
           "driver; calibrate compares a GPU's meters: run it on a GPU machine, or rehearse it "
           "with --meter simulated")
    assert doc["cannot"] == [
        {"what": "the GPU's meters side by side (energy counter, instant power, Zeus, 1 s polling), "
                 "idle power, the energy counter's update period and the shortest window worth "
                 "measuring", "why": why},
        {"what": "GPU copy bandwidth and forward floor",
         "why": "no CUDA device: measured on the CPU instead (its memory bandwidth, its forward time)"},
    ]
    assert doc["meters"] is None and doc["record"] is None and not list(calibration_records.iterdir())
    assert doc["verdict"][0] == ("nothing to calibrate: NVML could not start (NVML Shared Library "
                                 "Not Found); `mtad-energy calibrate --meter simulated` rehearses "
                                 "the calibration on a simulated GPU")
    assert "rapl" not in res.stdout
    assert doc["floor"][0]["forward_ms"] > 0  # what a CPU can measure, it measures


@CPU_ONLY
def test_nvml_without_cuda_in_torch_is_named(fake_nvml):
    res = calibrate("--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["cannot"][0]["why"] == (
        "NVML sees NVIDIA H100 80GB HBM3 but torch has no CUDA device (a CPU-only torch build, or a "
        "driver older than torch's CUDA): the workloads need one; calibrate compares a GPU's "
        "meters: run it on a GPU machine, or rehearse it with --meter simulated")


def test_bad_options_are_one_json_error():
    res = runner.invoke(app, ["calibrate", "--meter", "nvml-power", "--json"])
    assert res.exit_code == 2
    assert json.loads(res.stdout) == {"error": "calibrate measures the meters 'auto' picks from (the "
                                               "GPU's) or a 'simulated' GPU, got 'nvml-power'",
                                      "exit_code": 2}
    res = runner.invoke(app, ["calibrate", "--meter", "simulated", "--preset", "p100", "--json"])
    assert res.exit_code == 2 and "unknown sensor preset 'p100'" in json.loads(res.stdout)["error"]


def test_the_floor_of_each_named_model_one_after_the_other(calibration_records):
    """--model A,B times each model's floor (the GPU kit: the 8B target and the 1B draft)."""
    res = runner.invoke(app, ["calibrate", "--quick", "--meter", "simulated", "--model",
                              "tiny-llama,tiny-llama-draft", "--compile", "--json"])
    assert res.exit_code == 0, res.output
    floor = json.loads(res.stdout)["floor"]
    assert [(r["model"], r["mode"]) for r in floor] == [
        ("tiny-llama", "eager"), ("tiny-llama", "compiled"), ("tiny-llama-draft", "eager"),
        ("tiny-llama-draft", "compiled")]
    assert all(r["error"] is None for r in floor)
