"""`Decoder`: the base class every decoder in ``decoders/`` derives from (a name, a frozen
params dataclass and ``step``), and `target_step`, the plain one-token step from p.

A decoder turns the state of one sequence into the next block of tokens; the generate loop in
``generate.py`` owns everything else (prefill, EOS, max_new_tokens, cache rollback, stats).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from mtad_energy.decoding.rules.sampling import Warp, sample_u, warp_probs
from mtad_energy.decoding.runtime.params import DecoderParams
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import StepResult


def next_token(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_k: int,
               top_p: float) -> torch.Tensor:
    """``[B, 1]``: one token per row from warped p at the last position of ``logits [B, k, V]``
    (uniforms ``u [B, 1]``): a kernel."""
    return sample_u(warp_probs(logits[:, -1], temperature, top_k, top_p), u)[:, None]


def next_token_after(logits: torch.Tensor, u: torch.Tensor, recent: torch.Tensor | None,
                     temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, ...]:
    """Kernel: `next_token`, and each row's last T tokens after it (``recent [B, T]``: before
    it, `DecodeState.recent`): ``(token [B, 1], recent [B, T])``; ``recent`` None (T = 1,
    ``ar``'s: the token is the rows' last tokens): ``(token,)``, one output fewer to clone on a
    GPU host."""
    token = next_token(logits, u, temperature, top_k, top_p)
    return (token,) if recent is None else (token, torch.cat([recent[:, 1:], token], 1))


def draft_next(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_k: int,
               top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel: warped q at the last position of ``logits [B, k, V]`` and a token drawn from it
    with uniforms ``u [B, 1]``: ``(token [B, 1], q [B, V])``."""
    q = warp_probs(logits[:, -1], temperature, top_k, top_p)
    return sample_u(q, u)[:, None], q


def draft_token(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_k: int,
                top_p: float) -> tuple[torch.Tensor]:
    """Kernel: `draft_next` without q, for a rule that does not read it: ``(token [B, 1],)``."""
    return draft_next(logits, u, temperature, top_k, top_p)[:1]


def draft_chain(s: DecodeState, pending: torch.Tensor, gamma: int, warp: Warp,
                counts: list[int] | None = None, q: bool = True) -> tuple[torch.Tensor, ...]:
    """The chain step spd and typical share: sample gamma tokens per row autoregressively from
    warped q after feeding ``pending [B, k]`` (row b's last counts[b] tokens real, see
    `DecodeState.draft_feed`) to the draft: ``(draft [B, gamma], q [B, gamma, V])``, or
    ``(draft,)`` without ``q`` (a rule that does not read it: the chain hands back, and a GPU
    host clones, one tensor). The chain's uniforms are drawn at once; compiled, the chain is one
    graph call (`ModelRunner.chain`)."""
    return s.draft.chain(s.calls, pending, counts, draft_next if q else draft_token,
                         s.uniform(gamma, s.batch, 1), *warp.args)


def target_step(s: DecodeState, warp: Warp) -> StepResult:
    """One token per row sampled from warped p after the sequence: ``ar``'s step, and what a
    drafting decoder does when only one token is left (drafting would be wasted)."""
    # logits [B, 1, V] -> [B, 1] (compiled: the forward and the draw one graph call)
    # T = 1: the token is the rows' last token (and the same tensor as `last_token` after
    # it, which a compiled call must not get twice: dynamo would recompile for the alias)
    recent = s.recent if s.recent_width > 1 else None
    out = s.target.then(s.calls, s.last_token, next_token_after, s.uniform(s.batch, 1),
                        recent, *warp.args)  # (token [B, 1], recent [B, T]) or (token,)
    return StepResult(out[0], recent=out[-1])


