"""`PhaseTimer`: time per phase ("draft", "target") of a generation's forwards, on the CPU
(wall clock) or CUDA (events, read without stalling)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Time per phase ("draft", "target") of the forwards a generation runs.

    ``with timer(phase):`` times a block; ``time_s`` maps phase -> seconds so far; ``sync()`` waits
    for the device (the generate loop calls it only at the prefill / decode boundaries, where energy
    windows need it). Nested phases never double count: the inner block's time goes to the inner
    phase only, the outer phase gets the rest.

    ``PhaseTimer(device)`` (or ``PhaseTimer.for_device(device)``) picks the implementation:
    `CpuPhaseTimer` (``perf_counter``, no synchronisation) or, on CUDA, `CudaPhaseTimer`, which
    records CUDA events around each block instead of synchronising (docs/design.md section 7) and reads
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
