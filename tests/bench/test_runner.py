"""The profile runner: rows per (prompt, decoder, repeat), phase windows, resume, interruption."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest

from mtad_energy.bench.prompts import Prompt
from mtad_energy.bench.runner import Runner, run_profile, shard, work_units
from mtad_energy.config import DecoderSpec, MeasureConfig, ModelSpec, RunConfig
from mtad_energy.measure import Measurement, NoneMeter
from mtad_energy.results import ResultStore, load_results

PROMPTS = [Prompt(f"p{i}", " ".join(f"w{(i * 7 + j) % 50 + 2}" for j in range(6)), "toy",
                  reference="w2 w3 w4") for i in range(3)]


class WattMeter:
    """A meter with exactly `power_w` watts while a window is open (energy = power x time)."""

    name = "fake-watt"
    devices = ("gpu0",)
    update_period_s = None

    def __init__(self, power_w: float = 100.0):
        self.power_w = power_w
        self.opened: dict[str, float] = {}
        self.windows: list[str] = []

    def now(self) -> float:
        return time.perf_counter()

    def begin_window(self, key: str) -> None:
        self.opened[key] = self.now()

    def end_window(self, key: str) -> Measurement:
        start, end = self.opened.pop(key), self.now()
        self.windows.append(key)
        return Measurement(key, self.name, end - start, start, end, self.power_w * (end - start),
                           {"gpu0": self.power_w * (end - start)})

    def close(self) -> None:
        pass


def config(**kw) -> RunConfig:
    base = dict(decoders=(DecoderSpec("ar"), DecoderSpec.of("spd", gamma="3")),
                model=ModelSpec(alias=None), datasets=("toy",), n_prompts=3, max_new_tokens=6,
                measure=MeasureConfig("none", "off"))
    return RunConfig(**(base | kw))


def test_one_row_per_prompt_decoder_repeat_with_steps(tmp_path, llama_pair):
    store = ResultStore(tmp_path)
    rep = run_profile(config(repeats=2), store, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS)
    assert (rep.ran, rep.skipped) == (12, 0)
    runs = load_results(tmp_path)
    assert len(runs) == 12 and runs["run_key"].is_unique
    assert set(runs["decoder"]) == {"ar", "spd"}
    assert sorted(runs["repeat"].unique()) == [0, 1]
    assert set(runs.loc[runs.decoder == "spd", "param_gamma"]) == {3}
    assert json.loads(runs.loc[runs.decoder == "spd", "params_json"].iloc[0])["gamma"] == 3
    steps = load_results(tmp_path, "steps")
    per_run = steps.groupby("run_key").size()
    assert (per_run[runs.set_index("run_key").index] == runs.set_index("run_key")["iterations"]).all()
    # per-iteration draft / target / other times are stored and add up to the run's totals
    sums = steps.groupby("run_key")[["time_draft_s", "time_target_s", "time_other_s"]].sum()
    by_run = runs.set_index("run_key")
    for col in ("time_draft_s", "time_target_s", "time_other_s"):
        assert np.allclose(sums.loc[by_run.index, col], by_run[col], rtol=1e-6, atol=1e-9), col
    assert (sums.loc[by_run.index[by_run.decoder == "spd"], "time_draft_s"] > 0).all()
    assert runs["perplexity"].notna().all()
    # no energy meter: energy is null and the reason is kept
    assert runs["energy_j"].isna().all() and runs["energy_per_token_j"].isna().all()
    assert runs["energy_reason"].str.contains("no energy meter").all()


def test_prefill_and_decode_get_their_own_windows_and_energy_adds_up(tmp_path, llama_pair):
    meter = WattMeter(100.0)
    cfg = config(decoders=(DecoderSpec("ar"),), n_prompts=1, warmup=False)
    rep = run_profile(cfg, ResultStore(tmp_path), pair=llama_pair, meter=meter, prompts=PROMPTS[:1])
    row = rep.rows[0]
    assert [w.rsplit("/", 1)[1] for w in meter.windows] == ["prefill", "decode"]
    assert row["energy_j"] == pytest.approx(row["prefill_energy_j"] + row["decode_energy_j"])
    assert row["energy_per_token_j"] == pytest.approx(row["energy_j"] / row["tokens_emitted"])
    assert row["decode_tokens"] == row["tokens_emitted"]  # the loop's decode window holds all
    # the decode window covers the decode loop, whose time generate() reports
    assert row["decode_energy_j"] / 100.0 == pytest.approx(row["decode_time_s"], rel=0.2, abs=2e-3)
    assert row["meter"] == "fake-watt" and json.loads(row["energy_flags"]) == []


def test_rerun_skips_stored_rows_and_never_duplicates(tmp_path, llama_pair):
    store = ResultStore(tmp_path)
    run_profile(config(), store, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS)
    rep = run_profile(config(), store, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS)
    assert (rep.ran, rep.skipped, len(rep.rows)) == (0, 6, 6)
    assert len(load_results(tmp_path)) == 6


def test_an_interrupted_run_keeps_finished_rows_and_resumes(tmp_path, llama_pair):
    calls = {"n": 0}

    def scorer(prompt, gen):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return {}

    store = ResultStore(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run_profile(config(), store, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS, scorer=scorer)
    assert len(load_results(tmp_path)) == 3
    rep = run_profile(config(), ResultStore(tmp_path), pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS)
    assert (rep.ran, rep.skipped) == (3, 3)
    runs = load_results(tmp_path)
    assert len(runs) == 6 and runs["run_key"].is_unique
    steps = load_results(tmp_path, "steps")
    assert steps.groupby("run_key").size().sum() == runs["iterations"].sum()


def test_a_compacted_store_resumes_without_recomputing_a_stored_row(tmp_path, llama_pair):
    scored: list[str] = []

    def scorer(prompt, gen):
        scored.append(prompt.id)
        if len(scored) == 4:
            raise KeyboardInterrupt
        return {}

    with pytest.raises(KeyboardInterrupt):
        run_profile(config(), ResultStore(tmp_path), pair=llama_pair, meter=NoneMeter(),
                    prompts=PROMPTS, scorer=scorer)
    ResultStore(tmp_path).compact()
    assert not list((tmp_path / "runs").glob("*.parquet"))  # every stored run row is in a pack
    scored.clear()
    rep = run_profile(config(), ResultStore(tmp_path), pair=llama_pair, meter=NoneMeter(),
                      prompts=PROMPTS, scorer=scorer)
    assert (rep.ran, rep.skipped, len(scored)) == (3, 3, 3)  # the 3 stored rows did not run again
    runs = load_results(tmp_path)
    assert len(runs) == 6 and runs["run_key"].is_unique
    steps = load_results(tmp_path, "steps")
    assert steps.groupby("run_key").size().sum() == runs["iterations"].sum()


def test_mitigation_repeats_the_generation_and_stores_the_interval(tmp_path, llama_pair):
    cfg = config(decoders=(DecoderSpec("ar"),), n_prompts=1,
                 measure=MeasureConfig("fake-watt", "on", mitigation_repetitions=4, mitigation_min_s=0.0))
    runner = Runner(cfg, ResultStore(tmp_path), pair=llama_pair, meter=WattMeter(50.0),
                    sleep=lambda s: None)
    row = runner.run_unit(work_units(cfg, PROMPTS[:1])[0])
    assert row["mitigated"] and row["mitigation_repetitions"] >= 4
    assert row["energy_ci_low_j"] <= row["energy_j"] <= row["energy_ci_high_j"]
    assert row["energy_j"] == pytest.approx(50.0 * row["mitigation_time_s"])
    assert row["single_window_energy_j"] is not None


def test_scores_are_computed_outside_the_windows_and_stored(tmp_path, llama_pair):
    from mtad_energy.bench.runner import quality_scorer

    cfg = config(decoders=(DecoderSpec("ar"),), n_prompts=1)
    rep = run_profile(cfg, ResultStore(tmp_path), pair=llama_pair, meter=NoneMeter(),
                      prompts=PROMPTS[:1], scorer=quality_scorer())
    assert 0.0 <= rep.rows[0]["rouge_l"] <= 1.0


def test_shards_partition_the_work():
    units = work_units(config(repeats=2), PROMPTS)
    parts = [shard(units, i, 3) for i in range(3)]
    assert sorted(len(p) for p in parts) == [4, 4, 4]
    flat = [id(u) for p in parts for u in p]
    assert len(flat) == len(set(flat)) == len(units) and set(flat) == {id(u) for u in units}
    with pytest.raises(ValueError, match="shard index 3 is outside 0..2"):
        shard(units, 3, 3)


def test_bad_decoder_parameters_fail_before_anything_is_loaded(tmp_path):
    cfg = config(decoders=(DecoderSpec.of("mtad", tau="1.5"),))
    with pytest.raises(ValueError, match="tau"):
        Runner(cfg, ResultStore(tmp_path), meter=NoneMeter())
    assert not (tmp_path / "runs").exists()


def test_config_round_trips_through_json():
    cfg = config(decoders=(DecoderSpec.of("mmtad", gamma="4", tau="0.3"),), repeats=3)
    assert RunConfig.from_json(cfg.to_json()) == cfg


def test_ops_profiles_one_generation_per_decoder(tmp_path, llama_pair, monkeypatch):
    monkeypatch.setenv("MTAD_ENERGY_CACHE", str(tmp_path / "cache"))  # roofline peaks cache
    cfg = config(ops=True, n_prompts=1)
    store = ResultStore(tmp_path / "s")
    run_profile(cfg, store, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS[:1])
    ops = load_results(tmp_path / "s", "ops")
    assert sorted(ops["decoder"]) == ["ar", "spd"]
    assert (ops["flops"] > 0).all() and (ops["bytes"] > 0).all()
    assert (ops["t_flop_s"] + ops["t_mem_s"] <= ops["wall_time_s"] + 1e-9).all()
    run_profile(cfg, store, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS[:1])
    assert len(load_results(tmp_path / "s", "ops")) == 2  # stored once


@pytest.mark.slow
def test_compiled_runs_are_their_own_rows_under_model_plus_compile(tmp_path, llama_pair):
    """--compile: same tokens as the eager rows (greedy), other run keys, model '<m>+compile'
    (so reports never average compiled and eager runs together), compile recorded."""
    base = config(decoders=(DecoderSpec.of("spd", gamma="3", temperature="0"),), n_prompts=2)
    store = ResultStore(tmp_path)
    run_profile(base, store, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS[:2])
    rep = run_profile(dataclasses.replace(base, compile=True), store, pair=llama_pair,
                      meter=NoneMeter(), prompts=PROMPTS[:2])
    assert (rep.ran, rep.skipped) == (2, 0)
    runs = load_results(tmp_path).sort_values("prompt_id")
    eager, compiled = runs[~runs["compile"]], runs[runs["compile"]]
    assert set(eager["model"]) == {"custom"} and set(compiled["model"]) == {"custom+compile"}
    assert list(compiled["text"]) == list(eager["text"])
    assert not set(compiled["run_key"]) & set(eager["run_key"])


def test_batched_profile_rows_match_batch_1_and_split_the_batch_energy(tmp_path, llama_pair):
    """--batch-size 2 over 3 prompts: batches [p0, p1] and [p2, p0], p0 there decoded but not
    stored again (every stored row was decoded with 2 rows, as its model label says); greedy
    texts equal the batch-1 rows; each row holds its token share of its batch's joules (shares
    of a batch sum to 1)."""
    base = config(decoders=(DecoderSpec.of("spd", gamma="3", temperature="0"),), n_prompts=3)
    plain = ResultStore(tmp_path / "b1")
    run_profile(base, plain, pair=llama_pair, meter=NoneMeter(), prompts=PROMPTS)
    batched = dataclasses.replace(base, batch_size=2)
    meter = WattMeter(50.0)
    rep = run_profile(batched, ResultStore(tmp_path / "b2"), pair=llama_pair, meter=meter,
                      prompts=PROMPTS)
    assert rep.ran == 3
    b1 = load_results(tmp_path / "b1").set_index("prompt_id").sort_index()
    b2 = load_results(tmp_path / "b2").set_index("prompt_id").sort_index()
    assert list(b2.text) == list(b1.text)
    assert list(b2.batch_size) == [2, 2, 2]  # rows decoded together, the last batch too
    assert set(b2.model) == {"custom+batch2"}  # reports keep batched runs apart
    pair_rows = b2.loc[["p0", "p1"]]
    assert pair_rows.energy_share.sum() == pytest.approx(1.0)
    tokens = b2.tokens_emitted
    assert b2.loc["p2", "energy_share"] == pytest.approx(tokens["p2"] / (tokens["p2"] + tokens["p0"]))
    # the two rows of the first batch share one decode window: their decode energies add up to it
    decode_windows = [w for w in meter.windows if w.endswith("/decode")]
    assert len(decode_windows) == 2
    assert pair_rows.decode_energy_j.sum() == pytest.approx(
        pair_rows.decode_energy_j.iloc[0] / pair_rows.energy_share.iloc[0])
    assert not set(b2.index.map(lambda p: b2.loc[p, "run_key"])) & set(b1.run_key)


def test_batch_size_with_a_decoder_that_does_not_batch_is_refused(monkeypatch):
    from mtad_energy.decoding.decoders.bild import Bild

    monkeypatch.setattr(Bild, "batched", False)  # every registry decoder batches today
    with pytest.raises(ValueError, match="bild do not decode batches yet"):
        config(decoders=(DecoderSpec("bild"),), batch_size=2)


class CompileWatch(WattMeter):
    """A meter that counts the graphs dynamo compiles while each window is open."""

    def __init__(self):
        super().__init__()
        self.compiled_inside: list[int] = []

    def begin_window(self, key: str) -> None:
        from mtad_energy.decoding.runtime.compiled import graphs_compiled

        self._graphs = graphs_compiled()
        super().begin_window(key)

    def end_window(self, key: str) -> Measurement:
        from mtad_energy.decoding.runtime.compiled import graphs_compiled

        self.compiled_inside.append(graphs_compiled() - self._graphs)
        return super().end_window(key)


VARIED = [Prompt(f"v{i}", " ".join(f"w{(i * 5 + j) % 50 + 2}" for j in range(n)), "toy")
          for i, n in enumerate((3, 9, 20, 5, 14))]


def test_compiled_batched_profile_compiles_nothing_inside_its_windows(tmp_path, llama_pair):
    """--compile --batch-size 2 over prompts of five lengths (batches of 2, 2 and 1: two row
    buckets): the warm-up compiles every shape, so no window sees a compile, no row is flagged,
    and the texts are the eager batch-1 ones; every row has its batch's peak memory."""
    base = config(decoders=(DecoderSpec.of("mtad", temperature="0"),
                            DecoderSpec.of("specinfer", temperature="0")), n_prompts=5)
    run_profile(base, ResultStore(tmp_path / "eager"), pair=llama_pair, meter=NoneMeter(),
                prompts=VARIED)
    meter = CompileWatch()
    rep = run_profile(dataclasses.replace(base, compile=True, batch_size=2),
                      ResultStore(tmp_path / "compiled"), pair=llama_pair, meter=meter,
                      prompts=VARIED)
    assert rep.ran == 10 and len(meter.compiled_inside) == 12  # 6 batches x prefill/decode
    assert meter.compiled_inside == [0] * 12
    runs = load_results(tmp_path / "compiled").set_index(["prompt_id", "decoder"]).sort_index()
    eager = load_results(tmp_path / "eager").set_index(["prompt_id", "decoder"]).sort_index()
    assert list(runs.text) == list(eager.text)
    assert (runs.compile_in_window_s == 0).all() and (runs.peak_memory_bytes > 0).all()
    assert not runs.energy_flags.str.contains("compiled_in_window").any()
    assert set(runs.model) == {"custom+compile+batch2"}


