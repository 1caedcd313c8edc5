"""Stochastic beam sampling, shared by ``beam``, ``mtjd`` (over the target) and ``mtad`` / ``mmtad``
(over the draft).

Step 1 samples W distinct tokens from the warped distribution; each later step samples W
(beam, token) pairs without replacement with weights proportional to the *joint* warped
probability of the extended beam (Gumbel-top-k on the joint log-probability).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtad_energy.decoding.base import ModelRunner
from mtad_energy.decoding.sampling import Warp, gumbel_topk, log_probs, take


@dataclass(frozen=True)
class BeamDraft:
    """The beam tree and the final beams. D = depth, W = width; B sequences (`beam_sample_rows`:
    a leading ``[B]`` on every field) or one (`beam_sample`: no batch dim).

    ``tokens[d, b]`` / ``parents[d, b]`` / ``log_q[d, b]`` describe node (d, b): its token, the index
    of its parent at depth d-1, and its cumulative warped log-probability. Dead nodes (fewer than
    W candidates with positive probability) have ``log_q == -inf``.
    ``seqs[b]`` / ``path_log_q[b]`` are final beam b's tokens and cumulative log-probs per depth.
    """

    tokens: torch.Tensor  # [(B,) D, W]
    parents: torch.Tensor  # [(B,) D, W]
    log_q: torch.Tensor  # [(B,) D, W]
    seqs: torch.Tensor  # [(B,) W, D]
    path_log_q: torch.Tensor  # [(B,) W, D]
    best: torch.Tensor  # [(B,)]: index of the final beam with the highest joint log-prob

    @property
    def best_seq(self) -> torch.Tensor:  # [(B,) D]
        return _pick(self.seqs, self.best)

    @property
    def best_path_log_q(self) -> torch.Tensor:  # [(B,) D]
        return _pick(self.path_log_q, self.best)

    def best_at(self, depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence, the beam a search of ``depth[b]`` steps would end with (the highest
        joint log-prob among the W beams after that step, traced through its ancestors; beam
        search is sequential, so those are exactly the beams it would hold):
        ``(tokens [B, D], cumulative log ~q [B, D])``, entries past depth[b] meaningless.
        ``depth [B]`` in 1..D; all D gives `best_seq` and `best_path_log_q`."""
        width, full = self.tokens.shape[-1], self.tokens.shape[-2]
        d = (depth - 1)[:, None, None]  # [B, 1, 1]
        at_d = self.log_q.gather(1, d.expand(-1, 1, width))[:, 0]  # [B, W]
        w = at_d.argmax(-1)  # [B]: first index on ties, as `best`
        lin = lineage(self.parents)  # [B, D, W, D]
        path = lin.gather(1, d[..., None].expand(-1, 1, width, full))[:, 0]  # [B, W, D]
        path = path.gather(1, w[:, None, None].expand(-1, 1, full))[:, 0]  # [B, D]: node per depth
        return (self.tokens.gather(2, path[..., None])[..., 0],
                self.log_q.gather(2, path[..., None])[..., 0])

    def keep_closest(self, runner: ModelRunner, tokens: torch.Tensor, n: torch.Tensor
                     ) -> torch.Tensor:
        """Keep, per sequence, the final beam sharing the longest prefix with ``tokens[b, :n[b]]``
        (``tokens [B, D]``, the emitted draft) in the runner's rows, and return that common
        prefix's length ``[B]``: the draft cache is valid up to the sequence plus that many."""
        valid = torch.arange(tokens.shape[-1], device=n.device)[None] < n[:, None]  # [B, D]
        lcp = ((self.seqs == tokens[:, None]) & valid[:, None]).long().cumprod(2).sum(2)  # [B, W]
        row = lcp.argmax(1)  # [B]
        self.keep(runner, row)
        return lcp.gather(1, row[:, None])[:, 0]

    def keep(self, runner: ModelRunner, beam: torch.Tensor) -> None:
        """Shrink the runner's W rows per sequence back to final beam ``beam [(B,)]``."""
        if self.tokens.shape[-2] > 1:  # depth 1 never expanded the cache
            beam = beam.reshape(-1)  # [B]
            width = self.tokens.shape[-1]
            runner.select_rows(torch.arange(beam.shape[0], device=beam.device) * width + beam)

    def squeeze(self) -> BeamDraft:
        """The one sequence of a batch of 1, without the batch dim."""
        return BeamDraft(*(x[0] for x in (self.tokens, self.parents, self.log_q, self.seqs,
                                          self.path_log_q, self.best)))


def lineage(parents: torch.Tensor) -> torch.Tensor:
    """``lin [(B,) D, W, D]``: ``lin[..., d, b, e]`` = index at depth e of the ancestor of node
    (d, b) (itself at e = d); entries with e > d are 0 and meaningless. parents: ``[(B,) D, W]``."""
    depth, width = parents.shape[-2:]
    own = torch.arange(width, device=parents.device).expand(parents.shape[:-2] + (width,))
    own = own[..., None]  # [(B,) W, 1]
    lin = [own]
    for d in range(1, depth):  # D tiny gathers; no host sync
        prev, par = lin[-1], parents[..., d, :, None]  # [(B,) W, d], [(B,) W, 1]
        lin.append(torch.cat([prev.gather(-2, par.expand(par.shape[:-1] + prev.shape[-1:])),
                              own], -1))
    return torch.stack([F.pad(x, (0, depth - x.shape[-1])) for x in lin], -3)


