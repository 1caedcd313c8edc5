"""--compile-backend / --dynamic-shapes: how --compile compiles, named in the rows' model label and
key (other kernels: never pooled with, nor skipped as, the default compilation's rows)."""

from __future__ import annotations

import pytest

from mtad_energy.bench.runner import model_label
from mtad_energy.config import DecoderSpec, ModelSpec, RunConfig, compile_arg


def test_the_options_need_compile_and_build_compile_options():
    from mtad_energy.decoding.runtime.compiled import CompileOptions

    with pytest.raises(ValueError, match="add --compile, or drop them"):
        RunConfig(compile_backend="eager")
    with pytest.raises(ValueError, match="add --compile"):
        compile_arg(False, None, True)
    assert compile_arg(True) is True and compile_arg(False) is False
    assert compile_arg(True, "aot_eager", True) == CompileOptions(backend="aot_eager", dynamic=None)
    assert compile_arg(True, None, True) == CompileOptions(backend="inductor", dynamic=None)


def test_the_setting_names_the_rows_and_round_trips():
    base = RunConfig(model=ModelSpec(None, "random:tiny-llama"), compile=True)
    assert model_label(base) == "random:tiny-llama+compile"  # the default keeps its label
    cfg = RunConfig(model=ModelSpec(None, "random:tiny-llama"), compile=True,
                    compile_backend="aot_eager", compile_dynamic=True)
    assert model_label(cfg) == "random:tiny-llama+compile-aot_eager-dynamic"
    assert RunConfig.from_json(cfg.to_json()) == cfg


def test_decoding_sweep_keeps_each_setting_apart(tmp_path, llama_pair):
    from mtad_energy.bench.decode_batch import decode_batch_sweep
    from mtad_energy.measure import NoneMeter
    from mtad_energy.results import ResultStore

    store = ResultStore(tmp_path)

    def sweep(**kw):
        return decode_batch_sweep(llama_pair, [DecoderSpec("ar")], [1], [[5, 9, 4]], store,
                                  NoneMeter(), model="tiny", max_new_tokens=3, compile=True,
                                  compile_backend="eager", **kw)

    first, dynamic = sweep(), sweep(compile_dynamic=True)
    assert (first.ran, dynamic.ran) == (1, 1)  # the dynamic row is not the static one's
    assert [r["model"] for r in store.load("decode_batch").sort_values("model").to_dict("records")] \
        == ["tiny+compile-eager", "tiny+compile-eager-dynamic"]
    assert sweep().skipped == 1  # and each resumes as itself
    with pytest.raises(ValueError, match="add --compile"):
        decode_batch_sweep(llama_pair, [DecoderSpec("ar")], [1], [[5, 9, 4]], store, NoneMeter(),
                           compile_backend="eager")


@pytest.mark.parametrize("args, message", [
    (["profile", "--compile-backend", "eager"], "add --compile, or drop them"),
    (["sweep", "batch-size", "--decoder", "spd", "--dynamic-shapes"], "add --compile, or drop them"),
    (["sweep", "batch-size", "--dynamic-shapes"], "--dynamic-shapes is not used here"),
])
def test_the_cli_refuses_them_without_compile_before_loading(tmp_path, args, message):
    from typer.testing import CliRunner

    from mtad_energy.cli import app

    result = CliRunner().invoke(app, [*args, "--target", "random:tiny-llama", "--output",
                                      str(tmp_path / "out")])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "out").exists()  # refused before anything ran


# -- compiled by default on CUDA -------------------------------------------------------------------
def test_compiled_is_the_default_on_cuda_and_eager_elsewhere(monkeypatch):
    import torch

    from mtad_energy.cli.options import UsageError, resolve_compile

    assert resolve_compile(False, False, "cpu") is False
    assert resolve_compile(True, False, "cpu") is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_compile(False, False, "auto") is True  # auto: CUDA here
    assert resolve_compile(False, False, "cuda:0") is True
    assert resolve_compile(False, True, "cuda") is False  # --eager
    assert resolve_compile(False, False, "cuda", engine="vllm") is False  # an engine's own forwards
    assert resolve_compile(False, False, "cpu") is False
    with pytest.raises(UsageError, match="--compile and --eager contradict"):
        resolve_compile(True, True, "cuda")


