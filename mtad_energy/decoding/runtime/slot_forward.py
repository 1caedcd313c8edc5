"""What one compiled call of the static-cache path runs: a forward on a `SlotCache`
(`slot_forward`), and the fused calls that keep a decoder's step on the device between forwards.

On a GPU the host decides a compiled loop's speed (docs/design.md section 7): every graph call costs a
launch, its input copies and the host's own bookkeeping. So the compiled path fuses what a step
runs back to back into one graph:

* `forward_then` (`forward_tree_then` for a token tree): a forward and the pure tensor function
  that reads its logits (a verify's warp and acceptance rule, ``ar``'s sampling): one call
  instead of two;
* `forward_chain`: a draft's autoregressive loop, S forwards each followed by the function that
  draws the next token from its logits (`decoder.draft_next`), the token fed to the next forward
  inside the graph: one call instead of 2 S;
* `forward_verify` (`forward_tree_verify`): `forward_then` for a chain (tree) verify, the
  rollback of its columns to the tokens (nodes, moved to the tree's first columns) its rule
  keeps inside the same graph;
* `forward_tree_levels`: a draft token tree grown level by level (SpecInfer's), each level's
  draws and its tree forward inside the graph: one call instead of 2 L;
* `forward_grow`: a draft head's catch-up and the token tree it grows from it (EAGLE's), each
  tree forward and the function reading it inside the graph: one call instead of D + 2;
* `forward_beams`: a beam search of D steps (`rules.beam`), the rows expanded to the beams and
  reordered to them inside the graph, and the function reading the finished tree: one call
  instead of 3 D + 1 and the row copies between them.
* `select_slot_rows`, `repeat_slot_rows`: a runner's rows reordered or expanded (MTAD keeping
  its chosen beam, a step-by-step beam search) over every slot: one call returning nothing,
  instead of an op per buffer and index.

The functions are the decoders' own (`calls`), the same on the eager path, and so are the
programs: `forward_chain`, `forward_tree_levels`, `forward_beams` and `forward_grow` run the
`programs` the eager runner runs, over `SlotSteps` instead of `runner.RunnerSteps`; only where
they run changes. The fused calls leave the cache exactly as the separate calls would (the same KV and
validity at the same slots), but a tree verify's, which moves the kept path to the tree's first
columns (the same tokens at the same positions, in fewer columns). A fused call met for the
first time runs as the separate calls (its forwards compiled, the functions eager) and compiles
after the generation (`StaticRunner.compile_pending`), never inside a window. A phase's time on
the compiled path holds the functions fused into its forwards (a verify's rule is timed as
target time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mtad_energy.decoding.runtime import programs
from mtad_energy.decoding.runtime.compiled import signature
from mtad_energy.decoding.runtime.masks import additive_mask
from mtad_energy.decoding.runtime.runner import model_kwargs, pick_hidden
from mtad_energy.decoding.runtime.slot_cache import SlotCache
from mtad_energy.hf_cache import cache_kwargs


def slot_forward(model, cache: SlotCache, input_ids: torch.Tensor, new: torch.Tensor,
             anc: torch.Tensor | None = None, depths: torch.Tensor | None = None, *,
             features: torch.Tensor | None = None, hidden: tuple[int, ...] = ()
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [r, k]`` -> float32 logits ``[r, k, V]``, written at slots start.. of the
    cache's first r rows; ``new [r, k]`` (bool) says which tokens are real (a row's left
    padding, padded widths and padding rows are not: they see only themselves and stay invalid).
    With ``hidden`` (hidden-state indices, `ModelRunner`): ``(logits, hidden states [r, k,
    len(hidden) * H])``, one more graph output; ``features [r, k, F]``: a draft head's input.

    A chain (``anc`` None): row r's token i sits at position (r's valid columns before start) +
    (its real tokens up to i) - 1 and sees r's valid columns up to slot start + i. A token tree:
    ``anc [1 or r, k, M + k]`` (node i sees tree node j; the M earlier nodes are the M columns
    before start) and ``depths [1 or r, k]``: node i sees r's valid columns before the tree and
    its ancestors, at position (r's prefix length) + depth - 1.
    """
    r, k = input_ids.shape
    dev = input_ids.device
    start = cache.start
    cols = torch.arange(cache.slots, device=dev)  # [L]
    slots = start + torch.arange(k, device=dev)  # [k]
    valid = cache.valid[:r]  # [r, L]
    count = (valid & (cols < start)).sum(1)  # [r]: valid columns before the new ones
    valid.index_copy_(1, slots, new)
    if anc is None:
        pos = (count[:, None] + new.long().cumsum(1) - 1).clamp_min(0)  # [r, k]
        allowed = (valid[:, None, :] & (cols <= slots[:, None])) | (cols == slots[:, None])
    else:
        m = anc.shape[-1] - k
        tree_cols = start - m + torch.arange(m + k, device=dev)  # [M + k]
        tree = torch.zeros(r, k, cache.slots, dtype=torch.bool, device=dev).index_copy(
            2, tree_cols, anc.expand(r, k, m + k))
        allowed = (valid & (cols < start - m))[:, None, :] | tree  # [r, k, L]
        pos = ((count - m - 1)[:, None] + depths).clamp_min(0)
    mask = additive_mask(allowed, cache.layers[0].keys.dtype)  # [r, 1, k, L]
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos,
                **cache_kwargs(cache), use_cache=True, **model_kwargs(hidden, features))
    if hidden:
        return out.logits.float(), pick_hidden(out, hidden)
    return out.logits.float()


