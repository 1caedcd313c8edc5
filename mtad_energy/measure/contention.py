"""Contention: what other processes took from the machine during a measurement window.

A number measured while other processes held the cores (or the GPU) is not this decoder's alone:
with OpenMP threads spinning against a competing process, ``ar`` once ran 5x slower. So every
window also records, from Linux's own counters (no psutil):

- ``others_cpu_s``: CPU seconds the rest of the machine used during the window: the busy ticks of
  all CPUs in ``/proc/stat`` (user, nice, system, irq, softirq, steal; not idle or iowait) minus
  this process's own (``/proc/self/stat``: utime + stime of all its threads, and cutime + cstime
  of the children it reaped). A child still running (a spinning helper, a compile worker) counts
  as "other": it competes for the same cores. The exception is a window's **own processes**
  (``begin(key, own=pids)``): an engine that decodes in processes of its own (vLLM's engine core
  and its workers) does the window's work there, so those processes and their descendants count
  as this process (`process_tree`), on the CPU and on the GPU; a sibling engine that is not this
  window's (an idle vLLM of another configuration, still spinning) stays "other".
- ``others_cores``: that over the window's wall time, in core-equivalents (1.0: one core busy
  with other work the whole window).
- ``gpu_other_pids``: on a GPU, the other processes NVML lists on the measured device
  (``nvmlDeviceGetComputeRunningProcesses``) at the window's start or end. In a container with its
  own PID namespace NVML reports host PIDs, so this process may show as "other" there.

**Busy** (`Contention.contended`): other processes used more than `CONTENDED_CORES` (0.25) of a
core on average over the window, beyond the counters' resolution (one tick per CPU and one for
this process: a 20 ms window on 2 CPUs cannot show 0.25 of a core, and is not flagged unless the
excess is certain), or another process was on the measured GPU. A quiet Linux machine's daemons
use a few hundredths of a core; 0.25 is a competing process, not background noise.

The figures are stored with every row (``others_cpu_s``, ``others_cores``, ``gpu_other_pids``,
``contended``) so a stricter reader can apply its own threshold.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONTENDED_CORES = 0.25
"""Others' mean core-equivalents over a window above which it is flagged ``contended``."""

LOAD_SAMPLE_S = 0.3
"""How long `sample_load` watches the machine before a sweep (seconds)."""

Reader = Callable[[], str]


def _read(path: str) -> Reader:
    return lambda: Path(path).read_text()


PROC_STAT, SELF_STAT = _read("/proc/stat"), _read("/proc/self/stat")


def clock_ticks_per_s() -> int:
    """USER_HZ: the unit of /proc/stat and /proc/<pid>/stat times (100 on Linux)."""
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100


def parse_proc_stat(text: str) -> tuple[int, int]:
    """(busy ticks of all CPUs, number of CPUs) from ``/proc/stat``: the ``cpu`` line's user, nice,
    system, irq, softirq and steal (idle and iowait are not busy; guest time is already in user)."""
    busy, cpus = None, 0
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if fields[0] == "cpu":
            v = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
            user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
            busy = user + nice + system + irq + softirq + steal
        elif fields[0].startswith("cpu") and fields[0][3:].isdigit():
            cpus += 1
    if busy is None:
        raise ValueError("no aggregate 'cpu' line in /proc/stat")
    return busy, max(cpus, 1)


def parse_self_stat(text: str) -> int:
    """This process's CPU ticks from ``/proc/self/stat``: utime + stime (all threads) + cutime +
    cstime (reaped children). The fields are counted after the last ')' (the name may hold spaces
    and parentheses): state is field 3, utime field 14."""
    fields = text[text.rindex(")") + 2:].split()
    utime, stime, cutime, cstime = (int(fields[i]) for i in (11, 12, 13, 14))
    return utime + stime + cutime + cstime


