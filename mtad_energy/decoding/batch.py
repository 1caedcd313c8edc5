"""B sequences of different lengths in one KV cache: the runner of batched generation.

Layout: one cache ``[B, H_kv, T, D]`` whose columns are shared by the rows, and a bool ``valid
[B, T]`` saying which columns hold row b's tokens. Every forward appends k columns to every row;
a row with fewer real tokens (a shorter prompt, a draft that needs to catch up on fewer tokens)
is left-padded and its padding columns are invalid. Rolling a row back (rejected drafts)
invalidates its last columns in place: no KV is copied or moved per iteration, at the price of
holes where some rows rejected what others accepted. Columns that no row holds any more are cut
off the end. Each row gets its own position ids (its count of valid columns) and an attention
mask over its valid columns (4-D, passed as-is to transformers), so a row computes exactly what
it would alone.

The host mirrors, per sequence, the columns it holds (`cols`): every count the loop needs (row
lengths, the columns to cut) is known without reading the device. After a token tree keeps a
path chosen on the device, the host knows how many columns a sequence kept but not which: it
records the tree's last column for them (an upper bound, so cutting stays safe).

Token trees (one per sequence, the same shape for all) are appended as K columns valid in
every row; each node sees its row's prefix columns and its ancestors (`forward_tree`); keeping
a path marks the path's columns valid and the other tree columns invalid (`keep_tree`).

Beam decoders expand each sequence to W rows (row b*W + w, `repeat_rows`) and reorder rows
within a sequence (`select_rows`); the beams of a sequence share its columns, so the host
mirror stays per sequence.
"""

from __future__ import annotations

import torch

from mtad_energy.decoding import cache as kv
from mtad_energy.decoding.base import ModelRunner, PhaseTimer, additive_mask, to_device


class RowsRunner(ModelRunner):
    """`ModelRunner` for B rows of different lengths (see the module docstring)."""

    def __init__(self, model, timer: PhaseTimer, phase: str, rows: int):
        super().__init__(model, timer, phase)
        self.valid: torch.Tensor | None = None  # [B * width, T]
        self.cols: list[list[int]] = [[] for _ in range(rows)]  # host: sequence b's columns
        self.width = 1  # cache rows per sequence (W while a beam search runs)

    @property
    def row_lengths(self) -> list[int]:
        return [len(c) for c in self.cols]

    def __call__(self, input_ids: torch.Tensor, counts: list[int] | None = None,
                 **kwargs) -> torch.Tensor:
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
        logits = super().__call__(input_ids, attention_mask=additive_mask(allowed, dtype),
                                  position_ids=pos)
        self.valid = valid
        for seq, c in enumerate(counts or [k] * len(self.cols)):
            self.cols[seq].extend(range(t + k - c, t + k))
        return logits

    def forward_tree(self, input_ids: torch.Tensor, anc_rows: torch.Tensor,
                     depths: torch.Tensor) -> torch.Tensor:
        """`ModelRunner.forward_tree` for B sequences (input_ids ``[B, K]``): the prefix is each
        row's valid columns before the tree."""
        assert self.width == 1, "a token tree while beams are expanded"
        b, k = input_ids.shape
        dev = input_ids.device
        t = len(self)
        m = anc_rows.shape[-1] - k
        t0 = t - m  # the tree's first column
        prefix = to_device([len(c) - m for c in self.cols], dev)  # [B]
        head = (self.valid[:, None, :t0] if self.valid is not None
                else torch.zeros(b, 1, 0, dtype=torch.bool, device=dev))
        tree = anc_rows.expand(b, k, m + k)  # one shape for all ([K, M+K]) or one per row
        allowed = torch.cat([head.expand(b, k, t0), tree], 2)
        dtype = getattr(self.model, "dtype", torch.float32)
        logits = ModelRunner.__call__(self, input_ids, attention_mask=additive_mask(allowed, dtype),
                                      position_ids=prefix[:, None] - 1 + depths.expand(b, k))
        new = torch.ones(b, k, dtype=torch.bool, device=dev)
        self.valid = new if self.valid is None else torch.cat([self.valid, new], 1)
        for c in self.cols:
            c.extend(range(t, t + k))
        return logits

    def keep_tree(self, n_tree: int, nodes: torch.Tensor) -> None:
        """Of the last ``n_tree`` columns (one tree per sequence), keep ``nodes [B, m]`` of each
        sequence (root first) valid and invalidate the rest: no KV moves."""
        t = len(self)
        keep = torch.zeros(nodes.shape[0], n_tree, dtype=torch.bool, device=self.valid.device)
        keep.scatter_(1, nodes.to(keep.device), True)
        self.valid[:, t - n_tree:] = keep
        m = nodes.shape[1]
        self.cols = [c[:len(c) - n_tree] + [t - 1] * m for c in self.cols]  # columns: bound

    def crop_rows(self, lengths: list[int]) -> None:
        """Keep the first lengths[b] tokens of row b; cut the columns no row holds."""
        if all(len(c) <= n for c, n in zip(self.cols, lengths, strict=True)):
            return
        self.cols = [c[:n] for c, n in zip(self.cols, lengths, strict=True)]
        keep = to_device(lengths, self.valid.device).repeat_interleave(self.width)
        self.valid &= self.valid.long().cumsum(1) <= keep[:, None]
        end = max((c[-1] + 1 for c in self.cols if c), default=0)
        if end < self.valid.shape[1]:
            kv.crop(self.cache, end)
            self.valid = self.valid[:, :end]

    def crop(self, length: int) -> None:
        self.crop_rows([length] * len(self.cols))

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
