"""Benchmark: host bookkeeping per decoder (time that is neither a draft nor a target forward).

For every decoder on the default pair at batch 1: decode a few MT-Bench prompts, interleaving the
decoders within each repeat (drift hits all alike), and report the median over runs of
``other / decode`` (other = decode time - draft forwards - target forwards) and of tokens/s,
beside the issue's targets (<= 5 % for ar, spd, mtad, typical, bild; <= 10 % for the tree and
multi-draft decoders). Prints a table and writes CSV + JSON.

    python experiments/bench_overhead.py                          # smollm2 + its draft, 1 thread
    python experiments/bench_overhead.py --repeats 5 --label after --out experiments/results/x

To compare two versions of the code side by side, run this script from each checkout in turn
(e.g. with ``PYTHONPATH=/path/to/other/checkout``), alternating, with the same arguments.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

import mtad_energy
from mtad_energy.bench.prompts import load_prompts
from mtad_energy.decoding.registry import DECODERS, get_decoder
from mtad_energy.decoding.runtime.generate import encode_prompt, generate_ids
from mtad_energy.models import load_pair

TARGET = {"ar": 0.05, "spd": 0.05, "mtad": 0.05, "typical": 0.05, "bild": 0.05,
          "mmtad": 0.10, "specinfer": 0.10, "mcss": 0.10, "spectr": 0.10}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--decoders", default="ar,spd,mtad,typical,bild,mmtad,specinfer,mcss,spectr")
    ap.add_argument("--prompts", type=int, default=2, help="MT-Bench prompts")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--label", default="", help="stored in every row (e.g. before / after)")
    ap.add_argument("--out", default="experiments/results/bench_overhead")
    args = ap.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    names = [n for n in args.decoders.split(",") if n]
    unknown = [n for n in names if n not in DECODERS]
    if unknown:
        raise SystemExit(f"unknown decoder(s) {unknown}; known: {', '.join(DECODERS)}")
    pair = load_pair(args.model)
    prompts = [encode_prompt(pair, p.text) for p in load_prompts("mtbench", args.prompts)]
    decoders = {n: get_decoder(n) for n in names}
    for dec in decoders.values():  # warm-up
        generate_ids(dec, pair, prompts[0], 8, seed=0, compute_perplexity=False)
    rows = []
    t0 = time.perf_counter()
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            for name, dec in decoders.items():
                g = generate_ids(dec, pair, ids, args.max_new_tokens, seed=rep,
                                 compute_perplexity=False)
                s = g.stats
                rows.append({"label": args.label, "decoder": name, "repeat": rep, "prompt": i,
                             "tokens": s.tokens_emitted, "iterations": s.iterations,
                             "decode_time_s": s.decode_time_s, "time_draft_s": s.time_draft_s,
                             "time_target_s": s.time_target_s, "time_other_s": s.time_other_s,
                             "other_frac": s.time_other_s / s.decode_time_s,
                             "tokens_per_s": s.tokens_per_s})
        print(f"repeat {rep + 1}/{args.repeats} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    df = pd.DataFrame(rows)
    table = (df.groupby("decoder", sort=False)
             .agg(other_frac=("other_frac", statistics.median),
                  other_ms_per_iter=("time_other_s", lambda x: 0.0),
                  tokens_per_s=("tokens_per_s", statistics.median), runs=("repeat", "size"))
             .reset_index())
    per_iter = df.assign(o=df.time_other_s / df.iterations * 1e3).groupby("decoder", sort=False).o
    table["other_ms_per_iter"] = table.decoder.map(per_iter.median())
    table["target"] = table.decoder.map(TARGET)
    table["meets_target"] = table.other_frac <= table.target
    table.insert(0, "label", args.label)
    print(f"{args.model} on {pair.device}, {torch.get_num_threads()} thread(s), "
          f"{args.max_new_tokens} tokens, {len(prompts)} prompts x {args.repeats} repeats "
          f"(medians; other = decode - draft - target)")
    print(table.to_string(index=False, formatters={"other_frac": "{:.1%}".format,
                                                   "target": "{:.0%}".format,
                                                   "tokens_per_s": "{:.1f}".format,
                                                   "other_ms_per_iter": "{:.2f}".format}))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out.with_suffix(".csv"), index=False)
    df.to_csv(out.with_name(out.name + "_runs.csv"), index=False)
    meta = {"model": args.model, "device": str(pair.device), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, "prompts": len(prompts), "label": args.label,
            "package": str(Path(mtad_energy.__file__).parent)}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    print(f"wrote {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
