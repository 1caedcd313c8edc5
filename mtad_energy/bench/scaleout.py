"""Run one profile configuration as several shards in parallel, on SLURM or on one multi-GPU box.

Built on submitit rather than Ray: a sweep is a batch of independent, long, GPU-exclusive jobs,
which is exactly SLURM's model on the clusters these benchmarks run on, and submitit submits
plain SLURM jobs with no head node or object store to keep alive; its LocalExecutor runs the same
code path as subprocesses on one machine. Each worker owns its GPU(s) so energy readings of
different workers never overlap, and every worker writes into the same results store (one part
file per row, renamed into place), so re-submitting a sweep resumes it.

On SLURM (run from a login node, with the store on a shared filesystem)::

    jobs = submit_sweep(config, "/shared/results/run1", workers=8, cluster="slurm",
                        slurm_partition="gpu", slurm_extra={"account": "proj", "cpus_per_task": 8})
    summaries = wait(jobs)   # or come back later: the rows are in the store either way

That submits one SLURM array of 8 tasks, each with ``--gpus-per-node=1``; SLURM confines each
task to its GPU. Anything else ``SlurmExecutor`` accepts (``qos``, ``constraint``,
``array_parallelism``, ``setup``, ``additional_parameters``, ...) goes into ``slurm_extra``.
Logs land in ``<store>.submitit`` next to the store. Paths in the configuration (datasets, local
models) must be visible from the compute nodes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError
from submitit.helpers import DelayedSubmission

from mtad_energy.config import RunConfig
from mtad_energy.results.store import ResultStore

CLUSTERS = ("local", "slurm", "debug")
_LOG_TAIL_LINES = 40
_JOB_OVERHEAD_BYTES = 1 << 30  # python, torch and activations of one CPU job, besides the weights
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class SweepError(RuntimeError):
    """One or more shards failed; rows the other shards stored are kept (re-submit to resume)."""


def _process_token(pid: int) -> str | None:
    """What identifies process ``pid`` across PID reuse: its start time (Linux), else "alive";
    None when no such process exists."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):  # a zombie has ended; nobody may reap it (e.g. in a container)
            return None
        return fields[19]  # field 22, starttime (fields counted after the command name)
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "alive"


def watch_parent(pid: int, token: str | None, on_gone: Callable[[], object],
                 period_s: float = 1.0) -> threading.Thread:
    """Call ``on_gone`` (once) when process ``pid`` (identified by ``token``, from `_process_token`)
    has ended; watches from a daemon thread. A local job uses it to die with the command that
    submitted it, even when that command is killed with SIGKILL and cannot cancel it."""

    def loop() -> None:
        while True:
            now = _process_token(pid)
            if now is None or (token is not None and now != token and now != "alive"):
                on_gone()
                return
            time.sleep(period_s)

    thread = threading.Thread(target=loop, name=f"watch-parent-{pid}", daemon=True)
    thread.start()
    return thread


def _parent_gone(pid: int) -> None:
    print(f"the process that submitted this job ({pid}) has ended: stopping (finished rows are "
          "stored; re-submit to resume)", flush=True)
    os._exit(1)


def run_shard(config_json: str, store_dir: str, shard_index: int, shard_count: int,
              parent: tuple[int, str | None] | None = None) -> dict[str, Any]:
    """What one job runs: shard ``shard_index`` of ``shard_count`` of the configuration, into the
    store; returns a small JSON-able summary. ``parent`` (pid, `_process_token`): local jobs end
    when that process does."""
    # imported here so that submitting (on a login node, say) does not need torch
    from mtad_energy.bench.runner import quality_scorer, run_profile

    if parent is not None:
        watch_parent(parent[0], parent[1], lambda: _parent_gone(parent[0]))
    started = time.time()
    config = RunConfig.from_json(config_json)
    store = ResultStore(store_dir, create=False)
    counts = {"ran": 0, "skipped": 0}

    def progress(row: dict[str, Any] | None, _unit: Any) -> None:
        # goes to the job's stdout log, to follow a long job with `tail -f`
        counts["skipped" if row is None else "ran"] += 1
        print(f"shard {shard_index}/{shard_count}: ran {counts['ran']}, skipped {counts['skipped']}",
              flush=True)

    report = run_profile(config, store, scorer=quality_scorer(config.allow_code_execution),
                         progress=progress, shard_index=shard_index, shard_count=shard_count)
    return {
        "shard_index": shard_index, "shard_count": shard_count, "ran": report.ran,
        "skipped": report.skipped, "meter": report.meter, "meter_reason": report.meter_reason,
        "env_id": report.env_id, "hostname": socket.gethostname(), "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "started_unix_s": started, "finished_unix_s": time.time(),
    }


