"""experiments/paper.py: every paper table/figure has a spec whose command the CLI accepts; and
experiments/refit_batch.py on the H100 batch study."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app
from tests.limits import hang_limit_s

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "experiments" / "paper.py"


@pytest.fixture(scope="module")
def paper():
    spec = importlib.util.spec_from_file_location("paper", PAPER)
    module = importlib.util.module_from_spec(spec)
    sys.modules["paper"] = module
    spec.loader.exec_module(module)
    return module


def test_every_experiment_is_listed_with_its_paper_source(paper, capsys):
    assert paper.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in ("main", "batch-size", "mtjd-k", "gamma", "beam-width", "tau", "top-k", "top-p"):
        assert name in out


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_every_command_parses(paper, profile, tmp_path):
    """--help after the arguments makes typer parse the options of the command without running it."""
    for exp in paper.EXPERIMENTS.values():
        cmd = paper.command(exp, profile, tmp_path, "smollm2")[3:]
        opts = [a for a in cmd if a.startswith("--")]
        sub = cmd[:cmd.index(opts[0])]
        res = CliRunner().invoke(app, [*sub, "--help"])
        assert res.exit_code == 0, (exp.name, res.output)
        for opt in opts:
            assert opt in res.output, (exp.name, opt)


def test_unknown_experiment_is_refused(paper, capsys):
    assert paper.main(["nope"]) == 2
    assert "unknown experiment(s) nope" in capsys.readouterr().err


def test_refit_batch_recounts_the_h100_rows_and_says_what_is_not_identified(tmp_path):
    """The H100 batch study (B <= 16, 128 cached tokens): the energy roofline fits it with pi0
    near the measured idle power and eps_byte identified; eps_flop is not (every row memory-
    bound), and the paper form's PW_flop has T_flop = 0 in every row."""
    import json
    import shutil
    import subprocess

    kit = tmp_path / "kit"
    kit.mkdir()
    shutil.copy(ROOT / "experiments/results/gpu/nvidia-h100-80gb-hbm3/batch.csv", kit)
    proc = subprocess.run([sys.executable, str(ROOT / "experiments/refit_batch.py"), str(kit)],
                          capture_output=True, text=True, timeout=hang_limit_s(120))
    assert proc.returncode == 0, proc.stderr[-2000:]
    fits = json.loads((kit / "refit.json").read_text())
    roofline = {c["name"]: c for c in fits["all"]["roofline"]["coefficients"]}
    assert 110 < roofline["pi0_w"]["value"] < 135 and roofline["eps_byte_j"]["identified"]
    assert not roofline["eps_flop_j"]["identified"]
    assert "batch sizes 1-512" in roofline["eps_flop_j"]["verdict"]
    flop = fits["all"]["paper"]["coefficients"][1]
    assert flop["verdict"].startswith("not identified: T_flop is 0 in every row")
