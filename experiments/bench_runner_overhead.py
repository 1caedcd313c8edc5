"""Benchmark: what the profile runner adds around one generation.

The runner wraps each generation in a prefill and a decode measurement window (opened at the
decode loop's phase hooks), then computes perplexity and writes the run and its steps to the
results store. This script runs the same (prompt, seed) generations three ways, interleaved:

* ``plain``:  `generate_ids` alone (no hooks, no perplexity), the reference;
* ``hooked``: `generate_ids` with the runner's phase windows on the ``none`` meter;
* ``runner``: `Runner.run_unit` (windows + perplexity + scoring-free store writes).

It reports the median decode time (what tokens/s is computed from: it must not grow with the
hooks) and the median wall time per row (what a sweep costs), with ratios to ``plain`` measured
side by side. Prints a table and writes CSV + JSON under experiments/results/.

    python experiments/bench_runner_overhead.py                      # smollm2 target, CPU, 1 thread
    python experiments/bench_runner_overhead.py --repeats 10 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from mtad_energy.bench.phase_windows import PhaseWindows
from mtad_energy.bench.prompts import load_prompts
from mtad_energy.bench.runner import Runner, WorkUnit
from mtad_energy.config import DecoderSpec, MeasureConfig, ModelSpec, RunConfig
from mtad_energy.decoding.registry import build_decoder
from mtad_energy.decoding.runtime.generate import encode_prompt, generate_ids
from mtad_energy.measure import NoneMeter
from mtad_energy.models import load_pair
from mtad_energy.results import ResultStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--decoder", default="ar")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: least noisy)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    spec = DecoderSpec(args.decoder)
    needs_draft = build_decoder(spec).needs_draft
    pair = load_pair(args.model, with_draft=needs_draft)
    prompts = load_prompts("mtbench", args.n_prompts)
    meter = NoneMeter()
    decoder = build_decoder(spec)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for i, prompt in enumerate(prompts):
                ids = encode_prompt(pair, prompt.text)
                seed = 1000 * rep + i
                for variant in ("plain", "hooked", "runner"):
                    t0 = time.perf_counter()
                    if variant == "plain":
                        gen = generate_ids(decoder, pair, ids, args.max_new_tokens, seed=seed,
                                           compute_perplexity=False)
                        decode_s, tokens = gen.stats.decode_time_s, gen.stats.tokens_emitted
                    elif variant == "hooked":
                        windows = PhaseWindows(meter, f"bench{rep}-{i}")
                        try:
                            gen = generate_ids(decoder, pair, ids, args.max_new_tokens, seed=seed,
                                               compute_perplexity=False, on_phase=windows)
                        finally:
                            windows.close()
                        decode_s, tokens = gen.stats.decode_time_s, gen.stats.tokens_emitted
                    else:
                        # a fresh store per row so every row is measured, never skipped
                        cfg = RunConfig(decoders=(spec,), model=ModelSpec(args.model), datasets=("mtbench",),
                                        max_new_tokens=args.max_new_tokens, seed=seed,
                                        measure=MeasureConfig("none", "off"), warmup=False)
                        store = ResultStore(Path(tmp) / f"{rep}-{i}")
                        runner = Runner(cfg, store, pair=pair, meter=meter)
                        t0 = time.perf_counter()  # Runner() itself (env snapshot) is per sweep, not per row
                        row = runner.run_unit(WorkUnit(prompt, spec, 0))
                        decode_s, tokens = row["decode_time_s"], row["tokens_emitted"]
                    rows.append({"variant": variant, "repeat": rep, "prompt": prompt.id, "tokens": tokens,
                                 "decode_time_s": decode_s, "wall_time_s": time.perf_counter() - t0})
    df = pd.DataFrame(rows)
    med = df.groupby("variant")[["decode_time_s", "wall_time_s", "tokens"]].median()
    med = med.loc[["plain", "hooked", "runner"]]
    med["decode_vs_plain"] = med["decode_time_s"] / med.loc["plain", "decode_time_s"]
    med["wall_vs_plain"] = med["wall_time_s"] / med.loc["plain", "wall_time_s"]
    med["extra_wall_ms"] = 1e3 * (med["wall_time_s"] - med.loc["plain", "wall_time_s"])
    print(f"{args.decoder} on {pair.target_id}, {args.max_new_tokens} new tokens, {args.threads} thread(s), "
          f"median of {args.repeats} x {len(prompts)} interleaved rows")
    print(med.round(4).to_string())
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "runner_overhead.csv", index=False)
    (args.out / "runner_overhead.json").write_text(json.dumps({
        "model": pair.target_id, "decoder": args.decoder, "max_new_tokens": args.max_new_tokens,
        "threads": args.threads, "repeats": args.repeats, "machine": platform.platform(),
        "median": json.loads(med.to_json(orient="index"))}, indent=2))


if __name__ == "__main__":
    main()
