"""The whole energy pipeline on the CPU against a known truth: the identifying design (batch,
context and chunk axes) measured by the simulated roofline device, whose joules follow
static_w*T + j_per_flop*FLOPs + j_per_byte*bytes of the work read off the tensors; `decompose`
must recover those coefficients within 5 %, predict held-out decoding windows, and attribute every
window's joules. A counting rule that is wrong must fail the recovery."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from mtad_energy.bench.batch_sweep import batch_sweep
from mtad_energy.bench.decode_batch import decode_batch_sweep
from mtad_energy.bench.runner import run_profile
from mtad_energy.cli import app
from mtad_energy.config import DecoderSpec, MeasureConfig, RunConfig
from mtad_energy.energy.attribution import PHASES, TERMS, attribute, fit_columns
from mtad_energy.energy.fit import fit_form
from mtad_energy.energy.work import ModelDims, forward_work
from mtad_energy.measure import RooflineDevice, SimulatedMeter
from mtad_energy.results import ResultStore, load_results
from mtad_energy.results.breakdown import decode_windows

# made-up coefficients under which every term is a visible share of a tiny model's joules
TRUTH = {"pi0_w": 5.0, "eps_flop_j": 5e-7, "eps_byte_j": 5e-7}
SIZES, CONTEXTS, CHUNKS = (1, 4, 16), (64, 192), (16, 96)


def _device() -> RooflineDevice:
    return RooflineDevice(static_w=TRUTH["pi0_w"], j_per_flop=TRUTH["eps_flop_j"],
                          j_per_byte=TRUTH["eps_byte_j"])


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, llama_pair):
    out = tmp_path_factory.mktemp("pipeline") / "store"
    store = ResultStore(out)
    meter = SimulatedMeter(device=_device())
    rows = batch_sweep(llama_pair, SIZES, 2, store, meter, model="tiny", context_len=8,
                       forwards_per_run=2, contexts=CONTEXTS, chunks=CHUNKS, profile=False)
    assert [r["axis"] for r in rows] == ["batch"] * 3 + ["context"] * 2 + ["chunk"] * 2
    config = RunConfig(decoders=(DecoderSpec("ar"), DecoderSpec.of("spd", gamma=3)),
                       n_prompts=2, max_new_tokens=6, measure=MeasureConfig("simulated"))
    run_profile(config, store, pair=llama_pair, meter=meter)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    decode_batch_sweep(llama_pair, [DecoderSpec("ar"), DecoderSpec.of("spd", gamma="2,4")], [1, 2],
                       prompts, store, meter, model="tiny", max_new_tokens=6)
    return out


def _decompose(store_dir) -> dict:
    res = CliRunner().invoke(app, ["decompose", str(store_dir), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.slow
def test_decompose_recovers_the_devices_coefficients_and_predicts_held_out_windows(store_dir):
    out = _decompose(store_dir)
    fit = out["fits"]["roofline"]
    for name, truth in TRUTH.items():
        assert fit[name] == pytest.approx(truth, rel=0.05), name
    assert all(c["identified"] for c in fit["coefficients"])
    assert "--ops" in out["fits"]["paper"]["error"]  # the design ran without the profiler
    runs = out["validation"]["runs"]
    assert {r["source"] for r in runs} == {"runs", "decode_batch"}
    assert len(runs) == 2 * 2 + 3 * 2  # runs: 2 decoders x 2 prompts; sweep: 3 labels x 2 sizes
    assert out["validation"]["median_abs_error"] < 0.01
    labels = {(a["source"], a["label"]) for a in out["attribution"]}
    assert labels == {("runs", "ar"), ("runs", "spd"), ("decode_batch", "ar"),
                      ("decode_batch", "spd(gamma=2)"), ("decode_batch", "spd(gamma=4)")}


@pytest.mark.slow
def test_every_window_is_attributed_and_the_parts_add_up_to_the_measurement(store_dir):
    fits = _decompose(store_dir)["fits"]
    from mtad_energy.results.breakdown import fit_stores

    roofline = fit_stores([store_dir])[0]["roofline"]
    assert roofline.values == pytest.approx({k: fits["roofline"][k] for k in TRUTH})
    att = attribute(decode_windows([store_dir]), roofline)
    assert att["attribution_reason"].isna().all()
    measured = att["decode_energy_j"]
    assert np.allclose(att[list(PHASES)].sum(axis=1), measured, rtol=1e-12)
    assert np.allclose(att[list(TERMS)].sum(axis=1), measured, rtol=1e-12)
    assert np.allclose(att["attribution_scale"], 1.0, atol=0.02)  # the model explains the windows
    ar = att[att["decoder"] == "ar"]
    assert (ar["draft_energy_j"] == 0).all() and (ar["rejected_draft_energy_j"] == 0).all()
    assert ar["energy_per_accepted_draft_token_j"].isna().all()  # no draft: n/a, not 0
    spd = att[att["decoder"] == "spd"]
    assert (spd["draft_energy_j"] > 0).all() and (spd["rejected_draft_energy_j"] > 0).all()
    assert (spd["rejected_draft_energy_j"] < spd["draft_energy_j"] + spd["target_energy_j"]).all()


def _no_layers_in_attention(dims, rows, new, cols, concat_cache=True):
    w = forward_work(dims, rows, new, cols, concat_cache)
    attention = 4 * rows * dims.layers * dims.heads * dims.head_dim * new * cols
    return dataclasses.replace(w, flops=w.flops - attention + attention // dims.layers)


def _weights_per_row(dims, rows, new, cols, concat_cache=True):
    w = forward_work(dims, rows, new, cols, concat_cache)
    return dataclasses.replace(w, weight_bytes=w.weight_bytes * rows)


def _kv_of_new_tokens_only(dims, rows, new, cols, concat_cache=True):
    w = forward_work(dims, rows, new, cols, concat_cache)
    return dataclasses.replace(w, kv_read_bytes=dims.kv_bytes_per_column(rows) * new)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [_no_layers_in_attention, _weights_per_row,
                                    _kv_of_new_tokens_only])
def test_a_broken_counting_rule_does_not_recover_the_coefficients(store_dir, llama_pair, broken):
    """The same measured rows, counted by a wrong rule: some coefficient misses by > 5 %."""
    batch = load_results(store_dir, "batch")
    dims = ModelDims.from_model(llama_pair.target)
    recount = []
    for _, r in batch.iterrows():
        n, ctx = int(r["new_tokens"]), int(r["context_len"])
        shapes = [(int(r["batch_size"]), n, ctx + (k + 1) * n) for k in range(int(r["forwards_per_run"]))]
        works = [broken(dims, *s) for s in shapes]
        recount.append((sum(w.flops for w in works) * r["runs"], sum(w.bytes for w in works) * r["runs"]))
    wrong = batch.assign(counted_flops=[f for f, _ in recount], counted_bytes=[b for _, b in recount])
    right = fit_form("roofline", *fit_columns(batch, "roofline"))
    fit = fit_form("roofline", *fit_columns(wrong, "roofline"))
    assert right.values == pytest.approx(TRUTH, rel=0.05)
    errors = {k: abs(fit.values[k] / v - 1.0) for k, v in TRUTH.items()}
    assert max(errors.values()) > 0.05, errors


def test_without_a_fit_or_energy_the_attribution_is_n_a_with_the_reason():
    windows = pd.DataFrame([{
        "source": "runs", "key": "k", "model": "m", "decoder": "spd", "label": "spd",
        "batch_size": 1.0, "meter": "none", "decode_energy_j": np.nan, "decode_time_s": 1.0,
        "tokens": 10.0, "share": 1.0, "energy_reason": "meter 'none' measures no energy",
        "time_draft_s": 0.3, "time_target_s": 0.6, "time_other_s": 0.1, "draft_flops": 1e6,
        "draft_bytes": 1e6, "target_flops": 1e7, "target_bytes": 1e7, "draft_proposed": 8.0,
        "draft_accepted": 4.0, "iterations": 3.0}])
    att = attribute(windows, None)
    assert att["attribution_reason"][0] == "no decode energy measured: meter 'none' measures no energy"
    assert att[list(PHASES)].isna().all(axis=None)  # n/a, never 0
    measured = windows.assign(decode_energy_j=5.0)
    assert attribute(measured, None)["attribution_reason"][0].startswith("no energy model: run")
    assert attribute(measured, "the batch rows lack counted_flops")["attribution_reason"][0] == \
        "no energy model: the batch rows lack counted_flops"


@pytest.mark.slow
def test_the_summary_table_shows_joules_per_phase_on_request(tmp_path, model_dirs):
    pair = ["--target", model_dirs["llama"], "--draft", model_dirs["llama-draft"], "--device", "cpu"]
    run = ["profile", "--decoder", "ar,spd", *pair, "--max-new-tokens", "6", "--n-prompts", "1"]
    out = tmp_path / "sim"
    sweep = CliRunner().invoke(app, ["sweep", "batch-size", *pair[:2], "--device", "cpu", "--sizes",
                                     "1,4,16", "--contexts", "64,192", "--chunks", "16,96",
                                     "--runs", "1", "--context-len", "8", "--forwards-per-run", "2",
                                     "--no-ops", "--meter", "simulated", "--output", str(out)])
    assert sweep.exit_code == 0, sweep.output
    res = CliRunner().invoke(app, [*run, "--meter", "simulated", "--output", str(out),
                                   "--columns", "energy"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    text = res.output
    assert "J/acc." in text and "rejected" in text and "speed-up" not in text  # a choice, not wider
    # the fit recovers the simulated device, so measured / predicted is 1 up to the host time
    # between the meter's window and the loop's phase timers (0.1 % on a loaded machine): a
    # missing or doubled term would be off by far more
    low, high = map(float, re.search(r"measured / predicted by the energy model: ([\d.]+) to "
                                      r"([\d.]+)", " ".join(text.split())).groups())
    assert 0.99 <= low <= high <= 1.01, (low, high)
    assert max(len(line) for line in text.splitlines()) <= 80
    res = CliRunner().invoke(app, [*run, "--meter", "none", "--output", str(tmp_path / "none"),
                                   "--columns", "energy"])
    assert res.exit_code == 0, res.output
    assert "n/a: no decode energy measured: no energy meter selected" in " ".join(res.output.split())
    assert "0.0%" not in res.output  # n/a, never 0
    bad = CliRunner().invoke(app, [*run, "--columns", "joules", "--output", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--columns 'joules': choose speed or energy" in bad.output


def test_the_price_of_drafting_on_a_hand_built_window():
    """pi0 = 10 W, 1 nJ/FLOP, 2 nJ/byte; a window measured 10 % above the model: every part
    scales by 1.1. The draft proposed 8 tokens over 2 iterations and 6 were accepted."""
    from mtad_energy.energy.fit import fit_roofline

    t, flops, nbytes = np.array([1.0, 2.0, 1.5, 3.0]), np.array([1e9, 5e9, 2e9, 1e9]), \
        np.array([1e9, 1e9, 4e9, 2e9])
    fit = fit_roofline(10.0 * t + 1e-9 * flops + 2e-9 * nbytes, t, flops, nbytes)
    draft = 10.0 * 0.2 + 1e-9 * 1e8 + 2e-9 * 2e8  # 2.5 J
    target = 10.0 * 0.5 + 1e-9 * 1e9 + 2e-9 * 1e9  # 8 J
    other = 10.0 * 0.1  # 1 J
    window = pd.DataFrame([{
        "source": "runs", "key": "k", "model": "m", "decoder": "spd", "label": "spd",
        "batch_size": 1.0, "meter": "x", "decode_energy_j": 1.1 * (draft + target + other),
        "decode_time_s": 0.8, "tokens": 9.0, "share": 1.0, "energy_reason": None,
        "time_draft_s": 0.2, "time_target_s": 0.5, "time_other_s": 0.1, "draft_flops": 1e8,
        "draft_bytes": 2e8, "target_flops": 1e9, "target_bytes": 1e9, "draft_proposed": 8.0,
        "draft_accepted": 6.0, "iterations": 2.0}])
    row = attribute(window, fit).iloc[0]
    assert row["attribution_scale"] == pytest.approx(1.1)
    assert [row[c] for c in PHASES] == pytest.approx([1.1 * draft, 1.1 * target, 1.1 * other])
    static, flop = 10.0 * 0.8, 1e-9 * 1.1e9
    assert [row[c] for c in TERMS] == pytest.approx([1.1 * static, 1.1 * flop, 1.1 * 2e-9 * 1.2e9])
    assert row["energy_per_accepted_draft_token_j"] == pytest.approx(1.1 * draft / 6)
    # the draft's joules over its 8 tokens, the target's over 8 + one per iteration: 2 rejected
    assert row["rejected_draft_energy_j"] == pytest.approx(1.1 * (draft * 2 / 8 + target * 2 / 10))