def test_a_compiled_run_carries_the_compile_cost_of_its_warm_up(tmp_path, model_dirs):
    """The warm-up before a compiled row's windows compiles its shapes: the first row of each
    shape says how long (`compile_s`) and how many graphs, the next rows reuse its forwards'
    graphs, nothing compiles inside a window (a kernel signature a later row meets first, its
    own last and shorter verify, compiles after that row's window, counted in its row); the
    summary adds the rows up. Eager rows: 0 and 0."""
    from mtad_energy.decoding.runtime.static import reset_compiled
    from mtad_energy.models import load_pair
    from mtad_energy.results.analysis import decoder_summary

    reset_compiled()  # graphs of earlier tests are not this run's
    pair = load_pair(target=model_dirs["opt"], draft=model_dirs["opt-draft"], device="cpu")
    cfg = config(decoders=(DecoderSpec.of("spd", temperature="0"),), n_prompts=2)
    for compiled in (True, False):
        run_profile(dataclasses.replace(cfg, compile=compiled), ResultStore(tmp_path / str(compiled)),
                    pair=pair, meter=NoneMeter(), prompts=PROMPTS[:2])
    runs = load_results(tmp_path / "True").sort_values("created_unix_s")
    first, second = runs.iloc[0], runs.iloc[1]  # prompts of one length: one warm-up
    assert first.compile_s > 0 and first.graphs_compiled > second.graphs_compiled
    assert (runs.compile_in_window_s == 0).all()
    assert not runs.energy_flags.str.contains("compiled_in_window").any()
    summary = decoder_summary(runs).iloc[0]
    assert summary.compile_s == pytest.approx(runs.compile_s.sum())
    assert summary.graphs_compiled == runs.graphs_compiled.sum()
    eager = load_results(tmp_path / "False")
    assert (eager.compile_s == 0).all() and (eager.graphs_compiled == 0).all()
    assert decoder_summary(eager).iloc[0].compile_s == 0