def _pick(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``x[..., i, :]`` per batch row: x ``[(B,) W, D]``, i ``[(B,)]`` -> ``[(B,) D]``."""
    if i.dim() == 0:
        return take(x, i)
    return x.gather(-2, i[:, None, None].expand(-1, 1, x.shape[-1])).squeeze(-2)


def candidates(warp: Warp, logits: torch.Tensor, stochastic: bool, least: int = 1
               ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens a beam step draws from, per row of ``logits [R, V]``: ``(tokens [R, C],
    log ~q [R, C])`` holding every token of positive warped probability (`Warp.support`: the
    top-k candidates on the CPU), or ``(None, log ~q [R, V])`` for the whole vocabulary.
    Gumbel-top-k over every positive-probability entry draws the same law whether the zeros
    are there or not; so a stochastic beam step draws from the C candidates only (keys for W x k
    joint entries instead of W x V). A deterministic one (beam search) keeps the vocabulary:
    equal weights keep their order. ``least``: fewer candidates than that (a first step of W
    beams from a top-k < W) fall back to the vocabulary, whose zeros fill the dead beams."""
    tokens, q = warp.support(logits) if stochastic else (None, warp.probs(logits))
    if tokens is not None and tokens.shape[-1] < least:
        tokens, q = None, warp.probs(logits)
    return tokens, log_probs(q)


def beam_sample(runner: ModelRunner, first_ids: torch.Tensor, depth: int, width: int, warp: Warp,
                generator: torch.Generator, stochastic: bool = True,
                eos_token_id: int | None = None) -> BeamDraft:
    """`beam_sample_rows` for one sequence (``first_ids [1, k]``): fields without a batch dim."""
    return beam_sample_rows(runner, first_ids, depth, width, warp, generator, stochastic,
                            eos_token_id).squeeze()


def beam_sample_rows(runner: ModelRunner, first_ids: torch.Tensor, depth: int, width: int,
                     warp: Warp, generator: torch.Generator, stochastic: bool = True,
                     eos_token_id: int | None = None, counts: list[int] | None = None
                     ) -> BeamDraft:
    """Run ``depth`` beam steps of ``runner``'s model for B sequences after feeding ``first_ids
    [B, k]`` (row b's last counts[b] tokens real, see `DecodeState.draft_feed`).

    The runner's B-row cache is expanded to W rows per sequence (row b*W + w); on return row
    b*W + w holds sequence b's prefix plus the first depth-1 tokens of its final beam w (the last
    token is not fed). Beams that emitted ``eos_token_id`` are frozen: they repeat EOS at no cost.
    """
    logits = runner(first_ids, counts)[:, -1]  # [B, V]
    rows, vocab = logits.shape
    cand, log_q = candidates(warp, logits, stochastic, width)  # [B, C]
    pick = gumbel_topk(log_q, width, generator, stochastic)  # [B, W] distinct tokens
    tok = pick if cand is None else cand.gather(1, pick)
    cum = log_q.gather(1, pick)  # [B, W]
    parent = torch.zeros_like(tok)
    tokens, parents, cums = [tok], [parent], [cum]
    seqs, paths = tok[..., None], cum[..., None]  # [B, W, 1]
    if depth > 1:
        runner.repeat_rows(width)
    if eos_token_id is not None:  # a finished beam can only repeat EOS, at no cost
        # built with a comparison, not `frozen[eos] = 0.0`: no host-to-device copy per call
        frozen = torch.where(torch.arange(vocab, device=logits.device) == eos_token_id, 0.0,
                             float("-inf"))  # [V]
    base = torch.arange(rows, device=logits.device)[:, None] * width  # [B, 1]
    for _ in range(1, depth):
        out = runner(tok.reshape(rows * width, 1))[:, -1]  # [B*W, V]
        cand, log_q = candidates(warp, out, stochastic)  # [B*W, C]
        n_cand = log_q.shape[-1]
        log_q = log_q.view(rows, width, n_cand)
        if eos_token_id is not None:
            done = (tok == eos_token_id)[..., None]  # [B, W, 1]
            if cand is None:
                log_q = torch.where(done, frozen.to(log_q.dtype), log_q)
            else:  # a finished beam's one candidate: EOS, at no cost
                only = torch.arange(n_cand, device=out.device) == 0
                log_q = torch.where(done, torch.where(only, 0.0, float("-inf")), log_q)
                cand = torch.where(done, eos_token_id, cand.view(rows, width, n_cand))
        joint = (cum[..., None] + log_q).reshape(rows, width * n_cand)  # [B, W*C]
        idx = gumbel_topk(joint, width, generator, stochastic)  # [B, W]
        parent, cum = idx // n_cand, joint.gather(1, idx)
        tok = idx % n_cand if cand is None else cand.reshape(rows, -1).gather(1, idx)
        runner.select_rows((base + parent).reshape(-1))
        at = parent[..., None]
        seqs = torch.cat([seqs.gather(1, at.expand(-1, -1, seqs.shape[-1])), tok[..., None]], -1)
        paths = torch.cat([paths.gather(1, at.expand(-1, -1, paths.shape[-1])), cum[..., None]],
                          -1)
        tokens.append(tok), parents.append(parent), cums.append(cum)
    return BeamDraft(torch.stack(tokens, 1), torch.stack(parents, 1), torch.stack(cums, 1), seqs,
                     paths, cum.argmax(-1))
