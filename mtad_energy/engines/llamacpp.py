"""llama.cpp (``llama-cpp-python``) under the instrument: the GGUF as shipped, batch 1.

- ``ar``: ``Llama.generate`` with no draft; ``pld``: its `LlamaPromptLookupDecoding`; ``spd``:
  `SelfDraft`, a `LlamaDraftModel` that runs a second ``Llama`` on a GGUF (the target's own file
  unless ``draft_path`` is given: the model as its own draft) greedily for ``gamma`` tokens and
  rolls its cache back to what the target kept.
- Phases as for a streamed request: "prefill" is the prompt's eval (the draft's too) and the first
  token it gives; "decode" the rest, its tokens/s = the tokens after the first / its seconds.
  (Splitting the prompt's eval as the generate loop does changes llama.cpp's greedy output at
  near-ties: a batch of one token runs other kernels than the whole prompt.) Iteration 0 is the
  prompt's forward: its token and forward count, so block efficiency compares with the loop's.
- Statistics: llama.cpp keeps no acceptance counters and ``llama_perf_context`` counts verify
  batches as prompt evaluation. So target forwards are counted by wrapping ``Llama.eval`` (one
  iteration per decode eval, a forward per ``n_batch`` chunk), proposals by wrapping the draft
  model, and accepted = the leading emitted tokens of an iteration equal to its proposal.
- Sampling: llama.cpp's chain applies top-k, top-p, then the temperature (min-p off here); the
  project warps temperature, top-k, top-p. They agree for greedy (temperature 0), temperature 1,
  or top_p = 1; anything else is refused. Acceptance at temperature > 0 is llama.cpp's
  sample-and-match (a draft token kept when the target's sample equals it).
- Threads and wait policy are pinned (``n_threads``, ``n_threads_batch``: the process's torch
  thread count unless given) and recorded in the engine configuration.
- Loaded without the extra (repacking) buffer types: on AMX CPUs llama.cpp otherwise segfaults
  in ``ggml_backend_amx_mul_mat`` (upstream llama.cpp issue 20824).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtad_energy.decoding.runtime.generate import PhaseHook
from mtad_energy.decoding.runtime.stats import Generation
from mtad_energy.engines.base import Engine, Iteration, build_generation, import_engine_library
from mtad_energy.engines.registry import EngineError, UnsupportedError

if TYPE_CHECKING:  # types only
    from mtad_energy.specs import DecoderSpec, ModelSpec


def gguf_path(model: ModelSpec) -> Path:
    """The GGUF llama.cpp loads: ``--target FILE.gguf``, else the alias's shipped GGUF."""
    if model.target:
        path = Path(model.target)
        if path.suffix != ".gguf" or not path.is_file():
            raise UnsupportedError(f"engine 'llamacpp' loads a GGUF file; --target {model.target} "
                                   "is not one (give --target FILE.gguf, or the alias smollm2)")
        return path
    if model.alias == "smollm2":
        from mtad_energy.models import smollm2_gguf_path

        return smollm2_gguf_path()
    raise UnsupportedError(f"engine 'llamacpp' has no GGUF for the alias {model.alias!r}: give "
                           "--target FILE.gguf (or --model smollm2)")


def draft_gguf(model: ModelSpec, target: Path) -> Path:
    """spd's draft: ``--draft FILE.gguf``, else the target's own GGUF (``--draft self`` or none:
    the model as its own draft)."""
    if model.draft in (None, "self"):
        return target
    path = Path(model.draft)
    if path.suffix != ".gguf" or not path.is_file():
        raise UnsupportedError(f"engine 'llamacpp' drafts with a GGUF: --draft self (the target's "
                               f"own file) or --draft FILE.gguf; got {model.draft!r}")
    return path


