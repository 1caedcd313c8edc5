"""The decoding batch-size sweep (`sweep batch-size --decoder`): rows per decoder and batch size,
resume, and the crossover with ar."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.results import load_results
from mtad_energy.results.crossover import batch_crossover

runner = CliRunner()


def _rows(decoder: str, tok_s: dict[int, float], jpt: dict[int, float | None]) -> list[dict]:
    return [{"label": decoder, "decoder": decoder, "batch_size": b, "repeat": 0,
             "tokens_per_s": t, "energy_per_token_j": jpt[b], "block_efficiency": 1.0,
             "perplexity": 2.0} for b, t in tok_s.items()]


def test_crossover_is_the_size_from_which_a_decoder_stops_beating_ar():
    ar = _rows("ar", {1: 10, 2: 20, 4: 40, 8: 80}, {1: 1.0, 2: 0.5, 4: 0.25, 8: 0.125})
    spd = _rows("spd", {1: 20, 2: 15, 4: 50, 8: 60}, {1: 0.5, 2: 0.5, 4: 0.2, 8: 0.25})
    fast = _rows("fast", {1: 20, 2: 40, 4: 80, 8: 81}, {1: None, 2: None, 4: None, 8: None})
    t = batch_crossover(ar + spd + fast).set_index(["label", "batch_size"])
    assert t.loc[("spd", 1), "speedup"] == 2.0 and t.loc[("spd", 8), "speedup"] == 0.75
    assert t.loc[("spd", 4), "energy_saving"] == pytest.approx(0.2)
    # spd loses at 2 but wins again at 4: it stops beating ar from 8 on
    assert (t.loc["spd", "crossover_batch_size"] == 8).all()
    assert math.isnan(t.loc[("fast", 1), "crossover_batch_size"])  # still ahead at 8
    assert t.loc["fast", "energy_saving"].isna().all()  # no energy: n/a, not 0


def test_sweep_decodes_each_size_stores_rows_and_resumes(tmp_path, model_dirs):
    out = tmp_path / "sweep"
    args = ["sweep", "batch-size", "--decoder", "spd", "--target", model_dirs["llama"],
            "--draft", model_dirs["llama-draft"], "--sizes", "1,3", "--device", "cpu",
            "--meter", "simulated", "--max-new-tokens", "6", "--n-prompts", "2",
            "--output", str(out), "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    doc = json.loads(first.stdout)
    assert {(r["decoder"], r["batch_size"]) for r in doc["rows"]} == {
        ("ar", 1), ("ar", 3), ("spd", 1), ("spd", 3)}
    stored = load_results(out, "decode_batch")
    assert len(stored) == 4
    b3 = stored[stored.batch_size == 3]
    assert (b3.tokens <= 3 * 6).all() and (b3.tokens > 6).all()  # three rows decoded together
    assert (stored.energy_per_token_j > 0).all()
    ar = stored[stored.decoder == "ar"]
    assert (ar.block_efficiency == 1.0).all()
    assert (stored.decode_tokens == stored.tokens).all()  # the loop's decode window holds all
    assert (tmp_path / "sweep-crossover.png").is_file()
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    pd.testing.assert_frame_equal(load_results(out, "decode_batch"), stored)
    report = runner.invoke(app, ["report", str(out)])
    assert report.exit_code == 0, report.output
    text = (tmp_path / "sweep-report" / "report.md").read_text()
    assert "## Decoders across batch sizes" in text
    assert (tmp_path / "sweep-report" / "figures" / "batch_crossover.png").is_file()


def test_a_decoder_that_does_not_batch_is_refused_before_anything_runs(tmp_path, model_dirs,
                                                                        monkeypatch):
    from mtad_energy.decoding.decoders.bild import Bild

    monkeypatch.setattr(Bild, "batched", False)  # every registry decoder batches today
    out = runner.invoke(app, ["sweep", "batch-size", "--decoder", "bild", "--target",
                              model_dirs["llama"], "--draft", model_dirs["llama-draft"],
                              "--sizes", "1,2", "--device", "cpu", "--meter", "none",
                              "--output", str(tmp_path / "s"), "--json"])
    assert out.exit_code == 2
    err = json.loads(out.stdout)
    assert "bild do not decode batches yet" in json.dumps(err)
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").rglob("*.parquet"))


def test_profile_batch_size_reaches_the_rows_and_refuses_what_does_not_batch(tmp_path, model_dirs,
                                                                           monkeypatch):
    from mtad_energy.decoding.decoders.bild import Bild

    monkeypatch.setattr(Bild, "batched", False)
    common = ["--target", model_dirs["llama"], "--draft", model_dirs["llama-draft"],
              "--device", "cpu", "--meter", "none", "--dataset", "mtbench", "--n-prompts", "2",
              "--max-new-tokens", "4", "--json"]
    bad = runner.invoke(app, ["profile", "--decoder", "bild", "--batch-size", "2",
                              "--output", str(tmp_path / "bad"), *common])
    assert bad.exit_code == 2 and "bild do not decode batches yet" in bad.output
    ok = runner.invoke(app, ["profile", "--decoder", "spd", "--batch-size", "2",
                             "--output", str(tmp_path / "ok"), *common])
    assert ok.exit_code == 0, ok.output
    rows = load_results(tmp_path / "ok")
    rows = rows[rows.decoder == "spd"]  # beside profile's baseline, ar
    assert list(rows.batch_size) == [2, 2] and rows.energy_share.sum() == pytest.approx(1.0)


# -- several workers, re-runs, interruptions ---------------------------------------------------
def _sweep(pair, store, meter, progress=None):
    from mtad_energy.bench.decode_batch import decode_batch_sweep
    from mtad_energy.config import DecoderSpec

    prompts = [[5, 9, 4], [7, 3, 11, 12]]
    return decode_batch_sweep(pair, [DecoderSpec("ar"), DecoderSpec("spd")], [1, 2], prompts, store,
                              meter, max_new_tokens=4, progress=progress)


def test_rows_another_worker_stored_since_the_start_count_as_skipped(tmp_path, llama_pair):
    from mtad_energy.measure.none import NoneMeter
    from mtad_energy.results import ResultStore

    other = {}

    def progress(row, ran):  # after this worker's first row, another one does the whole sweep
        if not other:
            other["report"] = _sweep(llama_pair, ResultStore(tmp_path), NoneMeter())

    rep = _sweep(llama_pair, ResultStore(tmp_path), NoneMeter(), progress)
    assert (rep.ran, rep.skipped, len(rep.rows)) == (1, 3, 4)
    assert (other["report"].ran, other["report"].skipped) == (3, 1)
    stored = load_results(tmp_path, "decode_batch")
    assert len(stored) == 4 and stored["row_key"].is_unique
    # the other worker's rows, as it stored them (not measured again here)
    assert [r["created_unix_s"] for r in rep.rows[1:]] == [r["created_unix_s"] for r in
                                                            other["report"].rows[1:]]


def test_a_row_another_worker_stores_while_this_one_measures_it_counts_as_skipped(tmp_path,
                                                                                   llama_pair):
    """Two identical sweeps at once: the second stores a row while the first is measuring it."""
    import time

    from mtad_energy.measure.none import NoneMeter
    from mtad_energy.results import ResultStore

    other = {}

    def clock():  # the first window of this worker: the other worker runs the whole sweep
        if not other:
            other["report"] = _sweep(llama_pair, ResultStore(tmp_path), NoneMeter())
        return time.perf_counter()

    rep = _sweep(llama_pair, ResultStore(tmp_path), NoneMeter(clock=clock))
    assert (rep.ran, rep.skipped) == (0, 4)  # its one measured row lost the race: the other's
    assert other["report"].ran == 4
    stored = load_results(tmp_path, "decode_batch")
    assert len(stored) == 4
    assert {r["row_key"] for r in rep.rows} == set(stored["row_key"])


def _cli_sweep(model_dirs, out, *extra):
    return ["sweep", "batch-size", "--decoder", "spd", "--target", model_dirs["llama"],
            "--draft", model_dirs["llama-draft"], "--sizes", "1,2", "--device", "cpu",
            "--max-new-tokens", "4", "--n-prompts", "2", "--output", str(out), *extra]


def test_rerun_counts_stored_rows_and_an_interruption_counts_what_it_kept(tmp_path, model_dirs,
                                                                          monkeypatch):
    from mtad_energy.bench import decode_batch

    out = tmp_path / "s"
    real, calls = decode_batch._measure, {"n": 0}

    def interrupted(*args, **kwargs):  # Ctrl-C while the third row is measured
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_batch, "_measure", interrupted)
    res = runner.invoke(app, _cli_sweep(model_dirs, out, "--meter", "none"))
    assert res.exit_code == 130
    text = " ".join(res.output.split())
    assert "interrupted: 2 row(s) measured and stored" in text and "2 left" in text, text
    monkeypatch.setattr(decode_batch, "_measure", real)
    res = runner.invoke(app, _cli_sweep(model_dirs, out, "--meter", "none"))
    assert res.exit_code == 0, res.output
    assert "2 row(s) measured, 2 already stored" in " ".join(res.output.split())
    doc = json.loads(runner.invoke(app, _cli_sweep(model_dirs, out, "--meter", "none", "--json")).stdout)
    assert (doc["ran"], doc["skipped"]) == (0, 4)


def test_the_caption_gives_the_first_line_of_a_long_meter_reason(tmp_path, model_dirs, monkeypatch):
    from mtad_energy.measure import none

    reason = ("no GPU energy counter here\nrapl: /sys/class/powercap is not readable\n"
              "nvml: NVMLError_LibraryNotFound")
    monkeypatch.setattr(none.NoneMeter.__init__, "__defaults__", (reason, None))
    res = runner.invoke(app, _cli_sweep(model_dirs, tmp_path / "s", "--meter", "none"))
    assert res.exit_code == 0, res.output
    assert "J/tok n/a: no GPU energy counter here" in res.output
    assert "powercap" not in res.output and "NVMLError" not in res.output


def test_options_of_the_other_study_are_refused_before_anything_runs(tmp_path, model_dirs):
    res = runner.invoke(app, ["sweep", "batch-size", "--decoder", "ar", "--runs", "5000",
                              "--mitigate", "on", "--context-len", "99999", "--forwards-per-run", "7",
                              "--target", model_dirs["llama"], "--meter", "none",
                              "--output", str(tmp_path / "d")])
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert "--runs, --forwards-per-run, --context-len, --mitigate are not used here" in text
    res = runner.invoke(app, ["sweep", "batch-size", "--max-new-tokens", "5", "--set", "gamma=3",
                              "--target", model_dirs["llama"], "--meter", "none",
                              "--output", str(tmp_path / "f"), "--json"])
    assert res.exit_code == 2
    assert "--max-new-tokens, --set are not used here" in json.loads(res.stdout)["error"]
    assert not (tmp_path / "d").exists() and not (tmp_path / "f").exists()


def test_output_dot_puts_the_plot_beside_the_store(tmp_path, model_dirs, monkeypatch):
    store = tmp_path / "here"
    store.mkdir()
    monkeypatch.chdir(store)
    res = runner.invoke(app, _cli_sweep(model_dirs, ".", "--meter", "none", "--json"))
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["plot"] == str(tmp_path / "here-crossover.png")
    assert (tmp_path / "here-crossover.png").is_file()


def test_sweep_decodes_pld_without_loading_the_draft_and_says_so(tmp_path, model_dirs):
    args = ["sweep", "batch-size", "--decoder", "pld", "--target", model_dirs["llama"],
            "--draft", model_dirs["llama-draft"], "--sizes", "1,2", "--device", "cpu",
            "--meter", "none", "--max-new-tokens", "6", "--n-prompts", "2",
            "--output", str(tmp_path / "sweep"), "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert {(r["decoder"], r["batch_size"]) for r in doc["rows"]} == {
        ("ar", 1), ("ar", 2), ("pld", 1), ("pld", 2)}
    assert any("pld drafts without a draft model" in n and "not loaded" in n
               for n in doc["notes"])


def test_compiled_sweep_stores_its_rows_apart_and_compiles_nothing_inside_a_window(tmp_path,
                                                                                   model_dirs):
    """`sweep batch-size --decoder spd,mtad --sizes 1,3 --compile`: rows under
    '<model>+compile-eager' beside the eager ones of the same store, the eager tokens, no compile
    inside any window (each size's full-length warm-up compiled its shapes), peak memory. (The
    windows are dynamo's concern, whatever the backend; inductor's C++ build is minutes here.)"""
    out = tmp_path / "sweep"
    args = ["sweep", "batch-size", "--decoder", "spd,mtad", "--target", model_dirs["llama"],
            "--draft", model_dirs["llama-draft"], "--sizes", "1,3", "--device", "cpu",
            "--meter", "none", "--max-new-tokens", "6", "--n-prompts", "3", "--set",
            "temperature=0", "--output", str(out), "--json"]
    eager = runner.invoke(app, args)
    assert eager.exit_code == 0, eager.output
    compiled = runner.invoke(app, [*args, "--compile", "--compile-backend", "eager"])
    assert compiled.exit_code == 0, compiled.output
    assert json.loads(compiled.stdout)["ran"] == 6
    rows = load_results(out, "decode_batch")
    assert len(rows) == 12 and set(rows.model) == {"custom", "custom+compile-eager"}
    comp, eag = (rows[rows.model == m].set_index(["label", "batch_size"]).sort_index()
                 for m in ("custom+compile-eager", "custom"))
    assert (comp.tokens == eag.tokens).all() and (comp.block_efficiency == eag.block_efficiency).all()
    assert (comp.compile_in_window_s == 0).all() and comp["compile"].all() and not eag["compile"].any()
    # each size's warm-up compiled before its one row's window: the row carries that cost
    assert (comp.compile_s > 0).all() and (eag.compile_s == 0).all() and (eag.graphs_compiled == 0).all()
    doc = json.loads(compiled.stdout)  # the summary's JSON and notes say it too
    assert all(r["compile_s"] > 0 for r in doc["rows"])
    assert any(n.startswith("compiling") for n in doc["notes"])
    assert all(r["compile_s"] == 0 for r in json.loads(eager.stdout)["rows"])
    assert (rows.peak_memory_bytes > 0).all()
    assert not rows.energy_flags.str.contains("compiled_in_window").any()


def test_a_batch_size_that_would_not_fit_is_not_run_and_says_why(tmp_path, model_dirs,
                                                                 monkeypatch):
    """The sweep never ends in an out-of-memory crash: a size whose caches would not fit the
    free memory is not run (the reason is printed and in --json), nor is one that runs out of
    memory anyway; the other sizes are measured."""
    from mtad_energy.bench import decode_batch
    from mtad_energy.decoding.runtime import memory

    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: 3_000_000)
    real = decode_batch._measure

    def oom_at_3(decoder, pair, rows, *args, **kwargs):
        if len(rows) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(decoder, pair, rows, *args, **kwargs)

    monkeypatch.setattr(decode_batch, "_measure", oom_at_3)
    out = runner.invoke(app, ["sweep", "batch-size", "--decoder", "spd", "--target",
                              model_dirs["llama"], "--draft", model_dirs["llama-draft"],
                              "--sizes", "1,3,64", "--device", "cpu", "--meter", "none",
                              "--max-new-tokens", "4", "--n-prompts", "2",
                              "--output", str(tmp_path / "s"), "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    not_run = {(r["decoder"], r["batch_size"]): r["reason"] for r in doc["not_run"]}
    assert set(not_run) == {("ar", 3), ("ar", 64), ("spd", 3), ("spd", 64)}
    assert not_run[("spd", 64)].startswith("needs about") and "GiB free" in not_run[("spd", 64)]
    assert not_run[("spd", 3)].startswith("out of memory at batch size 3")
    assert set(load_results(tmp_path / "s", "decode_batch").batch_size) == {1}


@pytest.mark.slow
def test_sweep_decodes_pld_and_eagle_in_batches(tmp_path, model_dirs):
    """`sweep batch-size --decoder pld,eagle`: the head from `--draft eagle:DIR`, rows at each
    size with their draft (none for pld, the head for eagle) and draft tokens proposed."""
    args = ["sweep", "batch-size", "--decoder", "pld,eagle", "--target", model_dirs["llama"],
            "--draft", f"eagle:{model_dirs['llama-eagle']}", "--sizes", "1,2", "--device", "cpu",
            "--meter", "none", "--max-new-tokens", "6", "--n-prompts", "2",
            "--output", str(tmp_path / "sweep"), "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = load_results(tmp_path / "sweep", "decode_batch")
    assert set(zip(rows.decoder, rows.batch_size, strict=True)) == {
        (d, b) for d in ("ar", "pld", "eagle") for b in (1, 2)}
    eagle = rows[rows.decoder == "eagle"]
    assert set(eagle.draft_id) == {f"eagle:{model_dirs['llama-eagle']}"}
    assert (eagle.draft_proposed > 0).all() and (eagle.draft_forwards > 0).all()
