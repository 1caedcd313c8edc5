"""The batch-size sweep on tiny random models (CPU; runs=2, context_len=16, few forwards per run)."""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest
import torch

from mtad_energy.bench.batch_sweep import (
    BatchWorkload,
    batch_sweep,
    batch_table,
    design_points,
    prompt_ids,
)
from mtad_energy.measure import DevicePeaks, MitigationConfig, NoneMeter, SimulatedGPU, SimulatedMeter
from mtad_energy.results.schema import BATCH
from mtad_energy.results.store import ResultStore

PEAKS = DevicePeaks("cpu:test", peak_flops_per_s=1e11, peak_bytes_per_s=1e10, dtype="float32")
POWER_W = 150.0
FAST = {"context_len": 16, "forwards_per_run": 3, "peaks": PEAKS}


def constant_power_meter() -> SimulatedMeter:
    """A simulated GPU that draws POWER_W all the time (real clock): energy = POWER_W x time."""
    return SimulatedMeter(gpu=SimulatedGPU(idle_power_w=POWER_W, clock=time.perf_counter))


class CountingMeter(NoneMeter):
    """The `none` meter, recording the names of the windows it measured."""

    def __init__(self) -> None:
        super().__init__()
        self.windows: list[str] = []

    def begin_window(self, key: str) -> None:
        self.windows.append(key)
        super().begin_window(key)


@pytest.mark.parametrize("pair_name", ["llama_pair", "opt_pair"])
def test_simulated_meter_rows(pair_name, request, tmp_path) -> None:
    pair = request.getfixturevalue(pair_name)
    store = ResultStore(tmp_path / "store")
    rows = batch_sweep(pair, [1, 2], 2, store, constant_power_meter(), model="tiny", profile=False, **FAST)
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r, b in zip(rows, [1, 2], strict=True):
        assert set(BATCH.required) <= set(r)
        assert r["meter"] == "simulated" and r["model"] == "tiny" and r["device"] == "cpu"
        assert r["energy_j"] == pytest.approx(POWER_W * r["time_s"], rel=1e-9)
        assert r["energy_per_input_j"] == r["energy_j"] / 2 / b
        assert r["energy_per_run_j"] == r["energy_j"] / 2
        assert r["time_per_run_s"] == r["time_s"] / 2
        assert r["time_per_input_s"] == r["time_s"] / (2 * b)
        assert r["inputs"] == 2 * b and r["energy_reason"] is None
        assert isinstance(json.loads(r["energy_flags"]), list)
        assert r["t_flop_s"] is None  # profile=False
    stored = store.load("batch")
    assert sorted(stored["batch_size"]) == [1, 2]
    assert set(stored["row_key"]) == {r["row_key"] for r in rows}


def test_none_meter_stores_the_reason(llama_pair, tmp_path) -> None:
    store = ResultStore(tmp_path / "store")
    (row,) = batch_sweep(llama_pair, [2], 2, store, NoneMeter(), profile=False, **FAST)
    assert row["energy_j"] is None and row["energy_per_run_j"] is None
    assert row["energy_per_input_j"] is None
    assert row["energy_reason"] == "no energy meter selected (meter='none')"
    assert row["time_s"] > 0
    stored = store.load("batch").iloc[0]
    assert stored["energy_reason"] == row["energy_reason"]
    assert pd.isna(stored["energy_j"])
    table = batch_table(store.load("batch"))
    assert table["Energy (J)"].isna().all() and table["Time (s)"].iloc[0] == pytest.approx(row["time_s"])


