"""The tiny test pair on a CUDA device: every decoder, the KV-cache helpers and layer-subset
self-drafts. Only invariants that do not depend on sampled values are checked (random bf16 weights
may sample EOS at once). Every test is `gpu`-marked: skipped without CUDA (see conftest.py).

The rest of the suite pins its fixture pairs to the CPU for exact, seed-determined outputs.
"""

from __future__ import annotations

import pytest
import torch

import mtad_energy as me
from mtad_energy.decoding.runtime import cache as kv
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.timer import PhaseTimer
from mtad_energy.decoding.runtime.tree import keep_path
from mtad_energy.hf_cache import cache_kwargs
from mtad_energy.models import load_pair
from tests.conftest import with_heads

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
PROMPT = [5, 9, 12, 3]
MAX_NEW = 6


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def cuda_pair(request, model_dirs):
    pair = load_pair(target=model_dirs["llama"],
                     draft=with_heads(model_dirs, model_dirs["llama-draft"], "llama"),
                     device=DEVICE, dtype=request.param)
    assert pair.device.type == torch.device(DEVICE).type and pair.draft is not None
    assert pair.target.dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[request.param]
    return pair


def check_stats(g, max_new_tokens: int, vocab: int) -> None:
    s = g.stats
    assert 1 <= s.tokens_emitted <= max_new_tokens
    assert s.tokens_emitted == len(g.token_ids) == sum(step.emitted for step in g.steps)
    assert all(0 <= t < vocab for t in g.token_ids)
    assert s.stop_reason in {"eos", "max_new_tokens"}
    if s.stop_reason == "max_new_tokens":
        assert s.tokens_emitted == max_new_tokens
    assert s.target_forwards == sum(step.target_forwards for step in g.steps) >= 1
    assert s.draft_forwards == sum(step.draft_forwards for step in g.steps)
    times = (s.time_draft_s, s.time_target_s, s.time_other_s)
    assert min(times) >= 0 and s.decode_time_s >= 0 and s.prefill_time_s >= 0
    assert sum(times) == pytest.approx(s.decode_time_s, rel=1e-6, abs=1e-9)
    for name in ("time_draft_s", "time_target_s", "time_other_s"):
        assert min(getattr(step, name) for step in g.steps) >= 0
        assert sum(getattr(step, name) for step in g.steps) == pytest.approx(
            getattr(s, name), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("name", list(me.DECODERS))
def test_every_decoder_runs_on_cuda_with_consistent_stats(cuda_pair, name):
    g = me.generate(name, cuda_pair, PROMPT, max_new_tokens=MAX_NEW, seed=3)
    check_stats(g, MAX_NEW, cuda_pair.target.config.vocab_size)
    if me.DECODERS[name].needs_draft or me.DECODERS[name].head:
        assert g.stats.draft_forwards >= 1 or g.stats.tokens_emitted == 1


def test_cache_crop_then_refeed_gives_the_logits_of_a_fresh_forward_on_cuda(model_dirs):
    model = load_pair(target=model_dirs["llama"], device=DEVICE, dtype="fp32", with_draft=False).target
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]], device=DEVICE)
    with torch.no_grad():
        fresh = model(input_ids=ids).logits
        cache = kv.new_cache(model)
        model(input_ids=ids[:, :5], **cache_kwargs(cache), use_cache=True)
        model(input_ids=ids[:, :3] + 1, **cache_kwargs(cache), use_cache=True)  # rejected
        kv.crop(cache, 5)
        assert kv.cache_len(cache) == 5
        again = model(input_ids=ids[:, 5:], **cache_kwargs(cache), use_cache=True).logits
    assert torch.allclose(again, fresh[:, 5:], atol=1e-4)


@pytest.mark.parametrize("index_device", [DEVICE, "cpu"])
def test_cache_select_rows_and_keep_positions_on_cuda(model_dirs, index_device):
    """Row / position indices may live on either device: the helpers move them to the cache's."""
    model = load_pair(target=model_dirs["llama"], device=DEVICE, dtype="fp32", with_draft=False).target
    dev = torch.device(DEVICE)
    with torch.no_grad():
        cache = kv.new_cache(model)
        model(input_ids=torch.tensor([[1, 2, 3]], device=dev), **cache_kwargs(cache), use_cache=True)
        kv.repeat_rows(cache, 3)
        model(input_ids=torch.tensor([[4], [5], [6]], device=dev), **cache_kwargs(cache), use_cache=True)
        kv.select_rows(cache, torch.tensor([1], device=index_device))
        solo = kv.new_cache(model)
        model(input_ids=torch.tensor([[1, 2, 3, 5]], device=dev), **cache_kwargs(solo), use_cache=True)
    for a, b in zip(cache.layers, solo.layers, strict=True):
        assert a.keys.device.type == dev.type
        assert torch.allclose(a.keys, b.keys, atol=1e-4) and torch.allclose(a.values, b.values, atol=1e-4)
    before = cache.layers[0].keys.clone()
    kv.keep_positions(cache, torch.tensor([0, 2], device=index_device))
    assert torch.equal(cache.layers[0].keys, before[:, :, [0, 2]]) and kv.cache_len(cache) == 2


