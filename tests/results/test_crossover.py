"""Decoders across batch sizes in a store several sweeps wrote: settings kept apart, each decoder
against the ar that warps alike, the crossover judged on medians with the spread shown, and one
text for the CLI, the report and the notebook."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from mtad_energy.results import analysis, crossover, load_results
from mtad_energy.results.report import plot_batch_crossover, write_report


@pytest.fixture(scope="module")
def table(decode_only_store_dir) -> pd.DataFrame:
    return crossover.batch_crossover(load_results(decode_only_store_dir, "decode_batch"))


AR, SPD = "ar(temperature=1)", "spd(temperature=1)"  # the default warp, beside temperature 0


def _at(table, dataset, label, size):
    rows = table[(table.dataset == dataset) & (table.label == label) & (table.batch_size == size)]
    assert len(rows) == 1, rows
    return rows.iloc[0]


def test_sweeps_of_other_datasets_or_lengths_are_never_pooled(table):
    # mtbench/32 tokens: ar at B = 1 ran at 30 tok/s (and 60 with temperature 0); humaneval/64
    # tokens at half that. Pooled per (label, B), ar's median would mix both settings.
    assert _at(table, "mtbench", AR, 1).tokens_per_s == 30.0
    assert _at(table, "humaneval", AR, 1).tokens_per_s == 15.0
    assert _at(table, "humaneval", AR, 1).repeats == 3 and _at(table, "mtbench", AR, 1).repeats == 1
    settings = crossover.crossover_settings(table)
    assert [title for title, _ in settings] == ["llama3-8b · humaneval · 64 tokens · cpu (float16)",
                                                "llama3-8b · mtbench · 32 tokens · cpu (float16)"]


def test_a_decoder_is_compared_with_the_ar_that_warps_alike(table):
    hot = _at(table, "mtbench", "spd(temperature=0)", 1)
    assert hot.baseline_label == "ar(temperature=0)"
    assert hot.speedup == pytest.approx(2.0)  # 120 / 60, not 120 / 30
    assert _at(table, "mtbench", SPD, 8).baseline_label == AR
    assert _at(table, "mtbench", SPD, 8).speedup == pytest.approx(120 / 180)


def test_the_crossover_uses_medians_shows_the_spread_and_the_baseline_has_none(table):
    # humaneval, 3 repeats at 0.7x, 1x and 1.3x the fixture's speed: the medians are the
    # fixture's (spd beats ar at 1 and 2, not from 4 on)
    spd = table[(table.dataset == "humaneval") & (table.label == SPD)].set_index("batch_size")
    assert spd.loc[4, "speedup"] == pytest.approx(0.9)
    assert (spd.loc[4, "speedup_min"], spd.loc[4, "speedup_max"]) == pytest.approx((0.63, 1.17))
    assert (spd["crossover_batch_size"] == 4).all()
    ar = table[table.decoder == "ar"]
    assert ar["crossover_batch_size"].isna().all()  # ar does not "stop beating ar at 1"
    notes = crossover.crossover_notes(table[table.dataset == "humaneval"])
    assert any(f"{SPD}: the repeats disagree on beating ar at B = 4" in n for n in notes), notes
    assert not any("one repeat" in n for n in notes)
    assert any("one repeat" in n for n in crossover.crossover_notes(table[table.dataset == "mtbench"]))


def test_one_noisy_repeat_cannot_move_the_crossover():
    """Three repeats where one is wild: the median decides, not the outlier."""
    rows = []
    for rep, noise in enumerate((1.0, 1.02, 3.0)):  # repeat 2 measured spd 3x too fast
        for size, ar, spd in ((1, 10, 20), (2, 20, 18), (4, 40, 30)):
            rows += [{"decoder": "ar", "batch_size": size, "repeat": rep, "tokens_per_s": ar},
                     {"decoder": "spd", "batch_size": size, "repeat": rep,
                      "tokens_per_s": spd * noise}]
    t = crossover.batch_crossover(rows)
    assert (t.loc[t.decoder == "spd", "crossover_batch_size"] == 2).all()
    alone = crossover.batch_crossover([r for r in rows if r["repeat"] == 2])
    assert alone.loc[alone.decoder == "spd", "crossover_batch_size"].isna().all()  # why repeats


def test_every_view_prints_the_same_text(table):
    mt = table[table.dataset == "mtbench"]
    shown = crossover.crossover_display(mt).set_index(["decoder", "B"])
    assert list(shown.columns) == ["tok/s", "speed-up", "block eff.", "stops beating ar at B"]
    assert shown.loc[(AR, "1"), "stops beating ar at B"] == "-"
    assert shown.loc[(SPD, "2"), "speed-up"] == "1.45x"
    assert shown.loc[(SPD, "8"), "stops beating ar at B"] == "4"
    assert shown.loc[("spd(temperature=0)", "1"), "stops beating ar at B"] == "4"
    md = analysis.to_markdown(shown, higher_is_better={})
    assert "**" not in md and "<u>" not in md  # ar's constant 1.00x is not "best"
    assert "| 2 |" in md and "| 2.00 |" not in md and "crossover_batch_size" not in md
    never = crossover.crossover_display(crossover.batch_crossover([
        {"decoder": "ar", "batch_size": 1, "repeat": 0, "tokens_per_s": 1.0},
        {"decoder": "spd", "batch_size": 1, "repeat": 0, "tokens_per_s": 2.0}]))
    assert never.iloc[1]["stops beating ar at B"] == "never"
    he = crossover.crossover_display(table[table.dataset == "humaneval"])
    assert "min-max" in he.columns and he.iloc[-2]["min-max"] == "0.63-1.17"


def test_report_of_a_store_with_only_decoding_sweeps(decode_only_store_dir, tmp_path):
    path = write_report(decode_only_store_dir, tmp_path / "rep")
    text = path.read_text()
    assert "has no runs" not in text
    assert "40 decoding batch-size rows (`sweep batch-size --decoder`)" in text
    assert "40 of 40 decoding batch-size rows have no energy reading" in text
    assert "no GPU energy counter on this machine (CPU run) (40 rows)" in text
    assert "### llama3-8b · mtbench · 32 tokens · cpu (float16)" in text
    assert "### llama3-8b · humaneval · 64 tokens · cpu (float16)" in text
    assert "| spd(temperature=0) | 1 | 120.0 | 2.00x |" in text
    assert "crossover_batch_size" not in text and "stops beating ar at 1" not in text
    assert "- one repeat: a single noisy measurement" in text
    figures = sorted(p.name for p in (tmp_path / "rep" / "figures").glob("*.png"))
    assert figures == ["batch_crossover-2.png", "batch_crossover.png"]


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]


def test_crossover_figure_labels_and_what_it_says_without_energy_or_decoders(table):
    mt = table[(table.dataset == "mtbench")]
    fig = plot_batch_crossover(mt, "a title")
    assert fig.axes[0].get_ylabel() == "speed-up over ar (×)"
    assert fig.get_suptitle() == "a title"
    texts = " ".join(_texts(fig))
    assert "no GPU energy counter on this machine (CPU run)" in texts  # the rows' own reason
    assert "reads none on this machine" not in texts
    assert fig.axes[0].get_xlim()[1] < 11  # sizes up to 8, not an axis to 10 and beyond
    long = mt.assign(energy_reason="no GPU meter here; nvml-counter: NVML could not start. Use rapl")
    texts = " ".join(_texts(plot_batch_crossover(long)))
    assert "no GPU meter here" in texts and "NVML" not in texts  # its first clause, as in the CLI
    alone = plot_batch_crossover(mt[mt.decoder == "ar"])
    assert "only ar was measured" in " ".join(_texts(alone))
    assert all(not ax.get_legend() for ax in alone.axes) and not any(ax.lines for ax in alone.axes)


def test_crossover_rule_has_no_crossover_when_the_baseline_is_missing():
    t = crossover.batch_crossover([{"decoder": "spd", "batch_size": 1, "repeat": 0,
                                   "tokens_per_s": 2.0}])
    assert math.isnan(t.iloc[0]["speedup"])
    assert crossover.crossover_display(t).iloc[0]["stops beating ar at B"] == "n/a"
