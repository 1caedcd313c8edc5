"""B sequences of different lengths in one KV cache: the layout of batched generation.

Layout: one cache ``[R, H_kv, T, D]`` whose columns are shared by the rows, and a bool ``valid
[R, T]`` saying which columns hold row r's tokens. Every forward appends k columns to every row;
a row with fewer real tokens (a shorter prompt, a draft that needs to catch up on fewer tokens)
is left-padded and its padding columns are invalid. Rolling a row back (rejected drafts)
invalidates its last columns in place: no KV is copied or moved per iteration, at the price of
holes where some rows rejected what others accepted. Each row gets its own position ids (its
count of valid columns) and an attention mask over its valid columns (4-D, passed as-is to
transformers), so a row computes exactly what it would alone.

The host mirrors, per sequence, the columns it holds (`RowLayout.cols`): every count the loop
needs (row lengths, the columns to cut) is known without reading the device. After a token tree
keeps a path chosen on the device, the host knows how many columns a sequence kept but not
which: it records the tree's last column for them (an upper bound, so cutting stays safe).

Dead columns (holes, and the tree nodes off the kept path) are reclaimed by **compaction**: a
stable sort of each row's validity moves its valid columns, in order, to the right end of the
first max(row length) columns (one gather per layer; positions and attention are unchanged, as
keys carry their rotary position and the mask follows the columns). Columns no row holds are
cut off the end for free. So the cache stays within a constant of the longest row.

Token trees (one per sequence, the same shape for all) are appended as K columns valid in
every row; each node sees its row's prefix columns and its ancestors (`forward_tree`); keeping
a path marks the path's columns valid and the other tree columns invalid (`keep_tree`).

Beam decoders expand each sequence to W rows (row b*W + w, `repeat_rows`) and reorder rows
within a sequence (`select_rows`); the beams of a sequence share its columns, so the host
mirror stays per sequence.

`RowLayout` holds what eager and compiled runners share (the host mirror, rollback, tree keeps,
compaction); `RowsRunner` stores the columns in a growing ``DynamicCache``, and
`static.StaticRunner` in preallocated slots with rows padded to a bucket.
"""

from __future__ import annotations

import torch

from mtad_energy.decoding.runtime import cache as kv
from mtad_energy.decoding.runtime.masks import additive_mask
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.state import to_device
from mtad_energy.decoding.runtime.timer import PhaseTimer

# eager: compact once this many columns past the longest row are dead
DEAD_COLUMNS = 32


def compaction_order(valid: torch.Tensor, keep: int) -> torch.Tensor:
    """``valid [R, T]`` -> ``[R, keep]`` column indices: each row's valid columns in order,
    right-aligned, preceded by invalid ones (a stable sort puts False before True), so gathering
    them packs every row into the last ``keep`` columns. ``keep`` >= every row's valid count."""
    return valid.to(torch.uint8).sort(dim=1, stable=True).indices[:, valid.shape[1] - keep:]


