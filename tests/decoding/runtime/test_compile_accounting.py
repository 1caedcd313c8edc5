"""Where compiling happens and what it costs: never inside a window a generation is timed or
measured in (every compiled decoder's first generation included: each declares the shapes its
loop meets, `Decoder.warm_forwards`, and they compile before the windows open; nor after
`static.reset_compiled`), and counted once and whole: a call's ``compile_s`` (the runners' warm-up
before the prefill, the shapes first met in the loop, the kernels and fused calls compiled after
it), a stored row's (its warm-up's once plus its own, `bench.phase_windows.compile_columns`), a
summary's (a batch counted once, `results.analysis.compile_cost`).

Traced with ``aot_eager`` (the graph inductor sees, without code generation).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from unittest import mock

import pandas as pd
import pytest

from mtad_energy.bench.phase_windows import compile_columns
from mtad_energy.decoding.registry import DECODERS, get_decoder
from mtad_energy.decoding.runtime.compiled import CompiledCalls, CompileOptions, graphs_compiled
from mtad_energy.decoding.runtime.generate import generate_rows
from mtad_energy.decoding.runtime.static import StaticRunner, reset_compiled
from mtad_energy.results.analysis import compile_cost
from tests.conftest import with_heads
from tests.tiny import compile_test_decoder

TRACE = CompileOptions(backend="aot_eager")
PROMPTS = [[5, 9, 11, 3, 7, 21, 2], [4, 8], [30, 31, 32, 33, 34]]
SLOW = {"eagle", "mcss", "mmtad", "specinfer", "spectr"}  # > 20 s of compiling on CI's cores


def _generation(decoder, pair, prompts: list[list[int]]) -> tuple[list, list[int], list[str]]:
    """One compiled call: its rows, dynamo's graph count at each phase hook (prefill, decode,
    end) and the warnings of forwards compiled inside their timed window."""
    marks: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = generate_rows(decoder, pair, prompts, 10, compute_perplexity=False,
                             compile=TRACE, on_phase=lambda _: marks.append(graphs_compiled()))
    inside = [str(w.message) for w in caught if "inside its timed window" in str(w.message)]
    return rows, marks, inside


@pytest.mark.parametrize(("name", "params"), [
    *(pytest.param(n, {}, id=n, marks=[pytest.mark.slow] if n in SLOW else [])
      for n in sorted(DECODERS)),
    pytest.param("eagle", {"tree": "static", "branching": (2, 2, 1)}, id="eagle-static",
                 marks=pytest.mark.slow)])
def test_no_graph_compiles_inside_a_window(model_dirs, name, params):
    """A fresh pair (its runners' caches new, EAGLE's and Medusa's heads included; EAGLE's
    dynamic and static trees), compiled calls of B = 1, 3 and again 3 rows (the first call at
    each row bucket, then one after it): no call compiles a graph between its first hook and
    its last (forwards, heads, kernels, fused calls: all compiled before the prefill, from
    `Decoder.warm_forwards` and the widths every drafting decoder meets, or after the "end"),
    and no forward compiles inside its timed window."""
    from mtad_energy.models import load_pair

    pair = load_pair(target=model_dirs["llama"],
                     draft=with_heads(model_dirs, model_dirs["llama-draft"], "llama"), device="cpu")
    decoder = get_decoder(name, **params) if params else compile_test_decoder(name)
    for call, prompts in (("first, B = 1", PROMPTS[:1]), ("first, B = 3", PROMPTS),
                          ("second, B = 3", PROMPTS)):
        rows, marks, inside = _generation(decoder, pair, prompts)
        assert inside == [], (call, inside)
        assert marks[0] == marks[-1], (call, marks)
        assert rows[0].stats.compile_in_window_s == 0, (call, rows[0].stats.compile_in_window_s)


@pytest.mark.parametrize("name", ["ar", pytest.param("medusa", marks=pytest.mark.slow)])
def test_a_reset_forgets_every_record_of_a_graph(model_dirs, name):
    """`static.reset_compiled` between two calls on one pair: the second compiles its graphs
    again (dynamo forgot them), all before its windows open: the engines' caches and the
    heads' calls forgot what they had compiled too (a record left behind claims a graph dynamo
    no longer has: its forward compiles inside the timed window)."""
    from mtad_energy.models import load_pair

    pair = load_pair(target=model_dirs["llama"],
                     draft=with_heads(model_dirs, model_dirs["llama-draft"], "llama"), device="cpu")
    decoder = compile_test_decoder(name)
    _generation(decoder, pair, PROMPTS)
    reset_compiled()
    rows, marks, inside = _generation(decoder, pair, PROMPTS)
    assert rows[0].stats.graphs_compiled > 0  # premise: the reset forgot the graphs
    assert inside == [] and marks[0] == marks[-1], (inside, marks)
    assert rows[0].stats.compile_in_window_s == 0


def _gen(compile_s: float, graphs: int, in_window_s: float = 0.0) -> SimpleNamespace:
    """What `compile_columns` reads of a `Generation`: its statistics' compile figures."""
    return SimpleNamespace(stats=SimpleNamespace(compile_s=compile_s, graphs_compiled=graphs,
                                                 compile_in_window_s=in_window_s))


