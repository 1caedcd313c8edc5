"""Micro-benchmark: one tree verification forward vs a chain verification of the same depth.

MMTAD verifies a beam tree of W x gamma draft nodes (+ the last emitted token at the root) in one
target forward with a 4-D tree mask; MTAD / spd verify a chain of gamma + 1 tokens. Also timed: a
plain causal forward of as many tokens as the tree (tree cost without the custom mask). All
variants run interleaved on the same cached prefix (the cache is cropped back after each), and the
median of the repeats is reported. Prints a table, writes CSV + JSON under experiments/results/.

    python experiments/bench_tree_verify.py                   # smollm2 target on CPU
    python experiments/bench_tree_verify.py --prefix-lens 64,512 --repeats 50
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

import mtad_energy as me
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.timer import PhaseTimer
from mtad_energy.decoding.runtime.tree import ancestors, tree_forward


def beam_tree(width: int, gamma: int, gen: torch.Generator) -> torch.Tensor:
    """Flat parents ``[1 + W*gamma]`` of a random beam-shaped tree (root = last emitted token)."""
    par = [torch.tensor([-1]), torch.zeros(width, dtype=torch.long)]
    for d in range(1, gamma):
        par.append(1 + (d - 1) * width + torch.randint(0, width, (width,), generator=gen))
    return torch.cat(par)


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


@torch.inference_mode()
def bench(pair, prefix_len: int, width: int, gamma: int, repeats: int, warmup: int,
          seed: int) -> list[dict]:
    dev = pair.device
    timer = PhaseTimer(dev)
    gen = torch.Generator().manual_seed(seed)
    vocab = pair.target.config.vocab_size
    prefix = torch.randint(0, vocab, (prefix_len,), generator=gen).to(dev)
    runner = ModelRunner(pair.target, timer, "target")
    runner(prefix[None, :-1])
    base = len(runner)
    n_tree = 1 + width * gamma
    anc = ancestors(beam_tree(width, gamma, gen).to(dev))
    tree_tok = torch.cat([prefix[-1:], torch.randint(0, vocab, (n_tree - 1,), generator=gen)
                          .to(dev)])
    chain_tok = tree_tok[:gamma + 1][None]

    def tree():
        tree_forward(runner, tree_tok, anc, base)
        runner.crop(base)

    def chain():
        runner(chain_tok)
        runner.crop(base)

    def flat():  # as many tokens as the tree, causal mask: isolates the custom-mask overhead
        runner(tree_tok[None])
        runner.crop(base)

    variants = {"chain": chain, "tree": tree, "flat_causal": flat}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(warmup + repeats):
        for name, fn in variants.items():  # interleaved: drift hits every variant alike
            t = timed(fn, timer.sync)
            if i >= warmup:
                times[name].append(t)
    rows = []
    chain_ms = statistics.median(times["chain"]) * 1e3
    tokens = {"chain": gamma + 1, "tree": n_tree, "flat_causal": n_tree}
    for name, ts in times.items():
        med = statistics.median(ts) * 1e3
        rows.append({"prefix_len": prefix_len, "variant": name, "tokens": tokens[name],
                     "median_ms": round(med, 3), "p10_ms": round(sorted(ts)[len(ts) // 10] * 1e3, 3),
                     "ratio_vs_chain": round(med / chain_ms, 3), "repeats": len(ts)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--width", type=int, default=4, help="W beams per depth")
    ap.add_argument("--gamma", type=int, default=4, help="tree depth = chain draft length")
    ap.add_argument("--prefix-lens", default="128,512", help="cached context lengths")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = default)")
    ap.add_argument("--out", default="experiments/results/bench_tree_verify")
    args = ap.parse_args()

    import transformers
    transformers.utils.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = me.load_pair(args.model, device=args.device, with_draft=False)
    rows = []
    for plen in (int(x) for x in args.prefix_lens.split(",")):
        rows += bench(pair, plen, args.width, args.gamma, args.repeats, args.warmup, args.seed)
    df = pd.DataFrame(rows)
    print(f"{args.model} on {pair.device} ({torch.get_num_threads()} threads), W={args.width}, "
          f"gamma={args.gamma}: tree = 1 + W*gamma = {1 + args.width * args.gamma} tokens, "
          f"chain = gamma + 1 = {args.gamma + 1} tokens")
    print(df.to_string(index=False))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out.with_suffix(".csv"), index=False)
    meta = {"model": args.model, "target_id": pair.target_id, "device": str(pair.device),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "width": args.width, "gamma": args.gamma, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
