"""Auditing an engine's speculative decoding against acceptance theory (docs/design.md section 10).

The engine's own outputs are teacher-forced through the Hugging Face target p and draft q under the
engine's warping (`sampling.warp_probs`); a draft token is accepted with probability
alpha = sum_x min(p~(x), q~(x)) (Leviathan et al. 2023), or p~(d) for a deterministic draft d
(n-gram / prompt lookup, and vLLM's default greedy draft model: q~ a point mass on d).

**Where acceptance is measured.** An engine drafts at *chain starts*: the position after each
verification step, i.e. after a rejection's resampled token or a full chain's bonus token, never
at every position. Those positions are not typical: the token before a chain start is often one
the draft did not predict, so alpha there is lower than alpha averaged over the output (SmolLM2
at T = 0.8: 0.38 at chain starts, 0.54 averaged). Theory is therefore taken exactly where the
engine drafted: each `Chain` starts where the engine's steps put it, and its ``alphas[i]`` is the
probability that draft token i+1 is accepted *given the first i were* (teacher-forced over the
output: where they were accepted, the output tokens are the draft's, so the conditional is
exact). Chain starts come from the engine's per-step accepted counts (vLLM's detailed
per-request metrics: `stepped_chains`) or, for a deterministic draft, from the output itself (a
draft token is accepted exactly when the output carries it: `point_mass_chains`).

**The test.** Every draft position a chain reached is one trial, accepted with its alpha given the
past: the accepted count minus the summed alphas is a martingale, and its one-sided tails
(Poisson-binomial over the trials' alphas, `acceptance_test`) give p-values that are uniform for a
correct engine, so the flag fires at its nominal level; an engine accepting with half the right
probability, or accepting without the test, lands in the lower or upper tail. Beside it the
engine's own counters (vLLM: drafts, draft tokens, accepted tokens, accepted per position) with
Wilson intervals. `speculated_position_test` checks that the engine's sampled tokens at a
speculated position follow the target's exact warped distribution (chi-square).

Pure functions on tensors and counts first; the teacher-forcing driver takes a loaded model.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import binomtest, chi2

from mtad_energy.decoding.rules.sampling import Warp


# --------------------------------------------------------------------------- acceptance theory
def alpha_dists(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Acceptance probability of a draft token sampled from q, verified against p:
    ``sum_x min(p(x), q(x))``. p, q ``[..., V]`` (warped, normalised) -> ``[...]``."""
    return torch.minimum(p.float(), q.float()).sum(-1).clamp(0.0, 1.0)


