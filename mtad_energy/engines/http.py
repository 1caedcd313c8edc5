"""A running OpenAI-compatible server as an engine: ``--engine http://HOST:PORT``.

What people deploy speculative decoding as (``vllm serve --speculative-config``, SGLang's
``launch_server``, llama.cpp's server), measured under the same instrument as every engine:

* **The server** is found at load, outside every window: its served model from ``/v1/models``
  (``--engine-option model=NAME`` where it serves several), its speculative configuration as its
  ``/v1/models`` entry and ``/metrics`` state it (recorded in every row's ``engine_config``,
  never guessed), its version from ``/version`` where it states one (else None, with the
  reason in ``engine_config["version"]``), its model's readable name (a GGUF path's file stem;
  the full id as ``model_id``).
* **Requests stream** (``stream: true``), one per prompt, all in flight at once (batch size =
  requests in flight, one thread each). The prefill window opens before the first request is
  sent and the decode window once every request has its first token; each row's
  ``prefill_time_s`` is its time to first token and its steps are its streamed chunks, each with
  the tokens it carried and the time since the chunk before (``time_other_s``: the server's
  iteration, not split into draft and target). Tokens are the server's: its token ids (vLLM's
  ``return_token_ids``, llama-server's ``tokens``), else its per-token logprobs
  (``--engine-option logprobs=true``), never counted from re-tokenised text; a server that gives
  neither is an error naming the option.
* **Acceptance** per request from its response body where the server reports it
  (`server_protocol.body_spec`: vLLM's ``metrics.speculative_decoding``, TensorRT-LLM's
  ``speculative_decoding``, llama-server's ``timings``), which wins; else from the server's
  ``/metrics`` counters (vLLM's ``spec_decode_*``, parsed by ``prometheus_client``), diffed
  around each batch outside the windows: a row of a batch of one gets the counts, a row of a
  larger batch the batch's rates (the counters do not split by request). Neither: None, with
  the reason in ``engine_config["acceptance"]``, never 0. Block efficiency (tokens per target
  step) where the server counts its drafting steps (`target_steps`), else None with the reason
  in ``engine_config["block_efficiency"]``.
* **Perplexity** from the server's logprobs of the sampled tokens (``--engine-option
  logprobs=true``: exp of their mean negative logprob; vLLM's default ``--logprobs-mode
  raw_logprobs`` is the unwarped target's), else scored locally under the HF target from the
  server's token ids (the runner), else None; ``engine_config["perplexity"]`` says which.
* **Seeds**: request i of a batch is sent ``seed + i`` (rows are independent, as the in-process
  engines' are), so identical prompts in one batch do not draw alike.
* **The audit**: every request's prompt, tokens and the counters around its batch are kept
  (`HttpEngine.served_requests`) for `engines.http_audit`.
* **Joules**: the local meters, the server's processes counted as the measurement's own
  (``--engine-option server_pid=PID``, else the process listening on the port). A server on
  another host gives time and acceptance, and energy None with its reason (`unmetered`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from mtad_energy.decoding.runtime.generate import PhaseHook
from mtad_energy.decoding.runtime.stats import Generation
from mtad_energy.engines.base import Engine, Iteration, build_generation, import_engine_library
from mtad_energy.engines.registry import (
    SERVER,
    EngineError,
    UnsupportedError,
    check_server_url,
    model_suffix,
)
from mtad_energy.engines.server_protocol import (
    BodySpec,
    Stream,
    get_json,
    read_stream,
    request,
    spec_counters,
    spec_families,
)

if TYPE_CHECKING:  # types only
    from mtad_energy.specs import DecoderSpec, ModelSpec

STOP = {"length": "max_new_tokens", "stop": "eos"}  # OpenAI finish_reason -> the project's
# what identifies a /v1/models entry (its ``created`` stamp and permission ids change per start)
MODEL_KEYS = ("id", "owned_by", "root", "parent", "max_model_len")
MODEL_FILES = (".gguf", ".ggml", ".bin", ".safetensors", ".pt", ".pth", ".onnx")  # weights' files
# what a row's block efficiency is, and why it is None where it is (every row's engine_config)
BLOCK_RULE = ("tokens per target step: each request's first token + the drafting steps the "
              "server counts (vLLM's num_spec_steps or spec_decode_num_drafts, TensorRT-LLM's "
              "num_spec_steps) + the steps without a draft (one token each); a batch of more "
              "than one from /metrics: the batch's (the counters do not split by request); "
              "None where the server counts no drafting steps (llama-server's timings) or "
              "reports no speculative counts")


def served_model(entries: Sequence[Mapping[str, Any]], wanted: str | None, url: str) -> str:
    """The model to request: ``wanted`` where the server serves it, else its only model."""
    ids = [str(e.get("id")) for e in entries]
    if wanted:
        if wanted not in ids:
            raise UnsupportedError(f"the server at {url} does not serve {wanted!r} (it serves: "
                                   f"{', '.join(ids) or 'nothing'}); give --engine-option "
                                   "model=<one of those>")
        return wanted
    if len(ids) == 1:
        return ids[0]
    if not ids:
        raise EngineError(f"the server at {url} lists no model in /v1/models; wait until it has "
                          "loaded one, then rerun")
    raise UnsupportedError(f"the server at {url} serves {len(ids)} models ({', '.join(ids)}); "
                           "choose one: --engine-option model=NAME")


def readable_model(model_id: str) -> str:
    """A served model's readable name: where its id is a file's path (llama_cpp.server serves a
    GGUF under the path it was given), the file's name without a model file's suffix
    (``/m/SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct.Q4_1``); an absolute
    path, its last part; any other id (``smollm2``, ``org/name`` of a hub) as it is."""
    path = PurePosixPath(model_id.replace("\\", "/"))
    if path.suffix.lower() in MODEL_FILES:
        return path.stem
    return path.name if model_id.startswith(("/", "~", "./", "../")) and path.name else model_id


def local_addresses() -> set[str]:
    """This host's addresses (every interface's)."""
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}


def remote_reason(host: str, local: set[str] | None = None) -> str | None:
    """Why the local meters cannot see a server on ``host`` (it resolves to no address of this
    host), or None: loopback, or one of ``local`` (this host's addresses by default)."""
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return f"{host} does not resolve here: its server's energy is not measured"
    local = local_addresses() if local is None else local
    if all(ipaddress.ip_address(a).is_loopback or a in local for a in addrs):
        return None
    return (f"the server runs on {host}, not this host: the local meters do not see its work "
            "(run mtad-energy on the server's host to measure its joules)")


def listening_pids(port: int) -> tuple[int, ...]:
    """The processes listening on TCP ``port`` here (empty where they cannot be seen)."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return ()
    return tuple(sorted({c.pid for c in conns if c.status == psutil.CONN_LISTEN
                         and c.laddr and c.laddr.port == port and c.pid}))


def target_steps(tokens: Sequence[int], drafts: int | None, accepted: int | None) -> int | None:
    """The target's verification steps that emitted ``tokens`` (one count per request; a batch's
    requests together), from the server's speculative counts: each request's first token (its
    prefill), every drafting step (``drafts``: it emits its accepted draft tokens + 1) and every
    step without a draft (one token each: what the drafting steps left). None where the server
    counts no drafting steps (llama-server's timings) or no acceptance. A last step cut by the
    token limit emits fewer than it accepted (the counters keep the cut tokens): the count is
    then a lower bound, as the in-process vLLM engine's is (`engines.vllm.iterations_of`)."""
    if drafts is None or accepted is None or not tokens or min(tokens) < 1:
        return None
    firsts = len(tokens)
    return firsts + drafts + max(0, sum(tokens) - firsts - drafts - accepted)


def steps_columns(tokens: Sequence[int], drafts: int | None, accepted: int | None
                  ) -> dict[str, Any]:
    """Block efficiency (tokens per target step, `target_steps`) of one request, with its steps
    as its target forwards; of a batch (``tokens``: each request's), the batch's block
    efficiency only (the counters do not split steps by request). Uncountable: nothing (the row
    keeps None; ``engine_config["block_efficiency"]`` says why)."""
    steps = target_steps(tokens, drafts, accepted)
    if steps is None:
        return {}
    out: dict[str, Any] = {"block_efficiency": sum(tokens) / steps}
    return out | ({"target_forwards": steps} if len(tokens) == 1 else {})


def acceptance_columns(before: Mapping[str, float] | None, after: Mapping[str, float] | None,
                       batch_size: int, tokens: Sequence[int] = ()) -> dict[str, Any]:
    """The statistics the server's counters give a row from their readings around its batch:
    B = 1, the counts (proposed, accepted, draft depth) and rates; B > 1, the batch's rates only
    (the counters do not split by request); no counters: nothing (the row keeps None). With
    ``tokens`` (each request's count) and the drafting steps counted (vLLM's
    ``spec_decode_num_drafts``): the block efficiency too (`steps_columns`)."""
    if before is None or after is None or not {"proposed", "accepted"} <= set(after):
        return {}
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    proposed, accepted = int(delta["proposed"]), int(delta["accepted"])
    drafts = int(delta["drafts"]) if "drafts" in delta else None
    rates = {"acceptance_rate": accepted / proposed if proposed else None,
             "mean_accepted_length": accepted / drafts if drafts else None,
             **steps_columns(tokens, drafts, accepted)}
    if batch_size > 1:
        return rates
    return {"draft_proposed": proposed, "draft_accepted": accepted, "draft_depth": proposed,
            **rates}


def body_columns(spec: BodySpec, tokens: int | None = None) -> dict[str, Any]:
    """The statistics one request's own speculative counts give its row: the counts and the
    rates (mean accepted length: accepted draft tokens per drafting step, where the server says
    how many steps drafted), and with its ``tokens`` the block efficiency (`steps_columns`)."""
    return {"draft_proposed": spec.proposed, "draft_accepted": spec.accepted,
            "draft_depth": spec.proposed,
            "acceptance_rate": spec.accepted / spec.proposed if spec.proposed else None,
            "mean_accepted_length": spec.accepted / spec.drafts if spec.drafts else None,
            **(steps_columns([tokens], spec.drafts, spec.accepted) if tokens else {})}


def logprob_perplexity(stream: Stream) -> float | None:
    """exp(mean negative logprob) of the sampled tokens, from the logprobs the server streamed
    with them; None unless every token has one."""
    values = [v for c in stream.chunks for v in (c.logprobs or [])]
    counted = sum(int(c.count or 0) for c in stream.chunks)
    if not values or len(values) != counted or any(v is None for v in values):
        return None
    return math.exp(-sum(values) / len(values))  # type: ignore[arg-type]


def stream_generation(stream: Stream, prompt_len: int, t0: float, t_split: float,
                      config: Mapping[str, Any], url: str) -> Generation:
    """A `Generation` from one complete stream: time to first token (``t0`` -> its first chunk)
    as the prefill; the decode phase from ``t_split`` (when the last request of the batch had
    its first chunk, which opens the decode window) to this stream's last chunk, holding the
    chunks that came after ``t_split`` (by arrival, never by a race with the window's opening).
    One iteration per chunk; token counts are the server's (`server_protocol.chunk_tokens`)."""
    chunks = stream.chunks
    if any(c.count is None for c in chunks):
        raise EngineError(f"the server at {url} streams text without token ids or per-token "
                          "logprobs, so its tokens cannot be counted (never from re-tokenised "
                          "text): add --engine-option logprobs=true")
    ids = [i for c in chunks for i in c.ids] if all(c.ids is not None for c in chunks) else []
    its = [Iteration(emitted=int(c.count), proposed=None, accepted=None, draft_depth=None,
                     target_forwards=None, draft_forwards=None,
                     time_other_s=(c.t - chunks[k - 1].t) if k else None)
           for k, c in enumerate(chunks) if c.count]
    first = chunks[0].t if chunks else t0
    last = chunks[-1].t if chunks else t_split
    decode_tokens = sum(int(c.count) for c in chunks if c.t > t_split)  # type: ignore[misc]
    stop = STOP.get(stream.finish_reason or "", stream.finish_reason or "unknown")
    gen = build_generation(ids, "".join(c.text for c in chunks), prompt_len, its, first - t0,
                           max(0.0, last - t_split), stop, config, decode_tokens=decode_tokens)
    total = sum(int(c.count) for c in chunks)  # type: ignore[misc]
    if ids:
        return gen
    return dataclasses.replace(gen, stats=dataclasses.replace(gen.stats, tokens_emitted=total))


@dataclass(frozen=True)
class ServedRequest:
    """One request the engine served, kept for the audit (`engines.http_audit`): its prompt and
    the server's token ids, the speculative counts its body reported (None: none) and its batch
    (the index of the counters around it in `HttpEngine.batch_counters`)."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    spec: BodySpec | None
    batch: int


class HttpEngine(Engine):
    name = SERVER
    device = "server"

    def __init__(self, model: ModelSpec, options: Mapping[str, Any] | None = None):
        super().__init__(model, options)
        import_engine_library("prometheus_client")
        if not self.options.get("base_url"):
            raise UnsupportedError("engine 'http' needs its server: --engine http://HOST:PORT")
        if self.options["prompt"] not in ("ids", "text"):
            raise UnsupportedError(f"--engine-option prompt={self.options['prompt']!r}: give "
                                   "ids (token ids) or text")
        self.base_url = url = check_server_url(self.options["base_url"])
        self.timeout_s = float(self.options["timeout_s"])
        listing = get_json(url, "/v1/models", self.timeout_s)
        entries = listing.get("data") if isinstance(listing, Mapping) else None
        if not isinstance(entries, list):
            raise EngineError(f"{url}/v1/models answered no model list; give the base URL of an "
                              "OpenAI-compatible server")
        self.served = served_model(entries, self.options.get("model"), url)
        entry = next(e for e in entries if str(e.get("id")) == self.served)
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or 0
        self.remote = remote_reason(host)
        pid = self.options.get("server_pid")
        self.pids = (int(pid),) if pid else (() if self.remote else listening_pids(port))
        families, self.metrics_reason = self._families()
        self.tokenizer: Any = None
        self.version, version_reason = self._version(entry)
        self.dtype = "server"
        self.config = {
            "base_url": url, "model": readable_model(self.served), "model_id": self.served,
            "prompt": self.options["prompt"],
            "logprobs": bool(self.options["logprobs"]),
            "server_model": {k: entry[k] for k in MODEL_KEYS if k in entry}
            | {k: v for k, v in entry.items() if "spec" in k.lower()},
            "speculative_metrics": families,
            # where a request's body reports its counts, they win over "acceptance"'s
            "acceptance_body": "per request: vLLM's metrics.speculative_decoding, TensorRT-LLM's "
                               "speculative_decoding, llama-server's timings",
            "acceptance": ("the server's spec_decode counters in /metrics, diffed around each "
                           "batch" if self.metrics_reason is None else
                           f"None: {self.metrics_reason}"),
            "block_efficiency": BLOCK_RULE + ("" if self.metrics_reason is None else
                                              f" (/metrics: {self.metrics_reason})"),
            "perplexity": ("the server's logprobs of the sampled tokens" if
                           self.options["logprobs"] else "scored locally under the target from "
                           "the server's token ids (None: the server returns none; "
                           "--engine-option logprobs=true asks for its logprobs)"),
        } | ({} if version_reason is None else {"version": f"None: {version_reason}"})
        self.served_requests: list[ServedRequest] = []  # every request, for the audit
        # the /metrics counters before and after each batch (None: none)
        self.batch_counters: list[tuple[dict[str, float] | None, dict[str, float] | None]] = []

    # -- the server -----------------------------------------------------------------------
    def _metrics_text(self) -> tuple[str | None, str | None]:
        """/metrics' text, or None with the reason the server gives none."""
        try:
            status, body = request(self.base_url, "GET", "/metrics", self.timeout_s)
        except EngineError as error:
            return None, f"its /metrics could not be read ({error})"
        if status != 200:
            return None, f"the server has no /metrics (HTTP {status})"
        return body.decode("utf-8", errors="replace"), None

    def _families(self) -> tuple[list[str], str | None]:
        text, reason = self._metrics_text()
        if text is None:
            return [], reason
        try:
            families = spec_families(text)
            counters = spec_counters(text, self.served)
        except ValueError as error:
            return [], f"its /metrics is not Prometheus text ({error})"
        if not {"proposed", "accepted"} <= set(counters):
            return families, ("its /metrics has no spec_decode draft/accepted counters (no "
                              "speculation configured, or a server that does not count it)")
        return families, None

    def _counters(self) -> dict[str, float] | None:
        """The speculative counters now (outside every window), None without them."""
        if self.metrics_reason is not None:
            return None
        text, _ = self._metrics_text()
        return None if text is None else spec_counters(text, self.served)

    def _version(self, entry: Mapping[str, Any]) -> tuple[str | None, str | None]:
        """The server's version as it states it (``/version``: vLLM's, say), prefixed by its
        ``/v1/models`` owner ("vllm 0.32.0"); else None with the reason (an owner such as
        llama_cpp.server's "me" is no version, never recorded as one)."""
        owner = str(entry.get("owned_by") or "server")
        try:
            status, body = request(self.base_url, "GET", "/version", self.timeout_s)
        except EngineError as error:
            return None, f"its /version could not be read ({error})"
        try:
            version = json.loads(body).get("version") if status == 200 else None
        except (ValueError, AttributeError):
            version = None
        if not version:
            return None, (f"the server states no version (/version: HTTP {status}); its "
                          f"/v1/models owner is {owner!r}")
        return f"{owner} {version}", None

    # -- the contract -----------------------------------------------------------------------
    def draft_id(self, spec: DecoderSpec) -> str | None:
        return None  # the server's own drafting, recorded in engine_config

    def use_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def model_suffix(self) -> str:
        return model_suffix(self.base_url)  # +http@HOST:PORT: two servers' rows never pool

    def unmetered(self) -> str | None:
        return self.remote

    def processes(self, spec: DecoderSpec) -> tuple[int, ...]:
        return self.pids

    def _body(self, prompt: list[int], params: Mapping[str, Any], max_new_tokens: int,
              seed: int) -> dict[str, Any]:
        if self.options["prompt"] == "text":
            if self.tokenizer is None:
                raise EngineError("--engine-option prompt=text needs the target's tokenizer "
                                  "(the engine was opened without the HF pair)")
            sent: Any = self.tokenizer.decode(prompt, skip_special_tokens=False)
        else:
            sent = list(prompt)
        body = {"model": self.served, "prompt": sent, "max_tokens": max_new_tokens,
                "stream": True, "stream_options": {"include_usage": True},
                "temperature": float(params["temperature"]), "top_p": float(params["top_p"]),
                "top_k": int(params["top_k"]), "seed": seed,
                "return_token_ids": True, "return_tokens": True}  # vLLM's, llama-server's
        if self.options["logprobs"]:
            body["logprobs"] = 1
        return body

    def generate(self, spec: DecoderSpec, prompts: Sequence[list[int]], max_new_tokens: int,
                 seed: int = 0, on_phase: PhaseHook | None = None) -> list[Generation]:
        params = self.params(spec)
        hook = on_phase or (lambda phase: None)
        bodies = [self._body(list(p), params, max_new_tokens, seed + i)  # rows independent
                  for i, p in enumerate(prompts)]
        before = self._counters()
        streams = [Stream() for _ in prompts]
        firsts = [threading.Event() for _ in prompts]
        threads = [threading.Thread(target=read_stream, daemon=True,
                                    args=(self.base_url, b, self.timeout_s, s, e.set))
                   for b, s, e in zip(bodies, streams, firsts, strict=True)]
        hook("prefill")
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for e in firsts:  # set at each request's first tokens, or at its end
            e.wait()
        hook("decode")
        for t in threads:
            t.join()
        hook("end")
        failed = next((s.error for s in streams if s.error is not None), None)
        if failed is not None:
            raise failed  # no row: the runner stores one only after generate returns
        after = self._counters()
        config = {"decoder": spec.name, **params, "max_new_tokens": max_new_tokens, "seed": seed,
                  "engine": self.name}
        t_split = max((s.first_t for s in streams if s.first_t is not None), default=t0)
        built = [stream_generation(s, len(p), t0, t_split, {**config, "seed": seed + i},
                                   self.base_url)
                 for i, (s, p) in enumerate(zip(streams, prompts, strict=True))]
        accept = acceptance_columns(before, after, len(prompts),
                                    [g.stats.tokens_emitted for g in built])
        gens = []
        for s, p, g in zip(streams, prompts, built, strict=True):
            columns = (body_columns(s.spec, g.stats.tokens_emitted) if s.spec is not None
                       else accept)
            gens.append(dataclasses.replace(g, stats=dataclasses.replace(
                g.stats, perplexity=logprob_perplexity(s), **columns)))
            self.served_requests.append(ServedRequest(tuple(p), tuple(g.token_ids), s.spec,
                                             len(self.batch_counters)))
        self.batch_counters.append((before, after))
        return gens
