"""Benchmark: the decode loop's host time per iteration, where forwards cost almost nothing.

On a tiny random Llama pair (target 3 layers x 64 hidden, draft 1 layer, 128-token vocabulary,
no EOS; EAGLE-3 and Medusa heads built as tests/conftest.py builds them) every decoder of the
registry decodes at B = 1 and B = 8 (decoders that do not batch are skipped at B = 8, with the
reason), eager and/or compiled. Host time = decode time - time inside draft and target forwards
(what `GenerationStats.time_other_s` counts), in microseconds per loop iteration, split by phase:

* ``draft``  - inside `Decoder.step`, before the last draft forward that precedes the verify;
* ``verify`` - inside `step`, after that draft forward and before the first target forward
  (building the verify input: concatenations, tree masks, positions);
* ``accept`` - inside `step`, after the first target forward opens (acceptance, the bonus
  token, `StepResult`; a head decoder's drafting for the next iteration lands here too);
* ``cache``  - cache moves (crop / keep a tree path / select or repeat rows), in or out of step;
* ``loop``   - the rest: the generate loop's read-back, appends and statistics.

The phases come from an event log the benchmark records around the phase timer's blocks, the
decoder's step and the runners' cache moves (patched here, never in the library), so the hot
path is unchanged; the log adds about 1 us per event. Beside them, ``ar`` through Hugging
Face's own ``generate`` loop (sampling with the same warp) as an anchor: its host time per
iteration is the median gap between the end of one forward and the start of the next.

Runs are interleaved (every decoder and batch size once per repeat) so drift on a shared machine
hits all alike; each cell is the median over repeats of one generation's per-iteration mean. The
load average is printed and stored.

    OMP_NUM_THREADS=1 python experiments/bench_host.py --modes eager            # ~5 min
    OMP_NUM_THREADS=1 python experiments/bench_host.py --modes compiled --decoders ar,spd,mtad

Compiling takes minutes per decoder and batch size on a busy 2-core CPU (inductor), hence
``--modes eager`` as the default and a decoder list for compiled runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

import mtad_energy
import mtad_energy.decoding.runtime.generate  # noqa: F401 - the module (the package exports a function of that name)
from mtad_energy.decoding.registry import DECODERS, get_decoder
from mtad_energy.decoding.runtime.generate import generate_rows
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.timer import CpuPhaseTimer
from mtad_energy.models import load_pair
from tests import tiny

PHASES = ("draft", "verify", "accept", "cache", "loop")
CACHE_MOVES = ("crop_rows", "crop", "keep_positions", "keep_tree", "select_rows", "repeat_rows")
LOG: list[tuple[float, str, str]] = []  # (perf_counter, event, what)
_depth = [0]  # nesting of cache moves (only the outermost is logged)


class LoggingTimer(CpuPhaseTimer):
    """`CpuPhaseTimer` that also logs each forward block's open and close."""

    @classmethod
    def for_device(cls, device):
        return cls(device)

    def _open(self, phase: str) -> None:
        self._t0 = t = time.perf_counter()
        LOG.append((t, "fwd+", phase))

    def _close(self, phase: str) -> None:
        t = time.perf_counter()
        self._time_s[phase] = self._time_s.get(phase, 0.0) + t - self._t0
        LOG.append((t, "fwd-", phase))


def _logged(fn: Callable, tag: str) -> Callable:
    def wrapper(*args, **kwargs):
        outer = _depth[0] == 0
        if outer:
            LOG.append((time.perf_counter(), "cache+", tag))
        _depth[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth[0] -= 1
            if outer:
                LOG.append((time.perf_counter(), "cache-", tag))
    wrapper.__wrapped_by_bench__ = True
    return wrapper


def instrument() -> None:
    """Log the phase timer's blocks and every runner class's cache moves (this process only)."""
    from mtad_energy.decoding.runtime import batch, head_runner

    sys.modules["mtad_energy.decoding.runtime.generate"].PhaseTimer = LoggingTimer
    classes = [ModelRunner, batch.RowLayout, batch.RowsRunner, batch.PerRowRunner,
               head_runner.HeadRunner]
    try:
        from mtad_energy.decoding.runtime import static

        classes.append(static.StaticRunner)
    except ImportError:
        pass
    for cls in classes:
        for name in CACHE_MOVES:
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "__wrapped_by_bench__", False):
                setattr(cls, name, _logged(fn, name))


def log_step(decoder) -> None:
    """Log each call of ``decoder.step`` (an instance attribute over the method)."""
    step = type(decoder).step.__get__(decoder)

    def logged(s):
        LOG.append((time.perf_counter(), "step+", ""))
        try:
            return step(s)
        finally:
            LOG.append((time.perf_counter(), "step-", ""))
    decoder.step = logged