def _requeue_shard(*args: Any, **kwargs: Any) -> DelayedSubmission:
    # submitit calls `function.checkpoint` on preemption or timeout and requeues what it returns;
    # running the same shard again resumes it, since finished rows are skipped
    return DelayedSubmission(run_shard, *args, **kwargs)


run_shard.checkpoint = _requeue_shard  # type: ignore[attr-defined]


def _visible_gpu_indices() -> list[int]:
    """Indices of the GPUs this process may use, as the child processes must name them."""
    import torch

    count = torch.cuda.device_count()
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    entries: list[str] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if entry.lstrip("-").isdigit() and int(entry) < 0:
            break  # CUDA ignores everything from the first negative index on
        if entry:
            entries.append(entry)
    entries = entries[:count]
    if not all(e.isdigit() for e in entries):
        # submitit's visible_gpus takes integers only (it sets CUDA_VISIBLE_DEVICES from them)
        raise ValueError(f"CUDA_VISIBLE_DEVICES={spec!r} names GPUs by UUID; for cluster='local' list "
                         "them by index (e.g. CUDA_VISIBLE_DEVICES=0,1) or unset it")
    # a child's CUDA_VISIBLE_DEVICES replaces ours, so it must name physical indices, not ours
    return [int(e) for e in entries]


def _available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _weights_bytes(config: RunConfig) -> int | None:
    """Size of the model files one job loads (local directories or the Hugging Face cache), or
    None when it cannot be told without downloading."""
    m = config.model
    target, draft = m.target, m.draft
    if m.alias:
        from mtad_energy.models import ALIASES

        spec = ALIASES.get(m.alias)
        if spec is not None:
            target, draft = target or spec.target, draft or spec.draft
    total = 0
    for ident in (target, draft):
        if not ident or ident.startswith("self:"):
            continue
        path = Path(ident)
        if not path.is_dir():
            try:
                from huggingface_hub import snapshot_download

                path = Path(snapshot_download(ident, local_files_only=True))
            except Exception:  # not cached (or not a hub id): unknown
                return None
        total += sum(f.stat().st_size for f in path.rglob("*") if f.suffix in _WEIGHT_SUFFIXES)
    return total


