"""One program per step: the eager runner and the compiled runner's fused calls run the same
`runtime.programs` (over `runner.RunnerSteps` and `slot_forward.SlotSteps`), and the fused
calls' part of `StaticRunner` declares what it needs of the others (`static_fused.FusedCalls`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from mtad_energy.decoding.runtime import programs, static_fused
from mtad_energy.decoding.runtime.calls import EagerCalls
from mtad_energy.decoding.runtime.compiled import CompileOptions
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.static import ForwardShape, StaticRunner
from mtad_energy.decoding.runtime.static_fused import FusedCalls
from mtad_energy.decoding.runtime.timer import PhaseTimer

TRACE = CompileOptions(backend="aot_eager")


def _fused_class() -> ast.ClassDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(static_fused)))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FusedCalls")


def test_fused_calls_use_only_what_they_declare():
    """Every ``self.NAME`` `FusedCalls` reads or calls is its own method or a name its contract
    declares (an annotation without a value, so it shadows none of the runner's); no fallback
    goes through ``super()`` (the class's method order)."""
    cls = _fused_class()
    used = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    declared = set(inspect.get_annotations(FusedCalls))
    own = {n for n, v in vars(FusedCalls).items() if callable(v)}
    assert used - own - declared == set()
    assert declared and not declared & set(vars(FusedCalls))  # declared, never defined here
    supers = [n for n in ast.walk(cls) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Name) and n.func.id == "super"]
    assert supers == []


def test_the_static_runner_meets_the_fused_calls_contract(llama_pair):
    """Each name `FusedCalls` declares is defined by the rest of `StaticRunner` (the runner or
    its layout), not by FusedCalls: a runner made without it still has every one."""
    runner = StaticRunner(llama_pair.draft, PhaseTimer("cpu"), "contract", slots=16,
                          options=TRACE, seqs=3)
    for name in inspect.get_annotations(FusedCalls):
        assert hasattr(runner, name), name
        assert any(name in vars(c) for c in type(runner).__mro__ if c is not FusedCalls) \
            or name in vars(runner), name


@pytest.fixture
def program_calls(monkeypatch):
    """The programs run, by name, in order (a spy around each of `programs`' functions)."""
    calls: list[str] = []
    for name in ("chain", "tree_levels", "beam_search", "grow_tree"):
        real = getattr(programs, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(programs, name, spy)
    return calls


def test_eager_and_fused_chains_and_beam_searches_run_the_one_program(llama_pair,
                                                                       program_calls):
    """The eager runner's chain and beam search, and the compiled runner's fused ones (met
    first: the fused call's Python function, its forwards compiled), each run
    `programs.chain` / `programs.beam_search`, with the same tokens."""
    from mtad_energy.decoding.runtime.decoder import draft_next

    u = torch.rand(4, 1, 1, generator=torch.Generator().manual_seed(0))
    pending, warp = torch.tensor([[1, 2]]), (1.0, 0, 1.0)
    eager = ModelRunner(llama_pair.draft, PhaseTimer("cpu"), "eager")
    fused = StaticRunner(llama_pair.draft, PhaseTimer("cpu"), "one-program", slots=32,
                         options=TRACE, shape=ForwardShape(rows_per_seq=3, max_chain=5))
    outs = []
    for runner in (eager, fused):
        runner.prefill(torch.tensor([[5, 9, 11, 3]]))
        tokens = runner.chain(EagerCalls(), pending, None, draft_next, u, *warp)[0]
        beams = runner.beam_search(EagerCalls(), tokens[:, -1:], None, 4, 3, (*warp, False), None)
        outs.append((tokens, beams[0]))
    assert program_calls == ["chain", "beam_search"] * 2
    assert fused._pending  # the fused calls ran as such (to compile after the generation)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