def phase_seconds(log: list[tuple[float, str, str]]) -> dict[str, float]:
    """Host seconds per phase (draft / verify / accept / cache) of the steps in ``log``: the
    gaps between events that fall outside forwards and cache moves, labelled by where they lie
    in their step (module docstring)."""
    out = dict.fromkeys(PHASES[:4], 0.0)
    start = next((i for i, e in enumerate(log) if e[1] == "step+"), len(log))
    in_step = in_fwd = in_cache = False
    gaps: list[tuple[float, int]] = []  # this step's host gaps: (seconds, forwards before it)
    fwd_phases: list[str] = []
    prev = log[start][0] if start < len(log) else 0.0
    for t, ev, what in log[start:]:
        dt, prev = t - prev, t
        if in_cache and not in_fwd:  # a cache move inside a forward (compaction) is forward
            out["cache"] += dt
        elif in_step and not in_fwd:
            gaps.append((dt, len(fwd_phases)))
        if ev == "step+":
            in_step, gaps, fwd_phases = True, [], []
        elif ev == "fwd+":
            in_fwd = True
            fwd_phases.append(what)
        elif ev == "fwd-":
            in_fwd = False
        elif ev == "cache+":
            in_cache = True
        elif ev == "cache-":
            in_cache = False
        elif ev == "step-":
            in_step = False
            first_target = fwd_phases.index("target") if "target" in fwd_phases else len(fwd_phases)
            drafts = [i for i in range(first_target) if fwd_phases[i] == "draft"]
            last_draft = drafts[-1] + 1 if drafts else 0  # forwards seen at its close
            for dt_gap, n_fwd in gaps:  # no draft forward: everything before the verify
                if n_fwd > first_target:
                    out["accept"] += dt_gap
                elif n_fwd >= last_draft:
                    out["verify"] += dt_gap
                else:
                    out["draft"] += dt_gap
    return out


