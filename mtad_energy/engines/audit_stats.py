"""Pooled tests of tokens each drawn from its own distribution (the engine audit's output
tests, `audit_output`): token n from row n of ``[N, V]`` given the past, so a statistic summed
over the tokens is a martingale's sum and holds across positions and requests. A rank
chi-square (omnibus), a score of the tokens' probability, and any predictable weighted sum by
the saddlepoint; each returned as `audit.LosslessResult`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from scipy.stats import chi2, norm

from mtad_energy.engines.audit import LosslessResult


def rank_chi_square(refs: torch.Tensor, tokens: Sequence[int], max_cells: int = 12,
                    min_expected: float = 5.0) -> LosslessResult:
    """Pooled goodness of fit of tokens drawn each from its own distribution: ``refs [N, V]``,
    token n from row n (given the past: a martingale, so the test holds across positions).
    Cells are ranks under each row (most likely first): rank 1, 2, ... and the rest, as many
    as keep every cell's expected count >= ``min_expected`` (at most ``max_cells``). The
    statistic is (O - E)' C^-1 (O - E) over all cells but the last, C = sum_n diag(c_n) - c_n c_n'
    the exact covariance: chi-square with as many degrees of freedom as C's rank (cells - 1).
    With identical rows it is Pearson's statistic. A token a row cannot give: infinite."""
    n = len(tokens)
    if n == 0:
        return LosslessResult(0, 0, 0.0, 0)
    refs = refs.double()
    tok = torch.as_tensor(list(tokens), dtype=torch.long)
    if bool((refs.gather(1, tok[:, None])[:, 0] <= 0).any()):
        return LosslessResult(1, n, math.inf, 1)
    srt, order = refs.sort(dim=-1, descending=True, stable=True)  # [N, V]
    rank = (order == tok[:, None]).long().argmax(-1)  # [N]
    col, cum = srt.sum(0), srt.sum(0).cumsum(0)  # expected count per rank, and up to it
    cells = 0
    while (cells < min(max_cells - 1, refs.shape[1] - 1) and col[cells] >= min_expected
           and n - cum[cells] >= min_expected):
        cells += 1
    if cells == 0:
        return LosslessResult(1, n, 0.0, 0)
    c = srt[:, :cells]  # [N, cells]: each row's probability of the first cells
    obs = torch.nn.functional.one_hot(rank.clamp(max=cells), cells + 1)[:, :cells].sum(0).double()
    d = (obs - c.sum(0)).numpy()
    cov = (torch.diag(c.sum(0)) - c.T @ c).numpy()
    dof = int(np.linalg.matrix_rank(cov))
    stat = float(d @ np.linalg.pinv(cov) @ d) if dof else 0.0
    return LosslessResult(1, n, stat, dof)


def score_test(refs: torch.Tensor, tokens: Sequence[int]) -> LosslessResult:
    """Are the tokens as likely as their distributions say? S = sum_n r_n(x_n), the summed
    probability of the emitted tokens, against its distribution for x_n ~ r_n (independent given
    the past: a martingale), two-sided, its tails by the saddlepoint (`saddlepoint_tails`: the
    normal's lower tail is several times too light for tens of tokens). Returned as the
    chi-square on one degree of freedom with that p-value. A sampler drawing from a wrong
    distribution emits tokens less likely than they should be: this catches it with far fewer
    tokens than the omnibus `rank_chi_square`. A token a row cannot give: infinite."""
    n = len(tokens)
    if n == 0:
        return LosslessResult(0, 0, 0.0, 0)
    refs = refs.double()
    r_x = refs.gather(1, torch.as_tensor(list(tokens), dtype=torch.long)[:, None])[:, 0]
    if bool((r_x <= 0).any()):
        return LosslessResult(1, n, math.inf, 1)
    mean = (refs ** 2).sum(-1)
    if float(((refs ** 3).sum(-1) - mean ** 2).clamp_min(0.0).sum()) <= 1e-12:
        return LosslessResult(1, n, 0.0, 0)  # every row a point mass: nothing to test
    lower, upper = saddlepoint_tails(refs.numpy(), float(r_x.sum()))
    p = min(1.0, 2.0 * min(lower, upper))
    return LosslessResult(1, n, math.inf if p <= 0.0 else float(chi2.isf(p, 1)), 1)


def _saddlepoint(moments, s: float, side: float) -> tuple[float, float, float]:
    """theta with K'(theta) = s (K' increasing; the root on the ``side`` of 0), and K, K'' there:
    Newton's steps (each one `moments` call over ``[N, V]``: a handful where bisection took
    dozens), kept inside the bracket the signs give (halved, or doubled outwards while it is
    open)."""
    lo, hi = (-math.inf, 0.0) if side < 0 else (0.0, math.inf)
    theta = 0.0
    for _ in range(200):
        k, k1, k2 = moments(theta)
        f = k1 - s
        lo, hi = (lo, theta) if f > 0 else (theta, hi)
        step = theta - f / k2 if k2 > 0 else math.nan
        if not lo < step < hi:  # outside the bracket: halve it, or widen while it is open
            step = ((lo + hi) / 2 if math.isfinite(lo) and math.isfinite(hi) else
                    2 * theta if theta else side)
        if abs(step - theta) <= 1e-12 * (1.0 + abs(theta)) or abs(f) <= 1e-13 * (1.0 + abs(s)):
            return (theta, k, k2) if abs(f) <= 1e-13 * (1.0 + abs(s)) else \
                (step, *moments(step)[::2])
        theta = step
    k, _, k2 = moments(theta)
    return theta, k, k2