def forward_then(model, cache: SlotCache, input_ids: torch.Tensor, new: torch.Tensor,
                 fn: Callable[..., Any], rows: int, k: int, *args: Any,
                 forward: Callable[..., torch.Tensor] = slot_forward) -> Any:
    """`slot_forward` of ``input_ids [R, W]`` (rows and width padded), then ``fn(logits[:rows,
    :k], *args)``: what ``fn`` returns (a verify's block, a sampled token). ``forward``: the
    forward to run (compiled on its own while the fused call is not, `StaticGraphs.uncompiled`)."""
    return fn(forward(model, cache, input_ids, new)[:rows, :k], *args)


def forward_verify(model, cache: SlotCache, input_ids: torch.Tensor, new: torch.Tensor,
                   fn: Callable[..., Any], rows: int, k: int, *args: Any,
                   forward: Callable[..., torch.Tensor] = slot_forward) -> Any:
    """`forward_then` of a chain verify whose rule returns ``(block, accepted, length [rows],
    *handed)``, then the rollback on the device: row r keeps the first length[r] of the columns
    written, the others invalid, where the loop's crop would leave them. Returns ``handed``
    (`ModelRunner.verify`): the graph's only outputs."""
    start = cache.start.clone()  # [] the verify's first slot
    out = forward_then(model, cache, input_ids, new, fn, rows, k, *args, forward=forward)
    cols = torch.arange(input_ids.shape[1], device=input_ids.device)
    _keep_columns(cache, start, input_ids.shape[0], cols[None, :] < out[2][:, None])
    return out[3:]


def forward_tree_then(model, cache: SlotCache, input_ids: torch.Tensor, new: torch.Tensor,
                      anc: torch.Tensor, depths: torch.Tensor, fn: Callable[..., Any], rows: int,
                      k: int, *args: Any, features: torch.Tensor | None = None,
                      hidden: tuple[int, ...] = (),
                      forward: Callable[..., torch.Tensor] = slot_forward) -> Any:
    """`forward_then` for a token tree (``anc``, ``depths``, ``features``, ``hidden``:
    `slot_forward`'s): a tree verify's forward and its rule, or a head's tree forward and its
    expansion, in one call; with ``hidden``, ``fn(logits, hidden states, *args)``."""
    out = forward(model, cache, input_ids, new, anc, depths, features=features, hidden=hidden)
    outs = out if hidden else (out,)
    return fn(*(o[:rows, :k] for o in outs), *args)