def check_warp(params: Mapping[str, Any]) -> None:
    """Refuse a warp llama.cpp's sampler chain cannot reproduce (see the module docstring)."""
    t, p = float(params["temperature"]), float(params["top_p"])
    if t not in (0.0, 1.0) and p < 1.0:
        raise UnsupportedError(
            f"llama.cpp applies top_p before the temperature, the project after it: temperature "
            f"{t} with top_p {p} would warp differently; use temperature 0 or 1, or top_p=1")


@contextlib.contextmanager
def no_extra_buffer_types() -> Iterator[None]:
    """Models loaded inside get ``use_extra_bufts = False`` (no weight repacking, no AMX)."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params():  # type: ignore[no-untyped-def]
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


@dataclass
class Trace:
    """What one generation's wrapped calls saw, in order: ("eval", start, end, tokens,
    forwards) and ("draft", start, end, proposal, draft forwards)."""

    events: list[tuple] = field(default_factory=list)
    on: bool = False


def _traced_eval(llm: Any, trace: Trace, n_batch: int) -> None:
    """Wrap ``llm.eval`` (an instance attribute shadows the method ``generate`` calls)."""
    inner = type(llm).eval.__get__(llm)

    def eval(tokens: Sequence[int]) -> None:  # noqa: A001 (llama-cpp-python's name)
        t0 = time.perf_counter()
        inner(tokens)
        if trace.on:
            trace.events.append(("eval", t0, time.perf_counter(), len(tokens),
                                 math.ceil(len(tokens) / n_batch)))

    llm.eval = eval


class SelfDraft:
    """A draft model for ``Llama.generate``: a second ``Llama`` proposing ``gamma`` greedy
    tokens. Its cache keeps the longest prefix it shares with the target's tokens (rolled back
    past the first rejected draft token) and evaluates only the rest."""

    def __init__(self, llm: Any, gamma: int):
        from llama_cpp._internals import LlamaSampler

        self.llm, self.gamma, self.forwards = llm, gamma, 0
        self.sampler = LlamaSampler()
        self.sampler.add_greedy()

    def prime(self, prefix: Sequence[int]) -> None:
        """Prefill the draft's cache with the prompt (all but its last token)."""
        self.llm.reset()
        if prefix:
            self.llm.eval(list(prefix))

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        import numpy as np

        ids = [int(t) for t in input_ids]
        llm, keep = self.llm, 0
        cached = llm.input_ids[:llm.n_tokens]
        while keep < min(len(cached), len(ids) - 1) and cached[keep] == ids[keep]:
            keep += 1
        llm.n_tokens = keep  # eval() removes the cache past n_tokens
        out, feed = [], ids[keep:]
        for _ in range(self.gamma):
            llm.eval(feed)
            self.forwards += 1
            token = self.sampler.sample(llm._ctx, -1)
            out.append(token)
            feed = [token]
        return np.array(out, dtype=np.intc)


class TracedDraft:
    """Wraps a draft model: records each proposal, its time and the draft forwards it ran."""

    def __init__(self, inner: Any, trace: Trace):
        self.inner, self.trace = inner, trace

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        before = getattr(self.inner, "forwards", 0)
        t0 = time.perf_counter()
        proposal = self.inner(input_ids, **kwargs)
        if self.trace.on:
            self.trace.events.append(("draft", t0, time.perf_counter(),
                                      [int(t) for t in proposal],
                                      getattr(self.inner, "forwards", 0) - before))
        return proposal


