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
  distribution (the story's roles), each a pooled rank chi-square and a score over all
  requests and positions (`audit_stats`), and the bonus tokens against the previous position's
  p~ (an off-by-one: `neighbour_test`; where the roles are not known, at each position's chance
  of holding a bonus token); Bonferroni over the tests made. What the output could not test
  (roles not known, a role too rare) is said (`OutputTests.untested`), never passed as clean.
* **counters alone** (`conditional_counters_test`, no steps recorded): given the output, a
  lossless engine's chain structure is a Markov chain whose draft position t is accepted with
  probability min(p~, q~)(x_t) / p~(x_t); its accepted count is computed exactly (the theory at
  the positions the engine drafted, weighted as it drafts them) and tested in both tails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mtad_energy.decoding.rules.sampling import residual
from mtad_energy.engines import audit
from mtad_energy.engines.audit import LosslessResult, Measured
from mtad_energy.engines.audit_stats import (  # noqa: F401
    floor_pvalue,
    rank_chi_square,
    saddlepoint_tails,
    score_test,
    weighted_test,
)

TARGET, ACCEPTED, RESAMPLED, BONUS = range(4)  # an output position's role
FEW_TOKENS = 20  # a role with fewer tokens than this is reported untested (weak power)
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


def bonus_rows(served: Sequence[Served], k: int | None, tolerance: float = 0.0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The positions that may hold a bonus token, pooled over requests: ``p [N, V]`` (p~ there,
    mixed with ``tolerance`` of the uniform), ``prev [N, V]`` (p~ at the position before),
    ``w [N]`` and the tokens ``x [N]``. ``w`` is 1 at the bonus positions where every request's
    roles are known; else (``k``: the draft drafts k at every step) each position's chance of
    being one given the output before it (`bonus_weights`), which a lossless engine's bonus
    token follows whatever the role; no roles and no ``k``: none."""
    rows: list[tuple] = []
    known = bool(served) and all(s.steps is not None for s in served)
    for srv in served if known or k is not None else ():
        if known:
            roles = step_roles(srv.steps, len(srv.output))[0]
            w = torch.as_tensor([float(r == BONUS) for r in roles], dtype=torch.float64)
        else:
            a = accept_given_token(srv.p, srv.q, srv.output).clamp(tolerance, 1.0 - tolerance)
            w = torch.as_tensor(bonus_weights(a.tolist(), k))
        p = (1.0 - tolerance) * srv.p.double() + tolerance / srv.p.shape[-1]  # [T, V]
        keep = (w > 1e-9).nonzero()[:, 0]
        keep = keep[keep > 0]  # position 0 (the prefill's) has no position before it
        rows.append((p[keep], p[keep - 1], w[keep], torch.as_tensor(list(srv.output))[keep]))
    if not rows:
        v = served[0].p.shape[-1] if served else 1
        return (torch.zeros(0, v, dtype=torch.float64),) * 2 + (torch.zeros(0, dtype=torch.float64),
                                                                 torch.zeros(0, dtype=torch.long))
    return tuple(torch.cat(parts) for parts in zip(*rows, strict=True))  # type: ignore[return-value]


def bonus_score_test(p: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> LosslessResult:
    """The bonus tokens' score where their positions are known only by chance (`bonus_rows`'s
    ``w``): S = sum_t w_t p~_t(x_t), two-sided (`weighted_test`). A bonus token drawn from a
    wrong distribution shifts it where the weights are large."""
    return weighted_test(p, w[:, None] * p, x)


def neighbour_test(p: torch.Tensor, prev: torch.Tensor, w: torch.Tensor, x: torch.Tensor
                   ) -> LosslessResult:
    """An off-by-one in the bonus row, the commonest sampler bug (the token drawn from the
    previous position's p~): the log-likelihood ratio of the previous row against the right
    one, S = sum_t w_t log(prev_t(x_t) / p~_t(x_t)), weighted by each position's chance of
    holding a bonus token (`bonus_rows`), its upper tail (`weighted_test`). Where the bonus
    positions are known only by chance this is the test that can see the bug at the default
    sample size (the score of the tokens' probability, `bonus_score_test`, misses most)."""
    llr = prev.clamp_min(1e-30).log() - p.clamp_min(1e-30).log()  # [N, V]
    return weighted_test(p, w[:, None] * llr, x, upper_only=True)


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
    by `score_test`; the bonus tokens' previous-row test, `neighbour_test`). ``pvalue``:
    Bonferroni, the smallest p-value times the number of tests made (those with degrees of
    freedom). ``untested``: what these outputs could not test, each with its reason."""

    tests: dict[str, LosslessResult]
    untested: tuple[str, ...] = ()

    @property
    def made(self) -> int:
        return sum(1 for r in self.tests.values() if r.dof)

    @property
    def pvalue(self) -> float:
        ps = [r.pvalue for r in self.tests.values() if r.dof]
        return min(1.0, len(ps) * min(ps)) if ps else 1.0


def output_tests(served: Sequence[Served], tolerance: float = 0.0, k: int | None = None,
                 level: float = 1e-3) -> OutputTests:
    """The output at every position of every request against p~ (lossless, whatever the story)
    and, where every request's roles are known, each role's tokens against its distribution;
    each group by `rank_chi_square` and `score_test`; the bonus tokens' previous-row test
    (`neighbour_test`). Roles not known and ``k`` given (a draft drafting k at every step): the
    bonus-weighted score and previous-row test over the positions' chances of holding a bonus
    token. ``untested`` names each role no test could see at ``level`` after the correction:
    roles not known, none of them in the output, too few for the least likely outcome to
    reach it (`floor_pvalue`), or fewer than ``FEW_TOKENS`` (a test, but a weak one)."""
    p = torch.cat([s.p for s in served])
    toks = [x for s in served for x in s.output]
    p = (1.0 - tolerance) * p + tolerance / p.shape[-1]
    tests = {"every position": rank_chi_square(p, toks), "every position score": score_test(p, toks)}
    known = bool(served) and all(s.steps is not None for s in served)
    floors: dict[str, tuple[int, float | None]] = {}  # role -> (tokens, smallest p; None: exact)
    if known:
        roles = [step_roles(s.steps, len(s.output))[0] for s in served]
        refs = torch.cat([role_refs(s.p, s.q, r, tolerance) for s, r in zip(served, roles,
                                                                             strict=True)])
        flat = torch.as_tensor([x for r in roles for x in r])
        for role, name in ROLE_NAMES.items():
            keep = (flat == role).nonzero()[:, 0]
            x = [toks[i] for i in keep.tolist()]
            tests[name] = rank_chi_square(refs[keep], x)
            tests[f"{name} score"] = score_test(refs[keep], x)
            floors[name] = (len(x), 0.0 if tests[name].dof else
                            floor_pvalue(refs[keep], refs[keep]) if tests[f"{name} score"].dof
                            else None if x else 1.0)
    bp, prev, w, bx = bonus_rows(served, None if known else k, tolerance)
    if known:
        tests["bonus tokens, previous row"] = neighbour_test(bp, prev, w, bx)
        n, floor = floors[ROLE_NAMES[BONUS]]
        llr = prev.clamp_min(1e-30).log() - bp.clamp_min(1e-30).log()
        floors[ROLE_NAMES[BONUS]] = (n, min(floor if floor is not None else 1.0,
                                            floor_pvalue(bp, llr, upper_only=True) if n else 1.0))
    elif k is not None:
        tests["bonus-weighted score"] = bonus_score_test(bp, w, bx)
        tests["bonus-weighted, previous row"] = neighbour_test(bp, prev, w, bx)
    made = sum(1 for r in tests.values() if r.dof)
    untested = [f"{name}: none in the output" if not n else
                f"{name}: {n} in the output, too few for any test of them to reach {level:g} after "
                f"the correction (their least likely outcome gives p {floor:.2g})"
                if floor * made >= level else
                f"{name}: {n} in the output, too few for their tests to see more than a gross error"
                for name, (n, floor) in floors.items()
                if floor is not None and (floor * made >= level or n < FEW_TOKENS)]
    if not known:
        untested.append("each role's tokens apart: the engine's steps not recorded (" + (
            f"the bonus tokens tested by their chance at each position: {float(w.sum()):.0f} "
            "expected)" if k is not None else "no draft at every step: the bonus tokens not "
            "tested apart)"))
    return OutputTests(tests, tuple(untested))


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
    Bonferroni p-value below ``level``). ``greedy``: the engine decodes at T = 0 (its tokens and
    acceptances deterministic given its numerics, not samples): the certain checks alone."""

    row: audit.AuditRow
    contradictions: tuple[str, ...]
    output: OutputTests
    counters: CountersTest | None
    level: float
    greedy: bool = False

    @property
    def flags(self) -> tuple[str, ...]:
        out = [CONTRADICTS] if self.contradictions else []
        if self.greedy:
            return tuple(out)
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
    def untested(self) -> tuple[str, ...]:
        """What this audit could not test, each with its reason (no flag is not a clean bill
        for these): the output's (`OutputTests.untested`) and acceptance's where neither the
        chains' outcomes nor a counters-only test were available."""
        none = () if self.row.test is not None or self.counters is not None else (
            "acceptance: the chains' outcomes not known (the engine's steps not recorded) and "
            "the draft does not draft at every step: no acceptance test",)
        if self.greedy:
            return ("acceptance and the output's distribution: T = 0, deterministic given the "
                    "engine's numerics: the certain checks alone (each token a greedy maximum)",)
        return self.output.untested + none

    @property
    def flagged(self) -> bool:
        return bool(self.flags)

    def as_dict(self) -> dict:
        c = self.counters
        return {**self.row.as_dict(), "flag": self.flag, "flags": list(self.flags),
                "untested": list(self.untested), "contradictions": len(self.contradictions),
                "first_contradictions": list(self.contradictions[:3]),
                "output_tests": {name: {"samples": r.samples, "chi2": round(r.stat, 2),
                                        "dof": r.dof, "pvalue": r.pvalue}
                                 for name, r in self.output.tests.items()},
                "output_pvalue_bonferroni": self.output.pvalue,
                **({"counters_test": {"accepted": c.accepted, "expected": round(c.expected, 2),
                                      "p_under": c.p_under, "p_over": c.p_over}} if c else {})}


def audit_served(config: str, served: Sequence[Served], measured: Measured, k: int,
                 level: float = 1e-3, tolerance: float = 0.0, always_drafts: bool = True,
                 greedy: bool = False) -> Verdict:
    """Every check of one configuration's requests: where every request's roles are known
    (``steps``), the acceptance test on the chains they start (`audit.audit_row`), the steps'
    and tokens' contradictions; the counters against the output (``always_drafts``: the draft
    drafts at every step, a draft model); the output tests; without steps, the counters-only
    test (`conditional_counters_test`, ``always_drafts`` drafts only: else refused, None).
    ``greedy`` (T = 0, p~ the greedy maxima, `audit.tied_greedy`): every token must be one of
    them (a contradiction if not) and no statistical test flags (`Verdict.greedy`)."""
    known = bool(served) and all(s.steps is not None for s in served)
    problems = counter_contradictions(measured, served, k, always_drafts)
    for s in served if greedy else ():
        x = torch.as_tensor(list(s.output))
        problems += [f"position {t}: token {int(x[t])} at T = 0, not a greedy maximum"
                     for t in (s.p.gather(1, x[:, None])[:, 0] <= 0).nonzero()[:, 0].tolist()]
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
    tests = output_tests(served, tolerance, k if not known and always_drafts else None, level)
    return Verdict(row, tuple(problems), tests, counters, level, greedy)
