"""Two vLLM engine options measured through the engine seam (`mtad_energy.engines.vllm`).

    export PYTHONPATH=$PWD OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
    python experiments/vllm_options.py compiled [--sizes 1,16]   # -> results/engines/vllm_compiled.*
    python experiments/vllm_options.py k0 [--sizes 1,8]          # -> results/engines/vllm_k0.*
    python experiments/vllm_options.py settle [--sizes 1,2,4]    # -> results/engines/vllm_settle.*

`compiled`: one engine per mode (`enforce_eager` True / False: vLLM's default compilation on the
CPU, its torch.compile cache in ~/.cache/vllm, cold or warm as found and recorded), started one
after the other (each engine's `start_s`, outside every window), then `ar`.
`k0`: what k = 0 costs in vLLM's dynamic speculative decoding per drafting method: `ar` beside
`pld` (n-gram) and `spd` (the model as its own draft) started with gamma = 3 and
``per_batch_size=1-64:0`` (speculation off at every batch size).
Both: greedy, the first 3 bundled MT-Bench prompts cycled to fill B, `--tokens` tokens, the
configurations interleaved per repeat, tokens/s = tokens / the decode window, medians; the load
average is written beside them (other processes share the cores; not probed per window).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "engines"
OFF = "1-64:0"


def mtbench_ids(n: int = 3) -> list[list[int]]:
    from transformers import AutoTokenizer

    from mtad_energy.bench.prompts import load_prompts
    from mtad_energy.decoding.runtime.generate import text_ids
    from mtad_energy.models import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    return [text_ids(tok, p.text, chat=True)  # the ids every engine decodes
            for p in load_prompts("mtbench", n)]


def interleaved(runs: dict, prompts: list[list[int]], sizes: str, tokens: int, repeats: int
                ) -> list[dict]:
    """``runs``: name -> (engine, spec). Per batch size: one unmeasured call each, then the
    repeats interleaved; the median tokens/s, its ratio to the first run's, the draft tokens."""
    rows = []
    for b in (int(s) for s in sizes.split(",")):
        batch = [prompts[i % len(prompts)] for i in range(b)]
        for engine, spec in runs.values():
            engine.generate(spec, batch, 8)
        got: dict = {name: [] for name in runs}
        drafted = dict.fromkeys(runs, 0)
        for rep in range(repeats):
            for name, (engine, spec) in runs.items():
                gens = engine.generate(spec, batch, tokens, seed=rep)
                got[name].append(sum(len(g.token_ids) for g in gens)
                                 / max(g.stats.decode_time_s for g in gens))
                drafted[name] += sum(g.stats.draft_depth or 0 for g in gens)
        first = statistics.median(next(iter(got.values())))
        for name, values in got.items():
            tps = statistics.median(values)
            rows.append({"batch_size": b, "config": name, "tok_per_s": round(tps, 1),
                         "vs_first": round(tps / first, 3), "draft_tokens": drafted[name]})
            print(rows[-1], flush=True)
    return rows


