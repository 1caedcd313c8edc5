"""Where commands may write around a results store (issue 57, item 3): never inside a store (an
--output inside another store, a report --out into one), refused before anything loads or is
written; stores poisoned that way by older versions load again; and the OS's raw errors for a
bad output path (a file where a folder is, a name too long) become one line naming the option
and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.results import ResultStore, StoreError, load_results
from mtad_energy.results.store_files import StoreWarning
from tests.results.conftest import build_decode_only_store, build_store

runner = CliRunner()
LONG = "n" * 300  # a name over NAME_MAX (255 on every file system the project runs on)


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("paths")
    return build_store(root / "a", energy=True), build_decode_only_store(root / "b")


@pytest.fixture
def store(stores, tmp_path) -> Path:
    """A fresh copy of the energy store (the tests poison it)."""
    return Path(shutil.copytree(stores[0], tmp_path / "a"))


def compare_args(out) -> list[str]:
    # a target that does not exist: an error about --output proves nothing loaded before it
    return ["compare", "--decoders", "ar", "--target", "/nonexistent/model", "--meter", "none",
            "--dataset", "mtbench", "--n-prompts", "1", "--max-new-tokens", "2", "--device", "cpu",
            "--output", str(out)]


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# -- nothing written into a store ------------------------------------------------------------------
@pytest.mark.parametrize("inside", ["sub", "runs/sub"])
def test_an_output_inside_another_store_is_refused_before_anything_loads(store, inside):
    before = listing(store)
    res = runner.invoke(app, [*compare_args(store / inside), "--json"])
    assert res.exit_code == 2, res.output
    error = json.loads(res.stdout)["error"]
    assert error.startswith("Invalid value for '--output'")  # refused as the option is read
    assert "inside the results store" in error and "give --output a path outside it" in error
    assert listing(store) == before  # nothing written
    assert len(load_results(store)) == 24


def test_a_report_into_another_store_is_refused_and_writes_nothing(stores, store, tmp_path):
    before = listing(store)
    for out in (store, store / "rep"):
        res = runner.invoke(app, ["report", str(stores[1]), "--out", str(out)])
        assert res.exit_code == 2, res.output
        assert "--out" in flat(res.output) and "store" in flat(res.output)
    assert listing(store) == before
    res = runner.invoke(app, ["report", str(store), "--out", str(tmp_path / "fine")])
    assert res.exit_code == 0, res.output


def test_a_store_is_never_created_inside_another(store):
    with pytest.raises(StoreError, match="is inside the results store"):
        ResultStore(store / "sub")
    assert not (store / "sub").exists()


# -- stores poisoned by earlier versions load again -------------------------------------------------
def test_a_store_holding_a_nested_store_and_report_files_loads_with_a_warning(stores, store):
    shutil.copytree(stores[1], store / "sub")  # `--output store/sub`
    (store / "sub.md").write_text("| a |\n")  # compare's table beside it
    (store / "sub-crossover.png").write_bytes(b"png")
    (store / "sub-schedule-speed.json").write_text("{}")
    (store / "figures").mkdir()  # `report other --out store`
    (store / "figures" / "batch_energy.png").write_bytes(b"png")
    (store / "figures" / "batch_energy.svg").write_text("<svg/>")
    (store / "report.md").write_text("# report\n")
    with pytest.warns(StoreWarning, match=r"figures, report.md, sub, sub-crossover.png, "
                                          r"sub-schedule-speed.json and 1 more.*passed over") as w:
        runs = load_results(store)
    assert len(runs) == 24 and len(load_results(store, "decode_batch")) == 8  # not the nested one's
    assert "1 results store(s) of their own" in str(w[0].message)
    res = runner.invoke(app, ["report", str(store), "--out", str(store.parent / "rep")])
    assert res.exit_code == 0, res.output
    (store / "notes.txt").write_text("mine")  # anything else is still refused
    with pytest.raises(StoreError, match="notes.txt was not written by mtad-energy"):
        load_results(store)


# -- the OS's errors, named ------------------------------------------------------------------------
def bad_paths(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    (tmp_path / "afile").write_text("x")
    return {"file": (tmp_path / "afile" / "out", "afile is a file, not a folder"),
            "long": (tmp_path / LONG, "bytes long, over the 255 a name may have here")}


@pytest.mark.parametrize("case", ["file", "long"])
def test_a_bad_output_is_one_line_naming_the_option_before_anything_loads(tmp_path, case):
    out, why = bad_paths(tmp_path)[case]
    res = runner.invoke(app, [*compare_args(out), "--json"])
    assert res.exit_code == 2, res.output
    error = json.loads(res.stdout)["error"]
    assert "'--output'" in error and why in error and "give --output" in error
    assert "Errno" not in error and "nonexistent" not in error


@pytest.mark.parametrize("case", ["file", "long"])
def test_a_bad_report_or_schedule_out_is_named_with_the_fix(stores, tmp_path, case):
    out, why = bad_paths(tmp_path)[case]
    for args in (["report", str(stores[0]), "--out", str(out)],
                 ["schedule", str(stores[0]), "--out", str(out.with_suffix(".json"))]):
        res = runner.invoke(app, [*args, "--json"])
        assert res.exit_code == 2, res.output
        error = json.loads(res.stdout)["error"]
        assert why in error and "give --out" in error and "Errno" not in error, error


def test_missing_parent_folders_of_an_output_are_created(stores, tmp_path):
    res = runner.invoke(app, ["report", str(stores[0]), "--out", str(tmp_path / "a" / "b")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["schedule", str(stores[0]), "--out", str(tmp_path / "c" / "s.json")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "a" / "b" / "report.md").is_file() and (tmp_path / "c" / "s.json").is_file()
