"""Prompt lookup decoding (Saxena 2023; n-gram drafting as in Hugging Face's
``prompt_lookup_num_tokens`` and vLLM's ``ngram`` proposer): no draft model.

The draft is the continuation of the most recent earlier occurrence of the sequence's last n
tokens (prompt and output so far), n from ``max_ngram`` down to ``min_ngram``, at most ``gamma``
tokens; no occurrence, no draft (the iteration is one target forward, as ``ar``). The target
verifies the draft in one forward with speculative sampling where q is one-hot at each draft token
(`rules.chain.lookup_accept`): lossless w.r.t. warped p, and greedy-exact.

Per row: each row looks up its own sequence and drafts its own length (capped by what it can
still emit); a batch verifies the longest, shorter drafts padded and never accepted.

The lookup runs on the host over the loop's mirror of the tokens (`DecodeState.tokens`): no
device read-back, no draft forward; the verify's input (each row's last token, then its draft)
is copied from there in one copy. Its time is bookkeeping ("other"); ``draft_forwards`` is 0.
Stats: ``proposed`` = ``draft_depth`` = the row's draft length (0 without a match).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mtad_energy.decoding.rules.chain import lookup_accept_u
from mtad_energy.decoding.rules.sampling import split_uniforms, warp_probs
from mtad_energy.decoding.runtime.decoder import Decoder, target_step
from mtad_energy.decoding.runtime.params import DecoderParams, param, require
from mtad_energy.decoding.runtime.state import DecodeState, to_device
from mtad_energy.decoding.runtime.step import StepResult, block_out, block_tokens


@dataclass(frozen=True)
class PldParams(DecoderParams):
    gamma: int = param(10, "draft tokens at most per iteration (the continuation copied)")
    max_ngram: int = param(3, "longest suffix n-gram looked up")
    min_ngram: int = param(1, "shortest suffix n-gram looked up")

    def validate(self) -> None:
        require(self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}")
        require(self.min_ngram >= 1, f"min_ngram must be >= 1, got {self.min_ngram}")
        require(self.max_ngram >= self.min_ngram,
                f"max_ngram must be >= min_ngram ({self.min_ngram}), got {self.max_ngram}")


def ngram_draft(tokens: Sequence[int], max_ngram: int, min_ngram: int, limit: int) -> list[int]:
    """The continuation (at most ``limit`` tokens) of the most recent earlier occurrence of the
    last n tokens of ``tokens``, trying n = max_ngram down to min_ngram; [] when none occurs.

    "Earlier": the occurrence starts before the suffix itself and leaves at least one token
    after it (it may overlap the suffix, e.g. a repeated token); the continuation stops at the
    end of the sequence."""
    total = len(tokens)
    if limit <= 0 or total < 2:
        return []
    arr = np.asarray(tokens)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        # windows starting at 0 .. total-1-n: each ends before the last token, so continues
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[total - n:]).all(1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + limit].tolist()
    return []


class PromptLookup(Decoder):
    name = "pld"
    help = ("prompt lookup: draft the continuation of the last n-gram's latest earlier "
            "occurrence, speculative sampling with one-hot q (no draft model)")
    Params = PldParams
    batched = True
    drafts_without_model = True

    @property
    def lookahead(self) -> int:
        return self.params.gamma

    def step(self, s: DecodeState) -> StepResult:
        prm = self.params
        drafts = [ngram_draft(s.tokens[b], prm.max_ngram, prm.min_ngram, cap)
                  for b, cap in enumerate(self.draft_lens(s))]
        lens = [len(d) for d in drafts]
        gamma = max(lens)
        if gamma == 0:  # no row found an occurrence: one target step
            return target_step(s, prm.warp)
        # [B, 1 + gamma]: each row's last token (the host mirror has it), then its draft padded
        chain = to_device([t for b, d in enumerate(drafts)
                           for t in [s.tokens[b][-1], *d] + [0] * (gamma - len(d))],
                          s.device).view(s.batch, 1 + gamma)
        # logits [B, gamma+1, V] -> the block (compiled: the verify and its rule one graph call)
        recent, read = s.target.verify(
            s.calls, chain, pld_verify, chain, s.on_device(lens),
            s.uniforms((s.batch, gamma), (s.batch, 1)), s.recent, *prm.warp.args)
        return StepResult.from_read(read, recent, ("accepted", "length"), proposed=lens,
                                    depth=lens)


def pld_verify(logits: torch.Tensor, chain: torch.Tensor, lens: torch.Tensor, u: torch.Tensor,
               recent: torch.Tensor, temperature: float, top_k: int, top_p: float
               ) -> tuple[torch.Tensor, ...]:
    """Kernel: warped p of the verify (``logits [B, gamma+1, V]`` of ``chain [B, 1 + gamma]``:
    the last token, then the drafts), speculative sampling of the one-hot drafts of lengths
    ``lens [B]`` (`lookup_accept_u`; ``u``: its uniforms ``[B, gamma]`` then ``[B, 1]``, flat),
    and the block: ``(tokens [B, gamma+1], accepted [B], length [B], recent, read)``
    (`block_out`: the rows' last tokens after it, so the ids on the device are not written)."""
    draft = chain[:, 1:]  # [B, gamma]
    p = warp_probs(logits, temperature, top_k, top_p)
    n, nxt = lookup_accept_u(p, draft, lens, *split_uniforms(u, draft.shape, (draft.shape[0], 1)))
    tokens, length = block_tokens(draft, n, nxt)
    return (tokens, n, length, *block_out(tokens, length, recent, n, length))
