"""The memory-bandwidth floor of a decode forward, and how close eager and compiled forwards get.

At batch 1 a decode forward reads every weight once (of an untied embedding table only the row
it gathers: kilobytes, left out), so it cannot run faster than ``bytes read / copy bandwidth``
(docs/design.md section 7; `decode_read_bytes`, the counting rule's weight bytes).
`decode_forward_time` times consecutive one-token forwards of a model over a cached context, each
fed the argmax of the previous one on the device (no host sync inside the timed loop), in two ways:

* ``eager``: a `DynamicCache` and the plain Hugging Face forward (what the decoders run today);
* ``compiled``: a transformers `StaticCache` and ``torch.compile`` of the forward; on CUDA with
  ``mode="reduce-overhead"`` (CUDA graphs), the way gpt-fast and serving engines remove launch
  overhead. The static cache is what lets the graph be captured once and replayed; each forward
  is told its position and given a padding mask the cache's length (`static_step_kwargs`), so
  no model derives a shape from the cache's length.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mtad_energy.energy.work import dims_of
from mtad_energy.hf_cache import cache_kwargs


def weight_bytes(model) -> int:
    """Bytes of the model's parameters (tied tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def decode_read_bytes(model) -> int:
    """Bytes of the parameters a one-token decode forward reads: the counting rule's weight bytes
    (`mtad_energy.energy.work`: every weight but an untied embedding table, of which a forward gathers
    one row; a table tied to the LM head is read whole there), so the floor and the energy model
    agree on what a forward moves. A model type the rule does not count: all its weights."""
    try:
        return dims_of(model).read_once_bytes()
    except ValueError:
        return weight_bytes(model)


MATMUL_KERNEL = re.compile(r"gemm|gemv|matmul|cutlass|nvjet|xmma|splitk|(^|_)mm(_|$)", re.I)


@dataclass(frozen=True)
class KernelProfile:
    """What one decode forward's device time went to, from the CUDA kernels torch's profiler
    saw over a block of forwards: kernels per forward, their summed time (busy) and that of the
    matrix products (GEMM / GEMV kernels, by name)."""

    kernels_per_forward: float
    busy_ms: float
    matmul_ms: float

    @classmethod
    def of(cls, kernels: list[tuple[str, float]], forwards: int) -> KernelProfile:
        """From ``(kernel name, duration in microseconds)`` over ``forwards`` forwards."""
        busy = sum(us for _, us in kernels)
        matmul = sum(us for name, us in kernels if MATMUL_KERNEL.search(name))
        return cls(len(kernels) / forwards, busy / forwards / 1e3, matmul / forwards / 1e3)

    def limits(self, forward_ms: float, matrix_bytes: int, bandwidth_bytes_per_s: float) -> dict:
        """Where the forward's time above its floor goes: ``idle_ms`` between kernels (launch
        and dependency gaps), ``matmul_excess_ms`` (the matrix products' time past their
        weights / copy bandwidth), ``other_ms`` (every other kernel: norms, attention, rotary,
        argmax), and the matrix products' achieved bandwidth as a fraction of the copy's; the
        largest term named as ``limit``."""
        matmul_floor_ms = matrix_bytes / bandwidth_bytes_per_s * 1e3
        terms = {"idle_ms": forward_ms - self.busy_ms,
                 "matmul_excess_ms": self.matmul_ms - matmul_floor_ms,
                 "other_ms": self.busy_ms - self.matmul_ms}
        return {**terms, "kernels_per_forward": self.kernels_per_forward,
                "matmul_bandwidth_frac": matmul_floor_ms / self.matmul_ms if self.matmul_ms else None,
                "limit": max(terms, key=terms.get).removesuffix("_ms")}


def matrix_bytes(model) -> int:
    """Bytes of the 2-D weights of the model's Linear layers (the LM head included)."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.data_ptr() not in seen:
            seen.add(m.weight.data_ptr())
            total += m.weight.numel() * m.weight.element_size()
    return total


def _cuda_kernels(block: Callable[[], Any]) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of the CUDA kernels ``block()`` ran (torch.profiler, CUDA
    activity; kernels replayed from a CUDA graph included where CUPTI reports them)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        block()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == DeviceType.CUDA]


def static_step_kwargs(rows: int, start: int, end: int, device: torch.device
                       ) -> list[dict[str, torch.Tensor]]:
    """The keyword arguments of the one-token forwards at positions ``start .. end - 1`` on a
    `StaticCache` of ``end`` slots, one dict a forward, all made before any is timed (no
    host-to-device copy inside the loop): ``cache_position`` ``[1]`` (where to write, for the
    transformers versions that read it), ``position_ids [rows, 1]`` and one 2-D
    ``attention_mask [rows, end]`` of ones (bool) shared by all.

    The rule: a compiled forward is told its positions and its mask's length, never left to
    derive them from the cache's length, which a `StaticCache` keeps as a 0-d device tensor
    (transformers 5.24; it ignores ``cache_position``). Llama derives ``arange + length``, fixed
    shapes; OPT, given neither mask nor positions, builds a ones mask of ``length + 1`` columns
    to count positions from: a shape read off device data, which ``fullgraph`` compilation
    refuses ("Could not guard on data-dependent expression") and which would cost a host sync
    and an allocation every forward. The ones do not unmask unwritten slots: the causal mask,
    from the cache's own write position, hides them."""
    mask = torch.ones(rows, end, dtype=torch.bool, device=device)
    return [{"cache_position": torch.tensor([p], device=device),
             "position_ids": torch.full((rows, 1), p, dtype=torch.long, device=device),
             "attention_mask": mask} for p in range(start, end)]


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Seconds of ``fn()`` on ``device``: CUDA events on a GPU, perf_counter on the CPU."""
    if device.type == "cuda":
        def cuda_time(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return cuda_time

    def cpu_time(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return cpu_time


def copy_bandwidth(device: str | torch.device = "cuda", nbytes: int = 1 << 30,
                   repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written
    (the best of ``repeats`` copies of ``nbytes``)."""
    device = torch.device(device)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    time_of = _timer(device)
    def copy() -> None:
        dst.copy_(src)

    copy()  # warm-up
    best = min(time_of(copy) for _ in range(repeats))
    return 2 * src.numel() * src.element_size() / best


