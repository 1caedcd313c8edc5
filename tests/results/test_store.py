"""The results store: append-only part files, resume keys, and clear errors on foreign or damaged files."""

from __future__ import annotations

import json
import os
import time

import pandas as pd
import pytest

from mtad_energy.results import ResultStore, load_results, stable_key
from mtad_energy.results.schema import BATCH, RUNS, STEPS
from mtad_energy.results.store import MARKER, STALE_TMP_S, CorruptFileError, ForeignFileError, StoreError


def steps_rows(key: str, n: int) -> list[dict]:
    return [{c: 0 for c in STEPS.required} | {"run_key": key, "iteration": i} for i in range(n)]


def batch_row(key: str, b: int) -> dict:
    return {c: None for c in BATCH.required} | {"row_key": key, "batch_size": b, "energy_j": 2.0 * b}


def test_rows_round_trip_and_load_results_reads_them(tmp_path):
    store = ResultStore(tmp_path / "r")
    keys = [stable_key({"b": b}) for b in (1, 2, 4)]
    for k, b in zip(keys, (1, 2, 4), strict=True):
        store.write("batch", k, [batch_row(k, b)])
    df = load_results(tmp_path / "r", "batch")
    assert sorted(df["batch_size"]) == [1, 2, 4]
    assert sorted(df["energy_j"]) == [2.0, 4.0, 8.0]
    assert store.keys("batch") == set(keys)
    assert json.loads((tmp_path / "r" / MARKER).read_text())["format"] == "mtad-energy-results"


def test_a_row_is_never_written_twice(tmp_path):
    store = ResultStore(tmp_path)
    k = stable_key({"x": 1})
    store.write("batch", k, [batch_row(k, 1)])
    with pytest.raises(StoreError, match=f"batch row {k} is already stored"):
        store.write("batch", k, [batch_row(k, 1)])
    assert len(store.load("batch")) == 1


def test_rows_missing_required_columns_or_with_a_wrong_key_are_refused(tmp_path):
    store = ResultStore(tmp_path)
    k = stable_key({"x": 1})
    with pytest.raises(ValueError, match="batch row lacks column"):
        store.write("batch", k, [{"row_key": k}])
    with pytest.raises(ValueError, match="expected"):
        store.write("batch", k, [batch_row("0" * 16, 1)])
    with pytest.raises(ValueError, match="unknown table 'nope'"):
        store.write("nope", k, [])


def test_steps_of_an_unfinished_run_are_hidden_and_overwritten_on_redo(tmp_path):
    store = ResultStore(tmp_path)
    k = stable_key({"run": 1})
    store.write("steps", k, steps_rows(k, 3), overwrite=True)
    assert store.load("steps").empty  # no run row: the run did not finish
    store.write("steps", k, steps_rows(k, 2), overwrite=True)  # the redo
    run = {c: None for c in RUNS.required}
    store.write("runs", k, [run | {"run_key": k}])
    assert len(store.load("steps")) == 2


def test_stale_temporaries_of_a_killed_writer_are_removed_on_open(tmp_path):
    ResultStore(tmp_path)
    (tmp_path / "batch").mkdir()
    leftover = tmp_path / "batch" / ".tmp-abc-0123456789abcdef.parquet"
    leftover.write_bytes(b"half a file")
    old = time.time() - STALE_TMP_S - 1
    os.utime(leftover, (old, old))
    ResultStore(tmp_path)
    assert not leftover.exists()


def test_a_young_temporary_may_be_another_writers_and_is_left_alone_and_unread(tmp_path):
    store = ResultStore(tmp_path)
    k = stable_key({"x": 1})
    store.write("batch", k, [batch_row(k, 1)])
    inflight = tmp_path / "batch" / f".tmp-abc-{stable_key({'y': 2})}.parquet"
    inflight.write_bytes(b"being written")
    assert len(load_results(tmp_path, "batch")) == 1  # no error, not read
    assert inflight.exists()


def test_a_foreign_file_is_an_error_naming_it(tmp_path):
    ResultStore(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ForeignFileError, match=r"notes.txt was not written by mtad-energy; move it out"):
        load_results(tmp_path)


def test_a_foreign_file_inside_a_table_is_an_error(tmp_path):
    ResultStore(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "export.csv").write_text("a,b\n")
    with pytest.raises(ForeignFileError, match=r"export.csv was not written by mtad-energy \(expected "
                                               r"<16 hex digits>.parquet\)"):
        ResultStore(tmp_path)


def test_a_damaged_part_file_is_an_error_naming_it_and_the_fix(tmp_path):
    store = ResultStore(tmp_path)
    k = stable_key({"x": 1})
    store.write("batch", k, [batch_row(k, 1)])
    path = tmp_path / "batch" / f"{k}.parquet"
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(CorruptFileError, match=f"{k}.parquet is not a readable Parquet file .*delete it "
                                               "and re-run the same command"):
        load_results(tmp_path, "batch")


def test_a_directory_that_is_not_a_store_is_refused(tmp_path):
    (tmp_path / "data.csv").write_text("x")
    with pytest.raises(ForeignFileError, match="is not empty and is not an mtad-energy results store"):
        ResultStore(tmp_path)
    with pytest.raises(StoreError, match="does not exist; run `mtad-energy profile"):
        load_results(tmp_path / "missing")


def test_a_store_of_another_schema_version_is_refused(tmp_path):
    ResultStore(tmp_path)
    (tmp_path / MARKER).write_text(json.dumps({"format": "mtad-energy-results", "schema_version": 99}))
    with pytest.raises(StoreError, match="written with store schema 99"):
        ResultStore(tmp_path)


def test_empty_table_has_the_required_columns(tmp_path):
    df = ResultStore(tmp_path).load("runs")
    assert isinstance(df, pd.DataFrame) and df.empty and "energy_per_token_j" in df.columns


def test_stable_key_depends_on_content_not_order():
    assert stable_key({"a": 1, "b": 2}) == stable_key({"b": 2, "a": 1})
    assert stable_key({"a": 1}) != stable_key({"a": 2})