def alpha_point(p: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Acceptance probability of a deterministic draft token (q a point mass on it): ``p(token)``.
    p ``[..., V]``, tokens ``[...]`` -> ``[...]``."""
    return p.float().gather(-1, tokens[..., None].long())[..., 0]


def depth_probs(alphas: torch.Tensor) -> torch.Tensor:
    """P(a chain is accepted at least to depth j) = prod_{i<=j} alpha_i: ``[..., k] -> [..., k]``."""
    return alphas.float().cumprod(-1)


def expected_accepted(alphas: torch.Tensor) -> torch.Tensor:
    """Expected accepted draft tokens of a chain: sum_{j<=k} prod_{i<=j} alpha_i;
    ``[..., k] -> [...]`` (the bonus token not counted; block efficiency is this + 1)."""
    return depth_probs(alphas).sum(-1)


# --------------------------------------------------------------------------- chains where the engine drafted


@dataclass(frozen=True)
class Chain:
    """One drafting step of an engine: its first draft token at output position ``start``;
    ``alphas[i]``, the probability that draft token i+1 is accepted given the first i were (exact
    for the positions the chain reached); ``accepted``, how many the engine accepted (None: not
    known, a sampled draft without the engine's steps); ``at_start``: False for a chain put at
    every position (`every_position_chains`), not where the engine drafted."""

    start: int
    alphas: tuple[float, ...]
    accepted: int | None = None
    at_start: bool = True

    def __post_init__(self) -> None:
        if self.accepted is not None and not 0 <= self.accepted <= len(self.alphas):
            raise ValueError(f"accepted {self.accepted} outside 0..{len(self.alphas)} draft tokens")

    def trials(self) -> list[tuple[int, float, bool]]:
        """(depth, alpha, accepted) of every draft position the chain reached: its accepted ones
        and the one that was rejected (none after a full chain)."""
        if self.accepted is None:
            return []
        reached = min(self.accepted + 1, len(self.alphas))
        return [(i, self.alphas[i], i < self.accepted) for i in range(reached)]


def stepped_chains(alphas: torch.Tensor, steps: Sequence[tuple[int, int]]) -> list[Chain]:
    """Chains of a sampled draft at the starts the engine's steps give: ``steps`` are (drafted,
    accepted) per engine step (vLLM ``per_step_drafted`` / ``per_step_accepted``); the first chain
    starts at output position 1 (position 0 comes from the prefill) and each step emits its
    accepted tokens plus one. ``alphas [T]``: alpha at every output position, teacher-forced
    (`alpha_dists` of p~ and q~ along the output). A chain running past the output keeps the
    positions inside it (and its accepted count, where that fits)."""
    out, t, n = [], 1, alphas.shape[0]
    for drafted, accepted in steps:
        if t >= n:
            break
        if drafted:
            a = tuple(alphas[t:t + drafted].tolist())
            out.append(Chain(t, a, min(accepted, len(a))))  # past the end: the inside ones
        t += accepted + 1
    return out


def point_mass_chains(p: torch.Tensor, output: Sequence[int],
                      propose: Callable[[int], Sequence[int]]) -> list[Chain]:
    """Chains of a deterministic draft, read off the output: at a chain start t, the engine's
    proposal ``propose(t)`` (as made from the output's first t tokens and, for later draft
    tokens, the accepted ones before them); draft token i is accepted exactly when the output
    carries it at t + i (the residual after a rejection excludes it), with probability
    p~(d_i | output[:t + i]) (``p [T, V]``, teacher-forced). The next chain starts after the
    accepted tokens and the one the engine emitted after them. Positions past the output are
    left out (their outcome is unknown)."""
    out, t, n = [], 1, len(output)
    while t < n:
        d = list(propose(t))[: n - t]
        if not d:
            t += 1
            continue
        accepted = 0
        while accepted < len(d) and output[t + accepted] == d[accepted]:
            accepted += 1
        alphas = tuple(alpha_point(p[t:t + len(d)], torch.tensor(d)).tolist())
        out.append(Chain(t, alphas, accepted))
        t += accepted + 1
    return out


def ngram_proposer(prompt: Sequence[int], output: Sequence[int], min_n: int, max_n: int,
                   k: int) -> Callable[[int], list[int]]:
    """`point_mass_chains`'s ``propose`` for n-gram (prompt lookup) drafting (`ngram_propose`)."""
    return lambda t: ngram_propose(list(prompt) + list(output[:t]), min_n, max_n, k)


def greedy_proposer(q: torch.Tensor, k: int, output: Sequence[int] | None = None
                    ) -> Callable[[int], list[int]]:
    """`point_mass_chains`'s ``propose`` for a greedy draft model: argmax q~ at each of the k
    positions (``q [T, V]``, teacher-forced; right where the draft tokens before were accepted,
    the only positions the chain reaches). With the ``output``, where its token is one of q~'s
    tied maxima (`tied_greedy`: a draft in other numerics may have picked any of them), the
    proposal is that token: the reading that agrees with the engine wherever it can."""
    best = q.argmax(-1)
    if output is not None:
        out = torch.as_tensor(list(output))
        top = q.max(-1).values
        best = torch.where(q.gather(1, out[:, None])[:, 0] >= top, out, best)
    best = best.tolist()
    return lambda t: best[t:t + k]


def every_position_chains(alphas: torch.Tensor, k: int) -> list[Chain]:
    """A chain at every position t >= 1, outcomes unknown: for a sampled draft whose engine
    steps were not recorded. Its alpha_1 is the chain-start theory only where alpha does not
    vary with the position (the model as its own draft, q = p: 1 everywhere); elsewhere it is
    biased high (chain starts follow rejections), so `audit_row` refuses to test counters on
    these (``at_start`` False): record the engine's steps, or use the output
    (`audit_output.conditional_counters_test`)."""
    return [Chain(t, tuple(alphas[t:t + k].tolist()), at_start=False)
            for t in range(1, alphas.shape[0] - k + 1)]


# --------------------------------------------------------------------------- the test


def poisson_binomial_tails(alphas: Sequence[float], successes: int) -> tuple[float, float]:
    """P(S <= successes) and P(S >= successes) for S, the sum of independent Bernoulli(alpha_i)
    (exact, by convolution)."""
    pmf = np.zeros(len(alphas) + 1)
    pmf[0] = 1.0
    for i, a in enumerate(alphas):
        a = min(max(float(a), 0.0), 1.0)
        pmf[1:i + 2] = pmf[1:i + 2] * (1 - a) + pmf[:i + 1] * a
        pmf[0] *= 1 - a
    cdf = np.cumsum(pmf)
    below = cdf[successes - 1] if successes > 0 else 0.0
    return float(min(1.0, cdf[successes])), float(min(1.0, max(0.0, 1.0 - below)))


@dataclass(frozen=True)
class AcceptanceTest:
    """Accepted draft tokens over the trials the chains reached, against the sum of their alphas;
    ``per_depth[j]``: (trials, accepted, expected) at draft position j+1."""

    trials: int
    accepted: int
    expected: float
    p_under: float
    p_over: float
    per_depth: tuple[tuple[int, int, float], ...]

    def flag(self, level: float) -> str | None:
        """"under-accepts", "over-accepts" or None at one-sided ``level``."""
        return ("under-accepts" if self.p_under < level else
                "over-accepts" if self.p_over < level else None)


def acceptance_test(chains: Sequence[Chain], k: int, tolerance: float = 0.0) -> AcceptanceTest:
    """`AcceptanceTest` of the chains whose outcomes are known. ``tolerance``: alphas are taken
    within [tolerance, 1 - tolerance], for an audit whose numerics are not the engine's (a bf16
    engine at T = 0 against an fp32 target: a near-tie makes theory's 0 or 1 the other way)."""
    trials = [tr for c in chains for tr in c.trials()]
    alphas = [min(max(a, tolerance), 1.0 - tolerance) for _, a, _ in trials]
    accepted = sum(ok for _, _, ok in trials)
    p_under, p_over = poisson_binomial_tails(alphas, accepted)
    per_depth = tuple((sum(1 for d, _, _ in trials if d == j),
                       sum(1 for d, _, ok in trials if d == j and ok),
                       float(sum(a for (d, _, _), a in zip(trials, alphas, strict=True) if d == j)))
                      for j in range(k))
    return AcceptanceTest(len(trials), accepted, float(sum(alphas)), p_under, p_over, per_depth)


# --------------------------------------------------------------------------- measured vs theory
@dataclass(frozen=True)
class Measured:
    """An engine's acceptance counters over one measured call (diffed, not cumulative).

    ``accepted_per_pos[j]``: chains whose draft token j+1 was accepted (vLLM
    ``vllm:spec_decode_num_accepted_tokens_per_pos``)."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_pos: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if min(self.drafts, self.draft_tokens, self.accepted_tokens) < 0:
            raise ValueError(f"counters must be >= 0, got {self}")
        if self.accepted_tokens > self.draft_tokens:
            raise ValueError(f"accepted_tokens {self.accepted_tokens} > draft_tokens "
                             f"{self.draft_tokens}: counters not diffed over the same call?")
        if any(a > self.drafts for a in self.accepted_per_pos):
            raise ValueError(f"accepted_per_pos {self.accepted_per_pos} exceeds drafts {self.drafts}")


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (0, 1) when n == 0."""
    if n == 0:
        return 0.0, 1.0
    phat = successes / n
    den = 1 + z * z / n
    mid = (phat + z * z / (2 * n)) / den
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def under_acceptance_pvalue(successes: int, n: int, p_theory: float) -> float:
    """One-sided P(X <= successes), X ~ Binomial(n, p_theory): how surprising so few acceptances are
    if the engine met theory (for counters alone, where the chains' outcomes are not known)."""
    if n == 0:
        return 1.0
    p_theory = min(max(p_theory, 0.0), 1.0)
    if p_theory >= 1.0:
        return 0.0 if successes < n else 1.0
    return float(binomtest(successes, n, p_theory, alternative="less").pvalue)


def chain_accepted_pmf(alphas: Sequence[float]) -> np.ndarray:
    """Accepted draft tokens of one chain: P(A = j) = prod_{i<j} alpha_i (1 - alpha_j), and
    P(A = k) = prod alpha: ``[k + 1]``."""
    reach = np.cumprod([1.0] + [min(max(float(a), 0.0), 1.0) for a in alphas])  # P(A >= j)
    return reach - np.append(reach[1:], 0.0)


def accepted_tokens_pvalue(chains: Sequence[Chain], accepted: int) -> float:
    """One-sided P(sum of the chains' accepted tokens <= accepted), chains independent: the
    counters' token total against theory at every draft position, each weighted by how often
    the engine reaches it (not the token rate against alpha_1)."""
    pmf = np.ones(1)
    for c in chains:
        pmf = np.convolve(pmf, chain_accepted_pmf(c.alphas))
    return float(min(1.0, pmf[: accepted + 1].sum()))


@dataclass(frozen=True)
class AuditRow:
    """One drafting configuration's verdict: acceptance where the engine drafted beside theory
    there.

    ``theory_alpha1``: mean alpha of the chains' first draft tokens (at the chain starts);
    ``pvalue_counters``: the engine's own first-position counters against it (one-sided, under);
    ``test``: the trials' test where the chains' outcomes are known (the engine's steps, or a
    deterministic draft's output), else None; ``flag``: "under-accepts", "over-accepts" or None,

    from ``test`` where there is one (it holds the counters' information and more), else from
    the counters; ``refused``: why the counters were not tested (chains not at the engine's
    chain starts), else None."""

    config: str
    k: int
    chains: int
    theory_alpha1: float
    measured: Measured
    first_pos_rate: float
    first_pos_ci: tuple[float, float]
    accept_rate: float
    accept_rate_ci: tuple[float, float]
    pvalue_counters: float
    flag: str | None
    test: AcceptanceTest | None = None
    refused: str | None = None

    @property
    def flagged(self) -> bool:
        return self.flag is not None

    def as_dict(self) -> dict:
        m, t = self.measured, self.test
        return {
            "config": self.config, "k": self.k, "theory_chains": self.chains,
            "theory_alpha1_at_chain_starts": round(self.theory_alpha1, 4),
            "drafts": m.drafts, "draft_tokens": m.draft_tokens, "accepted_tokens": m.accepted_tokens,
            "accepted_per_pos": list(m.accepted_per_pos),
            "measured_pos1_rate": round(self.first_pos_rate, 4),
            "measured_pos1_ci95": [round(x, 4) for x in self.first_pos_ci],
            "measured_accept_rate": round(self.accept_rate, 4),
            "measured_accept_rate_ci95": [round(x, 4) for x in self.accept_rate_ci],
            "measured_accepted_per_chain": round(m.accepted_tokens / m.drafts, 3) if m.drafts else None,
            "pvalue_counters_under": self.pvalue_counters,
            **({"trials": t.trials, "trials_accepted": t.accepted,
                "trials_expected": round(t.expected, 2), "pvalue_under": t.p_under,
                "pvalue_over": t.p_over, "per_depth": [list(d) for d in t.per_depth]}
               if t is not None else {}),
            "flag": self.flag, **({"refused": self.refused} if self.refused else {}),
        }


def audit_row(config: str, chains: Sequence[Chain], measured: Measured, k: int,
              level: float = 1e-3, tolerance: float = 0.0) -> AuditRow:
    """The verdict of one configuration: `acceptance_test` over the chains' trials where every
    outcome is known (`stepped_chains`, `point_mass_chains`; ``tolerance``: its), beside the
    counters' first-position acceptance (``accepted_per_pos[0]`` of ``drafts``) against the
    chains' mean alpha_1 (one-sided binomial: conservative, alphas vary), or without per-position
    counters their accepted tokens against the chains' exact distribution
    (`accepted_tokens_pvalue`), which decides alone where the outcomes are not known; refused
    (``refused``, no flag) for chains not at the engine's chain starts. The counters' rates get
    Wilson intervals for the table (tokens within a chain are not independent: read the token
    rate as descriptive)."""
    firsts = [c.alphas[0] for c in chains if c.alphas]
    alpha1 = sum(firsts) / len(firsts) if firsts else 0.0
    per_pos = measured.accepted_per_pos
    succ, n = (per_pos[0], measured.drafts) if per_pos else (measured.accepted_tokens,
                                                              measured.draft_tokens)
    clamp = [Chain(c.start, tuple(min(max(a, tolerance), 1.0 - tolerance) for a in c.alphas))
             for c in chains]
    p_counters = (under_acceptance_pvalue(succ, n, min(max(alpha1, tolerance), 1.0 - tolerance))
                  if per_pos else accepted_tokens_pvalue(clamp, measured.accepted_tokens))
    known = bool(chains) and all(c.accepted is not None for c in chains)
    refused = (None if known or all(c.at_start for c in chains) else
               "chains at every position, not where the engine drafted: no counters test "
               "(record the engine's steps, or test the counters given the output)")
    test = acceptance_test(chains, k, tolerance) if known else None
    flag = test.flag(level) if test is not None else (
        "under-accepts" if p_counters < level and not refused else None)
    rate = measured.accepted_tokens / measured.draft_tokens if measured.draft_tokens else 0.0
    return AuditRow(
        config=config, k=k, chains=len(firsts), theory_alpha1=alpha1, measured=measured,
        first_pos_rate=succ / n if n else 0.0, first_pos_ci=wilson_interval(succ, n),
        accept_rate=rate,
        accept_rate_ci=wilson_interval(measured.accepted_tokens, measured.draft_tokens),
        pvalue_counters=p_counters, flag=flag, test=test, refused=refused)


# --------------------------------------------------------------------------- lossless check


def pooled_chi_square(counts: Counter, probs: torch.Tensor, min_expected: float = 5.0
                      ) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of token ``counts`` against ``probs [V]``; cells
    (most likely first) are pooled until each expects >= ``min_expected``. A token outside the
    support gives an infinite statistic (the engine emitted what the target cannot)."""
    n = sum(counts.values())
    if n == 0:
        return 0.0, 0
    if any(probs[t] <= 0 for t in counts):
        return math.inf, 1
    order = probs.argsort(descending=True).tolist()
    obs, exp, o_acc, e_acc = [], [], 0.0, 0.0
    rest = 1.0
    for t in order:
        pt = float(probs[t])
        if pt <= 0:
            break
        o_acc += counts.get(t, 0)
        e_acc += pt * n
        rest -= pt
        if e_acc >= min_expected and rest * n >= min_expected:
            obs.append(o_acc), exp.append(e_acc)
            o_acc, e_acc = 0.0, 0.0
    obs.append(n - sum(obs))  # the tail: whatever is left, observed and expected
    exp.append(n - sum(exp))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    return float(stat), len(obs) - 1


@dataclass(frozen=True)
class LosslessResult:
    groups: int
    samples: int
    stat: float
    dof: int

    @property
    def pvalue(self) -> float:
        if self.dof == 0:
            return 1.0
        return 0.0 if math.isinf(self.stat) else float(chi2.sf(self.stat, self.dof))


def speculated_position_test(pairs: Sequence[tuple[int, int]], exact: dict[int, torch.Tensor],
                             min_group: int = 20) -> LosslessResult:
    """Goodness of fit of the engine's token at a speculated position: ``pairs`` are (first token,
    second token) of independent samples from one prompt; ``exact[x1]`` is the target's warped
    ``p~(. | prompt, x1) [V]``. Groups of at least ``min_group`` samples are tested, their
    chi-square statistics and degrees of freedom summed (independent groups)."""
    groups: dict[int, Counter] = {}
    for x1, x2 in pairs:
        groups.setdefault(x1, Counter())[x2] += 1
    stat, dof, used, n = 0.0, 0, 0, 0
    for x1, c in groups.items():
        if sum(c.values()) < min_group or x1 not in exact:
            continue
        s, d = pooled_chi_square(c, exact[x1])
        stat, dof, used, n = stat + s, dof + d, used + 1, n + sum(c.values())
    return LosslessResult(used, n, stat, dof)


# --------------------------------------------------------------------------- n-gram proposals


def ngram_propose(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's n-gram (prompt lookup) proposal: the longest suffix of ``tokens`` of length
    min_n..max_n that occurred earlier; the k tokens after its earliest earlier occurrence
    (fewer where the context ends), [] without a match."""
    n_tok = len(tokens)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = list(tokens[n_tok - n:])
        for start in range(0, n_tok - n):
            if list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []


