"""Scale-out on submitit: shards in-process (debug), as concurrent local subprocesses sharing one
store, resume by re-submission, per-job GPU assignment, the SLURM batch script, failures."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import submitit
import torch

from mtad_energy.bench import scaleout
from mtad_energy.bench.scaleout import SweepError, run_shard, submit_sweep, wait
from mtad_energy.config import DecoderSpec, MeasureConfig, ModelSpec, RunConfig
from mtad_energy.results import ResultStore, load_results
from tests import tiny
from tests.limits import hang_limit_s

STAND_IN_S = 3600  # a stand-in job's `sleep`: ends only when stopped, within any hang guard

N_PROMPTS, DECODERS = 3, (DecoderSpec("ar"), DecoderSpec("spd"))


@pytest.fixture
def sweep(tmp_path) -> RunConfig:
    """A configuration that a fresh process can run: models and prompts are files in tmp_path."""
    tok = tiny.word_tokenizer(64)
    target = tiny.save(tiny.llama(64, 0, layers=1), tok, tmp_path / "target")
    draft = tiny.save(tiny.llama(64, 1, layers=1), tok, tmp_path / "draft")
    prompts = tmp_path / "toy.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w3 w{7 + i} w9 w{20 + i}"}) + "\n"
                               for i in range(N_PROMPTS)))
    return RunConfig(decoders=DECODERS, model=ModelSpec(alias=None, target=target, draft=draft),
                     datasets=(str(prompts),), n_prompts=N_PROMPTS, max_new_tokens=4,
                     measure=MeasureConfig("none", "off"))


def assert_complete(store) -> None:
    runs = load_results(store)  # also checks the store holds no foreign or temporary file
    assert len(runs) == N_PROMPTS * len(DECODERS) and runs["run_key"].is_unique
    assert set(zip(runs["prompt_id"], runs["decoder"], strict=True)) == {
        (f"p{i}", d.name) for i in range(N_PROMPTS) for d in DECODERS}


def test_debug_cluster_runs_every_shard_into_one_store(sweep, tmp_path):
    store = tmp_path / "store"
    summaries = wait(submit_sweep(sweep, store, workers=2, cluster="debug"))
    assert [s["shard_index"] for s in summaries] == [0, 1]
    assert [s["ran"] for s in summaries] == [3, 3] and sum(s["skipped"] for s in summaries) == 0
    assert {s["meter"] for s in summaries} == {"none"}
    json.dumps(summaries)  # small and JSON-able
    assert_complete(store)


def test_resubmitting_skips_everything_whatever_the_sharding(sweep, tmp_path):
    store = tmp_path / "store"
    wait(submit_sweep(sweep, store, workers=2, cluster="debug"))
    again = wait(submit_sweep(sweep, store, workers=3, cluster="debug"))
    assert sum(s["ran"] for s in again) == 0
    assert sum(s["skipped"] for s in again) == N_PROMPTS * len(DECODERS)
    assert_complete(store)


@pytest.fixture
def roomy(monkeypatch):
    """A machine with enough cores and memory for several CPU jobs (the bounds are tested apart)."""
    monkeypatch.setattr(scaleout, "_cpu_count", lambda: 64)
    monkeypatch.setattr(scaleout, "_available_memory_bytes", lambda: 1 << 40)


@pytest.mark.slow
def test_local_workers_are_concurrent_processes_writing_one_store(sweep, tmp_path, roomy):
    store = tmp_path / "store"
    t0 = time.perf_counter()
    summaries = wait(submit_sweep(sweep, store, workers=2, cluster="local", gpus_per_worker=0,
                                  timeout_min=60))
    print(f"2 local workers: {time.perf_counter() - t0:.1f} s")
    pids = {s["pid"] for s in summaries}
    assert len(pids) == 2 and os.getpid() not in pids
    assert max(s["started_unix_s"] for s in summaries) < min(s["finished_unix_s"] for s in summaries)
    assert [s["cuda_visible_devices"] for s in summaries] == ["", ""]  # no GPU for CPU workers
    assert sum(s["ran"] for s in summaries) == N_PROMPTS * len(DECODERS)
    assert_complete(store)
    assert len(list((tmp_path / "store.submitit").glob("*_log.out"))) == 2  # next to the store


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each job LocalExecutor starts (a no-op process stands in for it)."""
    seen: list[str] = []
    procs: list[subprocess.Popen] = []

    def start_controller(**kwargs):
        seen.append(kwargs["cuda_devices"])
        procs.append(subprocess.Popen(["true"]))
        return procs[-1]

    monkeypatch.setattr(submitit.local.local, "start_controller", start_controller)
    yield seen
    for p in procs:
        p.wait()


