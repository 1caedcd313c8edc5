"""Files derived from a results store (issue 41): where they go (beside the store, never inside
it, never one over another's) and what they carry (the terminal's caveats, strict JSON)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.results import ResultStore, load_results
from tests.results.test_schedule import sweep_rows, write_store

runner = CliRunner()


def compare_args(model_dirs, out) -> list[str]:
    return ["compare", "--decoders", "ar", "--target", model_dirs["llama"], "--meter", "none",
            "--dataset", "mtbench", "--n-prompts", "1", "--max-new-tokens", "2", "--device", "cpu",
            "--output", str(out)]


# -- item 1: compare's markdown side file ----------------------------------------------------------
def test_compares_markdown_is_named_by_the_whole_store_name(model_dirs, tmp_path):
    """`--output st/v.1` and `st/v.2` each get their own `<output>.md` (was: both `st/v.md`)."""
    for name in ("v.1", "v.2"):
        res = runner.invoke(app, compare_args(model_dirs, tmp_path / "st" / name))
        assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "st").glob("*.md")) == ["v.1.md", "v.2.md"]


def test_compare_into_the_current_directory_writes_beside_it(model_dirs, tmp_path, monkeypatch):
    """`--output .` names the table by the directory (was: a crash after the whole run)."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    res = runner.invoke(app, [*compare_args(model_dirs, "."), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["markdown"] == str(tmp_path / "here.md") and (tmp_path / "here.md").is_file()


