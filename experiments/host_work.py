"""Host work per decode iteration of every decoder, eager and compiled, at B = 1 and 8.

On a GPU the host decides a compiled loop's speed: each aten op dispatched outside a compiled
graph costs ~6-8 us (H200, docs/design.md section 7). This benchmark counts, with the tool's own
counter (`mtad_energy.measure.host_work`, through `engines.hf.counted_generation`), per
decode iteration: aten ops outside compiled graphs, compiled-graph calls, the clones of their
outputs (among the ops) and host reads of device values, for each (decoder, B, mode), after a
warm-up generation that compiles every shape.

Models: random weights at the layer counts of Llama-3.1-8B (32) and Llama-3.2-1B (16) and a tiny
width (`random:tiny-llama-l32` / `-l16`), with a random EAGLE-1 head and Medusa heads: per-layer
bookkeeping scales with the layer count, widths change no count. Random weights accept almost
nothing, so iterations are mostly one-token blocks; the counts are the loop's, not acceptance's.
Compiled rows use the ``eager`` torch.compile backend (dynamo's graphs run as aten calls, paused
from the count): what the host dispatches outside the graphs is the same under inductor, which
takes minutes per graph on this CPU. A GPU clones each tensor a CUDA-graph call returns (its next
replay overwrites them): counted here as the ops they are there (``clones_per_iter``, among
``host_ops_per_iter``). Not counted (CUDA only): a pinned-memory copy per host list sent to the
device, guard checks and launches inside a call.

    OMP_NUM_THREADS=1 python experiments/host_work.py --label after          # the whole grid
    python experiments/host_work.py --decoders spd,mtad --batch 1 --modes compiled --sites 20
    python experiments/host_work.py --smoke                                  # seconds: tiny pair

Writes experiments/results/host_work/<label>.csv (one row per decoder, B, mode) and .json (with
the top call sites when --sites is given); prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mtad_energy.decoding.registry import DECODERS, get_decoder
from mtad_energy.decoding.runtime.compiled import CompileOptions
from mtad_energy.engines.hf import counted_generation
from mtad_energy.measure.host_work import HostWorkCounter, HostWorkSites
from mtad_energy.models import load_pair

OUT = Path(__file__).parent / "results" / "host_work"
COLUMNS = ("decoder", "batch", "mode", "iterations", "host_ops_per_iter", "graph_calls_per_iter",
           "clones_per_iter", "host_reads_per_iter", "seconds")


def prompts_for(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """B prompts of different lengths, each holding a repeated segment (prompt lookup finds
    n-grams to copy)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(batch):
        seg = torch.randint(0, vocab, (6,), generator=g).tolist()
        out.append(torch.randint(0, vocab, (8 + b,), generator=g).tolist() + seg + seg)
    return out


def measure(pair, name: str, batch: int, mode: str, tokens: int, sites: int) -> dict:
    decoder = get_decoder(name)
    compile = CompileOptions(backend="eager") if mode == "compiled" else False
    prompts = prompts_for(batch, pair.target.config.vocab_size)
    t0 = time.perf_counter()
    counted_generation(decoder, pair, prompts, tokens, compile=compile)  # warm-up: compiles
    counter = HostWorkSites() if sites else HostWorkCounter()
    _, work = counted_generation(decoder, pair, prompts, tokens, compile=compile, counter=counter)
    row = {"decoder": name, "batch": batch, "mode": mode, "iterations": work.iterations,
           **work.columns(), "clones_per_iter": work.clones_per_iter,
           "seconds": round(time.perf_counter() - t0, 1)}
    if sites:
        it = max(work.iterations, 1)
        row["sites"] = {s: round(n / it, 2) for s, n in counter.sites.most_common(sites)}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decoders", default=",".join(DECODERS))
    ap.add_argument("--batch", default="1,8", help="batch sizes (B > 1: batched decoders only)")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    ap.add_argument("--sites", type=int, default=0, help="keep the top N call sites per row")
    ap.add_argument("--label", default="after", help="the results' file name")
    ap.add_argument("--smoke", action="store_true", help="tiny pair, few tokens (a rehearsal)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shape = ("tiny-llama", "tiny-llama-draft") if args.smoke else ("tiny-llama-l32",
                                                                   "tiny-llama-l16")
    pair = load_pair(target=f"random:{shape[0]}",
                     draft=f"random:{shape[1]},eagle:random-v1,medusa:random", device="cpu",
                     heads=("eagle", "medusa"))
    tokens = 8 if args.smoke else args.tokens
    rows: list[dict] = []
    stem = OUT / (args.label + ("-smoke" if args.smoke else ""))
    meta = {"command": " ".join(sys.argv), "torch": torch.__version__, "target": shape[0],
            "draft": shape[1], "tokens": tokens}
    print(" ".join(f"{c:>20}" if i > 2 else f"{c:>10}" for i, c in enumerate(COLUMNS)))
    for name in args.decoders.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            if batch > 1 and not DECODERS[name].batched:
                continue
            for mode in args.modes.split(","):
                row = measure(pair, name, batch, mode, tokens, args.sites)
                rows.append(row)
                print(" ".join(f"{row[c]:>20.1f}" if isinstance(row[c], float) and i > 2
                               else f"{row[c]!s:>20}" if i > 2 else f"{row[c]!s:>10}"
                               for i, c in enumerate(COLUMNS)), flush=True)
                write(stem, meta, rows)  # after every row: a grid cut short keeps its rows
    print(f"wrote {stem}.csv and .json")
    return 0


def write(stem: Path, meta: dict, rows: list[dict]) -> None:
    """The rows so far as ``stem``.csv (`COLUMNS`) and .json (``meta`` and the rows, sites
    included)."""
    OUT.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".csv").write_text("\n".join(
        [",".join(COLUMNS)] + [",".join(str(r[c]) for c in COLUMNS) for r in rows]) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
