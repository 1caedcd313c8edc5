"""profile / compare / sweep param / sweep batch-size / decompose / report through the CLI on tiny
local models (meter none: no GPU here), and the argument parsing behind them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.cli.options import UsageError, decoder_specs, parse_range, parse_sizes
from mtad_energy.config import DecoderSpec
from mtad_energy.results import load_results

runner = CliRunner()


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": f"w{i + 3} w{i + 9} w{i + 4}",
                                          "reference": "w3 w4"}) for i in range(3)) + "\n")
    return str(path)


def pair_args(model_dirs):
    return ["--target", model_dirs["llama"], "--draft", model_dirs["llama-draft"], "--meter", "none",
            "--max-new-tokens", "5"]


def test_profile_runs_stores_and_resumes(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "store"
    args = ["profile", "--decoder", "ar,mtad", *pair_args(model_dirs), "--dataset", prompts_file,
            "--n-prompts", "2", "--set", "tau=0.3", "--output", str(out)]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "4 run(s) measured, 0 already stored" in first.output
    assert "J/tok n/a" in first.output
    runs = load_results(out)
    assert len(runs) == 4 and runs.loc[runs.decoder == "mtad", "param_tau"].eq(0.3).all()
    # the command ended by compacting its store: the rows are in packs, no part file is left
    assert "compacted 8 part file(s)" in first.output
    assert not list((out / "runs").glob("*.parquet")) and len(list((out / "runs" / "packs").iterdir())) == 1
    again = runner.invoke(app, args + ["--json"])
    assert again.exit_code == 0, again.output
    res = json.loads(again.output[again.output.index("{"):])
    assert (res["ran"], res["skipped"]) == (0, 4)
    assert {r["decoder"] for r in res["summary"]} == {"ar", "mtad"}
    assert len(load_results(out)) == 4


def test_compare_writes_the_main_table_markdown(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "cmp"
    res = runner.invoke(app, ["compare", "--decoders", "ar,spd,mtad", *pair_args(model_dirs),
                              "--dataset", prompts_file, "--n-prompts", "1", "--output", str(out)])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "cmp.md").read_text()
    assert "spd" in md and "mtad" in md and "**" in md


def test_compare_includes_pld_and_says_it_ignores_the_draft(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "cmp"
    res = runner.invoke(app, ["compare", "--decoders", "ar,spd,pld", *pair_args(model_dirs),
                              "--dataset", prompts_file, "--n-prompts", "1", "--output", str(out),
                              "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert {r["decoder"] for r in doc["summary"]} == {"ar", "spd", "pld"}
    assert f"the pair's draft ({model_dirs['llama-draft']}) is ignored by it" in doc["notes"][0]
    assert "pld" in (tmp_path / "cmp.md").read_text()


@pytest.mark.slow
def test_compare_runs_every_decoder_and_the_heads_the_pair_has(model_dirs, prompts_file, tmp_path):
    """The default decoder list: all of ALL_DECODERS, plus medusa and eagle when the draft spec
    (or the alias) names their heads; each head decoder's rows name its head as their draft."""
    from mtad_energy.cli.options import ALL_DECODERS

    out = tmp_path / "cmp"
    draft = (f"{model_dirs['llama-draft']},medusa:{model_dirs['llama-medusa']},"
             f"eagle:{model_dirs['llama-eagle']}")
    args = [*pair_args(model_dirs), "--draft", draft, "--max-new-tokens", "3"]
    res = runner.invoke(app, ["compare", *args, "--dataset", prompts_file, "--n-prompts", "1",
                              "--output", str(out), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert {r["decoder"] for r in doc["summary"]} == {*ALL_DECODERS, "medusa", "eagle"}
    runs = load_results(out)
    assert set(runs.loc[runs.decoder == "eagle", "draft_id"]) == {
        f"eagle:{model_dirs['llama-eagle']}"}
    assert set(runs.loc[runs.decoder == "spd", "draft_id"]) == {model_dirs["llama-draft"]}
    assert "medusa" in (tmp_path / "cmp.md").read_text()


def test_sweep_param_runs_the_grid_and_the_baseline(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "sw"
    res = runner.invoke(app, ["sweep", "param", "--decoder", "spd", "--param", "gamma=2..4",
                              *pair_args(model_dirs), "--dataset", prompts_file, "--n-prompts", "1",
                              "--output", str(out)])
    assert res.exit_code == 0, res.output
    runs = load_results(out)
    assert sorted(runs.loc[runs.decoder == "spd", "param_gamma"]) == [2, 3, 4]
    assert (runs.decoder == "ar").sum() == 1


def test_batch_size_sweep_then_report(model_dirs, tmp_path):
    out = tmp_path / "bs"
    res = runner.invoke(app, ["sweep", "batch-size", "--target", model_dirs["llama"], "--sizes", "1,2",
                              "--runs", "2", "--context-len", "8", "--forwards-per-run", "2",
                              "--meter", "none", "--output", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output[res.output.index("{"):])["rows"]
    assert [r["Batch Size"] for r in rows] == [1, 2] and "Energy/run (J)" in rows[0]
    assert sorted(load_results(out, "batch")["batch_size"]) == [1, 2]
    rep = runner.invoke(app, ["report", str(out), "--out", str(tmp_path / "rep")])
    assert rep.exit_code == 0, rep.output
    assert (tmp_path / "rep" / "report.md").exists()


def test_decompose_without_energy_says_what_is_missing(model_dirs, tmp_path):
    out = tmp_path / "bs"
    runner.invoke(app, ["sweep", "batch-size", "--target", model_dirs["llama"], "--sizes", "1,2,4",
                        "--runs", "1", "--context-len", "8", "--forwards-per-run", "1", "--meter", "none",
                        "--output", str(out)])
    res = runner.invoke(app, ["decompose", str(out)])
    assert res.exit_code == 2
    assert "energy" in res.output and "meter" in res.output


def test_unknown_decoder_and_bad_values_fail_clearly(model_dirs, tmp_path):
    res = runner.invoke(app, ["profile", "--decoder", "nope", "--output", str(tmp_path / "x")])
    assert res.exit_code == 2 and "unknown decoder nope; available: ar, beam" in res.output
    res = runner.invoke(app, ["profile", "--decoder", "mtad", *pair_args(model_dirs), "--set", "tau=1.5",
                              "--output", str(tmp_path / "y")])
    assert res.exit_code == 2 and "tau" in res.output
    res = runner.invoke(app, ["profile", "--decoder", "ar", "--dataset", "squad",
                              "--output", str(tmp_path / "z")])
    assert res.exit_code == 2 and "unknown dataset 'squad'" in res.output


def test_compare_runs_every_registered_decoder_by_default(monkeypatch, tmp_path):
    """compare's default decoders come from the registry (CONTRIBUTING: one line in `DECODERS`):
    a decoder registered there, a new one too, is in the default, heads where the pair has
    them. The default is read from compare's own refusal of a parameter no decoder has (it
    lists the selected decoders, before anything loads)."""
    from mtad_energy.decoding import registry

    class Extra(registry.DECODERS["ar"]):
        name = "extra"

    monkeypatch.setitem(registry.DECODERS, "extra", Extra)

    def default(*draft: str) -> list[str]:
        res = runner.invoke(app, ["compare", "--set", "nope=1", "--device", "cpu", *draft,
                                  "--output", str(tmp_path / "out"), "--json"])
        assert res.exit_code == 2 and not (tmp_path / "out").exists()
        return json.loads(res.output)["error"].split("(")[1].split(")")[0].split(", ")

    assert sorted(default("--draft", "medusa:random,eagle:random")) == sorted(registry.DECODERS)
    assert default() == [n for n, c in registry.DECODERS.items() if c.head is None]


def test_set_goes_to_decoders_that_have_the_parameter():
    specs = decoder_specs(["ar", "spd", "mtad"], {"gamma": "6", "mtad.tau": "0.2"})
    assert specs == (DecoderSpec("ar"), DecoderSpec.of("spd", gamma="6"),
                     DecoderSpec.of("mtad", gamma="6", tau="0.2"))
    with pytest.raises(UsageError, match="no selected decoder \\(ar, spd\\) has a parameter 'tau'"):
        decoder_specs(["ar", "spd"], {"tau": "0.2"})
    with pytest.raises(UsageError, match="decoder 'mmtad' is not among --decoder ar"):
        decoder_specs(["ar"], {"mmtad.gamma": "3"})


def test_set_is_parsed_once_into_checked_specs_with_variants(tmp_path):
    """`decoder_specs` is the one parse of --set: a value hf's decoder refuses is refused there
    (before any model or target is looked at), and sweep batch-size's comma lists are expanded
    there, once, into one spec per value (a tuple parameter keeps its list)."""
    with pytest.raises(ValueError, match="parameter gamma='four' is not a valid int"):
        decoder_specs(["ar", "spd"], {"gamma": "four"})
    with pytest.raises(ValueError, match="gamma must be >= 1"):
        decoder_specs(["spd"], {"gamma": "0"})
    assert decoder_specs(["spd"], {"gamma": "0"}, "vllm") == (DecoderSpec.of("spd", gamma="0"),)
    specs = decoder_specs(["ar", "spd", "specinfer"], {"gamma": "1,2", "branching": "4,2"},
                          variants=True)
    assert specs == (DecoderSpec("ar"), DecoderSpec.of("spd", gamma="1"),
                     DecoderSpec.of("spd", gamma="2"), DecoderSpec.of("specinfer", branching="4,2"))
    res = runner.invoke(app, ["profile", "--decoder", "spd", "--set", "gamma=four", "--target",
                              str(tmp_path / "no-such-model"), "--meter", "none", "--output",
                              str(tmp_path / "out"), "--json"])
    assert res.exit_code == 2 and "gamma='four'" in json.loads(res.output)["error"]
    assert not (tmp_path / "out").exists()


def test_ranges_and_sizes():
    assert parse_range("3..6") == ["3", "4", "5", "6"]
    assert parse_range("2..8:3") == ["2", "5", "8"]
    assert parse_range("0.1, 0.5") == ["0.1", "0.5"]
    with pytest.raises(UsageError, match="is empty"):
        parse_range("5..3")
    assert parse_sizes("1,2,16") == [1, 2, 16]
    with pytest.raises(UsageError, match="positive integers"):
        parse_sizes("0,2")


def test_profile_with_workers_runs_submitit_jobs_into_one_store(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "dist"
    res = runner.invoke(app, ["profile", "--decoder", "ar,spd", *pair_args(model_dirs), "--dataset",
                              prompts_file, "--n-prompts", "2", "--workers", "2", "--cluster", "debug",
                              "--output", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert summary["ran"] == 4 and len(summary["jobs"]) == 2
    runs = load_results(out)
    assert len(runs) == 4 and runs["run_key"].is_unique