def forward_tree_verify(model, cache: SlotCache, input_ids: torch.Tensor, new: torch.Tensor,
                        anc: torch.Tensor, depths: torch.Tensor, fn: Callable[..., Any],
                        rows: int, k: int, *args: Any, features: torch.Tensor | None = None,
                        hidden: tuple[int, ...] = (),
                        forward: Callable[..., torch.Tensor] = slot_forward) -> Any:
    """`forward_tree_then` of a tree verify whose rule returns ``(block, accepted, length [rows],
    path [rows, m], ...)`` (`tree.tree_verify`), then the rollback on the device: row r's first
    length[r] nodes of path[r] (root first) move to the tree's first columns, in path order, and
    only those stay valid (every padding row's none), as a chain verify leaves its block
    (`forward_verify`): the host mirror stays exact and the dropped columns are cut, not
    compacted. A path's nodes are in tree order (a node after its parent), so a node at depth d
    was written at position prefix + d - 1: where it now sits. Returns ``handed``, the rule's
    outputs after the path (`ModelRunner.verify_tree`)."""
    start = cache.start.clone()  # [] the tree's first slot
    out = forward_tree_then(model, cache, input_ids, new, anc, depths, fn, rows, k, *args,
                            features=features, hidden=hidden, forward=forward)
    r, width = input_ids.shape
    _move_path(cache, start, r, out[3], width)
    cols = torch.arange(width, device=input_ids.device)
    _keep_columns(cache, start, r, cols[None, :] < out[2][:, None])
    return out[4:]


def _move_path(cache: SlotCache, start: torch.Tensor, r: int, path: torch.Tensor,
               width: int) -> None:
    """Of the ``width`` columns from ``start`` in the cache's first ``r`` rows, row b's column
    j becomes its column path[b, j] (``path [rows, m]``, m <= width), every layer's keys and
    values at once; the columns after m and the padding rows stay where they are."""
    rows, m = path.shape
    cols = torch.arange(width, device=path.device)
    src = torch.cat([path, cols[m:].expand(rows, width - m)], 1)  # [rows, W]
    src = torch.cat([src, cols.expand(r - rows, width)])  # [r, W]: padding rows stay
    kv = cache.kv[:, :r]  # [2 * layers, r, H, L, D]
    idx = (start + src)[None, :, None, :, None].expand(kv.shape[0], r, kv.shape[2], width,
                                                       kv.shape[4])
    kv.index_copy_(3, start + cols, kv.gather(3, idx))


def _keep_columns(cache: SlotCache, start: torch.Tensor, r: int, keep: torch.Tensor) -> None:
    """The validity of the W columns a verify wrote from ``start`` in the cache's first ``r``
    rows: ``keep [rows, W]`` for the real rows, none for the padding rows after them."""
    cols = start + torch.arange(keep.shape[1], device=keep.device)
    cache.valid[:r].index_copy_(1, cols, F.pad(keep, (0, 0, 0, r - keep.shape[0])))


def forward_chain(model, cache: SlotCache, input_ids: torch.Tensor, new: torch.Tensor,
                  real: torch.Tensor, fn: Callable[..., Any], rows: int, k: int,
                  u: torch.Tensor, *args: Any,
                  forward: Callable[..., torch.Tensor] = slot_forward) -> tuple[torch.Tensor, ...]:
    """`programs.chain` of S = ``u.shape[0]`` forwards on the cache (`SlotSteps`), the first of
    ``input_ids [R, W]`` (``new [R, W]``; the first k tokens are the input, the rest padding),
    each next of the token ``fn`` drew (``real [R, 1]``: which rows are real): ``fn(logits
    [rows, k, V], u[i] [rows, 1], *args) -> (token [rows, 1], *extras)``, as
    `ModelRunner.chain`. ``forward``: as in `forward_then`."""
    steps = SlotSteps(model, cache, input_ids, new, real, rows, k, forward)
    return programs.chain(steps, fn, u, *args)


