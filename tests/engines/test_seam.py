"""The engine seam without any engine installed: the decoder-name mapping, refusals of what an
engine cannot honour, the not-installed message, and the statistics a Generation gets."""

from __future__ import annotations

import importlib.util
import json

import pytest

from mtad_energy.config import DecoderSpec, ModelSpec, RunConfig
from mtad_energy.decoding.registry import build_decoder
from mtad_energy.engines import (
    Engine,
    EngineNotInstalledError,
    Iteration,
    UnsupportedError,
    build_generation,
    check_engine_options,
    engine_kind,
    load_engine,
    parse_engines,
)


def test_decoder_names_keep_one_meaning_across_engines():
    assert engine_kind("vllm").method("pld") == "ngram"
    assert engine_kind("vllm").method("spd") == "draft_model"
    assert "prompt lookup" in engine_kind("llamacpp").method("pld")
    assert "draft model" in engine_kind("llamacpp").method("spd")
    # the project's default warp and draft lengths, so `pld` means the same on every engine
    params = engine_kind("llamacpp").decoder_params("pld", {})
    assert params == {"temperature": 1.0, "top_k": 10, "top_p": 0.9, "gamma": 10, "max_ngram": 3,
                      "min_ngram": 1}  # the project's pld parameters, one fixed
    assert engine_kind("llamacpp").decoder_params("spd", {"gamma": "3", "temperature": "0"}) == {
        "temperature": 0.0, "top_k": 10, "top_p": 0.9, "gamma": 3}


@pytest.mark.parametrize("engine, decoder", [("llamacpp", "mtad"), ("llamacpp", "eagle"),
                                             ("vllm", "mtad"), ("vllm", "beam")])
def test_a_pairing_the_engine_lacks_is_refused_by_name(engine, decoder):
    with pytest.raises(UnsupportedError, match=f"engine '{engine}' has no decoder '{decoder}'"):
        RunConfig(decoders=(DecoderSpec(decoder),), engine=engine)


def test_options_an_engine_cannot_honour_are_refused():
    with pytest.raises(UnsupportedError, match="batch size 1 only"):
        RunConfig(decoders=(DecoderSpec("ar"),), engine="llamacpp", batch_size=2)
    with pytest.raises(UnsupportedError, match="--compile"):
        RunConfig(decoders=(DecoderSpec("ar"),), engine="llamacpp", compile=True)
    with pytest.raises(UnsupportedError, match="--compile"):
        RunConfig(decoders=(DecoderSpec("ar"),), engine="vllm", compile=True)
    with pytest.raises(UnsupportedError, match="--ops"):
        RunConfig(decoders=(DecoderSpec("ar"),), engine="llamacpp", ops=True)
    with pytest.raises(UnsupportedError, match="no parameter 'tau'"):
        RunConfig(decoders=(DecoderSpec.of("spd", tau="0.5"),), engine="llamacpp")
    with pytest.raises(UnsupportedError, match="min_ngram=1"):
        RunConfig(decoders=(DecoderSpec.of("pld", min_ngram=2),), engine="llamacpp")
    RunConfig(decoders=(DecoderSpec.of("pld", min_ngram=1),), engine="llamacpp")  # its only value
    # the project's own decoders keep their own rules: hf batches and compiles
    RunConfig(decoders=(DecoderSpec("ar"),), batch_size=2, compile=True)
    with pytest.raises(UnsupportedError, match="unknown engine 'sglang'"):
        parse_engines("hf,sglang")
    assert parse_engines("hf, llamacpp,hf") == ["hf", "llamacpp"]


def test_an_engine_not_installed_names_its_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llama_cpp", "vllm") else real(name, *a))
    for name, extra in (("llamacpp", "llamacpp"), ("vllm", "vllm")):
        for call, args in ((load_engine, (name, None)), (check_engine_options, (name, ["ar"]))):
            with pytest.raises(EngineNotInstalledError) as info:
                call(*args)
            assert str(info.value) == (f"engine '{name}' is not installed: "
                                       f"pip install -e \".[{extra}]\"")
    assert load_engine("hf", None) is None  # the project's own decoders: the runner's path