@dataclass(frozen=True)
class ForwardTiming:
    mode: str  # "eager" | "compiled"
    forward_ms: float  # median per forward
    forward_ms_min: float
    forwards: int
    compile_s: float | None  # warm-up incl. compilation / graph capture (compiled only)
    detail: str = ""
    kernels: KernelProfile | None = None  # CUDA only (`profile_kernels`)
    # the argmax chain of the first warm-up block, a row a batch row: the tokens the forwards fed
    # themselves from the same cached context in either mode, so eager and compiled must agree
    tokens: tuple[tuple[int, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def decode_forward_time(model, mode: str = "eager", context_len: int = 128, forwards: int = 32,
                        repeats: int = 5, batch_size: int = 1,
                        backend: str | Callable = "inductor",
                        compile_mode: str | None = None, seed: int = 0,
                        profile_kernels: bool = False) -> ForwardTiming:
    """Median time of one decode forward (``batch_size`` rows, one new token each) over a cache
    of ``context_len`` tokens, from ``repeats`` timed blocks of ``forwards`` consecutive forwards.

    ``backend``: torch.compile's, a name or a callable. ``compile_mode`` defaults to
    ``"reduce-overhead"`` on CUDA (CUDA graphs) and ``None`` on CPU.
    ``profile_kernels`` (CUDA): one more block under torch's profiler, after the timed ones, into
    `ForwardTiming.kernels`.
    """
    from transformers import StaticCache

    from mtad_energy.decoding.runtime.cache import crop, new_cache

    if mode not in ("eager", "compiled"):
        raise ValueError(f"mode must be 'eager' or 'compiled', got {mode!r}")
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    prompt = torch.randint(0, vocab, (batch_size, context_len), generator=gen).to(device)
    blocks = 2 + repeats + profile_kernels  # warm-up + timed (+ profiled)
    total = context_len + forwards * blocks
    time_of = _timer(device)

    if mode == "eager":
        cache = new_cache(model)
        step = model.forward
    else:
        cache = StaticCache(config=model.config, max_cache_len=total)
        if compile_mode is None and device.type == "cuda" and backend == "inductor":
            compile_mode = "reduce-overhead"
        step = torch.compile(model.forward, backend=backend, mode=compile_mode, fullgraph=True,
                             dynamic=False)
    logits = model(input_ids=prompt, **cache_kwargs(cache), use_cache=True,
                   cache_position=torch.arange(context_len, device=device)).logits
    first = logits[:, -1:].argmax(-1)
    # compiled: the static cache only ever moves forward here. Rewinding cache_position to an
    # earlier position made the compiled forward write past the cache's end (transformers 5.23,
    # torch 2.13): a compiled decoder path must own its write position (issue 11). Each step's
    # inputs made before timing: no host-to-device copy inside the loop.
    steps = iter(static_step_kwargs(batch_size, context_len, total, device)
                 if mode == "compiled" else ())

    def block(chain: list[torch.Tensor] | None = None):
        """``forwards`` decode steps (each step's tokens appended to ``chain`` if given).
        Eager: always from the same cached context, so every block reuses the same cache sizes
        (a cache that grows to new sizes pays the caching allocator's growth, 2-3x the forward
        on an H100). Compiled: the next ``forwards`` positions of the static cache (fixed shapes
        whatever the position)."""
        ids = first
        for _ in range(forwards):
            if mode == "eager":  # what the decoders run: the cache knows its own length
                out = step(input_ids=ids, **cache_kwargs(cache), use_cache=True)
            else:  # a static cache: told its position and mask (`static_step_kwargs`)
                out = step(input_ids=ids, **cache_kwargs(cache), use_cache=True, **next(steps))
            ids = out.logits[:, -1:].argmax(-1)
            if chain is not None:
                chain.append(ids)
        if mode == "eager":
            crop(cache, context_len)  # roll back to the same context for the next block

    chain: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for i in range(2):  # warm-up: compilation, graph capture, allocator, clocks
        block(chain if i == 0 else None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    warm_s = time.perf_counter() - t0
    tokens = tuple(map(tuple, torch.cat(chain, 1).tolist()))
    times = [time_of(block) / forwards for _ in range(repeats)]
    detail = f"backend={backend}, mode={compile_mode}" if mode == "compiled" else ""
    kernels = None
    if profile_kernels and device.type == "cuda":  # after the timing: it never costs the timing
        try:
            seen = _cuda_kernels(block)
            why = None if seen else "the profiler saw no CUDA kernels (graph replays hidden)"
            kernels = KernelProfile.of(seen, forwards) if seen else None
        except Exception as err:  # noqa: BLE001 - a profiler that fails says so, times stand
            why = f"kernel profile failed: {type(err).__name__}: {err}"
        if why:
            detail += f"{'; ' if detail else ''}{why}"
    return ForwardTiming(mode, statistics.median(times) * 1e3, min(times) * 1e3, forwards * repeats,
                         warm_s if mode == "compiled" else None, detail, kernels, tokens)
