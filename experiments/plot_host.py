"""The host-time figure of the findings page: host time per decode iteration relative to `ar`.

Reads the two runs `bench_host.py` wrote (`experiments/results/bench_host_before.csv` and
`bench_host_after.csv`: the decode loop's host microseconds per iteration, every decoder at
B = 1 and 8, tiny random Llama pair) and draws `x_ar` (host time / `ar`'s host time in the same,
interleaved run: comparable across the two runs, which met different machine loads) per decoder,
before and after issue 31's changes, one panel per batch size.

    python experiments/plot_host.py [--out experiments/results/bench_host.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

HERE = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "bench_host.png")
    args = ap.parse_args()
    df = pd.concat([pd.read_csv(HERE / f"bench_host_{label}.csv") for label in ("before", "after")])
    df = df[df["decoder"] != "ar"]
    order = list(dict.fromkeys(df["decoder"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, batch in zip(axes, (1, 8), strict=True):
        sub = df[df["batch"] == batch].pivot_table(index="decoder", columns="label", values="x_ar")
        sub = sub.reindex(order)[["before", "after"]]
        sub.plot.bar(ax=ax, color=["#bbbbbb", "#4477aa"], width=0.8)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_title(f"B = {batch}")
        ax.set_xlabel("")
        ax.set_ylabel("host time per iteration / ar's (x, log)")
        ax.legend(title="run")
    fig.suptitle("Decode-loop host time relative to ar (tiny random Llama pair, CPU, eager; "
                 "dashed: ar)", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
