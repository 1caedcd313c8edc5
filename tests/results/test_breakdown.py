"""decompose over stored results: the fit on batch rows and the per-decoder split, end to end
through the store and the CLI (synthetic rows with known powers)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from mtad_energy.cli import app
from mtad_energy.results import ResultStore, stable_key
from mtad_energy.results.breakdown import decoder_breakdown, fit_from_stores
from mtad_energy.results.schema import BATCH, OPS, RUNS

P_STATIC, PW_FLOP, PW_MEM = 60.0, 120.0, 200.0


def energy(t, tf, tm):
    return P_STATIC * t + PW_FLOP * tf + PW_MEM * tm


@pytest.fixture()
def store_dir(tmp_path):
    store = ResultStore(tmp_path / "s")
    for b, (t, ff, fm) in {1: (1.0, 0.05, 0.80), 2: (1.1, 0.15, 0.70), 4: (1.2, 0.30, 0.55),
                           8: (1.3, 0.50, 0.35), 16: (1.6, 0.70, 0.20)}.items():
        key = stable_key({"b": b})
        store.write("batch", key, [{c: None for c in BATCH.required} | {
            "row_key": key, "batch_size": b, "time_s": t, "t_flop_s": ff * t, "t_mem_s": fm * t,
            "energy_j": energy(t, ff * t, fm * t)}])
    for dec, (t_tok, ff, fm) in {"ar": (0.05, 0.1, 0.8), "mtad": (0.03, 0.3, 0.6)}.items():
        for i in range(2):
            key = stable_key({"dec": dec, "i": i})
            tokens = 10
            t = t_tok * tokens
            store.write("runs", key, [{c: None for c in RUNS.required} | {
                "run_key": key, "model": "toy", "decoder": dec, "params_json": "{}", "label": dec,
                "tokens_emitted": tokens, "prefill_time_s": 0.0, "decode_time_s": t,
                "energy_j": energy(t, ff * t, fm * t)}])
        key = stable_key({"ops": dec})
        store.write("ops", key, [{c: None for c in OPS.required} | {
            "ops_key": key, "model": "toy", "decoder": dec, "params_json": "{}",
            "wall_time_s": 2.0, "t_flop_s": 2.0 * ff, "t_mem_s": 2.0 * fm}])
    return tmp_path / "s"


def test_the_fit_recovers_the_powers_and_the_split_matches_the_measurement(store_dir):
    fit, n = fit_from_stores([store_dir])
    assert n == 5
    assert (fit.p_static_w, fit.pw_flop_w, fit.pw_mem_w) == pytest.approx((P_STATIC, PW_FLOP, PW_MEM))
    table = decoder_breakdown([store_dir], fit).set_index("decoder")
    assert list(table.index) == ["ar", "mtad"]
    parts = table[["static_j_per_token", "flop_j_per_token", "mem_j_per_token"]].sum(axis=1)
    assert np.allclose(parts, table["predicted_j_per_token"])
    assert np.allclose(table["predicted_j_per_token"], table["measured_j_per_token"])
    assert table.loc["ar", "mem_j_per_token"] == pytest.approx(PW_MEM * 0.8 * 0.05)


def test_cli_decompose_prints_the_fit_and_the_decoders(store_dir):
    res = CliRunner().invoke(app, ["decompose", str(store_dir), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["fit"]["p_static_w"] == pytest.approx(P_STATIC)
    assert {d["decoder"] for d in out["decoders"]} == {"ar", "mtad"}
    res = CliRunner().invoke(app, ["decompose", str(store_dir)])
    assert res.exit_code == 0 and "P_static = 60.0 W" in res.output


def test_no_batch_rows_is_a_clear_error(tmp_path):
    ResultStore(tmp_path / "empty")
    with pytest.raises(ValueError, match="no batch-sweep rows in .*run `mtad-energy sweep batch-size"):
        fit_from_stores([tmp_path / "empty"])
