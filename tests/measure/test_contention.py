"""The contention probe: its arithmetic on fake /proc readings, a real spinning process flagged,
NVML's process list (autospec mocks), the thread setup in the snapshot, the pre-sweep warning."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mtad_energy.measure.contention import (
    CONTENDED_CORES,
    Contention,
    ContentionProbe,
    GpuProcesses,
    busy_warning,
    combine,
    machine_load,
    parse_proc_stat,
    parse_self_stat,
    passive_openmp_default,
    process_tree,
    row_contention,
)
from mtad_energy.measure.env import snapshot
from tests.measure.conftest import FakeNvml, StepClock

HZ = 100


def proc_stat(user: int, system: int, idle: int, iowait: int = 0, steal: int = 0,
              cpus: int = 2) -> str:
    """A /proc/stat as Linux writes it (ticks): the aggregate line, one line per CPU, the rest."""
    lines = [f"cpu  {user} 0 {system} {idle} {iowait} 0 0 {steal} 0 0"]
    lines += [f"cpu{i} {user // cpus} 0 {system // cpus} {idle // cpus} 0 0 0 0 0 0"
              for i in range(cpus)]
    lines += ["intr 123 0 0", "ctxt 456", "btime 1700000000", "processes 789"]
    return "\n".join(lines) + "\n"


def self_stat(utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> str:
    """A /proc/self/stat line; the name has a space and a ')' to catch naive splitting."""
    return (f"4242 (py thon) x) R 1 4242 4242 0 -1 4194304 100 0 0 0 {utime} {stime} {cutime} "
            f"{cstime} 20 0 3 0 1000 100000 200 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1")


class FakeProc:
    """Readings the test sets between `begin` and `end`."""

    def __init__(self) -> None:
        self.stat = proc_stat(1000, 500, 9000)
        self.own = self_stat(100, 50)

    def probe(self, clock: StepClock, gpu_pids=None) -> ContentionProbe:
        return ContentionProbe(proc_stat=lambda: self.stat, self_stat=lambda: self.own,
                               clock=clock, hz=HZ, gpu_pids=gpu_pids)


def test_parsers_read_busy_ticks_and_own_ticks() -> None:
    busy, cpus = parse_proc_stat(proc_stat(1000, 500, 9000, iowait=300, steal=7, cpus=4))
    assert (busy, cpus) == (1000 + 500 + 7, 4)  # idle and iowait are not busy; steal is
    assert parse_self_stat(self_stat(100, 50, 20, 5)) == 175  # after the last ')'
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        parse_proc_stat("intr 1\n")


def test_others_are_busy_ticks_minus_this_process() -> None:
    fake, clock = FakeProc(), StepClock(10.0)
    probe = fake.probe(clock)
    probe.begin("w")
    # 1 s: the machine was busy 150 ticks (1.5 CPU-s), this process 60 of them
    fake.stat, fake.own, clock.now_s = proc_stat(1100, 550, 9050), self_stat(140, 70), 11.0
    c = probe.end("w")
    assert c.wall_s == pytest.approx(1.0) and c.cpus == 2
    assert c.others_cpu_s == pytest.approx(0.90)
    assert c.others_cores == pytest.approx(0.90)
    assert c.resolution_cpu_s == pytest.approx(0.03)  # (2 CPUs + this process) ticks
    assert c.contended
    cols = c.columns()
    assert cols["contended"] is True and cols["others_cores"] == pytest.approx(0.9)
    assert cols["gpu_other_pids"] == "[]"


def test_a_quiet_machine_is_not_flagged() -> None:
    fake, clock = FakeProc(), StepClock(0.0)
    probe = fake.probe(clock)
    probe.begin("w")
    # 2 s: 105 busy ticks, 100 of them this process: others 0.05 CPU-s = 0.025 cores
    fake.stat, fake.own, clock.now_s = proc_stat(1080, 525, 9300), self_stat(175, 75), 2.0
    c = probe.end("w")
    assert c.others_cpu_s == pytest.approx(0.05) and not c.contended


def test_the_threshold_is_a_quarter_core_beyond_the_counters_resolution() -> None:
    def window(others_ticks: int, wall_s: float) -> Contention:
        fake, clock = FakeProc(), StepClock(0.0)
        probe = fake.probe(clock)
        probe.begin("w")
        fake.stat, clock.now_s = proc_stat(1000 + others_ticks, 500, 9000), wall_s
        return probe.end("w")

    # 1 s on 2 CPUs: resolution 3 ticks, threshold 25 ticks: flagged from 29 ticks
    assert not window(27, 1.0).contended and window(29, 1.0).contended
    # a 20 ms window with 3 ticks of others reads as 1.5 cores but cannot be told from noise
    short = window(3, 0.02)
    assert short.others_cores == pytest.approx(1.5) and not short.contended
    assert CONTENDED_CORES == 0.25


def test_a_row_combines_its_windows() -> None:
    pre = Contention(wall_s=0.1, others_cpu_s=0.0, resolution_cpu_s=0.03, cpus=2)
    dec = Contention(wall_s=1.9, others_cpu_s=1.0, resolution_cpu_s=0.03, cpus=2,
                     gpu_other_pids=(7,))
    both = combine([pre, dec])
    assert both.wall_s == pytest.approx(2.0) and both.others_cpu_s == pytest.approx(1.0)
    assert both.resolution_cpu_s == pytest.approx(0.06) and both.gpu_other_pids == (7,)
    assert row_contention([pre, None])["contended"] is False
    unprobed = row_contention([None, None])
    assert unprobed["contended"] is None and unprobed["others_cores"] is None
    assert combine([]) is None


def test_without_proc_the_probe_records_nothing() -> None:
    def missing() -> str:
        raise FileNotFoundError("/proc/stat")

    probe = ContentionProbe(proc_stat=missing)
    probe.begin("w")
    assert probe.end("w") is None


def test_a_spinning_process_during_a_window_gets_it_flagged() -> None:
    """Real /proc: another process burns a core while this one sleeps through the window."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        probe = ContentionProbe()
        probe.begin("w")
        time.sleep(1.5)
        c = probe.end("w")
    finally:
        spinner.kill()
        spinner.wait()
    assert c is not None and c.contended, c
    assert c.others_cpu_s >= CONTENDED_CORES * c.wall_s


