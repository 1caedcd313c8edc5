"""Small but realistic results stores, written through `ResultStore.write` as the runner does.

Two models' worth of decoders is more than the analysis needs; one model, two datasets, two
prompts per dataset, six decoder configurations (two of mtad, so labels must tell them apart),
a steps part file per run and a five-size batch sweep. ``store_dir`` has energy everywhere;
``no_energy_store_dir`` is the same sweep as a CPU run records it (energy None, with a reason).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from mtad_energy.results import ResultStore, params_json, stable_key

MODEL = "smollm2"
DATASETS = ("humaneval", "mtbench")
PROMPTS = 2
# decoder, params, tokens/s, J/token, perplexity, mean accepted draft tokens per iteration
CONFIGS = (
    ("ar", {}, 20.0, 0.60, 2.40, 0.0),
    ("bild", {"gamma": 4, "rollback": 0.5}, 24.0, 0.52, 2.10, 1.6),
    ("spd", {"gamma": 4}, 28.0, 0.45, 2.38, 1.9),
    ("mtad", {"beam_width": 4, "gamma": 4, "tau": 0.5}, 34.0, 0.36, 1.70, 2.6),
    ("mtad", {"beam_width": 4, "gamma": 4, "tau": 0.3}, 36.0, 0.34, 1.80, 2.9),
    ("mmtad", {"beam_width": 4, "gamma": 4, "tau": 0.5, "width": 2}, 38.0, 0.33, 1.65, 3.1),
)
NO_ENERGY_REASON = "meter 'none': no GPU energy counter on this machine (CPU run)"
# the paper's batch-size table (OPT-13b on an L40), 3000 target forwards per batch size
PAPER_BATCH = ((1, 42450, 1129), (2, 49621, 1191), (4, 53325, 1178), (8, 59210, 1211),
               (16, 74058, 1255))
BATCH_RUNS = 3000


@dataclass(frozen=True)
class Stores:
    energy: Path
    no_energy: Path
    decode_only: Path


def _run_rows(rng: random.Random, energy: bool) -> tuple[list[dict], dict[str, list[dict]]]:
    runs, steps = [], {}
    for dataset in DATASETS:
        for p in range(PROMPTS):
            prompt_id = f"{dataset}/{p}"
            tokens = 128 if p == 0 else 73  # different lengths: mean of rates != pooled rate
            for decoder, prm, tps, jpt, ppl, accepted in CONFIGS:
                identity = {"sweep": "profile", "model": MODEL, "decoder": decoder,
                            "params": prm, "dataset": dataset, "prompt_id": prompt_id, "repeat": 0}
                key = stable_key(identity)
                rate = tps * (1.0 + 0.08 * (p - 0.5)) * (0.9 if dataset == "mtbench" else 1.0)
                decode_s = tokens / rate
                gamma = prm.get("gamma", 0)
                run_steps, emitted, it = [], 0, 0
                while emitted < tokens:
                    acc = min(gamma, max(0, round(rng.gauss(accepted, 1.0)))) if gamma else 0
                    step_emit = min(acc + 1, tokens - emitted)
                    run_steps.append({"run_key": key, "iteration": it, "emitted": step_emit,
                                      "proposed": gamma, "accepted": min(acc, step_emit),
                                      "draft_forwards": gamma, "target_forwards": 1})
                    emitted += step_emit
                    it += 1
                proposed = sum(s["proposed"] for s in run_steps)
                acc_total = sum(s["accepted"] for s in run_steps)
                energy_j = jpt * tokens * (1.0 + 0.05 * p) if energy else None
                row = {
                    "run_key": key, "sweep": "profile", "created_unix_s": 1.7e9 + len(runs),
                    "env_id": "0123456789abcdef", "model": MODEL, "target_id": "HuggingFaceTB/SmolLM2-360M",
                    "draft_id": None if decoder == "ar" else "HuggingFaceTB/SmolLM2-135M",
                    "decoder": decoder, "params_json": params_json(prm), "dataset": dataset,
                    "prompt_id": prompt_id, "max_new_tokens": 128, "seed": 0, "repeat": 0,
                    "meter": "nvml" if energy else "none", "device": "cuda:0" if energy else "cpu",
                    "dtype": "bfloat16", "prompt_len": 40 + p, "tokens_emitted": tokens,
                    "iterations": len(run_steps), "draft_proposed": proposed, "draft_accepted": acc_total,
                    "draft_forwards": proposed, "target_forwards": len(run_steps),
                    "prefill_time_s": 0.05, "decode_time_s": decode_s, "time_draft_s": 0.3 * decode_s,
                    "time_target_s": 0.6 * decode_s, "time_other_s": 0.1 * decode_s,
                    "tokens_per_s": tokens / decode_s, "block_efficiency": tokens / len(run_steps),
                    "acceptance_rate": acc_total / proposed if proposed else None,
                    "perplexity": ppl * (1.0 + 0.1 * p), "stop_reason": "max_new_tokens",
                    "energy_j": energy_j,
                    "prefill_energy_j": 0.02 * energy_j if energy else None,
                    "decode_energy_j": 0.98 * energy_j if energy else None,
                    "energy_per_token_j": energy_j / tokens if energy else None,
                    "energy_reason": None if energy else NO_ENERGY_REASON,
                    "energy_flags": "[]", "mitigated": energy, "text": "def f(x):\n    return x",
                    "others_cpu_s": 0.0, "others_cores": 0.0, "contended": False,
                    "energy_ci_low_j": 0.97 * energy_j if energy else None,
                    "energy_ci_high_j": 1.03 * energy_j if energy else None,
                    # counted work of the decode phase (what the energy attribution reads)
                    "draft_flops": 3e8 * proposed, "draft_bytes": 2.7e8 * proposed,
                    "target_flops": 7e8 * (proposed + len(run_steps)),
                    "target_bytes": 7.2e8 * len(run_steps),
                }
                if dataset == "humaneval":
                    row["passed"] = int(rng.random() < 0.3 + ppl / 20)
                    row["rouge_l"] = 0.2 + 0.1 * rng.random()
                runs.append(row)
                steps[key] = run_steps
    return runs, steps


def _batch_rows(energy: bool) -> list[dict]:
    rows = []
    for size, energy_j, time_s in PAPER_BATCH:
        key = stable_key({"sweep": "batch", "model": "opt-13b", "batch_size": size})
        rows.append({
            "row_key": key, "sweep": "batch", "created_unix_s": 1.7e9, "env_id": "0123456789abcdef",
            "model": "opt-13b", "target_id": "facebook/opt-13b", "batch_size": size, "runs": BATCH_RUNS,
            "forwards_per_run": 1, "context_len": 128, "meter": "nvml" if energy else "none",
            "device": "cuda:0" if energy else "cpu", "dtype": "float16", "time_s": float(time_s),
            "energy_j": float(energy_j) if energy else None,
            "energy_per_run_j": energy_j / BATCH_RUNS if energy else None,
            "energy_per_input_j": energy_j / BATCH_RUNS / size if energy else None,
            "time_per_run_s": time_s / BATCH_RUNS, "time_per_input_s": time_s / BATCH_RUNS / size,
            "energy_reason": None if energy else NO_ENERGY_REASON, "energy_flags": json.dumps([]),
            "t_flop_s": 0.1 * time_s, "t_mem_s": 0.8 * time_s, "t_other_s": 0.1 * time_s,
            # OPT-13B's counted work: weights once per forward, 2 FLOPs per weight per row
            "counted_flops": 2.6e10 * size * BATCH_RUNS, "counted_bytes": (2.6e10 + 4e8 * size) * BATCH_RUNS,
            "axis": "batch", "new_tokens": 1,
        })
    return rows


# decoders across batch sizes: (decoder, batch size, tokens/s, J/token); spd beats ar at 1 and 2
# and stops beating it from 4 on, as speculative decoding does once the target is compute-bound
DECODE_BATCH = [("ar", 1, 30.0, 2.0), ("ar", 2, 55.0, 1.1), ("ar", 4, 100.0, 0.62),
                ("ar", 8, 180.0, 0.36), ("spd", 1, 60.0, 1.2), ("spd", 2, 80.0, 0.9),
                ("spd", 4, 90.0, 0.7), ("spd", 8, 120.0, 0.5)]


WARP = {"temperature": 1.0, "top_k": 10, "top_p": 0.9}  # every stored row has its defaults


def _decode_batch_rows(energy: bool, dataset: str = "mtbench", max_new_tokens: int = 32,
                       temperature: float = 1.0, repeats: int = 1, scale: float = 1.0,
                       spread: float = 0.0) -> list[dict]:
    """One sweep's rows; ``scale`` multiplies every tokens/s, repeat r adds ``spread`` * (r - 1)
    of it (so the median is the repeat-1 value)."""
    rows = []
    for (decoder, size, tok_s, jpt), rep in ((d, r) for d in DECODE_BATCH for r in range(repeats)):
        params = params_json({**WARP, "temperature": temperature,
                              **({"gamma": 4} if decoder == "spd" else {})})
        tok_s = tok_s * scale * (1.0 + spread * (rep - 1) * (decoder != "ar"))
        key = stable_key({"sweep": "decode_batch", "decoder": decoder, "batch_size": size,
                          "dataset": dataset, "max_new_tokens": max_new_tokens, "params": params,
                          "repeat": rep})
        tokens = max_new_tokens * size
        rows.append({
            "row_key": key, "created_unix_s": 1.7e9, "env_id": "0123456789abcdef",
            "model": "llama3-8b", "target_id": "meta-llama/Meta-Llama-3-8B", "draft_id": "x",
            "decoder": decoder, "params_json": params, "label": decoder, "batch_size": size,
            "dataset": dataset, "prompts": "p", "max_new_tokens": max_new_tokens, "seed": rep,
            "repeat": rep,
            "meter": "nvml" if energy else "none", "device": "cuda:0" if energy else "cpu",
            "dtype": "float16", "tokens": tokens, "decode_time_s": tokens / tok_s,
            "tokens_per_s": tok_s, "iterations": 32, "target_forwards": 32, "draft_forwards": 0,
            "block_efficiency": 1.0 if decoder == "ar" else 2.5, "acceptance_rate": None,
            "perplexity": 3.0, "energy_j": jpt * tokens if energy else None,
            "energy_per_token_j": jpt if energy else None,
            "energy_reason": None if energy else NO_ENERGY_REASON, "energy_flags": json.dumps([]),
            "others_cpu_s": 0.0, "others_cores": 0.0, "contended": False,
            "time_draft_s": 0.0 if decoder == "ar" else 0.3 * tokens / tok_s,
            "time_target_s": (1.0 if decoder == "ar" else 0.6) * tokens / tok_s * 0.95,
            "time_other_s": 0.05 * tokens / tok_s, "draft_flops": 0 if decoder == "ar" else 4e11,
            "draft_bytes": 0 if decoder == "ar" else 3e10, "target_flops": 5e11 * size,
            "target_bytes": 5e11, "draft_proposed": 0 if decoder == "ar" else 128 * size,
            "draft_accepted": 0 if decoder == "ar" else 48 * size, "rows_iterations": 32 * size,
        })
    return rows


def build_store(root: Path, energy: bool, seed: int = 0) -> Path:
    store = ResultStore(root)
    runs, steps = _run_rows(random.Random(seed), energy)
    for row in runs:
        # steps first, the run row last: the run row is the runner's commit mark
        store.write("steps", row["run_key"], steps[row["run_key"]])
        store.write("runs", row["run_key"], [row])
    for row in _batch_rows(energy):
        store.write("batch", row["row_key"], [row])
    for row in _decode_batch_rows(energy):
        store.write("decode_batch", row["row_key"], [row])
    return root


def build_decode_only_store(root: Path) -> Path:
    """What three `sweep batch-size --decoder ar,spd` runs into one --output leave, without a
    meter: the fixture sweep (mtbench, 32 tokens); the same with --set temperature=0 (twice the
    speed: ar(temperature=0) is spd(temperature=0)'s baseline, not ar); and one on humaneval
    with 64 tokens and three repeats (a setting of its own, never pooled with the first)."""
    store = ResultStore(root)
    sweeps = (_decode_batch_rows(False),
              _decode_batch_rows(False, temperature=0.0, scale=2.0),
              _decode_batch_rows(False, dataset="humaneval", max_new_tokens=64, repeats=3,
                                 scale=0.5, spread=0.3))
    for row in (r for sweep in sweeps for r in sweep):
        store.write("decode_batch", row["row_key"], [row])
    return root


@pytest.fixture(scope="session")
def stores(tmp_path_factory) -> Stores:
    root = tmp_path_factory.mktemp("stores")
    return Stores(build_store(root / "energy", energy=True),
                  build_store(root / "no-energy", energy=False),
                  build_decode_only_store(root / "decode-only"))


@pytest.fixture(scope="session")
def store_dir(stores) -> Path:
    return stores.energy


@pytest.fixture(scope="session")
def no_energy_store_dir(stores) -> Path:
    return stores.no_energy


@pytest.fixture(scope="session")
def decode_only_store_dir(stores) -> Path:
    return stores.decode_only
