"""The chain rules: acceptance of one or k drafted token chains (SpD's speculative sampling,
prompt lookup, Spectr's k-sequential selection, Medusa's typical acceptance, BiLD's rollback) as
pure tensor functions (no models, no caches). Tree rules: `rules.tree`; the joint-ratio rules of
MTAD and MMTAD: `rules.joint`.

Shapes: gamma draft tokens, vocabulary V. ``p`` is the warped target, ``q`` the warped draft.
"""

from __future__ import annotations

import torch

from mtad_energy.decoding.rules.counted import cpu_only
from mtad_energy.decoding.rules.sampling import residual, sample_shape, sample_u, uniforms


def speculative_accept(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                       generator: torch.Generator | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan/Chen speculative sampling, for one sequence or B rows (leading ``[B]`` dims).

    p: ``[..., gamma+1, V]`` target at each draft position plus the bonus position.
    q: ``[..., gamma, V]`` draft distributions the draft tokens were sampled from.
    draft: ``[..., gamma]`` draft tokens.
    Returns ``(n_accepted, next_token)``, each ``[...]`` (0-d for one sequence): the first n draft
    tokens are accepted and next_token is drawn from the residual at the first rejection, or
    from p[gamma] if none.
    """
    u = uniforms(draft.shape, generator, p.device)
    return speculative_accept_u(p, q, draft, u, uniforms(sample_shape(p[..., 0, :]), generator,
                                                          p.device))


def speculative_accept_u(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u: torch.Tensor,
                         u_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`speculative_accept` with its uniforms given: ``u`` (draft's shape) for the tests,
    ``u_next`` for the next token's draw (`sample_u`'s)."""
    gamma = draft.shape[-1]
    p_x = p[..., :gamma, :].gather(-1, draft[..., None]).squeeze(-1)  # [..., gamma]
    q_x = q.gather(-1, draft[..., None]).squeeze(-1)
    # accept while u * q(x) <= p(x), i.e. u <= min(1, p/q); q(x) > 0 because x was drawn from q
    accepted = (u * q_x <= p_x) & (p_x > 0)
    n = accepted.long().cumprod(-1).sum(-1)  # [...]
    q_pad = torch.cat([q, torch.zeros_like(p[..., :1, :])], -2)  # bonus row: residual == p
    at_n = n[..., None, None].expand(*n.shape, 1, p.shape[-1])
    next_dist = residual(p.gather(-2, at_n).squeeze(-2), q_pad.gather(-2, at_n).squeeze(-2))
    return n, sample_u(next_dist, u_next)


def lookup_accept(p: torch.Tensor, draft: torch.Tensor, lens: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of a *deterministic* draft (q one-hot at each draft token: n-gram /
    prompt lookup), B rows with drafts of their own lengths; lossless w.r.t. p, as
    `speculative_accept`, without building q.

    p: ``[B, gamma+1, V]``; draft: ``[B, gamma]``, row b's draft is ``draft[b, :lens[b]]``
    (``lens [B]``; the rest is padding, never accepted). Accept x_i with prob min(1, p_i(x_i) / 1);
    at the first rejection sample from norm(max(0, p_i - onehot(x_i))) (p without x_i); when all
    lens[b] are accepted, from p after them. Returns ``(n_accepted [B], next_token [B])``.
    """
    u = uniforms(draft.shape, generator, p.device)
    return lookup_accept_u(p, draft, lens, u, uniforms((draft.shape[0], 1), generator, p.device))


def lookup_accept_u(p: torch.Tensor, draft: torch.Tensor, lens: torch.Tensor, u: torch.Tensor,
                    u_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`lookup_accept` with its uniforms given: ``u [B, gamma]`` for the tests, ``u_next [B, 1]``
    for the next token's draw."""
    gamma = draft.shape[-1]
    p_x = p[:, :gamma].gather(-1, draft[..., None])[..., 0]  # [B, gamma]
    real = torch.arange(gamma, device=p.device) < lens[:, None]
    n = ((u <= p_x) & (p_x > 0) & real).long().cumprod(-1).sum(-1)  # [B]
    p_n = p.gather(1, n[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]  # [B, V]
    x_n = torch.cat([draft, draft[:, :1]], 1).gather(1, n[:, None])[:, 0]  # [B]
    q_n = torch.nn.functional.one_hot(x_n, p.shape[-1]).to(p.dtype) * (n < lens)[:, None]
    return n, sample_u(residual(p_n, q_n), u_next)


# --- Spectr: k-sequential selection (Sun et al. 2023) ---------------------------------------------


def spectr_beta(p: torch.Tensor, q: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """beta(rho) = sum_x min(q(x), p(x)/rho): p, q ``[..., V]``, rho ``[...]`` -> ``[...]``."""
    return torch.minimum(q, p / rho[..., None]).sum(-1)


def spectr_rho(p: torch.Tensor, q: torch.Tensor, k: int | torch.Tensor, iters: int = 24,
               support: int = 0) -> torch.Tensor:
    """The rho in [1, k] solving 1 - (1 - beta(rho))^k = rho * beta(rho), by bisection.

    p, q: ``[..., V]``; k: int or ``[...]`` (number of drafts). Returns rho ``[...]``.
    f(rho) = 1 - (1-beta)^k - rho*beta is non-increasing (beta falls, rho*beta = sum min(rho q, p)
    rises), f(1) >= 0 and f(k) <= 0 (Bernoulli), so bisection keeps the root bracketed. 24 halvings
    of [1, k] reach float32 resolution. k = 1 gives rho = 1 exactly (the interval is empty).
    ``support > 0``: only tokens where q > 0 count in beta, so on the CPU, when no row of q has
    more than ``support`` nonzeros (e.g. 2 * top_k after a top-k warp), sum over q's ``support``
    most likely tokens. A row with more (top-k keeps every token tied at the cut, common with
    bf16 logits) uses the whole vocabulary, so rho stays exact. On a GPU the whole vocabulary is
    always used: it costs little there, and checking would read a value back to the host.
    """
    if (0 < support < q.shape[-1] and q.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and cpu_only(lambda: int((q > 0).sum(-1).max())) <= support):
        idx = q.topk(support, -1).indices
        p, q = p.gather(-1, idx), q.gather(-1, idx)
    k = torch.as_tensor(k, dtype=p.dtype, device=p.device).expand(p.shape[:-1])
    lo, hi = torch.ones_like(k), k.clone()
    for _ in range(iters):
        mid = (lo + hi) / 2
        beta = spectr_beta(p, q, mid)
        # 1 - (1-beta)^k without cancellation for small beta
        f = -torch.expm1(k * torch.log1p(-beta.clamp(max=1.0))) - mid * beta
        below = f > 0  # root lies above mid
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return (lo + hi) / 2


def spectr_residual(p: torch.Tensor, q: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """Distribution to sample when all k drafts are rejected: ``[..., V]``.

    docs/design.md section 3's [p - min(q, p/rho) * (1-(1-beta)^k)/beta] / (1-beta)^k. At the root
    (1-(1-beta)^k)/beta = rho, so the numerator is max(0, p - rho*q) and the denominator its mass;
    we normalise that form, which stays a valid distribution at any bisection tolerance.
    """
    return residual(p, rho[..., None] * q)


def spectr_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                  generator: torch.Generator | None = None, support: int = 0,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-draft k-sequential selection over k i.i.d. draft sequences, lossless w.r.t. p; for
    one sequence or B sequences at once (a leading ``[B]`` on every argument and result).

    p: ``[k, gamma+1, V]`` target along each draft (plus the bonus position).
    q: ``[k, gamma, V]`` draft distributions the drafts were sampled from.
    drafts: ``[k, gamma]``.
    At position t, over the drafts consistent with the emitted prefix (k' of them; given that
    prefix their tokens at t are i.i.d. ~q), accept draft i's token x with prob
    min(1, p(x) / (rho_k' q(x))) in index order; the first acceptance emits x and the drafts with x
    there stay consistent. If none is accepted, sample ``spectr_residual`` and stop. If a draft
    survives all gamma positions, sample the bonus token from p.
    The consistent set at t is fixed by the drafts alone (drafts sharing the accepted draft's first
    t tokens), so every rho and coin is computed up front in one batch; only a gamma-step walk of
    small tensor ops remains, with no host sync.
    Returns 0-d ``(n_accepted, next_token, row)``: the first n tokens of ``drafts[row]`` are
    accepted (``[B]`` each for B sequences). ``support``: see ``spectr_rho``. B sequences draw
    their coins in one ``rand [B, k, gamma]`` and their next tokens in one `sample`: for B = 1
    the same draws as one sequence.
    """
    if drafts.dim() == 2:  # one sequence: a batch of one
        n, nxt, row = spectr_accept(p[None], q[None], drafts[None], generator, support)
        return n[0], nxt[0], row[0]
    u = uniforms(drafts.shape, generator, p.device)
    return spectr_accept_u(p, q, drafts, u, uniforms((drafts.shape[0], 1), generator, p.device),
                           support)


def spectr_accept_u(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
                    u_next: torch.Tensor, support: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`spectr_accept` of B sequences with its uniforms given (a kernel): ``u [B, k, gamma]``,
    one per draft token, and ``u_next [B, 1]`` for the next token."""
    rows, k, gamma = drafts.shape
    # same[b, r, j, t]: drafts r and j agree on their first t tokens, t = 0..gamma
    eq = (drafts[:, :, None, :] == drafts[:, None, :, :]).long()  # [B, k, k, gamma]
    same = torch.cat([torch.ones_like(eq[..., :1]), eq.cumprod(-1)], -1).bool()  # [.., gamma+1]
    k_alive = same[..., :gamma].sum(2)  # [B, k, gamma]: consistent drafts at t if r is
    rho = spectr_rho(p[:, :, :gamma], q, k_alive, support=support)  # [B, k, gamma]
    p_x = p[:, :, :gamma].gather(-1, drafts[..., None])[..., 0]  # [B, k, gamma]
    q_x = q.gather(-1, drafts[..., None])[..., 0]
    ok = (u * rho * q_x <= p_x) & (p_x > 0)  # [B, k, gamma] each draft's coin at each position
    going = torch.ones(rows, dtype=torch.bool, device=p.device)  # every position so far accepted
    n = torch.zeros(rows, dtype=torch.long, device=p.device)
    row = torch.zeros(rows, dtype=torch.long, device=p.device)  # the last accepted draft
    for t in range(gamma):
        at_row = row[:, None, None].expand(-1, 1, k)
        cand = same[..., t].gather(1, at_row)[:, 0] & ok[..., t]  # [B, k] consistent, accepted
        hit = going & cand.any(-1)
        row = torch.where(hit, cand.long().argmax(-1), row)  # argmax: first in order
        n = n + hit.long()
        going = hit
    # next token at (row, n): residual after a rejection; q = 0 at the bonus position gives p
    at = (row * (gamma + 1) + n)[:, None]  # [B, 1] flat index into [k, gamma+1]
    q_pad = torch.cat([q, torch.zeros_like(p[:, :, :1])], 2)
    rho_pad = torch.cat([rho, torch.ones_like(rho[..., :1])], 2)
    vocab = p.shape[-1]
    at_v = at[..., None].expand(-1, 1, vocab)
    next_dist = spectr_residual(p.reshape(rows, -1, vocab).gather(1, at_v)[:, 0],
                                q_pad.reshape(rows, -1, vocab).gather(1, at_v)[:, 0],
                                rho_pad.reshape(rows, -1).gather(1, at)[:, 0])
    return n, sample_u(next_dist, u_next), row


# --- Medusa's typical acceptance and BiLD's rollback ---------------------------------------------

def typical_accept_length(p: torch.Tensor, draft: torch.Tensor, eps: float,
                          delta: float) -> torch.Tensor:
    """Longest prefix of ``draft [..., gamma]`` with p(x_i) > min(eps, delta * exp(-H(p_i))) at
    every i.

    p: ``[..., gamma, V]`` the distribution the test uses (typical.py: temperature-scaled,
    untruncated). Returns a long tensor ``[...]`` (0-d for one draft).
    """
    entropy = -torch.special.xlogy(p, p).sum(-1)  # [..., gamma]; 0 log 0 = 0
    threshold = torch.clamp(delta * torch.exp(-entropy), max=eps)
    p_x = p.gather(-1, draft[..., None]).squeeze(-1)
    return (p_x > threshold).long().cumprod(-1).sum(-1)


def rollback_length(nll: torch.Tensor, threshold: float) -> torch.Tensor:
    """BiLD: draft tokens kept before the first rollback, ``nll [..., m]`` = -log p(x_i) ->
    ``[...]`` long (0-d for one draft).

    A position rolls back when -log p(x) > threshold; everything from there on is discarded.
    """
    return (nll <= threshold).long().cumprod(-1).sum(-1)
