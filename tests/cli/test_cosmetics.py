"""The command line's small things (issue 41, "Cosmetic"): what it prints where nothing needs
loading, and output that reads whole at 80 columns."""

from __future__ import annotations

import json
import warnings

import pytest
import typer
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.cli.output import json_command

runner = CliRunner()


@pytest.fixture()
def nothing_loads(monkeypatch):
    from mtad_energy.models import pair

    monkeypatch.setattr(pair, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))


def test_version():
    from importlib.metadata import version

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output == f"mtad-energy {version('mtad-energy')}\n"


@pytest.mark.parametrize("command", [["profile", "--decoder", "ar", "--baseline", "none"],
                                     ["sweep", "batch-size", "--sizes", "1,2"],
                                     ["sweep", "batch-size", "--decoder", "ar", "--sizes", "1,2"]])
def test_a_budget_of_0_loads_nothing(nothing_loads, tmp_path, command):
    """was: the model loaded, then two empty tables."""
    out = tmp_path / "o"
    res = runner.invoke(app, [*command, "--target", "random:tiny-llama", "--meter", "none",
                              "--budget-s", "0", "--output", str(out), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["budget"] == {"seconds": 0.0, "spent": True, "left": 3 if "profile" in command else 2}
    assert not out.exists()
    text = runner.invoke(app, [*command, "--target", "random:tiny-llama", "--meter", "none",
                               "--budget-s", "0", "--output", str(out)]).output
    assert "┃" not in text and "--budget-s 0 s spent" in " ".join(text.split())


def test_a_budget_of_nan_says_what_to_give():
    res = runner.invoke(app, ["profile", "--budget-s", "nan", "--json"])
    assert res.exit_code == 2
    assert "give a number of seconds >= 0 (inf: no limit), not nan" in json.loads(res.stdout)["error"]


def test_hub_ids_are_never_folded_at_80_columns():
    from mtad_energy.models.pair import ALIASES

    res = runner.invoke(app, ["models"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    words = {w.rstrip(";") for w in res.output.split()}
    ids = {i for s in ALIASES.values() for i in (s.target, s.draft, s.eagle, s.medusa)
           if i and "/" in i}
    assert len(ids) > 10 and ids <= words, ids - words  # was: meta-llama/Llama-3.1-8B-Inst|ruct


def test_target_and_draft_help_name_the_random_and_head_specs():
    res = runner.invoke(app, ["profile", "--help"], env={"COLUMNS": "200"})
    text = " ".join(res.output.split())
    assert "random:SHAPE" in text and "eagle:DIR|random|random-v1" in text and \
        "medusa:DIR|random" in text


def test_generate_takes_the_compile_backend_and_checks_it_before_loading(nothing_loads):
    res = runner.invoke(app, ["generate", "--decoder", "ar", "--target", "random:tiny-llama",
                              "--compile", "--compile-backend", "nosuch", "--json"])
    assert res.exit_code == 2
    assert "--compile-backend 'nosuch' is not a torch.compile backend" in json.loads(res.stdout)[
        "error"]


def test_a_python_warning_prints_as_one_line():
    """The int8 draft's compile warning printed as a raw UserWarning with its source line."""
    sub = typer.Typer()

    @sub.command()
    @json_command
    def warn(as_json: bool = False):
        warnings.warn("compile (draft): int8 layers run eager", stacklevel=2)

    res = runner.invoke(sub, [])
    assert res.exit_code == 0, res.output
    assert res.output == "warning: compile (draft): int8 layers run eager\n"


def test_the_printed_schedule_keeps_every_range_on_one_line(tmp_path):
    from tests.results.test_schedule import sweep_rows, write_store

    write_store(tmp_path / "s", sweep_rows())
    res = runner.invoke(app, ["schedule", str(tmp_path / "s")], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    printed = res.output.split("add the drafting method):")[1]
    lines = [line.strip().rstrip(",") for line in printed.splitlines()]
    assert "[1, 1, 5]" in lines and "[2, 7, 3]" in lines  # whole, each on its own line
    assert json.loads(printed)["num_speculative_tokens_per_batch_size"][:2] == [[1, 1, 5], [2, 7, 3]]


def test_a_size_listed_twice_counts_once():
    """`--sizes 1,1,2` left the progress bar at 2/3."""
    from mtad_energy.cli.options import parse_sizes

    assert parse_sizes("1,1,2") == [1, 2]


def test_a_size_that_cannot_fit_is_skipped_before_its_rows_are_hashed(tmp_path, llama_pair,
                                                                      monkeypatch):
    """`--sizes 1,10000000` took 157 s (the rows' keys of every decoder and repeat) before
    saying the size cannot fit."""
    from mtad_energy.bench import decode_batch
    from mtad_energy.config import DecoderSpec
    from mtad_energy.decoding.runtime import memory
    from mtad_energy.measure.none import NoneMeter
    from mtad_energy.results import ResultStore

    hashed, skipped = [], []
    real = decode_batch.stable_key
    monkeypatch.setattr(decode_batch, "stable_key",
                        lambda identity: hashed.append(len(identity.get("ids", ()))) or real(identity))
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 1 << 30)
    decode_batch.decode_batch_sweep(
        llama_pair, [DecoderSpec("ar")], [1, 10_000_000], [[5, 9, 4]], ResultStore(tmp_path / "s"),
        NoneMeter(), max_new_tokens=2, on_skip=lambda label, b, why: skipped.append((label, b)))
    assert skipped == [("ar", 10_000_000)] and max(hashed) == 1


def test_an_engine_option_error_gives_an_example_of_the_engines_given(nothing_loads):
    res = runner.invoke(app, ["profile", "--engine", "llamacpp", "--engine-option", "n_ctx",
                              "--json"])
    assert res.exit_code == 2
    error = json.loads(res.stdout)["error"]
    assert "e.g. llamacpp: n_threads=" in error and "enforce_eager" not in error
