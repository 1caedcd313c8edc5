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
