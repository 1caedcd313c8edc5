"""What the command line prints: with --json exactly one JSON document on stdout (errors included),
and user text with square brackets printed as text, never parsed as rich markup."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.results import load_results

runner = CliRunner()


def pair_args(model_dirs):
    return ["--target", model_dirs["llama"], "--draft", model_dirs["llama-draft"], "--meter", "none",
            "--max-new-tokens", "3"]


def prompts(tmp_path, ids=("t0", "t1")):
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"w{3 + n} w9 w4"}) + "\n"
                            for n, i in enumerate(ids)))
    return str(path)


def only_json(res) -> dict:
    """stdout must parse as one JSON document, with nothing before or after it."""
    return json.loads(res.stdout)


def test_json_success_is_the_only_thing_on_stdout(model_dirs, tmp_path):
    data = prompts(tmp_path)
    res = runner.invoke(app, ["profile", "--decoder", "ar", *pair_args(model_dirs), "--dataset", data,
                              "--n-prompts", "2", "--output", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 0, res.output
    assert only_json(res)["ran"] == 2
    assert "profile" in res.stderr  # the progress bar went to stderr
    res = runner.invoke(app, ["compare", "--decoders", "ar,spd", *pair_args(model_dirs), "--dataset", data,
                              "--n-prompts", "1", "--output", str(tmp_path / "c"), "--json"])
    assert res.exit_code == 0, res.output
    assert {r["decoder"] for r in only_json(res)["summary"]} == {"ar", "spd"}
    res = runner.invoke(app, ["sweep", "batch-size", "--target", model_dirs["llama"], "--sizes", "1",
                              "--runs", "1", "--context-len", "4", "--forwards-per-run", "1",
                              "--meter", "none", "--output", str(tmp_path / "b"), "--json"])
    assert res.exit_code == 0, res.output
    assert [r["Batch Size"] for r in only_json(res)["rows"]] == [1]
    res = runner.invoke(app, ["profile", "--decoder", "ar,spd", *pair_args(model_dirs), "--dataset", data,
                              "--n-prompts", "1", "--workers", "2", "--cluster", "debug",
                              "--output", str(tmp_path / "d"), "--json"])
    assert res.exit_code == 0, res.output
    assert len(only_json(res)["jobs"]) == 2  # the shards' progress lines went to stderr


def test_json_errors_are_one_document_with_the_exit_code(model_dirs, tmp_path):
    res = runner.invoke(app, ["profile", "--decoder", "nope", "--output", str(tmp_path / "x"), "--json"])
    assert res.exit_code == 2
    assert only_json(res) == {"error": only_json(res)["error"], "exit_code": 2}
    assert "unknown decoder nope" in only_json(res)["error"]
    res = runner.invoke(app, ["sweep", "batch-size", "--target", str(tmp_path / "no-model"), "--sizes",
                              "1", "--meter", "none", "--output", str(tmp_path / "b"), "--json"])
    assert res.exit_code == 2 and only_json(res)["exit_code"] == 2
    # click's own usage errors too (checked before the command runs)
    res = runner.invoke(app, ["profile", "--n-prompts", "0", "--json"])
    assert res.exit_code == 2 and "n-prompts" in only_json(res)["error"]
    res = runner.invoke(app, ["generate", "--decoder", "nope", "--json"])
    assert res.exit_code == 2 and "nope" in only_json(res)["error"]


def test_square_brackets_in_user_text_print_as_text(model_dirs, tmp_path):
    out = tmp_path / "run[/2]"
    data = prompts(tmp_path, ids=("[/x]", "[bold]y"))
    args = ["profile", "--decoder", "ar", *pair_args(model_dirs), "--dataset", data, "--n-prompts", "2",
            "--output", str(out)]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "run[/2]" in first.output.replace("\n", "")
    assert sorted(load_results(out)["prompt_id"]) == ["[/x]", "[bold]y"]
    again = runner.invoke(app, args)  # the stored rows' ids are printed too
    assert again.exit_code == 0, again.output
    assert "0 run(s) measured, 2 already stored" in again.output
    # an error message naming a bracketed path
    res = runner.invoke(app, ["profile", "--decoder", "ar", *pair_args(model_dirs), "--dataset",
                              str(tmp_path / "no[/such].jsonl"), "--output", str(tmp_path / "e")])
    assert res.exit_code == 2 and "no[/such].jsonl" in res.output.replace("\n", ""), res.output