def forward_tree_levels(model, cache: SlotCache, input_ids: torch.Tensor, new: torch.Tensor,
                        real: torch.Tensor, fn: Callable[..., Any], rows: int, k: int,
                        branching: tuple[int, ...], anc: torch.Tensor, u: torch.Tensor,
                        *args: Any, forward: Callable[..., torch.Tensor] = slot_forward
                        ) -> tuple[torch.Tensor, ...]:
    """`programs.tree_levels` on the cache (`SlotSteps`), as `ModelRunner.tree_levels`: the
    first forward of ``input_ids [R, W]`` (``new [R, W]``; the first k tokens the input), each
    level's tree forward of the children ``[R, K]`` after the M nodes fed before them (``real
    [R, 1]``: which rows are real; ``anc [N, N]``: the tree's ancestors). ``forward``: as in
    `forward_then`."""
    steps = SlotSteps(model, cache, input_ids, new, real, rows, k, forward)
    return programs.tree_levels(steps, branching, anc, fn, u, *args)


def forward_grow(model, cache: SlotCache, input_ids: torch.Tensor, new: torch.Tensor,
                 real: torch.Tensor, fn: Callable[..., Any], rows: int, k: int, *args: Any,
                 features: torch.Tensor | None = None, hidden: tuple[int, ...] = (),
                 forward: Callable[..., torch.Tensor] = slot_forward) -> Any:
    """`programs.grow_tree` on the cache (`SlotSteps`), as `ModelRunner.grow_tree`: the first
    forward of ``input_ids [R, W]`` (``new [R, W]``; the first k tokens the input;
    ``features``: a head's), then the decoder's program ``fn(tree_then, call, logits [rows, k,
    V], hidden [rows, k, H], *args)``, whose tree forwards run here (`SlotSteps.tree_then`; a
    padding row takes the first row's tree) and ``call(f, *f_args)`` its pure functions.
    ``forward``: as in `forward_then`."""
    steps = SlotSteps(model, cache, input_ids, new, real, rows, k, forward,
                      features=features, hidden=hidden)
    return programs.grow_tree(steps, fn, *args)


def rows_of(t: torch.Tensor, rows: int, r: int, dims: int) -> torch.Tensor:
    """``t`` as ``r`` dense rows: one for all (``dims - 1`` dimensions) expanded to the ``rows``
    real rows, then the first row's repeated for the ``r - rows`` padding rows (which hold no
    valid column: whatever they are fed stays theirs)."""
    t = t.expand(rows, *t.shape) if t.dim() < dims else t
    if r == rows:
        return t.contiguous()
    return torch.cat([t, t[:1].expand(r - rows, *t.shape[1:])])


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: a program's pure functions inside a fused call (`EagerCalls` outside one)."""
    return fn(*args)


