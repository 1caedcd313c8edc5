"""Phase timing: draft / target / other add up to decode time, per generation and per iteration;
the CPU timer never touches CUDA; the CUDA timer records events and never synchronises; on a GPU
an iteration of the generate loop makes exactly one host synchronisation (the token read-back)."""

from __future__ import annotations

import collections
import dataclasses
import time
import traceback
import types
import warnings

import pytest
import torch

from mtad_energy.decoding.runtime import timer as timer_mod
from mtad_energy.decoding.runtime.generate import generate
from mtad_energy.decoding.runtime.timer import CpuPhaseTimer, CudaPhaseTimer, PhaseTimer
from tests.decoding.host_reads import at_read_back

REL = 1e-9


class SlowModel:
    """A model whose forward takes at least ``delay_s`` of wall time (a sleep on the host)."""

    def __init__(self, model, delay_s: float):
        self.model, self.delay_s, self.config = model, delay_s, model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def parameters(self):
        return self.model.parameters()

    def __call__(self, **kwargs):
        time.sleep(self.delay_s)
        return self.model(**kwargs)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("decoder", ["ar", "spd", "mtad"])
def test_phases_add_up_to_decode_time(llama_pair, decoder):
    t_delay, d_delay = 0.002, 0.001
    pair = dataclasses.replace(llama_pair, target=SlowModel(llama_pair.target, t_delay),
                               draft=SlowModel(llama_pair.draft, d_delay))
    gen = generate(decoder, pair, [5, 6, 7, 8], max_new_tokens=12, seed=3, compute_perplexity=False)
    st, steps = gen.stats, gen.steps
    assert steps and len(steps) == st.iterations
    # per generation: the three parts are the decode time
    assert close(st.time_draft_s + st.time_target_s + st.time_other_s, st.decode_time_s)
    assert st.time_other_s > 0
    # per iteration: the parts sum to the generation's (iterations tile the decode phase)
    for name in ("time_draft_s", "time_target_s", "time_other_s"):
        assert close(sum(getattr(s, name) for s in steps), getattr(st, name)), name
    assert close(sum(s.time_draft_s + s.time_target_s + s.time_other_s for s in steps),
                 st.decode_time_s)
    # each forward's time lands in its own iteration and phase
    for s in steps:
        assert s.time_target_s >= s.target_forwards * t_delay
        assert s.time_draft_s >= s.draft_forwards * d_delay
        assert s.time_draft_s == 0.0 or s.draft_forwards > 0
        assert s.time_other_s >= 0.0
    assert st.time_target_s >= st.target_forwards * t_delay
    assert st.time_draft_s >= st.draft_forwards * d_delay


