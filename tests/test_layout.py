"""The layout the README draws: one-way imports, no circle between modules or packages.

The graph is read from the source (every import statement, lazy ones inside functions included,
except those under ``if TYPE_CHECKING:``, which never run), so it shows what can be imported at run
time, not only what a module imports when it loads.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mtad_energy"
TESTS = ROOT.parent / "tests"
# the tests of the project as a whole sit at the top of tests/; the others in the room they test
PROJECT_WIDE = {"test_layout.py", "test_docs.py", "test_readme_commands.py", "test_experiments.py",
                "test_gpu_kit.py", "test_new_user.py", "test_new_user_inputs.py", "test_cuda.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_only(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (``from pkg import module`` counts as the
    module; ``from module import name`` as the module). Read once per test session (the source
    does not change during one); callers never change it."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_only(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    """``mtad_energy.measure.nvml`` -> ``measure``; a top-level module is its own package."""
    return module.split(".")[1] if module.count(".") else module


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for a, targets in graph.items():
        for b in targets:
            if package_of(a) != package_of(b):
                out[package_of(a)].add(package_of(b))
    return out


def test_no_import_circle_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_circle_between_packages():
    assert cycles(package_graph(import_graph())) == []


def test_the_cycle_finder_sees_a_circle():
    """The checks above can fail: a circle through three modules, and one through packages."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = {"mtad_energy.x.one": {"mtad_energy.y.two"}, "mtad_energy.y.two": {"mtad_energy.x.three"}}
    assert cycles(package_graph(graph)) == [["x", "y"]]


@pytest.mark.parametrize(("package", "never"), [
    ("decoding", {"measure", "bench", "results", "cli"}),
    ("measure", {"decoding", "bench", "results", "cli", "models"}),
    ("energy", {"measure", "decoding", "bench", "results", "cli", "engines", "models", "config"}),
    ("results", {"bench", "cli", "measure", "engines", "config"}),
    ("engines", {"bench", "cli", "config"}),
    ("specs", {"bench", "cli", "config", "engines", "results", "measure", "models"}),
    ("models", {"decoding", "measure", "bench", "results", "cli", "engines"}),
])
def test_imports_go_one_way(package, never):
    """The arrows README's layout draws: the decoding core and the meters never import each other,
    the energy model imports neither, results read stores without running anything."""
    reached = package_graph(import_graph()).get(package, set())
    assert not reached & never, f"{package} imports {sorted(reached & never)}"



@pytest.mark.parametrize(("layer", "never"), [
    ("decoding.rules", {"decoding.runtime", "decoding.decoders", "decoding.registry"}),
    ("decoding.runtime", {"decoding.decoders"}),
])
def test_decoding_layers_go_one_way(layer, never):
    """decoding/'s three rooms: the rules (pure tensor functions) import only rules, and the
    runtime never imports a decoder (the loop reaches them through the registry)."""
    prefix = f"mtad_energy.{layer}"
    banned = tuple(f"mtad_energy.{n}" for n in never)
    reached = {t for m, targets in import_graph().items()
               if m == prefix or m.startswith(prefix + ".") for t in targets}
    bad = sorted(t for t in reached if t in banned or t.startswith(tuple(b + "." for b in banned)))
    assert bad == [], f"{layer} imports {bad}"


def misplaced_tests(tests: Path, package: Path) -> list[str]:
    """Test files out of the package's mirror: a folder of ``tests/`` that names no folder of the
    package (``tests/decoding/decoders/`` mirrors ``mtad_energy/decoding/decoders/``), or a test
    at the top of ``tests/`` that is not one of the project-wide ones."""
    files = sorted(tests.rglob("test_*.py"))
    return [str(p.relative_to(tests)) for p in files
            if (p.parent == tests and p.name not in PROJECT_WIDE)
            or (p.parent != tests and not (package / p.parent.relative_to(tests)).is_dir())]


def test_tests_mirror_the_package():
    assert misplaced_tests(TESTS, ROOT) == [], "put a test in the tests/ folder of the room it tests"


