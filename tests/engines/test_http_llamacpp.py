"""A real server under the instrument: llama-cpp-python's OpenAI-compatible server
(``python -m llama_cpp.server``) started on a free 127.0.0.1 port with the bundled SmolLM2 GGUF,
measured by ``compare --engine hf,http://127.0.0.1:PORT --decoders ar,pld`` beside the project's
own decoders (the server runs ar, its pld skipped and said so).
Skipped cleanly without the server extra of llama-cpp-python (pip install "llama-cpp-python[server]")."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("prometheus_client", reason='needs prometheus-client: pip install -e ".[server]"')
pytest.importorskip("llama_cpp.server.app",
                    reason='needs llama-cpp-python\'s server: pip install "llama-cpp-python[server]"')

from typer.testing import CliRunner  # noqa: E402

from mtad_energy.cli import app  # noqa: E402
from mtad_energy.results import ResultStore  # noqa: E402
from tests.engines.real_servers import ServerFailed, llamacpp_command, running  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.smollm2]
NEW = 12


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """llama_cpp.server on a free port, one thread, until the module ends (`real_servers`)."""
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    try:
        with running(llamacpp_command, log) as (url, _pid):
            yield url
    except ServerFailed as error:
        pytest.fail(str(error))


def test_compare_measures_a_real_llamacpp_server_beside_hf(server_url, tmp_path):
    # llama_cpp.server takes text prompts only (the ids are decoded by the target's tokenizer)
    # and streams no token ids: its per-token logprobs count the tokens
    res = CliRunner().invoke(app, [
        "compare", "--engine", f"hf,{server_url}", "--decoders", "ar,pld", "--model", "smollm2",
        "--meter", "none", "--dataset", "mtbench", "--n-prompts", "1", "--max-new-tokens",
        str(NEW), "--set", "temperature=0", "--device", "cpu",
        "--engine-option", "prompt=text,logprobs=true", "--output", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    runs = ResultStore(tmp_path / "s").load("runs").set_index("engine")
    assert set(runs.index) == {"hf", "http"}
    # each engine the decoders it has: hf both, the server ar (pld skipped for it, said so)
    assert sorted(runs.loc["hf", "decoder"]) == ["ar", "pld"]
    assert f"engine {server_url} has no decoder pld: skipped for it" in " ".join(res.output.split())
    row = runs.loc["http"]
    assert row["model"] == f"smollm2+http@{server_url.removeprefix('http://')}"
    assert 0 < row["tokens_emitted"] <= NEW
    assert row["prefill_time_s"] > 0 and row["decode_time_s"] > 0 and row["tokens_per_s"] > 0
    assert row["decode_tokens"] == row["tokens_emitted"] - 1  # one request: its first token is TTFT
    steps = ResultStore(tmp_path / "s").load("steps")
    mine = steps[steps["run_key"] == row["run_key"]]
    assert mine["emitted"].sum() == row["tokens_emitted"]
    assert mine["time_other_s"].iloc[1:].gt(0).all()  # inter-token times, as streamed
    config = json.loads(row["engine_config"])
    assert config["base_url"] == server_url and config["acceptance"].startswith("None: ")
    # llama_cpp.server has no /version and owns its model as "me": no version, with the reason;
    # its model id is the GGUF's full path, named by the file's stem
    version = row["engine_version"]
    assert version is None or version != version  # None / NaN beside hf's version string
    assert config["version"].startswith("None: the server states no version")
    from mtad_energy.models import smollm2_gguf_path

    assert config["model"] == smollm2_gguf_path().stem
    assert config["model_id"] == str(smollm2_gguf_path())
    assert row["acceptance_rate"] is None or row["acceptance_rate"] != row["acceptance_rate"]
