"""Bad input through the CLI: a clear message naming the problem and the fix, exit code 2, nothing
stored lost, and refusals that happen before any model is loaded (issue 10, C3, C7, C8)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from mtad_energy.bench import prompts as prompts_mod
from mtad_energy.cli import app

runner = CliRunner()


def flat(text: str) -> str:
    """CLI output with rich's line wrapping undone (paths may be folded mid-word)."""
    return text.replace("\n", "")


def words(text: str) -> str:
    return " ".join(text.split())


def pair_args(model_dirs):
    return ["--target", model_dirs["llama"], "--draft", model_dirs["llama-draft"], "--meter", "none",
            "--max-new-tokens", "3"]


def profile(model_dirs, dataset, out, *extra):
    return runner.invoke(app, ["profile", "--decoder", "ar", *pair_args(model_dirs), "--dataset",
                               str(dataset), "--n-prompts", "3", "--output", str(out), *extra])


# --- prompt files (C7, C8) -----------------------------------------------------------------------


def test_invalid_utf8_in_a_prompt_file_names_file_line_and_fix(model_dirs, tmp_path, no_loading):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    res = profile(model_dirs, path, tmp_path / "out")
    assert res.exit_code == 2, res.output
    assert "latin.jsonl:2" in flat(res.output) and "not valid UTF-8" in words(res.output)
    assert "Traceback" not in res.output


def test_a_jsonl_file_holding_one_json_array_is_refused_clearly(model_dirs, tmp_path, no_loading):
    path = tmp_path / "array.jsonl"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]) + "\n")
    res = profile(model_dirs, path, tmp_path / "out")
    assert res.exit_code == 2, res.output
    assert "array.jsonl:1" in flat(res.output)
    assert "got an array" in words(res.output) and "one object per line" in words(res.output)


def test_an_empty_jsonl_is_refused_before_loading_the_model(model_dirs, tmp_path, no_loading):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    res = profile(model_dirs, path, tmp_path / "out")
    assert res.exit_code == 2, res.output
    assert "holds no prompts" in words(res.output)


