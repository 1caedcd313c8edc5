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

from mtad_energy.bench.scaleout import SweepError, run_shard, submit_sweep, wait
from mtad_energy.config import DecoderSpec, MeasureConfig, ModelSpec, RunConfig
from mtad_energy.results import ResultStore, load_results
from tests import tiny

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


@pytest.mark.slow
def test_local_workers_are_concurrent_processes_writing_one_store(sweep, tmp_path):
    store = tmp_path / "store"
    t0 = time.perf_counter()
    summaries = wait(submit_sweep(sweep, store, workers=2, cluster="local", gpus_per_worker=0,
                                  timeout_min=5))
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


def test_each_local_job_gets_its_own_gpu(sweep, tmp_path, two_gpus, launched, monkeypatch):
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


def test_without_a_gpu_local_workers_run_on_the_cpu(sweep, tmp_path, launched, monkeypatch):
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