def test_the_cli_refuses_before_loading_and_keeps_json_one_document(tmp_path):
    from typer.testing import CliRunner

    from mtad_energy.cli import app

    out = CliRunner().invoke(app, ["profile", "--engine", "hf,llamacpp", "--decoder", "mtad",
                                   "--output", str(tmp_path / "s"), "--json"])
    assert out.exit_code != 0
    doc = json.loads(out.stdout)
    assert "engine 'llamacpp' has no decoder 'mtad'" in doc["error"]
    assert not (tmp_path / "s").exists()  # nothing loaded, nothing written


def test_profile_and_the_decoding_sweep_refuse_a_decoder_an_engine_of_the_list_lacks(tmp_path):
    """profile and sweep batch-size --decoder measure one decoder list on every engine of
    --engine (compare skips instead: `skipped_decoders`): a decoder one engine lacks is refused
    before anything loads, naming every engine that lacks it, what each runs, and the fix."""
    from typer.testing import CliRunner

    from mtad_energy.cli import app

    for command, option in ((["profile", "--decoder", "mtad"], "--decoder (or --baseline)"),
                            (["sweep", "batch-size", "--decoder", "ar,mtad"], "--decoder")):
        out = CliRunner().invoke(app, [*command, "--engine", "hf,vllm,llamacpp", "--meter", "none",
                                       "--output", str(tmp_path / "s"), "--json"])
        assert out.exit_code == 2, out.output
        error = json.loads(out.stdout)["error"]
        assert error.startswith("engine 'vllm' has no decoder 'mtad' (it runs ar, pld, spd, eagle, "
                                "medusa); engine 'llamacpp' has no decoder 'mtad' (it runs ar, "
                                f"pld, spd): {' '.join(command[:-2])} runs every decoder on every "
                                "engine of --engine hf,vllm,llamacpp; drop mtad from "
                                f"{option}, or vllm, llamacpp from --engine"), error
        assert not (tmp_path / "s").exists()


def test_a_generation_from_engine_counts_obeys_the_statistics_contract():
    its = [Iteration(emitted=1), Iteration(emitted=3, proposed=4, accepted=2, draft_depth=4),
           Iteration(emitted=1, proposed=4, accepted=0, draft_depth=4)]
    gen = build_generation([5, 6, 7, 8, 9], "x", 3, its, 0.1, 0.5, "max_new_tokens", {"a": 1})
    s = gen.stats
    assert (s.tokens_emitted, s.iterations, s.target_forwards) == (5, 3, 3)
    assert (s.draft_proposed, s.draft_accepted, s.draft_depth) == (8, 2, 8)
    assert s.block_efficiency == pytest.approx(5 / 3)
    assert s.acceptance_rate == pytest.approx(2 / 8)
    assert s.mean_accepted_length == pytest.approx(1.0)  # 2 accepted over 2 drafting iterations
    assert s.tokens_per_s == pytest.approx(10.0)
    assert [st.emitted for st in gen.steps] == [1, 3, 1]
    # what the engine cannot tell stays unknown, never 0
    unknown = build_generation([1, 2], "", 1, [Iteration(emitted=2, accepted=None, proposed=None)],
                               0.1, 0.2, "eos", {})
    assert unknown.stats.draft_accepted is None and unknown.stats.draft_proposed is None
    assert unknown.stats.acceptance_rate is None and unknown.steps[0].accepted is None
    assert unknown.stats.time_other_s is None  # the target's time is unknown too


def test_the_decoding_sweep_refuses_a_batch_size_the_engine_cannot_do(tmp_path):
    from typer.testing import CliRunner

    from mtad_energy.cli import app

    out = CliRunner().invoke(app, ["sweep", "batch-size", "--engine", "llamacpp", "--decoder",
                                   "ar,spd", "--sizes", "1,2", "--meter", "none", "--output",
                                   str(tmp_path / "s"), "--json"])
    assert out.exit_code != 0
    assert "engine 'llamacpp' decodes batch size 1 only (asked for 2)" in json.loads(out.stdout)["error"]
    out = CliRunner().invoke(app, ["sweep", "batch-size", "--engine", "llamacpp", "--output",
                                   str(tmp_path / "t"), "--json"])
    assert out.exit_code != 0 and "--engine" in json.loads(out.stdout)["error"]


