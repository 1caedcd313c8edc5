"""Fit and apply the two energy models, each with what the data can and cannot tell apart.

* **paper**: E = P_static*T + PW_flop*T_flop + PW_mem*T_mem, with T the wall time and T_flop /
  T_mem the time in compute- / memory-bound ops (`profiler.profile_ops`; the rest of T, launch
  overhead and host work, is billed only through P_static). Powers in watts.
* **roofline** (Choi, Bedard, Fowler, Vuduc, "A roofline model of energy", IPDPS 2013):
  E = pi0*T + eps_flop*W + eps_byte*Q, with W the FLOPs and Q the bytes moved (counted,
  `mtad_energy.energy.work`): constant power in watts, joules per FLOP and per byte. Its coefficients
  are properties of the device, so one fit attributes any run's joules on it.

Units: energies in joules, times in seconds. Per row (one point of a batch study): E measured,
and the three columns of the form. Coefficients are fitted by non-negative least squares (a
negative power or cost has no physical meaning) on columns scaled to unit norm, so the reported
condition number describes how well the rows separate the terms, not the choice of units.

Whether a coefficient is **identified** is judged per coefficient, from the rows themselves:
its column must vary apart from the others (a variance-inflation factor below `VIF_MAX`), the fit
must not pin it at 0, and its 95 % interval must lie within ±`REL_CI_MAX` of the estimate. Each
verdict says which measurement would identify a coefficient that is not. Pure numpy/scipy: this
module imports nothing else from the project.

The intervals (`_intervals`) are heteroscedasticity-consistent t-intervals: the HC3 sandwich
standard error (MacKinnon and White 1985; recommended below ~250 rows by Long and Ervin 2000)
with Student-t quantiles on n - k degrees of freedom, over the coefficients the non-negativity
constraint leaves free. Meter noise is relative (a window's error grows with its joules), so
the rows' variances differ; and with ~30 rows a percentile bootstrap of resampled rows covered
the truth in only 0.89-0.93 of synthetic fits at 1.5 % noise (0.916 on the tested design; a wild
bootstrap 0.90-0.92), where these cover 0.94 (measured, `tests/measure/test_decompose.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

COND_WARN = 1e3
"""Condition numbers of the column-scaled design matrix above this make the split unreliable."""
VIF_MAX = 100.0
"""A column whose variance-inflation factor exceeds this is (nearly) a combination of the others."""
REL_CI_MAX = 0.25
"""An identified coefficient's 95 % interval lies within ±25 % of its estimate."""

ArrayLike = Sequence[float | None] | np.ndarray


@dataclass(frozen=True)
class Term:
    """One coefficient of a form: its name, symbol, unit, the column it multiplies, and what
    measurement identifies it."""

    name: str
    symbol: str
    unit: str
    column: str
    identify_by: str


FORMS: dict[str, tuple[Term, ...]] = {
    "paper": (
        Term("p_static_w", "P_static", "W", "T",
             "rows whose wall time varies apart from the time in ops (launch-bound small batches "
             "beside long prefill chunks, or an idle window)"),
        Term("pw_flop_w", "PW_flop", "W", "T_flop",
             "compute-bound rows: batch sizes into the compute-bound regime (256-512 at short "
             "context on a GPU) or prefill chunks of 128-4096 tokens"),
        Term("pw_mem_w", "PW_mem", "W", "T_mem",
             "memory-bound rows whose memory time varies apart from the wall time: a context-"
             "length axis (128-8192 cached tokens at a fixed batch size)"),
    ),
    "roofline": (
        Term("pi0_w", "pi0", "W", "T",
             "rows whose time varies at fixed work (launch-bound small batches beside compute-"
             "bound ones, or an idle window)"),
        Term("eps_flop_j", "eps_flop", "J/FLOP", "FLOPs",
             "rows whose FLOPs vary with the bytes nearly fixed: batch sizes 1-512 at short "
             "context, or prefill chunks of 128-4096 tokens"),
        Term("eps_byte_j", "eps_byte", "J/byte", "bytes",
             "rows whose bytes vary with the FLOPs nearly fixed: a context-length axis "
             "(128-8192 cached tokens at a fixed batch size)"),
    ),
}