@pytest.mark.parametrize("args", [["profile"], ["compare"], ["sweep", "param", "--decoder", "spd",
                                                            "--param", "gamma=2,3"],
                                  ["sweep", "batch-size", "--decoder", "spd"], ["generate"]])
def test_compile_with_eager_is_refused_before_loading(tmp_path, args):
    from typer.testing import CliRunner

    from mtad_energy.cli import app

    out = ["--output", str(tmp_path / "out")] if args[0] != "generate" else []
    result = CliRunner().invoke(app, [*args, "--compile", "--eager", "--target", "nosuch/model",
                                      *out])
    assert result.exit_code == 2, result.output
    assert "--compile and --eager contradict" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()  # refused before anything ran (the model is no model)


def test_eager_rows_on_a_gpu_are_labelled_launch_bound():
    import pandas as pd

    from mtad_energy.cli.tables import summary_table
    from mtad_energy.results.analysis import LAUNCH_BOUND_NOTE, decoder_summary

    def row(decoder, device, compiled, engine="hf"):
        return {"model": "m", "dataset": "d", "decoder": decoder, "params_json": "{}",
                "label": decoder, "prompt_id": "p", "tokens_emitted": 10, "decode_time_s": 1.0,
                "prefill_time_s": 0.1, "tokens_per_s": 10.0, "block_efficiency": 1.0,
                "acceptance_rate": None, "perplexity": 2.0, "energy_j": None,
                "energy_reason": "none", "meter": "none", "device": device, "compile": compiled,
                "engine": engine}

    runs = pd.DataFrame([row("ar", "cuda:0", False), row("spd", "cuda:0", True),
                         row("mtad", "cpu", False), row("pld", "cuda:0", False, "vllm")])
    summary = decoder_summary(runs).set_index("decoder")
    assert summary["launch_bound"].to_dict() == {"ar": True, "spd": False, "mtad": False,
                                                 "pld": False}
    from rich.console import Console

    console = Console(width=400, record=True)
    console.print(summary_table(summary.reset_index()))
    text = " ".join(console.export_text().split())
    # rows of other devices and engines are kept apart, their labels say so ([cuda, hf])
    assert "ar [cuda, hf] (launch-bound)" in text and "spd [cuda, hf] (launch-bound)" not in text
    assert " ".join(LAUNCH_BOUND_NOTE.split()) in text


def test_the_summary_carries_host_work_beside_cost_per_forward():
    import math

    import pandas as pd

    from mtad_energy.results.analysis import decoder_summary

    base = {"model": "m", "dataset": "d", "params_json": "{}", "prompt_id": "p",
            "tokens_emitted": 10, "prefill_time_s": 0.1, "tokens_per_s": 10.0,
            "block_efficiency": 1.0, "acceptance_rate": None, "perplexity": 2.0,
            "energy_j": None, "energy_reason": "none", "meter": "none"}
    runs = pd.DataFrame([
        {**base, "decoder": "spd", "label": "spd", "decode_time_s": 1.2, "time_draft_s": 0.4,
         "time_target_s": 0.6, "host_ops_per_iter": 30.0, "graph_calls_per_iter": 9.0,
         "host_reads_per_iter": 1.0},
        {**base, "decoder": "spd", "label": "spd", "decode_time_s": 1.8, "time_draft_s": 0.6,
         "time_target_s": 0.9, "host_ops_per_iter": 30.0, "graph_calls_per_iter": 9.0,
         "host_reads_per_iter": 1.0},
        {**base, "decoder": "ar", "label": "ar", "decode_time_s": 1.0, "time_draft_s": 0.0,
         "time_target_s": 0.8, "host_ops_per_iter": None, "graph_calls_per_iter": None,
         "host_reads_per_iter": None}])
    s = decoder_summary(runs).set_index("decoder")
    assert s.loc["spd", "host_overhead"] == pytest.approx(3.0 / 2.5)  # pooled: 3 s over 2.5 s
    assert s.loc["spd", "host_ops_per_iter"] == 30.0 and s.loc["spd", "graph_calls_per_iter"] == 9.0
    assert s.loc["ar", "host_overhead"] == pytest.approx(1.25)
    assert math.isnan(s.loc["ar", "host_ops_per_iter"])  # not counted: said so, not zero