class RowLayout:
    """Host mirror of B sequences' columns in a shared cache, and the operations on their
    validity that eager and compiled runners share. ``pad`` sequences after the B real ones are
    padding (a compiled batch rounded up to its bucket): they hold no valid column, ever.

    Subclasses provide the validity (`_valid`: ``[R, T]``, R = (B + pad) * width) and the three
    storage operations `_set_valid`, `_cut` and `_gather_columns`."""

    cols: list[list[int]]  # host: sequence b's columns
    width: int  # cache rows per sequence (W while a beam search runs)
    pad: int  # padding sequences after the real ones

    def _init_layout(self, seqs: int, pad: int = 0) -> None:
        self.cols = [[] for _ in range(seqs)]
        self.width = 1
        self.pad = pad
        # whether `cols` names each sequence's columns exactly (False after a tree keep, which
        # records an upper bound; compaction makes them exact again)
        self._exact = True
        # after a verify that rolled back on the device (`verify`, `verify_tree`): per sequence,
        # its columns before the verify; the device holds those plus the block's length
        self._held: list[int] | None = None

    # -- storage (subclasses) ------------------------------------------------------------------
    def _valid(self) -> torch.Tensor:
        """``[R, T]`` bool, T = the columns in use (`len(self)`): the runner's own, written in
        place by a tree keep."""
        raise NotImplementedError

    def _set_valid(self, valid: torch.Tensor) -> None:
        """Replace the validity of the columns in use (same shape)."""
        raise NotImplementedError

    def _cut(self, end: int) -> None:
        """Drop the columns from ``end`` on (no row holds them)."""
        raise NotImplementedError

    def _gather_columns(self, order: torch.Tensor) -> None:
        """Row r's KV and validity become its columns ``order[r]`` (``[R, T']``); T = T'."""
        raise NotImplementedError

    # -- host mirror ---------------------------------------------------------------------------
    @property
    def row_lengths(self) -> list[int]:
        return [len(c) for c in self.cols]

    def _per_row(self, values: list[int]) -> torch.Tensor:
        """Per-sequence values (padding sequences: 0) repeated for each of its rows, on the
        device: ``[R]``."""
        dev = self._valid().device
        return to_device(values + [0] * self.pad, dev).repeat_interleave(self.width)

    def _append_cols(self, t: int, k: int, counts: list[int] | None) -> None:
        for seq, c in enumerate(counts or [k] * len(self.cols)):
            self.cols[seq].extend(range(t + k - c, t + k))

    def crop_rows(self, lengths: list[int], kept: list[int] | None = None) -> None:
        """Keep the first lengths[b] tokens of row b; cut the columns no row holds; compact when
        too many dead columns have piled up (`_should_compact`). ``kept``: the iteration's
        block lengths read back; after a verify that rolled back on the device, where every row
        keeps its whole block, the device holds those tokens already."""
        held, self._held = self._held, None
        on_device = held is not None and kept is not None and all(
            h + k == n for h, k, n in zip(held, kept, lengths, strict=True))
        if any(len(c) > n for c, n in zip(self.cols, lengths, strict=True)):
            dropped = [c[n:] for c, n in zip(self.cols, lengths, strict=True)]
            self.cols = [c[:n] for c, n in zip(self.cols, lengths, strict=True)]
            end = max((c[-1] + 1 for c in self.cols if c), default=0)
            if on_device:  # rolled back in the verify's graph call: the host mirror only
                pass
            elif not self._exact:  # which columns a sequence holds is known on the device only
                valid = self._valid()
                self._set_valid(valid & (valid.long().cumsum(1)
                                         <= self._per_row(lengths)[:, None]))
            else:  # the dropped columns before the new end (one sequence has none: a cut does)
                holes = [(b, col) for b, cols in enumerate(dropped) for col in cols if col < end]
                if holes:
                    self._invalidate(holes)
            if end < len(self):
                self._cut(end)
        if self._should_compact():
            self.compact()

    def _invalidate(self, holes: list[tuple[int, int]]) -> None:
        """Mark the columns ``(sequence, column)`` invalid in each of the sequence's rows, in one
        indexed write (of the validity's flat view: one copy of the indices, one fill)."""
        w = self.width
        flat, stride = self._flat_valid()
        at = [(b * w + j) * stride + col for b, col in holes for j in range(w)]
        flat.index_fill_(0, to_device(at, flat.device), False)

    def _flat_valid(self) -> tuple[torch.Tensor, int]:
        """The validity as one flat view of its storage, and the stride of its rows."""
        valid = self._valid()
        if not valid.is_contiguous():  # a cut's slice: own its storage from now on
            valid = valid.contiguous()
            self._set_valid(valid)
        return valid.view(-1), valid.shape[1]

    def _should_compact(self) -> bool:
        return False

    def compact(self) -> None:
        """Pack every row's valid columns, in order, into the last max(row length) columns
        (see the module docstring); afterwards sequence b holds columns T - n_b .. T - 1."""
        keep = max(self.row_lengths, default=0)
        self._gather_columns(compaction_order(self._valid(), keep))
        self.cols = [list(range(keep - len(c), keep)) for c in self.cols]
        self._exact = True

    def crop(self, length: int) -> None:
        self.crop_rows([length] * len(self.cols))

    def keep_tree(self, n_tree: int, nodes: torch.Tensor) -> None:
        """Of the last ``n_tree`` columns (one tree per sequence), keep ``nodes [B, m]`` of each
        sequence (root first) valid and invalidate the rest: no KV moves."""
        assert self.width == 1, "a token tree while beams are expanded"
        nodes = nodes.reshape(len(self.cols), -1)  # one sequence may give [m]
        valid = self._valid()
        tree = valid[:, len(self) - n_tree:]  # [R, n_tree]: a view, written in place
        tree.fill_(False)  # padding rows: none
        tree[:nodes.shape[0]].scatter_(1, nodes, True)
        self._kept_tree(n_tree, nodes.shape[1])

    def _kept_tree(self, n_tree: int, m: int) -> None:
        """The host mirror after keeping m of the last ``n_tree`` columns (one tree per
        sequence): which ones only the device knows, so each sequence records the tree's last
        column m times (an upper bound, so cutting stays safe)."""
        t = len(self)
        self.cols = [c[:len(c) - n_tree] + [t - 1] * m for c in self.cols]
        self._exact = False

    def _tree_prefix(self, m: int) -> list[int]:
        """Per sequence: its columns before the tree's M earlier nodes."""
        return [len(c) - m for c in self.cols]