def test_a_table_of_several_engines_names_each_rows_model():
    """Engines side by side in one summary: each row says which engine (model label) it is."""
    import pandas as pd
    from rich.console import Console

    from mtad_energy.cli.tables import summary_table

    summary = pd.DataFrame([
        {"model": model, "dataset": "mtbench", "label": label, "n_runs": 3, "tokens_per_s": tps,
         "speedup": 1.0, "block_efficiency": 1.0, "acceptance_rate": None, "perplexity": 2.0,
         "energy_per_token_j": None, "decode_energy_per_token_j": None, "energy_reason": "none"}
        for model, tps in (("smollm2", 6.5), ("smollm2+llamacpp", 22.9)) for label in ("ar",)])
    console = Console(width=120, record=True)
    console.print(summary_table(summary, "compare"))
    text = console.export_text()
    rows = [line for line in text.splitlines() if "mtbench" in line]
    assert len(rows) == 2
    assert "smollm2+llamacpp" in rows[1] and "22.9" in rows[1]
    assert "smollm2+llamacpp" not in rows[0] and "smollm2" in rows[0]
    console = Console(width=120, record=True)
    console.print(summary_table(summary[summary["model"] == "smollm2"], "profile"))
    assert "model" not in console.export_text().split("\n")[1]  # one model: no column for it


def test_a_parameter_only_an_engine_has_is_taken_for_it_and_refused_for_hf():
    """vLLM's ``per_batch_size`` (its dynamic schedule) reaches vLLM's spd and pld through --set;
    the project's decoders (hf) lack it: refused by name, before anything loads."""
    from mtad_energy.cli.options import UsageError, decoder_specs

    specs = decoder_specs(["ar", "spd", "pld"], {"per_batch_size": "1-1:3;2-16:0"}, "vllm")
    assert {s.name: s.param_dict.get("per_batch_size") for s in specs} == {
        "ar": None, "spd": "1-1:3;2-16:0", "pld": "1-1:3;2-16:0"}
    whose = "'per_batch_size' is a parameter of vllm's spd, not of the project's decoders"
    with pytest.raises(UsageError, match=whose + r".*add --engine vllm"):
        decoder_specs(["ar", "spd"], {"per_batch_size": "1-1:3"}, "hf")
    with pytest.raises(UsageError, match=whose):  # llama.cpp has no schedule
        decoder_specs(["ar", "spd"], {"per_batch_size": "1-1:3"}, "llamacpp")
    with pytest.raises(UsageError, match="no selected decoder .* has a parameter 'nope'"):
        decoder_specs(["ar", "spd"], {"nope": "1"}, "hf")
    with pytest.raises(UnsupportedError, match=r"engine 'hf' \(the project's decoders\): spd has no "
                       r"parameter 'per_batch_size' \(a parameter of vllm's spd\); drop --set "
                       r"per_batch_size or run --engine vllm without hf"):
        check_engine_options("hf", ["spd"], params={"spd": {"per_batch_size": "1-1:3"}})


def test_the_cli_refuses_an_engine_parameter_beside_hf(tmp_path):
    from typer.testing import CliRunner

    from mtad_energy.cli import app

    res = CliRunner().invoke(app, ["profile", "--decoder", "spd", "--engine", "hf,vllm", "--set",
                                   "per_batch_size=1-1:3", "--meter", "none", "--output",
                                   str(tmp_path / "out"), "--json"])
    assert res.exit_code == 2
    assert "spd has no parameter 'per_batch_size'" in json.loads(res.output)["error"]
    assert not (tmp_path / "out").exists()


