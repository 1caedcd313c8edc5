"""A served engine's rows (`engines.http`), against the small server of
`tests.engines.openai_server`: block efficiency from the server's counted steps, the version only
where the server states one, a readable model name, and `compare` running each engine of
``--engine`` the decoders it has (the others skipped and said so, a decoder none has refused)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("prometheus_client", reason='needs prometheus-client: pip install -e ".[server]"')

from mtad_energy.cli import app  # noqa: E402
from mtad_energy.engines.http import readable_model, target_steps  # noqa: E402
from mtad_energy.results import ResultStore  # noqa: E402
from tests import tiny  # noqa: E402
from tests.conftest import VOCAB  # noqa: E402
from tests.engines.openai_server import Behaviour, free_port, serve  # noqa: E402
from tests.engines.test_http import engine_at, generate, runner  # noqa: E402


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return tiny.save(tiny.llama(VOCAB, 0, layers=2), tiny.word_tokenizer(VOCAB),
                     tmp_path_factory.mktemp("http-rows") / "llama")


# -- block efficiency from the server's steps ---------------------------------------------------
def test_target_steps_are_the_first_token_the_drafting_steps_and_the_steps_without_a_draft():
    assert target_steps([8], drafts=2, accepted=3) == 5  # 1 + 2 + (7 - 2 drafting - 3 kept)
    assert target_steps([7], drafts=2, accepted=4) == 3  # every step after the first drafted
    assert target_steps([8], drafts=0, accepted=0) == 8  # no speculation: a token a step
    assert target_steps([6], drafts=2, accepted=4) == 3  # the last step cut: a lower bound
    assert target_steps([8, 8], drafts=4, accepted=6) == 10  # a batch: its steps together
    assert target_steps([8], drafts=None, accepted=3) is None  # no count of drafting steps


@pytest.mark.parametrize("where, block, forwards", [
    ("metrics", 8 / 5, 5), ("vllm", 8 / 5, 5), ("trtllm", 8 / 5, 5), ("llamacpp", None, None)])
def test_a_served_rows_block_efficiency_is_tokens_per_target_step_where_steps_are_counted(
        where, block, forwards):
    """8 tokens, 2 drafting steps, 3 draft tokens accepted (the prompt's length): 5 target
    steps, from vLLM's counters or from a body counting its steps; llama-server's timings count
    no steps, so None, with the reason in engine_config."""
    behaviour = Behaviour(spec=(2, 6, 3), metrics="spec" if where == "metrics" else None,
                          body=None if where == "metrics" else where)
    with serve(behaviour) as (url, _):
        engine = engine_at(url)
        s = generate(engine, [[1, 2, 3]], new=8)[0].stats
    assert (s.tokens_emitted, s.draft_accepted) == (8, 3)
    assert s.block_efficiency == (pytest.approx(block) if block else None)
    assert s.target_forwards == forwards
    assert "llama-server's timings" in engine.config["block_efficiency"]


def test_a_batch_from_metrics_gets_the_batchs_block_efficiency_and_no_forwards_per_row():
    with serve(Behaviour(spec=(2, 6, 3), together=2)) as (url, _):
        gens = generate(engine_at(url), [[1], [2]], new=8)
    # 16 tokens, 4 drafting steps, 6 accepted: 2 + 4 + (14 - 4 - 6) = 10 steps
    assert [g.stats.block_efficiency for g in gens] == [pytest.approx(1.6)] * 2
    assert [g.stats.target_forwards for g in gens] == [None, None]


# -- the server's version and its model's name ----------------------------------------------------
def test_a_server_stating_no_version_has_none_with_the_reason_and_a_gguf_path_a_readable_name():
    gguf = "/srv/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    with serve(Behaviour(models=(gguf,), version=None)) as (url, state):
        engine = engine_at(url)
        generate(engine, [[1, 2]])
    assert state.requests[-1]["model"] == gguf  # requests name the server's own id
    assert engine.version is None  # its owner ("fake", llama_cpp.server's "me") is no version
    assert engine.config["version"].startswith("None: the server states no version")
    assert "'fake'" in engine.config["version"]
    assert engine.config["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert engine.config["model_id"] == engine.config["server_model"]["id"] == gguf
    with serve() as (url, _):
        engine = engine_at(url)
    assert engine.version == "fake 0.0-test" and "version" not in engine.config


def test_a_readable_model_name_is_a_paths_file_stem_and_any_other_id_as_it_is():
    assert readable_model("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert readable_model("C:\\m\\tiny.GGUF") == "tiny"
    assert readable_model("/work/models/SmolLM2-1.7B") == "SmolLM2-1.7B"  # a folder: its name
    assert readable_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub id: as it is
    assert readable_model("smollm2") == "smollm2"


# -- compare: each engine its own decoders ---------------------------------------------------------
def test_compare_runs_each_engine_the_decoders_it_has_and_says_which_it_skipped(target, tmp_path):
    """`compare --engine hf,URL --decoders ar,pld`: hf runs both, the server ar (its own
    speculation is its configuration); the skip is said in the notes and the JSON document."""
    with serve(Behaviour(vocab=VOCAB)) as (url, _):
        res = runner.invoke(app, ["compare", "--engine", f"hf,{url}", "--decoders", "ar,pld",
                                  "--target", target, "--meter", "none", "--dataset", "mtbench",
                                  "--n-prompts", "1", "--max-new-tokens", "6", "--device", "cpu",
                                  "--output", str(tmp_path / "s"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["decoders_skipped"] == {url: ["pld"]}
    assert f"engine {url} has no decoder pld: skipped for it (it runs ar)" in doc["notes"]
    runs = ResultStore(tmp_path / "s").load("runs")
    assert sorted(zip(runs["engine"], runs["decoder"], strict=True)) == [
        ("hf", "ar"), ("hf", "pld"), ("http", "ar")]


def test_compare_refuses_only_a_decoder_no_listed_engine_has_before_anything_loads(tmp_path):
    one, two = (f"http://127.0.0.1:{free_port()}" for _ in range(2))  # nothing listens there
    for engines, message in ((f"{one},{two}", f"no engine of --engine {one},{two} has decoder "
                                              f"pld ({one} runs ar; {two} runs ar)"),
                             (one, "engine 'http' has no decoder 'pld'; it runs ar")):
        res = runner.invoke(app, ["compare", "--engine", engines, "--decoders", "ar,pld",
                                  "--target", str(tmp_path / "no-model"), "--output",
                                  str(tmp_path / "s"), "--json"])
        assert res.exit_code == 2, res.output  # not 1: no server was asked, no model looked up
        assert message in json.loads(res.stdout)["error"]
    assert not (tmp_path / "s").exists()
