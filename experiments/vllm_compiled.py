"""vLLM's compiled start beside its eager one (issue 26: "vLLM's compiled start time, eager
measured only"), through the engine seam (`mtad_energy.engines.vllm.VllmEngine`).

    export PYTHONPATH=$PWD OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
    python experiments/vllm_compiled.py [--sizes 1,16] [--tokens 64] [--repeats 3]

One engine per mode (`enforce_eager` True / False: torch.compile, its cache in ~/.cache/vllm),
started one after the other (the start is each engine's `start_s`, outside every window); then
`ar` (greedy) on the first B bundled MT-Bench prompts (cycled), the two modes interleaved per
repeat; tokens/s as the engine reports it (decode window). Writes
results/engines/vllm_compiled.json and .md with the load average: other processes share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

OUT = Path(__file__).parent / "results" / "engines"


def main() -> None:
    from transformers import AutoTokenizer

    from mtad_energy.bench.prompts import load_prompts
    from mtad_energy.config import DecoderSpec, ModelSpec
    from mtad_energy.engines.vllm import VllmEngine
    from mtad_energy.models import smollm2_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    prompts = [tok.apply_chat_template([{"role": "user", "content": p.text}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for p in load_prompts("mtbench", 3)]
    spec = DecoderSpec.of("ar", temperature="0")
    load = [os.getloadavg()]
    cache = Path.home() / ".cache" / "vllm" / "torch_compile_cache"
    warm = cache.exists() and any(cache.iterdir())  # a compiled start reads it when it is there
    engines = {}
    for mode, eager in (("eager", True), ("compiled", False)):
        engine = VllmEngine(ModelSpec(), {"enforce_eager": eager})
        engine.warm_up(spec, prompts[:1], args.tokens)  # starts it (timed) and warms it up
        engines[mode] = engine
    result = {"start_s": {m: round(next(iter(e.start_s.values())), 1) for m, e in engines.items()},
              "version": engines["eager"].version, "tokens": args.tokens,
              "compile_cache": "warm" if warm else "cold", "tok_per_s": {}}
    try:
        for b in (int(s) for s in args.sizes.split(",")):
            rows = [prompts[i % len(prompts)] for i in range(b)]
            for e in engines.values():
                e.generate(spec, rows, 8)  # first call at this size
            got = {m: [] for m in engines}
            for rep in range(args.repeats):
                for mode, e in engines.items():
                    gens = e.generate(spec, rows, args.tokens, seed=rep)
                    tokens = sum(len(g.token_ids) for g in gens)
                    got[mode].append(tokens / max(g.stats.decode_time_s for g in gens))
            result["tok_per_s"][str(b)] = {m: round(statistics.median(v), 1) for m, v in got.items()}
            print(b, result["tok_per_s"][str(b)], flush=True)
    finally:
        for e in engines.values():
            e.close()
    load.append(os.getloadavg())
    result["load_average_before_after"] = [[round(x, 2) for x in lv] for lv in load]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "vllm_compiled.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# vLLM eager vs compiled ({result['version']}, ar, greedy, {args.tokens} tokens, "
             f"median of {args.repeats})", "",
             f"Engine start: eager {result['start_s']['eager']} s, compiled "
             f"{result['start_s']['compiled']} s ({result['compile_cache']} torch.compile cache, "
             "~/.cache/vllm; vLLM's default compilation config on the CPU).",
             "", "| B | eager tok/s | compiled tok/s |", "|---:|---:|---:|"]
    lines += [f"| {b} | {v['eager']} | {v['compiled']} |" for b, v in result["tok_per_s"].items()]
    lines += ["", f"Load average before / after: {result['load_average_before_after']} on "
              f"{os.cpu_count()} cores.", ""]
    (OUT / "vllm_compiled.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
