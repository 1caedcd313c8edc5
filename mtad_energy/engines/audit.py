"""Auditing an engine's speculative decoding against acceptance theory (DESIGN.md section 10).

The engine's own outputs are teacher-forced through the Hugging Face target p and draft q under the
engine's warping (`sampling.warp_probs`); at a draft position speculative sampling accepts with
probability alpha = sum_x min(p~(x), q~(x)) (Leviathan et al. 2023), or p~(d) for a deterministic
draft d (n-gram / prompt lookup: q~ a point mass on d). A chain of k is accepted to depth j with
prod_{i<=j} alpha_i, so its expected accepted length is sum_{j<=k} prod_{i<=j} alpha_i. Beside it
the engine's measured counters (vLLM: drafts, draft tokens, accepted tokens, accepted per position),
with Wilson intervals, and a one-sided binomial test that flags an engine accepting significantly
less than theory. `speculated_position_test` checks that the engine's sampled tokens at a
speculated position follow the target's exact warped distribution (chi-square).

Pure functions on tensors and counts first; the teacher-forcing drivers take loaded models.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from scipy.stats import binomtest, chi2

from mtad_energy.decoding.sampling import Warp

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


@dataclass(frozen=True)
class Theory:
    """What the target and draft predict over the chains the audit rebuilt.

    ``depth[j]``: mean over chains of P(accepted to depth j+1); ``draft_tokens``: mean chain length
    (a deterministic draft proposes fewer than k where the context runs out)."""

    chains: int
    depth: tuple[float, ...]
    mean_draft_tokens: float

    @property
    def accepted_per_chain(self) -> float:
        return float(sum(self.depth))

    @property
    def accept_rate(self) -> float:
        """Expected accepted / drafted tokens."""
        return self.accepted_per_chain / self.mean_draft_tokens if self.mean_draft_tokens else 0.0


def theory_from_chains(chain_alphas: Sequence[torch.Tensor], k: int) -> Theory:
    """Average the chains' depth probabilities; ``chain_alphas``: one ``[k_c]`` per chain
    (k_c <= k; a shorter chain contributes 0 beyond its end)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    kept = [a.float()[:k] for a in chain_alphas if a.numel()]
    if not kept:
        return Theory(0, (0.0,) * k, 0.0)
    depth = torch.zeros(k)
    for a in kept:
        depth[: a.numel()] += depth_probs(a)
    return Theory(len(kept), tuple((depth / len(kept)).tolist()),
                  sum(a.numel() for a in kept) / len(kept))


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
    if the engine met theory. Per-chain probabilities vary around their mean; a sum of Bernoullis
    with varying p has less variance than the binomial of the mean, so this p-value is
    conservative (flags less often than an exact test would)."""
    if n == 0:
        return 1.0
    p_theory = min(max(p_theory, 0.0), 1.0)
    if p_theory >= 1.0:
        return 0.0 if successes < n else 1.0
    return float(binomtest(successes, n, p_theory, alternative="less").pvalue)


@dataclass(frozen=True)
class AuditRow:
    """One drafting configuration's verdict: measured acceptance beside theory."""

    config: str
    k: int
    theory: Theory
    measured: Measured
    first_pos_rate: float
    first_pos_ci: tuple[float, float]
    accept_rate: float
    accept_rate_ci: tuple[float, float]
    pvalue: float
    flagged: bool

    def as_dict(self) -> dict:
        t, m = self.theory, self.measured
        return {
            "config": self.config, "k": self.k, "theory_chains": t.chains,
            "theory_alpha1": round(t.depth[0], 4),
            "theory_accept_rate": round(t.accept_rate, 4),
            "theory_accepted_per_chain": round(t.accepted_per_chain, 3),
            "drafts": m.drafts, "draft_tokens": m.draft_tokens, "accepted_tokens": m.accepted_tokens,
            "accepted_per_pos": list(m.accepted_per_pos),
            "measured_pos1_rate": round(self.first_pos_rate, 4),
            "measured_pos1_ci95": [round(x, 4) for x in self.first_pos_ci],
            "measured_accept_rate": round(self.accept_rate, 4),
            "measured_accept_rate_ci95": [round(x, 4) for x in self.accept_rate_ci],
            "measured_accepted_per_chain": round(m.accepted_tokens / m.drafts, 3) if m.drafts else None,
            "pvalue_under": self.pvalue, "flag_under_accepts": self.flagged,
        }


