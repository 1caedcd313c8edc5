"""A small OpenAI-compatible server for the tests of `engines.http`, on 127.0.0.1 at a free port
(stdlib ``http.server``, one thread per request): ``/v1/models``, a streamed ``/v1/completions``
and a Prometheus ``/metrics`` with vLLM's speculative counters, and the faults a real server
shows (HTTP errors, a stream cut mid-way, a stall, no ``/metrics``), chosen per test."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Behaviour:
    """What the server does. ``chunks``: tokens per streamed chunk, cycled (2: two tokens a
    chunk, as a speculating server emits accepted drafts); ``tokens``: how chunks say their
    tokens ("token_ids": vLLM's ids, "logprobs": per-token logprobs only, "text": neither);
    ``fault``: None, "http500", "http400", "cut" (the connection closed after two chunks),
    "stall" (silent for ``stall_s`` after one chunk); ``metrics``: "spec" (vLLM's spec_decode
    counters), "plain" (a /metrics without them) or None (HTTP 404); per request the counters
    grow by ``spec`` = (drafts, proposed, accepted). ``body``: the per-request speculative counts
    the response body carries, in a server's shape ("vllm": the root's
    ``metrics.speculative_decoding`` on the usage chunk, "trtllm": the last choice's
    ``speculative_decoding``, "llamacpp": the root's ``timings``; None: none), its counts
    (``spec``'s drafts and proposed, accepted = min(prompt length, proposed): each request its
    own); ``generate(prompt, n)``: the tokens and counts (drafts, proposed, accepted, accepted per
    position...) of a model-backed server instead of counting up, and optionally its steps
    (drafted, accepted), which a "vllm" body lists (vLLM's ``detailed`` level). A request asking ``logprobs``
    gets each token's, -(token % 4) / 4 (``logprob_value``). ``version``: what ``/version``
    states (None: it has none, as llama_cpp.server)."""

    models: tuple[str, ...] = ("tiny",)
    chunks: tuple[int, ...] = (1, 2)
    tokens: str = "token_ids"
    vocab: int = 32
    fault: str | None = None
    stall_s: float = 3.0
    metrics: str | None = "spec"
    spec: tuple[int, int, int] = (2, 6, 4)
    delay_s: float = 0.0  # between chunks
    together: int = 1  # a request waits (up to 5 s) until this many are in flight
    body: str | None = None
    generate: Callable[[list[int], int], tuple[Any, ...]] | None = None
    version: str | None = "0.0-test"  # what /version states (None: no /version, HTTP 404)


@dataclass
class State:
    behaviour: Behaviour
    requests: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    counters: list[int] = field(default_factory=lambda: [0, 0, 0])  # + accepted per position
    lock: threading.Condition = field(default_factory=threading.Condition)


def metrics_text(state: State) -> str:
    """vLLM's speculative counters as vLLM exposes them: by ``prometheus_client`` itself
    (``# TYPE vllm:spec_decode_num_drafts_total counter``, a ``_created`` gauge beside each),
    with a per-position acceptance counter and a gauge that is not about speculation."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    labels = {"model_name": "tiny", "engine": "0"}
    for name, value in zip(("num_drafts", "num_draft_tokens", "num_accepted_tokens"),
                           state.counters[:3], strict=True):
        counter = Counter(f"vllm:spec_decode_{name}", name, list(labels), registry=registry)
        counter.labels(**labels).inc(value)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per position",
                      [*labels, "position"], registry=registry)
    for pos, value in enumerate(state.counters[3:] or state.counters[2:3]):
        per_pos.labels(**labels, position=str(pos)).inc(value)
    Gauge("vllm:num_requests_running", "running", registry=registry).set(0)
    return generate_latest(registry).decode()


def completion_tokens(prompt: Any, n: int, vocab: int) -> list[int]:
    """The tokens the server "generates": counting up from the prompt's last id."""
    last = prompt[-1] if isinstance(prompt, list) and prompt else 0
    return [(last + 1 + i) % vocab for i in range(n)]


def logprob_value(token: int) -> float:
    """The logprob the server reports for a sampled ``token``."""
    return -(token % 4) / 4


def body_spec(kind: str | None, counts: tuple[int, ...], n: int,
              steps: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """One request's speculative counts (drafts, proposed, accepted) of ``n`` tokens in a
    server's shape: what the event carrying them adds (see `Behaviour`); vLLM's ``detailed``
    level adds its drafting ``steps`` (drafted, accepted), as vLLM lists them."""
    drafts, proposed, accepted = counts[:3]
    if kind == "vllm":  # the histogram from the counts per position (default: one a step)
        per_pos = list(counts[3:]) or [min(drafts, accepted)]
        hist = [drafts - per_pos[0]] + [a - b for a, b in zip(per_pos, [*per_pos[1:], 0],
                                                               strict=True)]
        detailed = {} if steps is None else {
            "per_step_drafted": [d for d, _ in steps if d],
            "per_step_accepted": [a for d, a in steps if d]}  # drafting steps only, as vLLM's
        return {"metrics": {"speculative_decoding": {
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "num_spec_steps": drafts, "acceptance_histogram": hist,
            "draft_acceptance_rate": accepted / proposed if proposed else 0.0,
            "num_accepted_draft_tokens": accepted, "num_draft_tokens": proposed,
            "num_spec_tokens": len(per_pos), **detailed}}}
    if kind == "trtllm":
        return {"speculative_decoding": {"total_accepted_draft_tokens": accepted,
                                         "total_draft_tokens": proposed, "num_spec_steps": drafts,
                                         "acceptance_rate": accepted / proposed}}
    if kind == "llamacpp":
        return {"timings": {"draft_n": proposed, "draft_n_accepted": accepted, "predicted_n": n}}
    return {}


class Handler(BaseHTTPRequestHandler):
    state: State  # set per server
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        b = self.state.behaviour
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "fake", "created": time.time(),
                 "max_model_len": 256} for m in b.models]})
        elif self.path == "/version" and b.version is not None:
            self._json(200, {"version": b.version})
        elif self.path == "/metrics" and b.metrics is not None:
            text = metrics_text(self.state) if b.metrics == "spec" else (
                "# HELP up Up.\n# TYPE up gauge\nup 1.0\n")
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        st, b = self.state, self.state.behaviour
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with st.lock:
            st.requests.append(body)
            st.in_flight += 1
            st.max_in_flight = max(st.max_in_flight, st.in_flight)
            st.lock.notify_all()
            st.lock.wait_for(lambda: st.in_flight >= b.together, timeout=5.0)
        try:
            self._complete(body, b)
        finally:
            with st.lock:
                st.in_flight -= 1

    def _complete(self, body: dict[str, Any], b: Behaviour) -> None:
        if self.path != "/v1/completions":
            return self._json(404, {"detail": "Not Found"})
        if body.get("model") not in b.models:
            return self._json(404, {"error": {"message": f"model {body.get('model')} not found"}})
        if b.fault == "http500":
            return self._json(500, {"error": {"message": "CUDA out of memory"}})
        if b.fault == "http400":
            return self._json(400, {"error": {"message": "prompt must be a string"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = int(body["max_tokens"])
        if b.generate is not None:
            tokens, counts, *steps = b.generate(list(body["prompt"]), n)
        else:
            tokens = completion_tokens(body["prompt"], n, b.vocab)
            counts, steps = (*b.spec[:2], min(len(body["prompt"]), b.spec[1])), []
        time.sleep(0.05)  # a prefill: every request of a batch is in flight meanwhile
        pos, k = 0, 0
        while pos < len(tokens):
            piece = tokens[pos:pos + b.chunks[k % len(b.chunks)]]
            pos, k = pos + len(piece), k + 1
            choice: dict[str, Any] = {"index": 0, "text": "".join(f" w{t}" for t in piece),
                                      "finish_reason": "length" if pos >= len(tokens) else None}
            if b.tokens == "token_ids":
                choice["token_ids"] = piece
            if b.tokens == "logprobs" or body.get("logprobs"):
                choice["logprobs"] = {"tokens": [f" w{t}" for t in piece],
                                      "token_logprobs": [logprob_value(t) for t in piece]}
            last = pos >= len(tokens)
            if last and b.body == "trtllm":
                choice.update(body_spec(b.body, counts, len(tokens)))
            self._event({"id": "cmpl-1", "object": "text_completion", "choices": [choice],
                         **(body_spec(b.body, counts, len(tokens))
                            if last and b.body == "llamacpp" else {})})
            if b.fault == "cut" and k == 2:
                return  # the connection closes: no [DONE]
            if b.fault == "stall":
                time.sleep(b.stall_s)
                return
            time.sleep(b.delay_s)
        grown = counts if b.generate is not None else b.spec
        with self.state.lock:
            have = self.state.counters + [0] * (len(grown) - len(self.state.counters))
            self.state.counters = [c + (grown[i] if i < len(grown) else 0)
                                   for i, c in enumerate(have)]
        self._event({"id": "cmpl-1", "object": "text_completion", "choices": [],
                     "usage": {"prompt_tokens": len(body["prompt"]),
                               "completion_tokens": len(tokens)},
                     **(body_spec(b.body, counts, len(tokens), *steps)
                        if b.body == "vllm" else {})})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, payload: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()


@contextlib.contextmanager
def serve(behaviour: Behaviour | None = None) -> Iterator[tuple[str, State]]:
    """``with serve(Behaviour(...)) as (url, state)``: the server at ``url`` until the end."""
    state = State(behaviour or Behaviour())
    handler = type("BoundHandler", (Handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