def process_tree(roots: Iterable[int], proc: Path = Path("/proc")) -> dict[int, int]:
    """pid -> CPU ticks (`parse_self_stat`: its own and its reaped children's) of each live
    process of ``roots`` and every live descendant, read from ``proc``. A live child's ticks are
    not in its parent's (only reaped ones are), so the values add up without counting twice."""
    parent, ticks = {}, {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            pid, ppid = int(stat.parent.name), int(text[text.rindex(")") + 2:].split()[1])
            ticks[pid], parent[pid] = parse_self_stat(text), ppid
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not a process
            continue
    tree = {r for r in roots if r in ticks}
    grew = True
    while grew:
        more = {pid for pid, pp in parent.items() if pp in tree and pid not in tree}
        tree |= more
        grew = bool(more)
    return {pid: ticks[pid] for pid in tree}


@dataclass(frozen=True)
class CpuSample:
    """The counters at one instant."""

    busy_ticks: int  # all CPUs
    own_ticks: int  # this process (and the window's own processes, `process_tree`)
    cpus: int
    time_s: float  # monotonic clock
    own_pids: frozenset[int] = frozenset()  # the window's own processes' trees, as read


@dataclass(frozen=True)
class Contention:
    """What others took during one window (or the sum of a row's windows, `combine`)."""

    wall_s: float
    others_cpu_s: float  # CPU seconds of other processes, >= 0
    resolution_cpu_s: float  # what the tick counters cannot resolve: (cpus + 1) ticks per window
    cpus: int
    gpu_other_pids: tuple[int, ...] = ()

    @property
    def others_cores(self) -> float:
        """Others' mean core-equivalents over the window (0.0 for an empty window)."""
        return self.others_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def contended(self) -> bool:
        """Busy: others took more than `CONTENDED_CORES` beyond the resolution, or another
        process was on the measured GPU."""
        excess_s = self.others_cpu_s - self.resolution_cpu_s
        return bool(self.gpu_other_pids) or excess_s > CONTENDED_CORES * self.wall_s

    def columns(self) -> dict[str, Any]:
        """The row columns: ``others_cpu_s``, ``others_cores``, ``gpu_other_pids`` (JSON list) and
        ``contended``."""
        return {"others_cpu_s": self.others_cpu_s, "others_cores": self.others_cores,
                "gpu_other_pids": json.dumps(list(self.gpu_other_pids)),
                "contended": self.contended}

    def describe(self) -> str:
        gpu = (f"; process(es) {', '.join(map(str, self.gpu_other_pids))} on the GPU"
               if self.gpu_other_pids else "")
        return (f"other processes used {self.others_cores:.2f} of {self.cpus} core(s) over "
                f"{self.wall_s:.2f} s{gpu}")


def between(start: CpuSample, end: CpuSample, hz: int, gpu_other_pids: Iterable[int] = ()
            ) -> Contention:
    """The window from ``start`` to ``end``: busy ticks minus own ticks, in seconds, never below
    zero (the two counters are read a moment apart)."""
    others = (end.busy_ticks - start.busy_ticks) - (end.own_ticks - start.own_ticks)
    return Contention(wall_s=max(0.0, end.time_s - start.time_s),
                      others_cpu_s=max(0, others) / hz, resolution_cpu_s=(end.cpus + 1) / hz,
                      cpus=end.cpus, gpu_other_pids=tuple(sorted(set(gpu_other_pids))))


def combine(readings: Sequence[Contention]) -> Contention | None:
    """A row's windows as one: seconds and resolutions add up, GPU processes are united (None
    when no window was probed)."""
    if not readings:
        return None
    return Contention(wall_s=sum(r.wall_s for r in readings),
                      others_cpu_s=sum(r.others_cpu_s for r in readings),
                      resolution_cpu_s=sum(r.resolution_cpu_s for r in readings),
                      cpus=max(r.cpus for r in readings),
                      gpu_other_pids=tuple(sorted({p for r in readings for p in r.gpu_other_pids})))


class GpuProcesses:
    """The processes other than this one that NVML lists on the GPU(s) a device string names
    (``cuda`` / ``cuda:N``: CUDA index N of the visible devices). NVML stays initialised while
    the object lives; a device NVML cannot list contributes nothing."""

    def __init__(self, device: str, env: dict[str, str] | None = None, own_pid: int | None = None):
        from mtad_energy.measure._nvml import init_nvml, visible_devices

        index = int(device.split(":", 1)[1]) if ":" in device else 0
        self.own = os.getpid() if own_pid is None else own_pid
        self.pynvml = init_nvml()
        devices, _ = visible_devices(self.pynvml, os.environ if env is None else env)
        self.handles = [d.handle for d in devices if d.cuda_index == index]

    def __call__(self) -> set[int]:
        pids: set[int] = set()
        for handle in self.handles:
            try:
                procs = self.pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except self.pynvml.NVMLError:
                continue
            pids |= {p.pid for p in procs if p.pid != self.own}
        return pids

    def close(self) -> None:
        from mtad_energy.measure._nvml import shutdown_nvml

        shutdown_nvml(self.pynvml)


def gpu_processes(device: str) -> Callable[[], set[int]] | None:
    """`GpuProcesses` for a CUDA device, None for the CPU or where NVML cannot start."""
    if not device.startswith("cuda"):
        return None
    from mtad_energy.measure.base import MeterUnavailableError

    try:
        return GpuProcesses(device)
    except MeterUnavailableError:
        return None


class ContentionProbe:
    """Window-scoped: `begin(key)` reads the counters, `end(key)` returns the window's
    `Contention`. Readers and the clock are injectable (tests feed fake /proc text); without
    /proc (not Linux) `begin` records nothing and `end` returns None."""

    def __init__(self, *, proc_stat: Reader = PROC_STAT, self_stat: Reader = SELF_STAT,
                 clock: Callable[[], float] = time.perf_counter, hz: int | None = None,
                 gpu_pids: Callable[[], set[int]] | None = None,
                 tree: Callable[[Iterable[int]], dict[int, int]] = process_tree):
        self.proc_stat, self.self_stat, self.clock = proc_stat, self_stat, clock
        self.hz = hz or clock_ticks_per_s()
        self.gpu_pids, self.tree = gpu_pids, tree
        self._open: dict[str, tuple[CpuSample, set[int], tuple[int, ...]]] = {}

    def sample(self, own: Sequence[int] = ()) -> CpuSample | None:
        """The counters now; ``own``: the roots of processes whose ticks count as this one's."""
        try:
            busy, cpus = parse_proc_stat(self.proc_stat())
            mine = parse_self_stat(self.self_stat())
        except (OSError, ValueError, IndexError):
            return None
        theirs = self.tree(own) if own else {}
        return CpuSample(busy, mine + sum(theirs.values()), cpus, self.clock(), frozenset(theirs))

    def begin(self, key: str, own: Sequence[int] = ()) -> None:
        """Open window ``key``; ``own``: pids of processes doing this window's work (an engine's),
        counted with their descendants as this process."""
        start = self.sample(own)
        if start is not None:
            self._open[key] = (start, self.gpu_pids() if self.gpu_pids else set(), tuple(own))

    def end(self, key: str) -> Contention | None:
        opened = self._open.pop(key, None)
        if opened is None:
            return None
        start, pids, own = opened
        end = self.sample(own)
        if end is None:
            return None
        pids |= self.gpu_pids() if self.gpu_pids else set()
        return between(start, end, self.hz, pids - start.own_pids - end.own_pids)


def sample_load(seconds: float = LOAD_SAMPLE_S, probe: ContentionProbe | None = None,
                sleep: Callable[[float], object] = time.sleep) -> Contention | None:
    """What other processes use right now: a window of ``seconds`` in which this process sleeps."""
    probe = probe or ContentionProbe()
    probe.begin("load")
    sleep(seconds)
    return probe.end("load")


def busy_warning(reading: Contention | None) -> str | None:
    """The warning before a long sweep on a busy machine (None when it is quiet or unknown)."""
    if reading is None or not reading.contended:
        return None
    return (f"the machine is busy: {reading.describe()} before starting; the rows measured "
            "while it is are flagged contended (their speed and energy are not this decoder's "
            "alone). Stop the other work, or compare only rows measured under the same load")


def machine_load(seconds: float = LOAD_SAMPLE_S, probe: ContentionProbe | None = None,
                 sleep: Callable[[float], object] = time.sleep) -> dict[str, Any]:
    """What a sweep reports before it starts (`sample_load`): ``others_cores`` (None without
    /proc), ``contended`` and ``warning`` (`busy_warning`; None on a quiet machine)."""
    reading = sample_load(seconds, probe, sleep)
    return {"others_cores": None if reading is None else round(reading.others_cores, 3),
            "contended": None if reading is None else reading.contended,
            "warning": busy_warning(reading)}


def passive_openmp_default(env: MutableMapping[str, str] | None = None) -> bool:
    """Set ``OMP_WAIT_POLICY=passive`` unless the user set a policy (True when set): OpenMP
    threads that spin while they wait collapse when another process holds the cores (``ar`` on
    the default pair, 2 cores, one competing process: 0.38 tok/s spinning, 1.10 passive).
    OpenMP reads it when torch loads it, so the CLI calls this before importing torch; a library
    user sets the variable before ``import torch``."""
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" in env:
        return False
    env["OMP_WAIT_POLICY"] = "passive"
    return True


def row_contention(readings: Iterable[Contention | None]) -> dict[str, Any]:
    """A row's contention columns from its windows' readings (None columns when unprobed)."""
    combined = combine([r for r in readings if r is not None])
    if combined is None:
        return {"others_cpu_s": None, "others_cores": None, "gpu_other_pids": "[]",
                "contended": None}
    return combined.columns()
