"""Rows measured on a busy machine are marked wherever they are summarised: the decoders' summary
(runs counted, a "*" and a caption), the crossover table (points and notes); never pooled silently."""

from __future__ import annotations

import pandas as pd
from rich.console import Console

from mtad_energy.cli.tables import summary_table
from mtad_energy.results import analysis, crossover, load_results


def _busy(frame: pd.DataFrame, mask: pd.Series, cores: float = 1.3) -> pd.DataFrame:
    frame = frame.copy()
    frame["contended"] = mask
    frame["others_cores"] = mask.map(lambda b: cores if b else 0.01)
    return frame


def _text(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_the_summary_counts_contended_runs_and_the_table_marks_them(store_dir):
    runs = load_results(store_dir)
    quiet = analysis.decoder_summary(runs)
    assert (quiet["n_contended"] == 0).all()
    assert analysis.contention_note(quiet) is None
    assert "*" not in _text(summary_table(quiet))

    spd = runs["decoder"] == "spd"
    first_spd = spd & (runs.index == runs.index[spd][0])
    summary = analysis.decoder_summary(_busy(runs, first_spd))
    row = summary[summary["decoder"] == "spd"].iloc[0]
    assert row["n_contended"] == 1 and row["others_cores_max"] == 1.3
    assert (summary.loc[summary["decoder"] != "spd", "n_contended"] == 0).all()
    text = _text(summary_table(summary))
    n_runs = int(row["n_runs"])
    assert f"{n_runs}*" in text  # the runs cell of the contended configuration
    assert "*: 1 of the runs were measured while other processes used the machine" in text
    assert "up to 1.30 core(s)" in text
    # the energy view marks the decoder instead (it has no runs column)
    energy = _text(summary_table(summary.assign(attribution_reason="no fit"), columns="energy"))
    assert "spd*" in energy and "*: 1 of the runs" in energy


def test_rows_without_the_columns_count_as_not_flagged(store_dir):
    runs = load_results(store_dir).drop(columns=["contended", "others_cores", "others_cpu_s"])
    summary = analysis.decoder_summary(runs)
    assert (summary["n_contended"] == 0).all() and summary["others_cores_max"].isna().all()
    old = load_results(store_dir).assign(contended=None)
    assert (analysis.decoder_summary(old)["n_contended"] == 0).all()


def test_a_crossover_point_with_contended_rows_or_baseline_is_marked(decode_only_store_dir):
    rows = load_results(decode_only_store_dir, "decode_batch")
    rows = rows[(rows["dataset"] == "mtbench")].reset_index(drop=True)
    quiet = crossover.batch_crossover(rows)
    assert not any("contended" in n for n in crossover.crossover_notes(quiet))
    assert not crossover.crossover_display(quiet)["speed-up"].str.endswith("*").any()

    # ar at B = 4 was measured on a busy machine: every speed-up at B = 4 is marked, ar's tok/s too
    busy_ar = (rows["decoder"] == "ar") & (rows["batch_size"] == 4)
    table = crossover.batch_crossover(_busy(rows, busy_ar, cores=0.9))
    shown = crossover.crossover_display(table)
    at4 = table["batch_size"] == 4
    assert shown.loc[at4 & (table["decoder"] == "spd"), "speed-up"].str.endswith("*").all()
    assert not shown.loc[~at4, "speed-up"].str.endswith("*").any()
    assert shown.loc[at4 & (table["decoder"] == "ar"), "tok/s"].str.endswith("*").all()
    assert not shown.loc[at4 & (table["decoder"] == "spd"), "tok/s"].str.endswith("*").any()
    note = next(n for n in crossover.crossover_notes(table) if n.startswith("contended"))
    assert "at B = 4" in note and "0.90 core(s)" in note


def test_the_report_says_how_many_rows_were_contended(store_dir):
    from mtad_energy.results import report

    runs = load_results(store_dir)
    runs = _busy(runs, runs["decoder"] == "ar", cores=2.0)
    notes = report._energy_notes(runs, analysis.decoder_summary(runs), pd.DataFrame(),
                                 pd.DataFrame())
    line = next(n for n in notes if n.startswith("**Contended:**"))
    assert f"{int((runs['decoder'] == 'ar').sum())} of the runs were measured" in line
    assert "up to 2.00 core(s)" in line
    quiet = load_results(store_dir)
    assert not any("Contended" in n for n in report._energy_notes(
        quiet, analysis.decoder_summary(quiet), pd.DataFrame(), pd.DataFrame()))
