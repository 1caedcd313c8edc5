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


@pytest.fixture()
def no_loading(monkeypatch):
    """Fails the test if a command loads a model."""
    import mtad_energy.bench.runner as runner_mod
    import mtad_energy.models as models_mod

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(runner_mod, "load_pair", refuse)
    monkeypatch.setattr(models_mod, "load_pair", refuse)


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
