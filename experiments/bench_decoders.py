"""Benchmark every registered decoder on one pair and a few bundled prompts (not a test).

Prints per decoder: tokens/s, block efficiency, acceptance rate, perplexity; plus Hugging Face's own
``generate(assistant_model=...)`` with the same pair and warping in the same run, and our spd's
tokens/s divided by it. Writes a CSV under experiments/results/.

    python experiments/bench_decoders.py                      # smollm2 pair on CPU
    python experiments/bench_decoders.py --model llama3-8b --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

import mtad_energy as me
from mtad_energy.bench.prompts import humaneval, mtbench
from mtad_energy.decoding.runtime.generate import encode_prompt


def hf_assisted(pair, ids: list[int], max_new_tokens: int, gamma: int, seed: int) -> tuple[int, float]:
    """Hugging Face assisted generation with the same pair and warp: (tokens, seconds)."""
    torch.manual_seed(seed)
    x = torch.tensor([ids], device=pair.device)
    t0 = time.perf_counter()
    out = pair.target.generate(x, attention_mask=torch.ones_like(x), assistant_model=pair.draft,
                               do_sample=True, temperature=1.0, top_k=10, top_p=0.9,
                               max_new_tokens=max_new_tokens, num_assistant_tokens=gamma,
                               num_assistant_tokens_schedule="constant",
                               eos_token_id=pair.eos_token_id, pad_token_id=pair.eos_token_id)
    if pair.device.type == "cuda":
        torch.cuda.synchronize()
    return out.shape[1] - len(ids), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--decoders", default=",".join(me.DECODERS))
    ap.add_argument("--n-prompts", type=int, default=2, help="per dataset (HumanEval, MT-Bench)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default="experiments/results/bench_decoders.csv")
    args = ap.parse_args()

    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    console = Console()
    pair = me.load_pair(args.model)
    prompts = humaneval(args.n_prompts) + mtbench(args.n_prompts)
    prompt_ids = [encode_prompt(pair, p.text) for p in prompts]
    names = args.decoders.split(",")
    me.generate("spd", pair, prompt_ids[0], max_new_tokens=8)  # warm-up (int8 kernels, allocator)

    rows = []
    for name in track(names, description="decoders", console=console):
        for i, (p, ids) in enumerate(zip(prompts, prompt_ids, strict=False)):
            g = me.generate(name, pair, ids, max_new_tokens=args.max_new_tokens, seed=i)
            rows.append({"decoder": name, "prompt": p.id, **g.to_dict()["stats"]})
    hf = []
    for i, ids in enumerate(prompt_ids):
        n, s = hf_assisted(pair, ids, args.max_new_tokens, 4, i)
        hf.append(n / s)
        rows.append({"decoder": "hf-assisted", "prompt": prompts[i].id, "tokens_emitted": n,
                     "decode_time_s": s, "tokens_per_s": n / s})
    df = pd.DataFrame(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)

    table = Table(title=f"{pair.name}: {pair.target_id} + {pair.draft_id} on {pair.device}, "
                  f"{len(prompts)} prompts x {args.max_new_tokens} new tokens", show_edge=False)
    for col in ("decoder", "tokens/s", "block eff.", "accept rate", "perplexity"):
        table.add_column(col, justify="left" if col == "decoder" else "right")
    agg = df.groupby("decoder", sort=False).agg(
        tps=("tokens_emitted", "sum"), secs=("decode_time_s", "sum"),
        be=("block_efficiency", "mean"), acc=("draft_accepted", "sum"),
        prop=("draft_proposed", "sum"), ppl=("perplexity", "median"))
    for name, r in agg.iterrows():
        acc = r.acc / r.prop if r.prop else None
        table.add_row(name, f"{r.tps / r.secs:.1f}", "-" if pd.isna(r.be) else f"{r.be:.2f}",
                      "-" if acc is None else f"{acc:.2f}", "-" if pd.isna(r.ppl) else f"{r.ppl:.3f}")
    console.print(table)
    spd = agg.loc["spd"] if "spd" in agg.index else None
    if spd is not None:
        hf_tps = agg.loc["hf-assisted"].tps / agg.loc["hf-assisted"].secs
        console.print(f"spd tokens/s / HF assisted tokens/s = {spd.tps / spd.secs / hf_tps:.2f} "
                      f"(median per prompt HF: {statistics.median(hf):.1f} tok/s)")
    console.print(f"rows written to {args.out}")


if __name__ == "__main__":
    main()