def tiny_pair(root: Path, vocab: int, layers: int, hidden: int):
    """A tiny random Llama target and 1-layer draft with EAGLE-3 and Medusa heads, saved and
    loaded through `load_pair` as the tests do (no EOS: every generation runs to the end)."""
    tok = tiny.word_tokenizer(vocab, eos=False)
    target = tiny.llama(vocab, 0, layers=layers, hidden=hidden, ctx=1024)
    tdir = tiny.save(target, tok, root / "target")
    ddir = tiny.save(tiny.llama(vocab, 1, layers=1, hidden=hidden, ctx=1024), tok, root / "draft")
    eagle = tiny.save_eagle(target, root / "eagle", version=3, draft_vocab=vocab * 3 // 4)
    medusa = tiny.save_medusa(target, root / "medusa")
    return load_pair(target=tdir, draft=f"{ddir},eagle:{eagle},medusa:{medusa}", device="cpu")


def run_loop(decoder, pair, prompts: list[list[int]], new_tokens: int, seed: int,
             compile: bool) -> dict[str, float]:
    """One generation through the project's loop: per-iteration microseconds by phase."""
    LOG.clear()
    g = generate_rows(decoder, pair, prompts, new_tokens, seed=seed, compute_perplexity=False,
                      compile=compile)[0]
    s = g.stats
    phases = phase_seconds(LOG)
    host_s = s.time_other_s
    phases["loop"] = host_s - sum(phases.values())
    it = s.iterations
    row = {f"{k}_us": v / it * 1e6 for k, v in phases.items()}
    row.update(host_us=host_s / it * 1e6, fwd_us=(s.time_draft_s + s.time_target_s) / it * 1e6,
               iterations=it, tokens_per_iter=s.tokens_emitted / it)
    return row


def run_hf(pair, prompts: list[list[int]], new_tokens: int, seed: int, warp) -> dict[str, float]:
    """``ar`` through transformers' ``generate``: median gap between consecutive forwards."""
    model = pair.target
    marks: list[tuple[float, float]] = []
    t_open = [0.0]

    def pre(*_):
        t_open[0] = time.perf_counter()

    def post(*_):
        marks.append((t_open[0], time.perf_counter()))

    h1 = model.register_forward_pre_hook(pre)
    h2 = model.register_forward_hook(post)
    try:
        torch.manual_seed(seed)
        ids = torch.tensor(prompts, dtype=torch.long)
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                       temperature=warp.temperature, top_k=warp.top_k, top_p=warp.top_p,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    finally:
        h1.remove(), h2.remove()
    gaps = [b[0] - a[1] for a, b in zip(marks[1:], marks[2:], strict=False)]  # decode only
    fwd = [b - a for a, b in marks[1:]]
    return {"host_us": statistics.median(gaps) * 1e6, "fwd_us": statistics.median(fwd) * 1e6,
            "iterations": len(marks) - 1, "tokens_per_iter": 1.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decoders", default=",".join(DECODERS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--modes", default="eager", help="eager,compiled")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3, help="EAGLE-3 taps 3 distinct layers")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers generate anchor")
    ap.add_argument("--label", default="", help="stored in every row (e.g. before / after)")
    ap.add_argument("--out", default="experiments/results/bench_host")
    args = ap.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    names = [n for n in args.decoders.split(",") if n]
    unknown = [n for n in names if n not in DECODERS]
    if unknown:
        raise SystemExit(f"unknown decoder(s) {unknown}; known: {', '.join(DECODERS)}")
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - {"eager", "compiled"}:
        raise SystemExit(f"--modes takes eager and/or compiled, got {args.modes!r}")
    batches = [int(b) for b in args.batches.split(",") if b]
    load0 = os.getloadavg()
    instrument()
    tmp = tempfile.TemporaryDirectory()
    pair = tiny_pair(Path(tmp.name), args.vocab, args.layers, args.hidden)
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(2, args.vocab, (b, args.prompt_len), generator=gen).tolist()
               for b in batches}
    cells, skipped = [], []
    for name in names:
        for b in batches:
            if b > 1 and not DECODERS[name].batched:
                skipped.append({"decoder": name, "batch": b,
                                "reason": f"{name} does not decode batches (batched=False)"})
                continue
            for mode in modes:
                dec = get_decoder(name)
                log_step(dec)
                cells.append((name, b, mode, dec))
    warp = get_decoder("ar").params.warp
    t0 = time.perf_counter()
    for _name, b, mode, dec in cells:  # warm-up (compiles the compiled cells' graphs)
        run_loop(dec, pair, prompts[b], args.new_tokens, 0, mode == "compiled")
    if not args.no_hf:
        for b in batches:
            run_hf(pair, prompts[b], 8, 0, warp)
    print(f"warm-up done ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for rep in range(args.repeats):
        for name, b, mode, dec in cells:
            rows.append({"decoder": name, "batch": b, "mode": mode, "repeat": rep,
                         **run_loop(dec, pair, prompts[b], args.new_tokens, rep + 1,
                                    mode == "compiled")})
        if not args.no_hf:
            for b in batches:
                rows.append({"decoder": "ar (hf generate)", "batch": b, "mode": "eager",
                             "repeat": rep, **run_hf(pair, prompts[b], args.new_tokens, rep, warp)})
        print(f"repeat {rep + 1}/{args.repeats} ({time.perf_counter() - t0:.0f} s, load "
              f"{os.getloadavg()[0]:.1f})", flush=True)
    load1 = os.getloadavg()
    df = pd.DataFrame(rows)
    cols = ["host_us", *[f"{p}_us" for p in PHASES], "fwd_us", "iterations", "tokens_per_iter"]
    table = (df.groupby(["decoder", "batch", "mode"], sort=False)[cols].median().reset_index())
    ar = table[table.decoder == "ar"].set_index(["batch", "mode"]).host_us
    table["x_ar"] = [r.host_us / ar.get((r.batch, r.mode), float("nan"))
                     for r in table.itertuples()]
    table.insert(0, "label", args.label)
    print(f"tiny Llama {args.layers}x{args.hidden}, vocab {args.vocab}, {args.new_tokens} new "
          f"tokens, prompt {args.prompt_len}, 1 thread, {args.repeats} repeats (medians, us per "
          f"iteration); load average {load0[0]:.1f} at start, {load1[0]:.1f} at end")
    fmt = {c: "{:.0f}".format for c in cols if c.endswith("_us")}
    fmt.update(x_ar="{:.2f}".format, tokens_per_iter="{:.2f}".format, iterations="{:.0f}".format)
    print(table.to_string(index=False, formatters=fmt))
    for s in skipped:
        print(f"skipped {s['decoder']} at B={s['batch']}: {s['reason']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out.with_suffix(".csv"), index=False)
    df.to_csv(out.with_name(out.name + "_runs.csv"), index=False)
    meta = {"label": args.label, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count(), "load_average_start": load0, "load_average_end": load1,
            "model": {"vocab": args.vocab, "layers": args.layers, "hidden": args.hidden,
                      "draft_layers": 1, "heads": ["eagle-3", "medusa"]},
            "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
            "repeats": args.repeats, "modes": modes, "batches": batches, "skipped": skipped,
            "package": str(Path(mtad_energy.__file__).parent)}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    print(f"wrote {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
