"""Benchmark: what the instrument costs an engine (target: <= 5 % of its tokens/s).

The same (prompt, decoder) generations on llama.cpp two ways, interleaved (the order flips every
repeat, so drift and other processes' load hit both alike):

* ``alone``: llama-cpp-python driven directly: a fresh unwrapped ``Llama`` (same GGUF, threads,
  context, no extra buffer types), ``Llama.generate`` timed from its first token (the prompt's
  eval gives it) until max_new_tokens or end of generation (``pld``: its own
  ``LlamaPromptLookupDecoding``; ``spd``: `SelfDraft`, llama-cpp-python shipping no draft-model
  class, unwrapped);
* ``tool``: `LlamaCppEngine.generate` with the runner's phase windows on the ``none`` meter: the
  wrapped ``eval`` and draft, the iteration accounting, `build_generation` - the tokens/s a row
  stores.

Both decode the same tokens (checked). Reports per decoder the median tokens/s of each and the
median of the per-pair ratios tool / alone, with the load average before and after (other
processes share the cores). Prints a table and writes CSV + JSON.

    OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE python experiments/bench_engine_overhead.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import pandas as pd

from mtad_energy.bench.phase_windows import PhaseWindows
from mtad_energy.bench.prompts import load_prompts
from mtad_energy.config import DecoderSpec, ModelSpec
from mtad_energy.decoding.runtime.generate import encode_prompt
from mtad_energy.engines import load_engine
from mtad_energy.engines.llamacpp import SelfDraft, no_extra_buffer_types
from mtad_energy.measure import NoneMeter
from mtad_energy.models import load_pair


def drive_alone(llm, draft_llm, decoder: str, params: dict, prompt: list[int], new: int
                ) -> tuple[list[int], float]:
    """llama-cpp-python alone: the tokens and the decode seconds, from the first token on (the
    tool's boundary: the prompt's eval and its first token are the prefill)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if decoder == "pld":
        llm.draft_model = LlamaPromptLookupDecoding(params["max_ngram"], params["gamma"])
    elif decoder == "spd":
        llm.draft_model = SelfDraft(draft_llm, params["gamma"])
        llm.draft_model.prime(prompt[:-1])
    else:
        llm.draft_model = None
    llm.reset()
    stream = llm.generate(prompt, top_k=params["top_k"], top_p=params["top_p"], min_p=0.0,
                          typical_p=1.0, temp=params["temperature"], repeat_penalty=1.0)
    tokens = [int(next(stream))]  # the prompt's eval gives the first token: the prefill
    t0 = time.perf_counter()
    while not (llama_cpp.llama_vocab_is_eog(llm._model.vocab, tokens[-1]) or len(tokens) >= new):
        tokens.append(int(next(stream)))
    secs = time.perf_counter() - t0
    stream.close()
    return tokens, secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decoders", default="ar,pld,spd")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--n-prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engines")
    args = ap.parse_args()

    pair = load_pair("smollm2", with_draft=False)  # the tool's prompt ids (chat template)
    prompts = [encode_prompt(pair, p.text) for p in load_prompts("mtbench", args.n_prompts)]
    engine = load_engine("llamacpp", ModelSpec("smollm2"), {"n_threads": args.threads})
    from llama_cpp import Llama

    def fresh(logits_all: bool):
        with no_extra_buffer_types():
            return Llama(str(engine.path), n_ctx=engine.n_ctx, n_batch=engine.n_batch,
                         n_ubatch=engine.n_batch, n_threads=args.threads,
                         n_threads_batch=args.threads, logits_all=logits_all, verbose=False)

    alone = {"ar": fresh(False), "spec": fresh(True), "draft": fresh(False)}
    meter = NoneMeter()
    load_before = os.getloadavg()
    rows = []
    for rep in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for name in args.decoders.split(","):
                spec = DecoderSpec.of(name, temperature=0.0)
                params = engine.params(spec)
                llm = alone["ar" if name == "ar" else "spec"]
                if rep == 0 and i == 0:  # warm both up, unmeasured
                    engine.warm_up(spec, [prompt], args.max_new_tokens)
                    drive_alone(llm, alone["draft"], name, params, prompt, 8)
                results = {}
                for way in (("tool", "alone") if rep % 2 == 0 else ("alone", "tool")):
                    if way == "tool":
                        windows = PhaseWindows(meter, f"{name}/{i}/{rep}")
                        gen = engine.generate(spec, [prompt], args.max_new_tokens, 0, windows)[0]
                        results[way] = (gen.token_ids, gen.stats.tokens_per_s)
                    else:
                        toks, secs = drive_alone(llm, alone["draft"], name, params, prompt,
                                                 args.max_new_tokens)
                        results[way] = (toks, (len(toks) - 1) / secs)  # tokens after the first
                if results["tool"][0] != results["alone"][0]:
                    raise SystemExit(f"{name} prompt {i}: the tool and llama.cpp alone decoded "
                                     "different tokens; the comparison would be meaningless")
                rows.append({"decoder": name, "prompt": i, "repeat": rep,
                             "tokens": len(results["tool"][0]),
                             "tool_tokens_per_s": results["tool"][1],
                             "alone_tokens_per_s": results["alone"][1],
                             "ratio": results["tool"][1] / results["alone"][1]})
    load_after = os.getloadavg()
    engine.close()
    runs = pd.DataFrame(rows)
    table = runs.groupby("decoder", sort=False).agg(
        pairs=("ratio", "size"), alone_tokens_per_s=("alone_tokens_per_s", "median"),
        tool_tokens_per_s=("tool_tokens_per_s", "median"), ratio_median=("ratio", "median"),
        ratio_min=("ratio", "min"), ratio_max=("ratio", "max")).reset_index()
    table["overhead_pct"] = (1 - table["ratio_median"]) * 100
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs.to_csv(args.out / "engine_overhead_runs.csv", index=False)
    table.to_csv(args.out / "engine_overhead.csv", index=False)
    meta = {"engine": engine.version, "engine_config": engine.config,
            "threads": args.threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "max_new_tokens": args.max_new_tokens, "n_prompts": args.n_prompts,
            "repeats": args.repeats, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "load_average_before": load_before,
            "load_average_after": load_after,
            "summary": json.loads(table.to_json(orient="records")),
            "median_ratio_all": statistics.median(runs["ratio"])}
    (args.out / "engine_overhead.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
