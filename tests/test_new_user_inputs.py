"""What a new user met (issue 57, item 3): input that ended in a raw Python, OS or torch error, or
that measured some rows before a later decoder stopped the command. Each is refused with one
line naming the option and the fix, exit 2, before any model loads where the input alone says
so. Each test names the finding it covers."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.results import ResultStore

runner = CliRunner()


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "w3 w4"}\n{"prompt": "w5 w6"}\n')
    return path


@pytest.fixture()
def nothing_loads(monkeypatch):
    """Any model load fails the test: the error must come before it."""
    from mtad_energy.models import pair

    monkeypatch.setattr(pair, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))


def measure(command: str, model_dirs, prompts_file, out, *extra: str, draft: str | None = None):
    """``command`` (profile, compare) on the tiny llama, ``--json``; returns the result."""
    pair = ["--target", model_dirs["llama"], *(["--draft", draft] if draft else [])]
    return runner.invoke(app, [command, *pair, "--device", "cpu", "--meter", "none",
                               "--max-new-tokens", "3", "--dataset", str(prompts_file),
                               "--output", str(out), *extra, "--json"])


def error_of(res) -> str:
    assert res.exit_code == 2, res.output
    return words(json.loads(res.stdout)["error"])


# --- self-drafts that keep no layer or divide by zero ---------------------------------------------


@pytest.mark.parametrize("draft, said", [
    ("self:skip=every0", "'every0' names every 0th layer, which divides by zero: use every K with "
                         "K >= 1"),
    ("self:layers=every0", "divides by zero"),
    ("self:skip=every1", "it keeps no layer of the target's 3: keep at least one"),
    ("self:skip=0-2", "keeps no layer"),
    ("self:layers=2-1", "layer range '2-1' runs backwards: write LOW-HIGH"),
])
def test_a_self_draft_that_cannot_build_a_draft_is_refused_before_loading(
        model_dirs, prompts_file, tmp_path, nothing_loads, draft, said):
    """was: `--draft self:skip=every0` ended in ZeroDivisionError's traceback; every1 loaded the
    target, then said "must keep at least one layer" without naming the option."""
    error = error_of(measure("profile", model_dirs, prompts_file, tmp_path / "o", "--decoder",
                             "spd", draft=draft))
    assert error.startswith(f"--draft '{draft}': ") and said in error, error
    assert not (tmp_path / "o").exists()


def test_every0_is_a_value_error_for_the_library_too(model_dirs):
    from mtad_energy.models import load_pair

    with pytest.raises(ValueError, match="divides by zero"):
        load_pair(target=model_dirs["llama"], draft="self:skip=every0", device="cpu")


# --- raw OS and torch errors ----------------------------------------------------------------------


@pytest.mark.parametrize("variable", ["MTAD_ENERGY_CACHE", "MTAD_ENERGY_CALIBRATION"])
def test_a_cache_variable_naming_a_file_is_refused_before_loading(
        model_dirs, prompts_file, tmp_path, nothing_loads, monkeypatch, variable):
    """was: `[Errno 20] Not a directory: '.../models'` after converting the default model, or a
    calibration record "not readable ... run calibrate again"."""
    a_file = tmp_path / "cache.txt"
    a_file.write_text("not a folder")
    monkeypatch.setenv(variable, str(a_file))
    error = error_of(measure("profile", model_dirs, prompts_file, tmp_path / "o", "--decoder",
                             "ar"))
    assert f"${variable}={a_file} is a file, not a folder: point {variable} at a folder" in error


def test_a_huge_beam_width_is_refused_naming_its_range(model_dirs, prompts_file, tmp_path,
                                                       nothing_loads):
    """was: `--set beam_width=100000` measured ar, then torch's "selected index k out of
    range"."""
    for decoder in ("mtad", "beam", "mtjd"):
        error = error_of(measure("profile", model_dirs, prompts_file, tmp_path / "o", "--decoder",
                                 decoder, "--set", "beam_width=100000",
                                 draft=model_dirs["llama-draft"]))
        assert "beam_width must be in [1, 1024]" in error and "got 100000" in error, error


def test_more_beams_than_the_vocabulary_are_refused_before_any_row(model_dirs, prompts_file,
                                                                   tmp_path):
    """beam_width 65 over the tiny models' 64 tokens: within the bound, but the first step keeps
    the 65 best of 64 tokens. Refused once the pair is known, before ar's rows are measured."""
    error = error_of(measure("compare", model_dirs, prompts_file, tmp_path / "o", "--decoders",
                             "ar,mtad", "--set", "beam_width=65", draft=model_dirs["llama-draft"]))
    assert "mtad: beam_width 65 is more beams than the draft's vocabulary has tokens (64): set " \
           "--set beam_width=64 or less" in error, error
    assert ResultStore(tmp_path / "o").keys("runs") == set()


