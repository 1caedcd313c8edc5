"""The results store's file layer: the errors a store raises (each names the file and the fix),
and the file operations every path of `store.ResultStore` rests on: a write through a temporary
renamed into place (`write_atomic`: a half-written file never looks finished, a taken name is
refused atomically, a full disk says so), an advisory `fcntl.flock` lock (`_flock`), and reading a
part file or a pack into one table whose columns are the union of theirs (`_read_parquet`,
`_to_pandas`). And where files go around a store: beside it (`beside_store`), never inside it or
any other store (`outside_store`, `check_output`: checked before anything is written), and what
such files look like when an older version or a path inside a store left them there
(`beside_file`: passed over with a warning, they hold no rows). The store's layout, keys and
compaction are `store`'s.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks, reads still count each key once
    fcntl = None  # type: ignore[assignment]

_TMP_PREFIX = ".tmp-"  # temporaries of `write_atomic`: never a finished file
MARKER = "mtad-energy-store.json"  # what makes a directory a results store


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


class StoreWarning(UserWarning):
    """Something in a store that loses no row but must not pass unsaid: a file mtad-energy wrote
    beside a store that ended up inside one, an environment snapshot that does not parse."""


def write_atomic(path: Path, write, exclusive: bool = False,
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


# what mtad-energy writes beside a store (`beside_store`) that older versions, or an
# --output / report --out inside a store, left in one: not rows, so passed over with a warning
_BESIDE_SUFFIXES = (".md", ".png", ".svg")
_BESIDE_JSON = re.compile(r"-schedule-[^/]*\.json$")


def beside_file(p: Path) -> bool:
    """A nested results store, a report, a figure or a schedule: what a command writes beside a
    store, never a row (a folder counts when it is a store or holds nothing but such files)."""
    if p.is_dir():
        return (p / MARKER).is_file() or all(
            f.is_dir() or f.suffix in _BESIDE_SUFFIXES for f in p.rglob("*"))
    return p.suffix in _BESIDE_SUFFIXES or bool(_BESIDE_JSON.search(p.name))


def strays_note(root: Path, strays: Sequence[Path]) -> str:
    """The warning for ``strays`` (`beside_file`s) found in the store in ``root``: what they are,
    that no row of theirs is read, and how to move them out."""
    nested = sum((p / MARKER).is_file() for p in strays)
    shown = ", ".join(p.name for p in strays[:5]) + (f" and {len(strays) - 5} more" if len(strays) > 5
                                                      else "")
    return (f"{root} holds {shown}: not rows of this store but what commands write beside a store "
            "(reports, figures, tables, schedules"
            + (f"; {nested} results store(s) of their own, read on their own" if nested else "")
            + f"), so they are passed over; move them out of {root} (e.g. `mv {strays[0]} "
              f"{root.parent}/`) to silence this")


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


def enclosing_store(path: str | Path) -> Path | None:
    """The results store ``path`` would lie inside (its nearest proper ancestor holding the
    marker), or None."""
    for parent in Path(path).resolve().parents:
        if (parent / MARKER).is_file():
            return parent
    return None


def _too_long(path: Path) -> str | None:
    """Why ``path`` is too long for its file system (a name over NAME_MAX, the whole over
    PATH_MAX), or None."""
    try:  # the limits of the file system the nearest existing folder is on
        near = next((p for p in path.parents if p.is_dir()), Path("/"))
        name_max, path_max = os.pathconf(near, "PC_NAME_MAX"), os.pathconf(near, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    long = next((part for part in path.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        return (f"the name {long[:24]}... is {len(os.fsencode(long))} bytes long, over the "
                f"{name_max} a name may have here")
    if len(os.fsencode(str(path))) >= path_max:
        return f"the path is {len(os.fsencode(str(path)))} bytes long, over the {path_max - 1} allowed here"
    return None


OutputKind = Literal["store", "folder", "file"]


def check_output(path: str | Path, option: str = "--output", what: str = "the results directory",
                 kind: OutputKind = "store") -> Path:
    """``path`` where a command may write, of ``kind``: a results ``store`` or another ``folder``
    it creates or reuses, or a ``file``; checked before anything loads or is written; else a
    ValueError saying it cannot create ``what`` there (naming ``option``), why, and the fix: a
    name too long for the file system, a file where a folder is (or must be), a folder where the
    file goes, a place that cannot be written, a path inside a results store (a store holds only
    what mtad-energy wrote: anything else inside it makes every command refuse that store), or,
    for any kind but ``store``, a results store itself (a report written into it does the same).
    Missing parent folders are fine: they are created."""
    path, folder = Path(path), kind != "file"
    where, cannot = path.absolute(), f"cannot create {what} {path} ({option})"
    if (why := _too_long(where)) is not None:
        raise ValueError(f"{cannot}: {why}; give {option} a shorter path")
    blocked = next((p for p in reversed(where.parents) if p.exists() and not p.is_dir()), None)
    if blocked is None and folder and path.exists() and not path.is_dir():
        blocked = path
    if blocked is not None:
        raise ValueError(f"{cannot}: {blocked} is a file, not a folder; give {option} a path under "
                         f"folders (missing ones are created), or move {blocked} away")
    if not folder and path.is_dir():
        raise ValueError(f"{path} is a folder; give {option} a file name")
    if (outer := enclosing_store(path)) is not None:
        raise ValueError(f"{path} is inside the results store {outer}: a store holds only "
                         "what mtad-energy wrote, and anything else inside it makes every command "
                         f"refuse that store; give {option} a path outside it (e.g. "
                         f"{beside_store(outer, '-' + path.name)})")
    if kind != "store" and (path / MARKER).is_file():
        raise ValueError(f"{path} is a results store, which may hold only what "
                         f"mtad-energy wrote; give {option} a folder outside any store (e.g. "
                         f"{beside_store(path, '-report')})")
    near = next(p for p in ((where,) if folder else ()) + tuple(where.parents) if p.exists())
    if not os.access(near, os.W_OK | os.X_OK):
        raise ValueError(f"{cannot}: cannot write in {near} (permission denied); give "
                         f"{option} a place you can write to")
    return path


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
