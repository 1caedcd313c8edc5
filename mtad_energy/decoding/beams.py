"""Stochastic beam sampling, shared by ``beam``, ``mtjd`` (over the target) and ``mtad`` / ``mmtad``
(over the draft).

Step 1 samples W distinct tokens from the warped distribution; each later step samples W
(beam, token) pairs without replacement with weights proportional to the *joint* warped
probability of the extended beam (Gumbel-top-k on the joint log-probability).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def _pick(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``x[..., i, :]`` per batch row: x ``[(B,) W, D]``, i ``[(B,)]`` -> ``[(B,) D]``."""
    if i.dim() == 0:
        return take(x, i)
    return x.gather(-2, i[:, None, None].expand(-1, 1, x.shape[-1])).squeeze(-2)


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
    log_q = log_probs(warp.probs(logits))  # [B, V]
    tok = gumbel_topk(log_q, width, generator, stochastic)  # [B, W] distinct tokens
    cum = log_q.gather(1, tok)  # [B, W]
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
        log_q = log_probs(warp.probs(out)).view(rows, width, vocab)
        if eos_token_id is not None:
            done = tok == eos_token_id
            log_q = torch.where(done[..., None], frozen.to(log_q.dtype), log_q)
        joint = (cum[..., None] + log_q).reshape(rows, width * vocab)  # [B, W*V]
        idx = gumbel_topk(joint, width, generator, stochastic)  # [B, W]
        parent, tok, cum = idx // vocab, idx % vocab, joint.gather(1, idx)
        runner.select_rows((base + parent).reshape(-1))
        at = parent[..., None]
        seqs = torch.cat([seqs.gather(1, at.expand(-1, -1, seqs.shape[-1])), tok[..., None]], -1)
        paths = torch.cat([paths.gather(1, at.expand(-1, -1, paths.shape[-1])), cum[..., None]],
                          -1)
        tokens.append(tok), parents.append(parent), cums.append(cum)
    return BeamDraft(torch.stack(tokens, 1), torch.stack(parents, 1), torch.stack(cums, 1), seqs,
                     paths, cum.argmax(-1))
