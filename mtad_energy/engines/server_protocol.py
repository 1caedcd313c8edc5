"""The OpenAI-compatible protocol a served engine speaks (`engines.http`), without the engine:
the base URL, JSON requests, one streamed completion read chunk by chunk, and the server's
Prometheus ``/metrics`` parsed (by ``prometheus_client``'s text parser, never by hand) into the
speculative-decoding counters it keeps.

Every failure is an `EngineError` (a failure while running, exit 1) naming the URL and the fix;
an unusable URL given on the command line is refused earlier (`registry.check_server_url`)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mtad_energy.engines.registry import EngineError

# vLLM's speculative-decoding counters (`vllm:spec_decode_*`, V1 engine), summed over labels:
# drafts (verify steps that drafted), draft tokens proposed, draft tokens accepted
SPEC_COUNTERS = {"drafts": "spec_decode_num_drafts", "proposed": "spec_decode_num_draft_tokens",
                 "accepted": "spec_decode_num_accepted_tokens"}


def connection(base_url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(base_url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, parts.port, timeout=timeout_s)


def request(base_url: str, method: str, path: str, timeout_s: float,
            body: Mapping[str, Any] | None = None) -> tuple[int, bytes]:
    """One request's (status, body); unreachable or timed out: `EngineError` with the fix."""
    conn = connection(base_url, timeout_s)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except TimeoutError as error:
        raise EngineError(f"the server at {base_url} did not answer {method} {path} within "
                          f"{timeout_s:g} s; check it is serving, or raise --engine-option "
                          "timeout_s") from error
    except OSError as error:  # refused, unknown host, reset
        raise EngineError(f"cannot reach a server at {base_url} ({error}); start it, or give "
                          "--engine http://HOST:PORT of a running OpenAI-compatible server"
                          ) from error
    finally:
        conn.close()


def get_json(base_url: str, path: str, timeout_s: float) -> Any:
    status, body = request(base_url, "GET", path, timeout_s)
    if status != 200:
        raise EngineError(f"GET {base_url}{path} answered HTTP {status} ({excerpt(body)}); is "
                          f"{base_url} an OpenAI-compatible server (vllm serve, "
                          "llama_cpp.server, SGLang's launch_server)?")
    try:
        return json.loads(body)
    except ValueError as error:
        raise EngineError(f"GET {base_url}{path} did not answer JSON ({excerpt(body)}); give "
                          "the base URL of an OpenAI-compatible server") from error


