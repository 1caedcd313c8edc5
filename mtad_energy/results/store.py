"""An append-only results store: one Parquet part file per finished row (or run), named by its key,
compacted into larger files once finished.

Layout of a store directory::

    DIR/mtad-energy-store.json          marker: format and schema version
    DIR/envs/<env_id>.json               environment snapshots the rows point at
    DIR/<table>/<key>.parquet            one part file per key (runs, steps, batch, ops, decode_batch)
    DIR/<table>/packs/<time>-<id>.parquet  compacted files: the rows of many finished part files
    DIR/.write-lock, DIR/.compact-lock   empty files whose advisory locks order writers and compaction

Why a file per key: a row is on disk the moment it is finished, so Ctrl-C, a crash or an
out-of-memory kill loses at most the row in flight; the key is the file name, so a re-run that
asks for the same row finds it and skips it, and a row can never be stored twice. Part files are
written to a temporary name and renamed, so a half-written file never looks finished; readers only
see finished names, so several workers (processes, hosts on a shared file system) can write into
one store at once. Temporary files left by a killed writer are removed when the store is opened
once they are older than any write could take (`STALE_TMP_S`), never while a writer may own them.
Anything else in DIR (a file we did not write, a part file that does not parse) is an error that
names the file: skipping it would silently drop results. Two things are passed over with a
`StoreWarning` naming them, since they hold no row: what mtad-energy writes beside a store (a
report, figures, a table, a schedule, another store) that an older version or an --output inside
the store left in it (`store_files.beside_file`; no command writes into a store now, and no store
is created inside another), and an environment snapshot that does not parse (its rows load).

Why packs: opening a file costs milliseconds whatever reads it, so 10^5 part files take minutes to
load. `ResultStore.compact` folds finished part files into packs of up to `PACK_ROWS` rows (the
CLI does it at the end of every command; `mtad-energy store compact DIR` on demand), and `load`
reads all files of a table in parallel. Compaction keeps every guarantee above:

- it writes a pack atomically first, then removes the files it holds; a reader or a crash between
  the two steps sees a row twice, and the key decides: each key's rows are taken from one file
  only (packs in the order they were written, then part files), and the next compaction removes
  the leftovers;
- a key stays taken after its part file is removed: a writer checks the packs and links its part
  file under a shared lock, and compaction removes files only under the exclusive one, so of two
  workers storing one key exactly one succeeds, whenever compaction runs;
- ``steps`` of a run are compacted once its ``runs`` row is in a pack (until then the run may be
  redone, its steps part file overwritten); one compaction runs at a time (the others skip).

Locks are `fcntl.flock` locks, released by the kernel when their process dies, so a crash never
leaves one behind. Where the file system has no working locks, reads still count each key once.
The errors and those file operations (atomic writes, locks, reading files) are `store_files`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mtad_energy.results.schema import (
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    TABLES,
    TableSpec,
    frame_without_unseen_energy,
)
from mtad_energy.results.store_files import (
    _TMP_PREFIX,
    MARKER,
    CorruptFileError,
    ForeignFileError,
    RowExistsError,
    StoreError,
    StoreWarning,
    _flock,
    _read_parquet,
    _to_pandas,
    beside_file,
    enclosing_store,
    strays_note,
    write_atomic,
)
from mtad_energy.results.store_files import DiskFullError as DiskFullError  # as before

FORMAT = "mtad-energy-results"
PACKS = "packs"
WRITE_LOCK = ".write-lock"
COMPACT_LOCK = ".compact-lock"
_KEY_FILE = re.compile(r"^[0-9a-f]{16}\.parquet$")
_PACK_FILE = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{8}\.parquet$")
_ENV_FILE = re.compile(r"^[0-9a-f]{16}\.json$")
STALE_TMP_S = 3600.0  # a part file takes milliseconds to write; an hour-old temporary is orphaned
PACK_ROWS = 100_000  # rows per pack at most; one under half of it is merged again by a compaction
READ_THREADS = min(32, 8 * (os.cpu_count() or 1))  # opening files waits on the file system
_READ_ATTEMPTS = 5


class _PackVanished(Exception):
    """A pack listed a moment ago was merged into a newer one: list the files again."""


@dataclass(frozen=True)
class TableCompaction:
    """What compacting one table did."""

    table: str
    parts: int  # part files folded into packs (and removed)
    packs_merged: int  # small packs rewritten into the new ones (and removed)
    packs_written: int
    rows: int  # rows in the packs written
    duplicates: int  # files (or a pack's keys) dropped because another file holds their key
    parts_left: int  # part files not compacted: steps of runs whose runs row is not in a pack

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Compaction:
    """What `ResultStore.compact` did; ``busy`` when another compaction held the store."""

    root: str
    tables: tuple[TableCompaction, ...]
    busy: bool
    time_s: float

    @property
    def parts(self) -> int:
        return sum(t.parts for t in self.tables)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "busy": self.busy, "time_s": self.time_s,
                "tables": [t.to_dict() for t in self.tables]}


def _unwritable(root: Path, err: OSError) -> str:
    return (f"cannot create the results directory {root} (--output): "
            f"{err.strerror or err}; pick a directory you can write to")


class ResultStore:
    """A results directory. ``ResultStore(dir)`` creates it if needed and checks what is in it."""

    def __init__(self, root: str | Path, create: bool = True):
        self.root = Path(root)
        self._pack_index: dict[str, dict[str, frozenset[str]]] = {}  # table -> pack name -> keys
        marker = self.root / MARKER
        if create and (outer := enclosing_store(self.root)) is not None:
            raise StoreError(f"{self.root} is inside the results store {outer}, which may hold only "
                             "what mtad-energy wrote; give --output a path outside it")
        if not self.root.exists():
            if not create:
                raise StoreError(f"results directory {self.root} does not exist")
            try:  # another worker may be creating it too
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise StoreError(_unwritable(self.root, err)) from None
        if not self.root.is_dir():
            raise StoreError(f"{self.root} is a file, not a results directory; pick another --output")
        if marker.exists():
            self._check_marker(marker)
        elif any(p for p in self.root.iterdir() if not p.name.startswith(_TMP_PREFIX)):
            raise ForeignFileError(
                f"{self.root} is not empty and is not an mtad-energy results store (no {MARKER}); "
                + ("pick a new or empty --output directory" if create else
                   "pass the directory a measuring command stored its rows in (its --output)"))
        elif create:
            try:
                self._write_marker()
            except OSError as err:
                raise StoreError(_unwritable(self.root, err)) from None
        else:
            raise StoreError(f"{self.root} is empty: no results yet")
        self._sweep_temporaries()
        self._check_layout()
        self._check_envs()

    # -- checks -------------------------------------------------------------------------------
    def _write_marker(self) -> None:
        write_atomic(self.root / MARKER, lambda p: p.write_text(json.dumps(
            {"format": FORMAT, "schema_version": SCHEMA_VERSION}, indent=2) + "\n"))

    def _check_marker(self, marker: Path) -> int:
        try:
            meta = json.loads(marker.read_text())
        except (OSError, ValueError) as err:
            raise CorruptFileError(f"{marker} is not valid JSON ({err}); restore it or start a new "
                                   "--output directory") from None
        if meta.get("format") != FORMAT:
            raise ForeignFileError(f"{marker} does not describe an mtad-energy results store")
        version = meta.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            readable = ", ".join(map(str, READABLE_SCHEMA_VERSIONS))
            raise StoreError(
                f"{self.root} was written with store schema {version}, this mtad-energy reads "
                f"schema {readable}; use a matching version or a new --output")
        return version

    def _table_dirs(self) -> list[Path]:
        return [self.root / t for t in TABLES if (self.root / t).is_dir()]

    def _sweep_temporaries(self) -> None:
        # a writer killed between write and rename leaves these; they never held a finished row.
        # Young ones may belong to a live writer in another process.
        now = time.time()
        dirs = [self.root, *(p for p in self.root.iterdir() if p.is_dir())]
        dirs += [d / PACKS for d in self._table_dirs() if (d / PACKS).is_dir()]
        for sub in dirs:
            for p in sub.glob(f"{_TMP_PREFIX}*"):
                try:
                    if now - p.stat().st_mtime > STALE_TMP_S:
                        p.unlink(missing_ok=True)
                except FileNotFoundError:  # renamed by its writer meanwhile
                    pass

    def _parts(self, table: str) -> list[Path]:
        """Finished part files of a table (temporaries and other names are not rows)."""
        d = self.root / table
        return sorted(p for p in d.glob("*.parquet") if _KEY_FILE.match(p.name)) if d.is_dir() else []

    def _packs(self, table: str) -> list[Path]:
        """Packs of a table, oldest first (the name starts with the time it was written)."""
        d = self.root / table / PACKS
        return sorted(p for p in d.glob("*.parquet") if _PACK_FILE.match(p.name)) if d.is_dir() else []

    def _check_layout(self) -> None:
        allowed_dirs = set(TABLES) | {"envs"}
        strays = []
        for p in sorted(self.root.iterdir()):
            if p.name in (MARKER, WRITE_LOCK, COMPACT_LOCK) or p.name.startswith(_TMP_PREFIX):
                continue
            if p.name not in allowed_dirs and beside_file(p):
                strays.append(p)
                continue
            if p.is_dir() and p.name in allowed_dirs:
                self._check_files(p, _ENV_FILE if p.name == "envs" else _KEY_FILE,
                                  "<env_id>.json" if p.name == "envs" else "<16 hex digits>.parquet")
                continue
            raise ForeignFileError(f"{p} was not written by mtad-energy; move it out of the results "
                                   f"directory {self.root} (a store holds only {MARKER}, "
                                   f"{', '.join(sorted(allowed_dirs))})")
        if strays:
            warnings.warn(strays_note(self.root, strays), StoreWarning, stacklevel=3)

    def _check_envs(self) -> None:
        """An environment snapshot that does not parse loses no row, but the rows pointing at it
        lose what machine measured them: said (`StoreWarning`), never passed over."""
        d = self.root / "envs"
        for p in sorted(q for q in d.iterdir() if _ENV_FILE.match(q.name)) if d.is_dir() else []:
            try:
                ok = isinstance(json.loads(p.read_text()), dict)
            except (OSError, ValueError):
                ok = False
            if not ok:
                warnings.warn(f"{p} is not a valid environment snapshot (not a JSON object): the "
                              f"rows with env_id {p.stem} load, but what machine, driver and "
                              "libraries measured them is lost; restore it from a backup, or delete "
                              "it (the next command measuring on that machine writes it again)",
                              StoreWarning, stacklevel=3)

    def _check_files(self, d: Path, pattern: re.Pattern, expected: str) -> None:
        for f in d.iterdir():
            if f.name.startswith(_TMP_PREFIX) or pattern.match(f.name):
                continue
            if f.name == PACKS and pattern is _KEY_FILE and f.is_dir():
                self._check_files(f, _PACK_FILE, "<16 hex digits>-<8 hex digits>.parquet")
                continue
            raise ForeignFileError(f"{f} was not written by mtad-energy (expected {expected}); "
                                   "move it out of the results directory")

    # -- packs --------------------------------------------------------------------------------
    def _pack_keys(self, table: str) -> set[str]:
        """Every key the packs of ``table`` hold now (the key column of a new pack is read once)."""
        for _ in range(_READ_ATTEMPTS):
            packs = self._packs(table)
            index = self._pack_index.setdefault(table, {})
            for name in set(index) - {p.name for p in packs}:
                del index[name]
            try:
                for p in packs:
                    if p.name not in index:
                        index[p.name] = self._read_pack_keys(table, p)
            except _PackVanished:
                continue
            return set().union(*index.values())
        raise StoreError(f"the packs of {self.root / table} kept changing while being listed; "
                         "try again")

    def _read_pack_keys(self, table: str, path: Path) -> frozenset[str]:
        key = TABLES[table].key
        try:
            column = pq.read_table(path, columns=[key])[key]
        except FileNotFoundError:
            raise _PackVanished from None
        except Exception as err:
            if not path.exists():
                raise _PackVanished from None
            raise self._damaged(table, path, err, pack=True) from None
        return frozenset(pc.unique(column).to_pylist())

    # -- writing ------------------------------------------------------------------------------
    def _table_dir(self, table: str) -> Path:
        self._check_table(table)
        d = self.root / table
        d.mkdir(exist_ok=True)
        return d

    @staticmethod
    def _check_table(table: str) -> None:
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; tables are {', '.join(TABLES)}")

    def has(self, table: str, key: str) -> bool:
        # the part file first: compaction writes its pack before it removes the part file
        return (self.root / table / f"{key}.parquet").exists() or key in self._pack_keys(table)

    def keys(self, table: str) -> set[str]:
        return {p.stem for p in self._parts(table)} | self._pack_keys(table)

    @contextlib.contextmanager
    def _claim(self, table: str, key: str) -> Iterator[None]:
        """Held while a part file is linked into place: no compaction removes a file meanwhile,
        so a key that is in no pack now and whose name is free is nowhere else."""
        with _flock(self.root / WRITE_LOCK, exclusive=False):
            if key in self._pack_keys(table):
                raise FileExistsError(key)
            yield

    def write(self, table: str, key: str, rows: Iterable[Mapping[str, Any]],
              overwrite: bool = False) -> Path:
        """Store ``rows`` (all sharing ``key``) as one part file. A key that is already stored is
        refused with `RowExistsError` unless ``overwrite`` (used only for ``steps``, whose run row
        is the commit mark); the refusal is atomic, so of two workers storing one key, one wins,
        also while a compaction moves part files into packs."""
        d = self._table_dir(table)
        spec: TableSpec = TABLES[table]
        rows = [dict(r) for r in rows]
        if not re.fullmatch(r"[0-9a-f]{16}", key):
            raise ValueError(f"a row key must be 16 hex digits, got {key!r}")
        for r in rows:
            missing = [c for c in spec.required if c not in r]
            if missing:
                raise ValueError(f"{table} row lacks column(s) {', '.join(missing)}")
            if r[spec.key] != key:
                raise ValueError(f"{table} row has {spec.key}={r[spec.key]!r}, expected {key!r}")
        path = d / f"{key}.parquet"
        exists = RowExistsError(f"{table} row {key} is already stored in {self.root / table}; rows "
                                "are never written twice")
        if not overwrite and self.has(table, key):
            raise exists
        frame = pd.DataFrame(rows)
        guard = contextlib.nullcontext if overwrite else (lambda: self._claim(table, key))
        try:
            write_atomic(path, lambda p: frame.to_parquet(p, index=False), exclusive=not overwrite,
                          guard=guard)
        except FileExistsError:  # another worker stored it between the check and the write
            raise exists from None
        return path

    def write_env(self, env_id: str, snapshot: Mapping[str, Any]) -> None:
        d = self.root / "envs"
        d.mkdir(exist_ok=True)
        path = d / f"{env_id}.json"
        if not path.exists():
            write_atomic(path, lambda p: p.write_text(json.dumps(snapshot, indent=2, default=str)))

    # -- reading ------------------------------------------------------------------------------
    def _damaged(self, table: str, path: Path, err: Exception, pack: bool = False) -> CorruptFileError:
        if pack:
            fix = ("it holds compacted rows of many runs: restore it from a backup, or delete it and "
                   "re-run the commands that wrote them to recompute them")
        elif table == "steps" and (self.root / "runs" / path.name).exists():
            # a run is redone only when its run row is missing: a damaged steps part goes with it
            fix = (f"delete it and its run row {self.root / 'runs' / path.name}, then re-run the same "
                   "command to recompute that run")
        elif table == "steps":
            fix = ("delete it: its run row is compacted, so that run keeps its runs row without "
                   "per-iteration steps (recompute it into a new --output if you need them)")
        else:
            fix = "delete it and re-run the same command to recompute that row"
        return CorruptFileError(f"{path} is not a readable Parquet file ({type(err).__name__}: "
                                f"{err}); {fix}")

    def _read_file(self, table: str, path: Path, pack: bool) -> pa.Table | None:
        """One file's rows, checked; None for a part file that vanished (compaction moved it into a
        pack, which was written before, so it is listed); a vanished pack raises _PackVanished."""
        key = TABLES[table].key
        try:
            tab = _read_parquet(path, pack)
        except FileNotFoundError:
            if pack:
                raise _PackVanished from None
            return None
        except Exception as err:  # pyarrow raises several types for a damaged file
            if not path.exists():
                if pack:
                    raise _PackVanished from None
                return None
            raise self._damaged(table, path, err, pack) from None
        if tab.num_rows and key not in tab.column_names:
            raise ForeignFileError(f"{path} was not written by mtad-energy (it has no {key} column); "
                                   "move it out of the results directory")
        if tab.num_rows and not pack and not pc.all(pc.equal(tab[key], path.stem)).as_py():
            raise ForeignFileError(f"{path} was not written by mtad-energy (its rows do not carry "
                                   f"{key} = {path.stem}, the file's name); move it out of the results "
                                   "directory")
        return tab

    def _read_files(self, table: str, packs: Sequence[Path], parts: Sequence[Path]
                    ) -> list[tuple[Path, pa.Table | None]]:
        """Read packs and part files in parallel; in the same order."""
        jobs = [(p, True) for p in packs] + [(p, False) for p in parts]
        if len(jobs) < 4:
            return [(p, self._read_file(table, p, pack)) for p, pack in jobs]
        with ThreadPoolExecutor(min(READ_THREADS, len(jobs))) as pool:
            tables = list(pool.map(lambda job: self._read_file(table, *job), jobs))
        return [(p, t) for (p, _), t in zip(jobs, tables, strict=True)]

    def _single(self, table: str, files: Sequence[tuple[Path, pa.Table | None]],
                taken: set[str]) -> tuple[list[tuple[Path, pa.Table]], int]:
        """The files' rows with each key's rows from the first file that holds it (``taken``:
        keys held elsewhere already); returns (path, rows) kept and how many files or keys were
        dropped as copies."""
        key = TABLES[table].key
        kept, dropped = [], 0
        for path, tab in files:
            if tab is None or tab.num_rows == 0:
                continue
            if _KEY_FILE.match(path.name):  # a part file holds one key
                if path.stem in taken:
                    dropped += 1
                    continue
                taken.add(path.stem)
            else:
                held = set(pc.unique(tab[key]).to_pylist())
                copies = held & taken
                if copies:
                    dropped += len(copies)
                    tab = tab.filter(pc.invert(pc.is_in(tab[key], pa.array(sorted(copies)))))
                taken |= held
            if tab.num_rows:
                kept.append((path, tab))
        return kept, dropped

    def _snapshot(self, table: str) -> tuple[list[tuple[Path, pa.Table | None]], set[str] | None]:
        """All files of ``table`` read at one moment (and for ``steps`` the finished runs' keys)."""
        for _ in range(_READ_ATTEMPTS):
            parts = self._parts(table)  # before the packs: a part file compacted meanwhile is in one
            packs = self._packs(table)
            done = self.keys("runs") if table == "steps" else None
            if done is not None:
                parts = [p for p in parts if p.stem in done]
            try:
                return self._read_files(table, packs, parts), done
            except _PackVanished:  # merged into a newer pack by a compaction: list again
                continue
        raise StoreError(f"{self.root / table} kept changing while being read (compactions running "
                         "back to back); try again")

    def load(self, table: str = "runs") -> pd.DataFrame:
        """All rows of ``table`` as a DataFrame (empty, with the required columns, if none).
        ``steps`` rows whose run row is missing (the run was interrupted after its steps were
        written) are left out: that run is not finished and will be redone."""
        self._check_table(table)
        files, done = self._snapshot(table)
        kept, _ = self._single(table, files, set())
        tables = [t for _, t in kept]
        if done is not None:  # packs hold finished runs only, unless a runs row was deleted
            key, finished = TABLES[table].key, pa.array(sorted(done), pa.string())
            tables = [t.filter(pc.is_in(t[key], finished)) if _PACK_FILE.match(p.name) else t
                      for p, t in kept]
            tables = [t for t in tables if t.num_rows]
        if not tables:
            return pd.DataFrame(columns=list(TABLES[table].required))
        return frame_without_unseen_energy(_to_pandas(tables))  # old stores' static-only joules

    def envs(self) -> dict[str, dict[str, Any]]:
        d = self.root / "envs"
        out = {}
        for p in sorted(q for q in d.glob("*.json") if _ENV_FILE.match(q.name)) if d.is_dir() else []:
            try:
                out[p.stem] = json.loads(p.read_text())
            except ValueError as err:
                raise CorruptFileError(f"{p} is not valid JSON ({err}); delete it") from None
        return out

    # -- compaction ---------------------------------------------------------------------------
    def compact(self, tables: Sequence[str] | None = None, pack_rows: int = PACK_ROWS) -> Compaction:
        """Fold the finished part files (and packs under half of ``pack_rows``) of each table into
        packs of up to ``pack_rows`` rows. Safe while workers write into the store and against a
        crash at any point; if another compaction holds the store, returns with ``busy``."""
        started = time.perf_counter()
        names = list(TABLES) if tables is None else list(tables)
        for t in names:
            self._check_table(t)
        done: list[TableCompaction] = []
        with _flock(self.root / COMPACT_LOCK, exclusive=True, blocking=False) as mine:
            if not mine:
                return Compaction(str(self.root), (), True, time.perf_counter() - started)
            for table in sorted(names, key=lambda t: t == "steps"):  # runs first: steps need them
                done.append(self._compact_table(table, pack_rows))
        return Compaction(str(self.root), tuple(done), False, time.perf_counter() - started)

    def _compact_table(self, table: str, pack_rows: int) -> TableCompaction:
        parts = self._parts(table)
        finished = parts
        if table == "steps":  # steps go into packs after their run row (which is then never redone)
            runs = self._pack_keys("runs")
            finished = [p for p in parts if p.stem in runs]
        packs = self._packs(table)  # no other compaction runs: these stay until we remove them
        # a pack under half full is merged again (packs are filled to between half and full, the
        # last one of a compaction excepted, so this never rewrites the same packs over and over)
        small = [p for p in packs if self._pack_rows(table, p) < pack_rows / 2]
        if not finished and len(small) < 2:
            return TableCompaction(table, 0, 0, 0, 0, 0, len(parts))
        self._pack_keys(table)  # the key index of every pack, up to date
        taken = set().union(*(self._pack_index[table][p.name] for p in packs if p not in small))
        files = self._read_files(table, small, finished)
        kept, dropped = self._single(table, files, taken)
        written = self._write_packs(table, [t for _, t in kept], pack_rows)
        with _flock(self.root / WRITE_LOCK, exclusive=True):  # no writer is linking a part now
            for p in [*small, *finished]:
                p.unlink(missing_ok=True)
        return TableCompaction(table, len(finished), len(small), len(written),
                               sum(t.num_rows for _, t in kept), dropped, len(parts) - len(finished))

    def _pack_rows(self, table: str, path: Path) -> int:
        try:
            return pq.read_metadata(path).num_rows
        except Exception as err:
            raise self._damaged(table, path, err, pack=True) from None

    def _write_packs(self, table: str, tables: Sequence[pa.Table], pack_rows: int) -> list[Path]:
        """Write ``tables`` (each one file's rows, so a key's rows stay together) as packs of up to
        ``pack_rows`` rows; returns their paths."""
        groups: list[list[pa.Table]] = []
        rows = pack_rows
        for t in tables:
            if rows + t.num_rows > pack_rows:
                groups.append([])
                rows = 0
            groups[-1].append(t)
            rows += t.num_rows
        try:  # every group before the first is written: a refusal leaves the table as it was
            merged_groups = [pa.concat_tables(g, promote_options="permissive") for g in groups]
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as err:
            raise StoreError(f"cannot compact {self.root / table}: its files disagree on a column's "
                             f"type ({err}); they are left as they are and still load") from None
        if groups and self._check_marker(self.root / MARKER) < SCHEMA_VERSION:
            self._write_marker()  # a schema-1 reader would not see the packs: it must refuse
        d = self.root / table / PACKS
        d.mkdir(exist_ok=True)
        written = []
        for merged in merged_groups:
            path = d / f"{time.time_ns():016x}-{uuid.uuid4().hex[:8]}.parquet"
            write_atomic(path, lambda p, m=merged: pq.write_table(m, p))
            written.append(path)
        return written


def compact_store(root: str | Path, tables: Sequence[str] | None = None,
                  pack_rows: int = PACK_ROWS) -> Compaction:
    """Compact the store in ``root`` (see `ResultStore.compact`)."""
    return _open(root).compact(tables, pack_rows)


# what stores the rows of a table: the advice when a reader finds no store
WRITERS = {"decode_batch": "sweep batch-size --decoder ar,spd", "batch": "sweep batch-size",
           "runs": "profile", "steps": "profile", "ops": "profile --ops"}


def _open(root: str | Path, table: str | None = None) -> ResultStore:
    """The store in ``root`` for reading (``table``: what the reader needs, named in the advice
    when there is no store)."""
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise StoreError(f"{path} is a file, not a results directory; pass the directory given as "
                         "--output (it holds mtad-energy-store.json)")
    if not path.is_dir():
        fix = (f"run `mtad-energy {WRITERS[table]} --output {path}` first" if table in WRITERS
               else f"measure into it first (`mtad-energy profile`, `compare` or `sweep` with "
                    f"--output {path})")
        raise StoreError(f"results directory {path} does not exist; {fix}")
    return ResultStore(path, create=False)


def load_results(root: str | Path, table: str = "runs") -> pd.DataFrame:
    """Rows of one table of the results store in ``root`` (``runs``, ``steps``, ``batch``, ``ops``,
    ``decode_batch``), its part files and packs read in parallel.

    Raises `StoreError` when ``root`` is not a store or holds a foreign or damaged file.
    """
    return _open(root, table).load(table)