def test_nested_phases_do_not_double_count(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timer_mod, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    timer = PhaseTimer(torch.device("cpu"))
    with timer("target"):
        now[0] += 1.0
        with timer("draft"):
            now[0] += 2.0
        now[0] += 4.0
    with timer("draft"):
        now[0] += 8.0
    assert timer.time_s == {"target": 5.0, "draft": 10.0}


def _no_cuda(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the CPU timer called into torch.cuda")

    for name in ("synchronize", "Event", "current_stream", "current_device"):
        monkeypatch.setattr(torch.cuda, name, boom)


def test_cpu_timer_makes_no_cuda_calls(model_dirs, monkeypatch):
    from mtad_energy.models import load_pair

    pair = load_pair(target=model_dirs["llama"], draft=model_dirs["llama-draft"], device="cpu")
    assert isinstance(PhaseTimer(torch.device("cpu")), CpuPhaseTimer)
    assert isinstance(PhaseTimer.for_device("cpu"), CpuPhaseTimer)
    _no_cuda(monkeypatch)
    timer = PhaseTimer.for_device(torch.device("cpu"))
    with timer("draft"):
        pass
    timer.sync()
    timer.flush()
    assert timer.time_s["draft"] >= 0.0
    gen = generate("spd", pair, [5, 6, 7], max_new_tokens=6, compute_perplexity=False)
    assert gen.stats.time_draft_s > 0 and gen.stats.time_target_s > 0


class FakeEvent:
    """Stands in for torch.cuda.Event: a GPU clock that advances by 1 ms per recorded event."""

    clock_ms = 0.0
    created = 0
    syncs = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        FakeEvent.created += 1
        self.t_ms: float | None = None
        self.done = True

    def record(self, stream=None) -> None:
        FakeEvent.clock_ms += 1.0
        self.t_ms = FakeEvent.clock_ms

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        FakeEvent.syncs += 1
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done and end.done, "read before the events completed"
        return end.t_ms - self.t_ms


def test_cuda_timer_uses_events_without_syncing(monkeypatch):
    """The CUDA implementation, on CPU with fake events: no synchronisation while timing, times
    read at flush, events pooled, nesting exclusive."""
    FakeEvent.clock_ms, FakeEvent.created, FakeEvent.syncs = 0.0, 0, 0
    device_syncs = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: device_syncs.append(device))
    timer = PhaseTimer.for_device("cuda")
    assert isinstance(timer, CudaPhaseTimer)
    for _ in range(50):
        with timer("draft"):
            FakeEvent.clock_ms += 2.0  # the block's GPU work: start..end = 3 ms
        with timer("target"):
            FakeEvent.clock_ms += 4.0  # 5 ms
        assert timer._pending  # nothing read yet
        timer.flush()
    assert device_syncs == [] and FakeEvent.syncs == 0
    assert FakeEvent.created == 4  # two events per phase block, reused from the pool
    assert timer.time_s == {"draft": pytest.approx(50 * 3e-3), "target": pytest.approx(50 * 5e-3)}
    # nesting: the outer phase gets only its own time
    timer = CudaPhaseTimer("cuda")
    with timer("target"):
        FakeEvent.clock_ms += 10.0
        with timer("draft"):
            FakeEvent.clock_ms += 20.0
    # outer: 11 ms before the inner block + 1 ms after it (between its re-opening and closing)
    assert timer.time_s == {"target": pytest.approx(12e-3), "draft": pytest.approx(21e-3)}
    # reading time_s before the events completed waits for them instead of failing
    with timer("draft"):
        pass
    timer._pending[-1][2].done = False
    assert timer.time_s["draft"] == pytest.approx(22e-3)
    assert FakeEvent.syncs == 1
    timer.sync()
    assert device_syncs == [timer.device]


# --------------------------------------------------------------------------------------- GPU


def _is_boundary_sync(stack: traceback.StackSummary) -> bool:
    """The sync at the decode/end boundary (``PhaseTimer.sync``), which energy windows need."""
    return any(f.name == "sync" and f.filename.endswith("runtime/timer.py") for f in stack)


def _is_read_back(stack: traceback.StackSummary) -> bool:
    """The loop's one read-back per iteration: where `host_reads.READ_BACK` is (the CPU test
    classifies by the same code object, so the two cannot drift apart)."""
    return any(at_read_back(f.filename, f.name) for f in stack)


def _where(stack: traceback.StackSummary) -> str:
    frames = [f for f in stack if "mtad_energy" in f.filename] or list(stack)[-3:]
    return " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.line}" for f in frames[::-1])


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("decoder", ["ar", "spd", "mtad"])
def test_one_host_sync_per_iteration_on_gpu(model_dirs, decoder, compile):
    from mtad_energy.models import load_pair

    pair = load_pair(target=model_dirs["llama"], draft=model_dirs["llama-draft"], device="cuda")
    prompt = [5, 6, 7, 8]
    generate(decoder, pair, prompt, max_new_tokens=8, compute_perplexity=False,  # warm up
             compile=compile)

    syncs: list[traceback.StackSummary] = []
    recording = [False]

    def on_sync(message, category, filename, lineno, file=None, line=None):
        if recording[0] and "synchroniz" in str(message):
            syncs.append(traceback.extract_stack()[:-1])

    def hook(phase: str) -> None:
        recording[0] = phase == "decode"

    from mtad_energy.decoding.registry import get_decoder
    from mtad_energy.decoding.runtime.generate import encode_prompt, generate_ids

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_sync
        torch.cuda.set_sync_debug_mode("warn")
        try:
            gen = generate_ids(get_decoder(decoder), pair, encode_prompt(pair, prompt), 8,
                               compute_perplexity=False, on_phase=hook, compile=compile)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    st = gen.stats
    assert close(st.time_draft_s + st.time_target_s + st.time_other_s, st.decode_time_s)
    assert st.time_target_s > 0 and (decoder == "ar" or st.time_draft_s > 0)
    for name in ("time_draft_s", "time_target_s", "time_other_s"):
        assert close(sum(getattr(s, name) for s in gen.steps), getattr(st, name)), name
    in_loop = [s for s in syncs if not _is_boundary_sync(s)]
    others = [s for s in in_loop if not _is_read_back(s)]
    places = collections.Counter(_where(s) for s in others)
    report = "\n".join(f"  {n:4d} x {where}" for where, n in places.most_common())
    assert len(in_loop) == st.iterations and not others, (
        f"{decoder}: {len(in_loop)} host syncs in {st.iterations} iterations "
        f"({len(in_loop) / st.iterations:.2f} per iteration; expected exactly 1, the token "
        f"read-back); {len(others)} elsewhere, by place:\n{report}")