def test_more_workers_than_gpus_is_refused(sweep, tmp_path, two_gpus, launched):
    with pytest.raises(ValueError, match=r"need 3 GPUs.* 2 visible GPU.*pass workers=2 or fewer"):
        submit_sweep(sweep, tmp_path / "store", workers=3)
    with pytest.raises(ValueError, match=r"need 4 GPUs.*pass workers=1 or fewer"):
        submit_sweep(sweep, tmp_path / "store", workers=2, gpus_per_worker=2)
    with pytest.raises(ValueError, match=r"pass gpus_per_worker=2 or fewer"):
        submit_sweep(sweep, tmp_path / "store", workers=1, gpus_per_worker=3)
    assert launched == []  # refused before anything started


def test_each_local_job_gets_its_own_gpu(sweep, tmp_path, two_gpus, launched, monkeypatch, roomy):
    submit_sweep(sweep, tmp_path / "a", workers=2)
    submit_sweep(sweep, tmp_path / "b", workers=1, gpus_per_worker=2)
    submit_sweep(sweep, tmp_path / "c", workers=3, gpus_per_worker=0)  # CPU run: no GPU count needed
    # a child's CUDA_VISIBLE_DEVICES replaces the parent's, so it names the parent's physical GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    submit_sweep(sweep, tmp_path / "d", workers=2)
    assert launched == ["0", "1", "0,1", "", "", "", "3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb")
    with pytest.raises(ValueError, match="by index"):
        submit_sweep(sweep, tmp_path / "e", workers=2)


def test_without_a_gpu_local_workers_run_on_the_cpu(sweep, tmp_path, launched, monkeypatch, roomy):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.warns(UserWarning, match="no GPU is visible: running 2 CPU worker"):
        submit_sweep(sweep, tmp_path / "store", workers=2)
    assert launched == ["", ""]


def test_slurm_submits_one_array_with_a_gpu_per_task(sweep, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").write_text('#!/bin/sh\necho "Submitted batch job 4242"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    jobs = submit_sweep(sweep, tmp_path / "store", workers=2, cluster="slurm", timeout_min=30,
                        slurm_partition="gpu", slurm_extra={"account": "proj", "cpus_per_task": 4})
    assert [j.job_id for j in jobs] == ["4242_0", "4242_1"]
    assert [j.submission().args[2:] for j in jobs] == [(0, 2), (1, 2)]
    script = next((tmp_path / "store.submitit").glob("*_submission.sh")).read_text()
    for flag in ("--array=0-1%2", "--gpus-per-node=1", "--ntasks-per-node=1", "--partition=gpu",
                 "--account=proj", "--cpus-per-task=4", "--time=30", "--job-name=mtad-profile"):
        assert f"#SBATCH {flag}\n" in script
    submit_sweep(sweep, tmp_path / "store", workers=2, cluster="slurm", gpus_per_worker=0,
                 folder=tmp_path / "cpu-logs")
    assert "--gpus" not in next((tmp_path / "cpu-logs").glob("*_submission.sh")).read_text()


def test_a_failed_shard_is_reported_with_its_error(sweep, tmp_path):
    broken = RunConfig.from_dict(sweep.to_dict() | {"datasets": [str(tmp_path / "missing.jsonl")]})
    with pytest.raises(SweepError, match=r"2 of 2 shard\(s\) failed(.|\n)*shard 0 of 2(.|\n)*"
                                         r"missing.jsonl does not exist"):
        wait(submit_sweep(broken, tmp_path / "store", workers=2, cluster="debug"))


def test_submitit_folder_inside_the_store_is_refused(sweep, tmp_path):
    with pytest.raises(ValueError, match="inside the results store"):
        submit_sweep(sweep, tmp_path / "store", workers=1, cluster="debug",
                     folder=tmp_path / "store" / "logs")


