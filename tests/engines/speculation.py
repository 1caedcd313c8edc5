"""A fake engine that speculates as a serving engine does (a chain at each of its own step
boundaries) over a model pair's warped p~ and q~, with the exact rejection sampler or a broken one:
what the audit (`mtad_energy.engines.audit`) must tell apart. Used by tests/engines/test_audit.py
and experiments/audit_calibration.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.sampling import Warp, residual
from mtad_energy.engines import audit

# (u, p~(x), q~(x), depth) -> whether the engine accepts draft token x
Accept = Callable[[float, float, float, int], bool]


def exact(u: float, p_x: float, q_x: float, depth: int) -> bool:
    """Speculative sampling: accept with probability min(1, p~(x) / q~(x))."""
    return u * q_x <= p_x


def half(u: float, p_x: float, q_x: float, depth: int) -> bool:
    """An engine that accepts with half the right probability."""
    return u <= min(1.0, p_x / q_x) / 2


def skips_odd(u: float, p_x: float, q_x: float, depth: int) -> bool:
    """An engine that skips every other position's test (accepts it unseen)."""
    return depth % 2 == 1 or exact(u, p_x, q_x, depth)


@dataclass(frozen=True)
class Draft:
    """How the draft proposes (``draw``: the token and the q~ it is verified against) and how the
    audit rebuilds its chains (``chains``) and alpha at every position (``along``)."""

    draw: Callable[[torch.Tensor, torch.Generator], tuple[int, torch.Tensor]]
    chains: Callable[[torch.Tensor, torch.Tensor, list[int], list[tuple[int, int]], int],
                     list[audit.Chain]]
    along: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _one_hot(d: int, like: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(d), like.shape[-1]).to(like.dtype)


# a token sampled from q~; chains at the engine's recorded steps
SAMPLED = Draft(lambda q, gen: (int(torch.multinomial(q, 1, generator=gen)), q),
                lambda p, q, out, steps, k: audit.stepped_chains(audit.alpha_dists(p, q), steps),
                audit.alpha_dists)
# argmax q~, a point mass (vLLM's default greedy draft model); chains read off the output alone
GREEDY = Draft(lambda q, gen: (int(q.argmax()), _one_hot(int(q.argmax()), q)),
               lambda p, q, out, steps, k: audit.point_mass_chains(p, out,
                                                                   audit.greedy_proposer(q, k)),
               lambda p, q: audit.alpha_point(p, q.argmax(-1)))


@torch.inference_mode()
def _next(model, ids: Sequence[int], warp: Warp) -> torch.Tensor:
    """The warped next-token distribution after every prefix of ``ids``: ``[len(ids), V]``."""
    return warp.probs(model(input_ids=torch.tensor([list(ids)])).logits[0]).float()


def speculate(target, draft, prompt: Sequence[int], n_tokens: int, k: int, warp: Warp,
              accept: Accept, gen: torch.Generator, rule: Draft = SAMPLED
              ) -> tuple[list[int], list[tuple[int, int]]]:
    """``n_tokens`` tokens after ``prompt``: the first from p~ (the prefill), then steps of k draft
    tokens (``rule.draw``), verified by ``accept``, the next token from the residual at the first
    rejection (p~ after a full chain). Returns the output and each step's (drafted, accepted), as
    vLLM's per-request metrics give them."""
    out = [int(torch.multinomial(_next(target, prompt, warp)[-1], 1, generator=gen))]
    steps = []
    while len(out) < n_tokens:
        ctx, drafts, qs = list(prompt) + out, [], []
        for _ in range(k):
            d, q = rule.draw(_next(draft, ctx + drafts, warp)[-1], gen)
            drafts.append(d)
            qs.append(q)
        ps = _next(target, ctx + drafts, warp)[len(ctx) - 1:]  # [k + 1, V]
        a = 0
        while a < k and accept(float(torch.rand((), generator=gen)), float(ps[a, drafts[a]]),
                               float(qs[a][drafts[a]]), a):
            a += 1
        dist = residual(ps[a], qs[a]) if a < k else ps[k]
        out += drafts[:a] + [int(torch.multinomial(dist, 1, generator=gen))]
        steps.append((k, a))
    return out[:n_tokens], steps


def counters(steps: Sequence[tuple[int, int]], k: int) -> audit.Measured:
    """The engine-wide counters of these steps (vLLM's spec_decode_num_* and per position)."""
    drafted = [(d, a) for d, a in steps if d]
    return audit.Measured(len(drafted), sum(d for d, _ in drafted), sum(a for _, a in drafted),
                          tuple(sum(1 for _, a in drafted if a > j) for j in range(k)))


def audit_run(pair, prompts: Sequence[Sequence[int]], n_tokens: int, k: int, warp: Warp,
              accept: Accept, seed: int, rule: Draft = SAMPLED) -> tuple[audit.AuditRow, float]:
    """One fake-engine run over ``prompts`` audited as vLLM's is: the row, and alpha averaged over
    every output position after the first (what the audit compared with before issue 41)."""
    gen = torch.Generator().manual_seed(seed)
    chains, steps_all, along = [], [], []
    for prompt in prompts:
        out, steps = speculate(pair.target, pair.draft, prompt, n_tokens, k, warp, accept, gen,
                               rule)
        p = audit.warped_along(pair.target, prompt, out, warp)
        q = audit.warped_along(pair.draft, prompt, out, warp)
        chains += rule.chains(p, q, out, steps, k)
        along.append(rule.along(p, q)[1:])
        steps_all += steps
    row = audit.audit_row(f"fake seed {seed}", chains, counters(steps_all, k), k)
    return row, float(torch.cat(along).mean())
