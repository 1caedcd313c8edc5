"""The compile rule lives once (docs/design.md section 7, docs/concepts/compiled.md): one
``torch.compile`` call under ``mtad_energy/decoding/`` (`compiled.CompiledFunctions.compiled`),
whose warm-up of a new input is untimed work the loop's host-work count never sees, and one body
of ``compile_pending`` (`graph_call.CompilesAfter`), which every runner and the generation's calls
inherit: what a generation met first compiles after it, never inside a window."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from mtad_energy.decoding.runtime.calls import EagerCalls
from mtad_energy.decoding.runtime.compiled import CompiledCalls, CompiledFunctions
from mtad_energy.decoding.runtime.graph_call import CompilesAfter, Pending
from mtad_energy.decoding.runtime.head_runner import HeadRunner
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.static import StaticRunner
from mtad_energy.measure.host_work import HostWorkCounter

DECODING = Path(__file__).resolve().parents[3] / "mtad_energy" / "decoding"


def _where(match) -> list[str]:
    """``file:function`` of every node of the decoding package's source that ``match`` accepts."""
    out = []
    for path in sorted(DECODING.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out += [f"{path.relative_to(DECODING)}:{func.name}"
                        for node in ast.walk(func) if match(node)]
    return out


def _is_torch_compile(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "compile" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch")


def test_one_torch_compile_call_and_one_compile_pending_body():
    """Every compiled function of the decode loop (a model's forwards, a head, the pure calls)
    is made in one place; every runner's and the calls' ``compile_pending`` is the one body."""
    assert _where(_is_torch_compile) == ["runtime/compiled.py:compiled"]
    bodies = [path for path in _where(lambda n: isinstance(n, ast.FunctionDef)
                                      and n.name == "compile_pending")]
    assert bodies == ["runtime/graph_call.py:compile_pending"]
    for cls in (ModelRunner, StaticRunner, HeadRunner, EagerCalls, CompiledCalls):
        assert cls.compile_pending is CompilesAfter.compile_pending, cls


def test_a_new_input_warms_untimed_and_uncounted_then_runs_as_one_graph_call():
    """`CompiledFunctions.warm` compiles a new input outside the count (not the loop's work)
    and returns its seconds; the call after it is one graph call and no op outside a graph."""
    functions = CompiledFunctions("eager", None, False, graphs=False)

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.ones(3)
    counter = HostWorkCounter()
    with counter.counting():
        seconds = functions.warm(double, (x,))
    assert seconds > 0
    assert (counter.graph_calls, counter.ops) == (0, 0)
    with counter.counting():
        assert functions.compiled(double)(x).tolist() == [2.0] * 3
    assert (counter.graph_calls, counter.ops) == (1, 0)


def test_pending_compiles_after_once_then_nothing():
    """What a generation met first waits in `Pending` until `compile_pending`, which runs each
    key's last compile once and forgets it: a second call compiles nothing (0 seconds)."""
    ran: list[str] = []
    owner = CompilesAfter()
    owner._pending = Pending()
    owner._pending.add("a", lambda: ran.append("first a"))
    owner._pending.add("b", lambda: ran.append("b"))
    owner._pending.add("a", lambda: ran.append("last a"))
    assert ran == []  # nothing compiles while the generation runs
    assert owner.compile_pending() >= 0 and ran == ["last a", "b"]
    assert owner.compile_pending() == 0.0 and ran == ["last a", "b"]
    assert CompilesAfter().compile_pending() == 0.0  # the eager path: nothing ever pending