def audit_row(config: str, theory: Theory, measured: Measured, level: float = 1e-3) -> AuditRow:
    """Compare the measured first-position acceptance (a binomial over chains: ``accepted_per_pos[0]``
    of ``drafts``; without per-position counters, accepted/draft tokens) with theory's mean alpha_1;
    flag when the one-sided binomial p-value is below ``level``. The overall accepted/draft-token
    rate gets a Wilson interval for the table (tokens within a chain are not independent: read it
    as descriptive)."""
    k = len(theory.depth)
    if measured.accepted_per_pos:
        succ, n, p_th = measured.accepted_per_pos[0], measured.drafts, theory.depth[0]
    else:
        succ, n, p_th = measured.accepted_tokens, measured.draft_tokens, theory.accept_rate
    pval = under_acceptance_pvalue(succ, n, p_th)
    rate = measured.accepted_tokens / measured.draft_tokens if measured.draft_tokens else 0.0
    return AuditRow(config, k, theory, measured, succ / n if n else 0.0, wilson_interval(succ, n),
                    rate, wilson_interval(measured.accepted_tokens, measured.draft_tokens),
                    pval, pval < level)


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


@torch.inference_mode()
def warped_along(model, prompt: Sequence[int], output: Sequence[int], warp: Warp) -> torch.Tensor:
    """The model's warped distribution at each generated position, teacher-forced over
    prompt + output: ``[len(output), V]`` (row t predicts output[t])."""
    ids = torch.tensor([list(prompt) + list(output)], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # [T, V]
    return warp.probs(logits).cpu()


def draft_model_chains(p: torch.Tensor, q: torch.Tensor, k: int, greedy_draft: bool = False
                       ) -> list[torch.Tensor]:
    """Chains of a draft model along one output: the engine drafts after each token it emits, so a
    chain starts at every position t >= 1 (position 0 comes from prefill) and its alphas are
    alpha_t..alpha_{t+k-1} teacher-forced along the output (an accepted draft token is the output
    token). ``greedy_draft``: the engine proposes argmax q and verifies it as a point mass (vLLM's
    default ``draft_sample_method="greedy"``), alpha = p~(argmax q~); else alpha = sum min(p~, q~).
    p, q ``[T, V]`` -> one ``[k]`` per start with a full chain ahead."""
    alphas = alpha_point(p, q.argmax(-1)) if greedy_draft else alpha_dists(p, q)  # [T]
    return [alphas[t:t + k] for t in range(1, alphas.shape[0] - k + 1)]


@torch.inference_mode()
def ngram_chains(target, prompt: Sequence[int], output: Sequence[int], warp: Warp, k: int,
                 min_n: int, max_n: int) -> list[torch.Tensor]:
    """Chains of n-gram drafting along one output: at each position t >= 1 the proposal d from
    prompt + output[:t]; its alphas p~(d_i | context, d_<i). One cached forward over prompt +
    output gives them where the proposal follows the output; elsewhere the cache, cropped to the
    context, runs the proposal's first len(d) - 1 tokens."""
    import copy

    from mtad_energy.decoding.cache import crop
    from mtad_energy.hf_cache import cache_kwargs, cache_of

    ids = torch.tensor([list(prompt) + list(output)], device=target.device)
    res = target(input_ids=ids, use_cache=True)
    p_out = warp.probs(res.logits[0, len(prompt) - 1:-1]).cpu()  # [T, V]
    chains = []
    for t in range(1, len(output)):
        d = ngram_propose(list(prompt) + list(output[:t]), min_n, max_n, k)
        if not d:
            continue
        if list(d[:-1]) == list(output[t:t + len(d) - 1]) and t + len(d) - 1 < len(output):
            p = p_out[t:t + len(d)]  # [len(d), V]
        else:
            cache = copy.deepcopy(cache_of(res))
            crop(cache, len(prompt) + t)
            tail = torch.tensor([d[:-1]], device=target.device)
            rest = (warp.probs(target(input_ids=tail, **cache_kwargs(cache)).logits[0]).cpu()
                    if len(d) > 1 else p_out[:0])
            p = torch.cat([p_out[t:t + 1], rest])  # [len(d), V]
        chains.append(alpha_point(p, torch.tensor(d)))
    return chains