def test_an_empty_prompt_is_called_empty_not_missing(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text('{"prompt": "fine"}\n{"id": "q2", "prompt": ""}\n')
    with pytest.raises(ValueError) as e:
        prompts_mod.jsonl(path)
    assert f"{path}:2: field 'prompt' is empty" in str(e.value)
    assert "no 'prompt'" not in str(e.value)


def test_malformed_jsonl_names_the_file_and_line(model_dirs, tmp_path, no_loading):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",}\n')
    res = profile(model_dirs, path, tmp_path / "out")
    assert res.exit_code == 2, res.output
    assert "broken.jsonl:3: invalid JSON" in flat(res.output)


# --- models and devices (C7, C8) -------------------------------------------------------------------


def test_a_truncated_safetensors_file_is_named_with_the_fix(model_dirs, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(model_dirs["llama"], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    res = runner.invoke(app, ["profile", "--decoder", "ar", "--target", str(bad), "--meter", "none",
                              "--dataset", "mtbench", "--n-prompts", "1", "--output", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert "truncated or damaged" in words(res.output) and "again" in words(res.output)
    assert "Traceback" not in res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_device_cuda_without_cuda_says_so(model_dirs, tmp_path):
    res = runner.invoke(app, ["profile", "--decoder", "ar", *pair_args(model_dirs), "--device", "cuda",
                              "--dataset", "mtbench", "--n-prompts", "1", "--output", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert "CUDA is not available" in words(res.output) and "--device cpu" in words(res.output)


def test_a_missing_target_directory_is_called_missing(tmp_path):
    res = runner.invoke(app, ["profile", "--decoder", "ar", "--target", "/no/such/dir", "--meter", "none",
                              "--dataset", "mtbench", "--n-prompts", "1", "--output", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert "/no/such/dir does not exist" in words(res.output)
    assert "hf download" not in res.output


# --- the results store (C7, C8) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored(model_dirs, tmp_path_factory):
    """A store holding two finished runs, and the command that made it (copy it before changing)."""
    root = tmp_path_factory.mktemp("stored")
    prompts = root / "toy.jsonl"
    prompts.write_text('{"id": "a", "prompt": "w3 w4 w5"}\n{"id": "b", "prompt": "w6 w7"}\n')
    out = root / "store"
    args = ["profile", "--decoder", "ar", *pair_args(model_dirs), "--dataset", str(prompts),
            "--n-prompts", "2", "--output", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return out, args


def copy_store(stored, tmp_path):
    out, args = stored
    mine = tmp_path / "store"
    shutil.copytree(out, mine)
    return mine, [a if a != str(out) else str(mine) for a in args]


def test_a_foreign_parquet_file_with_a_valid_name_is_not_loaded_as_a_row(stored, tmp_path):
    import pandas as pd

    from mtad_energy.results import load_results
    from mtad_energy.results.store import ForeignFileError

    store, _ = copy_store(stored, tmp_path)
    foreign = store / "runs" / "0123456789abcdef.parquet"
    pd.DataFrame({"decoder": ["ar"], "tokens_per_s": [1e9]}).to_parquet(foreign)
    with pytest.raises(ForeignFileError) as e:
        load_results(store)
    assert str(foreign) in str(e.value) and "not written by mtad-energy" in str(e.value)
    res = runner.invoke(app, ["report", str(store), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 2 and "0123456789abcdef.parquet" in flat(res.output)


def test_the_advice_for_a_truncated_steps_part_brings_its_steps_back(stored, tmp_path, monkeypatch):
    import mtad_energy.cli.run
    from mtad_energy.results import load_results
    from mtad_energy.results.store import CorruptFileError

    # part files, as a command killed before its final compaction leaves them
    _, args = stored
    store = tmp_path / "store"
    args = [a if a != str(stored[0]) else str(store) for a in args]
    monkeypatch.setattr(mtad_energy.cli.run, "compact_after", lambda out: None)
    assert runner.invoke(app, args).exit_code == 0
    monkeypatch.undo()
    steps = sorted((store / "steps").glob("*.parquet"))[0]
    steps.write_bytes(steps.read_bytes()[:20])
    with pytest.raises(CorruptFileError) as e:
        load_results(store, "steps")
    message = str(e.value)
    run_row = store / "runs" / steps.name
    assert str(steps) in message and str(run_row) in message
    steps.unlink()  # follow the advice
    run_row.unlink()
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "1 run(s) measured, 1 already stored" in words(res.output)
    assert set(load_results(store, "steps")["run_key"]) == set(load_results(store)["run_key"])
    assert len(load_results(store)) == 2


def test_a_full_disk_says_so_keeps_every_row_and_resumes(stored, tmp_path, monkeypatch):
    import errno

    import pandas as pd

    from mtad_energy.results import load_results

    store, args = copy_store(stored, tmp_path)
    # a third prompt: its first write (the steps part) hits a full disk
    prompts = tmp_path / "toy.jsonl"  # the same dataset name: the first two rows are stored
    prompts.write_text('{"id": "a", "prompt": "w3 w4 w5"}\n{"id": "b", "prompt": "w6 w7"}\n'
                       '{"id": "c", "prompt": "w8 w9"}\n')
    args = [str(prompts) if a.endswith("toy.jsonl") else a for a in args]
    args[args.index("--n-prompts") + 1] = "3"
    real = pd.DataFrame.to_parquet

    def full(self, path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(pd.DataFrame, "to_parquet", full)
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "disk full" in words(res.output) and "re-run the same command" in words(res.output)
    assert "Traceback" not in res.output
    assert len(load_results(store)) == 2  # nothing stored was lost
    assert not [p for p in store.rglob(".tmp-*")]
    monkeypatch.setattr(pd.DataFrame, "to_parquet", real)
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "1 run(s) measured, 2 already stored" in words(again.output)


def test_report_on_a_file_says_it_is_a_file(tmp_path):
    path = tmp_path / "results.parquet"
    path.write_text("x")
    res = runner.invoke(app, ["report", str(path)])
    assert res.exit_code == 2, res.output
    assert "is a file, not a results directory" in words(res.output)
    assert not (tmp_path / "results.parquet-report").exists()


# --- parameters and ranges (C8) ----------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [("nan", "temperature must be a number, got nan"),
                                            ("inf", "temperature must be a finite number >= 0"),
                                            ("-inf", "temperature must be a finite number >= 0")])
def test_a_non_finite_temperature_is_refused_before_loading(model_dirs, tmp_path, no_loading, value,
                                                            message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w3 w4"}\n')
    res = profile(model_dirs, prompts, tmp_path / "out", "--set", f"temperature={value}")
    assert res.exit_code == 2, res.output
    assert message in words(res.output)


def test_a_huge_param_range_is_refused_before_anything_runs(model_dirs, tmp_path, no_loading):
    res = runner.invoke(app, ["sweep", "param", "--decoder", "spd", "--param", "gamma=1..100000000",
                              *pair_args(model_dirs), "--dataset", "mtbench",
                              "--output", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert "100000000 values, more than the 1000" in words(res.output)
    grid = runner.invoke(app, ["sweep", "param", "--decoder", "mtad", "--param", "gamma=1..100",
                               "--param", "beam_width=1..100", *pair_args(model_dirs), "--dataset", "mtbench",
                               "--output", str(tmp_path / "o")])
    assert grid.exit_code == 2, grid.output
    assert "100 x 100 = 10000 configurations" in words(grid.output)


def test_batch_size_beyond_the_models_positions_is_a_clear_error(model_dirs, tmp_path):
    res = runner.invoke(app, ["sweep", "batch-size", "--target", model_dirs["llama"], "--sizes", "1",
                              "--runs", "1", "--context-len", "9000", "--meter", "none",
                              "--output", str(tmp_path / "bs")])
    assert res.exit_code == 2, res.output
    assert "exceeds the model's" in words(res.output) and "--context-len" in words(res.output)
    assert "Traceback" not in res.output


# --- HumanEval pass@1 (C3) ---------------------------------------------------------------------------


def test_the_summary_says_when_pass_at_1_was_not_computed_and_how_to_get_it(model_dirs, tmp_path,
                                                                             monkeypatch):
    import mtad_energy.bench.runner as runner_mod
    from mtad_energy.bench.prompts import Prompt

    monkeypatch.setattr(runner_mod, "load_config_prompts",
                        lambda config: [Prompt("HumanEval/0", "w3 w4 w5", "humaneval", "w3")])
    args = ["profile", "--decoder", "ar", *pair_args(model_dirs), "--dataset", "humaneval",
            "--n-prompts", "1", "--output", str(tmp_path / "he")]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    said = words(first.output)
    assert "pass@1 not computed for 1 HumanEval row(s)" in said and "--allow-code-execution" in said
    again = runner.invoke(app, args + ["--allow-code-execution", "--json"])
    assert again.exit_code == 0, again.output
    notes = json.loads(again.stdout)["notes"]
    assert len(notes) == 1 and "pass@1 missing for 1 of 1 HumanEval row(s)" in notes[0]
    assert "new --output" in notes[0]


# --- an over-long prompt (C8) ------------------------------------------------------------------------


def test_an_over_long_prompt_is_refused_before_any_row_runs_naming_it(model_dirs, tmp_path):
    from mtad_energy.results import load_results

    path = tmp_path / "long.jsonl"
    long_text = " ".join(f"w{3 + i % 50}" for i in range(400))  # the tiny Llama has 256 positions
    path.write_text("\n".join(json.dumps(r) for r in [{"id": "short", "prompt": "w3 w4"},
                                                       {"id": "huge", "prompt": long_text},
                                                       {"id": "fits", "prompt": "w5 w6"}]) + "\n")
    out = tmp_path / "out"
    res = profile(model_dirs, path, out)
    assert res.exit_code == 2, res.output
    said = words(res.output)
    assert "1 prompt(s) do not fit the target's context of 256 tokens" in said
    assert "huge (" in said and "nothing was run" in said and "leave these prompts out" in said
    assert len(load_results(out)) == 0  # refused up front: no row ran before it
    # one that fits without the new tokens: the fix names the largest --max-new-tokens that works
    path.write_text(json.dumps({"id": "near", "prompt": " ".join(["w3"] * 254)}) + "\n")
    near = profile(model_dirs, path, out)
    assert near.exit_code == 2, near.output
    assert "lower --max-new-tokens to at most" in words(near.output)


STORE_READERS = (["report", "{store}", "--out", "{tmp}/rep"], ["decompose", "{store}"],
                 ["schedule", "{store}"], ["store", "compact", "{store}"])


@pytest.mark.parametrize("state", ["missing", "empty"])
@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.parametrize("command", STORE_READERS, ids=lambda c: " ".join(c[:2]).split(" {")[0])
def test_a_missing_or_empty_store_is_bad_input_for_every_reader(tmp_path, command, state, as_json,
                                                                wide_console):
    """Exit code 2 everywhere (issue 27 item 9: `schedule` exited 1 with a traceback), naming the
    directory; with --json as the one error document."""
    store = tmp_path / "store"
    if state == "empty":
        store.mkdir()
    args = [a.format(store=store, tmp=tmp_path) for a in command] + (["--json"] if as_json else [])
    res = runner.invoke(app, args)
    assert res.exit_code == 2, (args, res.output)
    assert "Traceback" not in res.output
    said = json.loads(res.stdout)["error"] if as_json else flat(res.output)
    assert str(store) in said and ("does not exist" if state == "missing" else "is empty") in said
