"""The compiled runner's fused calls: the `ModelRunner` steps a `static.StaticRunner` runs as
one graph call each (`slot_forward`'s fused functions), at the widths and depths the decoder
declared up front (`static.ForwardShape`); anything else (a generation's shorter last iterations)
runs as the separate calls `ModelRunner` makes, each forward compiled on its own.

`FusedCalls` is the part of `StaticRunner` that chooses, per step, the fused function and the
forwards it runs after its first (`slot_forward.Later`): the runner's `_run` compiles and times
the call, and the host mirror learns its columns here (`_append_later`). What it needs of the
runner it is part of is declared on the class (`FusedCalls`' annotations: its contract), and a
step it does not fuse runs `ModelRunner`'s, named: the same program (`programs`) over the
runner's separate calls, not a parent class's method found through the class's method order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from mtad_energy.decoding.rules.sampling import uniforms
from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.slot_forward import (
    Fused,
    Later,
    forward_beams,
    forward_chain,
    forward_grow,
    forward_then,
    forward_tree_levels,
    forward_tree_then,
    forward_tree_verify,
    forward_verify,
)
from mtad_energy.models.shapes import output_size

if TYPE_CHECKING:
    from mtad_energy.decoding.runtime.static_graphs import StaticGraphs


class WarmForward(NamedTuple):
    """A forward to compile before the windows open (`Decoder.warm_forwards`): ``columns``
    tokens after ``m`` earlier tree nodes (None: a chain, run at `StaticRunner._width`), with a
    head's ``features`` of that width (None: none); ``per_seq``: a tree of its own per sequence
    (at B > 1 rows: one per row, as `slot_forward.rows_of` pads it); ``rows_per_seq``: a chain
    at that many cache rows per sequence (a beam search's steps over W beams)."""

    columns: int
    m: int | None = None
    features: int | None = None
    per_seq: bool = False
    rows_per_seq: int = 1


@dataclass(frozen=True)
class ForwardShape:
    """What a decoder tells the compiled runner of one of its models up front."""

    key: str = ""  # the decoder (name and parameters): tree widths are remembered per key
    rows_per_seq: int = 1  # cache rows a sequence expands to at most (beams)
    max_chain: int = 1  # widest chain forward (a verify of gamma + 1 tokens)
    # chain widths whose use depends on sampled values (a catch-up of 2 after a full accept, a
    # verify of 2 or a target step of 1 in the last iterations): compiled when the runner is
    # made, before the generation's windows open, so no warm-up has to be lucky to meet them
    warm_widths: tuple[int, ...] = ()
    hidden: tuple[int, ...] = ()  # hidden states every forward returns (`ModelRunner`)
    # forwards whose shapes the decoder knows up front but meets only inside the loop
    # (`Decoder.warm_forwards`: a head's catch-up and tree levels with its features, a tree
    # verify), compiled with `warm_widths`
    warm_forwards: tuple[WarmForward, ...] = ()


class FusedCalls:
    """`ModelRunner`'s multi-step calls fused into one graph call each (see the module
    docstring), the first part of `static.StaticRunner`.

    Its contract: the names annotated below, which the runner's other parts define and
    FusedCalls only reads or calls (annotations without values: nothing here shadows them).
    A call it does not fuse runs `ModelRunner`'s method of that name on ``self``, explicitly;
    ``self`` is a `ModelRunner` whose forwards are the runner's compiled ones."""

    # the static runner's (`static.StaticRunner`)
    model: Any
    device: torch.device
    graphs: StaticGraphs  # its `tree_widths`: the tree widths run so far
    shape: ForwardShape  # what the decoder declared up front (`max_chain`, `key`)
    hidden_layers: tuple[int, ...]
    n: int  # columns in use (host side)
    _rows: int  # cache rows in use: the bucket's sequences times `width`
    _run: Callable[..., Any]  # one forward or fused call: compiled, timed, counted
    _new: Callable[[int, list[int] | None], torch.Tensor | None]  # a ragged input's real tokens
    _real_rows: Callable[..., torch.Tensor]  # ``[R * width, 1]``: which cache rows are real
    # the layout's (`batch.RowLayout`)
    width: int  # cache rows per sequence
    row_lengths: list[int]  # per sequence: the columns it holds
    _held: list[int] | None  # after a verify rolled back on the device: columns before it
    _append_cols: Callable[[int, int, list[int] | None], None]  # the host mirror's new columns

    def then(self, calls, input_ids: torch.Tensor, fn: Callable[..., Any], *args: Any,
             counts: list[int] | None = None) -> Any:
        """`ModelRunner.then` in one graph call (`forward_then`) for a one-token step or a
        verify at the decoder's full width (`ForwardShape.max_chain`); a shorter verify (a
        generation's last, or a shorter draft) runs as two calls, the forward and the kernel:
        a fused graph per draft length would compile a target forward per length."""
        if not self._fuses_chain(input_ids):
            return ModelRunner.then(self, calls, input_ids, fn, *args, counts=counts)
        return self._fused_chain(forward_then, input_ids, fn, args, counts)

    def verify(self, calls, input_ids: torch.Tensor, fn: Callable[..., Any], *args: Any) -> Any:
        """`ModelRunner.verify` in one graph call (`forward_verify`) where `then` fuses: the
        rule and the rollback to each row's block on the device, which the loop's `crop_rows`
        then finds done (its ``kept``: the blocks' lengths read back)."""
        if not self._fuses_chain(input_ids):
            return ModelRunner.verify(self, calls, input_ids, fn, *args)
        prefix = self.row_lengths  # per sequence: its columns before the verify
        out = self._fused_chain(forward_verify, input_ids, fn, args)
        self._held = prefix  # the device holds prefix + the block's length, no more
        return out

    def _fuses_chain(self, input_ids: torch.Tensor) -> bool:
        """Whether a forward and its kernel run as one call: a one-token step or a verify at
        the decoder's full width (heads' forwards are not fused yet)."""
        return not self.hidden_layers and input_ids.shape[1] in (1, self.shape.max_chain)

    def _fused_chain(self, call: Callable[..., Any], input_ids: torch.Tensor,
                     fn: Callable[..., Any], args: tuple, counts: list[int] | None = None) -> Any:
        k = input_ids.shape[1]
        out = self._run(input_ids, self._new(k, counts),
                        fused=Fused(call, (fn, input_ids.shape[0], k, *args)))
        self._append_cols(self.n - k, k, counts)
        return out

    def chain(self, calls, input_ids: torch.Tensor, counts: list[int] | None,
              fn: Callable[..., Any], u: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        """`ModelRunner.chain` in one graph call (`forward_chain`) for a chain of the
        decoder's full length (``max_chain - 1`` draws); a shorter one (a generation's last
        iterations) runs forward by forward, as `then` does a shorter verify."""
        if self.hidden_layers or self.width != 1 or u.shape[0] != self.shape.max_chain - 1:
            return ModelRunner.chain(self, calls, input_ids, counts, fn, u, *args)
        rows, k = input_ids.shape
        fused = Fused(forward_chain, (self._real_rows(rows), fn, rows, k, u, *args),
                      (Later(1),) * (u.shape[0] - 1))
        out = self._run(input_ids, self._new(k, counts), fused=fused)
        self._append_later(k, fused, counts)
        return out

    def tree_levels(self, calls, input_ids: torch.Tensor, counts: list[int] | None,
                    branching: tuple[int, ...], anc: torch.Tensor, fn: Callable[..., Any],
                    u: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        """`ModelRunner.tree_levels` in one graph call (`forward_tree_levels`) for a tree of
        the decoder's full depth (``max_chain - 1`` levels); a shallower one (a generation's
        last iterations) runs forward by forward, as `chain` does a shorter chain."""
        if self.hidden_layers or self.width != 1 or len(branching) != self.shape.max_chain - 1:
            return ModelRunner.tree_levels(self, calls, input_ids, counts, branching, anc, fn,
                                           u, *args)
        rows, k = input_ids.shape
        sizes = [math.prod(branching[:i + 1]) for i in range(len(branching) - 1)]  # fed levels
        later = tuple(Later(c, sum(sizes[:i])) for i, c in enumerate(sizes))
        fused = Fused(forward_tree_levels, (self._real_rows(rows), fn, rows, k, branching, anc,
                                            u, *args), later)
        out = self._run(input_ids, self._new(k, counts), fused=fused)
        self._append_later(k, fused, counts)
        return out

    def grow_tree(self, calls, input_ids: torch.Tensor, counts: list[int] | None,
                  features: torch.Tensor, nodes: tuple[int, ...], fn: Callable[..., Any],
                  *args: Any) -> Any:
        """`ModelRunner.grow_tree` in one graph call (`forward_grow`) for a tree of up to the
        decoder's full depth (``max_chain - 2`` tree forwards after the catch-up, whose widths
        are ``nodes``): a shallower one (a generation's last iterations) too, a graph of its own
        per depth (a head's tree forwards are small; their shapes are the full tree's first
        ones), so no expansion's outputs come back to the host between the forwards."""
        if not self.hidden_layers or self.width != 1 or len(nodes) > self.shape.max_chain - 2:
            return ModelRunner.grow_tree(self, calls, input_ids, counts, features, nodes, fn,
                                         *args)
        rows, k = input_ids.shape
        width = self.model.config.hidden_size * len(self.hidden_layers)  # what a node feeds on
        later = tuple(Later(c, sum(nodes[:i]), width) for i, c in enumerate(nodes))
        fused = Fused(forward_grow, (self._real_rows(rows), fn, rows, k, *args), later)
        out = self._run(input_ids, self._new(k, counts), features=features, fused=fused)
        self._append_later(k, fused, counts)
        return out

    def beam_search(self, calls, first_ids: torch.Tensor, counts: list[int] | None,
                    depth: int, width: int, warp_args: tuple, generator: torch.Generator | None,
                    eos_token_id: int | None = None, finish: Callable[..., tuple] | None = None,
                    *finish_args: Any) -> tuple[torch.Tensor, ...]:
        """`ModelRunner.beam_search` in one graph call (`forward_beams`) for a search of the
        decoder's full draft length (``max_chain - 1`` steps, at least 2); a shorter one (a
        generation's last iterations) runs step by step. The uniforms are drawn up front for the
        whole vocabulary (what a compiled step ranks)."""
        if self.hidden_layers or self.width != 1 or not 2 <= depth == self.shape.max_chain - 1:
            return ModelRunner.beam_search(self, calls, first_ids, counts, depth, width,
                                           warp_args, generator, eos_token_id, finish,
                                           *finish_args)
        (rows, k), vocab = first_ids.shape, output_size(self.model)
        u = uniforms((rows, vocab * (1 + (depth - 1) * width)), generator, self.device) \
            if warp_args[-1] else None
        fused = Fused(forward_beams, (self._real_rows(rows, width), rows, k, width, depth, u,
                                      *warp_args, eos_token_id, finish, *finish_args),
                      (Later(1),) * (depth - 1), width)
        out = self._run(first_ids, self._new(k, counts), fused=fused)
        self._append_later(k, fused, counts)
        self.width = width
        return out

    def _append_later(self, k: int, fused: Fused, counts: list[int] | None) -> None:
        """The host mirror after a fused call: the first forward's k columns, then the later
        forwards' (`Fused.later`)."""
        t = self.n - k - fused.columns
        self._append_cols(t, k, counts)
        t += k
        for f in fused.later:
            self._append_cols(t, f.columns, None)
            t += f.columns

    def tree_then(self, calls, input_ids: torch.Tensor, anc_rows: torch.Tensor,
                  depths: torch.Tensor, fn: Callable[..., Any], *args: Any,
                  features: torch.Tensor | None = None) -> Any:
        """`ModelRunner.tree_then` in one graph call (`forward_tree_then`) for K nodes after M
        earlier ones as wide as the widest this decoder ran at these rows after M; a smaller
        one (a generation's last iterations) runs as two calls, as `then` does a shorter
        verify."""
        if not self._fuses_tree(input_ids, anc_rows):
            return ModelRunner.tree_then(self, calls, input_ids, anc_rows, depths, fn, *args,
                                         features=features)
        return self._fused_tree(forward_tree_then, input_ids, anc_rows, depths, fn, args,
                                features)

    def verify_tree(self, calls, input_ids: torch.Tensor, anc_rows: torch.Tensor,
                    depths: torch.Tensor, fn: Callable[..., Any], *args: Any,
                    features: torch.Tensor | None = None) -> Any:
        """`ModelRunner.verify_tree` in one graph call (`forward_tree_verify`) where `tree_then`
        fuses: the rule and the rollback to the kept nodes on the device, moved to the tree's
        first columns as a chain verify leaves its block, which the loop's `crop_rows` then
        finds done (its ``kept``: the blocks' lengths read back) and cuts after."""
        if not self._fuses_tree(input_ids, anc_rows):
            return ModelRunner.verify_tree(self, calls, input_ids, anc_rows, depths, fn,
                                           *args, features=features)
        prefix = self.row_lengths  # per sequence: its columns before the tree
        out = self._fused_tree(forward_tree_verify, input_ids, anc_rows, depths, fn, args,
                               features)
        self._held = prefix  # the device holds prefix + the block's length, no more
        return out

    def _fuses_tree(self, input_ids: torch.Tensor, anc_rows: torch.Tensor) -> bool:
        """Whether a tree of K nodes after M runs fused: as wide as the widest this decoder ran
        at these rows after M (a smaller one, a generation's last iterations, runs as two
        calls, as `then` does a shorter verify)."""
        k = input_ids.shape[1]
        seen = self.graphs.tree_widths.get((self.shape.key, self._rows, anc_rows.shape[-1] - k),
                                           set())
        return self.width == 1 and k >= max(seen, default=k)

    def _fused_tree(self, call: Callable[..., Any], input_ids: torch.Tensor,
                    anc_rows: torch.Tensor, depths: torch.Tensor, fn: Callable[..., Any],
                    args: tuple, features: torch.Tensor | None) -> Any:
        k = input_ids.shape[1]
        anc = anc_rows if anc_rows.dim() == 3 else anc_rows[None]  # [1 or B, K, M + K]
        depths = depths if depths.dim() == 2 else depths[None]
        fused = Fused(call, (fn, input_ids.shape[0], k, *args))
        out = self._run(input_ids, None, anc, depths, features=features, fused=fused)
        self._append_cols(self.n - k, k, None)
        return out