def saddlepoint_tails(probs: np.ndarray, s: float, values: np.ndarray | None = None
                      ) -> tuple[float, float]:
    """P(S <= s) and P(S >= s) for S = sum_n v_n, v_n taking the value values[n, x] (default
    probs[n, x]) with probability probs[n, x] (``[N, V]``): Lugannani-Rice, the cumulant
    generating function K(theta) = sum_n log sum_x probs e^(theta values) solved for
    K'(theta) = s; within a standard deviation of the mean, the normal; at an end of the
    support, exact."""
    v = probs if values is None else values
    live = probs > 0

    def moments(theta: float) -> tuple[float, float, float]:  # K, K', K''
        e = np.where(live, theta * v, -np.inf)
        top = e.max(1, keepdims=True)
        w = probs * np.exp(e - top)
        z = w.sum(1, keepdims=True)
        w = w / z
        m1 = (w * v).sum(1)
        return (float((np.log(z[:, 0]) + top[:, 0]).sum()), float(m1.sum()),
                float(((w * v * v).sum(1) - m1 ** 2).sum()))

    _, mean, var = moments(0.0)
    lo_end = np.where(live, v, np.inf).min(1, keepdims=True)
    hi_end = np.where(live, v, -np.inf).max(1, keepdims=True)
    lo_s, hi_s = float(lo_end.sum()), float(hi_end.sum())
    if s <= lo_s + 1e-12 or s >= hi_s - 1e-12:  # at an end of the support: every v_n at its end
        end = lo_end if s <= lo_s + 1e-12 else hi_end
        at_end = float(np.prod(np.where(live & np.isclose(v, end), probs, 0.0).sum(1)))
        return (at_end, 1.0) if s <= lo_s + 1e-12 else (1.0, at_end)
    if abs(s - mean) < math.sqrt(var):  # within a standard deviation: the normal (Lugannani-Rice
        lower = float(norm.cdf((s - mean) / math.sqrt(var)))  # cancels near the mean)
        return lower, 1.0 - lower
    theta, k, k2 = _saddlepoint(moments, s, -1.0 if s < mean else 1.0)
    w = math.copysign(math.sqrt(max(0.0, 2.0 * (theta * s - k))), theta)
    u = theta * math.sqrt(k2)
    lower = float(norm.cdf(w) + norm.pdf(w) * (1.0 / w - 1.0 / u))
    lower = min(max(lower, 0.0), 1.0)
    return lower, 1.0 - lower


def weighted_test(p: torch.Tensor, values: torch.Tensor, x: torch.Tensor,
                  upper_only: bool = False) -> LosslessResult:
    """S = sum_n values[n, x_n], x_n ~ p[n] given the past (``p, values [N, V]``, the values
    predictable: a martingale's sum), against its distribution by the saddlepoint
    (`saddlepoint_tails`); two-sided, or its upper tail (``upper_only``: a likelihood ratio).
    Returned as the chi-square on one degree of freedom with that p-value; no rows, or every
    value alike: not made (dof 0)."""
    live = p > 0
    vals = torch.where(live, values, 0.0)
    spread = torch.where(live, vals, -math.inf).amax(-1) - torch.where(live, vals, math.inf).amin(-1)
    if p.shape[0] == 0 or float(spread.max()) <= 1e-12:
        return LosslessResult(0, int(p.shape[0]), 0.0, 0)
    s = float(vals.gather(1, x[:, None])[:, 0].sum())
    lower, upper = saddlepoint_tails(p.numpy(), s, vals.numpy())
    pv = min(1.0, upper if upper_only else 2.0 * min(lower, upper))
    return LosslessResult(1, p.shape[0], math.inf if pv <= 0.0 else float(chi2.isf(pv, 1)), 1)


def floor_pvalue(p: torch.Tensor, values: torch.Tensor, upper_only: bool = False) -> float:
    """The smallest p-value `weighted_test` can give on these rows (``[N, V]``): every token at
    an end of its values (the probability of that outcome; two-sided: twice the likelier end).
    Above the level a test cannot fire whatever the engine emitted: it did not test."""
    live = p > 0
    vals = torch.where(live, values, 0.0)
    top = torch.where(live, vals, -math.inf).amax(-1, keepdim=True)
    low = torch.where(live, vals, math.inf).amin(-1, keepdim=True)
    at_top = float(torch.where(live & (vals >= top - 1e-12), p, 0.0).sum(-1).prod())
    at_low = float(torch.where(live & (vals <= low + 1e-12), p, 0.0).sum(-1).prod())
    return at_top if upper_only else min(1.0, 2.0 * min(at_top, at_low))