def excerpt(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", errors="replace").strip().replace("\n", " ")
    return text[:limit] + ("..." if len(text) > limit else "") if text else "empty body"


# -- /metrics ---------------------------------------------------------------------------------
def spec_counters(text: str, model: str) -> dict[str, float]:
    """The speculative counters of ``SPEC_COUNTERS`` a Prometheus text exposition holds, summed
    over their samples (those labelled with another ``model_name`` left out); a counter the
    server lacks is absent. The per-position acceptance counter is ``accepted_per_pos``
    (position -> accepted), where given."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    per_pos: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.split(":")[-1]
        samples = [s for s in family.samples if s.name.endswith("_total")
                   and s.labels.get("model_name", model) == model]
        if name == "spec_decode_num_accepted_tokens_per_pos":
            for s in samples:
                pos = s.labels.get("position", "?")
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            continue
        for key, counter in SPEC_COUNTERS.items():
            if name == counter and samples:
                out[key] = sum(s.value for s in samples)
    if per_pos:
        out.update({f"accepted_pos_{p}": v for p, v in sorted(per_pos.items())})
    return out


def spec_families(text: str) -> list[str]:
    """The names of the metric families about speculation a server exposes (what its metrics
    say about its speculative configuration, recorded as they are)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sorted({f.name for f in text_string_to_metric_families(text)
                   if "spec" in f.name.lower() and not f.name.endswith("_created")})


# -- per-request speculative counts in the response body ------------------------------------------
@dataclass(frozen=True)
class BodySpec:
    """One request's speculative counts as its response body reports them: ``source`` (the
    server's shape), verify steps that drafted (``drafts``; None where the server does not say),
    draft tokens ``proposed`` and ``accepted``, ``accepted_per_pos[j]`` (steps that accepted
    draft token j + 1; from the acceptance histogram, where given) and the per-step
    (drafted, accepted) arrays (vLLM's ``detailed`` level, where given)."""

    source: str
    drafts: int | None
    proposed: int
    accepted: int
    accepted_per_pos: tuple[int, ...] | None = None
    steps: tuple[tuple[int, int], ...] | None = None


def per_position(histogram: Any) -> tuple[int, ...] | None:
    """``accepted_per_pos`` from a dense histogram (index j: steps that accepted exactly j draft
    tokens): position j + 1 was accepted by every step accepting more than j."""
    if not isinstance(histogram, list) or not all(isinstance(c, int) for c in histogram):
        return None
    return tuple(sum(histogram[j + 1:]) for j in range(len(histogram) - 1))


def body_spec(event: Mapping[str, Any]) -> BodySpec | None:
    """The speculative counts one streamed event (or a whole response) carries, in the three
    shapes servers send (the field names as their sources and NVIDIA AIPerf's adapters read them,
    ai-dynamo/aiperf src/aiperf/spec_decode/), else None:

    * vLLM (>= 0.32, served with ``--per-request-spec-decode-metrics summary|detailed``): the
      root's ``metrics.speculative_decoding`` on the final usage chunk (``stream_options.
      include_usage``) -- vllm/entrypoints/openai/completion/serving.py and
      vllm/v1/metrics/stats.py ``RequestSpecDecodeMetrics.to_dict``: ``num_spec_steps``,
      ``num_draft_tokens``, ``num_accepted_draft_tokens``, ``acceptance_histogram``,
      ``per_step_accepted`` / ``per_step_drafted`` (detailed);
    * TensorRT-LLM (``per_request_spec_decode_stats``): a choice's ``speculative_decoding`` with
      ``total_draft_tokens``, ``total_accepted_draft_tokens``, ``num_spec_steps``,
      ``acceptance_histogram`` (AIPerf's trtllm_adapter.py);
    * llama.cpp's llama-server: the root's ``timings`` with ``draft_n`` and ``draft_n_accepted``
      (AIPerf's llamacpp_adapter.py; no count of drafting steps).

    SGLang's ``spec_verify_ct`` / ``spec_accept_token_num`` ride its native ``/generate``
    ``meta_info``, not its OpenAI completions stream (python/sglang/srt/entrypoints/openai/
    serving_completions.py sends no speculative field), so an SGLang server reads as none."""
    metrics = event.get("metrics")
    vllm = metrics.get("speculative_decoding") if isinstance(metrics, Mapping) else None
    choices = [c for c in event.get("choices") or [] if isinstance(c, Mapping)]
    trt = next((c["speculative_decoding"] for c in choices
                if isinstance(c.get("speculative_decoding"), Mapping)), None)
    timings = event.get("timings")
    try:
        if isinstance(vllm, Mapping) and "num_accepted_draft_tokens" in vllm:
            accepted, drafted = vllm.get("per_step_accepted"), vllm.get("per_step_drafted")
            steps = (tuple(zip(map(int, drafted), map(int, accepted), strict=True))
                     if isinstance(accepted, list) and isinstance(drafted, list) else None)
            return BodySpec("vllm", int(vllm["num_spec_steps"]), int(vllm["num_draft_tokens"]),
                            int(vllm["num_accepted_draft_tokens"]),
                            per_position(vllm.get("acceptance_histogram")), steps)
        if isinstance(trt, Mapping) and "total_accepted_draft_tokens" in trt:
            return BodySpec("tensorrt_llm", int(trt["num_spec_steps"]),
                            int(trt["total_draft_tokens"]),
                            int(trt["total_accepted_draft_tokens"]),
                            per_position(trt.get("acceptance_histogram")))
        if isinstance(timings, Mapping) and "draft_n_accepted" in timings:
            return BodySpec("llama.cpp", None, int(timings["draft_n"]),
                            int(timings["draft_n_accepted"]))
    except (KeyError, TypeError, ValueError) as error:
        raise EngineError(f"the server's per-request speculative counts are malformed ({error}): "
                          f"{json.dumps(vllm or trt or timings)[:200]}; see its version") from error
    return None


# -- one streamed completion -------------------------------------------------------------------
@dataclass
class Chunk:
    """One streamed event with tokens: when it arrived, the token ids it carried (None: the
    server gave none) and how many tokens it carried (None: the server did not say)."""

    t: float
    ids: list[int] | None
    count: int | None
    text: str
    logprobs: list[float | None] | None = None  # the sampled tokens' logprobs, where returned


@dataclass
class Stream:
    """One request's stream, read to its end (``[DONE]``): its chunks, the finish reason, the
    usage the server reported (if any), the speculative counts its body reported (`body_spec`;
    None: none) and the error that ended it early (None: complete)."""

    chunks: list[Chunk] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    spec: BodySpec | None = None
    error: EngineError | None = None
    done: bool = False

    @property
    def first_t(self) -> float | None:
        return self.chunks[0].t if self.chunks else None


def chunk_logprobs(choice: Mapping[str, Any]) -> list[float | None] | None:
    """The logprobs of the tokens a streamed choice carries (OpenAI completions'
    ``logprobs.token_logprobs``), None where the server sent none."""
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, Mapping) else None
    if not isinstance(values, list):
        return None
    return [float(v) if isinstance(v, (int, float)) else None for v in values]