@dataclass(frozen=True)
class Coefficient:
    """A fitted coefficient with its 95 % interval (`_intervals`) and a plain verdict."""

    name: str
    symbol: str
    unit: str
    value: float
    ci_low: float
    ci_high: float
    identified: bool
    verdict: str


@dataclass(frozen=True)
class EnergyFit:
    """One form's fit over ``n_rows`` rows.

    Attributes:
        form: ``"paper"`` or ``"roofline"`` (`FORMS`).
        coefficients: one per term of the form, in its order.
        r2: coefficient of determination of the energies (NaN if all energies are equal).
        rmse_j: root-mean-square residual (joules).
        max_abs_rel_error: max over rows of |residual| / |E|.
        residuals_j: measured minus predicted energy per row (joules), in row order.
        condition_number: 2-norm condition number of the column-scaled design matrix (inf if a
            column is all zero).
        warnings: human-readable doubts about the fit (empty when every coefficient is
            identified and the rows are sound).
    """

    form: str
    coefficients: tuple[Coefficient, ...]
    n_rows: int
    r2: float
    rmse_j: float
    max_abs_rel_error: float
    residuals_j: tuple[float, ...]
    condition_number: float
    warnings: tuple[str, ...] = ()

    @property
    def values(self) -> dict[str, float]:
        """Coefficient name -> value."""
        return {c.name: c.value for c in self.coefficients}

    def value(self, name: str) -> float:
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"the {self.form} form has no coefficient {name!r}; it has "
                           f"{', '.join(self.values)}") from None

    @property
    def identified(self) -> bool:
        return all(c.identified for c in self.coefficients)

    def terms_j(self, *columns: float | ArrayLike) -> tuple[float | np.ndarray, ...]:
        """Each term's joules (coefficient x column), for scalar or array columns in the form's
        order (paper: T, T_flop, T_mem; roofline: T, FLOPs, bytes)."""
        if len(columns) != len(self.coefficients):
            raise ValueError(f"the {self.form} form takes {len(self.coefficients)} columns, got "
                             f"{len(columns)}")
        out = []
        for c, col in zip(self.coefficients, columns, strict=True):
            term = c.value * np.asarray(col, dtype=float)
            out.append(float(term) if np.ndim(term) == 0 else term)
        return tuple(out)

    def predict_j(self, *columns: float | ArrayLike) -> float | np.ndarray:
        """Predicted energy (joules): a float for scalar columns, else an array."""
        return sum(self.terms_j(*columns))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EnergyFit:
        """The fit `to_dict` wrote (e.g. read back from JSON)."""
        fields = {f: data[f] for f in ("form", "n_rows", "r2", "rmse_j", "max_abs_rel_error",
                                        "condition_number")}
        return cls(**fields, coefficients=tuple(Coefficient(**c) for c in data["coefficients"]),
                   residuals_j=tuple(data["residuals_j"]), warnings=tuple(data["warnings"]))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["coefficients"] = [asdict(c) for c in self.coefficients]
        out["residuals_j"] = list(self.residuals_j)
        out["warnings"] = list(self.warnings)
        out.update(self.values)
        return out


def _column(values: ArrayLike, name: str) -> np.ndarray:
    """A 1-D float array; None becomes NaN (so missing energies can be counted, not crash)."""
    obj = np.asarray(values, dtype=object)
    if obj.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one value per row), got shape {obj.shape}")
    return np.asarray([np.nan if v is None else v for v in obj], dtype=float)


