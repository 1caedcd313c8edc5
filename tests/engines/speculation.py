"""A fake engine that speculates as a serving engine does (a chain at each of its own step
boundaries) over a model pair's warped p~ and q~, with the exact rejection sampler or a broken one:
what the audit (`mtad_energy.engines.audit`, `audit_output`) must tell apart: samplers that accept
wrongly, that emit wrongly after the test (`After`), and engines that lie (emit their drafts, or
inflate their counters). Used by tests/engines/test_audit*.py and experiments/audit_calibration.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.sampling import Warp, residual
from mtad_energy.engines import audit
from mtad_energy.engines import audit_output as ao

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


# (p~ at the k + 1 verified positions [k + 1, V], q~ at the k drafted [k, V], accepted a) -> the
# distribution the engine draws the token after the accepted ones from
After = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def exact_after(ps: torch.Tensor, qs: torch.Tensor, a: int) -> torch.Tensor:
    """The residual at the first rejection, p~ after a full chain (the bonus token)."""
    return residual(ps[a], qs[a]) if a < qs.shape[0] else ps[a]


def bonus_from_previous(ps: torch.Tensor, qs: torch.Tensor, a: int) -> torch.Tensor:
    """A bonus token drawn from the previous position's p~ (an off-by-one in the bonus row)."""
    return residual(ps[a], qs[a]) if a < qs.shape[0] else ps[a - 1]


def resample_from_p(ps: torch.Tensor, qs: torch.Tensor, a: int) -> torch.Tensor:
    """After a rejection, a token from p~ instead of the residual."""
    return ps[a]


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
              accept: Accept, gen: torch.Generator, rule: Draft = SAMPLED,
              after: After = exact_after, lies: bool = False
              ) -> tuple[list[int], list[tuple[int, int]], list[list[int]]]:
    """``n_tokens`` tokens after ``prompt``: the first from p~ (the prefill), then steps of k draft
    tokens (``rule.draw``), verified by ``accept``, the next token from ``after`` (the residual
    at the first rejection, p~ after a full chain). ``lies``: the engine emits the rejected draft
    token too (its drafts) but reports the steps it verified. Returns the output, each step's
    (drafted, accepted), as vLLM's per-request metrics give them, and each step's draft tokens."""
    out = [int(torch.multinomial(_next(target, prompt, warp)[-1], 1, generator=gen))]
    steps, drafted = [], []
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
        last = int(torch.multinomial(after(ps, torch.stack(qs), a), 1, generator=gen))
        out += drafts[:a] + [drafts[a] if lies and a < k else last]
        steps.append((k, a))
        drafted.append(drafts)
    return out[:n_tokens], steps, drafted


counters = ao.counters_of_steps  # the engine-wide counters of its steps


def audit_run(pair, prompts: Sequence[Sequence[int]], n_tokens: int, k: int, warp: Warp,
              accept: Accept, seed: int, rule: Draft = SAMPLED) -> tuple[audit.AuditRow, float]:
    """One fake-engine run over ``prompts`` audited as vLLM's is: the row, and alpha averaged over
    every output position after the first (what the audit compared with before issue 41)."""
    gen = torch.Generator().manual_seed(seed)
    chains, steps_all, along = [], [], []
    for prompt in prompts:
        out, steps, _ = speculate(pair.target, pair.draft, prompt, n_tokens, k, warp, accept, gen,
                                  rule)
        p = audit.warped_along(pair.target, prompt, out, warp)
        q = audit.warped_along(pair.draft, prompt, out, warp)
        chains += rule.chains(p, q, out, steps, k)
        along.append(rule.along(p, q)[1:])
        steps_all += steps
    row = audit.audit_row(f"fake seed {seed}", chains, counters(steps_all, k), k)
    return row, float(torch.cat(along).mean())


def served_run(pair, prompts: Sequence[Sequence[int]], n_tokens: int, k: int, warp: Warp,
               accept: Accept, seed: int, rule: Draft = SAMPLED, after: After = exact_after,
               lies: bool = False, inflates: bool = False, steps_recorded: bool = True,
               drafts_reported: bool = False) -> ao.Verdict:
    """One fake-engine run audited from its outputs (`audit_output.audit_served`): a sampled
    draft's requests with the engine's steps (``steps_recorded``; else counters alone) and, if
    ``drafts_reported``, its draft tokens; a greedy draft's read off the output beside the
    engine's steps. ``inflates``: the engine's counters report one more accepted token per chain
    that had a rejection (its steps and output honest)."""
    gen = torch.Generator().manual_seed(seed)
    served, steps_all = [], []
    for prompt in prompts:
        out, steps, drafts = speculate(pair.target, pair.draft, prompt, n_tokens, k, warp, accept,
                                       gen, rule, after, lies)
        p = audit.warped_along(pair.target, prompt, out, warp)
        q = audit.warped_along(pair.draft, prompt, out, warp)
        steps_all += steps
        if rule is GREEDY:
            served.append(ao.point_mass_served(out, p, audit.greedy_proposer(q, k), steps))
        else:
            served.append(ao.Served(tuple(out), p, q, tuple(steps) if steps_recorded else None,
                                    drafts=tuple(map(tuple, drafts)) if drafts_reported else None))
    told = [(d, min(d, a + 1)) for d, a in steps_all] if inflates else steps_all
    return ao.audit_served(f"fake seed {seed}", served, counters(told, k), k)