def chunk_tokens(choice: Mapping[str, Any]) -> tuple[list[int] | None, int | None]:
    """The tokens a streamed choice carries, as the server counted them: its token ids (vLLM's
    ``token_ids`` with ``return_token_ids``, llama-server's ``tokens``), else the number of its
    per-token logprobs; (None, None) when it says neither (never counted from its text)."""
    for key in ("token_ids", "tokens"):
        ids = choice.get(key)
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            return [int(i) for i in ids], len(ids)
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, Mapping) and isinstance(logprobs.get("tokens"), list):
        return None, len(logprobs["tokens"])
    return None, None


def read_stream(base_url: str, body: Mapping[str, Any], timeout_s: float, out: Stream,
                on_first: Any = None) -> None:
    """POST ``body`` to /v1/completions and read its server-sent events into ``out`` (chunks
    timestamped on arrival); ``on_first()`` is called once, at the first chunk with tokens or at
    the end. Never raises: a failure is left in ``out.error``."""
    conn = connection(base_url, timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise EngineError(f"POST {base_url}/v1/completions answered HTTP {resp.status} "
                              f"({excerpt(resp.read())}); "
                              + ("the request was refused: check --engine-option model and the "
                                 "prompt format (--engine-option prompt=text for a server that "
                                 "takes text only)" if resp.status < 500 else
                                 "the server failed: see its log"))
        while True:
            line = resp.readline()
            if not line:
                raise EngineError(f"the stream from {base_url} was cut after "
                                  f"{len(out.chunks)} chunks, before its [DONE]; the server "
                                  "stopped or dropped the connection: see its log, then rerun "
                                  "(rows stored so far are kept)")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out.done = True
                return
            event = json.loads(data)
            if "error" in event:
                raise EngineError(f"the server at {base_url} reported an error mid-stream: "
                                  f"{event['error']}; see its log")
            if event.get("usage"):
                out.usage = dict(event["usage"])
            out.spec = body_spec(event) or out.spec
            for choice in event.get("choices") or []:
                ids, count = chunk_tokens(choice)
                if ids or count or choice.get("text"):
                    out.chunks.append(Chunk(time.perf_counter(), ids, count,
                                            choice.get("text") or "", chunk_logprobs(choice)))
                    if on_first is not None and len(out.chunks) == 1:
                        on_first()
                if choice.get("finish_reason"):
                    out.finish_reason = choice["finish_reason"]
    except TimeoutError:
        out.error = EngineError(f"the server at {base_url} sent nothing for {timeout_s:g} s "
                                f"(after {len(out.chunks)} chunks); check it is not stuck, or "
                                "raise --engine-option timeout_s")
    except EngineError as error:
        out.error = error
    except ValueError as error:  # a data line that is not JSON
        out.error = EngineError(f"the server at {base_url} streamed an event that is not JSON "
                                f"({error}); is it an OpenAI-compatible server?")
    except OSError as error:
        out.error = EngineError(f"the connection to {base_url} failed mid-request ({error}); "
                                "check the server is running, then rerun")
    finally:
        conn.close()
        if on_first is not None and len(out.chunks) == 0:
            on_first()
