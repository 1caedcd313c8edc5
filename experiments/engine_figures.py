"""Figures: engines beside the project's own decoders, through the real CLI.

Runs ``mtad-energy compare --engine ENGINES --decoders ar,pld,spd`` (3 bundled MT-Bench prompts,
64 tokens, greedy, the model as its own draft: ``--draft self``; 1 thread, OpenMP wait policy
passive) into one store, then writes the table (tokens/s, speed-up over the engine's own ar,
block efficiency, acceptance, J/token n/a with the reason) as Markdown and JSON with the load
average beside it: other processes share the cores.

    python experiments/engine_figures.py                       # hf,llamacpp
    python experiments/engine_figures.py --engines hf,llamacpp,vllm --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

COLUMNS = {"model": "engine (model label)", "label": "decoder", "tokens_per_s": "tok/s",
           "speedup": "vs its ar", "block_efficiency": "block eff.",
           "acceptance_rate": "accepted/depth", "perplexity": "ppl (HF target)",
           "energy_per_token_j": "J/token"}


def markdown(summary: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * len(COLUMNS)]
    for row in summary:
        cells = []
        for key in COLUMNS:
            v = row.get(key)
            if key == "energy_per_token_j" and v is None:
                cells.append("n/a")
            elif isinstance(v, float):
                cells.append(f"{v:.3f}" if key != "tokens_per_s" else f"{v:.1f}")
            else:
                cells.append("-" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="hf,llamacpp")
    ap.add_argument("--decoders", default="ar,pld,spd")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engines")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "mtad_energy", "compare", "--engine", args.engines,
           "--decoders", args.decoders, "--dataset", "mtbench", "--n-prompts", str(args.n_prompts),
           "--max-new-tokens", str(args.max_new_tokens), "--set", "temperature=0",
           "--draft", "self", "--meter", "none", "--output", str(args.out / "store"), "--json"]
    load_before = os.getloadavg()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    load_after = os.getloadavg()
    try:
        doc = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"compare printed no JSON:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}") from None
    if "error" in doc:
        raise SystemExit(f"compare failed: {doc['error']}")
    reasons = sorted({r["energy_reason"] for r in doc["summary"] if r.get("energy_reason")})
    shown = " ".join(c if " " not in c else repr(c) for c in cmd[1:]).replace(sys.executable, "python")
    text = "\n".join([
        f"# Engines beside mtad-energy's decoders ({args.engines}; "
        f"{args.n_prompts} MT-Bench prompts, {args.max_new_tokens} tokens, greedy)", "",
        "Command (OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE):", "",
        f"    python {shown}", "",
        markdown(doc["summary"]), "",
        f"J/token n/a: {'; '.join(reasons) or '-'}.",
        f"Load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, after "
        f"{tuple(round(x, 2) for x in load_after)} on {os.cpu_count()} cores (other processes "
        "share them).", ""])
    (args.out / "figures.md").write_text(text)
    (args.out / "figures.json").write_text(json.dumps(
        {"command": cmd[1:], "load_average_before": load_before, "load_average_after": load_after,
         "summary": doc["summary"], "notes": doc.get("notes", [])}, indent=2, default=str) + "\n")
    print(text)


if __name__ == "__main__":
    main()
