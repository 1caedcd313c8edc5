"""Benchmark: eager vs compiled (`compile=True`: static KV cache + torch.compile) per decoder and
batch size.

On the default pair, in one run: at each batch size B every decoder decodes B MT-Bench prompts
(cycled) together, eagerly and compiled, interleaved within each repeat (drift hits both alike),
after a full-length warm-up per decoder, mode and B (compiled: every graph the loop uses is
compiled there; its time is reported as ``compile_s``, and the measured generations must report
none). Reports the median tokens/s (all B rows) of each mode, their ratio, and the median
target-forward time. Prints a table and writes CSV + JSON.

On a CUDA device it also times the target forward at Llama-3.1-8B shapes (random weights, bf16,
batch 1, 128 cached tokens), eager and compiled (CUDA graphs), against the memory floor
``weight bytes / measured copy bandwidth`` (goal: compiled within 1.5x of the floor).

    python experiments/bench_compile.py                      # smollm2 + its draft, 1 thread
    python experiments/bench_compile.py --batch-sizes 1,4,8 --decoders ar,spd,mtad
    python experiments/bench_compile.py --decoders ar,spd --repeats 5 --out experiments/results/x
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

from mtad_energy.bench.prompts import load_prompts
from mtad_energy.decoding.registry import DECODERS, get_decoder
from mtad_energy.decoding.runtime.generate import encode_prompt, generate_rows
from mtad_energy.models import load_pair

MODES = ("eager", "compiled")


def decoder_table(args) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    names = [n for n in args.decoders.split(",") if n]
    unknown = [n for n in names if n not in DECODERS]
    if unknown:
        raise SystemExit(f"unknown decoder(s) {unknown}; known: {', '.join(DECODERS)}")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    pair = load_pair(args.model, draft=args.draft, device=args.device)
    prompts = [encode_prompt(pair, p.text) for p in load_prompts("mtbench", args.prompts)]
    decoders = {n: get_decoder(n) for n in names}
    batches = {b: [prompts[i % len(prompts)] for i in range(b)] for b in sizes}
    compile_s: dict[tuple[str, int], float] = {}
    for b, batch in batches.items():
        for name, dec in decoders.items():
            for mode in MODES:
                gens = generate_rows(dec, pair, batch, args.max_new_tokens, seed=99,
                                     compute_perplexity=False, compile=mode == "compiled")
                if mode == "compiled":
                    compile_s[name, b] = gens[0].stats.compile_s
            print(f"warm: {name} B={b} (compiled warm-up compiled for {compile_s[name, b]:.1f} s)",
                  flush=True)
    rows = []
    t0 = time.perf_counter()
    for rep in range(args.repeats):
        for b, batch in batches.items():
            for name, dec in decoders.items():
                for mode in (MODES if (rep + b) % 2 == 0 else MODES[::-1]):
                    gens = generate_rows(dec, pair, batch, args.max_new_tokens, seed=rep,
                                         compute_perplexity=False, compile=mode == "compiled")
                    s = max(gens, key=lambda g: g.stats.decode_time_s).stats  # the last to end
                    tokens = sum(g.stats.tokens_emitted for g in gens)
                    rows.append({"decoder": name, "batch_size": b, "mode": mode, "repeat": rep,
                                 "tokens": tokens, "decode_time_s": s.decode_time_s,
                                 "tokens_per_s": tokens / s.decode_time_s,
                                 "target_forward_ms": s.time_target_s / s.target_forwards * 1e3,
                                 "other_frac": s.time_other_s / s.decode_time_s,
                                 "compile_s": s.compile_s})
        print(f"repeat {rep + 1}/{args.repeats} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    runs = pd.DataFrame(rows)
    if (runs.compile_s > 0).any():
        print("WARNING: a measured generation compiled (its row's compile_s > 0)", flush=True)
    med = (runs.groupby(["decoder", "batch_size", "mode"], sort=False)
           .agg(tokens_per_s=("tokens_per_s", statistics.median),
                target_forward_ms=("target_forward_ms", statistics.median),
                runs=("repeat", "size")).unstack("mode").reset_index())
    table = pd.DataFrame({
        "decoder": med["decoder"], "batch_size": med["batch_size"],
        "eager_tok_s": med[("tokens_per_s", "eager")],
        "compiled_tok_s": med[("tokens_per_s", "compiled")],
        "eager_target_ms": med[("target_forward_ms", "eager")],
        "compiled_target_ms": med[("target_forward_ms", "compiled")],
        "runs": med[("runs", "eager")],
    })
    table["compile_s"] = [compile_s[d, b] for d, b in zip(table.decoder, table.batch_size,
                                                           strict=True)]
    table["speedup"] = table.compiled_tok_s / table.eager_tok_s
    table = table.sort_values(["batch_size", "decoder"], key=lambda c: c.map(
        {n: i for i, n in enumerate(names)}) if c.name == "decoder" else c)
    header = (f"{args.model} (draft {pair.draft_id}) on {pair.device} "
              f"({pair.describe()['dtype']}), {torch.get_num_threads()} thread(s), "
              f"{args.max_new_tokens} tokens, batch sizes {sizes}, {args.repeats} repeats, eager "
              "and compiled interleaved (medians; tok/s of all B rows)")
    return table, runs, header


def floor_table(args) -> pd.DataFrame:
    """Target forward at a real shape vs its memory floor (CUDA only)."""
    from mtad_energy.bench.floor import copy_bandwidth, decode_forward_time, weight_bytes
    from mtad_energy.models.shapes import random_model

    bw = copy_bandwidth("cuda")
    rows = []
    for shape in args.floor_models.split(","):
        model = random_model(shape, device="cuda", dtype=torch.bfloat16)
        floor_ms = weight_bytes(model) / bw * 1e3
        for mode in MODES:
            t = decode_forward_time(model, mode=mode)
            rows.append({"model": shape, "mode": mode, "forward_ms": t.forward_ms,
                         "floor_ms": floor_ms, "x_floor": t.forward_ms / floor_ms,
                         "tokens_per_s": 1e3 / t.forward_ms, "copy_tb_per_s": bw / 1e12})
        del model
        torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--draft", default=None, help="another draft (e.g. self:layers=0-24)")
    ap.add_argument("--decoders", default="ar,spd,mtad,typical,bild,mmtad,specinfer,mcss,spectr")
    ap.add_argument("--batch-sizes", default="1", help="comma list, e.g. 1,4,8")
    ap.add_argument("--prompts", type=int, default=2, help="MT-Bench prompts")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--floor-models", default="llama3.1-8b", help="CUDA only")
    ap.add_argument("--out", default="experiments/results/bench_compile")
    args = ap.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    table, runs, header = decoder_table(args)
    print(header)
    print(table.to_string(index=False, formatters={
        "batch_size": "{:d}".format,
        "eager_tok_s": "{:.1f}".format, "compiled_tok_s": "{:.1f}".format,
        "eager_target_ms": "{:.2f}".format, "compiled_target_ms": "{:.2f}".format,
        "compile_s": "{:.0f}".format, "speedup": "{:.2f}x".format}))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out.with_suffix(".csv"), index=False)
    runs.to_csv(out.with_name(out.name + "_runs.csv"), index=False)
    meta = {"header": header, "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), **vars(args)}
    if torch.cuda.is_available() and args.floor_models:
        floor = floor_table(args)
        print("\ntarget forward vs memory floor (batch 1, 128 cached tokens, random weights, bf16)")
        print(floor.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
        floor.to_csv(out.with_name(out.name + "_floor.csv"), index=False)
        meta["gpu"] = torch.cuda.get_device_name(0)
    else:
        meta["floor"] = "not measured: no CUDA device (the floor comparison needs a GPU)"
        print("\nfloor comparison: not measured (no CUDA device)")
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2, default=str))
    print(f"wrote {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
