"""`sweep draft`: drafts as a sweep axis (issue 39). Every drafting decoder against every draft in
one store, rows keyed by their draft and never pooled (summary, per-draft view, report), the
draft-free baseline measured once, and bad drafts refused before any model loads."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.cli.options import UsageError, decoder_specs
from mtad_energy.cli.sweep_draft import draft_configs
from mtad_energy.config import ModelSpec, RunConfig
from mtad_energy.decoding.registry import DECODERS
from mtad_energy.results import load_results

runner = CliRunner()


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": f"w{i + 3} w{i + 9} w{i + 4}"})
                              for i in range(2)) + "\n")
    return str(path)


def sweep(model_dirs, prompts_file, out, *drafts, decoders="spd,mtad", extra=()):
    args = ["sweep", "draft", "--target", model_dirs["llama"], "--decoders", decoders,
            *[a for d in drafts for a in ("--draft", d)], "--meter", "none", "--dataset",
            prompts_file, "--n-prompts", "2", "--max-new-tokens", "4", "--output", str(out), *extra]
    return runner.invoke(app, args)


# -- the axis, end to end ----------------------------------------------------------------------
def test_every_decoder_runs_against_every_draft_and_the_rows_stay_apart(model_dirs, prompts_file,
                                                                       tmp_path):
    out = tmp_path / "drafts"
    drafts = (model_dirs["llama-draft"], "self:layers=0")
    res = sweep(model_dirs, prompts_file, out, *drafts, extra=["--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    runs = load_results(out)
    # ar (the baseline) once: its tokens owe nothing to a draft, its rows name none
    assert len(runs) == 2 * (1 + 2 * 2) and doc["ran"] == 10
    assert runs.loc[runs.decoder == "ar", "draft_id"].isna().all()
    for decoder in ("spd", "mtad"):
        assert sorted(runs.loc[runs.decoder == decoder, "draft_id"]) == sorted(2 * drafts)
    # the summary: one row per (decoder, draft), never pooled, labels naming the draft
    summary = pd.DataFrame(doc["summary"])
    spd = summary[summary.decoder == "spd"].set_index("draft_id")
    assert set(spd.index) == set(drafts) and (spd["n_runs"] == 2).all()
    assert set(spd["label"]) == {f"spd@{d}" for d in drafts}
    for draft in drafts:  # each summary row is that draft's own rows, not a pool
        mine = runs[(runs.decoder == "spd") & (runs.draft_id == draft)]
        assert spd.loc[draft, "block_efficiency"] == pytest.approx(mine["block_efficiency"].mean())
    assert summary.loc[summary.decoder == "ar", "label"].tolist() == ["ar"]
    # the per-draft view: a row per (draft, decoder), the draft's cost and SpD's acceptance
    view = pd.DataFrame(doc["drafts"])
    assert set(zip(view.draft_id, view.decoder, strict=True)) == {
        (d, n) for d in drafts for n in ("spd", "mtad")}
    assert (view.loc[view.decoder == "spd", "be_vs_spd"] == 1).all()
    assert (view["draft_cost"] > 0).all()
    for draft in drafts:
        mine = view[view.draft_id == draft]
        assert mine["spd_acceptance"].nunique() == 1
        assert mine["spd_acceptance"].iloc[0] == pytest.approx(
            spd.loc[draft, "acceptance_rate"], nan_ok=True)
    # resumed: nothing runs twice; the console shows the drafts side by side
    again = sweep(model_dirs, prompts_file, out, *drafts)
    assert again.exit_code == 0, again.output
    assert "0 run(s) measured, 10 already stored" in again.output
    assert "drafts side by side" in again.output and "self:layers=0" in again.output


def test_the_report_puts_drafts_side_by_side(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "drafts"
    assert sweep(model_dirs, prompts_file, out, model_dirs["llama-draft"], "self:layers=0",
                 decoders="spd").exit_code == 0
    res = runner.invoke(app, ["report", str(out), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "## Drafts" in text and "figures/drafts.png" in text
    assert (tmp_path / "rep" / "figures" / "drafts.png").stat().st_size > 0
    drafts = text.split("## Drafts")[1].split("##")[0]
    assert "self:layers=0" in drafts and model_dirs["llama-draft"] in drafts
    # the accepted-length figure keeps them apart too: one panel per (decoder, draft)
    assert text.count("| spd@") >= 2


# -- one configuration per draft, loading nothing ---------------------------------------------
def _base(*names):
    return RunConfig(decoders=decoder_specs(list(names), {}), model=ModelSpec(None, "t"))


def test_configs_put_each_decoder_with_the_drafts_it_uses():
    base = _base("ar", "spd", "pld", "medusa")
    configs = draft_configs(["self:int8", "medusa:random", "self:layers=0-3,5"], base.decoders,
                            base)
    assert [c.model.draft for c in configs] == ["self:int8", "medusa:random", "self:layers=0-3,5"]
    assert [[d.name for d in c.decoders] for c in configs] == [
        ["ar", "pld", "spd"], ["medusa"], ["spd"]]


@pytest.mark.parametrize(("drafts", "decoders", "said"), [
    ([], ("spd",), "one --draft each"),
    (["self:int8", " self:int8"], ("spd",), "'self:int8' is given twice"),
    (["medusa:random"], ("spd",), "is a medusa head, which none of --decoders"),
    (["self:int8"], ("ar", "pld"), "is a draft model, which none of --decoders ar,pld"),
    (["self:int8"], ("spd", "eagle"), "--decoders eagle drafts with a head of its kind, and no "
                                      "--draft names one: add --draft eagle:DIR"),
    (["self:int8,eagle:"], ("spd",), "give the eagle head's directory"),
])
def test_an_axis_that_cannot_run_is_refused_naming_the_fix(drafts, decoders, said):
    base = _base(*decoders)
    with pytest.raises(UsageError, match=said.replace("(", r"\(")):
        draft_configs(drafts, base.decoders, base)


def test_bad_drafts_are_refused_before_any_model_loads(model_dirs, prompts_file, tmp_path,
                                                       no_loading):
    cases = [([model_dirs["other-vocab"]], "different tokenizers"),
             (["self:layers=0-7"], "out of range: the target has layers 0..2"),
             (["random:tiny-opt"], "predicts 256 token ids, the target"),
             (["self:skip=every1"], "keeps no layer"),
             (["self:int8", "self:int8"], "given twice"),
             (["medusa:random"], "is a medusa head")]
    for drafts, said in cases:
        res = sweep(model_dirs, prompts_file, tmp_path / "x", model_dirs["llama-draft"], *drafts,
                    extra=["--json"])
        assert res.exit_code == 2, res.output
        error = json.loads(res.stdout)["error"]
        assert said in error, error
    assert not (tmp_path / "x").exists()


def test_a_draft_names_no_draft_for_the_decoders_that_do_not_use_it(llama_pair):
    assert llama_pair.draft_id_for(DECODERS["ar"]) is None
    assert llama_pair.draft_id_for(DECODERS["pld"]) is None
    assert llama_pair.draft_id_for(DECODERS["spd"]) == llama_pair.draft_id
    assert llama_pair.draft_id_for(DECODERS["medusa"]).startswith("medusa:")