def iterations(events: list[tuple], tokens: list[int], t_decode: float, t_end: float
               ) -> list[Iteration]:
    """Per iteration (one target eval, with the draft call before it): emitted tokens
    (``tokens`` split by how many each eval's samples yielded: its tokens evaluated minus the
    drafts not reached), the proposal, accepted = leading emitted tokens equal to the proposal,
    and times. Iteration 0 is the prompt's eval, which gives the first token inside the prefill
    window (its times are the prefill's: 0 here); the others tile [t_decode, t_end]."""
    its: list[dict[str, Any]] = []
    pending: tuple | None = None
    for ev in events:
        if ev[0] == "draft":
            pending = ev
            continue
        _, e0, e1, _, fw = ev
        d = pending or ("draft", e0, e0, [], 0)
        its.append({"start": d[1] if pending else e0, "draft_s": d[2] - d[1], "target_s": e1 - e0,
                    "proposal": d[3], "draft_fw": d[4], "target_fw": fw})
        pending = None
    if len(its) > 1:
        its[1]["start"] = t_decode
    out, pos = [], 0
    for k, it in enumerate(its):
        if pos >= len(tokens):
            break
        proposal, left = it["proposal"], tokens[pos:]
        # the eval yields its first sample, then one more per leading proposal token matched
        matched = 0
        while matched < min(len(proposal), len(left)) and left[matched] == proposal[matched]:
            matched += 1
        emitted = min(matched + 1, len(left))
        accepted = min(matched, emitted)  # a block cut by EOS / max_new_tokens keeps what it emitted
        end = its[k + 1]["start"] if k + 1 < len(its) else t_end
        if k == 0:
            it.update(start=end, target_s=0.0, draft_s=0.0)
        out.append(Iteration(
            emitted=emitted, proposed=len(proposal), accepted=accepted,
            draft_depth=len(proposal), target_forwards=it["target_fw"],
            draft_forwards=it["draft_fw"], time_target_s=it["target_s"],
            time_draft_s=it["draft_s"],
            time_other_s=max(0.0, end - it["start"] - it["target_s"] - it["draft_s"])))
        pos += emitted
    return out


