"""FLOP / byte accounting per op, roofline classification, and trace export.

Stock PyTorch wheels cannot read DRAM byte counters through the profiler, so bytes are computed
analytically from shapes and dtypes: every tensor input is read once and every output written
once; views move no data. FLOPs come from `torch.utils.flop_counter`'s formulas (matmul, conv,
attention); pointwise ops count one FLOP per output element (a convention: PyTorch counts none).

Each op is compute-bound when its intensity (FLOPs per byte) reaches the device's roofline
ridge, peak FLOP/s / peak bytes/s, both measured once (a matmul and a copy) and cached per device
in ``$MTAD_ENERGY_CACHE/roofline.json`` (default ``~/.cache/mtad_energy/``).

Per-op times are taken with a device sync around every op: this is an accounting pass, run
apart from the energy measurement.

torch is imported lazily so `mtad_energy.measure` imports without it.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mtad_energy.energy.tap import matrix_flops
from mtad_energy.measure.base import Clock, SyncFn, no_sync
from mtad_energy.paths import cache_dir

COMPUTE, MEMORY, OTHER = "compute", "memory", "other"


@dataclass(frozen=True)
class DevicePeaks:
    """Measured peaks of one device: FLOP/s (matmul) and bytes/s (copy; read + write)."""

    device: str
    peak_flops_per_s: float
    peak_bytes_per_s: float
    dtype: str

    @property
    def ridge_flop_per_byte(self) -> float:
        """Roofline ridge: intensities at or above it are compute-bound (FLOP/byte)."""
        return self.peak_flops_per_s / self.peak_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ridge_flop_per_byte": self.ridge_flop_per_byte}


def device_key(device: str = "cpu") -> str:
    """Cache key, e.g. ``"cuda:NVIDIA H100 80GB HBM3"`` or ``"cpu:AMD EPYC 7B13"``."""
    if device.startswith("cuda"):
        import torch

        return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    from mtad_energy.measure.env import cpu_model

    return f"cpu:{cpu_model()}"


def _device_sync(device: str) -> SyncFn:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return no_sync


def measure_peaks(
    device: str = "cpu",
    matmul_n: int | None = None,
    copy_bytes: int | None = None,
    dtype: str | None = None,
    repeats: int = 5,
    clock: Clock = time.perf_counter,
) -> DevicePeaks:
    """Peak FLOP/s from an n x n matmul and peak bytes/s from a copy (best of `repeats`)."""
    import torch

    cuda = device.startswith("cuda")
    n = matmul_n or (8192 if cuda else 1024)
    nbytes = copy_bytes or ((1 << 30) if cuda else (1 << 26))
    dt = getattr(torch, dtype) if dtype else (torch.float16 if cuda else torch.float32)
    sync = _device_sync(device)
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)

    def best(fn: Callable[[], object]) -> float:
        fn()  # warm-up (allocations, kernel selection)
        sync()
        times = []
        for _ in range(repeats):
            t0 = clock()
            fn()
            sync()
            times.append(clock() - t0)
        return max(min(times), 1e-12)

    t_mm = best(lambda: torch.mm(a, b))
    t_copy = best(lambda: dst.copy_(src))
    return DevicePeaks(
        device=device_key(device),
        peak_flops_per_s=2.0 * n**3 / t_mm,
        peak_bytes_per_s=2.0 * src.numel() * src.element_size() / t_copy,  # a copy reads and writes
        dtype=str(dt).removeprefix("torch."),
    )


def get_peaks(
    device: str = "cpu",
    cache_file: Path | None = None,
    refresh: bool = False,
    measure: Callable[[str], DevicePeaks] = measure_peaks,
) -> DevicePeaks:
    """Peaks for `device`: measured once, then read from the JSON cache (keyed by device name)."""
    path = cache_file or cache_dir() / "roofline.json"
    key = device_key(device)
    cache: dict[str, Any] = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}  # a broken cache is re-measured, not fatal
    if not refresh and key in cache:
        entry = cache[key]
        return DevicePeaks(
            key, entry["peak_flops_per_s"], entry["peak_bytes_per_s"], entry.get("dtype", "?")
        )
    peaks = measure(device)
    peaks = DevicePeaks(key, peaks.peak_flops_per_s, peaks.peak_bytes_per_s, peaks.dtype)
    cache[key] = {**peaks.to_dict(), "measured_unix_s": time.time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=2, sort_keys=True))
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return peaks


@dataclass(frozen=True)
class OpRecord:
    """One aten op call: FLOPs, bytes moved, wall time (seconds) and its roofline class."""

    name: str
    flops: int
    bytes: int
    time_s: float
    bound: str
    shapes: str

    @property
    def intensity_flop_per_byte(self) -> float | None:
        return None if self.bytes == 0 else self.flops / self.bytes


@dataclass(frozen=True)
class ProfileResult:
    """FLOP / byte accounting of one call.

    T_flop = time in compute-bound ops, T_mem = time in memory-bound ops, T_other = the rest of
    the wall time (views, Python, launch overhead), all in seconds.
    """

    ops: tuple[OpRecord, ...]
    total_flops: int
    total_bytes: int
    t_flop_s: float
    t_mem_s: float
    t_other_s: float
    wall_time_s: float
    peaks: DevicePeaks

    def table(self) -> list[dict[str, Any]]:
        """Per-op-name totals, largest time first (JSON/pandas ready)."""
        agg: dict[tuple[str, str], dict[str, Any]] = defaultdict(
            lambda: {"calls": 0, "flops": 0, "bytes": 0, "time_s": 0.0}
        )
        for op in self.ops:
            row = agg[(op.name, op.bound)]
            row["calls"] += 1
            row["flops"] += op.flops
            row["bytes"] += op.bytes
            row["time_s"] += op.time_s
        rows = [{"op": name, "bound": bound, **vals} for (name, bound), vals in agg.items()]
        return sorted(rows, key=lambda r: -r["time_s"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_flops": self.total_flops,
            "total_bytes": self.total_bytes,
            "t_flop_s": self.t_flop_s,
            "t_mem_s": self.t_mem_s,
            "t_other_s": self.t_other_s,
            "wall_time_s": self.wall_time_s,
            "peaks": self.peaks.to_dict(),
            "ops": self.table(),
        }


def _tensor_bytes(values: Any) -> tuple[int, list[str]]:
    """Bytes of the distinct tensors in `values` (one passed twice counts once), and shapes."""
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(values)
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    total, shapes = 0, []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
        shapes.append(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
    return total, shapes


def _op_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """`matrix_flops`, or one FLOP per output element of a pointwise op (a convention)."""
    import torch
    from torch.utils._pytree import tree_flatten

    flops = matrix_flops(func, args, kwargs, out)
    if flops == 0 and torch.Tag.pointwise in func.tags:
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return int(sum(t.numel() for t in outs))
    return flops


# ops that return a new tensor aliasing their input's storage without moving bytes
_ALIASING_COPIES = frozenset({"_unsafe_view", "alias", "lift_fresh"})


def _make_recorder(clock: Clock, sync: SyncFn) -> Any:
    # imported now so their import time (torch._dynamo: ~1.5 s, pulled in by entering a dispatch
    # mode) is not billed to T_other
    from torch.utils._python_dispatch import TorchDispatchMode

    class _OpRecorder(TorchDispatchMode):
        """Sees every aten op after decomposition, which is where FLOPs and bytes are exact."""

        def __init__(self) -> None:
            super().__init__()
            self.raw: list[tuple[str, int, int, float, str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            sync()
            t0 = clock()
            out = func(*args, **kwargs)
            sync()
            elapsed = clock() - t0
            name = str(func.overloadpacket.__name__)
            if func.is_view or name in _ALIASING_COPIES:
                nbytes, flops, shapes = 0, 0, []
            else:
                in_bytes, in_shapes = _tensor_bytes((args, kwargs))
                out_bytes, out_shapes = _tensor_bytes(out)
                nbytes, shapes = in_bytes + out_bytes, in_shapes + ["->"] + out_shapes
                flops = _op_flops(func, args, kwargs, out)
            self.raw.append((name, flops, nbytes, elapsed, " ".join(shapes)))
            return out

    return _OpRecorder()


def classify(flops: int, nbytes: int, ridge_flop_per_byte: float) -> str:
    """``"compute"`` if flops/bytes >= ridge, ``"memory"`` if it moves data, else ``"other"``."""
    if nbytes == 0:
        return COMPUTE if flops > 0 else OTHER
    return COMPUTE if flops / nbytes >= ridge_flop_per_byte else MEMORY


def profile_ops(
    fn: Callable[..., object],
    *args: Any,
    peaks: DevicePeaks | None = None,
    device: str = "cpu",
    clock: Clock = time.perf_counter,
    sync: SyncFn | None = None,
    **kwargs: Any,
) -> ProfileResult:
    """Run `fn(*args, **kwargs)` once and account FLOPs, bytes and time per aten op.

    Args:
        peaks: roofline peaks; default `get_peaks(device)` (measured once, then cached).
        device: device whose peaks (and sync) apply.
    """
    peaks = peaks or get_peaks(device)
    sync_fn = sync or _device_sync(device)
    recorder = _make_recorder(clock, sync_fn)
    sync_fn()
    start = clock()
    with recorder:
        fn(*args, **kwargs)
    sync_fn()
    wall = clock() - start
    ridge = peaks.ridge_flop_per_byte
    ops = tuple(
        OpRecord(name, flops, nbytes, t, classify(flops, nbytes, ridge), shapes)
        for name, flops, nbytes, t, shapes in recorder.raw
    )
    t_flop = sum(o.time_s for o in ops if o.bound == COMPUTE)
    t_mem = sum(o.time_s for o in ops if o.bound == MEMORY)
    return ProfileResult(
        ops=ops,
        total_flops=sum(o.flops for o in ops),
        total_bytes=sum(o.bytes for o in ops),
        t_flop_s=t_flop,
        t_mem_s=t_mem,
        t_other_s=max(wall - t_flop - t_mem, 0.0),
        wall_time_s=wall,
        peaks=peaks,
    )


def export_trace(
    fn: Callable[..., object],
    *args: Any,
    trace_dir: Path,
    worker_name: str = "mtad-energy",
    **kwargs: Any,
) -> Path:
    """Profile `fn` with torch.profiler (record_shapes, with_flops) and write a Chrome-trace JSON.

    The file is named ``<worker>.<ns>.pt.trace.json`` under `trace_dir`, the layout of
    `torch.profiler.tensorboard_trace_handler`: open it in the Perfetto UI (ui.perfetto.dev) or
    chrome://tracing, or point TensorBoard's profiler plugin at `trace_dir`. Note that
    torch-tb-profiler (TensorBoard's PyTorch profiler plugin) is deprecated and removed from
    Kineto; Perfetto and Holistic Trace Analysis read the same file.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True, with_flops=True) as prof:
        fn(*args, **kwargs)
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / f"{worker_name}.{time.time_ns()}.pt.trace.json"
    prof.export_chrome_trace(str(path))
    return path