def forward_beams(model, cache: SlotCache, input_ids: torch.Tensor, new: torch.Tensor,
                  real: torch.Tensor, rows: int, k: int, width: int, depth: int,
                  u: torch.Tensor | None, temperature: float, top_k: int, top_p: float,
                  stochastic: bool, eos_token_id: int | None, finish: Callable[..., tuple] | None,
                  *finish_args: Any, forward: Callable[..., torch.Tensor] = slot_forward
                  ) -> tuple[torch.Tensor, ...]:
    """`programs.beam_search` of ``depth`` >= 2 steps and W = ``width`` beams on the cache
    (`SlotSteps`), as `ModelRunner.beam_search`: the first forward of ``input_ids [R, C]`` (R
    cache rows at one per sequence, the first ``rows`` real; ``new [R, C]``; the first k tokens
    the input), the cache's R rows expanded to R*W (every slot: no host count of the columns in
    use enters the graph), then D-1 forwards of the beams' last tokens (``real [R*W, 1]``:
    which rows are real), each followed by the step's draw and the beams' columns reordered.
    ``u [rows, V + (D-1) W V]`` (None: beam search, no draws): the uniforms of the first draw,
    then of each step's, for the whole vocabulary; each draw takes the first of its share.
    ``forward``: as in `forward_then`."""
    vocab = 0 if u is None else u.shape[1] // (1 + (depth - 1) * width)

    def draws(scores: torch.Tensor, at: int, n: int) -> torch.Tensor | None:
        return _share(u, at, vocab, n)

    steps = SlotSteps(model, cache, input_ids, new, real, rows, k, forward)
    return programs.beam_search(steps, depth, width, (temperature, top_k, top_p, stochastic),
                                draws, eos_token_id, finish, *finish_args)


def select_slot_rows(model, cache: SlotCache, rows: torch.Tensor,
                     *pad: torch.Tensor) -> None:
    """Rows ``rows [r']`` (then the padding sequences' ``pad``) of every layer's keys and values
    and of the validity become the cache's first r rows, over every slot (no host count of the
    columns in use enters the graph; a column past them is written before any forward reads
    it): `StaticRunner.select_rows` in one graph call, which returns nothing (nothing cloned).
    ``model``: unused (the first argument of every `StaticGraphs` call)."""
    rows = torch.cat([rows, *pad]) if pad else rows
    r = rows.shape[0]
    cache.kv[:, :r] = cache.kv.index_select(1, rows)  # [2 * layers, r, H, L, D]
    cache.valid[:r] = cache.valid.index_select(0, rows)


def repeat_slot_rows(model, cache: SlotCache, seqs: int, n: int) -> None:
    """Each of the first ``seqs`` rows becomes ``n`` identical rows (row b*n + w), every layer's
    keys and values and the validity over every slot: `StaticRunner.repeat_rows` in one graph
    call (as `forward_beams` expands its rows), which returns nothing."""
    cache.kv[:, :seqs * n] = cache.kv[:, :seqs].repeat_interleave(n, 1)
    cache.valid[:seqs * n] = cache.valid[:seqs].repeat_interleave(n, 0)


def _share(u: torch.Tensor | None, at: int, vocab: int, n: int = 1) -> torch.Tensor | None:
    """A draw's uniforms: ``n`` vocabularies' worth of ``u``'s columns from vocabulary ``at``."""
    return None if u is None else u[:, at * vocab:(at + n) * vocab]


