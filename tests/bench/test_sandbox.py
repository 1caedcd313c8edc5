"""Hostile HumanEval completions: the sandbox's jail must contain each of them (issue 10, C4).

Each test runs a completion that tries to escape (write outside its directory, delete the parent's
files, start many processes, leave a daemon behind) and asserts the attempt had no effect. They
need the namespace jail (root, or unprivileged user namespaces) and skip with the reason elsewhere.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from mtad_energy.bench import quality
from mtad_energy.bench.quality import ExecResult, humaneval_pass
from tests.limits import hang_limit_s

pytestmark = pytest.mark.skipif(
    quality.sandbox_isolation() != "jail",
    reason="the kernel refuses the sandbox's namespaces here (needs root or unprivileged user "
           "namespaces, and mount_setattr: Linux >= 5.12)")


def toy() -> dict:
    return {"task_id": "toy/0", "prompt": "import os\nimport sys\nimport time\n\n\ndef f():\n",
            "entry_point": "f", "test": "def check(fn):\n    assert fn() == 1\n"}


def run(body: str, **kw) -> ExecResult:
    return humaneval_pass(toy(), body, allow_code_execution=True, **kw)


def printed(res: ExecResult, key: str) -> list[str]:
    return [ln.split("=", 1)[1] for ln in res.detail.splitlines() if ln.startswith(key + "=")]


def dead(pid: str) -> bool:
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "State:\tZ" in status.read_text()


def test_writing_outside_the_temporary_directory_is_refused(tmp_path):
    targets = [tmp_path / "escaped.txt", Path("/tmp") / f"mtad-escape-{uuid.uuid4().hex}",
               Path.cwd() / f"mtad-escape-{uuid.uuid4().hex}"]
    body = "".join(f"    try:\n        open({str(t)!r}, 'w').write('x')\n        print('wrote=1')\n"
                   f"    except OSError as e:\n        print(f'refused={{e.errno}}')\n" for t in targets)
    res = run(body + "    open('inside.txt', 'w').write('ok')\n    return 1\n")
    assert res.passed and res.confined, res.detail  # its own directory stays writable
    assert not printed(res, "wrote")
    assert len(printed(res, "refused")) == len(targets)
    assert not any(t.exists() for t in targets)


def test_deleting_a_file_in_the_parents_working_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "results.parquet"
    victim.write_text("precious")
    (tmp_path / "sub").mkdir()
    body = (f"    import shutil\n    for p in ({str(victim)!r}, {str(tmp_path / 'sub')!r}):\n"
            "        try:\n            shutil.rmtree(p) if p.endswith('sub') else os.remove(p)\n"
            "            print('deleted=' + p)\n        except OSError:\n            print('refused=' + p)\n"
            "    return 1\n")
    res = run(body)
    assert res.passed, res.detail
    assert not printed(res, "deleted") and len(printed(res, "refused")) == 2
    assert victim.read_text() == "precious" and (tmp_path / "sub").is_dir()


def test_a_light_fork_bomb_is_capped_and_reaped():
    # tries to start 200 sleeping processes; the jail allows a few dozen and kills them all at the end
    body = ("    started = 0\n    for _ in range(200):\n        try:\n            pid = os.fork()\n"
            "        except OSError:\n            break\n        if pid == 0:\n"
            "            time.sleep(3600)\n            os._exit(0)\n        started += 1\n"
            "    print(f'started={started}', flush=True)\n"
            "    print('host=' + os.readlink('/proc/self'), flush=True)\n    return 1\n")
    # the children sleep an hour: a sandbox that waited for them would end in its timeout
    res = run(body, timeout_s=hang_limit_s(8, cap_s=1800))
    assert res.status != "timeout", "the program waited for its children"
    assert res.passed, res.detail
    started = int(printed(res, "started")[0])
    assert started < 200, "the process limit did not apply"
    time.sleep(0.3)
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and not dead(p.name)
                 and (p / "status").exists() and _ppid(p) == printed(res, "host")[0]]
    assert not leftovers, f"{len(leftovers)} children outlived the sandbox"


def _ppid(proc: Path) -> str:
    try:
        return next(ln.split()[1] for ln in (proc / "status").read_text().splitlines()
                    if ln.startswith("PPid:"))
    except (OSError, StopIteration):
        return ""


def test_a_daemon_in_its_own_session_dies_with_the_sandbox(tmp_path):
    marker = tmp_path / "marker"
    # the daemon writes its marker into the shared /dev/shm too, in case the file system were open
    shm_marker = Path("/dev/shm") / f"mtad-marker-{uuid.uuid4().hex}"
    daemon = ("import os, time; print('daemon=' + os.readlink('/proc/self'), flush=True); time.sleep(2); "
              f"[open(m, 'w') for m in ({str(marker)!r}, {str(shm_marker)!r})]")
    body = ("    import subprocess\n"
            f"    subprocess.Popen(['setsid', sys.executable, '-c', {daemon!r}], start_new_session=True)\n"
            "    time.sleep(0.5)\n    return 1\n")
    res = run(body)
    assert res.passed, res.detail
    [pid] = printed(res, "daemon")
    time.sleep(0.2)
    assert dead(pid), "the daemon outlived the sandbox"
    time.sleep(2.5)  # past the daemon's 2 s sleep
    assert not marker.exists() and not shm_marker.exists()


def test_the_jail_still_runs_ordinary_code_and_reports_it():
    assert os.geteuid() != 0 or quality.network_isolation() == "netns"
    res = run("    import json, subprocess\n    subprocess.run(['true'], check=True)\n"
              "    return json.loads('1')\n")
    assert (res.passed, res.confined) == (True, True), res.detail
