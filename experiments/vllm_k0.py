"""What k = 0 costs in vLLM's dynamic speculative decoding, per drafting method, through the
engine seam: `ar` beside `pld` (n-gram) and `spd` (the model as its own draft) started with
gamma = 3 and the schedule ``per_batch_size=1-64:0`` (speculation off at every batch size).

    export PYTHONPATH=$PWD OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
    python experiments/vllm_k0.py [--sizes 1,8] [--tokens 64] [--repeats 3]

Greedy, the first 3 bundled MT-Bench prompts cycled to fill B; the three configurations
interleaved per repeat; tokens/s = tokens / the decode window. Writes
results/engines/vllm_k0.{json,md} with the load average (other processes share the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

OUT = Path(__file__).parent / "results" / "engines"
OFF = "1-64:0"


def main() -> None:
    from transformers import AutoTokenizer

    from mtad_energy.bench.prompts import load_prompts
    from mtad_energy.config import DecoderSpec, ModelSpec
    from mtad_energy.engines.vllm import VllmEngine
    from mtad_energy.models import smollm2_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    prompts = [tok.apply_chat_template([{"role": "user", "content": p.text}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
               for p in load_prompts("mtbench", 3)]
    specs = {"ar": DecoderSpec.of("ar", temperature="0"),
             "pld k=0": DecoderSpec.of("pld", gamma="3", per_batch_size=OFF, temperature="0"),
             "spd k=0": DecoderSpec.of("spd", gamma="3", per_batch_size=OFF, temperature="0")}
    load = [os.getloadavg()]
    engine = VllmEngine(ModelSpec(), {"max_num_seqs": 64})
    out: dict = {"version": engine.version, "schedule": OFF, "tokens": args.tokens, "rows": []}
    try:
        for spec in specs.values():
            engine.warm_up(spec, prompts[:1], args.tokens)  # starts each configuration
        for b in (int(s) for s in args.sizes.split(",")):
            rows = [prompts[i % len(prompts)] for i in range(b)]
            for spec in specs.values():
                engine.generate(spec, rows, 8)
            got: dict = {name: [] for name in specs}
            drafted: dict = {name: 0 for name in specs}
            for rep in range(args.repeats):
                for name, spec in specs.items():
                    gens = engine.generate(spec, rows, args.tokens, seed=rep)
                    got[name].append(sum(len(g.token_ids) for g in gens)
                                     / max(g.stats.decode_time_s for g in gens))
                    drafted[name] += sum(g.stats.draft_depth or 0 for g in gens)
            ar = statistics.median(got["ar"])
            for name in specs:
                tps = statistics.median(got[name])
                out["rows"].append({"batch_size": b, "config": name, "tok_per_s": round(tps, 1),
                                    "vs_ar": round(tps / ar, 3), "draft_tokens": drafted[name]})
                print(out["rows"][-1], flush=True)
        out["start_s"] = {k: round(v, 1) for k, v in engine.start_s.items()}
    finally:
        engine.close()
    load.append(os.getloadavg())
    out["load_average_before_after"] = [[round(x, 2) for x in lv] for lv in load]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "vllm_k0.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# k = 0 in vLLM's dynamic speculative decoding ({out['version']}, enforce_eager, "
             f"greedy, {args.tokens} tokens, median of {args.repeats})", "",
             f"`per_batch_size={OFF}` with gamma = 3 (speculation off at every batch size) beside "
             "`ar`; `python experiments/vllm_k0.py`.", "",
             "| B | configuration | tok/s | vs ar | draft tokens |", "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['batch_size']} | {r['config']} | {r['tok_per_s']} | {r['vs_ar']:.2f} | "
              f"{r['draft_tokens']} |" for r in out["rows"]]
    lines += ["", f"Load average before / after: {out['load_average_before_after']} on "
              f"{os.cpu_count()} cores (other processes share them; not probed per window).", ""]
    (OUT / "vllm_k0.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
