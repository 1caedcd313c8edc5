"""Fit and apply the energy model E = P_static*T + PW_flop*T_flop + PW_mem*T_mem.

Units: energies in joules, times in seconds, powers in watts. Per row (one configuration, e.g.
one batch size of the batch-size sweep): E the measured energy, T the wall time, T_flop the time
spent in compute-bound ops and T_mem the time in memory-bound ops (see `profiler.profile_ops`;
the rest of T, launch overhead and host work, is billed only through P_static).

The coefficients are fitted by non-negative least squares over the rows (a negative power has no
physical meaning). The columns are scaled to unit norm before solving, so the reported condition
number describes how well the data separate the three terms, not the choice of units. Pure
numpy/scipy: this module imports nothing else from the project.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

COND_WARN = 1e3
"""Condition numbers of the column-scaled design matrix above this make the split unreliable."""

COEF_NAMES = ("p_static_w", "pw_flop_w", "pw_mem_w")
_TERMS = ("P_static (T)", "PW_flop (T_flop)", "PW_mem (T_mem)")

ArrayLike = Sequence[float | None] | np.ndarray


@dataclass(frozen=True)
class EnergyFit:
    """Fitted powers (watts) and the quality of the fit over `n_rows` rows.

    Attributes:
        p_static_w, pw_flop_w, pw_mem_w: the coefficients (watts, all >= 0).
        n_rows: rows fitted.
        r2: coefficient of determination of the energies (NaN if all energies are equal).
        rmse_j: root-mean-square residual (joules).
        max_abs_rel_error: max over rows of |residual| / |E|.
        residuals_j: measured minus predicted energy per row (joules), in row order.
        condition_number: 2-norm condition number of the design matrix [T, T_flop, T_mem] with
            each column scaled to unit norm (inf if a column is all zero).
        warnings: human-readable doubts about the fit (empty when it is sound).
    """

    p_static_w: float
    pw_flop_w: float
    pw_mem_w: float
    n_rows: int
    r2: float
    rmse_j: float
    max_abs_rel_error: float
    residuals_j: tuple[float, ...]
    condition_number: float
    warnings: tuple[str, ...] = ()

    @property
    def coefficients_w(self) -> tuple[float, float, float]:
        """(P_static, PW_flop, PW_mem) in watts."""
        return (self.p_static_w, self.pw_flop_w, self.pw_mem_w)

    def predict_j(
        self, time_s: float | ArrayLike, t_flop_s: float | ArrayLike, t_mem_s: float | ArrayLike
    ) -> float | np.ndarray:
        """Predicted energy (joules): a float for scalar inputs, else an array of the inputs' shape."""
        t, tf, tm = (np.asarray(x, dtype=float) for x in (time_s, t_flop_s, t_mem_s))
        out = self.p_static_w * t + self.pw_flop_w * tf + self.pw_mem_w * tm
        return float(out) if np.ndim(out) == 0 else out

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["residuals_j"] = list(self.residuals_j)
        out["warnings"] = list(self.warnings)
        return out


@dataclass(frozen=True)
class EnergyBreakdown:
    """One configuration's energy split by the fitted model (joules); the terms sum to predicted_j."""

    static_j: float
    flop_j: float
    mem_j: float
    predicted_j: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _column(values: ArrayLike, name: str) -> np.ndarray:
    """A 1-D float array; None becomes NaN (so missing energies can be counted, not crash)."""
    obj = np.asarray(values, dtype=object)
    if obj.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one value per row), got shape {obj.shape}")
    return np.asarray([np.nan if v is None else v for v in obj], dtype=float)


