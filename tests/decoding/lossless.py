"""Statistical check that a decoder's output follows the warped target distribution exactly.

Enumerate every n-token continuation of a fixed prompt under the warped target (exact), sample the
decoder many times with fixed seeds (so the test is deterministic, never flaky), and run a
chi-square goodness-of-fit test.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch
from scipy.stats import chisquare

import mtad_energy as me
from mtad_energy.decoding.rules.sampling import Warp
from mtad_energy.models import ModelPair

PROMPT = [1, 2]


@torch.inference_mode()
def exact_joint(pair: ModelPair, warp: Warp, prompt=PROMPT, n_tokens: int = 2) -> dict[tuple, float]:
    """P(x_1..x_n | prompt) under warped p, for every sequence with positive probability."""
    vocab = pair.target.config.vocab_size
    out: dict[tuple, float] = {}
    for seq in itertools.product(range(vocab), repeat=n_tokens):
        ids = torch.tensor([list(prompt) + list(seq)])
        logits = pair.target(input_ids=ids).logits[0, len(prompt) - 1:-1]
        probs = warp.probs(logits)[torch.arange(n_tokens), torch.tensor(seq)]
        prob = float(probs.prod())
        if prob > 0:
            out[seq] = prob
    return out


def sample_counts(decoder, pair: ModelPair, n_samples: int, prompt=PROMPT, n_tokens: int = 2,
                  seed0: int = 0) -> Counter:
    counts: Counter = Counter()
    for s in range(n_samples):
        g = me.generate(decoder, pair, list(prompt), max_new_tokens=n_tokens, seed=seed0 + s,
                        compute_perplexity=False)
        counts[tuple(g.token_ids)] += 1
    return counts


def chi_square_pvalue(counts: Counter, probs: dict[tuple, float]) -> float:
    """Goodness of fit; a sample outside the support gives p-value 0."""
    if set(counts) - set(probs):
        return 0.0
    n = sum(counts.values())
    keys = sorted(probs, key=probs.get, reverse=True)
    # pool the rare cells so every expected count is >= 5 (chi-square validity)
    obs, exp, o_acc, e_acc = [], [], 0, 0.0
    for k in keys:
        o_acc += counts.get(k, 0)
        e_acc += probs[k] * n
        if e_acc >= 5:
            obs.append(o_acc), exp.append(e_acc)
            o_acc, e_acc = 0, 0.0
    if e_acc and exp:
        obs[-1] += o_acc
        exp[-1] += e_acc
    total = sum(exp)
    return float(chisquare(obs, [e * sum(obs) / total for e in exp]).pvalue)


ROW_PROMPTS = [[1, 0], [3, 1, 0, 2], [0]]  # batched rows of different lengths


def batched_row_pvalues(pair: ModelPair, decoder, module, broken: bool, **kwargs) -> list[float]:
    """Per row of `ROW_PROMPTS` decoded together (3 tokens, fixed seeds: 600, or 300 when
    ``broken``): the chi-square p-value of its continuations against its own warped p, with
    ``module.residual`` replaced by p when ``broken``. kwargs go to `generate_rows`."""
    from unittest import mock

    from mtad_energy.decoding.runtime.generate import generate_rows

    exact = [exact_joint(pair, Warp(), p, n_tokens=3) for p in ROW_PROMPTS]
    counts = [Counter() for _ in ROW_PROMPTS]
    with mock.patch.object(module, "residual", (lambda p, q: p) if broken else module.residual):
        for seed in range(300 if broken else 600):
            for c, g in zip(counts, generate_rows(decoder, pair, ROW_PROMPTS, 3, seed=seed,
                                                  compute_perplexity=False, **kwargs),
                            strict=True):
                c[tuple(g.token_ids)] += 1
    return [chi_square_pvalue(c, e) for c, e in zip(counts, exact, strict=True)]


def two_sample_pvalue(a: Counter, b: Counter, min_count: int = 10) -> float:
    """Chi-square test that two samples of sequences come from one distribution (homogeneity);
    cells seen fewer than ``min_count`` times in both samples together are pooled."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b), key=lambda k: a[k] + b[k], reverse=True)
    table, rare = [], [0, 0]
    for k in keys:
        if a[k] + b[k] >= min_count:
            table.append([a[k], b[k]])
        else:
            rare[0] += a[k]
            rare[1] += b[k]
    if sum(rare) >= min_count or not table:
        table.append(rare)
    elif table:
        table[-1] = [table[-1][0] + rare[0], table[-1][1] + rare[1]]
    return float(chi2_contingency(table).pvalue) if len(table) > 1 else 1.0