def test_a_compiled_run_that_compiles_inside_its_window_is_flagged(tmp_path, model_dirs,
                                                                   monkeypatch):
    """Without the warm-up (a fresh model, so nothing is compiled yet) and with a forward its
    decoder does not declare up front (`Decoder.warm_forwards` emptied: every decoder declares
    its own since issue 57, so this stands for a shape nobody foresaw), the first batch compiles
    inside its window: its time leaves the compilation out (`compile_s`), its joules cannot, so
    the row is flagged."""
    from mtad_energy.decoding.decoders.specinfer import SpecInfer
    from mtad_energy.models import load_pair

    monkeypatch.setattr(SpecInfer, "warm_forwards", lambda self, role, pair: ())

    pair = load_pair(target=model_dirs["opt"], draft=model_dirs["opt-draft"], device="cpu")
    cfg = config(decoders=(DecoderSpec.of("specinfer", branching="2,2"),), n_prompts=1,
                 compile=True, warmup=False)
    run_profile(cfg, ResultStore(tmp_path), pair=pair, meter=WattMeter(), prompts=PROMPTS[:1])
    row = load_results(tmp_path).iloc[0]
    assert row.compile_s > 0 and "compiled_in_window" in json.loads(row.energy_flags)
    assert row.decode_time_s < row.compile_s  # the stored time is decoding only