def recorded_owns(monkeypatch) -> list:
    """The ``own`` processes each contention window is opened with, in order."""
    from mtad_energy.measure.contention import ContentionProbe

    owns: list = []
    begin = ContentionProbe.begin
    monkeypatch.setattr(ContentionProbe, "begin",
                        lambda self, key, own=(): owns.append(own) or begin(self, key, own))
    return owns


class _ScriptedEngine(Engine):
    """An engine whose steps are a script on a simulated clock: each call's prefill window takes
    1 s and streams every row's first token, its decode window 2 s and the other tokens."""

    name = "vllm"  # an engine kind that batches

    def __init__(self, gpu):
        super().__init__(ModelSpec())
        self.gpu = gpu

    def draft_id(self, spec):
        return None

    def processes(self, spec):
        return (424242,)  # where it would decode, were it a real engine

    def generate(self, spec, prompts, max_new_tokens, seed=0, on_phase=None):
        hook = on_phase or (lambda _phase: None)
        hook("prefill")
        self.gpu.clock.advance(1.0)
        hook("decode")
        self.gpu.clock.advance(2.0)
        hook("end")
        n = max_new_tokens
        return [build_generation([5] * n, "", len(p), [Iteration(emitted=1)] * n, 1.0, 2.0,
                                 "max_new_tokens", {}, decode_tokens=n - 1) for p in prompts]


def test_an_engine_rows_tokens_and_joules_per_token_count_only_the_decode_windows_tokens(
        tmp_path, llama_pair, monkeypatch):
    """B rows whose first tokens stream out of the prefill window: the decoding sweep's tokens/s
    and decode J/token divide by the tokens the decode window holds (B x (n - 1)), never by all
    of them."""
    from mtad_energy.bench.decode_batch import decode_batch_sweep
    from mtad_energy.measure.simulated import SimClock, SimulatedGPU, SimulatedMeter
    from mtad_energy.results import ResultStore

    owns = recorded_owns(monkeypatch)
    gpu = SimulatedGPU(idle_power_w=100.0, clock=SimClock())
    engine = _ScriptedEngine(gpu)
    decode_batch_sweep(llama_pair, [DecoderSpec("ar")], [2], [[5, 9, 4], [7, 3, 11]],
                       ResultStore(tmp_path), SimulatedMeter(gpu), max_new_tokens=5,
                       engine=engine)
    (row,) = ResultStore(tmp_path).load("decode_batch").to_dict("records")
    assert (row["tokens"], row["decode_tokens"], row["decode_time_s"]) == (10, 8, 2.0)
    assert row["tokens_per_s"] == pytest.approx(8 / 2.0)
    assert row["energy_j"] == pytest.approx(100.0 * 2.0, rel=1e-6)  # the decode window's
    assert row["energy_per_token_j"] == pytest.approx(200.0 / 8, rel=1e-6)
    assert owns == [(424242,), (424242,)]  # both windows count the engine's processes as own


def test_an_engines_own_settings_are_checked_and_typed_before_anything_loads():
    vllm, llamacpp = engine_kind("vllm"), engine_kind("llamacpp")
    opts = vllm.options({"enforce_eager": "false", "gpu_memory_utilization": "0.45"})
    assert opts["enforce_eager"] is False and opts["gpu_memory_utilization"] == 0.45
    assert opts["max_num_seqs"] == 16  # the defaults fill the rest
    assert vllm.options({})["gpu_memory_utilization"] is None  # vLLM's own, not passed on
    assert llamacpp.options({"n_ctx": "512"})["n_ctx"] == 512
    with pytest.raises(UnsupportedError, match="no option 'n_ctx' .*it has: dtype, enforce_eager"):
        vllm.options({"n_ctx": "512"})
    with pytest.raises(UnsupportedError, match="enforce_eager='maybe' is not true or false"):
        vllm.options({"enforce_eager": "maybe"})
    with pytest.raises(UnsupportedError, match="max_num_seqs='lots' is not an integer"):
        vllm.options({"max_num_seqs": "lots"})


