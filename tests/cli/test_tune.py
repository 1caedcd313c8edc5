"""`mtad-energy tune` and `compare --tuned` (issue 56): the validation/held-out split, the choice by
criterion on a known store, its bootstrap fraction, resume, bad input refused before any model
loads, and one strict JSON document."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from mtad_energy.bench.prompts import Prompt
from mtad_energy.bench.splits import split_prompts
from mtad_energy.cli import app
from mtad_energy.decoding.grids import TUNING_GRIDS, grid_settings
from mtad_energy.decoding.registry import DECODERS, get_decoder
from mtad_energy.results import load_results
from mtad_energy.results.tuning import NoSettingError, bootstrap_indices, choose

runner = CliRunner()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "decoders"


def strict(text: str):
    """One strict JSON document (NaN or Infinity refused)."""
    def refuse(name):
        raise AssertionError(f"{name} in --json output")

    return json.loads(text, parse_constant=refuse)


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": f"w{i + 3} w{i + 9} w{i + 4}"})
                              for i in range(6)) + "\n")
    return str(path)


def tune(model_dirs, prompts_file, out, *extra):
    return runner.invoke(app, ["tune", "--target", model_dirs["llama"], "--draft",
                               model_dirs["llama-draft"], "--meter", "none", "--max-new-tokens", "3",
                               "--decoders", "spd", "--grid", "gamma=1,2", "--dataset", prompts_file,
                               "--val-prompts", "3", "--resamples", "200", "--output", str(out),
                               *extra])


# -- the split -------------------------------------------------------------------------------------
def _prompts(name: str, n: int) -> list[Prompt]:
    return [Prompt(f"{name}/{i}", f"text {i}", name) for i in range(n)]


def test_split_parts_are_disjoint_cover_the_datasets_and_keep_each_datasets_own_split():
    prompts = _prompts("a", 10) + _prompts("b", 7)
    split = split_prompts(prompts, 3, seed=0)
    val, held = set(split.validation), set(split.held_out)
    assert not val & held and val | held == set(prompts)
    assert [sum(p.dataset == d for p in split.validation) for d in "ab"] == [3, 3]
    # another dataset listed beside it does not move a dataset's split; the seed does
    alone = split_prompts(_prompts("a", 10), 3, seed=0)
    assert alone.validation == split.validation[:3] and alone.held_out == split.held_out[:7]
    assert split_prompts(prompts, 3, seed=1).validation != split.validation


# -- the choice on a known store --------------------------------------------------------------------
def _store(ppl: dict[str, list[float]], speed: dict[str, list[float]],
           jpt: dict[str, list[float]]) -> pd.DataFrame:
    """Rows of ar and spd(gamma=g) on prompts p0.. with the given per-prompt values."""
    rows = []
    for setting, values in ppl.items():
        decoder = "ar" if setting == "ar" else "spd"
        params = "{}" if setting == "ar" else json.dumps({"gamma": int(setting)})
        for i, v in enumerate(values):
            rows.append({"decoder": decoder, "params_json": params, "dataset": "d",
                         "prompt_id": f"p{i}", "perplexity": v, "tokens_per_s": speed[setting][i],
                         "energy_per_token_j": jpt[setting][i]})
    return pd.DataFrame(rows)


KNOWN = _store(ppl={"ar": [10, 10, 10], "2": [10.2, 10.2, 10.2], "3": [10.4, 10.4, 10.4],
                    "4": [12, 12, 12]},
               speed={"ar": [5, 5, 5], "2": [6, 6, 6], "3": [7, 7, 7], "4": [9, 9, 9]},
               jpt={"ar": [1, 1, 1], "2": [0.8, 0.8, 0.8], "3": [0.9, 0.9, 0.9], "4": [0.5, 0.5, 0.5]})


@pytest.mark.parametrize(("criterion", "ratio", "gamma"), [
    ("ppl", None, 2),  # the lowest perplexity
    ("speed", 1.05, 3),  # gamma=4 is faster but 1.2x ar's perplexity
    ("speed", 1.5, 4),  # within a looser budget, the fastest
    ("energy", 1.05, 2),  # the cheapest within the budget (gamma=4's 0.5 J is out of it)
])
def test_the_criterion_picks_the_known_best_setting(criterion, ratio, gamma):
    c = choose(KNOWN, "spd", criterion, ratio, resamples=50)
    assert c["params"] == {"gamma": gamma}
    assert c["label"] == f"spd(gamma={gamma})"
    assert c["ppl_ratio"] == pytest.approx({2: 1.02, 3: 1.04, 4: 1.2}[gamma])
    assert c["bootstrap_fraction"] == 1.0  # every prompt says the same


def test_a_choice_counts_the_flags_of_the_rows_it_was_made_on():
    """A contended or random-weight row reaches the record as it reaches every table: counted
    over the rows of the prompts the choice used (not those of a prompt it left out)."""
    flagged = KNOWN.assign(contended=False, draft_id="self:int8")
    flagged.loc[flagged.index[:2], "contended"] = True  # ar on p0 and p1
    flagged.loc[flagged.index[-1], "draft_id"] = "eagle:random"  # spd(gamma=4) on p2
    c = choose(flagged, "spd", "ppl", resamples=10)
    assert (c["rows"], c["contended_rows"], c["random_weight_rows"]) == (12, 2, 1)
    from mtad_energy.cli.tune import choice_table

    cells = " ".join(str(cell) for col in choice_table({"spd": c}, "ppl").columns
                     for cell in col._cells)
    assert "2 of 12 rows contended" in cells and "1 of 12 rows random weights" in cells
    clean = choose(KNOWN, "spd", "ppl", resamples=10)  # rows stored before the columns
    assert (clean["contended_rows"], clean["random_weight_rows"]) == (0, 0)


def test_a_tie_goes_to_the_setting_first_in_grid_order():
    tied = _store(ppl={"ar": [10, 10], "2": [10, 11], "3": [11, 10]},
                  speed={"ar": [1, 1], "2": [1, 1], "3": [1, 1]},
                  jpt={"ar": [1, 1], "2": [1, 1], "3": [1, 1]})
    g2, g3 = json.dumps({"gamma": 2}), json.dumps({"gamma": 3})
    assert choose(tied, "spd", "ppl", resamples=10, order=[g2, g3])["params"] == {"gamma": 2}
    assert choose(tied, "spd", "ppl", resamples=10, order=[g3, g2])["params"] == {"gamma": 3}


def test_a_perplexity_budget_no_setting_meets_names_the_closest_and_the_fix():
    with pytest.raises(NoSettingError, match=r"no spd setting keeps perplexity within "
                                             r"--max-ppl-ratio 1.01 .*spd\(gamma=2\) at 1.020x"):
        choose(KNOWN, "spd", "speed", 1.01, resamples=50)


def test_too_few_common_prompts_give_no_choice_and_compare_refuses_that_record(tmp_path):
    from mtad_energy.cli.tune import FORMAT, read_record
    from mtad_energy.results.tuning import IncompleteError

    # a spent --budget-s: spd(gamma=3) measured on one prompt only
    short = KNOWN[~((KNOWN.params_json == json.dumps({"gamma": 3})) & (KNOWN.prompt_id != "p0"))]
    with pytest.raises(IncompleteError, match="1 validation prompt"):
        choose(short, "spd", "ppl", resamples=10)
    (tmp_path / "st.tuned.json").write_text(json.dumps({"format": FORMAT, "decoders": {
        "spd": {"params": None, "reason": "spd: 1 validation prompt(s) ..."}}}))
    with pytest.raises(ValueError, match="spd has no chosen setting"):
        read_record(tmp_path / "st")


def test_the_bootstrap_fraction_is_the_share_of_resamples_the_same_setting_wins():
    # gamma=2 wins on p0 by far and loses on p1 by a little: it loses only resamples without p0
    store = _store(ppl={"ar": [10, 10], "2": [9, 11.2], "3": [11, 11]},
                   speed={"ar": [1, 1], "2": [1, 1], "3": [1, 1]},
                   jpt={"ar": [1, 1], "2": [1, 1], "3": [1, 1]})
    c = choose(store, "spd", "ppl", resamples=400, seed=3)
    idx = bootstrap_indices(2, 400, seed=3)[1:]
    expected = float(np.mean((idx == 0).any(axis=1)))
    assert c["params"] == {"gamma": 2}
    assert c["bootstrap_fraction"] == expected and 0.68 < expected < 0.82  # about 3/4
    wins = {s["label"]: s["wins"] for s in c["settings"]}
    assert wins == {"spd(gamma=2)": expected, "spd(gamma=3)": pytest.approx(1 - expected)}


# -- the grids -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_every_decoder_has_a_grid_its_decoder_takes_shown_on_its_page(name):
    for setting in grid_settings(name):
        get_decoder(name, **setting)  # every grid value is one the decoder takes
    assert f"<!-- decoder-grid {name} -->" in (DOCS / f"{name}.md").read_text()


def test_mtad_grid_is_the_papers():
    assert TUNING_GRIDS["mtad"] == {"beam_width": (4, 8), "gamma": (3, 4),
                                    "tau": (0.1, 0.3, 0.5, 0.7, 0.9)}
    assert len(grid_settings("mtad")) == 20


# -- bad input: refused before any model loads ------------------------------------------------------
@pytest.mark.parametrize(("extra", "message"), [
    (["--val-prompts", "0"], "--val-prompts 0 gives an empty validation split"),
    (["--val-prompts", "1"], "--val-prompts 1 gives a one-prompt validation split"),
    (["--val-prompts", "6"], "has 6 prompt(s): --val-prompts 6 would leave none held out"),
    (["--grid", "spd.gamma=0"], "spd refuses the grid setting spd(gamma=0"),
    (["--max-ppl-ratio", "1.1"], "--criterion ppl picks the lowest perplexity"),
    (["--criterion", "speed", "--max-ppl-ratio", "0"], "--max-ppl-ratio 0: give a positive ratio"),
    (["--criterion", "energy"], "--criterion energy needs joules"),
    (["--criterion", "fast"], "--criterion 'fast': choose one of ppl, speed, energy"),
    (["--set", "gamma=3"], "gamma is tuned by spd's grid and fixed by --set"),
    (["--decoders", "mtad", "--set", "tau=0.3"], "tau is tuned by mtad's grid and fixed by --set"),
], ids=["val0", "val1", "val-all", "grid-refused", "ratio-with-ppl", "ratio-zero", "energy-no-meter",
        "criterion-unknown", "grid-and-set", "default-axis-and-set"])
@pytest.mark.usefixtures("no_loading")
def test_bad_input_is_refused_before_any_model_loads(model_dirs, prompts_file, tmp_path, extra,
                                                     message):
    res = tune(model_dirs, prompts_file, tmp_path / "st", *extra)
    assert res.exit_code == 2, res.output
    assert message in words(res.output)
    assert not (tmp_path / "st").exists()


@pytest.mark.usefixtures("no_loading")
def test_bad_input_under_json_is_one_strict_document(model_dirs, prompts_file, tmp_path):
    res = tune(model_dirs, prompts_file, tmp_path / "st", "--val-prompts", "1", "--json")
    assert res.exit_code == 2
    doc = strict(res.stdout)
    assert doc["exit_code"] == 2 and "one-prompt validation split" in doc["error"]


@pytest.mark.usefixtures("no_loading")
def test_a_spent_budget_loads_nothing_and_writes_no_choice(model_dirs, prompts_file, tmp_path):
    res = tune(model_dirs, prompts_file, tmp_path / "st", "--budget-s", "0", "--json")
    assert res.exit_code == 0, res.output
    doc = strict(res.stdout)
    assert doc["budget"]["spent"] and doc["ran"] == 0 and "tuned" not in doc
    assert not (tmp_path / "st.tuned.json").exists()


# -- end to end on the tiny pair ---------------------------------------------------------------------
def test_tune_chooses_records_and_resumes(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "st"
    first = tune(model_dirs, prompts_file, out, "--json")
    assert first.exit_code == 0, first.output
    doc = strict(first.stdout)
    assert doc["ran"] == 3 * 3 and doc["skipped"] == 0  # ar + 2 settings on 3 validation prompts
    chosen = doc["tuned"]["decoders"]["spd"]
    assert chosen["params"]["gamma"] in (1, 2) and chosen["n_prompts"] == 3
    assert chosen["label"] == f"spd(gamma={chosen['params']['gamma']})"
    assert 0 < chosen["bootstrap_fraction"] <= 1 and chosen["resamples"] == 200
    runs = load_results(out)
    validation = {tuple(v) for v in doc["tuned"]["split"]["validation"]}
    assert set(zip(runs["dataset"], runs["prompt_id"], strict=True)) == validation
    # the choice is the one the stored rows give
    assert choose(runs, "spd", "ppl", resamples=200)["params"] == chosen["params"]
    record = strict((tmp_path / "st.tuned.json").read_text())
    assert record["decoders"]["spd"]["params"] == chosen["params"]
    # the same command again measures nothing and chooses the same setting
    again = tune(model_dirs, prompts_file, out, "--json")
    assert again.exit_code == 0, again.output
    doc2 = strict(again.stdout)
    assert doc2["ran"] == 0 and doc2["skipped"] == 9
    assert doc2["tuned"]["decoders"]["spd"]["params"] == chosen["params"]


def test_a_budget_no_setting_meets_fails_after_storing_the_rows(model_dirs, prompts_file, tmp_path):
    out = tmp_path / "st"
    res = tune(model_dirs, prompts_file, out, "--criterion", "speed", "--max-ppl-ratio", "0.01",
               "--json")
    assert res.exit_code == 2, res.output
    doc = strict(res.stdout)
    assert "no spd setting keeps perplexity within --max-ppl-ratio 0.01" in doc["error"]
    assert len(load_results(out)) == 9  # every row kept
    assert not (tmp_path / "st.tuned.json").exists()


def test_compare_tuned_measures_the_chosen_settings_on_held_out_prompts_only(model_dirs, prompts_file,
                                                                             tmp_path):
    out = tmp_path / "st"
    assert tune(model_dirs, prompts_file, out).exit_code == 0
    record = strict((tmp_path / "st.tuned.json").read_text())
    res = runner.invoke(app, ["compare", "--tuned", str(out), "--n-prompts", "2", "--meter", "none",
                              "--json"])
    assert res.exit_code == 0, res.output
    doc = strict(res.stdout)
    held = load_results(tmp_path / "st-heldout")
    validation = {tuple(v) for v in record["split"]["validation"]}
    pairs = set(zip(held["dataset"], held["prompt_id"], strict=True))
    assert len(pairs) == 2 and not pairs & validation  # disjoint from the validation split
    spd = held[held.decoder == "spd"]
    chosen = record["decoders"]["spd"]
    assert {json.loads(p)["gamma"] for p in spd["params_json"]} == {chosen["params"]["gamma"]}
    assert set(held["decoder"]) == {"ar", "spd"}  # ar beside it
    # the chosen setting named in the summary, the JSON, the markdown table and every row
    summary = pd.DataFrame(doc["summary"])
    assert summary.loc[summary.decoder == "spd", "label"].tolist() == [chosen["label"]]
    assert doc["tuned"]["decoders"]["spd"]["label"] == chosen["label"]
    assert chosen["label"] in (tmp_path / "st-heldout.md").read_text()
    assert all(f"gamma={chosen['params']['gamma']}" in label for label in spd["label"])


@pytest.mark.usefixtures("no_loading")
def test_compare_tuned_refuses_what_the_record_decides_and_a_missing_record(tmp_path):
    res = runner.invoke(app, ["compare", "--tuned", str(tmp_path / "none"), "--meter", "none"])
    assert res.exit_code == 2 and "no tune record" in words(res.output)
    res = runner.invoke(app, ["compare", "--tuned", str(tmp_path / "none"), "--decoders", "spd"])
    assert res.exit_code == 2 and "--decoders: --tuned measures what the tune record names" in words(
        res.output)


def test_the_defaults_config_drops_the_grid_axes_and_keeps_what_every_setting_shared():
    """`compare` tuned against default (experiments/tuned_vs_default.py): the same record, each
    decoder at its own defaults, a parameter fixed for the whole grid (``--set``) kept."""
    from mtad_energy.cli.tune import tuned_config
    from mtad_energy.config import DecoderSpec, MeasureConfig, RunConfig

    grid = [DecoderSpec.of("ar")] + [DecoderSpec.of("spd", gamma=g, temperature=0.7) for g in (2, 3)]
    grid += [DecoderSpec.of("mcss", branching=b) for b in ((2, 2, 2), (8, 1, 1))]
    doc = {"config": RunConfig(decoders=tuple(grid)).to_dict(), "baseline": {"params": {}},
           "decoders": {"spd": {"params": {"gamma": 3, "temperature": 0.7}},
                        "mcss": {"params": {"branching": [8, 1, 1]}}}}
    measure = MeasureConfig("none", "auto")
    tuned = tuned_config(doc, 2, 1, measure, False)
    default = tuned_config(doc, 2, 1, measure, False, at_defaults=True)
    assert [(s.name, dict(s.params)) for s in tuned.decoders] == [
        ("ar", {}), ("spd", {"gamma": 3, "temperature": 0.7}), ("mcss", {"branching": (8, 1, 1)})]
    assert [(s.name, dict(s.params)) for s in default.decoders] == [
        ("ar", {}), ("spd", {"temperature": 0.7}), ("mcss", {})]
    assert default.sweep == "compare-defaults" and default.n_prompts == 2
    assert {**default.to_dict(), "decoders": None, "sweep": None} == {
        **tuned.to_dict(), "decoders": None, "sweep": None}  # the same pair, tokens, seed, meter