def test_a_rows_compile_cost_is_its_warm_ups_once_plus_its_own():
    """A stored row of B = 3 rows after a warm-up of 3 rows: every generation of a call
    carries the call's figures, so the row takes the warm-up's once (not left out, not once
    per row) plus its own once; inside its windows: its own generation's."""
    warm = [_gen(2.0, 7, 0.25)] * 3
    gens = [_gen(0.5, 1, 0.125)] * 3
    assert compile_columns(warm, gens) == {"compile_s": 2.5, "graphs_compiled": 8,
                                           "compile_in_window_s": 0.125}
    assert compile_columns((), gens) == {"compile_s": 0.5, "graphs_compiled": 1,
                                         "compile_in_window_s": 0.125}


def test_a_summary_counts_a_batchs_compile_cost_once():
    """`runs` rows of one batch of 4 each carry the batch's 2 s and 6 graphs (and a row of B =
    1 its own 1 s, 3 graphs): together 3 s and 9 graphs, not 9 s and 27; a `decode_batch` row
    is a whole batch (``one_per_batch``)."""
    runs = pd.DataFrame({"batch_size": [4, 4, 4, 4, 1], "compile_s": [2.0] * 4 + [1.0],
                         "graphs_compiled": [6] * 4 + [3]})
    assert compile_cost(runs) == {"compile_s": 3.0, "graphs_compiled": 9.0}
    assert compile_cost(runs.iloc[:1], one_per_batch=True) == {"compile_s": 2.0,
                                                               "graphs_compiled": 6.0}


def test_a_calls_compile_s_is_every_second_it_spent_compiling(model_dirs):
    """A fresh pair's first compiled call of B = 3 rows: ``compile_s`` of every row is the
    call's seconds compiling, counted where they happen: the runners' warm-up of their known
    widths before the prefill (included, though outside every window), shapes first met in the
    loop, and what compiles after it (fused calls, kernels); the same figure for each row, not
    a row's share or a sum over rows."""
    from mtad_energy.models import load_pair

    pair = load_pair(target=model_dirs["llama"], draft="self:layers=0-0", device="cpu")
    spent = {"warm": 0.0, "prewarm": 0.0, "pending": 0.0}
    warm, prewarm = StaticRunner._warm, StaticRunner._prewarm
    pending, kernels_pending = StaticRunner.compile_pending, CompiledCalls.compile_pending

    def counted(key, fn):
        def run(self, *args, **kwargs):
            before = self.compile_s
            out = fn(self, *args, **kwargs)
            spent[key] += out if key in ("prewarm", "pending") else self.compile_s - before
            return out
        return run

    with (mock.patch.object(StaticRunner, "_warm", counted("warm", warm)),
          mock.patch.object(StaticRunner, "_prewarm", counted("prewarm", prewarm)),
          mock.patch.object(StaticRunner, "compile_pending", counted("pending", pending)),
          mock.patch.object(CompiledCalls, "compile_pending",
                            counted("pending", kernels_pending))):
        rows = generate_rows(get_decoder("spd", temperature=0), pair, PROMPTS, 8,
                             compute_perplexity=False, compile=TRACE)
    assert spent["prewarm"] > 0 and spent["pending"] > 0  # premise: both kinds happened
    total = spent["warm"] + spent["pending"]  # every warm-up, the prewarm's included
    for row in rows:
        assert row.stats.compile_s == pytest.approx(total, rel=1e-9, abs=1e-9)
        assert row.stats.compile_s - row.stats.compile_in_window_s >= spent["prewarm"] - 1e-9
