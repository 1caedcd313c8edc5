import json

import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app

runner = CliRunner()


def test_decoders_json_lists_every_decoder_with_params():
    from mtad_energy.decoding import DECODERS

    out = runner.invoke(app, ["decoders", "--json"])
    assert out.exit_code == 0, out.output
    specs = json.loads(out.output)
    assert set(specs) == set(DECODERS)
    tau = next(p for p in specs["mtad"]["params"] if p["name"] == "tau")
    assert tau["default"] == 0.5 and tau["type"] == "float"
    assert {n: s["needs_head"] for n, s in specs.items() if s["needs_head"]} == {
        "eagle": "eagle", "medusa": "medusa"}


def test_generate_json_on_a_local_pair(model_dirs):
    out = runner.invoke(app, ["generate", "--decoder", "mtad", "--target", model_dirs["llama"],
                              "--draft", model_dirs["llama-draft"], "--prompt", "w1 w2 w3",
                              "--set", "tau=0.3", "--set", "beam_width=2",
                              "--max-new-tokens", "6", "--device", "cpu", "--json"])
    assert out.exit_code == 0, out.output
    res = json.loads(out.output)
    assert res["config"]["tau"] == 0.3 and res["config"]["beam_width"] == 2
    assert res["stats"]["tokens_emitted"] == 6


@pytest.mark.slow
def test_generate_compile_gives_the_eager_tokens(model_dirs):
    args = ["generate", "--decoder", "spd", "--target", model_dirs["llama"], "--draft",
            model_dirs["llama-draft"], "--prompt", "w1 w2 w3", "--set", "temperature=0",
            "--max-new-tokens", "12", "--device", "cpu", "--json"]
    eager = runner.invoke(app, args)
    compiled = runner.invoke(app, [*args, "--compile"])
    assert compiled.exit_code == 0, compiled.output
    eager, compiled = json.loads(eager.output), json.loads(compiled.output)
    assert compiled["token_ids"] == eager["token_ids"]
    assert compiled["config"]["compiled"] == ["target", "draft"]
    assert "compiled" not in eager["config"]


def test_generate_reports_bad_input_clearly():
    out = runner.invoke(app, ["generate", "--decoder", "nope"])
    assert out.exit_code == 2 and "unknown decoder 'nope'" in out.output
    out = runner.invoke(app, ["generate", "--set", "tau"])
    assert out.exit_code != 0 and "key=value" in out.output


def test_env_json_has_a_snapshot_id_and_the_auto_meter_with_its_reason():
    out = runner.invoke(app, ["env", "--json"])
    assert out.exit_code == 0, out.output
    res = json.loads(out.output)
    assert len(res["snapshot_id"]) >= 8 and res["libraries"]["torch"]
    assert res["meter"]["name"] and res["meter"]["reason"]


def test_env_shows_each_meter_rejection_in_full(monkeypatch):
    """Errors and rows carry the short reason; `env` (which they point to) keeps every full one."""
    from mtad_energy import measure
    from mtad_energy.measure import MeterChoice, NoneMeter
    full = "NVML could not start (X); this machine has no usable NVIDIA driver. Use a CPU meter."
    choice = MeterChoice(NoneMeter(reason="short"), "none", "short", (("nvml-counter", full),))
    monkeypatch.setattr(measure, "select_meter", lambda: choice)
    out = runner.invoke(app, ["env"])
    assert out.exit_code == 0, out.output
    assert f"not nvml-counter: {full}" in " ".join(out.output.split())  # wrapped at 80 columns


def test_generate_pld_says_the_pairs_draft_is_ignored(model_dirs):
    out = runner.invoke(app, ["generate", "--decoder", "pld", "--target", model_dirs["llama"],
                              "--draft", model_dirs["llama-draft"], "--prompt", "w1 w2 w1 w2",
                              "--max-new-tokens", "6", "--device", "cpu", "--json"])
    assert out.exit_code == 0, out.output
    res = json.loads(out.output)
    assert res["pair"]["draft"] is None  # never loaded
    assert res["notes"] == [f"pld drafts without a draft model: the pair's draft "
                            f"({model_dirs['llama-draft']}) is ignored and not loaded"]
    text = runner.invoke(app, ["generate", "--decoder", "pld", "--target", model_dirs["llama"],
                               "--prompt", "w1 w2 w1 w2", "--max-new-tokens", "6",
                               "--device", "cpu"])
    assert text.exit_code == 0, text.output
    assert "ignored" not in text.output  # a pair without a draft: nothing to say


def test_generate_with_a_head_loads_it_from_the_draft_spec_and_drafts_with_it(model_dirs):
    """`--draft eagle:DIR` / `medusa:DIR`: the head in its public layout is loaded through the
    real path, its forwards are draft forwards; without one, the error names the fix."""
    for kind in ("eagle", "medusa"):
        out = runner.invoke(app, ["generate", "--decoder", kind, "--target", model_dirs["llama"],
                                  "--draft", f"{kind}:{model_dirs[f'llama-{kind}']}",
                                  "--prompt", "w1 w2 w3", "--max-new-tokens", "6",
                                  "--device", "cpu", "--json"])
        assert out.exit_code == 0, out.output
        res = json.loads(out.output)
        assert res["pair"]["heads"] == {kind: model_dirs[f"llama-{kind}"]}
        assert res["pair"]["draft"] is None and res["notes"] == []
        assert res["stats"]["draft_forwards"] >= 1 and res["stats"]["time_draft_s"] > 0
    bad = runner.invoke(app, ["generate", "--decoder", "medusa", "--target", model_dirs["llama"],
                              "--prompt", "w1 w2", "--max-new-tokens", "4", "--device", "cpu",
                              "--json"])
    assert bad.exit_code != 0
    err = json.loads(bad.output)
    assert "drafts with a medusa head" in err["error"] and "--draft medusa:DIR" in err["error"]