def test_workers_leave_each_others_temporaries_alone(tmp_path):
    ResultStore(tmp_path / "s")
    (tmp_path / "s" / "runs").mkdir()
    inflight = tmp_path / "s" / "runs" / ".tmp-0000-0123456789abcdef.parquet"
    inflight.write_bytes(b"half a parquet file")
    store = ResultStore(tmp_path / "s", create=False)  # what a worker opens mid-sweep
    assert inflight.exists()  # young: it may be another worker's write in flight
    assert store.load("runs").empty  # and it is not a row


def test_a_preempted_shard_requeues_itself():
    again = run_shard.checkpoint("{}", "/store", 1, 4)
    assert again.function is run_shard and again.args == ("{}", "/store", 1, 4)


# -- how many jobs, and that they end with the command that started them ----------------------------
def test_plan_jobs_bounds_by_units_cores_and_memory():
    gib = 1 << 30
    assert scaleout.plan_jobs(100, 1, "local", cpu_jobs=True, cpus=2, free_bytes=64 * gib,
                              job_bytes=gib)[0] == 1
    n, why = scaleout.plan_jobs(100, 50, "local", cpu_jobs=True, cpus=16, free_bytes=64 * gib,
                                job_bytes=gib)
    assert n == 8 and "16 core(s)" in why[-1]
    n, why = scaleout.plan_jobs(8, 50, "local", cpu_jobs=True, cpus=64, free_bytes=int(3.5 * gib),
                                job_bytes=gib)
    assert n == 3 and "GiB is available" in why[-1]
    assert scaleout.plan_jobs(8, 50, "local", cpu_jobs=True, cpus=1, free_bytes=0, job_bytes=gib)[0] == 1
    # GPU jobs and clusters: only the work units bound them (GPUs are checked by _local_gpu_slices)
    assert scaleout.plan_jobs(100, 6, "slurm") == (6, ["100 worker(s) asked for but there are only 6 "
                                                        "work unit(s)"])
    assert scaleout.plan_jobs(4, 6, "local", cpus=2, free_bytes=0, job_bytes=gib) == (4, [])
    assert scaleout.plan_jobs(4, None, "debug") == (4, [])  # units unknown: as asked


def test_never_more_local_jobs_than_units_cores_or_memory(sweep, tmp_path, launched, monkeypatch):
    monkeypatch.setattr(scaleout, "_available_memory_bytes", lambda: 1 << 40)
    monkeypatch.setattr(scaleout, "_cpu_count", lambda: 64)
    with pytest.warns(UserWarning, match=r"starting 6 job\(s\) instead of 100: .*only 6 work unit"):
        assert len(submit_sweep(sweep, tmp_path / "a", workers=100, gpus_per_worker=0)) == 6
    monkeypatch.setattr(scaleout, "_cpu_count", lambda: 2)
    with pytest.warns(UserWarning, match=r"starting 1 job\(s\) instead of 4: .*2 core"):
        assert len(submit_sweep(sweep, tmp_path / "b", workers=4, gpus_per_worker=0)) == 1
    monkeypatch.setattr(scaleout, "_cpu_count", lambda: 64)
    monkeypatch.setattr(scaleout, "_available_memory_bytes", lambda: 3 << 30)
    with pytest.warns(UserWarning, match=r"starting 2 job\(s\) instead of 4: .*GiB is available"):
        assert len(submit_sweep(sweep, tmp_path / "c", workers=4, gpus_per_worker=0)) == 2
    assert launched == [""] * 9


