"""Refit a GPU kit's batch study with both energy models, counting the work of its rows.

    python experiments/refit_batch.py experiments/results/gpu/nvidia-h100-80gb-hbm3

Reads ``batch.csv`` of a kit folder (rows of any kit version: older ones have no counted work, so
it is counted here from each row's shape with `mtad_energy.energy.work`: random weights at the named
shape, bf16 on a GPU), fits the paper form and the energy roofline per model and over all rows
(mitigated rows on their per-run basis), prints each coefficient with its 95 % interval and
verdict, and writes ``refit.json`` beside ``batch.csv``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def count_work(batch: pd.DataFrame, elem_bytes: int = 2) -> pd.DataFrame:
    """``counted_flops`` / ``counted_bytes`` of every row's window, from its model shape, batch
    size, context, new tokens and forwards (the kit's run definition)."""
    from mtad_energy.bench.batch_sweep import run_shapes
    from mtad_energy.energy.work import ModelDims, shapes_work
    from mtad_energy.models.shapes import config_for

    flops, nbytes = [], []
    for _, r in batch.iterrows():
        dims = ModelDims.from_config(config_for(r["model"]), elem_bytes)
        n = int(r.get("new_tokens", 1) or 1) if "new_tokens" in r else 1
        shapes = run_shapes(int(r["batch_size"]), int(r["context_len"]),
                            int(r["forwards_per_run"]), n)
        work = shapes_work(dims, shapes)
        flops.append(work.flops * int(r["runs"]))
        nbytes.append(work.bytes * int(r["runs"]))
    return batch.assign(counted_flops=flops, counted_bytes=nbytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kit", type=Path, help="a GPU kit results folder (with batch.csv)")
    args = ap.parse_args(argv)
    from mtad_energy.energy.attribution import fit_columns
    from mtad_energy.energy.fit import FORMS, fit_form

    batch = pd.read_csv(args.kit / "batch.csv")
    if "counted_flops" not in batch or batch["counted_flops"].isna().any():
        batch = count_work(batch)
    out: dict[str, dict] = {}
    for model, part in [("all", batch), *batch.groupby("model", sort=False)]:
        out[model] = {}
        for form in FORMS:
            try:
                fit = fit_form(form, *fit_columns(part, form))
            except ValueError as err:
                out[model][form] = {"error": str(err)}
                print(f"{model} / {form}: {err}")
                continue
            out[model][form] = fit.to_dict()
            print(f"\n{model} / {form}: {fit.n_rows} rows, R^2 {fit.r2:.4f}, condition number "
                  f"{fit.condition_number:.3g}")
            for c in fit.coefficients:
                print(f"  {c.symbol:9s} {c.value:11.4g} {c.unit:7s} [{c.ci_low:.4g}, {c.ci_high:.4g}]  "
                      f"{c.verdict}")
    (args.kit / "refit.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"\nwritten: {args.kit / 'refit.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