def test_command_line_modules_stay_short():
    long = {p.name: n for p in (ROOT / "cli").glob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def engine_branches(source: str) -> list[str]:
    """The tests of which engine generates in ``source``: an engine compared with None or with
    hf (``engine is None``, ``config.engine != HF``; not an attribute of an engine, such as
    ``engine.context_length is None``) or an ``isinstance(..., <Engine class>)``: what `bench/`
    must not hold (an engine is another source of generations under the same runner and
    windows, never a second pipeline). One form is the default, not a branch: an engine not
    given is the project's decoders (``engine if engine is not None else open_hf(...)``)."""
    tree = ast.parse(source)
    defaults = {id(n) for node in ast.walk(tree) if isinstance(node, ast.IfExp)
                and "open_hf(" in ast.unparse(node.orelse) for n in ast.walk(node.test)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and id(node) not in defaults:
            sides = [node.left, *node.comparators]
            texts = [ast.unparse(s) for s in sides]
            about_engine = any("engine" in t.rpartition(".")[2].lower() for t in texts)
            against = any(t in ("None", "HF", "'hf'", '"hf"') for t in texts)
            if about_engine and against:
                found.append(ast.unparse(node))
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance"
              and len(node.args) == 2 and "Engine" in ast.unparse(node.args[1])):
            found.append(ast.unparse(node))
    return found


def test_bench_holds_every_engine_alike():
    """No branch on the engine's kind in the runner, the batched sweep or anything else under
    bench/: the project's decoders are the engine hf (`engines.hf`), behind the same contract."""
    found = {p.name: b for p in sorted((ROOT / "bench").glob("*.py"))
             if (b := engine_branches(p.read_text()))}
    assert found == {}


def test_the_engine_branch_finder_sees_a_branch():
    assert engine_branches("if self.engine is not None:\n    pass") == ["self.engine is not None"]
    assert engine_branches("x = a if config.engine != HF else b") == ["config.engine != HF"]
    assert engine_branches("ok = isinstance(d, EngineDecoder)") == ["isinstance(d, EngineDecoder)"]
    assert engine_branches("if engines != [ENGINE]:\n    pass") == []  # a check of the input
    assert engine_branches("if runner.engine.context_length is None:\n    pass") == []
    assert engine_branches("e = engine if engine is not None else open_hf(pair)") == []


def test_a_decoder_imports_another_only_when_it_is_its_variant():
    """What decoders share (the draft chain, tree structures) lives in the runtime; a decoder
    file imports another only to build on it: MCSS is SpecInfer with its sampling, MMTAD is MTAD
    over a tree (its parameters)."""
    prefix = "mtad_energy.decoding.decoders."
    reached = {(m.removeprefix(prefix), t.removeprefix(prefix))
               for m, targets in import_graph().items() if m.startswith(prefix)
               for t in targets if t.startswith(prefix)}
    assert reached <= {("mcss", "specinfer"), ("mmtad", "mtad")}, sorted(reached)


# The runners' calls whose positional tail is a rule's own arguments, handed on as ``fn(*args)``
# to the pure function they run after the forward (`programs`, `slot_forward`): their count is the
# rule's arity, not a call's parameters to be swapped.
FORWARDS_A_RULES_ARGUMENTS = ("verify", "tree_verify", "grow_tree", "tree_then", "beam_search",
                              "forward_tree_then")


def long_positional_calls(root: Path, most: int = 8) -> list[str]:
    """Calls in the package passing more than ``most`` arguments by position (starred ones not
    counted), but the runners' calls handing a rule its arguments."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            n = sum(1 for a in node.args if not isinstance(a, ast.Starred))
            if n > most and name not in FORWARDS_A_RULES_ARGUMENTS:
                found.append(f"{path.relative_to(root)}:{node.lineno} {name} ({n})")
    return found


def test_no_call_passes_many_arguments_by_position():
    """issue 54: past the eighth, a call names its arguments (a 23-argument positional call was
    a silent swap waiting to happen), in the whole package."""
    assert long_positional_calls(ROOT) == []