def write(name: str, doc: dict, title: str, head: list[str]) -> None:
    doc["load_average_before_after"] = [[round(x, 2) for x in lv] for lv in doc.pop("_load")]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"# {title}", "", *head, "", "| B | configuration | tok/s | vs the first | draft tokens |",
             "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['batch_size']} | {r['config']} | {r['tok_per_s']} | {r['vs_first']:.2f} | "
              f"{r['draft_tokens']} |" for r in doc["rows"]]
    lines += ["", f"Load average before / after: {doc['load_average_before_after']} on "
              f"{os.cpu_count()} cores (other processes share them; not probed per window).", ""]
    (OUT / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def compiled(args) -> None:
    from mtad_energy.config import DecoderSpec, ModelSpec
    from mtad_energy.engines.vllm import VllmEngine

    prompts, spec = mtbench_ids(), DecoderSpec.of("ar", temperature="0")
    cache = Path.home() / ".cache" / "vllm" / "torch_compile_cache"
    warm = cache.exists() and any(cache.iterdir())  # a compiled start reads it when it is there
    load, engines = [os.getloadavg()], {}
    try:
        for mode, eager in (("eager", True), ("compiled", False)):
            engines[mode] = VllmEngine(ModelSpec(), {"enforce_eager": eager})
            engines[mode].warm_up(spec, prompts[:1], args.tokens)  # starts it (timed)
        rows = interleaved({m: (e, spec) for m, e in engines.items()}, prompts, args.sizes,
                           args.tokens, args.repeats)
        start = {m: round(next(iter(e.start_s.values())), 1) for m, e in engines.items()}
        version = engines["eager"].version
    finally:
        for e in engines.values():
            e.close()
    cold = "warm" if warm else "cold"
    write("vllm_compiled", {"version": version, "tokens": args.tokens, "start_s": start,
                            "compile_cache": cold, "rows": rows, "_load": [*load, os.getloadavg()]},
          f"vLLM eager vs compiled ({version}, ar, greedy, {args.tokens} tokens, median of "
          f"{args.repeats})",
          ["`python experiments/vllm_options.py compiled`. Engine start: eager "
           f"{start['eager']} s, compiled {start['compiled']} s ({cold} torch.compile cache, "
           "~/.cache/vllm; vLLM's default compilation config on the CPU)."])


def k0(args) -> None:
    from mtad_energy.config import DecoderSpec, ModelSpec
    from mtad_energy.engines.vllm import VllmEngine

    prompts = mtbench_ids()
    specs = {"ar": DecoderSpec.of("ar", temperature="0"),
             "pld k=0": DecoderSpec.of("pld", gamma="3", per_batch_size=OFF, temperature="0"),
             "spd k=0": DecoderSpec.of("spd", gamma="3", per_batch_size=OFF, temperature="0")}
    load = [os.getloadavg()]
    engine = VllmEngine(ModelSpec(), {"max_num_seqs": 64})
    try:
        for spec in specs.values():
            engine.warm_up(spec, prompts[:1], args.tokens)  # starts each configuration
        rows = interleaved({n: (engine, s) for n, s in specs.items()}, prompts, args.sizes,
                           args.tokens, args.repeats)
        start = {k: round(v, 1) for k, v in engine.start_s.items()}
    finally:
        engine.close()
    write("vllm_k0", {"version": engine.version, "schedule": OFF, "tokens": args.tokens,
                      "start_s": start, "rows": rows, "_load": [*load, os.getloadavg()]},
          f"k = 0 in vLLM's dynamic speculative decoding ({engine.version}, enforce_eager, greedy, "
          f"{args.tokens} tokens, median of {args.repeats})",
          [f"`per_batch_size={OFF}` with gamma = 3 (speculation off at every batch size) beside "
           "`ar` (the first: 'vs the first' is vs ar); `python experiments/vllm_options.py k0`."])


def decode_probe(own: tuple[int, ...], sink: list):
    """A phase hook that appends the decode window's others' cores (``own`` counted as ours)."""
    from mtad_energy.measure.contention import ContentionProbe

    probe = ContentionProbe()

    def hook(phase: str) -> None:
        if phase == "decode":
            probe.begin("decode", own)
        elif phase == "end":
            sink.append(probe.end("decode").others_cores)
    return hook


SPIN_S = 1.0  # vLLM 0.32's worker busy-loops this long after it decoded (`shm_broadcast`)


def settle(args) -> None:
    """Whether the engine that just decoded disturbs the next configuration's engine: its worker
    busy-loops `SPIN_S` after its last step. In one process, per repeat, every configuration once
    after waiting that out (``settled``: SPIN_S + 0.1 s, outside the windows) and once straight
    after the previous one (the two modes' order alternating); tokens/s = decode_tokens / the
    decode window; per mode, each configuration's median and its ratio to ar's."""
    from mtad_energy.config import DecoderSpec, ModelSpec
    from mtad_energy.engines import vllm

    prompts = mtbench_ids()
    specs = {"ar": DecoderSpec.of("ar", temperature="0"),
             "spd k=1": DecoderSpec.of("spd", gamma="1", temperature="0"),
             "spd k=2": DecoderSpec.of("spd", gamma="2", temperature="0")}
    load = [os.getloadavg()]
    engine = vllm.VllmEngine(ModelSpec(), {"max_num_seqs": 16})
    rows = []
    try:
        for spec in specs.values():
            engine.warm_up(spec, prompts[:1], args.tokens)
        for b in (int(s) for s in args.sizes.split(",")):
            batch = [prompts[i % len(prompts)] for i in range(b)]
            got = {(m, n): [] for m in ("settled", "unsettled") for n in specs}
            others = {key: [] for key in got}
            for rep in range(args.repeats):
                for mode in (("settled", "unsettled") if rep % 2 == 0 else ("unsettled", "settled")):
                    for name, spec in specs.items():
                        if mode == "settled":
                            time.sleep(SPIN_S + 0.1)
                        hook = decode_probe(engine.processes(spec), others[(mode, name)])
                        gens = engine.generate(spec, batch, args.tokens, seed=rep, on_phase=hook)
                        got[(mode, name)].append(sum(g.stats.decode_tokens for g in gens)
                                                 / max(g.stats.decode_time_s for g in gens))
            for (mode, name), values in got.items():
                ar = statistics.median(got[(mode, "ar")])
                rows.append({"batch_size": b, "config": f"{name} ({mode})",
                             "tok_per_s": round(statistics.median(values), 1),
                             "vs_first": statistics.median(values) / ar, "draft_tokens": "-",
                             "others_cores": round(statistics.median(others[(mode, name)]), 2)})
    finally:
        engine.close()
    write("vllm_settle", {"version": engine.version, "tokens": args.tokens, "spin_s": SPIN_S,
                          "rows": rows, "_load": [*load, os.getloadavg()]},
          f"vLLM engines of one run waiting out each other's busy-loop, or not ({engine.version}, "
          f"enforce_eager, greedy, {args.tokens} tokens, median of {args.repeats})",
          ["Per repeat every configuration once with the wait (`settled`) and once without, the "
           "two modes' order alternating; 'vs the first' is vs ar in the same mode. The others' "
           "cores of each decode window (the engine's own processes excluded) are in the JSON. "
           "`python experiments/vllm_options.py settle`."])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("compiled", "k0", "settle"))
    ap.add_argument("--sizes", default=None, help="default: 1,16 (compiled), 1,8 (k0), 1,2,4 "
                                                  "(settle)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    args.sizes = args.sizes or {"compiled": "1,16", "k0": "1,8", "settle": "1,2,4"}[args.stage]
    {"compiled": compiled, "k0": k0, "settle": settle}[args.stage](args)


if __name__ == "__main__":
    main()
