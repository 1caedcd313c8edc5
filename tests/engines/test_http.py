"""A running OpenAI-compatible server as an engine (`engines.http`), against the small server of
`tests.engines.openai_server` on 127.0.0.1: streamed windows, the server's own token counts,
acceptance from its /metrics, and every fault a clear error with no row stored for it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("prometheus_client", reason='needs prometheus-client: pip install -e ".[server]"')

from typer.testing import CliRunner  # noqa: E402

from mtad_energy.cli import app  # noqa: E402
from mtad_energy.engines import (  # noqa: E402
    EngineError,
    UnsupportedError,
    load_engine,
    model_suffix,
    parse_engines,
)
from mtad_energy.engines.http import acceptance_columns, remote_reason  # noqa: E402
from mtad_energy.results import ResultStore  # noqa: E402
from mtad_energy.specs import DecoderSpec, ModelSpec  # noqa: E402
from tests import tiny  # noqa: E402
from tests.conftest import VOCAB  # noqa: E402
from tests.engines.openai_server import Behaviour, free_port, serve  # noqa: E402

AR = DecoderSpec.of("ar", temperature="0")
runner = CliRunner()


def engine_at(url: str, **options):
    return load_engine(url, ModelSpec("smollm2"), options)


def generate(engine, prompts, new=7):
    phases: list[str] = []
    gens = engine.generate(AR, prompts, new, on_phase=phases.append)
    assert phases == ["prefill", "decode", "end"]
    return gens


# -- the URL as an engine name ------------------------------------------------------------------
def test_a_server_url_is_an_engine_and_a_malformed_one_is_refused():
    assert parse_engines("hf,http://127.0.0.1:8000/v1") == ["hf", "http://127.0.0.1:8000/v1"]
    # two servers' rows never pool: the label carries the server's address, never more of its URL
    assert model_suffix("http://127.0.0.1:8000/v1") == "+http@127.0.0.1:8000"
    assert model_suffix("http://127.0.0.1:8001") == "+http@127.0.0.1:8001"
    with pytest.raises(UnsupportedError, match="names one server twice"):
        parse_engines("http://127.0.0.1:8000,http://127.0.0.1:8000/v1")
    for bad in ("http://127.0.0.1", "http://:8000", "ftp://h:1", "http://h:1/v2/x", "http://h:x"):
        with pytest.raises(UnsupportedError, match="http://HOST:PORT"):
            parse_engines(f"hf,{bad}")


# -- streaming windows and the server's tokens -------------------------------------------------
def test_one_request_streams_its_ttft_chunks_and_acceptance_from_the_servers_counters():
    with serve(Behaviour(chunks=(1, 2), spec=(2, 6, 4))) as (url, state):
        engine = engine_at(url)
        gen = generate(engine, [[1, 2, 3]])[0]
    sent = state.requests[-1]
    assert sent["prompt"] == [1, 2, 3] and sent["stream"] is True and sent["model"] == "tiny"
    assert gen.token_ids == [4, 5, 6, 7, 8, 9, 10]  # the server's ids, as streamed
    assert [s.emitted for s in gen.steps] == [1, 2, 1, 2, 1]  # one step per streamed chunk
    s = gen.stats
    assert s.prefill_time_s >= 0.05  # time to first token: the server's prefill sleep
    assert s.decode_tokens == 6 and s.tokens_emitted == 7  # the first chunk is the prefill's
    assert s.stop_reason == "max_new_tokens"
    assert (s.draft_proposed, s.draft_accepted, s.acceptance_rate, s.mean_accepted_length) == (
        6, 4, pytest.approx(4 / 6), 2.0)
    assert engine.config["model"] == "tiny" and engine.version == "fake 0.0-test"
    assert "vllm:spec_decode_num_drafts" in engine.config["speculative_metrics"]
    assert "created" not in engine.config["server_model"]  # nothing that changes per start


def test_a_batch_is_requests_in_flight_together_with_the_batchs_rates_only():
    with serve(Behaviour(together=3)) as (url, state):  # each waits for the others
        gens = generate(engine_at(url), [[1], [2, 3], [4]], new=4)
    assert state.max_in_flight == 3
    assert [g.token_ids for g in gens] == [[2, 3, 4, 5], [4, 5, 6, 7], [5, 6, 7, 8]]
    assert all(g.stats.draft_accepted is None for g in gens)  # the counters do not split
    # three requests: 3 x (2 drafts, 6 proposed, 4 accepted)
    assert all(g.stats.acceptance_rate == pytest.approx(12 / 18) for g in gens)


def test_tokens_are_counted_from_logprobs_where_the_server_gives_no_ids_never_from_text():
    with serve(Behaviour(tokens="logprobs")) as (url, state):
        gen = generate(engine_at(url, logprobs="true"), [[1, 2]])[0]
        assert state.requests[-1]["logprobs"] == 1
        assert gen.token_ids == [] and gen.stats.tokens_emitted == 7
    with serve(Behaviour(tokens="text")) as (url, _), \
            pytest.raises(EngineError, match="add --engine-option logprobs=true"):
        generate(engine_at(url), [[1, 2]])


def test_without_metrics_acceptance_is_none_with_the_reason_never_zero():
    for metrics, why in ((None, "no /metrics"), ("plain", "no spec_decode")):
        with serve(Behaviour(metrics=metrics)) as (url, _):
            engine = engine_at(url)
            gen = generate(engine, [[1]])[0]
        assert gen.stats.acceptance_rate is None and gen.stats.draft_accepted is None
        assert engine.config["acceptance"].startswith("None: ") and why in engine.config["acceptance"]
    assert acceptance_columns({"proposed": 1.0}, None, 1) == {}


def test_a_server_on_another_host_is_unmetered_with_its_reason():
    assert remote_reason("127.0.0.1") is None
    assert remote_reason("10.1.2.3", local={"10.1.2.3"}) is None
    assert "not this host" in remote_reason("192.0.2.7", local={"10.1.2.3"})


# -- faults: a clear error, no row --------------------------------------------------------------
@pytest.mark.parametrize("behaviour, message", [
    (Behaviour(fault="http500"), "HTTP 500 .*CUDA out of memory.*see its log"),
    (Behaviour(fault="http400"), "HTTP 400 .*refused: check --engine-option model"),
    (Behaviour(fault="cut"), "stream .* was cut after 2 chunks, before its \\[DONE\\]"),
    (Behaviour(fault="stall", stall_s=2.0), "sent nothing for 0.5 s .*raise --engine-option timeout_s"),
])
def test_a_failing_request_is_an_engine_error_naming_the_fix(behaviour, message):
    with serve(behaviour) as (url, _):
        engine = engine_at(url, timeout_s="0.5")
        with pytest.raises(EngineError, match=message):
            generate(engine, [[1, 2]])


def test_an_unreachable_or_wrong_url_and_an_unserved_model_are_refused_at_load():
    with pytest.raises(EngineError, match="cannot reach a server at .*start it"):
        engine_at(f"http://127.0.0.1:{free_port()}")
    with serve(Behaviour(models=("a", "b"))) as (url, _):
        with pytest.raises(UnsupportedError, match="does not serve 'c' .*a, b.*model="):
            engine_at(url, model="c")
        with pytest.raises(UnsupportedError, match="serves 2 models .*--engine-option model=NAME"):
            engine_at(url)
        assert engine_at(url, model="b").served == "b"


# -- the CLI: side by side with hf, and a fault mid-run ---------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return tiny.save(tiny.llama(VOCAB, 0, layers=2), tiny.word_tokenizer(VOCAB),
                     tmp_path_factory.mktemp("http") / "llama")


def compare(target: str, engines: str, out, *extra: str):
    return runner.invoke(app, ["compare", "--engine", engines, "--decoders", "ar", "--target",
                               target, "--meter", "none", "--dataset", "mtbench", "--n-prompts",
                               "1", "--max-new-tokens", "6", "--device", "cpu", "--output",
                               str(out), *extra])


def test_compare_stores_hf_and_the_servers_rows_side_by_side(target, tmp_path):
    with serve(Behaviour(vocab=VOCAB)) as (url, _):
        res = compare(target, f"hf,{url}", tmp_path / "s")
    assert res.exit_code == 0, res.output
    runs = ResultStore(tmp_path / "s").load("runs").set_index("engine")
    assert set(runs.index) == {"hf", "http"} and runs.loc["http", "model"] == f"custom+http@{url[7:]}"
    row = runs.loc["http"]
    assert row["prefill_time_s"] > 0 and row["tokens_per_s"] > 0 and row["decode_tokens"] == 5
    assert row["acceptance_rate"] == pytest.approx(4 / 6)  # from the server's counters
    assert row["perplexity"] > 0  # the server's token ids scored under the HF target
    assert json.loads(row["engine_config"])["base_url"] == url


def test_a_stream_cut_mid_run_exits_1_with_one_json_error_and_stores_no_row(target, tmp_path):
    with serve(Behaviour(vocab=VOCAB, fault="cut")) as (url, _):
        res = compare(target, url, tmp_path / "s", "--json")
    assert res.exit_code == 1
    error = json.loads(res.stdout)
    assert "was cut after 2 chunks" in error["error"] and "Traceback" not in res.output
    assert len(ResultStore(tmp_path / "s").load("runs")) == 0


def test_a_malformed_server_url_exits_2_before_anything_loads(tmp_path):
    # a target that does not exist: refused for the URL first, before any model is looked up
    res = runner.invoke(app, ["compare", "--engine", "hf,http://127.0.0.1", "--decoders", "ar",
                              "--target", str(tmp_path / "no-model"), "--output",
                              str(tmp_path / "s")])
    assert res.exit_code == 2 and "is not a server's base URL" in res.output


def test_a_remote_servers_rows_have_no_energy_with_the_reason_a_local_ones_have_it(
        target, tmp_path, monkeypatch):
    import mtad_energy.engines.http as http_engine

    with serve(Behaviour(vocab=VOCAB)) as (url, _):
        res = compare(target, url, tmp_path / "local", "--meter", "simulated")
        assert res.exit_code == 0, res.output
        monkeypatch.setattr(http_engine, "remote_reason", lambda host: "another host, say")
        res = compare(target, url, tmp_path / "remote", "--meter", "simulated")
        assert res.exit_code == 0, res.output
    local = ResultStore(tmp_path / "local").load("runs").iloc[0]
    remote = ResultStore(tmp_path / "remote").load("runs").iloc[0]
    assert local["energy_j"] > 0
    assert remote["energy_j"] is None or remote["energy_j"] != remote["energy_j"]  # None / NaN
    assert remote["energy_reason"] == "another host, say" and remote["tokens_per_s"] > 0


@pytest.mark.parametrize("url, code, message", [
    ("http://127.0.0.1:{free}", 1, "cannot reach a server at"),
    ("{url}", 2, "does not serve 'nope'"),
])
def test_an_unreachable_server_exits_1_and_an_unserved_model_2_without_a_traceback(
        target, tmp_path, url, code, message):
    with serve(Behaviour(vocab=VOCAB)) as (live, _):
        res = compare(target, url.format(free=free_port(), url=live), tmp_path / "s",
                      "--engine-option", "model=nope")
    assert res.exit_code == code, res.output
    assert message in res.output and "Traceback" not in res.output


def test_the_decoding_sweep_runs_a_server_at_each_batch_size(target, tmp_path):
    """`sweep batch-size --decoder ar --engine URL`: a batch of N is N requests in flight; its
    counters give the batch's acceptance rate, and at one request its target steps (1 + 2
    drafting steps emitting 4 + 2 tokens: block efficiency 6 / 3); at two, the counters do not
    split the steps by request, so the batch row's forwards stay unknown, never a 0."""
    with serve(Behaviour(vocab=VOCAB)) as (url, _):
        res = runner.invoke(app, ["sweep", "batch-size", "--decoder", "ar", "--engine", url,
                                  "--sizes", "1,2", "--target", target, "--meter", "none",
                                  "--n-prompts", "2", "--max-new-tokens", "6", "--device", "cpu",
                                  "--output", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    rows = ResultStore(tmp_path / "s").load("decode_batch").set_index("batch_size")
    assert sorted(rows.index) == [1, 2] and set(rows["model"]) == {f"custom+http@{url[7:]}"}
    assert rows.loc[1, "target_forwards"] == 3 and rows.loc[1, "block_efficiency"] == 2.0
    assert rows.loc[[2], "block_efficiency"].isna().all()
    assert rows.loc[[2], "target_forwards"].isna().all()
    assert rows["acceptance_rate"].tolist() == [pytest.approx(4 / 6)] * 2


def test_a_text_only_server_gets_the_prompt_ids_decoded_by_the_targets_tokenizer():
    tok = tiny.word_tokenizer(VOCAB)
    with serve() as (url, state):
        engine = engine_at(url, prompt="text")
        with pytest.raises(EngineError, match="prompt=text needs the target's tokenizer"):
            generate(engine, [[5, 6]])
        engine.use_tokenizer(tok)
        gen = generate(engine, [[5, 6]])[0]
    assert state.requests[-1]["prompt"] == tok.decode([5, 6], skip_special_tokens=False)
    assert isinstance(state.requests[-1]["prompt"], str) and gen.prompt_len == 2


def test_energy_asked_of_a_remote_server_is_refused_and_never_repeated(target, tmp_path,
                                                                        monkeypatch):
    import mtad_energy.engines.http as http_engine
    from mtad_energy.config import MeasureConfig

    monkeypatch.setattr(http_engine, "remote_reason", lambda host: "it runs on another host")
    # --mitigate auto repeats on the simulated meter too (as it does on a GPU's)
    monkeypatch.setattr(MeasureConfig, "mitigates", lambda self, meter: self.mitigate != "off")
    with serve(Behaviour(vocab=VOCAB)) as (url, state):
        res = compare(target, url, tmp_path / "s", "--meter", "simulated", "--require-energy")
        assert res.exit_code == 2, res.output
        assert "but it runs on another host; drop them" in " ".join(res.output.split())
        assert state.requests == []  # refused before any request
        res = compare(target, url, tmp_path / "s", "--meter", "simulated", "--mitigate", "auto")
        assert res.exit_code == 0, res.output
    row = ResultStore(tmp_path / "s").load("runs").iloc[0]
    assert not row["mitigated"] and row["energy_reason"] == "it runs on another host"


# -- acceptance per request from the response body ---------------------------------------------
@pytest.mark.parametrize("shape, mean_length", [
    ("vllm", [0.5, 1.0]), ("trtllm", [0.5, 1.0]), ("llamacpp", [None, None])])
def test_each_requests_body_acceptance_wins_over_the_batchs_metrics(shape, mean_length):
    """Two requests in flight, each body reporting its own counts (2 drafting steps, 6 draft
    tokens, accepted = its prompt's length: 1 and 2): each row its own, where /metrics would
    give both the batch's 12/18; llama-server's timings do not count drafting steps."""
    with serve(Behaviour(body=shape, together=2, spec=(2, 6, 4))) as (url, state):
        gens = generate(engine_at(url), [[1], [2, 3]])
    assert state.max_in_flight == 2
    assert [g.stats.draft_accepted for g in gens] == [1, 2]
    assert [g.stats.draft_proposed for g in gens] == [6, 6]
    assert [g.stats.acceptance_rate for g in gens] == [pytest.approx(1 / 6), pytest.approx(2 / 6)]
    assert [g.stats.mean_accepted_length for g in gens] == mean_length


def test_vllms_per_request_metrics_are_read_as_vllm_writes_them_and_a_malformed_one_is_an_error():
    """vLLM 0.32's ``RequestSpecDecodeMetrics.to_dict`` (detailed level) on the usage chunk:
    3 verify steps drafting 3 tokens each, accepting 0, 2 and 3."""
    from mtad_energy.engines.server_protocol import body_spec

    event = {"choices": [], "usage": {"completion_tokens": 9}, "metrics": {"speculative_decoding": {
        "mean_acceptance_length": 1 + 5 / 3, "draft_acceptance_rate": 5 / 9,
        "acceptance_histogram": [1, 0, 1, 1], "num_spec_steps": 3, "num_accepted_draft_tokens": 5,
        "num_draft_tokens": 9, "num_spec_tokens": 3, "per_step_accepted": [0, 2, 3],
        "per_step_drafted": [3, 3, 3]}}}
    spec = body_spec(event)
    assert (spec.source, spec.drafts, spec.proposed, spec.accepted) == ("vllm", 3, 9, 5)
    assert spec.accepted_per_pos == (2, 2, 1)  # positions 1, 2, 3 accepted by 2, 2, 1 steps
    assert spec.steps == ((3, 0), (3, 2), (3, 3))
    assert body_spec({"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}) is None
    event["metrics"]["speculative_decoding"]["num_spec_steps"] = "three"
    with pytest.raises(EngineError, match="speculative counts are malformed"):
        body_spec(event)


# -- perplexity from the server's logprobs ------------------------------------------------------
def test_perplexity_is_the_servers_logprobs_where_it_returns_them_else_left_to_the_target():
    import math

    from tests.engines.openai_server import logprob_value

    with serve() as (url, _):
        with_lp = generate(engine_at(url, logprobs="true"), [[1, 2]])[0]
        without = generate(engine_at(url), [[1, 2]])[0]
    nll = [-logprob_value(t) for t in with_lp.token_ids]
    assert with_lp.stats.perplexity == pytest.approx(math.exp(sum(nll) / len(nll)))
    assert without.stats.perplexity is None  # scored under the target by the runner


def test_a_logprobs_only_servers_rows_get_its_perplexity_and_an_id_servers_the_targets(
        target, tmp_path):
    import math

    from tests.engines.openai_server import logprob_value

    with serve(Behaviour(vocab=VOCAB, tokens="logprobs")) as (url, state):
        res = compare(target, url, tmp_path / "lp", "--engine-option", "logprobs=true")
        assert res.exit_code == 0, res.output
        with serve(Behaviour(vocab=VOCAB)) as (url_ids, _):
            res = compare(target, url_ids, tmp_path / "ids")
        assert res.exit_code == 0, res.output
    # the server "generates" counting up from the prompt's last id: its tokens are known
    prompt = state.requests[-1]["prompt"]
    tokens = [(prompt[-1] + 1 + i) % VOCAB for i in range(6)]
    nll = [-logprob_value(t) for t in tokens]
    lp_row = ResultStore(tmp_path / "lp").load("runs").iloc[0]
    assert lp_row["perplexity"] == pytest.approx(math.exp(sum(nll) / 6))  # no ids: the server's
    ids_row = ResultStore(tmp_path / "ids").load("runs").iloc[0]
    assert ids_row["perplexity"] > 0 and ids_row["perplexity"] != pytest.approx(lp_row["perplexity"])


# -- seeds: rows independent ---------------------------------------------------------------------
def test_each_request_of_a_batch_is_sent_its_own_seed():
    with serve() as (url, state):
        engine = engine_at(url)
        gens = engine.generate(AR, [[1], [1], [1]], 4, seed=5)
    assert sorted(r["seed"] for r in state.requests) == [5, 6, 7]
    assert [g.config["seed"] for g in gens] == [5, 6, 7]


# -- two servers: two labels, never pooled -------------------------------------------------------
def test_two_servers_in_one_run_store_and_show_rows_under_two_labels(target, tmp_path):
    with serve(Behaviour(vocab=VOCAB)) as (one, _), serve(Behaviour(vocab=VOCAB)) as (two, _):
        res = compare(target, f"{one},{two}", tmp_path / "s")
    assert res.exit_code == 0, res.output
    runs = ResultStore(tmp_path / "s").load("runs")
    labels = {f"custom+http@{one[7:]}", f"custom+http@{two[7:]}"}
    assert set(runs["model"]) == labels and len(runs) == 2
    assert all(label in res.output for label in labels)  # the summary: one line each


# -- the audit over a server ---------------------------------------------------------------------
K, MIN_N, MAX_N = 3, 1, 3  # the server's n-gram drafting (vLLM's speculative_config)


def ngram_server(model, lie: int = 0, step_lie: bool = False):
    """A model-backed server's ``generate``: greedy tokens of ``model``, the counts of its
    n-gram drafting read off them (drafts, draft tokens, accepted, accepted per position), its
    accepted and draft tokens inflated by ``lie``, and its steps (drafted, accepted), the first
    drafting step that rejected claiming one more accepted where ``step_lie``."""
    import torch

    from mtad_energy.decoding.rules.sampling import Warp
    from mtad_energy.engines import audit as au
    from mtad_energy.engines import audit_output as ao

    def gen(prompt, n):
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(n):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        out = ids[len(prompt):]
        p = au.warped_along(model, prompt, out, Warp(temperature=0.0, top_k=0, top_p=1.0))
        served = ao.point_mass_served(out, p, au.ngram_proposer(prompt, out, MIN_N, MAX_N, K))
        m = ao.counters_of_steps(served.steps, K)
        steps = list(served.steps)
        bad = next((i for i, (d, a) in enumerate(steps) if d and a < d), None) if step_lie else None
        if bad is not None:
            steps[bad] = (steps[bad][0], steps[bad][1] + 1)
        return out, (m.drafts, m.draft_tokens + lie, m.accepted_tokens + lie,
                     *m.accepted_per_pos), steps
    return gen


@pytest.fixture(scope="module")
def model():
    return tiny.llama(VOCAB, 0, layers=2)


@pytest.mark.parametrize("where", ["metrics", "vllm"])
def test_the_audit_passes_a_truthful_server_and_flags_one_whose_counters_lie(model, where):
    """Greedy n-gram speculation served, its counters in /metrics or in each body (vLLM's
    shape): a server telling the truth passes every check; one claiming 100 more accepted
    draft tokens than its output shows contradicts it."""
    from mtad_energy.decoding.rules.sampling import Warp
    from mtad_energy.engines.audit_output import CONTRADICTS
    from mtad_energy.engines.http_audit import audit_server

    warp = Warp(temperature=0.0, top_k=0, top_p=1.0)
    prompts = [[3, 4, 5, 3, 4], [7, 8, 9, 7], [2, 2, 6]]
    verdicts = {}
    for lie in (0, 100):
        behaviour = Behaviour(vocab=VOCAB, generate=ngram_server(model, lie), together=3,
                              metrics="spec" if where == "metrics" else None,
                              body="vllm" if where == "vllm" else None)
        with serve(behaviour) as (url, _):
            engine = engine_at(url)
            generate(engine, prompts, new=16)
        verdicts[lie] = audit_server(engine, model, warp, K, MIN_N, MAX_N)
    truthful, liar = verdicts[0], verdicts[100]
    assert truthful.row.measured.accepted_tokens > 0  # the n-gram drafts hit: a real check
    assert not truthful.flagged, truthful.as_dict()
    assert liar.flag == CONTRADICTS and "accepted tokens" in " ".join(liar.contradictions)


def test_a_server_reporting_no_counts_or_no_token_ids_is_refused_by_the_audit(model):
    from mtad_energy.decoding.rules.sampling import Warp
    from mtad_energy.engines.http_audit import audit_server

    warp = Warp(temperature=0.0, top_k=0, top_p=1.0)
    with serve(Behaviour(vocab=VOCAB, metrics="plain")) as (url, _):
        engine = engine_at(url)
        with pytest.raises(UnsupportedError, match="served no request"):
            audit_server(engine, model, warp, K, MIN_N, MAX_N)
        generate(engine, [[1, 2]])
    with pytest.raises(UnsupportedError, match="no speculative counts for batch 0"):
        audit_server(engine, model, warp, K, MIN_N, MAX_N)
    with serve(Behaviour(vocab=VOCAB, tokens="logprobs")) as (url, _):
        engine = engine_at(url, logprobs="true")
        generate(engine, [[1, 2]])
    with pytest.raises(UnsupportedError, match="returned no token ids"):
        audit_server(engine, model, warp, K, MIN_N, MAX_N)


def test_the_decoding_sweep_keeps_the_servers_perplexity(target, tmp_path):
    """`sweep batch-size` scores rows under the target unless the server gave their logprobs."""
    import math

    from tests.engines.openai_server import logprob_value

    with serve(Behaviour(vocab=VOCAB)) as (url, state):
        res = runner.invoke(app, ["sweep", "batch-size", "--decoder", "ar", "--engine", url,
                                  "--sizes", "1", "--target", target, "--meter", "none",
                                  "--n-prompts", "1", "--max-new-tokens", "6", "--device", "cpu",
                                  "--engine-option", "logprobs=true", "--output",
                                  str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    prompt = state.requests[-1]["prompt"]
    nll = [-logprob_value((prompt[-1] + 1 + i) % VOCAB) for i in range(6)]
    row = ResultStore(tmp_path / "s").load("decode_batch").iloc[0]
    assert row["perplexity"] == pytest.approx(math.exp(sum(nll) / 6))


def sampling_server(model, warp, lossy: bool, seed: int = 0):
    """A model-backed server's ``generate`` sampling under ``warp`` with n-gram drafts, verified
    as speculative sampling does (a draft token d kept with probability p~(d), else a token of
    p~ without d), or ``lossy``: every draft token kept. Its counts are its real steps'."""
    import torch

    from mtad_energy.engines import audit as au
    from mtad_energy.engines import audit_output as ao

    rng = torch.Generator().manual_seed(seed)

    def probs(ctx):
        with torch.inference_mode():
            return warp.probs(model(input_ids=torch.tensor([ctx])).logits[0, -1:])[0]

    def gen(prompt, n):
        out, steps = [], []
        while len(out) < n:
            drafts, kept = (au.ngram_propose(list(prompt) + out, MIN_N, MAX_N, K) if out else []), 0
            for tok in drafts:
                p = probs(list(prompt) + out)
                if lossy or torch.rand((), generator=rng) < p[tok]:
                    out, kept = [*out, tok], kept + 1
                    continue
                rest = p.clone()
                rest[tok] = 0.0  # the residual of a point-mass draft: p~ without d
                out.append(int(torch.multinomial(rest / rest.sum(), 1, generator=rng)))
                break
            else:  # every draft token kept (or none): the bonus token
                out.append(int(torch.multinomial(probs(list(prompt) + out), 1, generator=rng)))
            steps.append((len(drafts), kept))
        m = ao.counters_of_steps(steps, K)
        return out[:n], (m.drafts, m.draft_tokens, m.accepted_tokens, *m.accepted_per_pos)
    return gen


def test_the_audit_passes_a_lossless_sampling_server_and_flags_one_keeping_every_draft(model):
    """Sampled speculation (T 1) with n-gram drafts: the lossless server passes; one keeping
    every draft token whatever the target says is flagged as over-accepting."""
    from mtad_energy.decoding.rules.sampling import Warp
    from mtad_energy.engines.http_audit import audit_server

    warp = Warp(temperature=1.0, top_k=0, top_p=1.0)
    flags = {}
    for lossy in (False, True):
        with serve(Behaviour(vocab=VOCAB, generate=sampling_server(model, warp, lossy))) as (url, _):
            engine = engine_at(url)
            for i in range(4):
                generate(engine, [[3 + i, 4, 5, 3, 4], [7, 8 + i, 9, 7]], new=24)
        verdict = audit_server(engine, model, warp, K, MIN_N, MAX_N)
        assert verdict.row.measured.drafts > 10  # the drafts were checked
        flags[lossy] = verdict.flags
    assert flags == {False: (), True: ("over-accepts",)}


def test_the_audit_checks_vllms_per_step_story_against_the_output(model):
    """vLLM's ``detailed`` per-request metrics list each drafting step's (drafted, accepted):
    a server whose list matches its output passes; one claiming an extra accepted token in one
    step, its totals true, contradicts the output at that step."""
    from mtad_energy.decoding.rules.sampling import Warp
    from mtad_energy.engines.audit_output import CONTRADICTS
    from mtad_energy.engines.http_audit import audit_server

    warp = Warp(temperature=0.0, top_k=0, top_p=1.0)
    verdicts = {}
    for step_lie in (False, True):
        behaviour = Behaviour(vocab=VOCAB, generate=ngram_server(model, step_lie=step_lie),
                              metrics=None, body="vllm")
        with serve(behaviour) as (url, _):
            engine = engine_at(url)
            generate(engine, [[3, 4, 5, 3, 4], [2, 2, 6]], new=16)
        assert all(r.spec.steps for r in engine.served_requests)  # the detailed level, read
        verdicts[step_lie] = audit_server(engine, model, warp, K, MIN_N, MAX_N)
    assert not verdicts[False].flagged, verdicts[False].as_dict()
    assert verdicts[True].flag == CONTRADICTS
    assert any("the engine reports" in c for c in verdicts[True].contradictions)
