"""Decoder contract, per-generation state and the model runner.

A decoder turns the state of one sequence into the next block of tokens; the generate loop in
``generate.py`` owns everything else (prefill, EOS, max_new_tokens, cache rollback, stats).

Cache invariant between iterations (gpt-fast style): the target cache holds every token except the
last one, which is fed at the start of the next iteration together with the draft tokens, so the
bonus token never needs a forward of its own. The draft cache holds a prefix of the sequence.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from mtad_energy.decoding import cache as kv
from mtad_energy.decoding.sampling import Warp, sample


def param(default: Any, help: str) -> Any:
    """A decoder parameter with its one-line help (shown by ``mtad-energy decoders``)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class DecoderParams:
    """Parameters every decoder has: the warp applied to p (and q)."""

    temperature: float = param(1.0, "softmax temperature; 0 = greedy")
    top_k: int = param(10, "keep the k most likely tokens (0 = all)")
    top_p: float = param(0.9, "nucleus: drop a token once the mass before it exceeds top_p")

    def __post_init__(self) -> None:
        self.warp  # noqa: B018 - validates the warp fields
        self.validate()

    def validate(self) -> None:
        """Subclasses raise ValueError naming the parameter and its valid range."""

    @property
    def warp(self) -> Warp:
        return Warp(self.temperature, self.top_k, self.top_p)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class StepResult:
    """What one decoder iteration produced."""

    tokens: torch.Tensor  # [m] tokens to append, m >= 1
    proposed: int = 0  # draft tokens shown to the target
    accepted: int = 0  # of those, accepted


class PhaseTimer:
    """Accumulates wall time per phase; synchronises the device at both ends so GPU work is
    attributed to the phase that launched it."""

    def __init__(self, device: torch.device):
        self._sync: Callable[[], None] = (
            (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None))
        self.time_s: dict[str, float] = {"draft": 0.0, "target": 0.0}

    def sync(self) -> None:
        self._sync()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.time_s[phase] = self.time_s.get(phase, 0.0) + time.perf_counter() - t0


class ModelRunner:
    """One model with its KV cache; counts and times forwards."""

    def __init__(self, model, timer: PhaseTimer, phase: str):
        self.model = model
        self.cache = kv.new_cache(model)
        self.forwards = 0
        self._timer = timer
        self._phase = phase

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """input_ids ``[B, k]`` -> float32 logits ``[B, k, V]``; appends k positions to the cache."""
        self.forwards += 1
        with self._timer(self._phase):
            out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True,
                             **kwargs)
        return out.logits.float()

    def __len__(self) -> int:
        return kv.cache_len(self.cache)

    def crop(self, length: int) -> None:
        kv.crop(self.cache, length)

    def select_rows(self, rows: torch.Tensor) -> None:
        kv.select_rows(self.cache, rows)

    def repeat_rows(self, n: int) -> None:
        kv.repeat_rows(self.cache, n)


@dataclass
class DecodeState:
    """One sequence being decoded. ``ids[:n]`` are the tokens so far (prompt included)."""

    ids: torch.Tensor  # [capacity] on the model device
    n: int
    prompt_len: int
    max_new_tokens: int
    target: ModelRunner
    draft: ModelRunner | None
    generator: torch.Generator
    eos_token_id: int | None = None

    @property
    def remaining(self) -> int:
        return self.prompt_len + self.max_new_tokens - self.n

    @property
    def last_token(self) -> torch.Tensor:
        """``[1, 1]``: the one token the target cache has not seen."""
        return self.ids[self.n - 1:self.n].unsqueeze(0)

    def draft_pending(self) -> torch.Tensor:
        """``[1, k]``, k >= 1: the tokens the draft cache has not seen."""
        return self.ids[len(self.draft):self.n].unsqueeze(0)

    def append(self, tokens: torch.Tensor) -> None:
        m = tokens.shape[0]
        self.ids[self.n:self.n + m] = tokens
        self.n += m


def target_step(s: DecodeState, warp: Warp) -> StepResult:
    """One token sampled from warped p after the sequence: ``ar``'s step, and what a drafting
    decoder does when only one token is left (drafting would be wasted)."""
    return StepResult(sample(warp.probs(s.target(s.last_token)[0, -1]), s.generator)[None])


class Decoder:
    """Base class of every decoder: a name, a frozen params dataclass, and ``step``."""

    name: ClassVar[str]
    help: ClassVar[str]
    Params: ClassVar[type[DecoderParams]] = DecoderParams
    needs_draft: ClassVar[bool] = False

    def __init__(self, params: DecoderParams | None = None):
        self.params = params if params is not None else self.Params()

    @property
    def lookahead(self) -> int:
        """Positions beyond the emitted ones the target may see in one iteration."""
        return 0

    def draft_len(self, s: DecodeState) -> int:
        """Draft positions worth proposing this iteration: the lookahead, capped one short of the
        tokens still wanted (the bonus token from p fills the last). 0: take a `target_step`."""
        return max(0, min(self.lookahead, s.remaining - 1))

    def step(self, s: DecodeState) -> StepResult:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {"decoder": self.name, **dataclasses.asdict(self.params)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"