class LlamaCppEngine(Engine):
    name = "llamacpp"

    def __init__(self, model: ModelSpec, options: Mapping[str, Any] | None = None):
        super().__init__(model, options)
        llama_cpp = import_engine_library("llama_cpp")  # e.g. a missing libgomp
        from mtad_energy.engines import thread_settings

        threads = thread_settings()
        self.path = gguf_path(model)
        self.draft_path = Path(self.options.get("draft_path") or draft_gguf(model, self.path))
        self.n_threads = int(self.options.get("n_threads") or threads["threads"])
        self.n_threads_batch = int(self.options.get("n_threads_batch") or self.n_threads)
        self.n_ctx = int(self.options.get("n_ctx", 1024))
        self.n_batch = int(self.options.get("n_batch", 512))
        self.context_length = self.n_ctx - 1  # the position after the last draft token
        self.version = f"llama-cpp-python {llama_cpp.__version__}"
        quant = re.search(r"\.((?:I?Q\d\w*)|F16|BF16|F32)\.gguf$", self.path.name, re.IGNORECASE)
        self.dtype = f"gguf-{quant.group(1)}" if quant else "gguf"
        self.traces = {k: Trace() for k in ("plain", "spec", "draft")}
        t0 = time.perf_counter()
        try:
            with no_extra_buffer_types():
                self.plain = self._load(self.path, logits_all=False)  # ar
                self.spec = self._load(self.path, logits_all=True)  # verifies drafts
                self.draft_llm = self._load(self.draft_path, logits_all=False)  # spd's draft
        except (ValueError, RuntimeError, OSError) as error:
            raise EngineError(f"llama.cpp failed to load {self.path}: {error}") from error
        self.load_time_s = time.perf_counter() - t0
        for key, llm in (("plain", self.plain), ("spec", self.spec)):
            _traced_eval(llm, self.traces[key], self.n_batch)
        self.config = {
            "model_path": str(self.path), "draft_path": str(self.draft_path),
            "n_threads": self.n_threads, "n_threads_batch": self.n_threads_batch,
            "n_ctx": self.n_ctx, "n_batch": self.n_batch, "use_extra_bufts": False,
            "wait_policy": threads["omp_wait_policy"], "omp_num_threads": threads["omp_num_threads"],
            "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "draft_sampling": "greedy",
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        }

    def _load(self, path: Path, logits_all: bool) -> Any:
        from llama_cpp import Llama

        return Llama(str(path), n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_batch,
                     n_threads=self.n_threads, n_threads_batch=self.n_threads_batch,
                     logits_all=logits_all, verbose=False)

    def draft_id(self, spec: DecoderSpec) -> str | None:
        if spec.name != "spd":
            return None
        same = self.draft_path == self.path
        return f"self:{self.path.name}" if same else self.draft_path.name

    def params(self, spec: DecoderSpec) -> dict[str, Any]:
        params = super().params(spec)
        check_warp(params)
        return params

    def generate(self, spec: DecoderSpec, prompts: Sequence[list[int]], max_new_tokens: int,
                 seed: int = 0, on_phase: PhaseHook | None = None) -> list[Generation]:
        self.kind.check_batch_size(len(prompts))
        params = self.params(spec)
        prompt = list(prompts[0])
        need = len(prompt) + max_new_tokens + int(params.get("gamma", 0))
        if need > self.context_length:
            raise UnsupportedError(
                f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + the draft length "
                f"needs {need} positions, more than llama.cpp's n_ctx {self.n_ctx}; lower "
                "--max-new-tokens or load the engine with a larger n_ctx")
        try:
            return [self._generate(spec.name, params, prompt, max_new_tokens, seed, on_phase)]
        except (RuntimeError, OSError) as error:
            raise EngineError(f"llama.cpp died generating ({spec.label}): {error}") from error

    def _generate(self, decoder: str, params: dict[str, Any], prompt: list[int],
                  max_new_tokens: int, seed: int, on_phase: PhaseHook | None) -> Generation:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        hook = on_phase or (lambda phase: None)
        llm, trace = (self.plain, self.traces["plain"]) if decoder == "ar" else \
            (self.spec, self.traces["spec"])
        draft = None
        if decoder == "pld":
            draft = LlamaPromptLookupDecoding(max_ngram_size=params["max_ngram"],
                                              num_pred_tokens=params["gamma"])
        elif decoder == "spd":
            draft = SelfDraft(self.draft_llm, params["gamma"])
        llm.draft_model = TracedDraft(draft, trace) if draft is not None else None
        llm.set_seed(seed)
        trace.events.clear()
        tokens: list[int] = []
        stop = "max_new_tokens"
        trace.on = True
        try:
            # prefill: the prompt's eval and its first token (B = 1: switch at the first token)
            hook("prefill")
            t0 = time.perf_counter()
            llm.reset()
            if isinstance(draft, SelfDraft):
                draft.prime(prompt[:-1])
            stream = llm.generate(prompt, top_k=int(params["top_k"]), top_p=float(params["top_p"]),
                                  min_p=0.0, typical_p=1.0, temp=float(params["temperature"]),
                                  repeat_penalty=1.0, reset=True)
            token = next(stream)
            t_prefill = time.perf_counter()
            hook("decode")
            t_decode = time.perf_counter()
            while True:
                tokens.append(int(token))
                if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
                    stop = "eos"
                    break
                if len(tokens) >= max_new_tokens:
                    break
                token = next(stream)
            stream.close()
        finally:
            trace.on = False
            llm.draft_model = None
        t_end = time.perf_counter()
        hook("end")
        its = iterations(trace.events, tokens, t_decode, t_end)
        text = llm.detokenize(tokens).decode("utf-8", errors="replace")
        config = {"decoder": decoder, **params, "max_new_tokens": max_new_tokens, "seed": seed,
                  "engine": self.name}
        return build_generation(tokens, text, len(prompt), its, t_prefill - t0, t_end - t_decode,
                                stop, config, decode_tokens=len(tokens) - 1)

    def close(self) -> None:
        for attr in ("plain", "spec", "draft_llm"):
            llm = getattr(self, attr, None)
            if llm is not None:
                llm.close()
                setattr(self, attr, None)
