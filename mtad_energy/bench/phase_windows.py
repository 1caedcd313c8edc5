"""One measured generation and what its windows give its stored row: `measure_generation` (any
engine's generation of B rows inside `PhaseWindows`, a "prefill" and a "decode" window opened at
the engine's phase hooks, with what other processes took meanwhile, under the peak-memory
reading), the row's energy columns from those two windows (`energy_columns`), and what compiling
cost it (`compile_columns`, `FLAG_COMPILED_IN_WINDOW`). The profile runner (`runner`) and the
decoding batch-size sweep (`decode_batch`) both measure and store rows through them, whichever
engine generates (the project's decoders are the engine ``hf``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mtad_energy.measure import EnergyMeter, Measurement, peak_memory
from mtad_energy.measure.contention import Contention, ContentionProbe, row_contention

if TYPE_CHECKING:  # the rows' generations and who makes them
    from mtad_energy.config import DecoderSpec
    from mtad_energy.decoding.runtime.stats import Generation
    from mtad_energy.engines import Engine

# a compiled run that still compiled a shape inside its measurement windows: its time excludes
# the compilation (`compile_in_window_s`), its joules do not
FLAG_COMPILED_IN_WINDOW = "compiled_in_window"


def compile_columns(warm: Sequence[Generation], gens: Sequence[Generation]) -> dict[str, Any]:
    """What compiling cost a stored row (one generation of B rows: every row gets its batch's
    figures, as it gets its batch's decode time): ``compile_s`` the seconds compiling before and
    inside its windows (the warm-up that ran for it, when its shapes were new, plus its own
    generation's), ``graphs_compiled`` the graphs compiled then, ``compile_in_window_s`` the part
    inside its windows (the row is flagged `FLAG_COMPILED_IN_WINDOW`). Eager: 0, 0, 0."""
    stats = [g.stats for g in (*warm[:1], *gens[:1])]  # rows of one call share these figures
    return {"compile_s": sum(s.compile_s for s in stats),
            "graphs_compiled": sum(s.graphs_compiled for s in stats),
            "compile_in_window_s": max(g.stats.compile_in_window_s for g in gens)}


class PhaseWindows:
    """Opens a "prefill" and a "decode" window at the generate loop's phase hooks; closes whatever
    is still open in `close()` (called from a finally), so an exception never leaks a window.
    With a ``probe``, each window also records what other processes took meanwhile
    (``contention``: `measure.contention`), the probe opened outside the meter's window;
    ``own``: the processes doing the generation's work besides this one (an engine's,
    `Engine.processes`), which the probe counts as this process, not as others."""

    def __init__(self, meter: EnergyMeter, key: str, probe: ContentionProbe | None = None,
                 own: Sequence[int] = ()):
        self.meter, self.key, self.probe, self.own = meter, key, probe, tuple(own)
        self.open: str | None = None
        self.measurements: dict[str, Measurement] = {}
        self.contention: dict[str, Contention | None] = {}

    def __call__(self, phase: str) -> None:
        if self.open is not None:
            self._end()
        if phase in ("prefill", "decode"):
            if self.probe is not None:
                self.probe.begin(f"{self.key}/{phase}", self.own)
            self.meter.begin_window(f"{self.key}/{phase}")
            self.open = phase

    def _end(self) -> None:
        name, self.open = f"{self.key}/{self.open}", self.open
        self.measurements[self.open] = self.meter.end_window(name)
        if self.probe is not None:
            self.contention[self.open] = self.probe.end(name)
        self.open = None

    def close(self) -> None:
        if self.open is not None:
            self._end()

    def contention_columns(self, phases: Sequence[str] = ("prefill", "decode")) -> dict[str, Any]:
        """The row's contention columns over ``phases`` (`row_contention`)."""
        return row_contention(self.contention.get(p) for p in phases)



def energy_columns(windows: dict[str, Measurement]) -> dict[str, Any]:
    """A row's energy columns from its "prefill" and "decode" windows (`PhaseWindows.measurements`):
    each phase's joules, their total (None unless both were measured, with the first reason
    recorded) and the flags of both."""
    pre, dec = windows.get("prefill"), windows.get("decode")
    flags = sorted({f.code for m in (pre, dec) if m for f in m.flags})
    reasons = [m.reason for m in (pre, dec) if m and m.reason]
    total = None
    if pre and dec and pre.energy_j is not None and dec.energy_j is not None:
        total = pre.energy_j + dec.energy_j
    return {
        "prefill_energy_j": pre.energy_j if pre else None,
        "decode_energy_j": dec.energy_j if dec else None,
        "energy_j": total,
        "energy_reason": reasons[0] if total is None and reasons else None,
        "energy_flags": json.dumps(flags),
    }


@dataclass
class Measured:
    """One measured generation of B rows: its generations, its windows (``measurements`` per
    phase, contention), the peak memory of the device meanwhile and what compiling cost it
    (`compile_columns`)."""

    generations: list[Generation]
    windows: PhaseWindows
    peak_memory_bytes: int | None
    compiling: dict[str, Any]

    @property
    def compiled_in_window(self) -> bool:
        return self.compiling["compile_in_window_s"] > 0


def measure_generation(engine: Engine, spec: DecoderSpec, prompts: Sequence[list[int]],
                       max_new_tokens: int, seed: int, meter: EnergyMeter, key: str,
                       probe: ContentionProbe | None = None,
                       warm: Sequence[Generation] = ()) -> Measured:
    """``engine`` decodes ``prompts`` together inside one pair of windows named by ``key`` (its
    processes counted as the measurement's own, `Engine.processes`), under the peak-memory
    reading; ``warm``: the warm-up generations that ran for these shapes (their compile cost goes
    to this row). The windows close in a finally: an exception never leaks one."""
    windows = PhaseWindows(meter, key, probe, engine.processes(spec))
    with peak_memory(engine.device) as peak:
        try:
            gens = engine.generate(spec, prompts, max_new_tokens, seed, windows)
        finally:
            windows.close()
    unseen = engine.unmetered()  # a server on another host: no local reading is its energy
    if unseen:
        windows.measurements = {k: dataclasses.replace(m, energy_j=None, device_energy_j={},
                                                       samples=(), reason=unseen)
                                for k, m in windows.measurements.items()}
    return Measured(gens, windows, peak.bytes, compile_columns(warm, gens))