# --------------------------------------------------------------------------- teacher forcing


def tied_greedy(logits: torch.Tensor, gap: float) -> torch.Tensor:
    """T = 0 for an engine whose numerics are not the audit's: the tokens within ``gap`` logits of
    the maximum are ties, p~ uniform over them (``[..., V]``; ``gap`` 0: the one-hot argmax
    but for exact ties). A bf16 engine's greedy token is one of them where the fp32 audit's
    argmax is another (SmolLM2: 29 of 1,024 tokens, each within 0.23 logits)."""
    tied = logits >= logits.max(-1, keepdim=True).values - gap
    return tied.float() / tied.sum(-1, keepdim=True)


@torch.inference_mode()
def warped_along(model, prompt: Sequence[int], output: Sequence[int], warp: Warp,
                 tie_gap: float = 0.0) -> torch.Tensor:
    """The model's warped distribution at each generated position, teacher-forced over
    prompt + output: ``[len(output), V]`` (row t predicts output[t]); at T = 0 with ``tie_gap``
    the near-ties shared (`tied_greedy`)."""
    ids = torch.tensor([list(prompt) + list(output)], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # [T, V]
    if warp.temperature == 0 and tie_gap > 0:
        return tied_greedy(logits.float(), tie_gap).cpu()
    return warp.probs(logits).cpu()