def test_engine_options_go_to_each_engine_that_has_them_and_into_its_configuration():
    from mtad_energy.cli.engines import EngineOptions, engine_options

    both = engine_options(["n_ctx=512,enforce_eager=false", "dtype=float16"], "hf,vllm,llamacpp")
    assert both == {"vllm": {"enforce_eager": "false", "dtype": "float16"},
                    "llamacpp": {"n_ctx": "512"}}
    assert engine_options(None, "vllm") == {"vllm": {}}
    with pytest.raises(UnsupportedError, match="no engine of --engine llamacpp has an option "
                                               "'enforce_eager' \\(llamacpp: n_threads"):
        engine_options(["enforce_eager=false"], "llamacpp")
    with pytest.raises(UnsupportedError, match="hf, the project's own decoders, takes none"):
        engine_options(["n_ctx=5"], "hf")
    with pytest.raises(UnsupportedError, match="expects KEY=VALUE, got 'n_ctx'"):
        engine_options(["n_ctx"], "llamacpp")
    with pytest.raises(UnsupportedError, match="n_ctx='big' is not an integer"):
        engine_options(["n_ctx=big"], "llamacpp")
    help_text = " ".join(EngineOptions.__metadata__[0].help.split())  # written out, kept true
    for name in ("vllm", "llamacpp"):
        assert f"{name}: {', '.join(engine_kind(name).settings)}" in help_text
    config = RunConfig(decoders=(DecoderSpec("ar"),), engine="vllm",
                       engine_options=(("enforce_eager", "false"),))
    assert RunConfig.from_json(config.to_json()) == config  # a worker gets them too
    with pytest.raises(UnsupportedError, match="hf .* has none"):
        RunConfig(decoders=(DecoderSpec("ar"),), engine_options=(("n_ctx", "5"),))
    with pytest.raises(UnsupportedError, match="no option 'n_ctx'"):
        RunConfig(decoders=(DecoderSpec("ar"),), engine="vllm", engine_options=(("n_ctx", "5"),))


def test_the_runner_starts_the_engine_with_its_settings(tmp_path, llama_pair, monkeypatch):
    import mtad_energy.engines as engines_mod
    from mtad_energy.bench import runner as runner_mod
    from mtad_energy.config import MeasureConfig
    from mtad_energy.measure.simulated import SimClock, SimulatedGPU
    from mtad_energy.results import ResultStore

    started = []

    def load(name, model, options=None):
        started.append((name, options))
        return _ScriptedEngine(SimulatedGPU(clock=SimClock()))

    monkeypatch.setattr(engines_mod, "load_engine", load)
    monkeypatch.setattr(type(engine_kind("vllm")), "installed", lambda self: True)
    owns = recorded_owns(monkeypatch)
    config = RunConfig(decoders=(DecoderSpec("ar"),), n_prompts=1, max_new_tokens=4,
                       engine="vllm", engine_options=(("max_num_seqs", "4"),),
                       measure=MeasureConfig(meter="none"), warmup=False)
    runner_mod.run_profile(config, ResultStore(tmp_path), pair=llama_pair)
    assert started == [("vllm", {"max_num_seqs": "4"})]
    assert owns == [(424242,), (424242,)]  # its windows count the engine's processes as own


def test_a_second_vllm_that_cannot_start_on_a_gpu_says_how_to_split_the_memory():
    from mtad_energy.engines.vllm import start_failure_hint

    assert start_failure_hint("cpu", 2, {}) == "" and start_failure_hint("cuda", 0, {}) == ""
    hint = start_failure_hint("cuda", 2, {})
    assert "2 vLLM engine(s)" in hint and "default share of the GPU, 0.92" in hint
    assert "--engine-option gpu_memory_utilization=0.30" in hint
    assert "gpu_memory_utilization=0.5)" in start_failure_hint(
        "cuda", 1, {"gpu_memory_utilization": 0.5})


