"""experiments/paper.py: every paper table/figure has a spec whose command the CLI accepts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app

PAPER = Path(__file__).resolve().parents[1] / "experiments" / "paper.py"


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
