"""Is the engine audit calibrated? (issue 41, item 0) A fake engine speculates over a tiny model
pair (tests/tiny.lossless_pair: p~ and q~ far apart; T = 0.8, k = 3) with the exact rejection
sampler, one that accepts with half the right probability, and one that skips every other
position's test; a sampled draft (chains at the engine's recorded steps) and a greedy one (chains
read off the output, as for vLLM's default draft model and n-gram). Each run is audited as vLLM's
is (`mtad_energy.engines.audit`), over N seeds, and beside it the audit before issue 41: the
counters' first-position acceptance against alpha averaged over every output position.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python experiments/audit_calibration.py --seeds 20

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
PROMPTS = [[1, 2, 3, 1], [2, 4, 1, 0], [3, 3, 1, 2], [0, 1, 2, 3], [4, 0, 4, 1], [1, 1, 0, 2]]
LEVEL = 1e-3  # the audit's level (its flag)


def main(argv=None) -> int:
    from mtad_energy.decoding.rules.sampling import Warp
    from mtad_energy.engines.audit import under_acceptance_pvalue
    from tests import tiny
    from tests.engines import speculation as sp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    pair, warp, k = tiny.lossless_pair(), Warp(temperature=0.8, top_k=0, top_p=1.0), 3
    engines = {"exact": sp.exact, "half": sp.half, "skips every other test": sp.skips_odd}
    rows = []
    for draft_name, rule in (("sampled", sp.SAMPLED), ("greedy", sp.GREEDY)):
        for engine_name, accept in engines.items():
            t0, runs = time.perf_counter(), []
            for seed in range(args.seeds):
                row, all_positions = sp.audit_run(pair, PROMPTS, args.tokens, k, warp, accept, seed,
                                                  rule)
                m = row.measured
                before = under_acceptance_pvalue(m.accepted_per_pos[0], m.drafts, all_positions)
                runs.append({"seed": seed, "flag": row.flag, "p_under": row.test.p_under,
                             "p_over": row.test.p_over, "alpha1_chain_starts": row.theory_alpha1,
                             "alpha1_all_positions": all_positions,
                             "measured_pos1": row.first_pos_rate, "before_p_under": before})
            n = len(runs)
            rows.append({
                "draft": draft_name, "engine": engine_name, "seeds": n,
                "flagged_under": sum(r["flag"] == "under-accepts" for r in runs),
                "flagged_over": sum(r["flag"] == "over-accepts" for r in runs),
                "p_under_below_0.05": sum(r["p_under"] < 0.05 for r in runs),
                "p_over_below_0.05": sum(r["p_over"] < 0.05 for r in runs),
                "mean_alpha1_chain_starts": sum(r["alpha1_chain_starts"] for r in runs) / n,
                "mean_alpha1_all_positions": sum(r["alpha1_all_positions"] for r in runs) / n,
                "mean_measured_pos1": sum(r["measured_pos1"] for r in runs) / n,
                "before_flagged_under": sum(r["before_p_under"] < LEVEL for r in runs),
                "wall_s": round(time.perf_counter() - t0, 1), "runs": runs})
            print({k_: v for k_, v in rows[-1].items() if k_ != "runs"}, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "audit_calibration.json").write_text(json.dumps(
        {"pair": "tests/tiny.lossless_pair", "temperature": 0.8, "k": k, "prompts": PROMPTS,
         "tokens": args.tokens, "level": LEVEL, "rows": rows}, indent=1))
    lines = [f"| draft | engine | seeds | flagged at {LEVEL:g} (under / over) | p < 0.05 (under / "
             "over) | alpha_1 at chain starts | alpha_1 all positions | measured pos-1 | before: "
             "flagged under |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['draft']} | {r['engine']} | {r['seeds']} | {r['flagged_under']} / "
              f"{r['flagged_over']} | {r['p_under_below_0.05']} / {r['p_over_below_0.05']} | "
              f"{r['mean_alpha1_chain_starts']:.3f} | {r['mean_alpha1_all_positions']:.3f} | "
              f"{r['mean_measured_pos1']:.3f} | {r['before_flagged_under']} |" for r in rows]
    (OUT / "audit_calibration.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