def test_resume_runs_only_the_missing_batch_size(llama_pair, tmp_path) -> None:
    store = ResultStore(tmp_path / "store")
    meter = CountingMeter()
    first = batch_sweep(llama_pair, [1, 2], 2, store, meter, profile=False, **FAST)
    assert meter.windows == ["batch1", "batch2"]
    seen: list[int] = []
    second = batch_sweep(llama_pair, [1, 2, 4], 2, store, meter, profile=False,
                         progress=lambda b, row: seen.append(b), **FAST)
    assert meter.windows == ["batch1", "batch2", "batch4"]  # only batch 4 ran again
    assert seen == [1, 2, 4]
    for old, new in zip(first, second[:2], strict=True):
        assert new["row_key"] == old["row_key"]
        assert new["created_unix_s"] == old["created_unix_s"]
        assert new["time_s"] == old["time_s"]
    df = store.load("batch")
    assert len(df) == 3 and not df["row_key"].duplicated().any()
    table = batch_table(df)
    assert list(table["Batch Size"]) == [1, 2, 4]
    # a different configuration is a different row
    batch_sweep(llama_pair, [1], 3, store, meter, profile=False, **FAST)
    assert meter.windows[-1] == "batch1" and len(store.load("batch")) == 4


def test_profile_splits_the_measured_time(opt_pair, tmp_path) -> None:
    store = ResultStore(tmp_path / "store")
    (row,) = batch_sweep(opt_pair, [2], 2, store, NoneMeter(), profile=True, **FAST)
    total = row["t_flop_s"] + row["t_mem_s"] + row["t_other_s"]
    assert total == pytest.approx(row["time_s"], rel=1e-9)
    assert row["t_mem_s"] > 0 and row["t_flop_s"] >= 0 and row["t_other_s"] >= 0
    # every Linear weight is used in one matmul per row per forward: 2 FLOPs per weight
    linear_weights = sum(m.weight.numel() for m in opt_pair.target.modules()
                         if isinstance(m, torch.nn.Linear))
    assert row["flops_per_run"] >= 2 * linear_weights * 2 * FAST["forwards_per_run"]
    assert row["bytes_per_run"] > 0
    assert row["ridge_flop_per_byte"] == pytest.approx(10.0)


def test_mitigation_columns(llama_pair, tmp_path) -> None:
    store = ResultStore(tmp_path / "store")
    cfg = MitigationConfig(min_repetitions=2, min_duration_s=0.0, groups=2, gap_s=0.0, drop_s=0.0,
                           warmup_s=0.0, idle_s=0.01)
    (row,) = batch_sweep(llama_pair, [1], 2, store, constant_power_meter(), mitigation=cfg,
                         profile=False, **FAST)
    assert row["mitigated"] is True
    assert row["energy_per_run_j"] == pytest.approx(POWER_W * row["mitigated_time_per_run_s"], rel=1e-9)
    assert row["energy_per_input_j"] == row["energy_per_run_j"]  # batch 1
    assert row["energy_per_run_ci_low_j"] <= row["energy_per_run_j"] <= row["energy_per_run_ci_high_j"]
    assert row["idle_power_w"] == pytest.approx(POWER_W)
    assert row["dynamic_energy_per_run_j"] == pytest.approx(0.0, abs=1e-6)
    assert json.loads(row["mitigation"])["groups"] == 2


def test_a_run_leaves_the_cache_as_it_found_it(llama_pair) -> None:
    work = BatchWorkload(llama_pair.target, 3, context_len=16, forwards_per_run=4)
    assert work.cache_len() == 16
    work.run()
    first = work.last_ids.clone()
    assert work.cache_len() == 16
    work.run()
    assert work.cache_len() == 16
    assert torch.equal(work.last_ids, first)  # identical work: the same greedy tokens every run
    assert work.last_ids.shape == (3, 1)


def test_prompt_rows_do_not_depend_on_the_batch_size() -> None:
    big = prompt_ids(16, 16, 64, seed=0)
    assert big.shape == (16, 16) and big.dtype == torch.int64
    assert torch.equal(prompt_ids(2, 16, 64, seed=0), big[:2])
    assert not torch.equal(prompt_ids(2, 16, 64, seed=1), big[:2])
    assert int(big.min()) >= 0 and int(big.max()) < 64


