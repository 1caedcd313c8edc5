"""The engine's story against its output (issue 57, item 1): the audit's checks that use the
emitted tokens, beside `audit`'s acceptance test on the engine's steps.

An engine tells a story (its per-step (drafted, accepted) counts, its engine-wide counters) and
emits an output. Every output position then has a *role*: the prefill's or an undrafted step's
token (drawn from p~), an accepted draft token (a draft from q~ that passed: distributed as
min(p~, q~) / alpha), the token after a rejection (the residual norm(max(0, p~ - q~))) or the
bonus token after a full chain (p~). Three kinds of check:

* **contradictions** (certain, no statistics): the steps do not tile the output, the counters
  are not the steps' sums (or, counters alone, exceed what the output can hold), an accepted
  draft token is not the emitted one, a rejected draft token or any token the residual excludes
  follows a rejection. A correct engine never has one; an engine that lies has them.
* **the output** (`output_tests`): every emitted token against p~ at its position, roles ignored
  (lossless: holds whatever the story), and the tokens of each role against that role's
  distribution (the story's roles), each a pooled rank chi-square over all requests and
  positions (`rank_chi_square`); Bonferroni over the tests made.
* **counters alone** (`conditional_counters_test`, no steps recorded): given the output, a
  lossless engine's chain structure is a Markov chain whose draft position t is accepted with
  probability min(p~, q~)(x_t) / p~(x_t); its accepted count is computed exactly (the theory at
  the positions the engine drafted, weighted as it drafts them) and tested in both tails.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.stats import chi2, norm

from mtad_energy.decoding.rules.sampling import residual
from mtad_energy.engines import audit
from mtad_energy.engines.audit import LosslessResult, Measured

TARGET, ACCEPTED, RESAMPLED, BONUS = range(4)  # an output position's role
ROLE_NAMES = {ACCEPTED: "accepted draft tokens", RESAMPLED: "tokens after a rejection",
              BONUS: "bonus tokens"}


@dataclass(frozen=True)
class Served:
    """One request as the engine served it. ``output`` (T tokens); ``p [T, V]`` the target's
    warped distribution teacher-forced along it; ``q [T, V]`` the draft's as verified (a sampled
    draft: q~ teacher-forced; a point-mass draft: one-hot of its proposal, `point_mass_served`);
    ``steps``: the (drafted, accepted) per step the roles come from (the engine's, or read off
    the output for a point-mass draft; None: not known); ``reported``: the engine's own steps where
    ``steps`` were read off the output; ``drafts``: the engine's draft tokens per step, if it
    reports them."""

    output: tuple[int, ...]
    p: torch.Tensor
    q: torch.Tensor
    steps: tuple[tuple[int, int], ...] | None = None
    reported: tuple[tuple[int, int], ...] | None = None
    drafts: tuple[tuple[int, ...], ...] | None = None


def point_mass_served(output: Sequence[int], p: torch.Tensor, propose,
                      reported: Sequence[tuple[int, int]] | None = None) -> Served:
    """A deterministic draft's request, its steps read off the output (`audit.point_mass_chains`'s
    walk: a draft token is accepted exactly where the output carries it; no proposal: an
    undrafted step) and q~ the one-hot of the proposal at each chain position (p~ elsewhere)."""
    n, t, steps, q = len(output), 1, [], p.clone()
    while t < n:
        d = list(propose(t))[: n - t]
        a = 0
        while a < len(d) and output[t + a] == d[a]:
            a += 1
        for i, tok in enumerate(d[: a + 1]):
            q[t + i] = torch.nn.functional.one_hot(torch.tensor(tok), p.shape[-1]).to(p.dtype)
        steps.append((len(d), a))
        t += a + 1
    return Served(tuple(output), p, q, tuple(steps),
                  tuple(map(tuple, reported)) if reported is not None else None)


def counters_of_steps(steps: Sequence[tuple[int, int]], k: int) -> Measured:
    """The engine-wide counters these steps give (vLLM's spec_decode_num_* and per position)."""
    drafted = [(d, a) for d, a in steps if d]
    return Measured(len(drafted), sum(d for d, _ in drafted), sum(a for _, a in drafted),
                    tuple(sum(1 for _, a in drafted if a > j) for j in range(k)))


# --------------------------------------------------------------------------- contradictions


def step_roles(steps: Sequence[tuple[int, int]], n: int) -> tuple[list[int], list[str]]:
    """The role of each of the output's n positions by the steps (position 0: the prefill's),
    and the steps' contradictions of the output: a step outside 0 <= accepted <= drafted, a step
    starting past the output's end, steps emitting fewer tokens than the output has. (The last
    step may run past the end: the engine cut it at its token limit.)"""
    roles, problems = [TARGET], []
    for i, (drafted, accepted) in enumerate(steps):
        if not 0 <= accepted <= drafted:
            problems.append(f"step {i} accepts {accepted} of {drafted} draft tokens")
            break
        if len(roles) >= n:
            problems.append(f"step {i} starts at position {len(roles)}, past the output's {n} tokens")
            break
        roles += [ACCEPTED] * accepted + [TARGET if not drafted else
                                          RESAMPLED if accepted < drafted else BONUS]
    if len(roles) < n and not problems:
        problems.append(f"the steps emit {len(roles)} tokens, the output has {n}")
    return roles[:n], problems


def token_contradictions(s: Served, roles: Sequence[int], tolerance: float = 0.0) -> list[str]:
    """Tokens the story says the engine could not have emitted: after a rejection, a token the
    residual excludes (p~(x) < q~(x) - tolerance: the rejected draft token is one); an accepted
    draft token outside min(p~, q~)'s support; where the engine reports its draft tokens, an
    accepted one that is not the emitted token, or a rejected one emitted after it."""
    out, problems = s.output, []
    for t, role in enumerate(roles):
        x, p_x, q_x = out[t], float(s.p[t, out[t]]), float(s.q[t, out[t]])
        if role == RESAMPLED and p_x < q_x - tolerance:
            problems.append(f"position {t}: token {x} after a rejection, where the residual "
                            f"cannot give it (p~ {p_x:.3g} < q~ {q_x:.3g})")
        elif role == ACCEPTED and min(p_x, q_x) <= 0.0:
            problems.append(f"position {t}: token {x} accepted, outside min(p~, q~)'s support")
    if s.drafts is not None and s.steps is not None:
        t = 1
        for i, ((_, a), d) in enumerate(zip(s.steps, s.drafts, strict=False)):
            for j in range(min(a + 1, len(d), len(out) - t)):
                if (j < a) != (out[t + j] == d[j]):
                    problems.append(f"step {i}: draft token {j + 1} ({d[j]}) "
                                    f"{'accepted' if j < a else 'rejected'}, output has {out[t + j]}")
            t += a + 1
    return problems


def counter_contradictions(measured: Measured, served: Sequence[Served], k: int,
                           always_drafts: bool) -> list[str]:
    """The engine-wide counters against the output. With steps (the engine's, or read off the
    output): the counters are the steps' sums, except that steps read off the output are cut at
    its end (the draft tokens past it, counted by the engine: `_hidden_tokens`).
    Without: every chain covers its accepted tokens plus one, so drafts + accepted tokens is at
    most the output positions after the first plus k per request (and at least those positions
    where the engine ``always_drafts``: a draft model)."""
    problems = []
    if measured.accepted_per_pos and sum(measured.accepted_per_pos) != measured.accepted_tokens:
        problems.append(f"accepted per position {list(measured.accepted_per_pos)} does not sum to "
                        f"accepted tokens {measured.accepted_tokens}")
    per_pos = measured.accepted_per_pos
    if any(a < b for a, b in zip(per_pos, per_pos[1:], strict=False)):
        problems.append(f"accepted per position {list(per_pos)} grows with depth")
    positions, slack = sum(len(s.output) - 1 for s in served), k * len(served)
    if all(s.steps is not None for s in served):
        visible = counters_of_steps([st for s in served for st in s.steps], k)
        hidden = sum(_hidden_tokens(s.steps, k) for s in served)
        lo = (visible.drafts, visible.draft_tokens, visible.accepted_tokens)
        got = (measured.drafts, measured.draft_tokens, measured.accepted_tokens)
        names = ("drafts", "draft tokens", "accepted tokens")
        for name, lo_i, got_i in zip(names, lo, got, strict=True):
            if not lo_i <= got_i <= lo_i + (hidden if name != "drafts" else 0):
                problems.append(f"counters: {got_i} {name}, the output shows {lo_i}"
                                + (f" (+ up to {hidden} past its end)" if name != "drafts" else ""))
        if not hidden and measured.accepted_per_pos and \
                measured.accepted_per_pos[:k] != visible.accepted_per_pos:
            problems.append(f"counters: accepted per position {list(measured.accepted_per_pos)}, "
                            f"the output shows {list(visible.accepted_per_pos)}")
        return problems
    total = measured.drafts + measured.accepted_tokens
    if total > positions + slack or (always_drafts and total < positions):
        problems.append(f"counters: {measured.drafts} drafts + {measured.accepted_tokens} accepted "
                        f"tokens, the output's {positions} positions allow "
                        f"{positions if always_drafts else 0}..{positions + slack}")
    return problems


def _hidden_tokens(steps: Sequence[tuple[int, int]], k: int) -> int:
    """Draft tokens the steps may have had past the output's end (steps read off the output are
    cut there, those starting within k of it; the engine counts all k): k minus each drafted
    count."""
    return sum(max(0, k - d) for d, _ in steps if d)


# --------------------------------------------------------------------------- the output


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
    a, b = (-1.0, 0.0) if s < mean else (0.0, 1.0)
    while (moments(a)[1] > s) if s < mean else (moments(b)[1] < s):
        a, b = (2 * a, a) if s < mean else (b, 2 * b)
    theta = brentq(lambda t: moments(t)[1] - s, a, b, xtol=1e-12, maxiter=200)
    k, _, k2 = moments(theta)
    w = math.copysign(math.sqrt(max(0.0, 2.0 * (theta * s - k))), theta)
    u = theta * math.sqrt(k2)
    lower = float(norm.cdf(w) + norm.pdf(w) * (1.0 / w - 1.0 / u))
    lower = min(max(lower, 0.0), 1.0)
    return lower, 1.0 - lower


def bonus_score_test(served: Sequence[Served], k: int, tolerance: float = 0.0
                     ) -> LosslessResult:
    """Without steps, the bonus tokens' positions are not known, but a lossless engine's chance
    that position t is one, given the output before it (`bonus_weights`), is; and its token
    follows p~ whatever its role. S = sum_t w_t p~_t(x_t) with those predictable weights is a
    martingale's sum: tested two-sided by its saddlepoint tails, as `score_test`. A bonus token
    drawn wrongly shifts it where the weights are large."""
    probs, values, s = [], [], 0.0
    for srv in served:
        a = accept_given_token(srv.p, srv.q, srv.output).clamp(tolerance, 1.0 - tolerance)
        w = torch.as_tensor(bonus_weights(a.tolist(), k))
        keep = w > 1e-9
        p = srv.p.double()[keep]
        probs.append(p)
        values.append(w[keep, None] * p)
        x = torch.as_tensor(list(srv.output))[keep]
        s += float((w[keep] * p.gather(1, x[:, None])[:, 0]).sum())
    p, v = torch.cat(probs), torch.cat(values)
    if p.shape[0] == 0 or float(v.max()) <= 0:
        return LosslessResult(0, 0, 0.0, 0)
    lower, upper = saddlepoint_tails(p.numpy(), s, v.numpy())
    pv = min(1.0, 2.0 * min(lower, upper))
    return LosslessResult(1, p.shape[0], math.inf if pv <= 0.0 else float(chi2.isf(pv, 1)), 1)


def bonus_weights(accept: Sequence[float], k: int) -> np.ndarray:
    """P(position t is a bonus position | the output before t) for a lossless engine drafting k
    from position 1 (`accepted_distribution`'s chain walk, forward): ``[T]``."""
    w, f = np.zeros(len(accept)), np.eye(1, k + 1)[0]  # [depth 0..k-1, or k: a bonus position]
    for t in range(1, len(accept)):
        w[t] = f[k]
        a = float(accept[t])
        f = np.concatenate([[f[k] + (1 - a) * f[:k].sum()], a * f[:k]])
    return w


def role_refs(p: torch.Tensor, q: torch.Tensor, roles: Sequence[int],
              tolerance: float = 0.0) -> torch.Tensor:
    """Each position's distribution in its role: ``[T, V]`` (accepted: min(p~, q~) / alpha;
    after a rejection: the residual; bonus and target: p~), mixed with ``tolerance`` x p~ (an
    audit whose numerics are not the engine's)."""
    acc = torch.minimum(p, q)
    acc = acc / acc.sum(-1, keepdim=True).clamp_min(1e-30)
    r = torch.as_tensor(list(roles))[:, None]
    ref = torch.where(r == ACCEPTED, acc, torch.where(r == RESAMPLED, residual(p, q), p))
    return (1.0 - tolerance) * ref + tolerance * p


@dataclass(frozen=True)
class OutputTests:
    """``tests``: name -> `LosslessResult` ("every position": the output against p~, roles
    ignored; one per role where the roles are known; each by `rank_chi_square` and, "... score",
    by `score_test`). ``pvalue``: Bonferroni, the smallest p-value times the number of tests
    made (those with degrees of freedom)."""

    tests: dict[str, LosslessResult]

    @property
    def made(self) -> int:
        return sum(1 for r in self.tests.values() if r.dof)

    @property
    def pvalue(self) -> float:
        ps = [r.pvalue for r in self.tests.values() if r.dof]
        return min(1.0, len(ps) * min(ps)) if ps else 1.0


def output_tests(served: Sequence[Served], tolerance: float = 0.0, k: int | None = None
                 ) -> OutputTests:
    """The output at every position of every request against p~ (lossless, whatever the story)
    and, where every request's roles are known, each role's tokens against its distribution;
    each group by `rank_chi_square` and `score_test`. Roles not known and ``k`` given (a draft
    drafting k at every step): the bonus-weighted score (`bonus_score_test`) besides."""
    p = torch.cat([s.p for s in served])
    toks = [x for s in served for x in s.output]
    p = (1.0 - tolerance) * p + tolerance / p.shape[-1]
    tests = {"every position": rank_chi_square(p, toks), "every position score": score_test(p, toks)}
    if served and all(s.steps is not None for s in served):
        roles = [step_roles(s.steps, len(s.output))[0] for s in served]
        refs = torch.cat([role_refs(s.p, s.q, r, tolerance) for s, r in zip(served, roles,
                                                                             strict=True)])
        flat = torch.as_tensor([x for r in roles for x in r])
        for role, name in ROLE_NAMES.items():
            keep = (flat == role).nonzero()[:, 0]
            tests[name] = rank_chi_square(refs[keep], [toks[i] for i in keep.tolist()])
            tests[f"{name} score"] = score_test(refs[keep], [toks[i] for i in keep.tolist()])
    elif served and k is not None:
        tests["bonus-weighted score"] = bonus_score_test(served, k, tolerance)
    return OutputTests(tests)


# --------------------------------------------------------------------------- counters alone


def accept_given_token(p: torch.Tensor, q: torch.Tensor, output: Sequence[int]) -> torch.Tensor:
    """P(the output's token at t was an accepted draft token | it is x_t, t a draft position),
    for a lossless engine: min(p~, q~)(x_t) / p~(x_t). ``[T]``."""
    x = torch.as_tensor(list(output))[:, None]
    p_x, q_x = p.gather(1, x)[:, 0].double(), q.gather(1, x)[:, 0].double()
    return torch.where(p_x > 0, torch.minimum(p_x, q_x) / p_x.clamp_min(1e-300), 0.0)


def accepted_distribution(accept: Sequence[float], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Given one output, the distribution of the accepted draft tokens a lossless engine drafting
    k per step (from position 1) reports: ``accept[t]`` the probability that position t, if a
    draft position, was accepted. Chain depth is a Markov chain (accepted: one deeper, a bonus
    after k; rejected: a new chain). Returns the pmf of the accepted tokens the output shows and
    of those plus the most a chain cut at the output's end can hide (k - its depth)."""
    n = len(accept)
    f = np.zeros((k + 1, n + 1))  # [depth 0..k-1, or k: a bonus position; accepted so far]
    f[0, 0] = 1.0
    for t in range(1, n):
        a, g = float(accept[t]), np.zeros_like(f)
        g[0] += f[k] + (1 - a) * f[:k].sum(0)
        for i in range(k):
            g[i + 1, 1:] += a * f[i, :-1]
        f = g
    shown = f.sum(0)
    most = np.zeros(n + 1 + k)
    for i in range(k + 1):
        most[(k - i if 0 < i < k else 0):][: n + 1] += f[i]
    return shown, most


@dataclass(frozen=True)
class CountersTest:
    """The engine's accepted tokens against their distribution given the output; ``expected``:
    its mean (the output's visible positions)."""

    accepted: int
    expected: float
    p_under: float
    p_over: float


def conditional_counters_test(served: Sequence[Served], measured: Measured, k: int,
                              tolerance: float = 0.0) -> CountersTest:
    """The counters-only test (no steps recorded; a draft that drafts k at every step): the
    accepted tokens against their exact distribution given the outputs (`accepted_distribution`,
    requests independent: convolved), one-sided in each tail (the under tail against the tokens
    the outputs show, the over tail against those plus the most the cut chains hide)."""
    shown, most = np.ones(1), np.ones(1)
    for s in served:
        a = accept_given_token(s.p, s.q, s.output).clamp(tolerance, 1.0 - tolerance).tolist()
        one, one_most = accepted_distribution(a, k)
        shown, most = np.convolve(shown, one), np.convolve(most, one_most)
    got = measured.accepted_tokens
    p_under = float(shown[: got + 1].sum())
    p_over = float(most[got:].sum()) if got < len(most) else 0.0
    mean = float((np.arange(len(shown)) * shown).sum())
    return CountersTest(got, mean, min(1.0, p_under), min(1.0, p_over))


# --------------------------------------------------------------------------- the verdict

CONTRADICTS = "counters contradict output"


def reported_contradictions(read: Sequence[tuple[int, int]],
                            reported: Sequence[tuple[int, int]]) -> list[str]:
    """The engine's steps against those read off its output (a point-mass draft): equal, except
    that the last may run past the output's end (more accepted where all it shows were)."""
    if len(read) != len(reported):
        return [f"the engine reports {len(reported)} steps, its output shows {len(read)}"]
    out = []
    for i, ((d, a), (_, got)) in enumerate(zip(read, reported, strict=True)):
        cut = i == len(read) - 1 and a == d
        if got != a and not (cut and got > a):
            out.append(f"step {i}: the engine reports {got} accepted, its output shows {a}")
    return out


@dataclass(frozen=True)
class Verdict:
    """One configuration's audit from its outputs: ``row``, the acceptance test where the roles
    are known (`audit.audit_row`; its ``test`` None otherwise); ``contradictions``, the story's
    certain contradictions of the output; ``output``, the output tests; ``counters``, the
    counters-only test where no steps were recorded. ``flags``: every check that fired, in this
    order: CONTRADICTS, the acceptance test's, the counters test's, "lossy" (``output``'s
    Bonferroni p-value below ``level``)."""

    row: audit.AuditRow
    contradictions: tuple[str, ...]
    output: OutputTests
    counters: CountersTest | None
    level: float

    @property
    def flags(self) -> tuple[str, ...]:
        out = [CONTRADICTS] if self.contradictions else []
        if self.row.test is not None and self.row.flag:
            out.append(self.row.flag)
        if self.counters is not None:
            out += (["under-accepts"] if self.counters.p_under < self.level else
                    ["over-accepts"] if self.counters.p_over < self.level else [])
        return tuple(out + (["lossy"] if self.output.pvalue < self.level else []))

    @property
    def flag(self) -> str | None:
        return self.flags[0] if self.flags else None

    @property
    def flagged(self) -> bool:
        return bool(self.flags)

    def as_dict(self) -> dict:
        c = self.counters
        return {**self.row.as_dict(), "flag": self.flag, "flags": list(self.flags),
                "contradictions": len(self.contradictions),
                "first_contradictions": list(self.contradictions[:3]),
                "output_tests": {name: {"samples": r.samples, "chi2": round(r.stat, 2),
                                        "dof": r.dof, "pvalue": r.pvalue}
                                 for name, r in self.output.tests.items()},
                "output_pvalue_bonferroni": self.output.pvalue,
                **({"counters_test": {"accepted": c.accepted, "expected": round(c.expected, 2),
                                      "p_under": c.p_under, "p_over": c.p_over}} if c else {})}


def audit_served(config: str, served: Sequence[Served], measured: Measured, k: int,
                 level: float = 1e-3, tolerance: float = 0.0, always_drafts: bool = True
                 ) -> Verdict:
    """Every check of one configuration's requests: where every request's roles are known
    (``steps``), the acceptance test on the chains they start (`audit.audit_row`), the steps'
    and tokens' contradictions; the counters against the output (``always_drafts``: the draft
    drafts at every step, a draft model); the output tests; without steps, the counters-only
    test (`conditional_counters_test`, ``always_drafts`` drafts only: else refused, None)."""
    known = bool(served) and all(s.steps is not None for s in served)
    problems = counter_contradictions(measured, served, k, always_drafts)
    chains = []
    for s in served if known else ():
        roles, bad = step_roles(s.steps, len(s.output))
        problems += bad + token_contradictions(s, roles, tolerance)
        if s.reported is not None:
            problems += reported_contradictions(s.steps, s.reported)
        chains += audit.stepped_chains(audit.alpha_dists(s.p, s.q), s.steps)
    row = audit.audit_row(config, chains, measured, k, level, tolerance)
    counters = (conditional_counters_test(served, measured, k, tolerance)
                if not known and always_drafts else None)
    tests = output_tests(served, tolerance, k if not known and always_drafts else None)
    return Verdict(row, tuple(problems), tests, counters, level)