def _nnls_scaled(a: np.ndarray, e: np.ndarray) -> np.ndarray:
    """NNLS on unit-norm columns (an all-zero column stays 0), in the original units."""
    from scipy.optimize import nnls  # scipy is slow to import; only fitting needs it

    norms = np.linalg.norm(a, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    return nnls(a / scale, e)[0] / scale


def _vif(a_scaled: np.ndarray, i: int) -> float:
    """Variance-inflation factor of column i: 1 / (1 - R^2) of regressing it on the others
    (uncentred, as the model has no intercept); inf when the others reproduce it exactly."""
    others = np.delete(a_scaled, i, axis=1)
    y = a_scaled[:, i]
    fitted = others @ np.linalg.lstsq(others, y, rcond=None)[0]
    ss = float(y @ y)
    r2 = 1.0 - float((y - fitted) @ (y - fitted)) / ss if ss > 0 else 1.0
    return math.inf if r2 >= 1.0 - 1e-12 else 1.0 / (1.0 - r2)


def _verdict(term: Term, value: float, lo: float, hi: float, norm: float, vif: float,
             unconstrained: float, others: Sequence[str]) -> tuple[bool, str]:
    fix = f"measure {term.identify_by}"
    if norm == 0:
        return False, f"not identified: {term.column} is 0 in every row; {fix}"
    if vif > VIF_MAX:
        return False, (f"not identified: {term.column} is (nearly) a combination of "
                       f"{' and '.join(others)} across the rows (variance inflation "
                       f"{vif:.3g} > {VIF_MAX:g}); {fix}")
    if value == 0.0:
        return False, (f"not identified: pinned at 0 by the non-negativity constraint "
                       f"(unconstrained least squares gives {unconstrained:.4g} {term.unit}); {fix}")
    half = max(value - lo, hi - value) / value
    if half > REL_CI_MAX:
        return False, (f"not identified: its 95 % interval [{lo:.4g}, {hi:.4g}] {term.unit} "
                       f"reaches ±{half:.0%} of the estimate; {fix}")
    return True, f"identified: 95 % interval within ±{half:.1%}"


def _intervals(a_scaled: np.ndarray, e: np.ndarray, coef_scaled: np.ndarray,
               level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """``level`` intervals (scaled units) of the NNLS coefficients: for the free ones (> 0),
    coef ± t(n - k_free) * HC3 standard error of the least-squares fit on the free columns (the
    one NNLS solved), the lower end clipped at 0; a coefficient pinned at 0 gets [0, the upper
    end of the unconstrained fit's interval]. Infinite where the rows leave no degree of freedom
    or a row alone decides a coefficient (leverage 1: its noise cannot be estimated)."""
    from scipy.stats import t as student_t

    n, k = a_scaled.shape
    lo, hi = np.zeros(k), np.full(k, np.inf)

    def sandwich(cols: np.ndarray, fitted: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, float]:
        x = a_scaled[:, cols]
        pinv = np.linalg.pinv(x)  # [k_cols, n]
        coef = fitted if fitted is not None else pinv @ e
        lev = np.einsum("nk,kn->n", x, pinv)  # leverages h_ii
        resid = e - x @ coef
        with np.errstate(divide="ignore", invalid="ignore"):
            inflated = np.where(lev < 1 - 1e-9, resid / (1 - lev), np.inf)
        se = np.sqrt((pinv ** 2) @ inflated ** 2)
        dof = n - x.shape[1]
        q = float(student_t.ppf(0.5 + level / 2, dof)) if dof > 0 else math.inf
        return coef, np.where(np.isfinite(se), se, np.inf), q

    free = coef_scaled > 0
    if free.any():
        c, se, q = sandwich(np.flatnonzero(free), coef_scaled[free])
        lo[free], hi[free] = np.maximum(c - q * se, 0.0), c + q * se
    if (~free).any():
        c, se, q = sandwich(np.arange(k), None)
        hi[~free] = np.maximum(c + q * se, 0.0)[~free]
    return lo, hi


def fit_form(form: str, energy_j: ArrayLike, *columns: ArrayLike) -> EnergyFit:
    """Fit one form (`FORMS`) by non-negative least squares, with 95 % intervals
    (`_intervals`).

    Raises:
        ValueError: unknown form, lengths differ, fewer rows than coefficients, a row lacks
            energy, or a column value is missing, negative or not finite.
    """
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}; forms: {', '.join(FORMS)}")
    terms = FORMS[form]
    if len(columns) != len(terms):
        raise ValueError(f"the {form} form takes {len(terms)} columns "
                         f"({', '.join(t.column for t in terms)}), got {len(columns)}")
    e = _column(energy_j, "energy_j")
    cols = [_column(c, t.column) for c, t in zip(columns, terms, strict=True)]
    lengths = {"energy_j": e.size, **{t.column: c.size for t, c in zip(terms, cols, strict=True)}}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{', '.join(lengths)} must have one value per row; got "
                         + ", ".join(f"{k}={v}" for k, v in lengths.items()))
    n, k = e.size, len(terms)
    if n < k:
        raise ValueError(f"fitting {k} coefficients ({', '.join(t.symbol for t in terms)}) needs at "
                         f"least {k} rows, got {n}; run the batch sweep with more points (e.g. "
                         "--sizes 1,2,4,8,16)")
    missing = int(np.count_nonzero(~np.isfinite(e)))
    if missing:
        raise ValueError(f"{missing} of {n} rows lack energy (energy_j is missing or NaN); the batch "
                         "sweep must run with a meter that measures energy (GPU: nvml or zeus; CPU: "
                         "rapl, or simulated), not 'none'")
    for t, col in zip(terms, cols, strict=True):
        if not np.all(np.isfinite(col)) or np.any(col < 0):
            raise ValueError(f"{t.column} must be finite and >= 0 in every row; got {col.tolist()}")

    a = np.column_stack(cols)
    norms = np.linalg.norm(a, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    coef = _nnls_scaled(a, e)
    cond = float(np.linalg.cond(a / scale)) if np.all(norms > 0) else math.inf
    lo, hi = (bound / scale for bound in _intervals(a / scale, e, coef * scale))
    unconstrained = np.linalg.lstsq(a / scale, e, rcond=None)[0] / scale

    coefficients = []
    for i, t in enumerate(terms):
        vif = _vif(a / scale, i) if norms[i] > 0 else math.inf
        others = [o.column for j, o in enumerate(terms) if j != i]
        ok, verdict = _verdict(t, float(coef[i]), float(lo[i]), float(hi[i]), float(norms[i]), vif,
                               float(unconstrained[i]), others)
        coefficients.append(Coefficient(t.name, t.symbol, t.unit, float(coef[i]), float(lo[i]),
                                        float(hi[i]), ok, verdict))

    pred = a @ coef
    resid = e - pred
    ss_res = float(resid @ resid)
    ss_tot = float(np.sum((e - e.mean()) ** 2))
    with np.errstate(divide="ignore", invalid="ignore"):
        # a zero-energy row with a nonzero residual has infinite relative error
        rel = np.where(resid == 0, 0.0, np.abs(resid) / np.abs(e))
    notes = [f"{c.symbol} ({c.unit}) {c.verdict}" for c in coefficients if not c.identified]
    if not math.isfinite(cond) or cond > COND_WARN:
        notes.append(f"the columns {', '.join(t.column for t in terms)} are nearly collinear "
                     f"(condition number {cond:.3g} > {COND_WARN:g}): the split between the terms "
                     "rests on small differences between the rows")
    if form == "paper":
        over = int(np.count_nonzero(cols[1] + cols[2] > cols[0] * (1 + 1e-6) + 1e-12))
        if over:
            notes.append(f"T_flop + T_mem exceed the wall time T in {over} of {n} rows; scale the "
                         "profiled times to the measured window before fitting")
    return EnergyFit(
        form=form, coefficients=tuple(coefficients), n_rows=n,
        r2=1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan, rmse_j=math.sqrt(ss_res / n),
        max_abs_rel_error=float(np.max(rel)), residuals_j=tuple(float(r) for r in resid),
        condition_number=cond, warnings=tuple(notes))


def fit_energy_model(energy_j: ArrayLike, time_s: ArrayLike, t_flop_s: ArrayLike, t_mem_s: ArrayLike,
                     **options: Any) -> EnergyFit:
    """The paper's form: E = P_static*T + PW_flop*T_flop + PW_mem*T_mem (see `fit_form`)."""
    return fit_form("paper", energy_j, time_s, t_flop_s, t_mem_s, **options)


def fit_roofline(energy_j: ArrayLike, time_s: ArrayLike, flops: ArrayLike, nbytes: ArrayLike,
                 **options: Any) -> EnergyFit:
    """The energy roofline: E = pi0*T + eps_flop*FLOPs + eps_byte*bytes (see `fit_form`)."""
    return fit_form("roofline", energy_j, time_s, flops, nbytes, **options)
