"""What a new-user pass found in reading a store (issue 57, item 3): `decompose A A` counting rows
twice, `report` averaging rows of other meters, token counts or settings into one table row,
`decompose` on simulated joules not saying so, an unreadable environment snapshot passed over,
an even count's median, titles outside their figure and table headers cut."""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.results import ResultStore, analysis, crossover, figures, load_results, stable_key
from mtad_energy.results.report import write_report
from mtad_energy.results.settings import setting_labels
from mtad_energy.results.store_files import StoreWarning
from tests.results.conftest import _batch_rows, _decode_batch_rows, _run_rows, build_store

runner = CliRunner()


def decompose_json(*dirs: Path) -> dict:
    res = runner.invoke(app, ["decompose", *map(str, dirs), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def counts(doc: dict) -> tuple:
    return (doc["rows"], len(doc["windows"]), len(doc["validation"]["runs"]),
            doc["validation"]["median_abs_error"], json.dumps(doc["attribution"], sort_keys=True))


# -- decompose counts each row once ---------------------------------------------------------------
def test_decompose_of_one_store_twice_or_a_copy_counts_each_row_once(store_dir, tmp_path):
    alone = counts(decompose_json(store_dir))
    copy = Path(shutil.copytree(store_dir, tmp_path / "copy"))
    assert counts(decompose_json(store_dir, store_dir)) == alone
    assert counts(decompose_json(store_dir, copy)) == alone  # the same rows, in another store
    assert counts(decompose_json(store_dir, tmp_path / ".." / tmp_path.name / "copy")) == alone


def test_rows_of_one_configuration_measured_in_two_stores_both_count(store_dir, tmp_path):
    """Two measurements share a key (what was asked for) but not a time: both are rows."""
    other = ResultStore(tmp_path / "other")
    for row in _batch_rows(True):
        other.write("batch", row["row_key"], [{**row, "created_unix_s": 1.8e9}])
    assert decompose_json(store_dir, other.root)["rows"] == 2 * decompose_json(store_dir)["rows"]


# -- report never averages across settings ------------------------------------------------------
def store_with_two(root: Path, column: str, value) -> Path:
    """The fixture's runs, and each again with ``column`` = ``value`` and a third of the speed
    (another key: another measurement)."""
    store = ResultStore(root)
    runs, steps = _run_rows(random.Random(0), True)
    for row in runs:
        store.write("steps", row["run_key"], steps[row["run_key"]])
        store.write("runs", row["run_key"], [row])
        key = stable_key({"again": row["run_key"], column: value})
        store.write("runs", key, [{**row, "run_key": key, column: value,
                                   "tokens_per_s": row["tokens_per_s"] / 3}])
    return root


@pytest.mark.parametrize(("column", "value", "shown"), [
    ("meter", "simulated", "meter simulated"), ("max_new_tokens", 64, "64 tokens"),
    ("dtype", "float32", "float32")])
def test_the_report_never_averages_rows_of_another_setting(tmp_path, column, value, shown):
    root = store_with_two(tmp_path / "st", column, value)
    summary = analysis.decoder_summary(load_results(root))
    assert len(summary) == 2 * 12  # 6 configurations x 2 datasets, each setting apart
    assert summary["n_runs"].eq(2).all()  # the two prompts of one setting, never four
    spd = summary[(summary["decoder"] == "spd") & (summary["dataset"] == "mtbench")]
    assert sorted(spd["label"]) == sorted([f"spd [{spd['setting'].iloc[0]}]",
                                           f"spd [{spd['setting'].iloc[1]}]"])
    assert any(shown in s for s in spd["setting"])
    # each over the ar of its own setting (over the other's: 3 times or a third of it)
    assert spd["speedup"].round(6).nunique() == 1 and 1.3 < spd["speedup"].iloc[0] < 1.5
    md = write_report(root, tmp_path / "rep").read_text()
    assert f"spd [{[s for s in spd['setting'] if shown in s][0]}]" in md


def test_a_setting_is_named_only_where_it_varies_within_a_model():
    """A model label already names a compiled, batched or other engine's rows (``+batch4``)."""
    frame = pd.DataFrame({"model": ["m", "m", "m+batch4"], "meter": ["nvml", "simulated", "nvml"],
                          "batch_size": [None, None, 4], "device": "cuda:0"})
    assert list(setting_labels(frame)) == ["meter nvml", "meter simulated", "meter nvml"]
    assert list(setting_labels(frame.iloc[[0, 2]])) == ["", ""]


def test_crossover_and_batch_tables_keep_meters_apart():
    rows = _decode_batch_rows(True) + [{**r, "row_key": r["row_key"][::-1], "meter": "simulated",
                                        "tokens_per_s": r["tokens_per_s"] * 3}
                                       for r in _decode_batch_rows(True)]
    cross = crossover.batch_crossover(rows)
    parts = crossover.crossover_settings(cross)
    assert len(parts) == 2 and any("meter simulated" in title for title, _ in parts)
    assert (cross.groupby(["label", "batch_size"]).size() == 2).all()  # one point per meter
    batch = pd.DataFrame(_batch_rows(True) + [{**r, "meter": "simulated"} for r in _batch_rows(True)])
    curve = crossover.batch_curve(batch)
    assert curve["n_rows"].eq(1).all() and curve["model"].nunique() == 2


# -- decompose says simulated ---------------------------------------------------------------------
def test_decompose_of_simulated_rows_says_so_in_text_and_json(store_dir, tmp_path):
    root = tmp_path / "sim"
    store = ResultStore(root)
    for row in _batch_rows(True):
        store.write("batch", row["row_key"], [{**row, "meter": "simulated"}])
    for row in _decode_batch_rows(True):
        store.write("decode_batch", row["row_key"], [{**row, "meter": "simulated"}])
    doc = decompose_json(root)
    assert doc["simulated"]["batch_rows"] == 5 and doc["simulated"]["decode_windows"] == 8
    assert "simulated" in doc["simulated"]["note"] and "not measured" in doc["simulated"]["note"]
    res = runner.invoke(app, ["decompose", str(root)], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "simulated: 5 of the fit's batch rows" in res.output
    measured = decompose_json(store_dir)["simulated"]
    assert measured == {"batch_rows": 0, "decode_windows": 0, "note": None}
    assert "simulated" not in runner.invoke(app, ["decompose", str(store_dir)]).output


# -- an environment snapshot that does not parse ----------------------------------------------------
@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_an_environment_file_that_does_not_parse_is_reported(tmp_path, text):
    root = build_store(tmp_path / "st", energy=True)
    env = root / "envs" / "0123456789abcdef.json"
    ResultStore(root).write_env("0123456789abcdef", {"gpu": "x"})
    with warnings.catch_warnings(record=True) as clean:
        warnings.simplefilter("always")
        load_results(root)
    assert not [w for w in clean if issubclass(w.category, StoreWarning)]
    env.write_text(text)
    with pytest.warns(StoreWarning, match=r"0123456789abcdef.json is not a valid environment "
                                          r"snapshot.*rows with env_id 0123456789abcdef load"):
        assert len(load_results(root)) == 24


# -- cosmetics ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("accepted", "median"), [
    ([0, 0, 1, 1], 0.5), ([0, 1, 1], 1.0), ([1, 3], 2.0), ([2, 2, 2, 4], 2.0)])
def test_the_median_accepted_length_of_an_even_count_is_the_mean_of_the_middle_two(accepted, median):
    steps = pd.DataFrame({"run_key": "k", "accepted": accepted, "proposed": 4})
    runs = pd.DataFrame({"run_key": ["k"], "decoder": ["spd"], "params_json": ["{}"]})
    stats = analysis.accepted_length_stats(analysis.accepted_length_histogram(steps, runs))
    assert stats["median_accepted"].iloc[0] == median == pd.Series(accepted).median()


def _inside(fig, text, room) -> bool:
    box = text.get_window_extent(fig.canvas.get_renderer())
    return box.x0 >= room.x0 - 1 and box.x1 <= room.x1 + 1


def test_figure_and_panel_titles_lie_inside_the_figure(decode_only_store_dir):
    part = crossover.crossover_settings(crossover.batch_crossover(
        load_results(decode_only_store_dir, "decode_batch")))[0][1]
    title = "meta-llama/Meta-Llama-3.1-70B-Instruct+compile-inductor-dynamic · " * 3 + "decoders"
    fig = figures.plot_batch_crossover(part, title)
    fig.canvas.draw()
    assert _inside(fig, fig._suptitle, fig.bbox) and "\n" in fig._suptitle.get_text()
    hist = pd.DataFrame({"decoder": "spd", "label": "spd(gamma=4, a_rather_long_parameter=0.5) "
                         "[meter simulated, 64 tokens, float32]", "accepted": [0, 1, 2],
                         "count": [1, 2, 1], "fraction": [0.25, 0.5, 0.25]})
    hist = pd.concat([hist, hist.assign(label=hist["label"] + " again")])
    fig = figures.plot_accepted_lengths(hist)
    fig.canvas.draw()
    for ax in fig.axes:
        if ax.get_visible():
            assert _inside(fig, ax.title, ax.get_tightbbox(fig.canvas.get_renderer())), \
                ax.title.get_text()
            assert _inside(fig, ax.title, fig.bbox)


def test_the_schedule_table_never_cuts_a_column_name(store_dir, tmp_path):
    from tests.results.test_schedule import sweep_rows, write_store

    write_store(tmp_path / "st", sweep_rows())
    res = runner.invoke(app, ["schedule", str(tmp_path / "st"), "--out", str(tmp_path / "s.json")],
                        env={"COLUMNS": "40"})
    assert res.exit_code == 0, res.output
    words = set(res.output.replace("┃", " ").replace("│", " ").split())
    for header in ("batch sizes", "speed-up", "best spd gamma", "vLLM gamma"):
        assert set(header.split()) <= words, header