class RowsRunner(RowLayout, ModelRunner):
    """`ModelRunner` for B rows of different lengths in a growing ``DynamicCache`` (see the
    module docstring); compacts once `DEAD_COLUMNS` columns past the longest row are dead."""

    def __init__(self, model, timer: PhaseTimer, phase: str, rows: int,
                 hidden: tuple[int, ...] = ()):
        super().__init__(model, timer, phase, hidden)
        self.valid: torch.Tensor | None = None  # [B * width, T]
        self._init_layout(rows)

    def _valid(self) -> torch.Tensor:
        return self.valid

    def _set_valid(self, valid: torch.Tensor) -> None:
        self.valid = valid

    def _cut(self, end: int) -> None:
        kv.crop(self.cache, end)
        self.valid = self.valid[:, :end]

    def _gather_columns(self, order: torch.Tensor) -> None:
        kv.gather_columns(self.cache, order)
        self.valid = self.valid.gather(1, order)

    def _should_compact(self) -> bool:
        return len(self) > max(self.row_lengths, default=0) + DEAD_COLUMNS

    def __call__(self, input_ids: torch.Tensor, counts: list[int] | None = None,
                 features: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """input_ids ``[B, k]``; row b's last counts[b] tokens are real (all k if None)."""
        b, k = input_ids.shape
        dev = input_ids.device
        t = len(self)
        if counts is None:
            new = torch.ones(b, k, dtype=torch.bool, device=dev)
        else:
            assert self.width == 1, "ragged input while beams are expanded"
            new = torch.arange(k, device=dev)[None, :] >= k - to_device(counts, dev)[:, None]
        valid = new if self.valid is None else torch.cat([self.valid, new], 1)  # [B, T + k]
        seen = valid.long().cumsum(1)  # [B, T + k]
        pos = (seen[:, t:] - 1).clamp_min(0)  # [B, k]: a real token's position in its row
        causal = torch.ones(k, k, dtype=torch.bool, device=dev).tril()
        allowed = valid[:, None, :].expand(b, k, t + k).clone()  # [B, k, T + k]
        allowed[:, :, t:] &= causal
        allowed[:, :, t:] |= torch.eye(k, dtype=torch.bool, device=dev)  # padding sees itself
        dtype = getattr(self.model, "dtype", torch.float32)
        logits = ModelRunner.__call__(self, input_ids, attention_mask=additive_mask(allowed, dtype),
                                      position_ids=pos, features=features)
        self.valid = valid
        self._append_cols(t, k, counts)
        return logits

    def forward_tree(self, input_ids: torch.Tensor, anc_rows: torch.Tensor,
                     depths: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """`ModelRunner.forward_tree` for B sequences (input_ids ``[B, K]``): the prefix is each
        row's valid columns before the tree."""
        assert self.width == 1, "a token tree while beams are expanded"
        b, k = input_ids.shape
        dev = input_ids.device
        t = len(self)
        m = anc_rows.shape[-1] - k
        t0 = t - m  # the tree's first column
        prefix = to_device(self._tree_prefix(m), dev)  # [B]
        head = (self.valid[:, None, :t0] if self.valid is not None
                else torch.zeros(b, 1, 0, dtype=torch.bool, device=dev))
        tree = anc_rows.expand(b, k, m + k)  # one shape for all ([K, M+K]) or one per row
        allowed = torch.cat([head.expand(b, k, t0), tree], 2)
        dtype = getattr(self.model, "dtype", torch.float32)
        logits = ModelRunner.__call__(self, input_ids, attention_mask=additive_mask(allowed, dtype),
                                      position_ids=prefix[:, None] - 1 + depths.expand(b, k),
                                      features=features)
        new = torch.ones(b, k, dtype=torch.bool, device=dev)
        self.valid = new if self.valid is None else torch.cat([self.valid, new], 1)
        self._append_cols(t, k, None)
        return logits

    def repeat_rows(self, n: int) -> None:
        """Expand every sequence's one row to n identical rows (row b*n + w)."""
        assert self.width == 1, "rows are expanded already"
        kv.repeat_rows(self.cache, n)
        self.valid = self.valid.repeat_interleave(n, 0)
        self.width = n

    def select_rows(self, rows: torch.Tensor) -> None:
        """Gather rows ``[B * W']``; row i must come from sequence i // W' (a beam reorder within
        each sequence, W' = W, or keeping one beam per sequence, W' = 1)."""
        width = rows.shape[0] // len(self.cols)
        assert width * len(self.cols) == rows.shape[0], "rows must keep B sequences"
        kv.select_rows(self.cache, rows)
        self.valid = self.valid.index_select(0, rows.to(self.valid.device))
        self.width = width


def row_dependence(model) -> str | None:
    """Why a row of ``model``'s batched forward would not compute what it computes alone (None:
    it would). Dynamic int8 quantisation (the CPU self-draft ``self:int8``) takes one activation
    scale over the whole input tensor, so a row's logits would depend on the other rows and on
    masked padding."""
    from torch.ao.nn.quantized import dynamic

    if any(isinstance(m, dynamic.Linear) for m in model.modules()):
        return (f"{type(model).__name__} has dynamically quantized int8 layers (one activation "
                "scale per input tensor)")
    return None


class PerRowRunner(ModelRunner):
    """B sequences, each in its own batch-1 `ModelRunner` (one forward per sequence): for a
    model whose batched rows are not row-independent (`row_dependence`), so every row is exactly
    what it is at batch 1, at B times the forwards. Same interface as `RowsRunner`: inputs
    ``[B * W, k]`` with row b's last counts[b] tokens real, logits left-padded to k."""

    def __init__(self, model, timer: PhaseTimer, phase: str, rows: int,
                 hidden: tuple[int, ...] = ()):
        super().__init__(model, timer, phase, hidden)
        self.rows = [ModelRunner(model, timer, phase, hidden) for _ in range(rows)]
        self.width = 1

    def _gather_hidden(self, k: int) -> None:
        """The rows' hidden states, left-padded to k as the logits are."""
        if self.hidden_layers:
            self.hidden = torch.cat([torch.nn.functional.pad(r.hidden, (0, 0, k - r.hidden.shape[1], 0))
                                     for r in self.rows])

    def __call__(self, input_ids: torch.Tensor, counts: list[int] | None = None,
                 features: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        self.forwards += 1
        k = input_ids.shape[1]
        counts = counts or [k] * len(self.rows)
        w = self.width
        outs = [r(input_ids[b * w:(b + 1) * w, k - c:], None,
                  None if features is None else features[b * w:(b + 1) * w, k - c:])
                for b, (r, c) in enumerate(zip(self.rows, counts, strict=True))]
        self.forward_shapes += [r.forward_shapes[-1] for r in self.rows]
        self._gather_hidden(k)
        return torch.cat([torch.nn.functional.pad(o, (0, 0, k - o.shape[1], 0)) for o in outs])

    def forward_tree(self, input_ids: torch.Tensor, anc_rows: torch.Tensor,
                     depths: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        self.forwards += 1
        per = anc_rows.dim() == 3
        out = torch.cat([r.forward_tree(input_ids[b:b + 1], anc_rows[b] if per else anc_rows,
                                        depths[b] if per else depths,
                                        None if features is None else features[b:b + 1])
                         for b, r in enumerate(self.rows)])
        self._gather_hidden(input_ids.shape[1])
        self.forward_shapes += [r.forward_shapes[-1] for r in self.rows]
        return out

    def keep_tree(self, n_tree: int, nodes: torch.Tensor) -> None:
        nodes = nodes.reshape(len(self.rows), -1)
        for r, nd in zip(self.rows, nodes, strict=True):
            r.keep_tree(n_tree, nd)

    def __len__(self) -> int:
        return max(self.row_lengths)

    @property
    def row_lengths(self) -> list[int]:
        return [len(r) for r in self.rows]

    def crop_rows(self, lengths: list[int], kept: list[int] | None = None) -> None:
        for r, n in zip(self.rows, lengths, strict=True):
            r.crop(n)

    def crop(self, length: int) -> None:
        self.crop_rows([length] * len(self.rows))

    def select_rows(self, rows: torch.Tensor) -> None:
        width = rows.shape[0] // len(self.rows)
        for b, r in enumerate(self.rows):  # row i of sequence b comes from rows b*W .. b*W+W-1
            r.select_rows(rows[b * width:(b + 1) * width] - b * self.width)
        self.width = width

    def repeat_rows(self, n: int) -> None:
        for r in self.rows:
            r.repeat_rows(n)
        self.width = n


def rows_runner(model, timer: PhaseTimer, phase: str, rows: int,
                hidden: tuple[int, ...] = ()) -> ModelRunner:
    """The eager runner of ``rows`` sequences: one shared cache (`RowsRunner`), or one forward
    per sequence (`PerRowRunner`) for a model whose rows would depend on each other; ``hidden``:
    the hidden states to keep from every forward (`ModelRunner`)."""
    if rows == 1:
        return ModelRunner(model, timer, phase, hidden)
    if row_dependence(model) is None:
        return RowsRunner(model, timer, phase, rows, hidden)
    return PerRowRunner(model, timer, phase, rows, hidden)
