"""The results store's file layer: the errors a store raises (each names the file and the fix),
and the file operations every path of `store.ResultStore` rests on: a write through a temporary
renamed into place (`_write_atomic`: a half-written file never looks finished, a taken name is
refused atomically, a full disk says so), an advisory `fcntl.flock` lock (`_flock`), and reading a
part file or a pack into one table whose columns are the union of theirs (`_read_parquet`,
`_to_pandas`). The store's layout, keys and compaction are `store`'s.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks, reads still count each key once
    fcntl = None  # type: ignore[assignment]

_TMP_PREFIX = ".tmp-"  # temporaries of `_write_atomic`: never a finished file


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


def _write_atomic(path: Path, write, exclusive: bool = False,
                  guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """Write through a temporary file renamed into place. ``exclusive``: fail with
    `FileExistsError` if ``path`` exists, also when another process creates it at the same moment
    (a hard link is created atomically or not at all; where the file system has no hard links,
    an existence check just before the rename leaves a window of microseconds). ``guard`` is
    entered around the rename only (it may raise `FileExistsError` too)."""
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
        with guard():
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


@contextlib.contextmanager
def _flock(path: Path, exclusive: bool, blocking: bool = True) -> Iterator[bool]:
    """An advisory lock on ``path`` (created if missing); yields False if ``blocking`` is off and
    another process holds it. Without working locks (no fcntl, or a file system that refuses
    them) it yields True: the readers' key rule still keeps every row single."""
    if fcntl is None:
        yield True
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
        held = True
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            held = False
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        yield held  # the lock goes with the descriptor, closed below
    finally:
        os.close(fd)


def _read_parquet(path: Path, pack: bool) -> pa.Table:
    # a part file is small: one read, then parsed from memory (the fastest of pyarrow's ways for
    # one-row files); a pack is read column by column on pyarrow's own threads. The pandas
    # metadata of a one-row file describes its own columns only: dropped, so that tables with
    # different columns concatenate into the union of their columns
    tab = pq.read_table(path) if pack else pq.ParquetFile(pa.BufferReader(path.read_bytes())).read()
    return tab.replace_schema_metadata(None)


def _to_pandas(tables: Sequence[pa.Table]) -> pd.DataFrame:
    """One DataFrame from tables whose columns differ (the union, missing values null)."""
    try:
        return pa.concat_tables(tables, promote_options="permissive").to_pandas()
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        # a column with different types in different files: pandas keeps it as objects
        return pd.concat([t.to_pandas() for t in tables], ignore_index=True, sort=False)


def beside_store(store: str | Path, tail: str) -> Path:
    """Where a file derived from the store in ``store`` goes: ``<store's name><tail>`` in the
    store's parent directory (a store may hold only what mtad-energy wrote, so never inside it),
    e.g. ``st/v.1`` -> ``st/v.1.md``. A path without a name of its own (``.``, ``..``) is named by
    the directory it stands for, so no derived file starts with ``tail`` alone.

    Raises:
        ValueError: the store is the file system's root, which has no name and no parent.
    """
    path = Path(store)
    if path.name in ("", ".", ".."):
        path = path.resolve()
    if not path.name:
        raise ValueError(f"the results store {store} has no name to name files beside it by; give "
                         "a store in a directory of its own (e.g. --output results/run1)")
    return path.with_name(path.name + tail)


def outside_store(path: str | Path, store: str | Path, option: str) -> Path:
    """``path`` where it is neither the store in ``store`` nor inside it; else a ValueError naming
    ``option``, the store, and the fix (checked before any work: a store holds only what
    mtad-energy wrote, and a file written into it makes every later command refuse the store)."""
    path = Path(path)
    where, root = path.resolve(), Path(store).resolve()
    if where == root or where.is_relative_to(root):
        raise ValueError(f"{option} {path} is inside the results store {store}: a store may hold "
                         f"only what mtad-energy wrote; give {option} a path outside it")
    return path