class Decoder:
    """Base class of every decoder: a name, a frozen params dataclass, and ``step``."""

    name: ClassVar[str]
    help: ClassVar[str]
    Params: ClassVar[type[DecoderParams]] = DecoderParams
    needs_draft: ClassVar[bool] = False
    # drafts without the pair's draft model (prompt lookup, heads): a loaded draft is ignored
    drafts_without_model: ClassVar[bool] = False
    # the kind of draft head it runs on the target's hidden states ("eagle", "medusa"): the
    # pair's ``heads[head]``, run as its draft model (its forwards count as draft forwards)
    head: ClassVar[str | None] = None
    # whether `step` handles a DecodeState of B > 1 rows (batched generation)
    batched: ClassVar[bool] = False

    def __init__(self, params: DecoderParams | None = None):
        self.params = params if params is not None else self.Params()

    @property
    def lookahead(self) -> int:
        """Positions beyond the emitted ones the target may see in one iteration."""
        return 0

    @property
    def verify_width(self) -> int:
        """Tokens of the widest forward an iteration runs (a chain's verify; trees override)."""
        return self.lookahead + 1

    def lookahead_for(self, max_new_tokens: int) -> int:
        """The lookahead a generation of ``max_new_tokens`` can use: `draft_len` caps every
        iteration's draft one short of the tokens still wanted (``gamma=1000000`` with 8 new
        tokens drafts at most 7)."""
        return min(self.lookahead, max(0, max_new_tokens - 1))

    def warm_forwards(self, role: str, pair) -> tuple[tuple, ...]:
        """Forwards of ``role``'s model ("target" / "draft") whose shapes are known before the
        generation but met only inside its loop, as `static.WarmForward` fields ``(columns, m,
        features, per_seq, rows_per_seq)`` (a cache-free head's: its calls,
        `head_runner.HeadCall`): a compiled runner compiles them when it is made, before any
        window opens (chains of the widths every drafting decoder meets sometimes are
        compiled for all: `generate._runners`). Here what every decoder's loop may run: the
        target's one-token step (`target_step`: ``ar``'s every step, a drafting decoder's
        last), and a beam search's steps over ``role``'s model (one token at each of its
        `cache_rows` beams per sequence; its first step, before the rows expand, is a chain)."""
        beams = self.cache_rows(role)
        return (((1,),) if role == "target" else ()) + (
            ((1, None, None, False, beams),) if beams > 1 else ())

    def cache_rows(self, role: str) -> int:
        """Cache rows one sequence expands to at most in ``role``'s model ("target" / "draft"):
        the beam width of a beam search over that model; 1 otherwise."""
        return 1

    def draft_len(self, s: DecodeState) -> int:
        """Draft positions worth proposing this iteration: the lookahead, capped one short of the
        tokens still wanted (the bonus token from p fills the last) by the row that wants the
        most. 0: take a `target_step`."""
        return max(0, min(self.lookahead, s.remaining - 1))

    def draft_lens(self, s: DecodeState) -> list[int]:
        """`draft_len` per row, as each row would draft alone: capped by what the row itself
        still wants; 0 for a row that is done. A batch drafts ``max(draft_lens)``; a lossy
        rule must not accept past a row's own length, and statistics count it per row."""
        return [max(0, min(self.lookahead, s.row_remaining(b) - 1)) if s.active[b] else 0
                for b in range(s.batch)]

    def draft_model(self, pair) -> Any:
        """What the draft runner runs: the pair's draft model (``needs_draft``), its head of kind
        ``head``, or None (no draft runner)."""
        if self.head is not None:
            return pair.heads.get(self.head)
        return pair.draft if self.needs_draft else None

    def target_hidden(self, pair) -> tuple[int, ...]:
        """Hidden states every target forward must return (`ModelRunner` indices)."""
        return ()

    def draft_hidden(self) -> tuple[int, ...]:
        """Hidden states every draft forward must return (a head's output feature)."""
        return ()

    def prefill(self, s: DecodeState) -> None:
        """Called once after the loop's prefill of the target (and a draft model), inside the
        prefill phase: a head decoder primes its head from the target's hidden states."""

    def step(self, s: DecodeState) -> StepResult:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {"decoder": self.name, **dataclasses.asdict(self.params)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"
