"""decoder_summary, main_table / to_markdown, accepted-length histograms and the batch curve."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from mtad_energy.results import analysis, crossover, load_results
from tests.results.conftest import BATCH_RUNS, PAPER_BATCH


@pytest.fixture(scope="module")
def runs(store_dir) -> pd.DataFrame:
    return load_results(store_dir)


@pytest.fixture(scope="module")
def summary(runs) -> pd.DataFrame:
    return analysis.decoder_summary(runs)


def _runs(rows: list[dict]) -> pd.DataFrame:
    """Minimal run rows: only the columns the summary reads."""
    base = {"model": "m", "dataset": "d", "params_json": "{}", "prompt_id": "p", "meter": "nvml",
            "energy_reason": None, "block_efficiency": 1.0, "acceptance_rate": None, "perplexity": 2.0}
    return pd.DataFrame([{**base, **r} for r in rows])


# -- decoder_summary -------------------------------------------------------------------------------
def test_baseline_speedup_is_exactly_one(summary):
    ar = summary[summary["decoder"] == "ar"]
    assert len(ar) == 2  # one per dataset
    assert (ar["speedup"] == 1.0).all()
    assert (ar["energy_saving"] == 0.0).all()


def test_speedup_is_ratio_to_baseline_on_same_dataset(summary):
    for _, g in summary.groupby("dataset"):
        base = g.loc[g["decoder"] == "ar", "tokens_per_s"].item()
        assert g["speedup"].to_numpy() == pytest.approx(g["tokens_per_s"].to_numpy() / base, rel=1e-12)


def test_energy_per_token_is_total_energy_over_total_tokens(summary, runs):
    for r in summary.itertuples():
        g = runs[(runs["dataset"] == r.dataset) & (runs["decoder"] == r.decoder)
                 & (runs["params_json"] == r.params_json)]
        expected = math.fsum(g["energy_j"]) / math.fsum(g["tokens_emitted"])
        assert r.energy_per_token_j == pytest.approx(expected, rel=1e-12)
        # not the mean of the per-run ratios: the fixture's runs differ in length and J/token
        assert r.energy_per_token_j != pytest.approx(g["energy_per_token_j"].mean(), rel=1e-9)


def test_energy_per_token_exact_on_hand_made_runs():
    s = analysis.decoder_summary(_runs([
        {"decoder": "ar", "prompt_id": "a", "tokens_emitted": 4, "decode_time_s": 1.0, "tokens_per_s": 4.0,
         "energy_j": 10.0},
        {"decoder": "ar", "prompt_id": "b", "tokens_emitted": 12, "decode_time_s": 1.0,
         "tokens_per_s": 12.0, "energy_j": 6.0},
    ]))
    (row,) = s.itertuples()
    assert row.energy_per_token_j == 1.0  # 16 J / 16 tokens; the mean of 2.5 and 0.5 J/token is 1.5
    assert row.tokens_per_s == 8.0  # mean of the per-run rates
    assert row.tokens_per_s_pooled == 16 / 2.0  # total tokens / total decode time
    assert row.total_energy_j == 16.0
    assert row.n_runs == 2 and row.n_prompts == 2


def test_mean_rate_and_pooled_rate_differ_for_unequal_runs():
    s = analysis.decoder_summary(_runs([
        {"decoder": "spd", "prompt_id": "a", "tokens_emitted": 10, "decode_time_s": 1.0,
         "tokens_per_s": 10.0, "energy_j": 1.0},
        {"decoder": "spd", "prompt_id": "b", "tokens_emitted": 90, "decode_time_s": 3.0,
         "tokens_per_s": 30.0, "energy_j": 9.0},
    ]))
    (row,) = s.itertuples()
    assert row.tokens_per_s == 20.0
    assert row.tokens_per_s_pooled == 25.0
    assert row.energy_per_token_j == 10.0 / 100
    assert math.isnan(row.speedup) and math.isnan(row.energy_saving)  # no ar baseline


def test_partial_energy_uses_only_runs_with_energy():
    s = analysis.decoder_summary(_runs([
        {"decoder": "ar", "prompt_id": "a", "tokens_emitted": 10, "decode_time_s": 1.0,
         "tokens_per_s": 10.0, "energy_j": 5.0},
        {"decoder": "ar", "prompt_id": "b", "tokens_emitted": 30, "decode_time_s": 1.0,
         "tokens_per_s": 30.0, "energy_j": None, "energy_reason": "window too short"},
    ]))
    (row,) = s.itertuples()
    assert row.energy_per_token_j == 0.5
    assert row.n_energy_runs == 1
    assert row.energy_reason == "window too short"


def test_missing_energy_gives_nan_and_keeps_the_reason(no_energy_store_dir):
    s = analysis.decoder_summary(load_results(no_energy_store_dir))
    assert s["energy_per_token_j"].isna().all()
    assert s["energy_saving"].isna().all()
    assert (s["n_energy_runs"] == 0).all()
    assert s["energy_reason"].str.contains("no GPU energy counter").all()
    assert (s.loc[s["decoder"] == "ar", "speedup"] == 1.0).all()  # speed still compares


def test_labels_name_the_parameters_that_differ(summary):
    labels = set(summary["label"])
    assert {"ar", "spd", "bild", "mmtad", "mtad(tau=0.3)", "mtad(tau=0.5)"} == labels
    assert summary.groupby(["dataset", "label"]).size().max() == 1


def test_rows_follow_the_papers_decoder_order(summary):
    order = list(dict.fromkeys(summary["decoder"]))
    assert order == ["ar", "bild", "spd", "mtad", "mmtad"]


def test_downstream_scores_and_confidence_interval(summary, runs):
    he = summary[summary["dataset"] == "humaneval"].set_index("label")
    raw = runs[runs["dataset"] == "humaneval"]
    spd = raw[raw["decoder"] == "spd"]
    assert he.loc["spd", "pass_at_1"] == pytest.approx(spd["passed"].mean())
    assert he.loc["spd", "rouge_l"] == pytest.approx(spd["rouge_l"].mean())
    assert summary.loc[summary["dataset"] == "mtbench", "pass_at_1"].isna().all()
    assert (summary["energy_per_token_ci_low_j"] < summary["energy_per_token_j"]).all()
    assert (summary["energy_per_token_ci_high_j"] > summary["energy_per_token_j"]).all()


def test_empty_runs_give_empty_summary():
    s = analysis.decoder_summary(pd.DataFrame(columns=["model", "dataset", "decoder", "params_json"]))
    assert s.empty and "energy_per_token_j" in s.columns


# -- main_table and to_markdown --------------------------------------------------------------------
def _cells(markdown: str) -> dict[str, list[str]]:
    """Markdown table rows as {first cell: other cells}."""
    rows = [line.strip("|").split("|") for line in markdown.strip().splitlines()[2:]]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows}


def test_main_table_layout(summary):
    table = analysis.main_table(summary)
    assert list(table.columns.get_level_values("dataset").unique()) == ["humaneval", "mtbench"]
    assert list(table.columns.get_level_values("metric")[:3]) == [
        "tokens_per_s", "energy_per_token_j", "perplexity"]
    assert list(table.index) == ["ar", "bild", "spd", "mtad(tau=0.3)", "mtad(tau=0.5)", "mmtad"]
    assert table.loc["mmtad", ("humaneval", "tokens_per_s")] == pytest.approx(
        summary.query("dataset == 'humaneval' and label == 'mmtad'")["tokens_per_s"].item())


def test_markdown_marks_best_and_second_in_the_fixture(summary):
    md = analysis.to_markdown(analysis.main_table(summary))
    header = md.splitlines()[0]
    assert "humaneval: tokens/s ↑" in header and "mtbench: J/token ↓" in header
    cells = _cells(md)
    # columns: he tokens/s, he J/token, he PPL, mt tokens/s, mt J/token, mt PPL
    assert cells["mmtad"][0].startswith("**") and cells["mtad(tau=0.3)"][0].startswith("<u>")
    assert cells["mmtad"][1].startswith("**")  # lowest J/token is best
    assert cells["mtad(tau=0.3)"][1].startswith("<u>")
    assert cells["mtad(tau=0.5)"][2].startswith("<u>")  # second lowest perplexity
    assert not any(c.startswith(("**", "<u>")) for c in cells["ar"])


def test_markdown_ties_nan_and_lower_is_better():
    table = pd.DataFrame({
        "tokens_per_s": [10.0, 30.0, 20.0, math.nan],
        "energy_per_token_j": [0.5, 0.3, 0.3, 0.9],  # tie for best: both bold, no second
        "perplexity": [2.0, math.nan, 1.5, 3.0],
        "rouge_l": [0.9, 0.5, 0.5, 0.1],  # tie for second: both underlined
        "note": [1.0, 2.0, 3.0, 4.0],  # not a known metric: never marked
    }, index=pd.Index(["a", "b", "c", "d"], name="label"))
    md = analysis.to_markdown(table)
    cells = _cells(md)
    assert md.splitlines()[0] == ("| label | tokens/s ↑ | J/token ↓ | PPL ↓ | Rouge-L ↑ | note |")
    assert [cells[k][0] for k in "abcd"] == ["10.0", "**30.0**", "<u>20.0</u>", "n/a"]
    assert [cells[k][1] for k in "abcd"] == ["0.500", "**0.300**", "**0.300**", "0.900"]
    assert [cells[k][2] for k in "abcd"] == ["<u>2.00</u>", "n/a", "**1.50**", "3.00"]
    assert [cells[k][3] for k in "abcd"] == ["**0.900**", "<u>0.500</u>", "<u>0.500</u>", "0.100"]
    assert [cells[k][4] for k in "abcd"] == ["1.00", "2.00", "3.00", "4.00"]


def test_markdown_ties_are_judged_on_displayed_digits_and_overrides_apply():
    table = pd.DataFrame({"tokens_per_s": [30.01, 30.04, 20.0], "score": [3.0, 1.0, 2.0],
                          "perplexity": [math.nan, 2.0, math.nan]}, index=["x", "y", "z"])
    cells = _cells(analysis.to_markdown(table, higher_is_better={"score": False}))
    assert [cells[k][0] for k in "xyz"] == ["**30.0**", "**30.0**", "20.0"]
    assert [cells[k][1] for k in "xyz"] == ["3.00", "**1.00**", "<u>2.00</u>"]
    assert [cells[k][2] for k in "xyz"] == ["n/a", "2.00", "n/a"]  # a lone value is not marked


def test_markdown_ranks_within_each_model():
    s = pd.DataFrame({"model": ["m1", "m1", "m2", "m2"], "dataset": "d", "decoder": ["ar", "spd"] * 2,
                      "label": ["ar", "spd"] * 2, "tokens_per_s": [10.0, 20.0, 1.0, 2.0]})
    table = analysis.main_table(s, ["tokens_per_s"])
    assert list(table.index) == [("m1", "ar"), ("m1", "spd"), ("m2", "ar"), ("m2", "spd")]
    lines = analysis.to_markdown(table).splitlines()
    assert lines[0] == "| model | label | d: tokens/s ↑ |"
    assert lines[3] == "| m1 | spd | **20.0** |" and lines[5] == "| m2 | spd | **2.0** |"
    assert lines[4] == "| m2 | ar | <u>1.0</u> |"  # one precision per column


# -- accepted lengths and batch curve --------------------------------------------------------------
def test_histogram_fractions_sum_to_one(store_dir, runs):
    steps = load_results(store_dir, "steps")
    hist = analysis.accepted_length_histogram(steps, runs)
    assert list(hist.columns) == ["decoder", "label", "accepted", "count", "fraction"]
    assert "ar" not in set(hist["decoder"])  # ar never drafts
    sums = hist.groupby("label")["fraction"].sum()
    assert sums.to_numpy() == pytest.approx(1.0, abs=1e-12)
    assert hist["count"].sum() == (pd.to_numeric(steps["proposed"]) > 0).sum()
    # every length from 0 to the longest is listed, so bars line up
    assert all(sorted(g["accepted"]) == list(range(g["accepted"].max() + 1))
               for _, g in hist.groupby("label"))
    stats = analysis.accepted_length_stats(hist).set_index("label")
    assert stats.loc["mmtad", "mean_accepted"] > stats.loc["spd", "mean_accepted"]


def test_batch_curve_is_the_papers_table(store_dir):
    curve = crossover.batch_curve(load_results(store_dir, "batch"))
    assert list(curve["batch_size"]) == [b for b, _, _ in PAPER_BATCH]
    for col in ("energy_j", "energy_per_run_j", "energy_per_input_j", "time_s", "time_per_run_s",
                "time_per_input_s"):
        assert col in curve.columns
    assert curve["energy_j"].tolist() == [float(e) for _, e, _ in PAPER_BATCH]
    assert curve["energy_per_input_j"].to_numpy() == pytest.approx(
        (curve["energy_per_run_j"] / curve["batch_size"]).to_numpy())
    assert curve["inputs"].tolist() == [BATCH_RUNS * b for b, _, _ in PAPER_BATCH]
    assert curve["energy_per_run_rel"].iloc[0] == 1.0
    assert curve["energy_per_run_rel"].iloc[-1] == pytest.approx(74058 / 42450)


def test_batch_curve_sorts_and_averages_repeats():
    batch = pd.DataFrame({"model": "m", "batch_size": [4, 1, 4], "runs": 10, "energy_j": [8.0, 1.0, 12.0],
                          "energy_per_run_j": [0.8, 0.1, 1.2], "energy_per_input_j": [0.2, 0.1, 0.3],
                          "time_s": 1.0, "time_per_run_s": 0.1, "time_per_input_s": 0.1,
                          "energy_reason": None})
    curve = crossover.batch_curve(batch)
    assert curve["batch_size"].tolist() == [1, 4]
    assert curve["energy_j"].tolist() == [1.0, 10.0]
    assert curve["n_rows"].tolist() == [1, 2]


def test_each_ratio_is_taken_on_one_basis():
    """Speed-up (decode tokens/s) pairs with the decode-only energy saving; the end-to-end
    speed-up (prefill included) with the total one. Here the drafting decoder halves decode time
    and decode joules but pays the same prefill, so the two bases differ."""
    df = _runs([
        {"decoder": "ar", "tokens_emitted": 10, "decode_time_s": 1.0, "prefill_time_s": 1.0,
         "tokens_per_s": 10.0, "decode_energy_j": 100.0, "energy_j": 200.0},
        {"decoder": "spd", "tokens_emitted": 10, "decode_time_s": 0.5, "prefill_time_s": 1.0,
         "tokens_per_s": 20.0, "decode_energy_j": 50.0, "energy_j": 150.0},
    ])
    s = analysis.decoder_summary(df).set_index("decoder")
    assert s.loc["spd", "speedup"] == 2.0 and s.loc["spd", "energy_saving"] == 0.5
    assert s.loc["spd", "decode_energy_per_token_j"] == 5.0 and s.loc["spd", "energy_per_token_j"] == 15.0
    assert s.loc["spd", "speedup_total"] == pytest.approx(2.0 / 1.5)
    assert s.loc["spd", "energy_saving_total"] == pytest.approx(0.25)


def test_decode_rates_count_the_tokens_the_decode_window_holds():
    """An engine streams its first token out of the prefill window (``decode_tokens`` = n - 1):
    the decode J/token and the pooled tokens/s divide by those; rows stored before the column
    count all their tokens."""
    row = {"decoder": "ar", "tokens_emitted": 11, "decode_time_s": 2.0, "prefill_time_s": 1.0,
           "tokens_per_s": 5.0, "decode_energy_j": 100.0, "energy_j": 150.0}
    engine = analysis.decoder_summary(_runs([{**row, "decode_tokens": 10}])).iloc[0]
    assert engine["decode_energy_per_token_j"] == 10.0 and engine["tokens_per_s_pooled"] == 5.0
    old = analysis.decoder_summary(_runs([row])).iloc[0]
    assert old["decode_energy_per_token_j"] == pytest.approx(100 / 11)
    assert old["tokens_per_s_pooled"] == pytest.approx(11 / 2.0)


def test_drafts_are_configurations_and_ar_is_one_whatever_draft_its_rows_name(runs):
    """Two drafts of one decoder are two summary rows labelled with their draft; ``ar``'s rows,
    stored before draft-free decoders stopped naming the pair's draft (here: half of them name
    one), stay one configuration and the baseline of both."""
    spd = runs[runs.decoder == "spd"]
    other = spd.assign(draft_id="self:int8", run_key=spd["run_key"] + "-q",
                       block_efficiency=spd["block_efficiency"] + 1.0)
    ar = runs[runs.decoder == "ar"]
    old_ar = ar.iloc[::2].assign(draft_id="HuggingFaceTB/SmolLM2-135M")
    mixed = pd.concat([runs[runs.decoder != "ar"], ar.iloc[1::2], old_ar, other],
                      ignore_index=True)
    summary = analysis.decoder_summary(mixed)
    one = summary[(summary.decoder == "spd") & (summary.dataset == "mtbench")].set_index("label")
    assert set(one.index) == {"spd@HuggingFaceTB/SmolLM2-135M", "spd@self:int8"}
    assert one.loc["spd@self:int8", "block_efficiency"] == pytest.approx(
        one.loc["spd@HuggingFaceTB/SmolLM2-135M", "block_efficiency"] + 1.0)
    base = summary[summary.decoder == "ar"]
    assert base["label"].tolist() == ["ar", "ar"] and base["draft_id"].isna().all()  # 2 datasets
    assert (base["n_runs"] == runs[runs.decoder == "ar"].groupby("dataset").size().values).all()
    assert one["speedup"].notna().all()


def test_a_drafts_caveats_reach_its_table_notes_and_csv_columns(runs):
    """The per-draft view carries its rows' flags: ``*`` where a run was measured on a busy
    machine, ``†`` on random weights (`results.drafts`), with the lines saying what they mean."""
    from mtad_energy.results.drafts import draft_notes, draft_rows, draft_table

    spd = runs[runs.decoder == "spd"]
    busy = spd.assign(draft_id="self:int8", run_key=spd["run_key"] + "-q", contended=True)
    rand = spd.assign(draft_id="random:tiny-llama-draft", run_key=spd["run_key"] + "-r")
    mixed = pd.concat([runs, busy, rand], ignore_index=True)
    rows = draft_rows(analysis.decoder_summary(mixed), mixed)
    table = draft_table(rows).set_index(["dataset", "draft"])["flags"]
    assert table[("mtbench", "self:int8")] == "*"
    assert table[("mtbench", "random:tiny-llama-draft")] == "†"
    assert table[("mtbench", "HuggingFaceTB/SmolLM2-135M")] == ""
    assert {"n_contended", "implausible", "random_weights"} <= set(rows.columns)
    notes = draft_notes(rows)
    assert any(n.startswith("*: 4 of") for n in notes) and any(n.startswith("†") for n in notes)
