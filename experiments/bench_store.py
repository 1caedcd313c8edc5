"""Load time of a results store against its size: before (the base commit's `load_results`, one
part file after another), with parallel reading of the same part files, and after compaction.

Builds one store of N runs rows and their steps rows (1-20 iterations per run, 10.5 on average)
per size through the store's real writing path (`ResultStore.write`, steps first then the run row,
as the runner writes them; `--workers` processes write disjoint keys in parallel). Rows look like
the runner's: the same columns, ``param_<name>`` columns of 11 decoders, a 200-character text.
The smaller stores are hard links to the first part files of the largest one (the same files).

Then for each size and table (runs, steps):

- before: `load_results` of the base commit (``--base``, extracted with `git archive` and run in a
  subprocess), which opens the part files one by one;
- parallel: this tree's `load_results` on the same part files (read in parallel threads);
- compacted: `mtad-energy store compact` (timed), then this tree's `load_results`.

Every load is checked to return the same rows. The page cache is warm in every case (the files
were just written or read): what is timed is opening and parsing, not the disk.

Run: python experiments/bench_store.py [--sizes 1000,10000,100000] [--dir /tmp/bench-store]
(about 2 hours on 2 cores with 100000: the build and the base commit's loads dominate; --show
prints the last run's table). Writes experiments/results/bench_store.{csv,json}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mtad_energy.results import ResultStore, load_results, stable_key
from mtad_energy.results.store import MARKER, compact_store

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
DECODERS = {"ar": {}, "beam": {"beam_width": 4}, "mtjd": {"k": 2, "beam_width": 4},
            "spd": {"gamma": 5}, "mtad": {"gamma": 5, "beam_width": 4, "tau": 0.5},
            "mmtad": {"gamma": 5, "beam_width": 4, "tau": 0.5}, "specinfer": {"branching": "[4,2,2]"},
            "mcss": {"branching": "[4,2,2]"}, "spectr": {"num_drafts": 4, "gamma": 4},
            "bild": {"fallback": 0.5, "rollback": 2.0, "max_draft": 10},
            "typical": {"gamma": 5, "eps": 0.3, "delta": 0.09}}
OLD_LOAD = """
import json, sys, time
from mtad_energy.results import load_results
start = time.perf_counter()
frame = load_results(sys.argv[1], sys.argv[2])
took = time.perf_counter() - start
print(json.dumps({"time_s": took, "rows": len(frame), "keys": frame["run_key"].nunique()}))
"""
console = Console()


def run_row(i: int) -> tuple[str, dict, list[dict]]:
    """Run ``i``: its key, its runs row and its steps rows (as the runner builds them)."""
    name = list(DECODERS)[i % len(DECODERS)]
    key = stable_key({"bench": i})
    tokens, iterations = 32, 1 + (i * 7919) % 20
    row = {
        "run_key": key, "sweep": "compare", "created_unix_s": 1.7e9 + i, "env_id": "0" * 16,
        "model": "llama3-8b", "target_id": "meta-llama/Llama-3.1-8B", "draft_id": "meta-llama/Llama-3.2-1B",
        "decoder": name, "label": name, "compile": False, "batch_size": 1, "energy_share": 1.0,
        "params_json": json.dumps(DECODERS[name], sort_keys=True),
        **{f"param_{k}": v for k, v in DECODERS[name].items()},
        "dataset": "humaneval", "prompt_id": f"HumanEval/{i % 164}", "max_new_tokens": tokens,
        "seed": i % 5, "repeat": i % 5, "meter": "nvml-counter", "device": "cuda:0", "dtype": "bfloat16",
        "prompt_len": 100 + i % 300, "tokens_emitted": tokens, "iterations": iterations,
        "draft_proposed": 5 * iterations, "draft_accepted": 3 * iterations, "draft_depth": 5 * iterations,
        "mean_accepted_length": 3.0, "draft_forwards": 5 * iterations, "target_forwards": iterations,
        "prefill_time_s": 0.01, "decode_time_s": 0.2 + i % 7 / 10, "time_draft_s": 0.05,
        "time_target_s": 0.12, "time_other_s": 0.03, "tokens_per_s": 120.0 + i % 50,
        "block_efficiency": tokens / iterations, "acceptance_rate": 0.6, "perplexity": 3.2,
        "stop_reason": "max_new_tokens", "energy_j": 60.0 + i % 13, "prefill_energy_j": 2.0,
        "decode_energy_j": 58.0, "energy_reason": None, "energy_flags": "", "mitigated": False,
        "others_cpu_s": 0.0, "others_cores": 0.0, "contended": False,
        "energy_per_token_j": 1.9, "rouge_l": None, "text": f"def f{i}(x):\n" + "    return x\n" * 12,
    }
    steps = [{"run_key": key, "iteration": j, "emitted": 3, "proposed": 5, "draft_depth": 5,
              "accepted": 2, "draft_forwards": 5, "target_forwards": 1, "time_draft_s": 0.004,
              "time_target_s": 0.01, "time_other_s": 0.001} for j in range(iterations)]
    return key, row, steps


def write_rows(root: str, first: int, count: int) -> int:
    """One builder process: runs ``first`` .. ``first + count - 1`` through `ResultStore.write`."""
    store = ResultStore(root, create=False)
    for i in range(first, first + count):
        key, row, steps = run_row(i)
        store.write("steps", key, steps, overwrite=True)
        store.write("runs", key, [row])
    return count


def build(root: Path, n: int, workers: int) -> float:
    """A store of ``n`` runs through the real writing path; returns seconds taken."""
    ResultStore(root)
    have = len(list((root / "runs").glob("*.parquet"))) if (root / "runs").is_dir() else 0
    if have == n:
        return 0.0
    if have:
        raise SystemExit(f"{root} holds {have} runs, not {n}: remove it (or pass another --dir)")
    start = time.perf_counter()
    chunk = 500
    with ProcessPoolExecutor(workers) as pool, _progress() as bar:
        task = bar.add_task(f"writing {n} runs", total=n)
        jobs = [pool.submit(write_rows, str(root), a, min(chunk, n - a)) for a in range(0, n, chunk)]
        for job in jobs:
            bar.advance(task, job.result())
    return time.perf_counter() - start


def link_subset(big: Path, root: Path, n: int) -> None:
    """A store of the first ``n`` runs of ``big`` (hard links to its part files)."""
    if root.exists():
        shutil.rmtree(root)
    ResultStore(root)
    for table in ("runs", "steps"):
        (root / table).mkdir()
        for i in range(n):
            name = f"{stable_key({'bench': i})}.parquet"
            os.link(big / table / name, root / table / name)


def as_schema_1(root: Path) -> None:
    """The marker the base commit wrote and reads (this tree reads it too)."""
    (root / MARKER).write_text(json.dumps({"format": "mtad-energy-results", "schema_version": 1}))


def old_load(base_tree: Path, root: Path, table: str) -> dict:
    env = os.environ | {"PYTHONPATH": str(base_tree)}
    out = subprocess.run([sys.executable, "-c", OLD_LOAD, str(root), table], env=env, check=True,
                         capture_output=True, text=True, cwd=base_tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def timed_load(root: Path, table: str, repeats: int) -> tuple[float, int, int]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        frame = load_results(root, table)
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(frame), frame["run_key"].nunique()


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=console)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="runs rows per store")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "mtad-bench-store",
                    help="where the stores are built (about 35 KB per run)")
    ap.add_argument("--base", default="d515638", help="the commit whose load_results is 'before'")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="builder processes")
    ap.add_argument("--repeats", type=int, default=3, help="loads timed per case (median); the "
                    "base commit's are timed once")
    ap.add_argument("--keep", action="store_true", help="keep the stores")
    ap.add_argument("--show", action="store_true", help="print the table of the last run "
                    "(experiments/results/bench_store.json) and exit")
    args = ap.parse_args()
    if args.show:
        show(json.loads((RESULTS / "bench_store.json").read_text())["rows"])
        return
    sizes = sorted(int(s) for s in args.sizes.split(","))
    args.dir.mkdir(parents=True, exist_ok=True)
    base_tree = args.dir / f"base-{args.base}"
    if not base_tree.exists():
        base_tree.mkdir()
        archive = subprocess.run(["git", "archive", args.base, "mtad_energy"], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive, check=True)
    big = args.dir / f"runs-{sizes[-1]}-full"
    build_s = build(big, sizes[-1], args.workers)
    console.print(f"built {sizes[-1]} runs in {build_s:.0f} s ({args.workers} writer processes)")
    rows = []
    for n in sizes:
        root = args.dir / f"runs-{n}"
        link_subset(big, root, n)
        as_schema_1(root)
        cases = {}
        for table in ("runs", "steps"):
            before = old_load(base_tree, root, table)
            t_par, n_par, k_par = timed_load(root, table, args.repeats)
            cases[table] = {"before": before, "parallel": (t_par, n_par, k_par)}
            console.print(f"{n} runs, {table}: before {before['time_s']:.2f} s, parallel {t_par:.2f} s")
        start = time.perf_counter()
        done = compact_store(root)
        compact_s = time.perf_counter() - start
        for table in ("runs", "steps"):
            t_cmp, n_cmp, k_cmp = timed_load(root, table, args.repeats)
            before, (t_par, n_par, k_par) = cases[table]["before"], cases[table]["parallel"]
            if not before["rows"] == n_par == n_cmp or not before["keys"] == k_par == k_cmp == n:
                raise SystemExit(f"{n} runs, {table}: the loads disagree: before {before}, parallel "
                                 f"{n_par} rows, compacted {n_cmp} rows")
            packs = len(list((root / table / "packs").glob("*.parquet")))
            rows.append({"runs": n, "table": table, "rows": n_cmp, "files": n, "before_s": before["time_s"],
                         "parallel_s": t_par, "compact_s": compact_s, "packs": packs,
                         "compacted_s": t_cmp, "speedup": before["time_s"] / t_cmp})
        console.print(f"{n} runs: compacted in {compact_s:.1f} s ({done.parts} part files)")
        if not args.keep:
            shutil.rmtree(root)
    if not args.keep:
        shutil.rmtree(big)
    show(rows)
    RESULTS.mkdir(exist_ok=True)
    meta = {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "base": args.base,
            "build_s": build_s, "workers": args.workers}
    (RESULTS / "bench_store.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    with open(RESULTS / "bench_store.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    console.print(f"written {RESULTS / 'bench_store.csv'} and .json")


def show(rows: list[dict]) -> None:
    t = Table(title="load_results time (s) against store size", title_justify="left", show_edge=False,
              caption_justify="left")
    for col in ("runs", "table", "rows", "before", "parallel", "compact", "packs", "after",
                "gain"):
        t.add_column(col, justify="left" if col == "table" else "right", overflow="fold")
    for r in rows:
        t.add_row(str(r["runs"]), r["table"], str(r["rows"]), f"{r['before_s']:.1f}",
                  f"{r['parallel_s']:.1f}", f"{r['compact_s']:.1f}", str(r["packs"]),
                  f"{r['compacted_s']:.3f}", f"{r['speedup']:.0f}x")
    t.caption = ("seconds. before: the base commit's load, part files one by one; parallel: this "
                 "tree's, the same files read in parallel; compact: `store compact` (both tables); "
                 "after: the load once compacted; gain: before / after")
    console.print(t)


if __name__ == "__main__":
    main()
