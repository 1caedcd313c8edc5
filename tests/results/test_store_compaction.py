"""Compaction of a results store into packs, and the store's guarantees around it: a crash at any
point of a compaction, a compaction racing writers (other processes), a key that stays taken, and
damaged or foreign packs named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from mtad_energy.results import ResultStore, load_results, stable_key
from mtad_energy.results.schema import RUNS, STEPS
from mtad_energy.results.store import (
    COMPACT_LOCK,
    MARKER,
    PACKS,
    WRITE_LOCK,
    CorruptFileError,
    ForeignFileError,
    RowExistsError,
    StoreError,
    _flock,
    compact_store,
)
from tests.limits import hang_limit_s

ROOT = Path(__file__).resolve().parents[2]

# a worker as the runner writes: steps first (overwritten on a redo), then the run row, the commit
# mark, refused if the key is stored; prints the keys it stored
WRITER = """
import json, sys, time
from mtad_energy.results import ResultStore, stable_key
from mtad_energy.results.schema import RUNS, STEPS
from mtad_energy.results.store import RowExistsError
store, first, n, worker = ResultStore(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
mine = []
for i in range(first, first + n):
    k = stable_key({"i": i})
    if store.has("runs", k):
        continue
    store.write("steps", k, [{c: 0 for c in STEPS.required} | {"run_key": k, "iteration": j}
                             for j in range(i % 4 + 1)], overwrite=True)
    try:
        store.write("runs", k, [{c: None for c in RUNS.required} | {"run_key": k, "text": worker}])
    except RowExistsError:
        continue
    mine.append(k)
print(json.dumps(mine))
"""

# a compaction that dies (as by SIGKILL or power loss: no cleanup) after `n` removals
CRASH = """
import os, pathlib, sys
from mtad_energy.results.store import compact_store
after, unlink = int(sys.argv[2]), pathlib.Path.unlink
def dying_unlink(self, missing_ok=False):
    global after
    if not self.name.startswith(".tmp-"):
        if after == 0:
            os._exit(9)
        after -= 1
    unlink(self, missing_ok=missing_ok)
pathlib.Path.unlink = dying_unlink
compact_store(sys.argv[1], pack_rows=int(sys.argv[3]))
"""


def child(code: str, *args) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, err = proc.communicate(timeout=hang_limit_s(300))
    return proc.returncode, out + err


def run_row(k: str, text: str = "") -> dict:
    return {c: None for c in RUNS.required} | {"run_key": k, "text": text, "tokens_emitted": 3}


def fill(store: ResultStore, n: int, first: int = 0) -> list[str]:
    """``n`` finished runs (run row and 1-4 steps rows each), as the runner writes them."""
    keys = []
    for i in range(first, first + n):
        k = stable_key({"i": i})
        store.write("steps", k, [{c: 0 for c in STEPS.required} | {"run_key": k, "iteration": j}
                                 for j in range(i % 4 + 1)], overwrite=True)
        store.write("runs", k, [run_row(k, f"row {i}")])
        keys.append(k)
    return keys


def files(root: Path, table: str) -> tuple[list[Path], list[Path]]:
    """(part files, packs) of a table."""
    return sorted((root / table).glob("*.parquet")), sorted((root / table / PACKS).glob("*.parquet"))


def ordered(frame: pd.DataFrame) -> pd.DataFrame:
    cols = ["run_key", "iteration"] if "iteration" in frame.columns else ["run_key"]
    return frame.sort_values(cols).reset_index(drop=True)


def test_compaction_folds_finished_parts_into_packs_and_loads_the_same_rows(tmp_path):
    store = ResultStore(tmp_path)
    fill(store, 24)
    unfinished = stable_key({"unfinished": 1})  # steps written, the run row not (interrupted)
    store.write("steps", unfinished, [{c: 0 for c in STEPS.required} | {"run_key": unfinished}],
                overwrite=True)
    before = {t: ordered(load_results(tmp_path, t)) for t in ("runs", "steps")}
    done = store.compact(pack_rows=10)
    runs, steps = {t.table: t for t in done.tables}["runs"], {t.table: t for t in done.tables}["steps"]
    assert (runs.parts, runs.packs_written, runs.rows) == (24, 3, 24)  # 10 + 10 + 4 rows
    assert (steps.parts, steps.parts_left) == (24, 1)
    assert files(tmp_path, "runs")[0] == [] and len(files(tmp_path, "runs")[1]) == 3
    assert files(tmp_path, "steps")[0] == [tmp_path / "steps" / f"{unfinished}.parquet"]
    for t in ("runs", "steps"):
        pd.testing.assert_frame_equal(ordered(load_results(tmp_path, t)), before[t])
    assert store.keys("runs") == set(before["runs"]["run_key"]) and store.has("runs", stable_key({"i": 3}))
    # the next compaction merges the pack under half full with the new rows, leaves the others
    fill(store, 7, first=24)
    again = {t.table: t for t in store.compact(pack_rows=10).tables}["runs"]
    assert (again.parts, again.packs_merged, again.packs_written, again.rows) == (7, 1, 2, 11)
    assert sorted(pq.read_metadata(p).num_rows for p in files(tmp_path, "runs")[1]) == [1, 10, 10, 10]
    assert len(load_results(tmp_path)) == 31 and load_results(tmp_path)["run_key"].is_unique
    assert sum(t.packs_written for t in store.compact(pack_rows=10).tables) == 0  # nothing to do


def test_steps_follow_their_run_row_into_packs_and_hide_without_it(tmp_path):
    store = ResultStore(tmp_path)
    keys = fill(store, 3)
    done = {t.table: t for t in store.compact(tables=["steps"]).tables}["steps"]
    assert (done.parts, done.parts_left) == (0, 3)  # no run row is in a pack yet
    store.compact()
    assert files(tmp_path, "steps")[0] == [] and len(load_results(tmp_path, "steps")) == 1 + 2 + 3
    files(tmp_path, "runs")[1][0].unlink()  # the runs rows are gone: their steps are not shown
    assert load_results(tmp_path, "steps").empty and store.keys("steps") == set(keys)


def test_a_compacted_key_stays_taken(tmp_path):
    store = ResultStore(tmp_path)
    k = fill(store, 1)[0]
    store.compact()
    assert not (tmp_path / "runs" / f"{k}.parquet").exists()
    with pytest.raises(RowExistsError, match=f"runs row {k} is already stored"):
        store.write("runs", k, [run_row(k, "second")])
    # a writer that checked before the compaction ran finds the key at its link
    late = ResultStore(tmp_path)
    late.has = lambda table, key: False
    with pytest.raises(RowExistsError):
        late.write("runs", k, [run_row(k, "second")])
    assert not (tmp_path / "runs" / f"{k}.parquet").exists()
    assert list(load_results(tmp_path)["text"]) == ["row 0"]


def test_a_part_file_beside_a_pack_with_its_key_counts_once_and_the_pack_wins(tmp_path):
    # what a crash between writing a pack and removing its parts leaves (here with other content,
    # to see which copy counts)
    store = ResultStore(tmp_path)
    k = fill(store, 1)[0]
    store.compact()
    copy = tmp_path / "runs" / f"{k}.parquet"
    pd.DataFrame([run_row(k, "later copy")]).to_parquet(copy, index=False)
    runs = load_results(tmp_path)
    assert list(runs["text"]) == ["row 0"]
    done = {t.table: t for t in store.compact().tables}["runs"]
    # the copy goes; the pack (under half full) is rewritten with the one row it holds
    assert (done.parts, done.duplicates, done.packs_merged, done.rows) == (1, 1, 1, 1)
    assert not copy.exists()
    assert list(load_results(tmp_path)["text"]) == ["row 0"]


@pytest.mark.parametrize("removed", [0, 3, 15])
def test_a_crash_mid_compaction_loses_nothing_and_the_next_compaction_resolves_it(tmp_path, removed):
    store = ResultStore(tmp_path)
    fill(store, 24)
    store.compact(pack_rows=10)  # packs of 10, 10 and 4 rows: the last one is merged again
    fill(store, 12, first=24)
    before = {t: ordered(load_results(tmp_path, t)) for t in ("runs", "steps")}
    code, out = finish(child(CRASH, tmp_path, removed, 10))
    # it died after writing packs of 10 and 6 rows (the 4-row pack and the 12 new parts) and
    # removing `removed` of its inputs: the 4-row pack first, then the parts (15: all 13, then 2
    # files of the steps table)
    assert code == 9, out
    parts, packs = files(tmp_path, "runs")
    assert (len(packs), len(parts)) == ((5, 12) if removed == 0 else (4, max(0, 13 - removed)))
    for t in ("runs", "steps"):  # each row once, all of them
        pd.testing.assert_frame_equal(ordered(load_results(tmp_path, t)), before[t])
    k = stable_key({"i": 25})
    with pytest.raises(RowExistsError):  # and its keys are taken
        store.write("runs", k, [run_row(k)])
    done = compact_store(tmp_path, pack_rows=10)  # the dead compaction's lock died with it
    assert not done.busy and sum(t.duplicates for t in done.tables) > 0
    assert files(tmp_path, "runs")[0] == files(tmp_path, "steps")[0] == []
    assert sorted(pq.read_metadata(p).num_rows for p in files(tmp_path, "runs")[1]) == [6, 10, 10, 10]
    for t in ("runs", "steps"):
        pd.testing.assert_frame_equal(ordered(load_results(tmp_path, t)), before[t])


def test_a_crash_while_a_pack_is_written_leaves_a_temporary_that_is_not_read(tmp_path):
    store = ResultStore(tmp_path)
    fill(store, 3)
    store.compact()
    half = tmp_path / "runs" / PACKS / f".tmp-{'0' * 32}-{'1' * 16}-{'2' * 8}.parquet"
    half.write_bytes(b"PAR1 half a pack")
    assert len(load_results(tmp_path)) == 3
    old = time.time() - 4000
    os.utime(half, (old, old))
    ResultStore(tmp_path)
    assert not half.exists()


def test_compaction_racing_writers_stores_every_row_once(tmp_path):
    ResultStore(tmp_path)
    # two workers write the same 100 runs, a third 60 others, while this process compacts
    workers = [child(WRITER, tmp_path, 0, 100, "a"), child(WRITER, tmp_path, 0, 100, "b"),
               child(WRITER, tmp_path, 100, 60, "c")]
    compactions, seen = 0, 0
    while any(w.poll() is None for w in workers):
        compactions += compact_store(tmp_path, pack_rows=40).parts > 0
        runs = load_results(tmp_path)
        assert runs["run_key"].is_unique and len(runs) >= seen  # never twice, never fewer
        seen = len(runs)
        time.sleep(0.05)
    results = [finish(w) for w in workers]
    assert all(code == 0 for code, _ in results), results
    stored = [json.loads(out.strip().splitlines()[-1]) for _, out in results]
    assert compactions >= 2  # it really raced (the writers take seconds)
    compact_store(tmp_path, pack_rows=40)
    runs = load_results(tmp_path)
    assert len(runs) == 160 and runs["run_key"].is_unique
    # of the two workers storing one key, exactly one did, and its row is the one stored
    assert sorted(stored[0] + stored[1]) == sorted({stable_key({"i": i}) for i in range(100)})
    assert set(stored[2]) == {stable_key({"i": i}) for i in range(100, 160)}
    writer = {k: w for w, keys in zip("abc", stored, strict=True) for k in keys}
    assert (runs["text"] == runs["run_key"].map(writer)).all()
    steps = load_results(tmp_path, "steps")
    assert steps.groupby("run_key").size().to_dict() == {
        stable_key({"i": i}): i % 4 + 1 for i in range(160)}
    assert files(tmp_path, "runs")[0] == [] and files(tmp_path, "steps")[0] == []


def test_compaction_removes_files_only_while_no_writer_is_linking_one(tmp_path):
    store = ResultStore(tmp_path)
    fill(store, 3)
    with _flock(tmp_path / WRITE_LOCK, exclusive=False):  # a writer between its check and its link
        worker = threading.Thread(target=compact_store, args=(tmp_path,))
        worker.start()
        worker.join(timeout=1.0)
        assert worker.is_alive() and len(files(tmp_path, "runs")[0]) == 3
        assert len(files(tmp_path, "runs")[1]) == 1  # the pack is written, the parts wait
    worker.join(timeout=hang_limit_s(60))
    assert not worker.is_alive() and files(tmp_path, "runs")[0] == []


def test_a_second_compaction_while_one_runs_does_nothing(tmp_path):
    store = ResultStore(tmp_path)
    fill(store, 3)
    with _flock(tmp_path / COMPACT_LOCK, exclusive=True):
        done = compact_store(tmp_path)
    assert done.busy and done.tables == () and len(files(tmp_path, "runs")[0]) == 3
    assert not compact_store(tmp_path).busy and files(tmp_path, "runs")[0] == []


def test_a_damaged_pack_is_an_error_naming_it(tmp_path):
    store = ResultStore(tmp_path)
    fill(store, 3)
    store.compact()
    pack = files(tmp_path, "runs")[1][0]
    pack.write_bytes(pack.read_bytes()[:40])
    with pytest.raises(CorruptFileError, match=f"{pack.name} is not a readable Parquet file .*it holds "
                                               "compacted rows of many runs: restore it from a backup"):
        load_results(tmp_path)


def test_a_foreign_file_among_the_packs_is_an_error_naming_it(tmp_path):
    store = ResultStore(tmp_path)
    fill(store, 2)
    store.compact()
    (tmp_path / "runs" / PACKS / "mine.parquet").write_bytes(b"x")
    with pytest.raises(ForeignFileError, match=r"mine.parquet was not written by mtad-energy \(expected "
                                               r"<16 hex digits>-<8 hex digits>.parquet\)"):
        ResultStore(tmp_path)


def test_a_pack_without_the_key_column_is_foreign(tmp_path):
    ResultStore(tmp_path)
    (tmp_path / "runs" / PACKS).mkdir(parents=True)
    pd.DataFrame({"x": [1]}).to_parquet(tmp_path / "runs" / PACKS / f"{'0' * 16}-{'0' * 8}.parquet")
    with pytest.raises(ForeignFileError, match="was not written by mtad-energy .it has no run_key column"):
        load_results(tmp_path)


def test_parts_that_disagree_on_a_column_type_still_load_and_are_not_compacted(tmp_path):
    store = ResultStore(tmp_path)
    a, b = stable_key({"a": 1}), stable_key({"b": 1})
    store.write("runs", a, [run_row(a) | {"param_k": 3}])
    store.write("runs", b, [run_row(b) | {"param_k": "top"}])
    assert sorted(map(str, load_results(tmp_path)["param_k"])) == ["3", "top"]
    with pytest.raises(StoreError, match=r"cannot compact .*runs: its files disagree on a column's type"):
        store.compact()
    assert len(files(tmp_path, "runs")[0]) == 2 and len(load_results(tmp_path)) == 2


def test_a_schema_1_store_is_read_and_upgraded_by_its_first_compaction(tmp_path):
    store = ResultStore(tmp_path)
    (tmp_path / MARKER).write_text(json.dumps({"format": "mtad-energy-results", "schema_version": 1}))
    fill(store, 2)
    assert len(load_results(tmp_path)) == 2
    compact_store(tmp_path)
    assert json.loads((tmp_path / MARKER).read_text())["schema_version"] == 2
    assert len(load_results(tmp_path)) == 2


def test_store_compact_command(tmp_path):
    from typer.testing import CliRunner

    from mtad_energy.cli import app

    store = ResultStore(tmp_path / "s")
    fill(store, 3)
    res = CliRunner().invoke(app, ["store", "compact", str(tmp_path / "s"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    tables = {t["table"]: t for t in doc["tables"]}
    assert (tables["runs"]["parts"], tables["steps"]["parts"], doc["busy"]) == (3, 3, False)
    res = CliRunner().invoke(app, ["store", "compact", str(tmp_path / "s")])
    assert res.exit_code == 0 and "compacted" in res.output and "parts left" in res.output
    res = CliRunner().invoke(app, ["store", "compact", str(tmp_path / "nope"), "--json"])
    assert res.exit_code == 2
    assert json.loads(res.stdout) == {"error": f"results directory {tmp_path / 'nope'} does not exist; "
                                               "measure into it first (`mtad-energy profile`, "
                                               "`compare` or `sweep` with --output "
                                               f"{tmp_path / 'nope'})", "exit_code": 2}
