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
    """The beam tree and the final beams. D = depth, W = width.

    ``tokens[d, b]`` / ``parents[d, b]`` / ``log_q[d, b]`` describe node (d, b): its token, the index
    of its parent at depth d-1, and its cumulative warped log-probability. Dead nodes (fewer than
    W candidates with positive probability) have ``log_q == -inf``.
    ``seqs[b]`` / ``path_log_q[b]`` are final beam b's tokens and cumulative log-probs per depth.
    """

    tokens: torch.Tensor  # [D, W]
    parents: torch.Tensor  # [D, W]
    log_q: torch.Tensor  # [D, W]
    seqs: torch.Tensor  # [W, D]
    path_log_q: torch.Tensor  # [W, D]
    best: torch.Tensor  # 0-d: index of the final beam with the highest joint log-prob

    @property
    def best_seq(self) -> torch.Tensor:  # [D]
        return take(self.seqs, self.best)

    @property
    def best_path_log_q(self) -> torch.Tensor:  # [D]
        return take(self.path_log_q, self.best)

    def keep(self, runner: ModelRunner, beam: torch.Tensor) -> None:
        """Shrink the runner's W-row cache back to final beam ``beam`` (0-d)."""
        if self.tokens.shape[0] > 1:  # depth 1 never expanded the cache
            runner.select_rows(beam[None])


def beam_sample(runner: ModelRunner, first_ids: torch.Tensor, depth: int, width: int, warp: Warp,
                generator: torch.Generator, stochastic: bool = True,
                eos_token_id: int | None = None) -> BeamDraft:
    """Run ``depth`` beam steps of ``runner``'s model after feeding ``first_ids [1, k]``.

    The runner's batch-1 cache is expanded to W rows; on return row b holds the prefix plus the
    first depth-1 tokens of final beam b (the last token is not fed). Beams that emitted
    ``eos_token_id`` are frozen: they repeat EOS at no cost.
    """
    logits = runner(first_ids)[:, -1]  # [1, V]
    vocab = logits.shape[-1]
    log_q = log_probs(warp.probs(logits))[0]  # [V]
    tok = gumbel_topk(log_q, width, generator, stochastic)  # [W] distinct tokens
    cum = log_q[tok]  # [W]
    parent = torch.zeros_like(tok)
    tokens, parents, cums = [tok], [parent], [cum]
    seqs, paths = tok[:, None], cum[:, None]
    if depth > 1:
        runner.repeat_rows(width)
    if eos_token_id is not None:  # a finished beam can only repeat EOS, at no cost
        # built with a comparison, not `frozen[eos] = 0.0`: no host-to-device copy per call
        frozen = torch.where(torch.arange(vocab, device=logits.device) == eos_token_id, 0.0,
                             float("-inf"))  # [V]
    for _ in range(1, depth):
        log_q = log_probs(warp.probs(runner(tok[:, None])[:, -1]))  # [W, V]
        if eos_token_id is not None:
            done = tok == eos_token_id
            log_q = torch.where(done[:, None], frozen.to(log_q.dtype), log_q)
        joint = (cum[:, None] + log_q).reshape(-1)  # [W*V]
        idx = gumbel_topk(joint, width, generator, stochastic)
        parent, tok, cum = idx // vocab, idx % vocab, joint[idx]
        runner.select_rows(parent)
        seqs = torch.cat([seqs[parent], tok[:, None]], 1)
        paths = torch.cat([paths[parent], cum[:, None]], 1)
        tokens.append(tok), parents.append(parent), cums.append(cum)
    return BeamDraft(torch.stack(tokens), torch.stack(parents), torch.stack(cums), seqs, paths,
                     cum.argmax())