def test_batch_table_columns_order_and_duplicates() -> None:
    rows = [{"batch_size": b, "energy_j": 10.0 * b, "energy_per_run_j": 5.0 * b,
             "energy_per_input_j": 5.0, "time_s": 1.0, "time_per_run_s": 0.5, "time_per_input_s": 0.5 / b,
             "meter": "zeus"} for b in (4, 1, 2)]
    table = batch_table(rows)
    assert list(table.columns) == ["Batch Size", "Energy (J)", "Energy/run (J)", "Energy/input (J)",
                                   "Time (s)", "Time/run (s)", "Time/input (s)"]
    assert list(table["Batch Size"]) == [1, 2, 4]
    assert list(table["Energy (J)"]) == [10.0, 20.0, 40.0]
    with pytest.raises(ValueError, match=r"more than one row per batch size \(they differ in meter\)"):
        batch_table([*rows, {**rows[0], "meter": "none"}])


def test_bad_arguments(llama_pair, tmp_path) -> None:
    store = ResultStore(tmp_path / "store")
    with pytest.raises(ValueError, match="batch sizes must be positive integers"):
        batch_sweep(llama_pair, [0, 2], 2, store, NoneMeter(), **FAST)
    with pytest.raises(ValueError, match="the design reaches 263 positions .* exceeds the model's 256"):
        batch_sweep(llama_pair, [1], 2, store, NoneMeter(), context_len=255, forwards_per_run=8)
    with pytest.raises(ValueError, match="exceeds the model's 256; lower --context-len, --contexts or"):
        batch_sweep(llama_pair, [1], 2, store, NoneMeter(), chunks=[250], **FAST)
    with pytest.raises(ValueError, match=r"context lengths must be positive integers, got \[0\]"):
        batch_sweep(llama_pair, [1], 2, store, NoneMeter(), contexts=[0], **FAST)


def test_design_points_name_each_point_once():
    points = design_points([1, 4], [16, 64], [8, 32], 16, 3)
    assert points == [("batch", 1, 16, 1, 3), ("batch", 4, 16, 1, 3), ("context", 1, 64, 1, 3),
                      ("chunk", 1, 16, 8, 1), ("chunk", 1, 16, 32, 1)]  # (1, 16, 1) is B=1 already


def test_context_and_chunk_axes_store_their_counted_work(llama_pair, tmp_path) -> None:
    from mtad_energy.energy.work import ModelDims, forward_work

    store = ResultStore(tmp_path / "store")
    rows = batch_sweep(llama_pair, [1, 2], 2, store, constant_power_meter(), profile=False,
                       contexts=[40], chunks=[12], **FAST)
    assert [(r["axis"], r["batch_size"], r["context_len"], r["new_tokens"]) for r in rows] == [
        ("batch", 1, 16, 1), ("batch", 2, 16, 1), ("context", 1, 40, 1), ("chunk", 1, 16, 12)]
    dims = ModelDims.from_model(llama_pair.target)
    decode = [forward_work(dims, 2, 1, 16 + k) for k in (1, 2, 3)]  # 3 forwards per run
    assert rows[1]["counted_flops_per_run"] == sum(w.flops for w in decode)
    assert rows[1]["counted_bytes"] == 2 * sum(w.bytes for w in decode)  # 2 runs
    chunk = forward_work(dims, 1, 12, 16 + 12)  # one forward of 12 tokens per run
    assert (rows[3]["counted_flops_per_run"], rows[3]["counted_bytes_per_run"]) == (chunk.flops, chunk.bytes)
    assert rows[3]["tokens"] == 2 * 12 and rows[3]["forwards"] == 2
    # the paper's table is the batch axis; decode rows keep the keys they had before the axes
    assert list(batch_table(rows)["Batch Size"]) == [1, 2]
    again = batch_sweep(llama_pair, [1, 2], 2, store, constant_power_meter(), profile=False, **FAST)
    assert [r["row_key"] for r in again] == [r["row_key"] for r in rows[:2]]
    assert len(store.load("batch")) == 4


def test_a_chunk_workload_feeds_fixed_chunks_and_crops_back(llama_pair) -> None:
    work = BatchWorkload(llama_pair.target, 2, context_len=10, forwards_per_run=2, new_tokens=5)
    assert work.chunk.shape == (2, 5)
    work.run()
    assert work.cache_len() == 10
    assert work.shapes() == [(2, 5, 15), (2, 5, 20)]
