"""decompose over stored results: both forms fitted on batch rows (window or mitigated per-run
basis), the paper form's per-decoder split from ops rows, validation on held-out windows, and
the CLI's tables and JSON (synthetic rows with known coefficients)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.energy.attribution import fit_columns, validate
from mtad_energy.results import ResultStore, stable_key
from mtad_energy.results.breakdown import decode_windows, fit_stores, ops_fractions_breakdown
from mtad_energy.results.schema import BATCH, OPS, RUNS

P_STATIC, PW_FLOP, PW_MEM = 60.0, 120.0, 200.0
PI0, EPS_FLOP, EPS_BYTE = 100.0, 1e-12, 5e-11


def paper_energy(t, tf, tm):
    return P_STATIC * t + PW_FLOP * tf + PW_MEM * tm


def roofline_energy(t, flops, nbytes):
    return PI0 * t + EPS_FLOP * flops + EPS_BYTE * nbytes


# paper and roofline cannot both hold exactly on one row: each row is written twice, once per form
POINTS = {1: (1.0, 0.05, 0.80, 2e12, 4e10), 2: (1.1, 0.15, 0.70, 4e12, 4.2e10),
          4: (1.2, 0.30, 0.55, 8e12, 4.1e10), 8: (1.3, 0.50, 0.35, 3e13, 5e10),
          16: (1.6, 0.70, 0.20, 9e13, 9e10), 32: (2.0, 0.80, 0.10, 1.5e14, 1.1e11)}


def _batch_row(key: str, **cols) -> dict:
    return {c: None for c in BATCH.required} | {"row_key": key, "runs": 4} | cols


@pytest.fixture()
def store_dir(tmp_path):
    store = ResultStore(tmp_path / "s")
    for b, (t, ff, fm, _, _) in POINTS.items():
        key = stable_key({"b": b})
        store.write("batch", key, [_batch_row(key, batch_size=b, time_s=t, t_flop_s=ff * t,
                                              t_mem_s=fm * t, energy_j=paper_energy(t, ff * t, fm * t))])
    for dec, (t_tok, ff, fm) in {"ar": (0.05, 0.1, 0.8), "mtad": (0.03, 0.3, 0.6)}.items():
        for i in range(2):
            key = stable_key({"dec": dec, "i": i})
            tokens = 10
            t = t_tok * tokens
            store.write("runs", key, [{c: None for c in RUNS.required} | {
                "run_key": key, "model": "toy", "decoder": dec, "params_json": "{}", "label": dec,
                "tokens_emitted": tokens, "prefill_time_s": 0.0, "decode_time_s": t,
                "energy_j": paper_energy(t, ff * t, fm * t)}])
        key = stable_key({"ops": dec})
        store.write("ops", key, [{c: None for c in OPS.required} | {
            "ops_key": key, "model": "toy", "decoder": dec, "params_json": "{}",
            "wall_time_s": 2.0, "t_flop_s": 2.0 * ff, "t_mem_s": 2.0 * fm}])
    return tmp_path / "s"


@pytest.fixture()
def roofline_dir(tmp_path):
    """Batch rows that follow the roofline (half of them mitigated: per-run energy and time),
    and decoding runs whose decode windows it must predict."""
    store = ResultStore(tmp_path / "r")
    for b, (t, _, _, flops, nbytes) in POINTS.items():
        key = stable_key({"b": b})
        runs = 4
        row = _batch_row(key, batch_size=b, time_s=t, energy_j=roofline_energy(t, flops, nbytes),
                         counted_flops=flops, counted_bytes=nbytes, runs=runs)
        if b % 4 == 0:  # mitigated: the protocol's per-run figures (the window's are noisier)
            t_run = 0.9 * t / runs
            row.update(mitigated=True, mitigated_time_per_run_s=t_run, energy_j=1e9,
                       energy_per_run_j=roofline_energy(t_run, flops / runs, nbytes / runs))
        store.write("batch", key, [row])
    for i, (td, tt, to) in enumerate([(0.2, 0.5, 0.05), (0.0, 0.9, 0.02)]):
        key = stable_key({"run": i})
        draft = (3e12, 1e10) if td else (0, 0)
        exact = roofline_energy(td + tt + to, draft[0] + 2e13, draft[1] + 6e10)
        store.write("runs", key, [{c: None for c in RUNS.required} | {
            "run_key": key, "model": "toy", "decoder": ["spd", "ar"][i], "label": ["spd", "ar"][i],
            "params_json": "{}", "tokens_emitted": 20, "decode_time_s": td + tt + to,
            "time_draft_s": td, "time_target_s": tt, "time_other_s": to, "draft_flops": draft[0],
            "draft_bytes": draft[1], "target_flops": 2e13, "target_bytes": 6e10,
            "draft_proposed": 12 if td else 0, "draft_accepted": 6 if td else 0, "iterations": 4,
            "decode_energy_j": exact * (1.1 if i else 1.0)}])  # the second: 10 % above the model
    return tmp_path / "r"


def test_both_forms_recover_their_coefficients(store_dir, roofline_dir):
    fits, n = fit_stores([store_dir])
    assert n == 6
    assert fits["paper"].values == pytest.approx(
        {"p_static_w": P_STATIC, "pw_flop_w": PW_FLOP, "pw_mem_w": PW_MEM})
    assert fits["roofline"].startswith("the batch rows lack counted_flops / counted_bytes: re-run")
    fits, _ = fit_stores([roofline_dir])
    assert fits["roofline"].values == pytest.approx(
        {"pi0_w": PI0, "eps_flop_j": EPS_FLOP, "eps_byte_j": EPS_BYTE})
    assert fits["paper"].startswith("the batch rows lack t_flop_s / t_mem_s: re-run the sweep with --ops")


def test_mitigated_rows_are_fitted_per_run(roofline_dir):
    from mtad_energy.results import load_results

    batch = load_results(roofline_dir, "batch").sort_values("batch_size")
    e, t, flops, nbytes = fit_columns(batch, "roofline")
    mitigated = batch["batch_size"].to_numpy() % 4 == 0
    assert np.all(e[mitigated] < 1e9)  # the per-run energy, not the window's
    assert np.allclose(flops[mitigated] * 4, batch["counted_flops"].to_numpy()[mitigated])
    assert np.allclose(flops[~mitigated], batch["counted_flops"].to_numpy()[~mitigated])


def test_validation_predicts_held_out_windows(roofline_dir):
    fits, _ = fit_stores([roofline_dir])
    valid = validate(fits["roofline"], decode_windows([roofline_dir])).set_index("decoder")
    assert valid.loc["spd", "error"] == pytest.approx(0.0, abs=1e-9)
    assert valid.loc["ar", "error"] == pytest.approx(1 / 1.1 - 1)
    with pytest.raises(ValueError, match="takes the roofline fit"):
        validate(fits["paper"], decode_windows([roofline_dir]))


def test_the_paper_form_splits_decoders_by_their_ops_fractions(store_dir):
    fits, _ = fit_stores([store_dir])
    table = ops_fractions_breakdown([store_dir], fits["paper"]).set_index("decoder")
    assert list(table.index) == ["ar", "mtad"]
    parts = table[["static_j_per_token", "flop_j_per_token", "mem_j_per_token"]].sum(axis=1)
    assert np.allclose(parts, table["predicted_j_per_token"])
    assert np.allclose(table["predicted_j_per_token"], table["measured_j_per_token"])
    assert table.loc["ar", "mem_j_per_token"] == pytest.approx(PW_MEM * 0.8 * 0.05)


def test_cli_decompose_prints_both_forms_the_validation_and_the_attribution(roofline_dir):
    res = CliRunner().invoke(app, ["decompose", str(roofline_dir), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["fits"]["roofline"]["pi0_w"] == pytest.approx(PI0)
    assert "error" in out["fits"]["paper"]
    assert out["validation"]["median_abs_error"] == pytest.approx((1 - 1 / 1.1) / 2)
    spd = next(a for a in out["attribution"] if a["label"] == "spd")
    assert spd["j_per_accepted_draft_token"] > 0 and spd["scale"] == pytest.approx(1.0)
    rows = {w["decoder"]: w for w in out["windows"]}  # every row's own split, scale beside it
    assert rows["ar"]["attribution_scale"] == pytest.approx(1.1)
    assert sum(rows["ar"][c] for c in ("draft_energy_j", "target_energy_j", "other_energy_j")) == \
        pytest.approx(rows["ar"]["decode_energy_j"])
    res = CliRunner().invoke(app, ["decompose", str(roofline_dir)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    text = res.output
    for expected in ("energy roofline E = pi0*T + eps_flop*FLOPs + eps_byte*bytes (6 batch rows)",
                     "paper form E = P_static*T + PW_flop*T_flop + PW_mem*T_mem: not fitted",
                     "held-out decode windows", "median |prediction error| 4.5% over 2 decode",
                     "decode J/token by phase", "decode J/token by term"):
        assert expected in text, expected
    assert max(len(line) for line in text.splitlines()) <= 80


def test_no_batch_rows_is_a_clear_error(tmp_path):
    ResultStore(tmp_path / "empty")
    with pytest.raises(ValueError, match="no batch-sweep rows in .*`mtad-energy sweep batch-size "
                                         "--output DIR` without --decoder"):
        fit_stores([tmp_path / "empty"])
    res = CliRunner().invoke(app, ["decompose", str(tmp_path / "empty"), "--json"])
    assert res.exit_code == 2 and "no batch-sweep rows" in json.loads(res.stdout)["error"]


def test_a_window_counts_the_tokens_its_decode_window_holds():
    """An engine's first token streams out of the prefill window: a `runs` window's (and a
    decoding sweep's) tokens are its ``decode_tokens``; rows stored before the column count all."""
    import pandas as pd

    from mtad_energy.results.breakdown import windows_from

    runs = pd.DataFrame({"run_key": ["a", "b"], "decoder": "ar", "params_json": "{}",
                         "tokens_emitted": [11, 11], "decode_tokens": [10, None],
                         "decode_energy_j": [1.0, 1.0], "decode_time_s": [1.0, 1.0]})
    batch = pd.DataFrame({"row_key": ["c"], "decoder": "ar", "label": "ar", "tokens": [22],
                          "decode_tokens": [20], "energy_j": [2.0], "decode_time_s": [1.0]})
    w = windows_from(runs, batch)
    assert w["tokens"].tolist() == [10.0, 11.0, 20.0]
