"""The steps of stochastic beam sampling, pure tensor functions (kernels: `runtime.calls`) that
a runner's beam search (`runtime.runner.ModelRunner.beam_search`) runs between its forwards:
`first_scores` / `first_select` after the first forward, `step_scores` / `step_select` after each
later one, and what is read off the finished tree (`best_at`, `closest_beam`, `beam_rows`).

Step 1 samples W distinct tokens from the warped distribution; each later step samples W
(beam, token) pairs without replacement with weights proportional to the *joint* warped
probability of the extended beam (Gumbel-top-k on the joint log-probability). A draw takes its
uniforms (``u``; None: the W largest, beam search): at least as many as the scores it ranks, of
which it uses the first (a compiled step draws for the whole vocabulary up front, an eager one
for the candidates it found: the same law, `candidates`).
"""

from __future__ import annotations

import torch

from mtad_energy.decoding.rules.joint import lineage
from mtad_energy.decoding.rules.sampling import Warp, gumbel_topk_u, log_probs


def candidates(warp: Warp, logits: torch.Tensor, stochastic: bool, least: int = 1
               ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens a beam step draws from, per row of ``logits [R, V]``: ``(tokens [R, C],
    log ~q [R, C])`` holding every token of positive warped probability (`Warp.support`: the
    top-k candidates on the CPU, eagerly), or ``(None, log ~q [R, V])`` for the whole vocabulary.
    Gumbel-top-k over every positive-probability entry draws the same law whether the zeros
    are there or not; so a stochastic beam step draws from the C candidates only (keys for W x k
    joint entries instead of W x V). A deterministic one (beam search) keeps the vocabulary:
    equal weights keep their order. ``least``: fewer candidates than that (a first step of W
    beams from a top-k < W) fall back to the vocabulary, whose zeros fill the dead beams."""
    tokens, q = warp.support(logits) if stochastic else (None, warp.probs(logits))
    if tokens is not None and tokens.shape[-1] < least:
        tokens, q = None, warp.probs(logits)
    return tokens, log_probs(q)


def first_scores(logits: torch.Tensor, width: int, temperature: float, top_k: int, top_p: float,
                 stochastic: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Kernel: a beam search's first step's candidates and their log ~q after the last position
    of ``logits [B, k, V]``: `candidates` (at least W of them)."""
    return candidates(Warp(temperature, top_k, top_p), logits[:, -1], stochastic, width)


def first_select(cand: torch.Tensor | None, log_q: torch.Tensor, u: torch.Tensor | None,
                 width: int) -> tuple[torch.Tensor, ...]:
    """Kernel: W distinct first tokens by Gumbel-top-k (``u`` None: the W largest):
    ``(tok, parent, cum [B, W], seqs, paths [B, W, 1])``."""
    pick = gumbel_topk_u(log_q, width, _first(u, log_q))  # [B, W] distinct tokens
    tok = pick if cand is None else cand.gather(1, pick)
    cum = log_q.gather(1, pick)  # [B, W]
    return tok, torch.zeros_like(tok), cum, tok[..., None], cum[..., None]


def step_scores(logits: torch.Tensor, cum: torch.Tensor, tok: torch.Tensor, temperature: float,
                top_k: int, top_p: float, stochastic: bool, eos_token_id: int | None
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Kernel: a later beam step's candidates ``[B, W, C]`` (or None: the vocabulary) and the
    joint log ~q of every (beam, candidate) ``[B, W*C]``, from the W beams' forward ``logits
    [B*W, 1, V]``, their cumulative log ~q and last tokens ``cum, tok [B, W]``. A beam that
    emitted ``eos_token_id`` is frozen: its one continuation is EOS, at no cost."""
    rows, width = tok.shape
    cand, log_q = candidates(Warp(temperature, top_k, top_p), logits[:, -1], stochastic)
    n_cand = log_q.shape[-1]
    log_q = log_q.view(rows, width, n_cand)
    if cand is not None:
        cand = cand.view(rows, width, n_cand)
    if eos_token_id is not None:
        done = (tok == eos_token_id)[..., None]  # [B, W, 1]
        if cand is None:  # built with a comparison: no host-to-device copy
            frozen = torch.where(torch.arange(n_cand, device=tok.device) == eos_token_id, 0.0,
                                 float("-inf"))  # [V]
            log_q = torch.where(done, frozen.to(log_q.dtype), log_q)
        else:  # a finished beam's one candidate: EOS, at no cost
            only = torch.arange(n_cand, device=tok.device) == 0
            log_q = torch.where(done, torch.where(only, 0.0, float("-inf")), log_q)
            cand = torch.where(done, eos_token_id, cand)
    return cand, (cum[..., None] + log_q).reshape(rows, width * n_cand)


def step_select(cand: torch.Tensor | None, joint: torch.Tensor, u: torch.Tensor | None,
                seqs: torch.Tensor, paths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Kernel: W (beam, token) pairs of ``joint [B, W*C]`` by Gumbel-top-k (``u`` None: the W
    largest), and the beams they extend: ``(tok, parent, cum [B, W], seqs, paths [B, W, d+1],
    rows [B*W])``, rows: the cache rows to keep (`beam_rows` of each parent)."""
    rows, width = seqs.shape[:2]
    n_cand = joint.shape[-1] // width
    idx = gumbel_topk_u(joint, width, _first(u, joint))  # [B, W]
    parent, cum = idx // n_cand, joint.gather(1, idx)
    tok = idx % n_cand if cand is None else cand.reshape(rows, -1).gather(1, idx)
    at = parent[..., None]
    seqs = torch.cat([seqs.gather(1, at.expand(-1, -1, seqs.shape[-1])), tok[..., None]], -1)
    paths = torch.cat([paths.gather(1, at.expand(-1, -1, paths.shape[-1])), cum[..., None]], -1)
    base = torch.arange(rows, device=joint.device)[:, None] * width
    return tok, parent, cum, seqs, paths, (base + parent).reshape(-1)


def best_at(tokens: torch.Tensor, parents: torch.Tensor, log_q: torch.Tensor,
            depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence of a beam tree (`BeamDraft`'s ``tokens, parents, log_q [B, D, W]``), the beam
    a search of ``depth[b]`` steps would end with (the highest joint log-prob among the W beams
    after that step, traced through its ancestors; beam search is sequential, so those are
    exactly the beams it would hold): ``(tokens [B, D], cumulative log ~q [B, D])``, entries
    past depth[b] meaningless. ``depth [B]`` in 1..D. A kernel."""
    width, full = tokens.shape[-1], tokens.shape[-2]
    d = (depth - 1)[:, None, None]  # [B, 1, 1]
    at_d = log_q.gather(1, d.expand(-1, 1, width))[:, 0]  # [B, W]
    w = at_d.argmax(-1)  # [B]: first index on ties, as `best`
    lin = lineage(parents)  # [B, D, W, D]
    path = lin.gather(1, d[..., None].expand(-1, 1, width, full))[:, 0]  # [B, W, D]
    path = path.gather(1, w[:, None, None].expand(-1, 1, full))[:, 0]  # [B, D]: node per depth
    return tokens.gather(2, path[..., None])[..., 0], log_q.gather(2, path[..., None])[..., 0]


def closest_beam(seqs: torch.Tensor, tokens: torch.Tensor, n: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the final beam (of ``seqs [B, W, D]``) sharing the longest prefix with
    ``tokens[b, :n[b]]`` and that prefix's length: ``(beam [B], length [B])``. A kernel."""
    valid = torch.arange(tokens.shape[-1], device=n.device)[None] < n[:, None]  # [B, D]
    lcp = ((seqs == tokens[:, None]) & valid[:, None]).long().cumprod(2).sum(2)  # [B, W]
    row = lcp.argmax(1)  # [B]
    return row, lcp.gather(1, row[:, None])[:, 0]


def beam_rows(beam: torch.Tensor, width: int) -> torch.Tensor:
    """``[B]``: the cache row of sequence b's beam ``beam[b]`` (rows b*W + w)."""
    return torch.arange(beam.shape[0], device=beam.device) * width + beam


def _first(u: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor | None:
    """The first of ``u [R, >= N]`` (iid uniforms) for ``scores [R, N]``: a draw's own."""
    return None if u is None else u[:, :scores.shape[-1]]
