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

import os
import socket
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError
from submitit.helpers import DelayedSubmission

from mtad_energy.config import RunConfig
from mtad_energy.results.store import ResultStore

CLUSTERS = ("local", "slurm", "debug")
_LOG_TAIL_LINES = 40


class SweepError(RuntimeError):
    """One or more shards failed; rows the other shards stored are kept (re-submit to resume)."""


def run_shard(config_json: str, store_dir: str, shard_index: int, shard_count: int) -> dict[str, Any]:
    """What one job runs: shard ``shard_index`` of ``shard_count`` of the configuration, into the
    store; returns a small JSON-able summary."""
    # imported here so that submitting (on a login node, say) does not need torch
    from mtad_energy.bench.runner import quality_scorer, run_profile

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
    """Submit one job per shard of ``config`` (``workers`` shards) writing into ``store_dir``.

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
        jobs = []
        for i, gpus in enumerate(gpu_slices):
            local.update_parameters(timeout_min=timeout_min, tasks_per_node=1, nodes=1,
                                    gpus_per_node=len(gpus), visible_gpus=gpus)
            jobs.append(local.submit(run_shard, *args, i, workers))
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


def wait(jobs: Sequence[submitit.Job]) -> list[dict[str, Any]]:
    """Wait for every job; their summaries in shard order. Raises `SweepError` naming each failed
    shard with the end of its error log once all jobs have ended."""
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
