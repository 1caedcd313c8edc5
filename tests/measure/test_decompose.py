"""The energy-model fit on synthetic rows generated from known powers."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from mtad_energy.measure.decompose import EnergyFit, breakdown, fit_energy_model

P_STATIC_W, PW_FLOP_W, PW_MEM_W = 60.0, 120.0, 200.0


def rows(n: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(E, T, T_flop, T_mem) [n] with compute/memory fractions that vary across rows."""
    rng = np.random.default_rng(seed)
    time_s = rng.uniform(1.0, 10.0, n)
    flop_frac = rng.uniform(0.05, 0.6, n)
    mem_frac = rng.uniform(0.2, 0.9, n) * (1.0 - flop_frac)
    t_flop_s, t_mem_s = flop_frac * time_s, mem_frac * time_s
    energy_j = P_STATIC_W * time_s + PW_FLOP_W * t_flop_s + PW_MEM_W * t_mem_s
    return energy_j, time_s, t_flop_s, t_mem_s


def test_exact_rows_recover_the_powers() -> None:
    fit = fit_energy_model(*rows())
    assert fit.p_static_w == pytest.approx(P_STATIC_W, rel=1e-6)
    assert fit.pw_flop_w == pytest.approx(PW_FLOP_W, rel=1e-6)
    assert fit.pw_mem_w == pytest.approx(PW_MEM_W, rel=1e-6)
    assert fit.n_rows == 8
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.rmse_j < 1e-9 and fit.max_abs_rel_error < 1e-12
    assert fit.condition_number < 100
    assert fit.warnings == ()
    assert len(fit.residuals_j) == 8


def test_units_do_not_change_the_condition_number() -> None:
    e, t, tf, tm = rows()
    # the same data in milliseconds: the powers scale, the conditioning must not
    fit_s, fit_ms = fit_energy_model(e, t, tf, tm), fit_energy_model(e, t * 1e3, tf * 1e3, tm * 1e3)
    assert fit_ms.condition_number == pytest.approx(fit_s.condition_number, rel=1e-9)
    assert fit_ms.pw_mem_w == pytest.approx(PW_MEM_W / 1e3, rel=1e-6)


def test_noisy_rows_recover_the_powers_within_a_few_percent() -> None:
    e, t, tf, tm = rows(n=40, seed=1)
    noisy = e * (1.0 + 0.02 * np.random.default_rng(2).standard_normal(e.size))
    fit = fit_energy_model(noisy, t, tf, tm)
    assert fit.p_static_w == pytest.approx(P_STATIC_W, rel=0.05)
    assert fit.pw_flop_w == pytest.approx(PW_FLOP_W, rel=0.05)
    assert fit.pw_mem_w == pytest.approx(PW_MEM_W, rel=0.05)
    assert fit.r2 > 0.99
    assert 0.005 < fit.max_abs_rel_error < 0.1
    assert np.allclose(fit.residuals_j, noisy - fit.predict_j(t, tf, tm))


def test_a_negative_unconstrained_coefficient_is_pinned_at_zero_with_a_warning() -> None:
    _, t, tf, tm = rows()
    energy = -20.0 * t + PW_FLOP_W * tf + PW_MEM_W * tm  # unconstrained LS gives P_static = -20
    unconstrained = np.linalg.lstsq(np.column_stack([t, tf, tm]), energy, rcond=None)[0]
    assert unconstrained[0] == pytest.approx(-20.0)
    fit = fit_energy_model(energy, t, tf, tm)
    assert fit.p_static_w == 0.0
    assert fit.pw_flop_w >= 0 and fit.pw_mem_w >= 0
    assert fit.warnings == (
        "P_static (T) is pinned at 0 W by the non-negativity constraint (unconstrained least squares "
        "gives -20 W): the data do not support this term",
    )