class SlotSteps:
    """`programs.Steps` inside a fused call: each forward a ``forward`` (`slot_forward`) on
    ``cache``, the first of ``input_ids [R, W]`` (``new [R, W]``; the first k tokens the input,
    the first ``rows`` rows real; a head's ``features``, the ``hidden`` states it returns), each
    later one written after the columns the ones before wrote (``real [R', 1]``: which of the
    R' rows are real, R' = R times the beams); the pure functions called as they are; the rows
    moved over every slot. Padding rows take the first row's tokens and trees and hold no valid
    column."""

    def __init__(self, model, cache: SlotCache, input_ids: torch.Tensor, new: torch.Tensor,
                 real: torch.Tensor, rows: int, k: int, forward: Callable[..., Any],
                 features: torch.Tensor | None = None, hidden: tuple[int, ...] = ()):
        self.model, self.cache, self.forward = model, cache, forward
        self.input_ids, self.new, self.real = input_ids, new, real
        self.rows, self.k = rows, k
        self.features, self.hidden = features, hidden
        self.start = cache.start.clone()  # [] the first forward's slot (the runner sets it)
        self.call = _call

    def first(self) -> torch.Tensor:
        logits = self.forward(self.model, self.cache, self.input_ids, self.new)
        return logits[:self.rows, :self.k]

    def first_hidden(self) -> tuple[torch.Tensor, torch.Tensor]:
        logits, states = self.forward(self.model, self.cache, self.input_ids, self.new,
                                      features=self.features, hidden=self.hidden)
        return logits[:self.rows, :self.k], states[:self.rows, :self.k]

    def next(self, tokens: torch.Tensor, i: int) -> torch.Tensor:
        r = tokens.shape[0]  # after the input's k columns (its padding stays invalid)
        self.cache.start.copy_(self.start + self.k + i - 1)
        ids = F.pad(tokens, (0, 0, 0, self.real.shape[0] - r))  # [R', 1]
        return self.forward(self.model, self.cache, ids, self.real)[:r]

    def level(self, children: torch.Tensor, anc: torch.Tensor, fed: int) -> torch.Tensor:
        r, n = self.input_ids.shape[0], children.shape[1]
        tree = anc.contiguous()  # [K, M + K] (dense: a graph's input)
        self.cache.start.copy_(self.start + self.k + fed)
        return self.forward(self.model, self.cache, F.pad(children, (0, 0, 0, r - self.rows)),
                            self.real.expand(r, n).contiguous(), tree[None],
                            tree.sum(-1)[None])[:self.rows]

    def tree_then(self, tokens: torch.Tensor, anc: torch.Tensor, depths: torch.Tensor,
                  feats: torch.Tensor, f: Callable[..., Any], *f_args: Any) -> Any:
        r, rows, n = self.input_ids.shape[0], self.rows, tokens.shape[1]
        self.cache.start.copy_(self.start + self.k + anc.shape[-1] - n)  # after the M fed
        out = self.forward(self.model, self.cache, rows_of(tokens, rows, r, 2),
                           self.real.expand(r, n).contiguous(), rows_of(anc, rows, r, 3),
                           rows_of(depths, rows, r, 2), features=rows_of(feats, rows, r, 3),
                           hidden=self.hidden)
        return f(out[0][:rows], out[1][:rows], *f_args)

    def repeat_rows(self, n: int) -> None:
        repeat_slot_rows(self.model, self.cache, self.input_ids.shape[0], n)

    def select_rows(self, rows: torch.Tensor, i: int) -> None:
        """Only the columns this search wrote differ between a sequence's beams, so a reorder
        moves those (their validity is the same in every beam); padding rows stay."""
        kv = self.cache.kv  # [2 * layers, R', H, L, D]
        fixed = torch.arange(rows.shape[0], self.real.shape[0], device=kv.device)
        cols = self.start + self.k + torch.arange(i, device=kv.device)  # [i]: the steps'
        part = kv.index_select(3, cols).index_select(1, torch.cat([rows, fixed]))
        kv.narrow(1, 0, self.real.shape[0]).index_copy_(3, cols, part)


class Later(NamedTuple):
    """A forward a fused call runs after its first: ``columns`` tokens, after ``m`` earlier
    tree nodes (None: a chain), with a head's ``features`` of that width (None: none; a head's
    tree has one per sequence)."""

    columns: int
    m: int | None = None
    features: int | None = None


@dataclass(frozen=True, eq=False)
class Fused:
    """What a runner fuses into a forward's graph: ``call`` (`forward_then`, `forward_chain`,
    `forward_beams`, `forward_tree_levels`, `forward_grow`) with its arguments after the first
    forward's ids and validity (``args``), running forwards after the first one: ``later``
    (`Later`: a chain's next token ``Later(1)``; a tree level of K nodes after M ``Later(K,
    M)``), at ``width`` rows per sequence."""

    call: Callable[..., Any]
    args: tuple
    later: tuple[Later, ...] = ()
    width: int = 1

    @property
    def columns(self) -> int:
        """Columns the later forwards write."""
        return sum(f.columns for f in self.later)

    def key(self) -> tuple:
        """What decides the fused graph besides the first forward's shape."""
        return (self.call.__name__, signature(self.args))