def test_keep_path_on_cuda_keeps_the_prefix_and_the_chosen_nodes(model_dirs):
    model = load_pair(target=model_dirs["llama"], device=DEVICE, dtype="fp32", with_draft=False).target
    dev = torch.device(DEVICE)
    runner = ModelRunner(model, PhaseTimer.for_device(dev), "target")
    with torch.no_grad():
        runner(torch.tensor([[1, 2, 3]], device=dev))
        runner(torch.tensor([[4, 5, 6]], device=dev))  # three "tree nodes" after a 3-token prefix
    before = runner.cache.layers[0].keys.clone()
    keep_path(runner, 3, torch.tensor([0, 2], device=dev))
    assert len(runner) == 5
    assert torch.equal(runner.cache.layers[0].keys, before[:, :, [0, 1, 2, 3, 5]])


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_layer_subset_self_draft_on_cuda(model_dirs, dtype):
    pair = load_pair(target=model_dirs["llama"], draft="self:layers=0-1", device=DEVICE, dtype=dtype)
    t, d = pair.target, pair.draft
    assert d.config.num_hidden_layers == 2 and next(d.parameters()).device.type == torch.device(DEVICE).type
    assert d.model.layers[1].mlp.up_proj.weight.data_ptr() == t.model.layers[1].mlp.up_proj.weight.data_ptr()
    every = load_pair(target=model_dirs["llama"], draft="self:skip=", device=DEVICE, dtype=dtype)
    ids = torch.tensor([[3, 4, 5]], device=DEVICE)
    with torch.no_grad():
        assert torch.equal(every.draft(input_ids=ids).logits, every.target(input_ids=ids).logits)
        assert torch.isfinite(d(input_ids=ids).logits.float()).all()
    for name in ("spd", "mtad"):
        check_stats(me.generate(name, pair, PROMPT, max_new_tokens=MAX_NEW, seed=1), MAX_NEW,
                    t.config.vocab_size)


def test_int8_self_draft_is_refused_on_cuda_with_a_clear_message(model_dirs):
    with pytest.raises(ValueError, match="'self:int8' .* runs on CPU only; on a GPU use a layer-subset"):
        load_pair(target=model_dirs["opt"], draft="self:int8", device=DEVICE)


@pytest.mark.parametrize("name", ["ar", "spd", "mtad", "specinfer", "spectr", "beam", "pld",
                                  "medusa", "eagle"])
def test_compiled_path_with_cuda_graphs_matches_eager_greedy_output(model_dirs, name):
    """`compile=True` on CUDA: static cache, inductor with CUDA graphs (reduce-overhead). Greedy
    (fp32) output is the eager output; a second generation replays the captured graphs."""
    pair = load_pair(target=model_dirs["llama"],
                     draft=with_heads(model_dirs, model_dirs["llama-draft"], "llama"),
                     device=DEVICE, dtype="fp32")
    decoder = me.get_decoder(name, temperature=0)
    eager = me.generate(decoder, pair, PROMPT, max_new_tokens=16, compute_perplexity=False)
    for _ in range(2):
        compiled = me.generate(decoder, pair, PROMPT, max_new_tokens=16, compute_perplexity=False,
                               compile=True)
        assert compiled.token_ids == eager.token_ids
        check_stats(compiled, 16, pair.target.config.vocab_size)
    assert compiled.config["compiled"] == (
        ["target", "draft"] if decoder.draft_model(pair) is not None else ["target"])


@pytest.mark.parametrize("name", ["ar", "spd", "mtad"])
def test_host_work_on_cuda_is_what_the_cpu_counts(model_dirs, name):
    """Compiled on CUDA (inductor, CUDA graphs), the host-work counter finds one host read per
    iteration (the read-back) and the ops the CPU budget allows, plus what only CUDA adds: a
    clone per CUDA-graph output and a pinned copy per host list sent to the device (two per
    forward at most)."""
    from mtad_energy.engines.hf import counted_generation
    from mtad_energy.measure.host_work import HostWorkSites
    from tests.decoding.host_reads import site_at_read_back
    from tests.decoding.runtime.test_host_syncs import OPS_BUDGET

    pair = load_pair(target=model_dirs["llama"], draft=model_dirs["llama-draft"], device=DEVICE,
                     dtype="fp32")
    decoder = me.get_decoder(name, top_k=0, top_p=1.0)
    counted_generation(decoder, pair, [PROMPT], 16, compile=True)  # compiles every shape
    counter = HostWorkSites()
    gens, work = counted_generation(decoder, pair, [PROMPT], 16, compile=True, counter=counter)
    s = gens[0].stats
    assert work.reads == s.iterations and all(site_at_read_back(x) for x in counter.read_sites)
    forwards = (s.draft_forwards + s.target_forwards) / s.iterations
    assert work.columns()["host_ops_per_iter"] <= OPS_BUDGET[name] + 2 * forwards, (
        dict(counter.sites.most_common(15)))


def test_calibrate_on_the_gpu_stores_a_record_later_runs_reference(calibration_records):
    """`mtad-energy calibrate --quick` on the real GPU: every meter side by side, a verdict, and a
    record under the GPU's UUID that the next snapshot references."""
    from mtad_energy.bench.calibrate import CalibrateConfig, run_calibration
    from mtad_energy.measure import snapshot
    from mtad_energy.measure.calibration import load_record
    from mtad_energy.measure.probes import ROLES

    report = run_calibration(CalibrateConfig(quick=True, model="llama3.2-1b"))
    cal, rec = report.meters, report.record
    assert cal is not None and rec is not None and rec.trusted_meter in ROLES
    assert {r["meter"] for r in cal.rows if r["protocol"] == "plain"} >= {"nvml-counter", "nvml-power"}
    assert 0.001 < cal.counter_update_period_s < 1.0 and cal.idle_power_w > 10
    assert rec.min_window_s is None or rec.min_window_s > 0
    assert report.floor[0]["error"] is None and report.floor[0]["x_floor"] > 1.0
    assert load_record(rec.device_id) == rec
    assert [c["record_id"] for c in snapshot().calibrations][:1] == [rec.record_id]
