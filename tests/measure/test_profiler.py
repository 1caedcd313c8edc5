"""FLOP / byte accounting on CPU with ops whose FLOPs and bytes are known exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtad_energy.measure import DevicePeaks, export_trace, get_peaks, measure_peaks, profile_ops
from mtad_energy.measure.profiler import classify, device_key
from mtad_energy.paths import CACHE_ENV_VAR, cache_dir

# ridge = 10 FLOP/byte
PEAKS = DevicePeaks("cpu:test", peak_flops_per_s=1e11, peak_bytes_per_s=1e10, dtype="float32")


class TickClock:
    """Each call advances 1 s: op times become exact and deterministic."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_matmul_flops_and_bytes_exact() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    r = profile_ops(torch.mm, a, b, peaks=PEAKS)
    (op,) = r.ops
    assert op.name == "mm"
    assert op.flops == 2 * 64 * 32 * 16
    assert op.bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert r.total_flops == op.flops and r.total_bytes == op.bytes
    assert op.shapes == "float32[64, 32] float32[32, 16] -> float32[64, 16]"


def test_elementwise_ops_count_one_flop_per_element_and_read_write_once() -> None:
    x = torch.randn(1000)
    y = torch.randn(1000, dtype=torch.float64)
    r = profile_ops(lambda: (torch.relu(x), x + x, y * 2.0), peaks=PEAKS)
    by_name = {o.name: o for o in r.ops}
    assert (by_name["relu"].flops, by_name["relu"].bytes) == (1000, 8000)
    assert (by_name["add"].flops, by_name["add"].bytes) == (1000, 8000)  # x read once
    assert (by_name["mul"].flops, by_name["mul"].bytes) == (1000, 16000)  # float64
    assert all(o.bound == "memory" for o in r.ops)


def test_views_move_no_bytes_and_linear_decomposes() -> None:
    x, w = torch.randn(8, 4), torch.randn(5, 4)
    r = profile_ops(torch.nn.functional.linear, x, w, peaks=PEAKS)
    names = [(o.name, o.flops, o.bytes, o.bound) for o in r.ops]
    assert names == [("t", 0, 0, "other"), ("mm", 2 * 8 * 4 * 5, 4 * (32 + 20 + 40), "memory")]


def test_roofline_split_of_time() -> None:
    a = torch.randn(128, 128)
    v = torch.randn(128 * 128)
    clock = TickClock()  # every op takes exactly 1 tick; profile start/end take one each
    r = profile_ops(lambda: (a @ a, v + 1.0, v.view(128, 128)), peaks=PEAKS, clock=clock)
    assert [(o.name, o.bound) for o in r.ops] == [
        ("mm", "compute"),
        ("add", "memory"),
        ("view", "other"),
    ]
    assert (r.t_flop_s, r.t_mem_s) == (1.0, 1.0)
    assert r.wall_time_s == 7.0  # start, 3 ops x 2 reads, end
    assert r.t_other_s == 5.0
    table = r.table()
    assert {row["op"]: row["bound"] for row in table} == {
        "mm": "compute",
        "add": "memory",
        "view": "other",
    }
    json.dumps(r.to_dict())


def test_classify() -> None:
    assert classify(100, 10, 10.0) == "compute"
    assert classify(99, 10, 10.0) == "memory"
    assert classify(0, 0, 10.0) == "other"
    assert classify(5, 0, 10.0) == "compute"


def test_peaks_are_measured_once_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    assert cache_dir() == tmp_path
    calls: list[str] = []

    def fake_measure(device: str) -> DevicePeaks:
        calls.append(device)
        return DevicePeaks("ignored", 2e11, 4e10, "float32")

    first = get_peaks("cpu", measure=fake_measure)
    second = get_peaks("cpu", measure=fake_measure)
    assert calls == ["cpu"]
    assert first == second
    assert first.device == device_key("cpu") and first.ridge_flop_per_byte == 5.0
    stored = json.loads((tmp_path / "roofline.json").read_text())
    assert stored[device_key("cpu")]["peak_flops_per_s"] == 2e11
    get_peaks("cpu", measure=fake_measure, refresh=True)
    assert calls == ["cpu", "cpu"]


def test_measure_peaks_small_sizes() -> None:
    p = measure_peaks("cpu", matmul_n=64, copy_bytes=1 << 16, repeats=2)
    assert p.peak_flops_per_s > 0 and p.peak_bytes_per_s > 0 and p.dtype == "float32"


def test_export_trace_is_chrome_trace_json(tmp_path: Path) -> None:
    a = torch.randn(16, 16)
    path = export_trace(torch.mm, a, a, trace_dir=tmp_path / "tb", worker_name="unit")
    assert (
        path.parent == tmp_path / "tb"
        and path.name.startswith("unit.")
        and path.name.endswith(".pt.trace.json")
    )
    trace = json.loads(path.read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names


def test_inference_mode_linear_and_attention_still_count_flops() -> None:
    """Under inference_mode, linear and sdpa reach the dispatcher whole (no addmm / bmm)."""
    import torch

    from mtad_energy.measure.profiler import DevicePeaks, profile_ops

    peaks = DevicePeaks("cpu", 1e11, 1e10, "float32")
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(4, 10, 64)
    q, k = torch.randn(1, 4, 7, 16), torch.randn(1, 4, 9, 16)

    def run() -> None:
        with torch.inference_mode():
            lin(x)
            torch.nn.functional.scaled_dot_product_attention(q, k, k)

    result = profile_ops(run, peaks=peaks)
    assert result.total_flops == 2 * 40 * 64 * 32 + 4 * 4 * 7 * 9 * 16


@pytest.mark.parametrize("op", [
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "scaled_dot_product_attention",
])
def test_grouped_query_sdpa_is_counted_with_the_query_heads(op, monkeypatch) -> None:
    """Grouped-query attention (Llama, SmolLM2: fewer K/V heads than query heads) reaches the CUDA
    sdpa kernels with K/V of H_kv heads; torch 2.11's registered sdpa formula asserts equal head
    counts and crashed the batch-size sweep on an H100. The profiler counts these ops itself."""
    from torch.utils.flop_counter import flop_registry

    from mtad_energy.measure.profiler import _op_flops

    def torch_2_11_formula(*args, **kwargs):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    packet = getattr(torch.ops.aten, op)
    if packet in flop_registry:
        monkeypatch.setitem(flop_registry, packet, torch_2_11_formula)
    b, h, h_kv, lq, lk, d = 2, 8, 2, 3, 7, 16
    q, k, v = torch.randn(b, h, lq, d), torch.randn(b, h_kv, lk, d), torch.randn(b, h_kv, lk, d)
    out = torch.empty(b, h, lq, d)
    assert _op_flops(packet.default, (q, k, v), {}, out) == 2 * (2 * b * h * lq * lk * d)


def test_profiling_a_grouped_query_llama_counts_its_attention() -> None:
    from tests import tiny

    model = tiny.llama(64, 0, layers=1)  # 4 query heads, 2 K/V heads, head dim 8
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.inference_mode():
        r = profile_ops(lambda: model(input_ids=ids), peaks=PEAKS)
    (attn,) = [o for o in r.ops if "attention" in o.name]
    assert attn.flops == 2 * (2 * 1 * 4 * 5 * 5 * 8)
