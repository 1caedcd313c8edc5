"""--compile-backend / --dynamic-shapes: how --compile compiles, named in the rows' model label and
key (other kernels: never pooled with, nor skipped as, the default compilation's rows)."""

from __future__ import annotations

import pytest

from mtad_energy.bench.runner import model_label
from mtad_energy.config import DecoderSpec, ModelSpec, RunConfig, compile_arg


def test_the_options_need_compile_and_build_compile_options():
    from mtad_energy.decoding.static import CompileOptions

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
