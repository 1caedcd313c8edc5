"""Decoder contract, per-generation state and the model runner.

A decoder turns the state of one sequence into the next block of tokens; the generate loop in
``generate.py`` owns everything else (prefill, EOS, max_new_tokens, cache rollback, stats).

Cache invariant between iterations (gpt-fast style): the target cache holds every token except the
last one, which is fed at the start of the next iteration together with the draft tokens, so the
bonus token never needs a forward of its own. The draft cache holds a prefix of the sequence.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
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
        for f in dataclasses.fields(self):  # NaN passes every comparison the range checks make
            value = getattr(self, f.name)
            require(not (isinstance(value, float) and math.isnan(value)),
                    f"{f.name} must be a number, got nan")
        require(math.isfinite(self.temperature),
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
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
    """What one decoder iteration produced.

    A decoder whose block length depends on sampled values (how many draft tokens were accepted)
    does not read that length back itself: it returns a padded ``tokens`` buffer with a 0-d
    device tensor ``length`` (and may give ``accepted`` as a 0-d device tensor too), and the
    generate loop reads both back together with the tokens, in its one host sync per iteration.
    """

    tokens: torch.Tensor  # [m] tokens to append, m >= 1 (or a padded buffer, see `length`)
    proposed: int = 0  # draft tokens shown to the target (every tree node, k*gamma for Spectr)
    accepted: int | torch.Tensor = 0  # of those, accepted (an int, or a 0-d device tensor)
    length: torch.Tensor | None = None  # 0-d device tensor: only tokens[:length] are emitted
    # 0-d device tensor: the draft cache is valid only up to this many positions (the loop crops
    # it there, after the read-back), for drafts whose kept row diverges from the emitted path
    draft_cache_len: torch.Tensor | None = None
    depth: int = 0  # draft tokens on one path that could have been accepted (the drafted depth)

    @classmethod
    def block(cls, draft: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor, proposed: int,
              draft_cache_len: torch.Tensor | None = None) -> StepResult:
        """``draft[:n]`` followed by ``nxt``, with ``n`` (0-d) left on the device: the buffer is
        ``draft`` with ``nxt`` written at index n, ``[len(draft) + 1]``, of which n + 1 count."""
        buf = torch.cat([draft, nxt.view(1)]).scatter(0, n.view(1), nxt.view(1))
        return cls(buf, proposed, n, n + 1, draft_cache_len, depth=draft.shape[0])


class PhaseTimer:
    """Time per phase ("draft", "target") of the forwards a generation runs.

    ``with timer(phase):`` times a block; ``time_s`` maps phase -> seconds so far; ``sync()`` waits
    for the device (the generate loop calls it only at the prefill / decode boundaries, where energy
    windows need it). Nested phases never double count: the inner block's time goes to the inner
    phase only, the outer phase gets the rest.

    ``PhaseTimer(device)`` (or ``PhaseTimer.for_device(device)``) picks the implementation:
    `CpuPhaseTimer` (``perf_counter``, no synchronisation) or, on CUDA, `CudaPhaseTimer`, which
    records CUDA events around each block instead of synchronising (DESIGN.md section 7) and reads
    them in `flush` - call that right after a host read-back, when the events are complete.
    """

    def __new__(cls, device: torch.device | str | None = None):
        if cls is PhaseTimer:
            cls = CudaPhaseTimer if torch.device(device or "cpu").type == "cuda" else CpuPhaseTimer
        return super().__new__(cls)

    @classmethod
    def for_device(cls, device: torch.device | str) -> PhaseTimer:
        return PhaseTimer(device)

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device or "cpu")
        self._time_s: dict[str, float] = {"draft": 0.0, "target": 0.0}
        self._stack: list[str] = []

    @property
    def time_s(self) -> dict[str, float]:
        """Seconds per phase so far (on CUDA this reads the pending events, waiting if needed)."""
        self.flush()
        return self._time_s

    def sync(self) -> None:
        """Wait for the device to finish the queued work (a no-op on CPU)."""

    def flush(self) -> None:
        """Fold pending measurements into ``time_s`` (a no-op on CPU)."""

    def _open(self, phase: str) -> None:
        raise NotImplementedError

    def _close(self, phase: str) -> None:
        raise NotImplementedError

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self._stack:
            self._close(self._stack[-1])
        self._stack.append(phase)
        self._open(phase)
        try:
            yield
        finally:
            self._close(phase)
            self._stack.pop()
            if self._stack:
                self._open(self._stack[-1])


class CpuPhaseTimer(PhaseTimer):
    """Host wall time (``perf_counter``) per phase; touches no device API."""

    def __init__(self, device: torch.device | str | None = None):
        super().__init__(device)
        self._t0 = 0.0

    def _open(self, phase: str) -> None:
        self._t0 = time.perf_counter()

    def _close(self, phase: str) -> None:
        self._time_s[phase] = self._time_s.get(phase, 0.0) + time.perf_counter() - self._t0


class CudaPhaseTimer(PhaseTimer):
    """GPU time per phase from a pair of CUDA events recorded on the current stream around each
    block: no host synchronisation while timing. Events wait in a list until `flush`, which reads
    them (``Event.elapsed_time``) and returns them to a pool for reuse. `flush` right after a
    read-back of the same stream costs no stall; otherwise it waits for the last pending event."""

    def __init__(self, device: torch.device | str | None = None):
        super().__init__(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._pool: list[torch.cuda.Event] = []
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | None = None

    def _event(self) -> torch.cuda.Event:
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _open(self, phase: str) -> None:
        self._start = self._event()

    def _close(self, phase: str) -> None:
        assert self._start is not None
        self._pending.append((phase, self._start, self._event()))
        self._start = None

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)
        self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        for _, _, end in self._pending:
            if not end.query():  # not yet complete: only when flushed before a read-back
                end.synchronize()
        for phase, start, end in self._pending:
            self._time_s[phase] = self._time_s.get(phase, 0.0) + start.elapsed_time(end) / 1e3
            self._pool += (start, end)
        self._pending.clear()


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
