"""Is the engine audit calibrated? (issue 41, item 0; issue 57, item 1) A fake engine speculates
over a tiny model pair (tests/tiny.lossless_pair: p~ and q~ far apart; T = 0.8, k = 3) with the
exact rejection sampler and with broken ones: accepting with half the right probability,
skipping every other position's test, drawing the bonus token from the previous position's p~,
resampling from p~ instead of the residual; and engines that lie: emitting their drafts while
reporting the steps they verified, or inflating their counters (one more accepted token per
rejecting chain). A sampled draft with the engine's steps recorded, the same with counters alone
(no steps), and a greedy draft (chains read off the output, as for vLLM's default draft model and
n-gram). Each run is audited from its outputs (`mtad_energy.engines.audit_output.audit_served`)
at the audit's level, over N seeds (fewer for the broken engines: each is caught or not); each
run's `untested` says what its outputs could not test (a greedy draft's rare bonus tokens; each
role apart where the steps are not recorded).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python experiments/audit_calibration.py --seeds 20 \\
        --broken-seeds 8    # ~20 min on a shared 2-core machine (one core)

Writes experiments/results/engines/audit_calibration.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

OUT = ROOT / "experiments" / "results" / "engines"
PROMPTS = [[1, 2, 3, 1], [2, 4, 1, 0], [3, 3, 1, 2], [0, 1, 2, 3], [4, 0, 4, 1], [1, 1, 0, 2],
           [2, 2, 4, 3], [0, 3, 1, 4], [3, 0, 2, 2], [4, 4, 1, 3], [1, 3, 0, 0], [2, 0, 3, 4],
           [0, 0, 4, 2], [3, 4, 2, 1], [4, 2, 0, 1], [1, 4, 3, 0]]
LEVEL = 1e-3  # the audit's level (its flag)


def engines(sp) -> dict[str, dict]:
    """Each engine as `speculation.served_run`'s keywords."""
    return {"exact": {}, "half": {"accept": sp.half}, "skips every other test": {"accept": sp.skips_odd},
            "bonus from the previous p": {"after": sp.bonus_from_previous},
            "resamples from p": {"after": sp.resample_from_p},
            "lies: emits its drafts": {"lies": True}, "lies: inflates its counters": {"inflates": True}}


def drafts(sp) -> dict[str, dict]:
    return {"sampled, steps": {"rule": sp.SAMPLED},
            "sampled, counters only": {"rule": sp.SAMPLED, "steps_recorded": False},
            "greedy": {"rule": sp.GREEDY}}


def summary(draft: str, engine: str, runs: list[dict]) -> dict:
    n = len(runs)
    return {"draft": draft, "engine": engine, "seeds": n,
            "flagged": sum(bool(r["flags"]) for r in runs),
            "contradicts": sum("counters contradict output" in r["flags"] for r in runs),
            "under": sum("under-accepts" in r["flags"] for r in runs),
            "over": sum("over-accepts" in r["flags"] for r in runs),
            "lossy": sum("lossy" in r["flags"] for r in runs),
            "untested": sum(bool(r["untested"]) for r in runs),
            "bonus_tokens": ([r["bonus_tokens"] for r in runs] if runs[0]["bonus_tokens"] is not None
                             else None),
            "acceptance_p_below_0.05": sum(min(r["p_under"], r["p_over"]) < 0.05 for r in runs),
            "output_p_below_0.05": sum(r["output_p"] < 0.05 for r in runs),
            "mean_positions_per_run": sum(r["positions"] for r in runs) / n, "runs": runs}


def bonus_range(counts: list[int] | None) -> str:
    """The bonus tokens per run where the roles are known: "min-max" (else "-")."""
    return "-" if counts is None else f"{min(counts)}-{max(counts)}"


def main(argv=None) -> int:
    from mtad_energy.decoding.rules.sampling import Warp
    from tests import tiny
    from tests.engines import speculation as sp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=16, help="runs of the exact engine per draft")
    ap.add_argument("--broken-seeds", type=int, default=6, help="runs of each broken engine")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    pair, warp, k = tiny.lossless_pair(), Warp(temperature=0.8, top_k=0, top_p=1.0), 3
    rows, t_start = [], time.perf_counter()
    for draft_name, draft_kw in drafts(sp).items():
        for engine_name, engine_kw in engines(sp).items():
            t0, runs = time.perf_counter(), []
            for seed in range(args.seeds if engine_name == "exact" else args.broken_seeds):
                kw = {"accept": sp.exact, **draft_kw, **engine_kw}
                v = sp.served_run(pair, PROMPTS[: args.prompts], args.tokens, k, warp,
                                  kw.pop("accept"), seed, **kw)
                t = v.row.test
                c = v.counters
                runs.append({"seed": seed, "flags": list(v.flags),
                             "contradictions": len(v.contradictions),
                             "untested": list(v.untested),
                             "bonus_tokens": (v.output.tests["bonus tokens"].samples
                                              if "bonus tokens" in v.output.tests else None),
                             "p_under": t.p_under if t else c.p_under,
                             "p_over": t.p_over if t else c.p_over, "output_p": v.output.pvalue,
                             "output_tests": {n: r.pvalue for n, r in v.output.tests.items()},
                             "positions": sum(r.samples for n, r in v.output.tests.items()
                                              if n == "every position")})
            rows.append({**summary(draft_name, engine_name, runs),
                         "wall_s": round(time.perf_counter() - t0, 1)})
            print({k_: v_ for k_, v_ in rows[-1].items() if k_ != "runs"}, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "audit_calibration.json").write_text(json.dumps(
        {"pair": "tests/tiny.lossless_pair", "temperature": 0.8, "k": k,
         "prompts": PROMPTS[: args.prompts], "tokens": args.tokens, "level": LEVEL,
         "wall_s": round(time.perf_counter() - t_start, 1), "rows": rows}, indent=1))
    lines = [f"| draft | engine | runs | flagged at {LEVEL:g} | contradicts output | under / over "
             "| lossy | acceptance p < 0.05 | output p < 0.05 | untested said | bonus tokens |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['draft']} | {r['engine']} | {r['seeds']} | {r['flagged']} | "
              f"{r['contradicts']} | {r['under']} / {r['over']} | {r['lossy']} | "
              f"{r['acceptance_p_below_0.05']} | {r['output_p_below_0.05']} | {r['untested']} | "
              f"{bonus_range(r['bonus_tokens'])} |" for r in rows]
    (OUT / "audit_calibration.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