def plan_jobs(workers: int, units: int | None, cluster: str, *, cpu_jobs: bool = False,
              cpus: int | None = None, free_bytes: int | None = None,
              job_bytes: int | None = None) -> tuple[int, list[str]]:
    """How many jobs to start for ``workers`` asked for: never more than the ``units`` of work
    (None: unknown); local jobs without a GPU of their own (``cpu_jobs``) also at most one per two
    cores (``cpus``) and as many as the available memory holds (``free_bytes`` / ``job_bytes``).
    Returns the count and one line per reduction saying why."""
    n, why = workers, []
    if units is not None and n > max(1, units):
        n = max(1, units)
        why.append(f"{workers} worker(s) asked for but there are only {units} work unit(s)")
    if cluster == "local" and cpu_jobs:
        if cpus is not None and n > max(1, cpus // 2):
            n = max(1, cpus // 2)
            why.append(f"CPU jobs share this machine's {cpus} core(s): at most {n} (one per two cores)")
        if free_bytes is not None and job_bytes and n > max(1, free_bytes // job_bytes):
            n = max(1, free_bytes // job_bytes)
            why.append(f"each job needs about {job_bytes / 2**30:.1f} GiB and {free_bytes / 2**30:.1f} "
                       f"GiB is available: at most {n}")
    return n, why


def _local_gpu_slices(workers: int, gpus_per_worker: int) -> list[list[int]]:
    """The distinct GPUs each local worker gets, or a ValueError saying what fits."""
    if gpus_per_worker == 0:
        return [[] for _ in range(workers)]
    gpus = _visible_gpu_indices()
    if not gpus:
        warnings.warn(f"no GPU is visible: running {workers} CPU worker(s) (pass gpus_per_worker=0 "
                      "to say so)", stacklevel=3)
        return [[] for _ in range(workers)]
    need = workers * gpus_per_worker
    if need > len(gpus):
        fit = len(gpus) // gpus_per_worker
        hint = (f"pass workers={fit} or fewer" if fit else f"pass gpus_per_worker={len(gpus)} or fewer")
        raise ValueError(
            f"{workers} worker(s) x {gpus_per_worker} GPU(s) each need {need} GPUs, but this machine "
            f"has {len(gpus)} visible GPU(s) ({', '.join(map(str, gpus))}); {hint} (each worker owns "
            "its GPUs so energy readings do not overlap), or gpus_per_worker=0 for a CPU-only run")
    return [gpus[i * gpus_per_worker:(i + 1) * gpus_per_worker] for i in range(workers)]


def submit_sweep(config: RunConfig, store_dir: str | Path, *, workers: int, cluster: str = "local",
                 folder: str | Path | None = None, gpus_per_worker: int = 1, timeout_min: int = 720,
                 slurm_partition: str | None = None,
                 slurm_extra: dict[str, Any] | None = None) -> list[submitit.Job]:
    """Submit one job per shard of ``config`` (at most ``workers`` shards) writing into ``store_dir``.

    Never more jobs than work units; local jobs without a GPU of their own are also bounded by
    the cores and the available memory (`plan_jobs`; a warning says when fewer jobs start). Local
    jobs end with the submitting process: `wait` cancels them when it is interrupted (Ctrl-C,
    SIGTERM), and each job stops by itself when the submitting process is gone (even SIGKILLed).

    cluster: ``"local"`` (subprocesses on this machine, one distinct GPU set per job),
    ``"slurm"`` (one array job) or ``"debug"`` (in this process, one shard after the other, when
    `wait` is called). ``folder`` holds submitit's pickles and logs (default: ``<store_dir>.submitit``
    next to the store). ``timeout_min`` is per job; a job that times out or is preempted is
    requeued and resumes where it stopped.
    """
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster must be one of {', '.join(CLUSTERS)}, got {cluster!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if gpus_per_worker < 0:
        raise ValueError(f"gpus_per_worker must be >= 0, got {gpus_per_worker}")
    store_path = Path(store_dir).resolve()
    log_dir = Path(folder).resolve() if folder is not None else store_path.with_name(
        store_path.name + ".submitit")
    if log_dir == store_path or store_path in log_dir.parents:
        raise ValueError(f"the submitit folder {log_dir} is inside the results store {store_path}, "
                         "which refuses files it did not write; pick a folder outside it")
    cpu_jobs = cluster == "local" and (gpus_per_worker == 0 or not _visible_gpu_indices())
    weights = _weights_bytes(config) if cpu_jobs else None
    planned, why = plan_jobs(
        workers, _count_units(config), cluster, cpu_jobs=cpu_jobs,
        cpus=_cpu_count() if cpu_jobs else None,
        free_bytes=_available_memory_bytes() if cpu_jobs else None,
        # weights may be stored in 16 bits and run in fp32 on the CPU
        job_bytes=2 * (weights or 0) + _JOB_OVERHEAD_BYTES if cpu_jobs else None)
    if why:
        warnings.warn(f"starting {planned} job(s) instead of {workers}: " + "; ".join(why), stacklevel=2)
    workers = planned
    gpu_slices: list[list[int]] = []
    if cluster == "local":
        gpu_slices = _local_gpu_slices(workers, gpus_per_worker)
        if workers > 1 and not any(gpu_slices) and config.measure.meter not in ("none", "simulated"):
            warnings.warn("local workers without a GPU of their own share this machine's CPU: their "
                          "energy and time readings overlap; use meter 'none' or one worker",
                          stacklevel=2)
    if cluster != "slurm" and (config.measure.require_energy or config.measure.mitigate == "on"):
        # the jobs run on this machine: refuse here, once, rather than in every job
        from mtad_energy.measure import get_meter

        with get_meter(config.measure.meter) as meter:
            config.measure.mitigation_for(meter)
    # create and check the store once, before any worker opens it concurrently
    ResultStore(store_path)
    args = (config.to_json(), str(store_path))
    name = f"mtad-{config.sweep}"

    if cluster == "local":
        # AutoExecutor refuses local_visible_gpus (LocalExecutor only lists "setup" as valid), so
        # use LocalExecutor itself; it gives every job the same first GPUs unless visible_gpus
        # changes between submissions
        local = submitit.LocalExecutor(folder=log_dir)
        me = (os.getpid(), _process_token(os.getpid()))
        jobs = []
        for i, gpus in enumerate(gpu_slices):
            local.update_parameters(timeout_min=timeout_min, tasks_per_node=1, nodes=1,
                                    gpus_per_node=len(gpus), visible_gpus=gpus)
            jobs.append(local.submit(run_shard, *args, i, workers, parent=me))
        return jobs

    executor = submitit.AutoExecutor(folder=log_dir, cluster=cluster)
    # None leaves gpus_per_node unset: no GPU request at all rather than an explicit zero
    params: dict[str, Any] = {"name": name, "timeout_min": timeout_min, "nodes": 1, "tasks_per_node": 1,
                              "gpus_per_node": gpus_per_worker or None}
    if cluster == "slurm":
        params["slurm_partition"] = slurm_partition
        params.update({k if k.startswith("slurm_") else f"slurm_{k}": v
                       for k, v in (slurm_extra or {}).items()})
    executor.update_parameters(**params)
    n = workers
    return executor.map_array(run_shard, [args[0]] * n, [args[1]] * n, range(n), [n] * n)


def _tail(text: str | None, lines: int = _LOG_TAIL_LINES) -> str:
    return "\n".join((text or "").rstrip().splitlines()[-lines:])


def _count_units(config: RunConfig) -> int | None:
    """How many distinct work units ``config`` asks for (as `runner.work_units` counts them,
    without importing torch), or None when its prompts cannot be read here."""
    from mtad_energy.bench.prompts import load_prompts

    try:
        prompts = {p: None for name in config.datasets for p in load_prompts(name, config.n_prompts)}
    except Exception:  # e.g. a dataset only the compute nodes see; the jobs report it
        return None
    return len(prompts) * config.repeats * len(set(config.decoders))


class _Terminated(SystemExit):
    pass


CANCEL_GRACE_S = 10.0  # how long cancelled local jobs get to end before their controller is killed


def _all_done(jobs: Sequence[submitit.Job], timeout_s: float) -> bool:
    """Whether every job is done within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(not j.done() for j in jobs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


@contextlib.contextmanager
def _local_jobs_end_with_us(jobs: Sequence[submitit.Job]) -> Iterator[None]:
    """Cancel the unfinished local jobs when waiting ends by an exception (Ctrl-C, or SIGTERM,
    turned into one here). SLURM jobs are left running: their rows resume on re-submission."""
    local = [j for j in jobs if isinstance(j, submitit.local.local.LocalJob)]
    installed, previous = False, None
    if local and threading.current_thread() is threading.main_thread():
        def terminate(signum: int, _frame: Any) -> None:
            raise _Terminated(128 + signum)

        previous, installed = signal.signal(signal.SIGTERM, terminate), True
    try:
        yield
    except BaseException:
        running = [j for j in local if not j.done()]
        for job in running:
            job.cancel()  # SIGINT to its controller, which stops the task (then SIGKILLs it)
        if not _all_done(running, CANCEL_GRACE_S):
            # a controller that ignores SIGINT: one started from a non-interactive shell's
            # background (`nohup ... &`) inherits SIGINT ignored. Kill it; its task notices its
            # parent is gone and stops itself.
            for job in running:
                if not job.done():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(job.job_id), signal.SIGKILL)
            _all_done(running, CANCEL_GRACE_S)
        raise
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def wait(jobs: Sequence[submitit.Job]) -> list[dict[str, Any]]:
    """Wait for every job; their summaries in shard order. Raises `SweepError` naming each failed
    shard with the end of its error log once all jobs have ended. Interrupted, it cancels the
    local jobs still running (`_local_jobs_end_with_us`)."""
    with _local_jobs_end_with_us(jobs):
        return _wait(jobs)


def _wait(jobs: Sequence[submitit.Job]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    first: BaseException | None = None
    for i, job in enumerate(jobs):
        # exception() first: DebugJob.result() drops into pdb when the function raises
        err = job.exception()
        if err is None:
            results.append(job.result())
            continue
        first = first or err
        text = f"shard {i} of {len(jobs)} (job {job.job_id}) failed"
        log = _tail(job.stderr())
        if log:  # submitit logs the traceback there, after whatever the job wrote
            text += f"; end of {job.paths.stderr}:\n{log}"
        elif isinstance(err, FailedJobError | UncompletedJobError):
            text += f":\n{_tail(str(err))}"
        else:  # DebugJob ran in this process and hands back the raw exception
            text += f":\n{_tail(''.join(traceback.format_exception(err)))}"
        failures.append(text)
    if failures:
        message = (f"{len(failures)} of {len(jobs)} shard(s) failed; the rows already stored are kept, "
                   "re-submit the same sweep to finish it\n\n" + "\n\n".join(failures))
        raise SweepError(message) from first
    return results
