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
from mtad_energy.decoding.sampling import Warp
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