def test_collinear_columns_get_the_identifiability_warning() -> None:
    t = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    tf, tm = 0.3 * t, 0.6 * t  # same fractions in every row
    energy = P_STATIC_W * t + PW_FLOP_W * tf + PW_MEM_W * tm
    fit = fit_energy_model(energy, t, tf, tm)
    assert fit.condition_number > 1e3
    collinear = [w for w in fit.warnings if w.startswith("columns T, T_flop, T_mem are nearly collinear")]
    assert len(collinear) == 1
    assert "not identifiable" in collinear[0] and "add batch sizes" in collinear[0]
    # the total is still fitted: only the split is unknown
    assert fit.r2 == pytest.approx(1.0)


def test_missing_energy_names_the_rows_and_the_fix() -> None:
    e, t, tf, tm = rows(n=5)
    e = list(e)
    e[1], e[3] = None, math.nan
    msg = ("2 of 5 rows lack energy (energy_j is missing or NaN); the batch sweep must run with a meter "
           "that measures energy (GPU: nvml or zeus; CPU: rapl), not 'none'")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        fit_energy_model(e, t, tf, tm)


def test_fewer_than_three_rows_is_an_error() -> None:
    msg = ("fitting 3 coefficients (P_static, PW_flop, PW_mem) needs at least 3 rows, got 2; run the "
           "batch sweep with more batch sizes (e.g. 1,2,4,8,16)")
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        fit_energy_model([1.0, 2.0], [1.0, 1.0], [0.1, 0.2], [0.5, 0.6])


def test_unequal_lengths_and_bad_times_are_errors() -> None:
    with pytest.raises(ValueError, match="one value per row"):
        fit_energy_model([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [0.1, 0.2], [0.5, 0.6, 0.7])
    with pytest.raises(ValueError, match="t_mem_s must be finite and >= 0"):
        fit_energy_model([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [0.1, 0.2, 0.3], [0.5, -0.6, 0.7])


def test_profiled_times_longer_than_the_wall_time_are_flagged() -> None:
    e, t, tf, tm = rows()
    tm = tm.copy()
    tm[0] = t[0]  # T_flop + T_mem > T
    fit = fit_energy_model(e, t, tf, tm)
    assert any(w.startswith("T_flop + T_mem exceed the wall time T in 1 of 8 rows") for w in fit.warnings)


def test_breakdown_sums_to_the_prediction() -> None:
    fit = fit_energy_model(*rows())
    b = breakdown(fit, 3.0, 0.5, 2.0)
    assert b.static_j == pytest.approx(P_STATIC_W * 3.0)
    assert b.flop_j == pytest.approx(PW_FLOP_W * 0.5)
    assert b.mem_j == pytest.approx(PW_MEM_W * 2.0)
    assert b.static_j + b.flop_j + b.mem_j == pytest.approx(b.predicted_j, rel=1e-15)
    assert b.predicted_j == pytest.approx(fit.predict_j(3.0, 0.5, 2.0))
    assert set(b.to_dict()) == {"static_j", "flop_j", "mem_j", "predicted_j"}


def test_to_dict_is_json_ready_and_the_fit_is_frozen() -> None:
    fit = fit_energy_model(*rows())
    d = json.loads(json.dumps(fit.to_dict()))
    assert d["p_static_w"] == pytest.approx(P_STATIC_W) and isinstance(d["residuals_j"], list)
    assert d["warnings"] == []
    with pytest.raises(AttributeError):
        fit.p_static_w = 1.0  # type: ignore[misc]
    assert isinstance(fit, EnergyFit)


def test_pandas_series_inputs() -> None:
    pd = pytest.importorskip("pandas")
    e, t, tf, tm = rows()
    df = pd.DataFrame({"energy_j": e, "time_s": t, "t_flop_s": tf, "t_mem_s": tm})
    fit = fit_energy_model(df["energy_j"], df["time_s"], df["t_flop_s"], df["t_mem_s"])
    assert fit.pw_mem_w == pytest.approx(PW_MEM_W, rel=1e-6)
