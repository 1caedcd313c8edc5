"""An append-only results store: one Parquet part file per finished row (or run), named by its key.

Layout of a store directory::

    DIR/mtad-energy-store.json      marker: format and schema version
    DIR/envs/<env_id>.json           environment snapshots the rows point at
    DIR/<table>/<key>.parquet        one part file per key (runs, steps, batch, ops)

Why a file per key: a row is on disk the moment it is finished, so Ctrl-C, a crash or an
out-of-memory kill loses at most the row in flight; the key is the file name, so a re-run that
asks for the same row finds it and skips it, and a row can never be stored twice. Part files are
written to a temporary name and renamed, so a half-written file never looks finished; readers only
see finished names, so several workers (processes, hosts on a shared file system) can write into
one store at once. Temporary files left by a killed writer are removed when the store is opened
once they are older than any write could take (`STALE_TMP_S`), never while a writer may own them.
Anything else in DIR (a file we did not write, a part file that does not parse) is an error that
names the file: skipping it would silently drop results.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from mtad_energy.results.schema import SCHEMA_VERSION, TABLES, TableSpec

MARKER = "mtad-energy-store.json"
FORMAT = "mtad-energy-results"
_KEY_FILE = re.compile(r"^[0-9a-f]{16}\.parquet$")
_ENV_FILE = re.compile(r"^[0-9a-f]{16}\.json$")
_TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600.0  # a part file takes milliseconds to write; an hour-old temporary is orphaned


class StoreError(RuntimeError):
    """The results directory cannot be used as it is; the message names the file and the fix."""


class ForeignFileError(StoreError):
    pass


class CorruptFileError(StoreError):
    pass


class DiskFullError(StoreError):
    """No space left while writing a part file; the rows stored before it are intact."""


class RowExistsError(StoreError):
    """The row is already stored (by an earlier run or, just now, by another worker)."""


def _write_atomic(path: Path, write, exclusive: bool = False) -> None:
    """Write through a temporary file renamed into place. ``exclusive``: fail with
    `FileExistsError` if ``path`` exists, also when another process creates it at the same moment
    (a hard link is created atomically or not at all; where the file system has no hard links,
    an existence check just before the rename leaves a window of microseconds)."""
    tmp = path.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex}-{path.name}")
    try:
        try:
            write(tmp)
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"disk full: no space left to write {path} ({err.strerror or err}). Every row "
                    "finished before it is stored intact (a row is written whole or not at all); free "
                    "some space, then re-run the same command to resume where it stopped") from None
            raise
        if exclusive:
            try:
                os.link(tmp, path)
                return
            except FileExistsError:
                raise
            except OSError:  # no hard links here (some network or FUSE file systems)
                if path.exists():
                    raise FileExistsError(path) from None
        os.replace(tmp, path)  # atomic on POSIX: readers see the old state or the whole file
    finally:
        tmp.unlink(missing_ok=True)


class ResultStore:
    """A results directory. ``ResultStore(dir)`` creates it if needed and checks what is in it."""

    def __init__(self, root: str | Path, create: bool = True):
        self.root = Path(root)
        marker = self.root / MARKER
        if not self.root.exists():
            if not create:
                raise StoreError(f"results directory {self.root} does not exist")
            self.root.mkdir(parents=True, exist_ok=True)  # another worker may be creating it too
        if not self.root.is_dir():
            raise StoreError(f"{self.root} is a file, not a results directory; pick another --output")
        if marker.exists():
            self._check_marker(marker)
        elif any(p for p in self.root.iterdir() if not p.name.startswith(_TMP_PREFIX)):
            raise ForeignFileError(
                f"{self.root} is not empty and is not an mtad-energy results store (no {MARKER}); "
                "pick a new or empty --output directory")
        elif create:
            _write_atomic(marker, lambda p: p.write_text(json.dumps(
                {"format": FORMAT, "schema_version": SCHEMA_VERSION}, indent=2) + "\n"))
        else:
            raise StoreError(f"{self.root} is empty: no results yet")
        self._sweep_temporaries()
        self._check_layout()

    # -- checks -------------------------------------------------------------------------------
    def _check_marker(self, marker: Path) -> None:
        try:
            meta = json.loads(marker.read_text())
        except (OSError, ValueError) as err:
            raise CorruptFileError(f"{marker} is not valid JSON ({err}); restore it or start a new "
                                   "--output directory") from None
        if meta.get("format") != FORMAT:
            raise ForeignFileError(f"{marker} does not describe an mtad-energy results store")
        if meta.get("schema_version") != SCHEMA_VERSION:
            raise StoreError(
                f"{self.root} was written with store schema {meta.get('schema_version')}, this "
                f"mtad-energy reads schema {SCHEMA_VERSION}; use a matching version or a new --output")

    def _sweep_temporaries(self) -> None:
        # a writer killed between write and rename leaves these; they never held a finished row.
        # Young ones may belong to a live writer in another process.
        now = time.time()
        for sub in [self.root, *(p for p in self.root.iterdir() if p.is_dir())]:
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

    def _check_layout(self) -> None:
        allowed_dirs = set(TABLES) | {"envs"}
        for p in self.root.iterdir():
            if p.name == MARKER:
                continue
            if p.name.startswith(_TMP_PREFIX):
                continue
            if p.is_dir() and p.name in allowed_dirs:
                pattern = _ENV_FILE if p.name == "envs" else _KEY_FILE
                for f in p.iterdir():
                    if not pattern.match(f.name) and not f.name.startswith(_TMP_PREFIX):
                        raise ForeignFileError(
                            f"{f} was not written by mtad-energy (expected "
                            f"{'<env_id>.json' if p.name == 'envs' else '<16 hex digits>.parquet'}); "
                            "move it out of the results directory")
                continue
            raise ForeignFileError(f"{p} was not written by mtad-energy; move it out of the results "
                                   f"directory {self.root} (a store holds only {MARKER}, "
                                   f"{', '.join(sorted(allowed_dirs))})")

    # -- writing ------------------------------------------------------------------------------
    def _table_dir(self, table: str) -> Path:
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; tables are {', '.join(TABLES)}")
        d = self.root / table
        d.mkdir(exist_ok=True)
        return d

    def has(self, table: str, key: str) -> bool:
        return (self.root / table / f"{key}.parquet").exists()

    def keys(self, table: str) -> set[str]:
        return {p.stem for p in self._parts(table)}

    def write(self, table: str, key: str, rows: Iterable[Mapping[str, Any]],
              overwrite: bool = False) -> Path:
        """Store ``rows`` (all sharing ``key``) as one part file. A key that is already stored is
        refused with `RowExistsError` unless ``overwrite`` (used only for ``steps``, whose run row
        is the commit mark); the refusal is atomic, so of two workers storing one key, one wins."""
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
        exists = RowExistsError(f"{table} row {key} is already stored in {path}; rows are never "
                                "written twice")
        if path.exists() and not overwrite:
            raise exists
        frame = pd.DataFrame(rows)
        try:
            _write_atomic(path, lambda p: frame.to_parquet(p, index=False), exclusive=not overwrite)
        except FileExistsError:  # another worker stored it between the check and the write
            raise exists from None
        return path

    def write_env(self, env_id: str, snapshot: Mapping[str, Any]) -> None:
        d = self.root / "envs"
        d.mkdir(exist_ok=True)
        path = d / f"{env_id}.json"
        if not path.exists():
            _write_atomic(path, lambda p: p.write_text(json.dumps(snapshot, indent=2, default=str)))

    # -- reading ------------------------------------------------------------------------------
    def load(self, table: str = "runs") -> pd.DataFrame:
        """All rows of ``table`` as a DataFrame (empty, with the required columns, if none).
        ``steps`` rows whose run row is missing (the run was interrupted after its steps were
        written) are left out: that run is not finished and will be redone."""
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; tables are {', '.join(TABLES)}")
        paths = self._parts(table)
        if table == "steps":
            done = self.keys("runs")
            paths = [p for p in paths if p.stem in done]
        frames = []
        key = TABLES[table].key
        for p in paths:
            try:
                frame = pd.read_parquet(p)
            except Exception as err:  # pyarrow raises several types for a damaged file
                # a run is redone only when its run row is missing: a damaged steps part goes with it
                fix = (f"delete it and its run row {self.root / 'runs' / p.name}, then re-run the same "
                       "command to recompute that run" if table == "steps" else
                       "delete it and re-run the same command to recompute that row")
                raise CorruptFileError(f"{p} is not a readable Parquet file ({type(err).__name__}: "
                                       f"{err}); {fix}") from None
            if not frame.empty and (key not in frame.columns or (frame[key] != p.stem).any()):
                raise ForeignFileError(f"{p} was not written by mtad-energy (its rows do not carry "
                                       f"{key} = {p.stem}, the file's name); move it out of the results "
                                       "directory")
            frames.append(frame)
        frames = [f for f in frames if not f.empty]
        if not frames:
            return pd.DataFrame(columns=list(TABLES[table].required))
        return pd.concat(frames, ignore_index=True, sort=False)

    def envs(self) -> dict[str, dict[str, Any]]:
        d = self.root / "envs"
        out = {}
        for p in sorted(q for q in d.glob("*.json") if _ENV_FILE.match(q.name)) if d.is_dir() else []:
            try:
                out[p.stem] = json.loads(p.read_text())
            except ValueError as err:
                raise CorruptFileError(f"{p} is not valid JSON ({err}); delete it") from None
        return out


def load_results(root: str | Path, table: str = "runs") -> pd.DataFrame:
    """Rows of one table of the results store in ``root`` (``runs``, ``steps``, ``batch``, ``ops``).

    Raises `StoreError` when ``root`` is not a store or holds a foreign or damaged file.
    """
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise StoreError(f"{path} is a file, not a results directory; pass the directory given as "
                         "--output (it holds mtad-energy-store.json)")
    if not path.is_dir():
        raise StoreError(f"results directory {path} does not exist; run `mtad-energy profile "
                         f"--output {path}` first")
    return ResultStore(path, create=False).load(table)
