"""The compiled path: a static KV cache the runner writes at its own position, and a forward
compiled once per shape (gpt-fast style), under the same generate loop and decoders, for one
sequence or a batch of rows.

`StaticRunner` has `ModelRunner`'s interface and `batch.RowLayout`'s layout (columns shared by
the rows, a per-row validity mask, compaction). Differences from the eager runners, all inside:

* the KV cache is preallocated ``[R, H_kv, L, D]`` per layer, with a bool ``valid [R, L]``
  (`slot_cache.SlotCache`); a forward of k tokens writes slots ``start .. start+k-1`` where
  ``start`` is a 0-d device tensor the runner sets from its host-side column count, so
  **rollback is invalidating columns and moving the write position** (nothing is freed or
  copied);
* the rows are padded to a **bucket** (1, 2, 4, 8, ... sequences, times the rows a sequence
  expands to: beams), so a sweep over batch sizes compiles a bounded number of
  graphs; padding rows hold no valid column and see only their own token; rows that finish
  keep riding in their slot;
* every forward builds its 4-D additive mask and position ids inside the compiled graph from
  ``valid`` and ``start`` (a chain: row r's query i sees r's valid columns up to ``start + i``;
  a token tree: r's valid columns before the tree plus the node's ancestors) and writes which
  of its columns are real into ``valid``; transformers returns a 4-D mask as-is, so the model
  code never asks the cache for its length and the graph has no data-dependent shapes;
* ``torch.compile`` with ``dynamic=False`` specialises on the input shape: one graph per
  (rows, k, L) the loop uses (``CompileOptions(dynamic=None)``: one symbolic graph reused
  across them). A chain forward of k > 2 tokens runs at the decoder's widest chain width
  (``ForwardShape.max_chain``: its verify of gamma + 1) and a tree at the widest tree of the
  same decoder and shape seen so far, the extra tokens invalid; so a generation's shorter
  last verifies never need a new graph, and each decoder pads only to its own widths;
* the first forward of a shape on a cache (compiling, and on CUDA recording its CUDA graph)
  runs untimed before the timed one, and its seconds are kept apart (`compile_s`): the loop's
  clock skips them, and `Generation.stats.compile_s` reports them;
* dead columns are reclaimed by compaction when the next forward would not fit.

The compiled forward and its cache live in a `static_graphs.StaticGraphs` per (model, role)
that outlives a generation, so later generations reuse the graphs (and the cache, when they need
the same rows and slots). The prefill runs the same function uncompiled (its length differs per
prompt).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from mtad_energy.decoding.runtime.batch import RowLayout, rows_runner
from mtad_energy.decoding.runtime.compiled import (
    CompileOptions,
    graphs_compiled,
    reset_dynamo,
    signature,
)
from mtad_energy.decoding.runtime.graph_call import Pending
from mtad_energy.decoding.runtime.head_runner import release_heads
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.slot_forward import (
    Fused,
    Later,
    repeat_slot_rows,
    rows_of,
    select_slot_rows,
    slot_forward,
)
from mtad_energy.decoding.runtime.state import to_device
from mtad_energy.decoding.runtime.static_fused import (  # noqa: F401 (ForwardShape, WarmForward: static.*)
    ForwardShape,
    FusedCalls,
    WarmForward,
)
from mtad_energy.decoding.runtime.static_graphs import (
    check_static_support,
    eager_reason,
    graphs_for,
    install_capture_hooks,
    release_graphs,
    row_bucket,
)
from mtad_energy.decoding.runtime.timer import PhaseTimer
from mtad_energy.energy.work import Forward

# models already warned about staying eager (Python's own once-per-location filter is reset by
# every `warnings.catch_warnings` block, which torch and transformers enter often)
_WARNED_EAGER: weakref.WeakSet = weakref.WeakSet()


def make_runner(model, timer: PhaseTimer, phase: str, rows: int, slots: int,
                options: CompileOptions | None = None,
                shape: ForwardShape | None = None) -> ModelRunner:
    """A `StaticRunner` for ``model`` and ``rows`` sequences, or the eager runner (with a
    warning naming why) for a model that cannot compile."""
    why = eager_reason(model)
    if why is None:
        return StaticRunner(model, timer, phase, slots, options, rows, shape)
    if model not in _WARNED_EAGER:  # once per model, not per generation (a sweep makes many)
        _WARNED_EAGER.add(model)
        warnings.warn(f"compile ({phase}): {why}", stacklevel=3)
    return rows_runner(model, timer, phase, rows, (shape or ForwardShape()).hidden)


def reset_compiled() -> None:
    """Forget every graph and every record of one, as a fresh process starts: dynamo's graphs
    and the pure functions' signatures (`compiled.reset_dynamo`), the static graphs' caches with
    the shapes they compiled (`static_graphs.release_graphs`: the next generation makes new caches
    and compiles its shapes before its windows again) and the heads' compiled calls
    (`head_runner.release_heads`). A record left behind would claim a graph dynamo forgot, and
    its forward would compile inside its timed window."""
    reset_dynamo()
    release_graphs()
    release_heads()


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of a fresh contiguous tensor (a copy only if it has others)."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= size
    return t if t.stride() == tuple(reversed(expected)) else t.clone(
        memory_format=torch.contiguous_format)


class StaticRunner(FusedCalls, RowLayout, ModelRunner):
    """`ModelRunner` over a model's `StaticGraphs`: same interface, static cache, compiled
    forwards, for ``seqs`` sequences padded to their bucket (see the module docstring); its
    multi-step calls fused into one graph call each (`static_fused.FusedCalls`).

    Each part declares what it needs of the others: `FusedCalls` the names it annotates (this
    class's forwards, shape and graphs, the layout's mirror), its unfused calls `ModelRunner`'s
    by name; `batch.RowLayout` its storage operations, defined here (`_valid`, `_set_valid`,
    `_cut`, `_gather_columns`)."""

    compiled = True

    def __init__(self, model, timer: PhaseTimer, phase: str, slots: int,
                 options: CompileOptions | None = None, seqs: int = 1,
                 shape: ForwardShape | None = None):
        check_static_support(model)
        self.model = model
        self.forwards = 0
        # (rows, tokens, KV columns attended) of every forward as it runs: padding rows and
        # widths included, attention over all L slots (`mtad_energy.energy.work` counts them)
        self.forward_shapes: list[Forward] = []
        self.compile_s = 0.0  # seconds of first forwards of a shape (compiling), untimed
        self._timer = timer
        self._phase = phase
        self.shape = shape or ForwardShape()
        self.hidden_layers = self.shape.hidden
        self.hidden: torch.Tensor | None = None
        if self.hidden_layers:  # transformers installs them lazily, under a lock dynamo refuses
            install_capture_hooks(model)
        self.device = next(model.parameters()).device
        self.graphs = graphs_for(model, phase, self.device, options)
        bucket = row_bucket(seqs)
        self._init_layout(seqs, pad=bucket - seqs)
        self.cache = self.graphs.cache_for(bucket * self.shape.rows_per_seq, slots)
        self.n = 0  # columns in use (host side: set by forwards, cuts and compaction)
        self._ones: dict[tuple, torch.Tensor] = {}  # constants, made once per shape (`_constant`)
        self._pending = Pending(self.device)  # fused calls to compile after the generation
        self.prewarm_s = self._prewarm()  # before any window opens: not the generation's
        self.compile_s -= self.prewarm_s

    # -- RowLayout storage ---------------------------------------------------------------------
    @property
    def _seqs(self) -> int:
        """The bucket's sequences: the real ones and the padding."""
        return len(self.cols) + self.pad

    @property
    def _rows(self) -> int:
        return self._seqs * self.width

    def _valid(self) -> torch.Tensor:
        return self.cache.valid[:self._rows, :self.n]

    def _flat_valid(self) -> tuple[torch.Tensor, int]:
        return self.cache.flat_valid, self.cache.slots

    def _set_valid(self, valid: torch.Tensor) -> None:
        self.cache.valid[:self._rows, :self.n] = valid

    def _cut(self, end: int) -> None:
        # no forward reads a column at or past the write position before writing it (its KV and
        # validity): moving the position back drops the columns from ``end`` on
        self.n = end

    def _gather_columns(self, order: torch.Tensor) -> None:
        r, keep = order.shape
        kv = self.cache.kv  # [2 * layers, R, H, L, D]: every layer's keys and values at once
        idx = order[None, :, None, :, None].expand(kv.shape[0], r, kv.shape[2], keep, kv.shape[4])
        kv[:, :r, :, :keep] = kv[:, :r, :, :self.n].gather(3, idx)
        self.cache.valid[:r, :keep] = self.cache.valid[:r, :self.n].gather(1, order)
        self.cache.valid[:, keep:self.n] = False
        self.n = keep

    # -- forwards ------------------------------------------------------------------------------
    def _width(self, rows: int, k: int, m: int | None) -> int:
        """The width to run a forward of k tokens at (see the module docstring)."""
        if m is None:
            return k if k <= 2 else max(k, self.shape.max_chain)
        seen = self.graphs.tree_widths.setdefault((self.shape.key, rows, m), set())
        wider = [w for w in seen if w >= k]
        if wider:
            return min(wider)
        seen.add(k)
        return k

    def _fit(self, width: int) -> None:
        """Room for ``width`` more columns: compact, and grow only if that is not enough."""
        if self.n + width <= self.cache.slots:
            return
        self.compact()
        if self.n + width > self.cache.slots:
            self.cache = self.graphs.grow(self.cache, self.n + width)
            self._prewarm()

    def _run(self, input_ids: torch.Tensor, new: torch.Tensor | None,
             anc: torch.Tensor | None = None, depths: torch.Tensor | None = None,
             compiled: bool = True, features: torch.Tensor | None = None,
             fused: Fused | None = None) -> Any:
        rows, k = input_ids.shape
        total = self._rows
        m = None if anc is None else anc.shape[-1] - k
        width = self._width(total, k, m) if compiled else k
        later = () if fused is None else fused.later  # the fused call's forwards after the first
        more = sum(f.columns for f in later)
        self._fit(width + more)
        grow = (0, width - k, 0, total - rows)  # pad: tokens right, rows below
        padded = grow != (0, 0, 0, 0)
        # dense inputs (dynamo guards on strides, and a slice of the ids buffer has the
        # buffer's, which grow with the prompt); nothing copied that is dense already
        if not padded:
            real = self._real(total, width) if new is None else new
        else:
            real = F.pad(self._real(rows, k) if new is None else new, grow, value=False)
        args: tuple = (_dense(F.pad(input_ids, grow) if padded else input_ids), _dense(real))
        if anc is not None:  # padded nodes see only themselves, at depth 1
            pad_n = width - k
            if pad_n:
                anc = F.pad(anc, (0, pad_n, 0, pad_n))
                anc[..., k:, m + k:] |= torch.eye(pad_n, dtype=torch.bool, device=anc.device)
                depths = F.pad(depths, (0, pad_n), value=1)
            if anc.shape[0] > 1 and total > rows:  # a tree per sequence: padding takes the first's
                anc, depths = rows_of(anc, rows, total, 3), rows_of(depths, rows, total, 2)
            args += (_dense(anc), _dense(depths))
        kwargs: dict = {"hidden": self.hidden_layers} if self.hidden_layers else {}
        if features is not None:  # a head's input, padded as the tokens
            kwargs["features"] = _dense(F.pad(features, (0, 0, *grow)) if padded else features)
        self.cache.start.fill_(self.n)
        key = self._graph_key(total, width, m, anc is not None and anc.shape[0] > 1,
                              None if features is None else features.shape[-1])
        if compiled and key not in self.cache.warmed:  # the forward's own shape: compiled now
            self._warm(args, kwargs)
            self.cache.warmed.add(key)
        forward = partial(self.graphs.forward, compiled=compiled)
        if fused is not None:
            args += fused.args
            fused_key = key + fused.key()
            if fused_key in self.cache.warmed:
                forward = partial(self.graphs.forward, call=fused.call)
            else:  # met first: its forwards' graphs now, the fused graph after the generation
                self._warm_later(later, fused.width)
                self._compile_later(fused_key, args, kwargs, fused.call, m or 0)
                forward = partial(self.graphs.uncompiled, call=fused.call)
        self.forwards += 1 + len(later)
        self.forward_shapes.append(Forward(total, width, self.cache.slots,
                                           0 if features is None else features.shape[-1]))
        self.forward_shapes += [Forward(total * fused.width, f.columns, self.cache.slots,
                                        f.features or 0) for f in later]
        before = graphs_compiled()
        with self._timer(self._phase):
            out = forward(self.cache, args, kwargs=kwargs)
        if graphs_compiled() != before:
            warnings.warn(f"compile ({self._phase}): a forward of shape {key} compiled inside "
                          "its timed window", stacklevel=3)
        self.n += k + more
        if fused is not None:
            return out
        if self.hidden_layers:
            logits, hidden = out
            self.hidden = hidden[:rows, :k] if padded else hidden
            return logits[:rows, :k] if padded else logits
        return out[:rows, :k] if padded else out

    def _real(self, rows: int, k: int) -> torch.Tensor:
        """``[rows, k]`` all True: every token real (made once per shape, not per forward)."""
        return self._constant((rows, k), lambda: torch.ones(rows, k, dtype=torch.bool,
                                                            device=self.device))

    def _real_rows(self, rows: int, width: int = 1) -> torch.Tensor:
        """``[R * width, 1]``: True for the first ``rows * width`` of the R cache rows at
        ``width`` rows per sequence (made once per count)."""
        r = self._seqs * width
        return self._constant(("rows", rows, width), lambda: torch.arange(
            r, device=self.device)[:, None] < rows * width)

    def _graph_key(self, rows: int, width: int, m: int | None, per_row: bool = False,
                   features: int | None = None) -> tuple:
        """What decides a forward's graph: rows, width, tree prefix (None: a chain), one tree
        per sequence or one for all, a head's feature width, the hidden states returned."""
        return ((rows, width, m) + (("per-row",) if per_row else ())
                + (() if features is None else (("features", features),))
                + ((("hidden", self.hidden_layers),) if self.hidden_layers else ()))

    def _prewarm(self) -> float:
        """Compile `ForwardShape.warm_widths` and `ForwardShape.warm_forwards` at the bucket's
        rows on this cache now (see `_warm_widths`, `_warm_tree`). Returns the seconds it took
        (in ``compile_s``)."""
        before = self.compile_s
        self._warm_widths(self.shape.warm_widths)
        rows = self._seqs
        for f in self.shape.warm_forwards:
            if f.m is None:
                self._warm_widths((self._width(rows, f.columns, None),), f.rows_per_seq,
                                  f.features)
            else:  # the width the loop's trees pad to (`_width`), then that tree
                self.graphs.tree_widths.setdefault((self.shape.key, rows, f.m), set()).add(
                    f.columns)
                self._warm_tree(f.columns, f.m, f.features, f.per_seq and rows > 1, rows)
        return self.compile_s - before

    def _features(self, rows: int, k: int, features: int | None) -> dict:
        """A dummy head input of width ``features`` for ``rows x k`` tokens (none: {})."""
        return {} if features is None else {"features": torch.zeros(
            rows, k, features, dtype=getattr(self.model, "dtype", torch.float32),
            device=self.device)}

    def _warm_widths(self, widths: tuple[int, ...], per_seq: int = 1,
                     features: int | None = None) -> float:
        """Compile chain forwards of ``widths`` at the bucket's rows (times ``per_seq`` rows a
        sequence: a beam search's; with a head's ``features`` of that width): dummy tokens
        marked not real, written at the first free slot (nothing becomes valid, the next forward
        overwrites them); a width that does not fit waits for the cache to grow, which warms
        again. Returns the seconds it took (in ``compile_s``)."""
        rows = self._seqs * per_seq
        todo = [w for w in widths
                if self._graph_key(rows, w, None, features=features) not in self.cache.warmed
                and self.n + w <= self.cache.slots]
        kwargs: dict = {"hidden": self.hidden_layers} if self.hidden_layers else {}
        before = self.compile_s
        for width in todo:
            ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
            self.cache.start.fill_(self.n)
            self._warm((ids, torch.zeros_like(ids, dtype=torch.bool)),
                       kwargs | self._features(rows, width, features))
            self.cache.warmed.add(self._graph_key(rows, width, None, features=features))
        return self.compile_s - before

    def _warm_later(self, later: tuple[Later, ...], per_seq: int) -> None:
        """Compile the forwards a fused call runs after its first (`Fused.later`), which run on
        their own while the call is not compiled yet: chain widths (`_warm_widths`), and token
        trees of K nodes after M, a head's with its features and a tree per sequence (dummy
        nodes marked not real at the first free slot, or at M)."""
        chains = tuple(sorted({f.columns for f in later if f.m is None}))
        if chains:
            self._warm_widths(chains, per_seq)
        rows = self._seqs * per_seq
        for k, m, features in later:
            if m is not None:
                self._warm_tree(k, m, features, features is not None and rows > 1, rows)

    def _warm_tree(self, k: int, m: int, features: int | None, per_row: bool,
                   rows: int) -> None:
        """Compile a token tree of K nodes after M at ``rows`` cache rows (a head's with its
        ``features``; ``per_row``: a tree per row): dummy nodes marked not real at the first
        free slot, or at M."""
        key = self._graph_key(rows, k, m, per_row, features)
        at = max(self.n, m)  # room for the M earlier nodes' columns before it
        if key in self.cache.warmed or at + k > self.cache.slots:
            return
        kwargs: dict = {"hidden": self.hidden_layers} if self.hidden_layers else {}
        ids = torch.zeros(rows, k, dtype=torch.long, device=self.device)
        trees = rows if per_row else 1
        anc = torch.ones(trees, k, m + k, dtype=torch.bool, device=self.device)
        self.cache.start.fill_(at)
        self._warm((ids, torch.zeros_like(ids, dtype=torch.bool), anc,
                    torch.ones(trees, k, dtype=torch.long, device=self.device)),
                   kwargs | self._features(rows, k, features))
        self.cache.warmed.add(key)
        if at != self.n:  # the warm wrote past the columns in use (after M earlier nodes):
            self.cache.start.fill_(self.n)  # the fused call that follows starts at them

    def _compile_later(self, key: tuple, args: tuple, kwargs: dict, call: Callable[..., Any],
                       start: int) -> None:
        """Compile ``call`` (a fused call, a row move) met for the first time after the
        generation (`compile_pending`), on the inputs it met it with, at the cache's first
        slots: the generation's cache it overwrites is emptied by the next one (a token tree
        after M earlier nodes at slot M, past them)."""
        def compile_now() -> None:
            if key not in self.cache.warmed:
                self.cache.start.fill_(start)
                self.graphs.warm(self.cache, args, kwargs, call)
                self.cache.warmed.add(key)

        self._pending.add(key, compile_now)

    def _warm(self, args: tuple, kwargs: dict, call=slot_forward) -> None:
        """Run a new shape untimed (compiling it): the calls are idempotent (the same KV and
        validity written at the same slots), their seconds go to ``compile_s``."""
        self.compile_s += self.graphs.warm(self.cache, args, kwargs, call)

    def _new(self, k: int, counts: list[int] | None) -> torch.Tensor | None:
        """``[B, k]``: which tokens of a ragged input are real (row b's last counts[b]), made once
        per distinct counts (a draft's catch-up repeats a few patterns; read-only)."""
        if counts is None:
            return None
        assert self.width == 1, "ragged input while beams are expanded"
        return self._constant(("new", k, *counts), lambda: torch.arange(
            k, device=self.device)[None, :] >= k - to_device(counts, self.device)[:, None])

    def __call__(self, input_ids: torch.Tensor, counts: list[int] | None = None,
                 features: torch.Tensor | None = None) -> torch.Tensor:
        k = input_ids.shape[1]
        logits = self._run(input_ids, self._new(k, counts), features=features)
        self._append_cols(self.n - k, k, counts)  # after `_run`: it may have compacted
        return logits

    def prefill(self, input_ids: torch.Tensor, counts: list[int] | None = None,
                features: torch.Tensor | None = None) -> torch.Tensor:
        k = input_ids.shape[1]
        logits = self._run(input_ids, self._new(k, counts), compiled=False, features=features)
        self._append_cols(self.n - k, k, counts)
        return logits

    def forward_tree(self, input_ids: torch.Tensor, anc_rows: torch.Tensor,
                     depths: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        assert self.width == 1, "a token tree while beams are expanded"
        k = input_ids.shape[1]
        anc = anc_rows if anc_rows.dim() == 3 else anc_rows[None]  # [1 or B, K, M + K]
        depths = depths if depths.dim() == 2 else depths[None]
        logits = self._run(input_ids, None, anc, depths, features=features)
        self._append_cols(self.n - k, k, None)
        return logits

    def __len__(self) -> int:
        return self.n

    # -- rows ----------------------------------------------------------------------------------
    def _padding_rows(self, width: int) -> list[int]:
        """Rows of the padding sequences, ``width`` each, in the current layout."""
        seqs = len(self.cols)
        return [s * self.width + j for s in range(seqs, seqs + self.pad) for j in range(width)]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Gather rows ``[B * W']`` (within each sequence, as `RowsRunner.select_rows`): one
        graph call over every slot (`slot_forward.select_slot_rows`)."""
        width = rows.shape[0] // len(self.cols)
        assert width * len(self.cols) == rows.shape[0], "rows must keep B sequences"
        rows = rows if rows.device == self.device else rows.to(self.device)
        pad = () if not self.pad else (self._constant(  # the padding sequences' rows
            ("padding rows", self.width, width),
            lambda: to_device(self._padding_rows(width), self.device)),)
        self._move_rows(select_slot_rows, (rows, *pad))
        self.width = width

    def _move_rows(self, call: Callable[..., None], args: tuple) -> None:
        """``call(model, cache, *args)``, a move of the cache's rows that returns nothing, as
        one graph call: compiled on the cache once met (a new one runs its Python function,
        counted as the graph call it will be, and compiles after the generation, never inside
        a window: `compile_pending`)."""
        key = (call.__name__, signature(args))
        if key in self.cache.warmed:
            self.graphs.forward(self.cache, args, call=call)
            return
        self._compile_later(key, args, {}, call, self.n)
        self.graphs.uncompiled(self.cache, args, call=call, fused=False)

    def _constant(self, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A read-only device tensor made once per ``key`` (row indices, masks)."""
        t = self._ones.get(key)
        if t is None:
            t = self._ones[key] = make()
        return t

    def repeat_rows(self, n_rows: int) -> None:
        """Expand every sequence's one row to n_rows identical rows (row b*n_rows + w): one
        graph call over every slot (`slot_forward.repeat_slot_rows`)."""
        assert self.width == 1, "rows are expanded already"
        seqs = self._seqs
        assert seqs * n_rows <= self.cache.rows, (
            f"{n_rows} rows per sequence exceed the {self.shape.rows_per_seq} the decoder "
            "declared (Decoder.cache_rows)")
        self._move_rows(repeat_slot_rows, (seqs, n_rows))
        self.width = n_rows