def test_the_decoding_sweep_loads_each_engine_with_its_own_settings(monkeypatch):
    import mtad_energy.engines as engines
    from mtad_energy.bench.decode_batch import DecodeBatchReport
    from mtad_energy.cli.engines import each_engine

    loaded = []

    class Loaded:
        def close(self):
            loaded.append("closed")

    monkeypatch.setattr(engines, "load_engine",
                        lambda name, model, options=None: loaded.append((name, options)) or Loaded())
    each_engine(["vllm", "llamacpp"], ModelSpec(), lambda e: DecodeBatchReport([], 0, 0),
                {"vllm": {"enforce_eager": "false"}, "llamacpp": {}})
    assert loaded == [("vllm", {"enforce_eager": "false"}), "closed", ("llamacpp", {}), "closed"]


def test_an_engine_sweep_takes_parameter_values_only_the_engine_has(tmp_path, model_dirs,
                                                                   monkeypatch):
    """``sweep batch-size --engine vllm --set gamma=0,1``: gamma=0 is vLLM's (the speculating
    engine at k = 0) and hf's decoders would refuse it, so the command never builds them; the
    rows are the engine's, one per gamma, under the engine's settings."""
    from typer.testing import CliRunner

    import mtad_energy.engines as engines
    from mtad_energy.cli import app
    from mtad_energy.measure.simulated import SimClock, SimulatedGPU
    from mtad_energy.results import load_results

    loaded = []
    monkeypatch.setattr(type(engine_kind("vllm")), "installed", lambda self: True)
    monkeypatch.setattr(engines, "load_engine", lambda name, model, options=None: loaded.append(
        options) or _ScriptedEngine(SimulatedGPU(clock=SimClock())))
    out = CliRunner().invoke(app, [
        "sweep", "batch-size", "--engine", "vllm", "--decoder", "ar,spd", "--set", "gamma=0,1",
        "--target", model_dirs["llama"], "--sizes", "1,2", "--n-prompts", "2", "--meter", "none",
        "--max-new-tokens", "4", "--engine-option", "max_num_seqs=4", "--output",
        str(tmp_path / "s"), "--json"])
    assert out.exit_code == 0, out.output
    rows = load_results(tmp_path / "s", "decode_batch")
    assert sorted(set(rows["label"])) == ["ar", "spd(gamma=0)", "spd(gamma=1)"]
    assert len(rows) == 6 and loaded == [{"max_num_seqs": "4"}]
    assert (rows["decode_tokens"] == rows["batch_size"] * 3).all()  # n - 1 per row in the window
    # the plot is named by its engine: an hf sweep into the same store keeps its own
    assert json.loads(out.stdout)["plot"] == str(tmp_path / "s-crossover-vllm.png")
    assert (tmp_path / "s-crossover-vllm.png").is_file()
    with pytest.raises(ValueError, match="gamma must be >= 1"):  # hf's own rule, where hf runs
        build_decoder(DecoderSpec.of("spd", gamma="0"))


def test_the_project_decoders_are_built_where_hf_runs_them_only():
    """`engines.hf.project_decoders`, the one place a command builds the project's decoders of
    its specs: where hf is among the engines (a name or a list), never for another engine's
    values (vLLM's gamma=0, which hf refuses)."""
    from mtad_energy.engines.hf import project_decoders

    zero = [DecoderSpec("ar"), DecoderSpec.of("spd", gamma="0")]
    assert project_decoders("vllm", zero) == [] and project_decoders(["vllm", "llamacpp"], zero) == []
    with pytest.raises(ValueError, match="gamma must be >= 1"):
        project_decoders(["vllm", "hf"], zero)
    built = project_decoders("hf", [DecoderSpec.of("spd", gamma="3")])
    assert [(d.name, d.params.gamma) for d in built] == [("spd", 3)]


def test_notes_of_an_engine_run_never_build_the_project_decoders_from_engine_values():
    from mtad_energy.cli.run import config_draft_notes

    config = RunConfig(decoders=(DecoderSpec.of("spd", gamma="0"),), engine="vllm")
    assert config_draft_notes(config) == []  # hf would refuse gamma=0; vLLM runs it