def test_cli_100_workers_for_one_unit_start_one_local_job(model_dirs, tmp_path):
    from typer.testing import CliRunner

    from mtad_energy.cli import app

    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"id": "p0", "prompt": "w3 w9 w4"}) + "\n")
    res = CliRunner().invoke(app, ["profile", "--decoder", "ar", "--target", model_dirs["llama"],
                                   "--meter", "none", "--max-new-tokens", "3", "--dataset", str(data),
                                   "--n-prompts", "1", "--workers", "100", "--cluster", "local",
                                   "--output", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert len(out["jobs"]) == 1 and out["ran"] == 1
    assert "starting 1 job(s) instead of 100" in res.stderr


@pytest.fixture
def sleepers(monkeypatch) -> list[subprocess.Popen]:
    """Local jobs that run until stopped (a `sleep` stands in for each job's controller)."""
    procs: list[subprocess.Popen] = []

    def start_controller(**kwargs):
        procs.append(subprocess.Popen(["sleep", str(STAND_IN_S)]))
        return procs[-1]

    monkeypatch.setattr(submitit.local.local, "start_controller", start_controller)
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _ends(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` ends within a hang guard (a signalled process is reaped a moment after
    the signal, later on a loaded machine; an uncancelled stand-in sleeps far longer)."""
    try:
        proc.wait(timeout=hang_limit_s(10, cap_s=STAND_IN_S / 2))
    except subprocess.TimeoutExpired:
        return False
    return True


def test_sigterm_while_waiting_stops_the_local_jobs(sweep, tmp_path, sleepers, roomy):
    import signal
    import threading

    jobs = submit_sweep(sweep, tmp_path / "store", workers=2, gpus_per_worker=0)
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(SystemExit) as exc:
        wait(jobs)
    assert exc.value.code == 128 + signal.SIGTERM
    assert len(sleepers) == 2 and all(_ends(p) for p in sleepers)  # cancelled, ended
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is restored


def test_a_job_that_ignores_the_cancel_is_killed(sweep, tmp_path, monkeypatch, roomy):
    """A controller started from a non-interactive shell's background (`nohup ... &`) inherits
    SIGINT ignored, so submitit's cancel (a SIGINT) does not stop it: after the grace it is
    killed."""
    import signal
    import threading

    procs: list[subprocess.Popen] = []

    def start_controller(**kwargs):
        procs.append(subprocess.Popen(["sleep", str(STAND_IN_S)], preexec_fn=lambda: signal.signal(
            signal.SIGINT, signal.SIG_IGN)))
        return procs[-1]

    monkeypatch.setattr(submitit.local.local, "start_controller", start_controller)
    monkeypatch.setattr(scaleout, "CANCEL_GRACE_S", 0.5)
    try:
        jobs = submit_sweep(sweep, tmp_path / "store", workers=2, gpus_per_worker=0)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(SystemExit):
            wait(jobs)
        assert len(procs) == 2 and all(_ends(p) for p in procs)
        assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_job_notices_when_its_parent_has_ended():
    import threading

    parent = subprocess.Popen(["sleep", "60"])
    token = scaleout._process_token(parent.pid)
    assert token is not None
    gone = threading.Event()
    scaleout.watch_parent(parent.pid, token, gone.set, period_s=0.05)
    assert not gone.wait(0.3)
    parent.kill()  # SIGKILL: it cannot tell anyone; a zombie counts as ended
    assert gone.wait(hang_limit_s(5))
    parent.wait()
    reused = threading.Event()  # same pid, another process (its start time differs)
    scaleout.watch_parent(os.getpid(), "not-my-start-time", reused.set, period_s=0.05)
    assert reused.wait(5.0)


PARENT = """
import sys, time
from mtad_energy.bench.scaleout import submit_sweep
from mtad_energy.config import RunConfig
jobs = submit_sweep(RunConfig.from_json(sys.argv[1]), sys.argv[2], workers=1, cluster="local",
                    gpus_per_worker=0, timeout_min=5)
print(jobs[0].job_id, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_local_jobs_die_when_the_submitting_process_is_killed(sweep, tmp_path):
    import signal

    long = RunConfig.from_dict(sweep.to_dict() | {"repeats": 200})  # 1200 rows: minutes of work
    store = tmp_path / "store"
    parent = subprocess.Popen([os.sys.executable, "-c", PARENT, long.to_json(), str(store)],
                              stdout=subprocess.PIPE, text=True)
    controller = int(parent.stdout.readline())
    runs = store / "runs"
    deadline = time.monotonic() + hang_limit_s(120)
    while not (runs.is_dir() and any(runs.glob("*.parquet"))):  # the job is writing rows
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.2)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + hang_limit_s(30)
    while scaleout._process_token(controller) is not None:
        assert time.monotonic() < deadline, "the local job outlived the process that submitted it"
        time.sleep(0.2)
    n = len(list(runs.glob("*.parquet")))
    time.sleep(2.0)
    assert len(list(runs.glob("*.parquet"))) == n < 1200  # nothing writes any more
    assert "has ended: stopping" in next((tmp_path / "store.submitit").glob("*_log.out")).read_text()
