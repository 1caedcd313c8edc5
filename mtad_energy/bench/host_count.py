"""Host work per decode iteration of a generation, counted (`measure.host_work`) in a pass that
no timed window shares: the runners count their untimed warm-up generation, and the host-work
benchmark (`experiments/host_work.py`) a generation of its own after a warm-up.
"""

from __future__ import annotations

from collections.abc import Sequence

from mtad_energy.decoding.runtime.compiled import CompileOptions
from mtad_energy.decoding.runtime.decoder import Decoder
from mtad_energy.decoding.runtime.generate import generate_rows
from mtad_energy.decoding.runtime.stats import Generation
from mtad_energy.measure.host_work import HostWork, HostWorkCounter
from mtad_energy.models import ModelPair


def warm_up_tokens(max_new_tokens: int, compile: object) -> int:
    """Tokens of a configuration's warm-up generation: full length when compiled (every shape
    the loop uses compiles there, not inside a measured window), a few when eager (first-call
    allocations and kernel selection). Its host work is counted over those iterations."""
    return max_new_tokens if compile else min(8, max_new_tokens)


def counted_generation(decoder: Decoder, pair: ModelPair, prompts: Sequence[list[int]],
                       max_new_tokens: int, seed: int = 0,
                       compile: bool | CompileOptions = False,
                       counter: HostWorkCounter | None = None
                       ) -> tuple[list[Generation], HostWork]:
    """Decode ``prompts`` together (`generate_rows`) with ``counter`` (a fresh
    `HostWorkCounter` by default) counting the decode phase; its work is divided by the
    generation's iterations (the batch's: the most any row ran)."""
    counter = counter if counter is not None else HostWorkCounter()
    gens = generate_rows(decoder, pair, list(prompts), max_new_tokens, seed=seed,
                         compute_perplexity=False, on_phase=counter, compile=compile)
    return gens, counter.result(max(g.stats.iterations for g in gens))
