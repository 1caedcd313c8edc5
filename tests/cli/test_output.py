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


# -- what a new user meets first -------------------------------------------------------------------
def _lines_fit(text: str, width: int = 80) -> None:
    assert "…" not in text, text  # wrapped, never cut
    assert all(len(line) <= width for line in text.splitlines()), text


def test_tables_and_help_wrap_at_80_columns_instead_of_cutting(model_dirs, tmp_path):
    from mtad_energy.cli import app as the_app
    from mtad_energy.cli.output import console

    assert console.width == 80  # as when piped to a file
    for args in (["models"], ["decoders"], ["--help"], ["profile", "--help"],
                 ["sweep", "batch-size", "--help"], ["sweep", "--help"]):
        res = runner.invoke(the_app, args)
        assert res.exit_code == 0, res.output
        _lines_fit(res.output)
    assert "--allow-code-execution" in runner.invoke(the_app, ["profile", "--help"]).output
    res = runner.invoke(the_app, ["profile", "--decoder", "ar,spd", *pair_args(model_dirs), "--dataset",
                                  prompts(tmp_path), "--n-prompts", "2", "--output", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    _lines_fit(res.output)
    assert "speed-" in res.output and "ppl" in res.output


def test_wrapping_keeps_numbers_whole():
    from mtad_energy.cli.output import column_widths

    texts = [["decoder", "spd(gamma=6)"], ["perplexity", "54.231"], ["speed-up", "1.25x"],
             ["accepted/depth", "0.50"], ["a long note that can wrap", "x y z"]]
    natural = [max(map(len, col)) for col in texts]
    assert column_widths(texts, 100) == natural  # room for everything: nothing wraps
    for room in (45, 36):  # the long note wraps first; then headers fold, numbers never do
        widths = column_widths(texts, room)
        assert sum(widths) <= room, (room, widths)
        assert widths[0] >= len("spd(gamma=6)") and widths[1] >= len("54.231")
        assert widths[2] >= len("1.25x") and widths[3] >= len("0.50")
    assert column_widths(texts, 45)[1] >= len("perplexity")


def test_every_command_takes_json(model_dirs, tmp_path):
    res = runner.invoke(app, ["models", "--json"])
    assert res.exit_code == 0 and only_json(res)["smollm2"]["draft"] == "self:int8"
    runner.invoke(app, ["profile", "--decoder", "ar", *pair_args(model_dirs), "--dataset",
                        prompts(tmp_path), "--n-prompts", "1", "--output", str(tmp_path / "p")])
    res = runner.invoke(app, ["report", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 0, res.output
    doc = only_json(res)
    assert doc["report"] == str(tmp_path / "p-report" / "report.md") and doc["figures"]
    res = runner.invoke(app, ["report", str(tmp_path / "nothing"), "--json"])
    assert res.exit_code == 2 and "does not exist" in only_json(res)["error"]
    # every command of the app, and of its groups (`sweep`, `store`), has --json
    from typer.main import get_command

    def leaves(command) -> list:
        if hasattr(command, "commands"):  # a group (typer's own click, or click's)
            return [leaf for sub in command.commands.values() for leaf in leaves(sub)]
        return [command]

    commands = leaves(get_command(app))
    assert {"sweep", "store"} <= {c.name for c in get_command(app).commands.values()}
    assert {"batch-size", "param", "compact", "calibrate"} <= {c.name for c in commands}
    for command in commands:
        assert "--json" in [o for p in command.params for o in p.opts], command.name


def test_generate_with_a_target_of_ones_own_is_not_the_default_pair(model_dirs):
    args = ["generate", "--decoder", "spd", "--target", model_dirs["llama"], "--draft",
            model_dirs["llama-draft"], "--device", "cpu", "--max-new-tokens", "3", "--prompt", "w3 w4"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "spd on custom (" in res.output and "smollm2" not in res.output
    assert only_json(runner.invoke(app, [*args, "--json"]))["pair"]["pair"] == "custom"


def test_profile_batches_hold_batch_size_rows_or_are_refused(model_dirs, tmp_path):
    common = ["profile", "--decoder", "ar", *pair_args(model_dirs), "--dataset", prompts(tmp_path, ids=(
        "a", "b", "c")), "--device", "cpu"]
    res = runner.invoke(app, [*common, "--batch-size", "64", "--n-prompts", "2", "--output",
                              str(tmp_path / "big"), "--json"])
    assert res.exit_code == 2
    assert "--batch-size 64 is more than the 2 prompt(s)" in only_json(res)["error"]
    assert not (tmp_path / "big").exists()
    # 3 prompts in batches of 2: the last batch is completed with another prompt (not stored)
    res = runner.invoke(app, [*common, "--batch-size", "2", "--n-prompts", "3", "--output",
                              str(tmp_path / "b2")])
    assert res.exit_code == 0, res.output
    assert "profile · custom+batch2 (2 prompts decoded together)" in res.output
    rows = load_results(tmp_path / "b2")
    assert sorted(rows.prompt_id) == ["a", "b", "c"]
    assert (rows.batch_size == 2).all() and (rows.model == "custom+batch2").all()
    last = rows[rows.prompt_id == "c"].iloc[0]
    assert 0 < last.energy_share < 1  # its share of a two-row batch


def test_json_counts_are_integers_not_floats(model_dirs, tmp_path):
    """Counts stay ints in --json (issue 27 item 9: `max_new_tokens: 8.0`): pandas makes a count
    column float as soon as one row lacks it; the JSON output turns it back."""
    res = runner.invoke(app, ["compare", "--decoders", "ar,spd", *pair_args(model_dirs),
                              "--dataset", prompts(tmp_path), "--n-prompts", "2",
                              "--output", str(tmp_path / "c"), "--json"])
    assert res.exit_code == 0, res.output
    rows = only_json(res)["summary"]
    for row in rows:
        for name in ("n_runs", "total_tokens", "graphs_compiled"):
            assert type(row[name]) is int, (name, row[name])
    assert '"total_tokens": 6,' in res.stdout  # 2 prompts x 3 tokens, printed as an integer


def test_integer_records_keep_fractions_and_missing_values():
    import pandas as pd

    from mtad_energy.cli.output import integer_records
    frame = pd.DataFrame({"max_new_tokens": [8, None], "Batch Size": [2.0, 3.0],
                          "tokens_per_s": [10.0, 2.5], "tokens": [1.5, 2.0],
                          "crossover_batch_size": [4.0, None]})
    assert integer_records(frame) == [
        {"max_new_tokens": 8, "Batch Size": 2, "tokens_per_s": 10.0, "tokens": 1.5,
         "crossover_batch_size": 4},
        {"max_new_tokens": None, "Batch Size": 3, "tokens_per_s": 2.5, "tokens": 2,
         "crossover_batch_size": None}]
    first = integer_records(frame)[0]
    assert {type(first[k]) for k in ("max_new_tokens", "Batch Size", "crossover_batch_size")} == {int}
    assert type(first["tokens_per_s"]) is float


def test_decompose_tables_never_cut_a_decoder_name():
    """The attribution tables at 80 columns keep every word of a long label whole (they wrap
    between words or stack, as every other table does)."""
    import io

    import pandas as pd
    from rich.console import Console

    from mtad_energy.cli.tables import attribution_tables

    label = "mmtad+smollm2-135m-int8-selfdraft [cpu, hf]"
    row = dict(source="runs", label=label, batch_size=1, draft_j_per_token=0.1,
               target_j_per_token=0.2, other_j_per_token=0.01, scale=1.0, static_j_per_token=0.1,
               flop_j_per_token=0.2, mem_j_per_token=0.3, j_per_accepted_draft_token=0.05,
               rejected_share=0.1, reason="no meter")
    con = Console(width=80, record=True, file=io.StringIO())
    for table in attribution_tables(pd.DataFrame([row])):
        con.print(table)
    text = con.export_text()
    _lines_fit(text)
    for table_text in text.split("decode J/token by ")[1:]:
        assert "mmtad+smollm2-135m-int8-selfdraft" in table_text, text
