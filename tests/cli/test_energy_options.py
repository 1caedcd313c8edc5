"""Energy options: --require-energy refuses before loading a model, mitigation needs a meter that
measures energy (refused with --mitigate on, skipped with auto), simulated energy is labelled."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mtad_energy.bench.prompts import Prompt
from mtad_energy.bench.runner import Runner, work_units
from mtad_energy.cli import app
from mtad_energy.config import DecoderSpec, MeasureConfig, ModelSpec, NoEnergyError, RunConfig
from mtad_energy.measure import NoneMeter
from mtad_energy.measure.select import energy_unavailable
from mtad_energy.results import ResultStore, load_results

runner = CliRunner()


class GpulessZeus(NoneMeter):
    """What `get_meter("zeus")` gives on a machine without a GPU: a working meter with no device."""

    name = "zeus"

    def __init__(self):
        super().__init__(reason="Zeus found no GPU")


def one_line(res) -> str:
    return " ".join(res.output.split())


def prompts_file(tmp_path) -> str:
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"w{i + 3} w9 w4"}) + "\n"
                            for i in range(2)))
    return str(path)


def test_require_energy_exits_2_before_loading_a_model(tmp_path):
    missing = str(tmp_path / "no-such-model")  # loading it would fail with another message
    for cmd in (["profile", "--decoder", "ar"], ["compare", "--decoders", "ar"],
                ["sweep", "param", "--decoder", "spd", "--param", "gamma=2,3"],
                ["sweep", "batch-size", "--sizes", "1"]):
        res = runner.invoke(app, [*cmd, "--target", missing, "--meter", "none", "--require-energy",
                                  "--output", str(tmp_path / cmd[-1].replace("=", ""))])
        assert res.exit_code == 2, (cmd, res.output)
        text = one_line(res)
        assert "--require-energy: meter 'none' cannot measure energy" in text, text
        assert "drop --require-energy" in text and "no-such-model" not in text
    res = runner.invoke(app, ["profile", "--decoder", "ar", "--target", missing, "--meter", "none",
                              "--require-energy", "--workers", "2", "--cluster", "debug",
                              "--output", str(tmp_path / "dist")])
    assert res.exit_code == 2 and "--require-energy" in one_line(res), res.output


def test_mitigate_on_without_energy_is_refused_with_the_fix(tmp_path):
    res = runner.invoke(app, ["profile", "--decoder", "ar", "--target", str(tmp_path / "none"),
                              "--meter", "none", "--mitigate", "on", "--output", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert "--mitigate on repeats every generation" in one_line(res)
    assert "use --mitigate auto or off" in one_line(res)
    with pytest.raises(NoEnergyError, match="mitigate on"):
        MeasureConfig("zeus", "on").mitigation_for(GpulessZeus())


def test_mitigation_is_skipped_when_the_meter_measures_no_energy(tmp_path, llama_pair):
    assert energy_unavailable(GpulessZeus()) and energy_unavailable(NoneMeter())
    assert MeasureConfig("zeus", "auto").mitigation_for(GpulessZeus()) is False
    cfg = RunConfig(decoders=(DecoderSpec("ar"),), model=ModelSpec(alias=None), datasets=("toy",),
                    n_prompts=1, max_new_tokens=3, measure=MeasureConfig("zeus", "auto"))
    slept: list[float] = []
    run = Runner(cfg, ResultStore(tmp_path), pair=llama_pair, meter=GpulessZeus(), sleep=slept.append)
    row = run.run_unit(work_units(cfg, [Prompt("p", "w3 w9 w4", "toy")])[0])
    assert row["mitigated"] is False and row["energy_j"] is None
    assert slept == []  # no idle-power wait, no 32 repetitions


def test_simulated_energy_is_labelled_and_listed_in_help(model_dirs, tmp_path):
    helptext = one_line(runner.invoke(app, ["profile", "--help"], env={"COLUMNS": "200"}))
    assert "simulated" in helptext and "--require-energy" in helptext
    out = tmp_path / "sim"
    res = runner.invoke(app, ["compare", "--decoders", "ar", "--target", model_dirs["llama"],
                              "--max-new-tokens", "3", "--meter", "simulated", "--dataset",
                              prompts_file(tmp_path), "--n-prompts", "1", "--output", str(out)],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    text = one_line(res)
    assert "(simulated)" in text and "these joules were not measured" in text
    assert "not measured" in (tmp_path / "sim.md").read_text()
    assert load_results(out)["energy_j"].notna().all()
    rep = runner.invoke(app, ["report", str(out), "--out", str(tmp_path / "rep")])
    assert rep.exit_code == 0, rep.output
    assert "**Simulated energy**: 1 of 1 runs" in (tmp_path / "rep" / "report.md").read_text()
    res = runner.invoke(app, ["sweep", "batch-size", "--target", model_dirs["llama"], "--sizes", "1",
                              "--runs", "1", "--context-len", "4", "--forwards-per-run", "1", "--no-ops",
                              "--meter", "simulated", "--output", str(tmp_path / "bs")],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "not measured" in one_line(res)
