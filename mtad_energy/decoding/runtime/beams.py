"""Stochastic beam sampling over a runner's model, shared by ``beam``, ``mtjd`` (over the target)
and ``mtad`` / ``mmtad`` (over the draft): `beam_sample_rows` runs the runner's beam search
(`ModelRunner.beam_search`: eagerly step by step, or on the compiled path one graph call for a
full-length draft) and returns the tree as a `BeamDraft`. The steps' rule (Gumbel-top-k on the
joint warped log-probability) is `rules.beam`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mtad_energy.decoding.rules.beam import beam_rows, best_at, closest_beam
from mtad_energy.decoding.rules.sampling import Warp, take
from mtad_energy.decoding.runtime.calls import EagerCalls
from mtad_energy.decoding.runtime.runner import ModelRunner


@dataclass(frozen=True)
class BeamDraft:
    """The beam tree and the final beams. D = depth, W = width; B sequences (`beam_sample_rows`:
    a leading ``[B]`` on every field) or one (`beam_sample`: no batch dim).

    ``tokens[d, b]`` / ``parents[d, b]`` / ``log_q[d, b]`` describe node (d, b): its token, the index
    of its parent at depth d-1, and its cumulative warped log-probability. Dead nodes (fewer than
    W candidates with positive probability) have ``log_q == -inf``.
    ``seqs[b]`` / ``path_log_q[b]`` are final beam b's tokens and cumulative log-probs per depth.
    ``finished``: what the search's ``finish`` function returned (`beam_sample_rows`): a search
    with one hands back only that (the tree's fields None; ``depth``: D).
    """

    tokens: torch.Tensor | None  # [(B,) D, W]
    parents: torch.Tensor | None  # [(B,) D, W]
    log_q: torch.Tensor | None  # [(B,) D, W]
    seqs: torch.Tensor | None  # [(B,) W, D]
    path_log_q: torch.Tensor | None  # [(B,) W, D]
    finished: tuple = ()
    depth: int = 0  # D

    @property
    def best(self) -> torch.Tensor:  # [(B,)]
        """The final beam with the highest joint log-prob (the first on ties)."""
        return self.log_q[..., -1, :].argmax(-1)

    @property
    def best_seq(self) -> torch.Tensor:  # [(B,) D]
        return _pick(self.seqs, self.best)

    @property
    def best_path_log_q(self) -> torch.Tensor:  # [(B,) D]
        return _pick(self.path_log_q, self.best)

    def best_at(self, depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rules.beam.best_at` of this tree (B sequences)."""
        return best_at(self.tokens, self.parents, self.log_q, depth)

    def keep_closest(self, runner: ModelRunner, tokens: torch.Tensor, n: torch.Tensor
                     ) -> torch.Tensor:
        """Keep, per sequence, the final beam sharing the longest prefix with ``tokens[b, :n[b]]``
        (``tokens [B, D]``, the emitted draft) in the runner's rows, and return that common
        prefix's length ``[B]``: the draft cache is valid up to the sequence plus that many."""
        row, lcp = closest_beam(self.seqs, tokens, n)
        self.keep(runner, row)
        return lcp

    def keep(self, runner: ModelRunner, beam: torch.Tensor) -> None:
        """Shrink the runner's W rows per sequence back to final beam ``beam [(B,)]``."""
        self.keep_rows(runner, beam_rows(beam.reshape(-1), self.tokens.shape[-1]))

    def keep_rows(self, runner: ModelRunner, rows: torch.Tensor) -> None:
        """`keep` of the beams in cache rows ``rows [B]`` (`rules.beam.beam_rows`: a verify's
        kernel gives them)."""
        if self.depth > 1:  # depth 1 never expanded the cache
            runner.select_rows(rows)

    def squeeze(self) -> BeamDraft:
        """The one sequence of a batch of 1, without the batch dim."""
        return BeamDraft(*(x[0] for x in (self.tokens, self.parents, self.log_q, self.seqs,
                                          self.path_log_q)),
                         tuple(x[0] for x in self.finished), self.depth)


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
                     eos_token_id: int | None = None, counts: list[int] | None = None,
                     calls: EagerCalls | None = None,
                     finish: Callable[..., tuple] | None = None, finish_args: tuple[Any, ...] = ()
                     ) -> BeamDraft:
    """Run ``depth`` beam steps of ``runner``'s model for B sequences after feeding ``first_ids
    [B, k]`` (row b's last counts[b] tokens real, see `DecodeState.draft_feed`); the steps'
    arithmetic runs as ``calls`` (`DecodeState.calls`; default eager), their uniforms drawn
    from ``generator``. ``finish(tokens, parents, log_q, seqs, path_log_q, *finish_args)``: a
    kernel reading the finished tree (MTAD's `mtad.mtad_finish`), run with the search (in its
    graph, compiled); its outputs are `BeamDraft.finished`, and the search hands back nothing
    else (the tree's fields None).

    The runner's B-row cache is expanded to W rows per sequence (row b*W + w); on return row
    b*W + w holds sequence b's prefix plus the first depth-1 tokens of its final beam w (the last
    token is not fed). Beams that emitted ``eos_token_id`` are frozen: they repeat EOS at no cost.
    """
    out = runner.beam_search(calls or EagerCalls(), first_ids, counts, depth, width,
                             (*warp.args, stochastic), generator, eos_token_id, finish,
                             *finish_args)
    if finish is not None:
        return BeamDraft(None, None, None, None, None, tuple(out), depth)
    return BeamDraft(*out, depth=depth)