def fit_energy_model(
    energy_j: ArrayLike, time_s: ArrayLike, t_flop_s: ArrayLike, t_mem_s: ArrayLike
) -> EnergyFit:
    """Fit E = P_static*T + PW_flop*T_flop + PW_mem*T_mem by non-negative least squares.

    Args:
        energy_j: measured energy per row (joules) [n]; None/NaN marks a row without energy.
        time_s: wall time per row (seconds) [n].
        t_flop_s: time in compute-bound ops per row (seconds) [n].
        t_mem_s: time in memory-bound ops per row (seconds) [n].

    Raises:
        ValueError: lengths differ, fewer than 3 rows, a row lacks energy, or a time is missing,
            negative or not finite.
    """
    from scipy.optimize import nnls  # scipy is slow to import; only fitting needs it

    e, t, tf, tm = (_column(v, n) for v, n in ((energy_j, "energy_j"), (time_s, "time_s"),
                                                (t_flop_s, "t_flop_s"), (t_mem_s, "t_mem_s")))
    lengths = {"energy_j": e.size, "time_s": t.size, "t_flop_s": tf.size, "t_mem_s": tm.size}
    if len(set(lengths.values())) != 1:
        raise ValueError("energy_j, time_s, t_flop_s and t_mem_s must have one value per row; got "
                         + ", ".join(f"{k}={v}" for k, v in lengths.items()))
    n = e.size
    if n < 3:
        raise ValueError(f"fitting 3 coefficients (P_static, PW_flop, PW_mem) needs at least 3 rows, "
                         f"got {n}; run the batch sweep with more batch sizes (e.g. 1,2,4,8,16)")
    missing = int(np.count_nonzero(~np.isfinite(e)))
    if missing:
        raise ValueError(f"{missing} of {n} rows lack energy (energy_j is missing or NaN); the batch "
                         "sweep must run with a meter that measures energy (GPU: nvml or zeus; CPU: "
                         "rapl), not 'none'")
    for name, col in (("time_s", t), ("t_flop_s", tf), ("t_mem_s", tm)):
        if not np.all(np.isfinite(col)) or np.any(col < 0):
            raise ValueError(f"{name} must be finite and >= 0 in every row; got {col.tolist()}")

    a = np.column_stack([t, tf, tm])
    norms = np.linalg.norm(a, axis=0)
    # an all-zero column cannot be scaled; leave it as is (its coefficient is then unidentifiable)
    scale = np.where(norms > 0, norms, 1.0)
    a_scaled = a / scale
    x_scaled, _ = nnls(a_scaled, e)
    coef = x_scaled / scale
    cond = float(np.linalg.cond(a_scaled)) if np.all(norms > 0) else math.inf

    pred = a @ coef
    resid = e - pred
    ss_res = float(resid @ resid)
    ss_tot = float(np.sum((e - e.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan
    rmse = math.sqrt(ss_res / n)
    with np.errstate(divide="ignore", invalid="ignore"):
        # a zero-energy row with a nonzero residual has infinite relative error
        rel = np.where(resid == 0, 0.0, np.abs(resid) / np.abs(e))
    max_rel = float(np.max(rel))

    notes: list[str] = []
    if not math.isfinite(cond) or cond > COND_WARN:
        zero_cols = [name for name, nrm in zip(("T", "T_flop", "T_mem"), norms, strict=True) if nrm == 0]
        detail = f" ({', '.join(zero_cols)} is 0 in every row)" if zero_cols else ""
        notes.append(
            f"columns T, T_flop, T_mem are nearly collinear (condition number {cond:.3g} > "
            f"{COND_WARN:g}){detail}: the T_flop/T_mem fractions of the wall time barely vary across "
            "rows, so the split between the terms is not identifiable; add batch sizes (e.g. up to "
            "16 or more) so the compute-bound fraction changes")
    unconstrained = np.linalg.lstsq(a_scaled, e, rcond=None)[0] / scale
    for i, term in enumerate(_TERMS):
        if coef[i] == 0.0 and norms[i] > 0:
            notes.append(
                f"{term} is pinned at 0 W by the non-negativity constraint (unconstrained least "
                f"squares gives {unconstrained[i]:.4g} W): the data do not support this term")
    over = int(np.count_nonzero(tf + tm > t * (1 + 1e-6) + 1e-12))
    if over:
        notes.append(f"T_flop + T_mem exceed the wall time T in {over} of {n} rows; scale the profiled "
                     "times to the measured window before fitting")

    return EnergyFit(
        p_static_w=float(coef[0]),
        pw_flop_w=float(coef[1]),
        pw_mem_w=float(coef[2]),
        n_rows=n,
        r2=r2,
        rmse_j=rmse,
        max_abs_rel_error=max_rel,
        residuals_j=tuple(float(r) for r in resid),
        condition_number=cond,
        warnings=tuple(notes),
    )


def breakdown(fit: EnergyFit, time_s: float, t_flop_s: float, t_mem_s: float) -> EnergyBreakdown:
    """Split one configuration's energy into the model's terms (joules).

    Args:
        time_s: wall time T (seconds); t_flop_s / t_mem_s: compute- / memory-bound time (seconds).
    """
    static = fit.p_static_w * float(time_s)
    flop = fit.pw_flop_w * float(t_flop_s)
    mem = fit.pw_mem_w * float(t_mem_s)
    return EnergyBreakdown(static_j=static, flop_j=flop, mem_j=mem, predicted_j=static + flop + mem)