def test_a_seed_beyond_64_bits_names_the_option_and_its_range(nothing_loads):
    """was: "Overflow when unpacking long long" after the models loaded."""
    for command in (["profile"], ["compare"], ["sweep", "param", "--param", "gamma=1,2"],
                    ["sweep", "batch-size"], ["generate"]):
        res = runner.invoke(app, [*command, "--seed", str(2**70), "--json"])
        assert res.exit_code == 2, res.output
        error = json.loads(res.stdout)["error"]
        assert error.startswith(f"Invalid value for '--seed': give a seed in 0..{2**63 - 1} ") \
            and str(2**70) in error, error


# --- compare with a pair lacking a draft ------------------------------------------------------------


def test_compare_checks_every_decoder_before_measuring_any(model_dirs, prompts_file, tmp_path,
                                                          nothing_loads):
    """was: compare measured ar and pld, then stopped at spd (naming spd alone); mtad and
    eagle would have stopped the re-run in turn."""
    error = error_of(measure("compare", model_dirs, prompts_file, tmp_path / "o", "--decoders",
                             "ar,pld,spd,mtad,eagle"))
    assert "spd, mtad need a draft model and the pair has none: add --draft" in error, error
    assert "eagle drafts with an eagle head the pair lacks: add --draft eagle:DIR" in error
    assert "or run only decoders this pair runs (ar, beam, mtjd, pld); nothing was measured" in error
    assert ResultStore(tmp_path / "o").keys("runs") == set()


def test_the_default_compare_without_a_draft_names_every_drafting_decoder(model_dirs, prompts_file,
                                                                         tmp_path, nothing_loads):
    error = error_of(measure("compare", model_dirs, prompts_file, tmp_path / "o"))
    assert "spd, mtad, mmtad, specinfer, mcss, spectr, bild, typical need a draft model" in error


def test_a_sweep_of_one_drafting_decoder_names_it_once(model_dirs, prompts_file, tmp_path,
                                                     nothing_loads):
    res = runner.invoke(app, ["sweep", "param", "--decoder", "spd", "--param", "gamma=2,3",
                              "--target", model_dirs["llama"], "--device", "cpu", "--meter", "none",
                              "--dataset", str(prompts_file), "--output", str(tmp_path / "o"),
                              "--json"])
    assert error_of(res).startswith("spd needs a draft model and the pair has none")


# --- the run loop: what it was asked for and what it ran --------------------------------------------


def test_n_prompts_beyond_the_dataset_says_how_many_it_has(model_dirs, prompts_file, tmp_path):
    """was: --n-prompts 5 over a file of 2 ran 2, and said nothing."""
    res = measure("profile", model_dirs, prompts_file, tmp_path / "o", "--decoder", "ar",
                  "--baseline", "none", "--n-prompts", "5")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert "--n-prompts 5: p has 2 prompts; all 2 are used" in doc["notes"]  # p.jsonl
    exact = measure("profile", model_dirs, prompts_file, tmp_path / "o", "--decoder", "ar",
                    "--baseline", "none", "--n-prompts", "2")
    assert not any("--n-prompts" in n for n in json.loads(exact.stdout)["notes"])


def test_a_name_swept_twice_or_also_fixed_is_refused(model_dirs, prompts_file, tmp_path,
                                                   nothing_loads):
    """was: --param gamma=1,2 --param gamma=3 swept gamma=3 alone (a dict kept the last)."""
    def sweep(*args):
        return runner.invoke(app, ["sweep", "param", "--decoder", "spd", *args, "--target",
                                   model_dirs["llama"], "--draft", model_dirs["llama-draft"],
                                   "--dataset", str(prompts_file), "--meter", "none",
                                   "--output", str(tmp_path / "o"), "--json"])

    twice = error_of(sweep("--param", "gamma=1,2", "--param", "gamma=3"))
    assert twice.startswith("--param gamma is given twice (gamma=1,2 and gamma=3): the second "
                            "would replace the first"), twice
    both = error_of(sweep("--param", "gamma=1,2", "--set", "gamma=3"))
    assert both.startswith("gamma is given by both --param and --set; keep one"), both
    assert not (tmp_path / "o").exists()


def test_compare_over_workers_checks_every_decoder_before_submitting(model_dirs, prompts_file,
                                                                    tmp_path, nothing_loads):
    """--workers: each job's runner would refuse spd after the other jobs had measured ar."""
    error = error_of(measure("compare", model_dirs, prompts_file, tmp_path / "o", "--decoders",
                             "ar,spd", "--workers", "2", "--cluster", "debug"))
    assert error.startswith("spd needs a draft model and the pair has none"), error