def test_a_windows_own_processes_count_as_this_one_not_as_others() -> None:
    """Real /proc: the same spinner in two windows open at once; where it is the window's own
    (an engine decoding in a process of its own), its ticks leave the others' share."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        probe = ContentionProbe()
        probe.begin("plain")
        probe.begin("mine", own=(spinner.pid,))
        time.sleep(1.5)
        mine, plain = probe.end("mine"), probe.end("plain")
    finally:
        spinner.kill()
        spinner.wait()
    assert plain.others_cpu_s - mine.others_cpu_s >= CONTENDED_CORES * plain.wall_s, (plain, mine)


def test_a_process_tree_is_the_roots_and_every_live_descendant() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen([sys.executable,"
         " '-c', 'import time; time.sleep(30)']); print(p.pid, flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert set(process_tree([child.pid])) == {child.pid, grandchild}
        assert {os.getpid(), child.pid, grandchild} <= set(process_tree([os.getpid()]))
        assert all(t >= 0 for t in process_tree([child.pid]).values())
    finally:
        child.kill()
        child.wait()
        os.kill(grandchild, 9)
    assert process_tree([child.pid]) == {}  # gone: nothing of it is counted


def test_an_engines_processes_leave_the_gpu_list_and_the_cpu_share() -> None:
    fake, clock = FakeProc(), StepClock(0.0)
    ticks = {7: 10, 8: 5}  # an engine core (7) and its worker (8)
    probe = ContentionProbe(proc_stat=lambda: fake.stat, self_stat=lambda: fake.own, clock=clock,
                            hz=HZ, gpu_pids=lambda: {8, 99}, tree=lambda roots: dict(ticks))
    probe.begin("w", own=(7,))
    # 1 s: 150 busy ticks: this process 60, the engine's two processes 80 -> others 10
    ticks.update({7: 40, 8: 55})
    fake.stat, fake.own, clock.now_s = proc_stat(1100, 550, 9050), self_stat(140, 70), 1.0
    c = probe.end("w")
    assert c.others_cpu_s == pytest.approx(0.10)  # 0.1 core: not contended on the CPU
    assert c.gpu_other_pids == (99,)  # its worker on the GPU is the window's own; 99 is not
    assert c.contended


def test_nvml_listing_another_process_flags_the_window(fake_nvml: FakeNvml) -> None:
    own = os.getpid()
    fake_nvml.gpus[0].pids = (own, 31337)
    fake_nvml.gpus[1].pids = (own, 555)
    gpu = GpuProcesses("cuda:0", env={})
    assert gpu() == {31337}  # this process and the other GPU's processes are not listed
    assert GpuProcesses("cuda:1", env={})() == {555}
    fake, clock = FakeProc(), StepClock(0.0)
    probe = fake.probe(clock, gpu_pids=gpu)
    probe.begin("w")
    fake.own, clock.now_s = self_stat(200, 50), 1.0  # the CPU was this process's alone
    c = probe.end("w")
    assert c.others_cpu_s == 0.0 and c.gpu_other_pids == (31337,) and c.contended
    assert c.columns()["gpu_other_pids"] == "[31337]" and "31337" in c.describe()
    fake_nvml.gpus[0].pids = (own,)
    probe.begin("alone")
    assert not probe.end("alone").contended
    probe.begin("joined")  # a process that arrives during the window is seen at its end
    fake_nvml.gpus[0].pids = (own, 999)
    assert probe.end("joined").gpu_other_pids == (999,)


def test_the_snapshot_records_threads_and_wait_policy(no_nvml: None) -> None:
    import torch

    snap = snapshot(env={"OMP_WAIT_POLICY": "passive", "OMP_NUM_THREADS": "1"})
    t = snap.to_dict()["threads"]
    assert t["omp_wait_policy"] == "passive" and t["omp_num_threads"] == "1"
    assert t["torch_threads"] == torch.get_num_threads() and t["mkl_num_threads"] is None
    assert t["affinity_cpus"] == len(os.sched_getaffinity(0))
    other = snapshot(env={"OMP_WAIT_POLICY": "active", "OMP_NUM_THREADS": "1"})
    assert other.snapshot_id != snap.snapshot_id  # another thread setup is another setup


def test_a_busy_machine_is_warned_about_before_a_sweep() -> None:
    fake, clock = FakeProc(), StepClock(0.0)

    def busy_sleep(seconds: float) -> None:  # others burn 1.2 cores meanwhile
        fake.stat = proc_stat(1000 + int(120 * seconds), 500, 9000)
        clock.now_s += seconds

    load = machine_load(0.5, fake.probe(clock), sleep=busy_sleep)
    assert load["contended"] and load["others_cores"] == pytest.approx(1.2)
    assert "the machine is busy" in load["warning"] and "1.20 of 2 core(s)" in load["warning"]
    quiet = machine_load(0.5, FakeProc().probe(StepClock(0.0)),
                         sleep=lambda s: None)
    assert quiet["warning"] is None and busy_warning(None) is None


def test_the_cli_sets_a_passive_wait_policy_before_torch_unless_the_user_chose_one() -> None:
    env: dict[str, str] = {}
    assert passive_openmp_default(env) and env == {"OMP_WAIT_POLICY": "passive"}
    mine = {"OMP_WAIT_POLICY": "active"}
    assert not passive_openmp_default(mine) and mine == {"OMP_WAIT_POLICY": "active"}
    code = ("import os, sys; import mtad_energy.cli; "
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    child = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=child, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["passive", "False"]  # set before torch (and its OpenMP) is loaded
    out = subprocess.run([sys.executable, "-c", code], env={**child, "OMP_WAIT_POLICY": "active"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["active", "False"]
