"""The paper's tables and figures as `mtad-energy` commands, one spec per experiment.

    python experiments/paper.py --list
    python experiments/paper.py main batch-size                # CPU: the offline smollm2 pair
    python experiments/paper.py --profile gpu --model llama3-8b main gamma tau
    python experiments/paper.py --dry-run all                  # print the commands only

Each experiment writes to its own results store under --root (default results/paper/<profile>);
re-running resumes. `mtad-energy report DIR` turns a store into tables and figures. The CPU profile
keeps every experiment to minutes on two cores (few prompts, short outputs); the GPU profile uses
the paper's scale where it is affordable (the batch study's 3,000 runs per batch size).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Experiment:
    name: str
    paper: str  # the table or figure it reproduces
    args: tuple[str, ...]  # mtad-energy arguments shared by both profiles
    cpu: tuple[str, ...] = ()
    gpu: tuple[str, ...] = ()
    takes_model: bool = True


def ablation(decoder: str, param: str, values: str, paper: str, name: str) -> Experiment:
    return Experiment(name, paper, ("sweep", "param", "--decoder", decoder, "--param", f"{param}={values}"),
                      cpu=("--dataset", "mtbench", "--n-prompts", "2", "--max-new-tokens", "32"),
                      gpu=("--dataset", "humaneval,mtbench", "--n-prompts", "80", "--max-new-tokens", "128"))


EXPERIMENTS = {e.name: e for e in (
    Experiment("main", "Table: speed, energy and quality of all decoders (main comparison)",
               ("compare",),
               cpu=("--dataset", "humaneval,mtbench", "--n-prompts", "2", "--max-new-tokens", "32"),
               gpu=("--dataset", "humaneval,mtbench", "--n-prompts", "80", "--max-new-tokens", "128",
                    "--ops")),
    Experiment("batch-size", "Table: effect of batch size on speed and energy (OPT-13b, L40)",
               ("sweep", "batch-size", "--sizes", "1,2,4,8,16"),
               cpu=("--runs", "5"), gpu=("--runs", "3000")),
    Experiment("mtjd-k", "Figure: perplexity and Rouge-L of MTJD versus K = 1..5",
               ("sweep", "param", "--decoder", "mtjd", "--param", "k=1..5", "--baseline", "none"),
               cpu=("--dataset", "humaneval", "--n-prompts", "3", "--max-new-tokens", "32"),
               gpu=("--dataset", "chatgpt_prompts", "--n-prompts", "100", "--max-new-tokens", "128")),
    ablation("mmtad", "gamma", "3..10", "Ablation: draft length gamma", "gamma"),
    ablation("mmtad", "beam_width", "1..8", "Ablation: beam width", "beam-width"),
    ablation("mmtad", "tau", "0.1,0.3,0.5,0.7,0.9", "Ablation: verification threshold tau", "tau"),
    ablation("mtad", "top_k", "1,5,10,20,50", "Ablation: top-k warping", "top-k"),
    ablation("mtad", "top_p", "0.5,0.7,0.8,0.9,1.0", "Ablation: top-p warping", "top-p"),
)}


def command(exp: Experiment, profile: str, root: Path, model: str | None) -> list[str]:
    args = [*exp.args, *(exp.cpu if profile == "cpu" else exp.gpu)]
    if model and exp.takes_model:
        args += ["--model", model]
    return [sys.executable, "-m", "mtad_energy", *args, "--output", str(root / exp.name)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="experiments to run ('all' for every one)")
    ap.add_argument("--profile", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--model", help="pair alias (default: smollm2 on cpu; the CLI default otherwise)")
    ap.add_argument("--root", type=Path, help="results root (default results/paper/<profile>)")
    ap.add_argument("--list", action="store_true", help="list the experiments")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ns = ap.parse_args(argv)
    if ns.list or not ns.names:
        for e in EXPERIMENTS.values():
            print(f"{e.name:12s} {e.paper}")
        return 0
    names = list(EXPERIMENTS) if ns.names == ["all"] else ns.names
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        print(f"unknown experiment(s) {', '.join(unknown)}; choose from {', '.join(EXPERIMENTS)}",
              file=sys.stderr)
        return 2
    root = ns.root or Path("results/paper") / ns.profile
    for name in names:
        cmd = command(EXPERIMENTS[name], ns.profile, root, ns.model)
        print("$", shlex.join(["mtad-energy", *cmd[3:]]), flush=True)
        if not ns.dry_run:
            rc = subprocess.call(cmd)
            if rc:
                return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