def test_a_store_named_like_a_markdown_file_gets_one_json_document(model_dirs, tmp_path):
    """`--output st/res.md` (was: the table written over the store, exit 1, two documents)."""
    res = runner.invoke(app, [*compare_args(model_dirs, tmp_path / "res.md"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["markdown"] == str(tmp_path / "res.md.md")
    assert len(load_results(tmp_path / "res.md")) == 1


def test_a_markdown_file_inside_the_store_is_refused_before_measuring(model_dirs, tmp_path):
    out = tmp_path / "st"
    res = runner.invoke(app, [*compare_args(model_dirs, out), "--markdown", str(out / "t.md"),
                              "--json"])
    assert res.exit_code == 2, res.output
    error = json.loads(res.stdout)["error"]
    assert "--markdown" in error and "inside the results store" in error
    assert not out.exists()  # nothing measured, nothing stored


# -- item 3: report . ------------------------------------------------------------------------------
def test_report_of_the_current_directory_goes_beside_it(tmp_path, monkeypatch):
    """`report .` (was: "PosixPath('.') has an empty name")."""
    ResultStore(tmp_path / "st")
    monkeypatch.chdir(tmp_path / "st")
    res = runner.invoke(app, ["report", ".", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["report"] == str(tmp_path / "st-report" / "report.md")
    ResultStore(tmp_path / "st", create=False)  # still a store


# -- item 4: schedule . / --out inside the store ---------------------------------------------------
def test_schedule_never_writes_into_the_store(tmp_path, monkeypatch):
    """`schedule .` inside a store writes `<store>-schedule-speed.json` beside it (was:
    `-schedule-speed.json` inside it, after which every command refused the store);
    `--out STORE/x.json` is refused."""
    store = tmp_path / "sweep"
    write_store(store, sweep_rows())
    res = runner.invoke(app, ["schedule", str(store), "--out", str(store / "x.json"), "--json"])
    assert res.exit_code == 2, res.output
    assert "--out" in json.loads(res.stdout)["error"] and not (store / "x.json").exists()
    monkeypatch.chdir(store)
    res = runner.invoke(app, ["schedule", ".", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["output"] == str(tmp_path / "sweep-schedule-speed.json")
    assert [p.name for p in store.glob("*.json")] == ["mtad-energy-store.json"]  # its marker
    assert len(load_results(store, "decode_batch")) == len(sweep_rows())


@pytest.mark.parametrize("name", [".", "st", "st/v.1", "a/.."])
def test_side_files_are_named_beside_the_store(tmp_path, monkeypatch, name):
    from mtad_energy.results.store_files import beside_store

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    path = beside_store(name, ".md")
    assert path.resolve().parent == (tmp_path / name).resolve().parent
    assert path.name == (tmp_path / name).resolve().name + ".md"


# -- item 9: strict JSON ---------------------------------------------------------------------------
def strict(text: str):
    """Parse as strict JSON (RFC 8259: Node, Go): a bare NaN / Infinity fails the test."""
    def refuse(constant):
        raise AssertionError(f"not strict JSON: bare {constant}")

    return json.loads(text, parse_constant=refuse)


def test_a_budget_without_limit_is_null_with_its_reason(model_dirs, tmp_path):
    """`--budget-s inf --json` (was: "seconds": Infinity)."""
    res = runner.invoke(app, ["profile", "--decoder", "ar", "--baseline", "none", "--target",
                              model_dirs["llama"], "--meter", "none", "--n-prompts", "1",
                              "--max-new-tokens", "2", "--output", str(tmp_path / "p"),
                              "--budget-s", "inf", "--json"])
    assert res.exit_code == 0, res.output
    budget = strict(res.stdout)["budget"]
    assert budget["seconds"] is None and "no limit" in budget["seconds_reason"]


def test_decompose_json_has_no_bare_infinity(tmp_path):
    """Three batch rows for three coefficients: unbounded intervals (was: "ci_high": Infinity)."""
    from mtad_energy.results import stable_key
    from tests.results.test_breakdown import POINTS, _batch_row, roofline_energy

    store = ResultStore(tmp_path / "r")
    for b, (t, _, _, flops, nbytes) in list(POINTS.items())[:3]:
        key = stable_key({"b": b})
        store.write("batch", key, [_batch_row(
            key, batch_size=b, time_s=t, counted_flops=flops, counted_bytes=nbytes,
            energy_j=roofline_energy(t, flops, nbytes) * 1.01 ** b)])
    res = runner.invoke(app, ["decompose", str(tmp_path / "r"), "--json"])
    assert res.exit_code == 0, res.output
    coefficients = strict(res.stdout)["fits"]["roofline"]["coefficients"]
    assert any(c["ci_high"] is None for c in coefficients)
    assert all(c["verdict"] for c in coefficients)  # what the null means is said beside it


def test_every_json_document_is_strict(capsys):
    from mtad_energy.cli.output import emit

    emit({"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": {"d": (2.0, None)}})
    assert strict(capsys.readouterr().out) == {"a": None, "b": [None, None, 1.5], "c": {"d": [2.0, None]}}


# -- items 6 and 7: the terminal's caveats in every artefact ---------------------------------------
def _run(decoder: str, tok_s: float, block: float, *, contended: bool = False,
         draft_id: str | None = None, ppl: float = 2.0) -> dict:
    return {"model": "m", "dataset": "d", "decoder": decoder, "params_json": "{}", "prompt_id": "p",
            "repeat": 0, "tokens_emitted": 8, "decode_time_s": 8 / tok_s, "tokens_per_s": tok_s,
            "block_efficiency": block, "acceptance_rate": 0.5, "perplexity": ppl,
            "energy_j": None, "decode_energy_j": None, "energy_reason": "no meter", "meter": "none",
            "prefill_time_s": 0.01, "contended": contended, "others_cores": 1.5 if contended else 0.0,
            "target_id": "t", "draft_id": draft_id}


def _cells(md: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in md.splitlines()[2:] if line.startswith("|")]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows}


def test_the_markdown_table_carries_the_terminals_marks_and_ranks_none_it_doubts():
    """medusa 3.70x with nothing accepted (`!` in the terminal: was underlined second best in the
    file), spd measured on a busy machine (`*`: was dropped), mtad on random weights (was bold
    for its perplexity)."""
    import pandas as pd

    from mtad_energy.results.analysis import decoder_summary
    from mtad_energy.results.caveats import marked_main_table

    summary = decoder_summary(pd.DataFrame([
        _run("ar", 10.0, 1.0), _run("medusa", 37.0, 1.0), _run("spd", 15.0, 1.8, contended=True),
        _run("mtad", 9.0, 1.5, draft_id="random:tiny-llama-draft", ppl=1.5)]))
    md = marked_main_table(summary)
    cells = _cells(md)  # tokens/s, J/token, perplexity
    assert cells["medusa"][0] == "37.0 !"  # marked, not ranked
    assert cells["spd"][0] == "**15.0**\\*" and cells["ar"][0] == "<u>10.0</u>"
    assert cells["mtad†"] == ["9.0", "n/a", "1.50"]  # the best perplexity, not ranked
    text = " ".join(md.split())
    assert "\\*: 1 of the runs were measured while other processes used the machine" in text
    assert "!: implausible" in text and "†: random weights at real shapes" in text


def test_compare_and_report_on_random_heads_rank_nothing_and_say_why(tmp_path):
    """`--draft medusa:random`: compare's table and the report marked the random heads' row
    best or second (was: no random-weights note in either)."""
    out = tmp_path / "rnd"
    res = runner.invoke(app, ["compare", "--decoders", "ar,medusa", "--target", "random:tiny-llama",
                              "--draft", "medusa:random", "--meter", "none", "--n-prompts", "1",
                              "--max-new-tokens", "3", "--output", str(out), "--json"])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "rnd.md").read_text()
    assert "**" not in md and "<u>" not in md and "random weights at real shapes" in md
    rep = runner.invoke(app, ["report", str(out), "--json"])
    assert rep.exit_code == 0, rep.output
    text = (tmp_path / "rnd-report" / "report.md").read_text()
    assert "**Random weights**" in text
    table = [line for line in text.split("## Main table")[1].split("## Figures")[0].splitlines()
             if line.startswith("|")]
    assert table and not any("**" in line or "<u>" in line for line in table)


def test_generate_says_the_weights_are_random():
    """README: every command gives the random-weights note (generate did not)."""
    from mtad_energy.config import RANDOM_NOTE

    res = runner.invoke(app, ["generate", "--decoder", "ar", "--target", "random:tiny-llama",
                              "--prompt", "w1 w2", "--max-new-tokens", "2", "--device", "cpu",
                              "--json"])
    assert res.exit_code == 0, res.output
    assert RANDOM_NOTE in json.loads(res.stdout)["notes"]


def test_the_schedule_document_carries_contention_random_weights_and_extrapolation(tmp_path):
    """A schedule built from contended, random-weight rows measured at B = 1 only, written for
    up to B = 64 (was: one range 1-64 and no caveat)."""
    rows = [r for r in sweep_rows() if r["batch_size"] == 1]
    for r in rows:
        r.update(contended=True, target_id="random:tiny-llama", model="random:tiny-llama")
    write_store(tmp_path / "s", rows)
    res = runner.invoke(app, ["schedule", str(tmp_path / "s"), "--max-batch-size", "64", "--json"])
    assert res.exit_code == 0, res.output
    written = json.loads((tmp_path / "s-schedule-speed.json").read_text())
    notes = " ".join(written["notes"])
    assert "batch size(s) 2-64 not measured (measured: 1)" in notes
    assert f"{len(rows)} of the {len(rows)} rows behind it were measured while other" in notes
    assert "random weights at real shapes" in notes
    assert written["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 64, 5]]


def test_the_kits_csvs_count_the_contended_rows(tmp_path):
    """decoders.csv / batched.csv summarise stored rows; a contended row is counted in its cell
    (was: dropped, so a busy machine's figures read as the decoder's)."""
    import importlib.util
    import sys
    from pathlib import Path

    import pandas as pd

    path = Path(__file__).resolve().parents[2] / "experiments/gpu/tables.py"
    spec = importlib.util.spec_from_file_location("gpu_kit_tables_41", path)
    kit = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = kit
    spec.loader.exec_module(kit)
    rows = pd.DataFrame([{"decoder": d, "model": "random:tiny-llama", "iterations": 4,
                          "decode_time_s": 0.4, "target_forwards": 4, "draft_forwards": 0,
                          "time_draft_s": 0.0, "time_target_s": 0.3, "time_other_s": 0.1,
                          "decode_energy_j": None, "block_efficiency": 1.0, "contended": busy}
                         for d, busy in (("ar", False), ("ar", True), ("spd", False))])
    summary = kit.summarise(kit.per_iteration(rows, "decode_energy_j"), {"ar": 1.0, "spd": 2.0},
                            ["decoder", "mode"]).set_index("decoder")
    assert summary["n_contended"].to_dict() == {"ar": 1, "spd": 0}
    out = kit.Out(tmp_path)
    out.table("decoders", summary.reset_index(), "decoders")
    assert "1 row(s) measured on a busy machine" in (tmp_path / "run.log").read_text()
    assert pd.read_csv(tmp_path / "decoders.csv")["n_contended"].tolist() == [1, 0]


# -- item 5: the forward-only batch-size study records and flags contention ------------------------
def test_the_forward_only_sweep_records_flags_and_warns_of_a_busy_machine(model_dirs, tmp_path,
                                                                          monkeypatch):
    """`sweep batch-size` without --decoder (was: no contention columns, no warning, no mark; at
    load 5, B = 4 looked cheaper per run than B = 1, unflagged)."""
    from mtad_energy.measure.contention import Contention, ContentionProbe

    busy = Contention(wall_s=1.0, others_cpu_s=1.5, resolution_cpu_s=0.03, cpus=2)
    monkeypatch.setattr(ContentionProbe, "end", lambda self, key: busy)
    args = ["sweep", "batch-size", "--target", model_dirs["llama"], "--sizes", "1,2", "--runs", "1",
            "--context-len", "8", "--forwards-per-run", "1", "--meter", "none", "--no-ops",
            "--output", str(tmp_path / "bs")]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["machine_load"]["contended"] and "the machine is busy" in doc["machine_load"]["warning"]
    assert [r["contended"] for r in doc["rows"]] == [True, True]
    assert "2 of the batch-sweep points were measured while other processes" in doc["notes"][0]
    stored = load_results(tmp_path / "bs", "batch")
    assert stored["contended"].all() and (stored["others_cores"] == 1.5).all()
    text = " ".join(runner.invoke(app, args).output.split())  # resumed: the stored rows' flags
    assert "warning: the machine is busy" in text and "1* " in text and "2* " in text


# -- item 2: an EAGLE head on a target outside the Llama family ------------------------------------
def test_an_eagle_head_on_an_opt_target_is_refused_before_anything_loads(monkeypatch):
    """`--target random:tiny-opt --draft eagle:random-v1` (was: AttributeError: 'OPTConfig' object
    has no attribute 'intermediate_size', with a traceback, after loading the target)."""
    from mtad_energy.models import pair

    monkeypatch.setattr(pair, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    res = runner.invoke(app, ["compare", "--decoders", "ar,eagle", "--target", "random:tiny-opt",
                              "--draft", "eagle:random-v1", "--meter", "none", "--n-prompts", "1",
                              "--max-new-tokens", "2", "--json"])
    assert res.exit_code == 2, res.output
    error = json.loads(res.stdout)["error"]
    assert "EAGLE heads are for Llama-family targets" in error and "model_type='opt'" in error
