"""Decoder contract, per-generation state and the model runner.

A decoder turns the state of one sequence into the next block of tokens; the generate loop in
``generate.py`` owns everything else (prefill, EOS, max_new_tokens, cache rollback, stats).

Cache invariant between iterations (gpt-fast style): the target cache holds every token except the
last one, which is fed at the start of the next iteration together with the draft tokens, so the
bonus token never needs a forward of its own. The draft cache holds a prefix of the sequence.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from mtad_energy.decoding import cache as kv
from mtad_energy.decoding.kernels import Kernels
from mtad_energy.decoding.sampling import Warp, sample_u, uniforms, warp_probs
from mtad_energy.energy.work import Forward
from mtad_energy.hf_cache import cache_kwargs


def param(default: Any, help: str, when: tuple[str, str] | None = None) -> Any:
    """A decoder parameter with its one-line help (shown by ``mtad-energy decoders``); ``when``
    (another parameter, its value): the mode it belongs to (EAGLE's ``branching`` is read only
    with ``tree=static``): set to other than its default in another mode, it is refused rather
    than silently ignored."""
    return field(default=default, metadata={"help": help, **({"when": when} if when else {})})


@dataclass(frozen=True)
class DecoderParams:
    """Parameters every decoder has: the warp applied to p (and q)."""

    temperature: float = param(1.0, "softmax temperature; 0 = greedy")
    top_k: int = param(10, "keep the k most likely tokens (0 = all)")
    top_p: float = param(0.9, "nucleus: drop a token once the mass before it exceeds top_p")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # NaN passes every comparison the range checks make
            value = getattr(self, f.name)
            require(not (isinstance(value, float) and math.isnan(value)),
                    f"{f.name} must be a number, got nan")
        require(math.isfinite(self.temperature),
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        self.warp  # noqa: B018 - validates the warp fields
        self.validate()
        self._refuse_ignored()

    def _refuse_ignored(self) -> None:
        """A parameter of a mode that is not selected (`param`'s ``when``), set to other than its
        default, would be ignored: refuse it, naming the mode that reads it."""
        for f in dataclasses.fields(self):
            when = f.metadata.get("when")
            if when is None or getattr(self, when[0]) == when[1] or getattr(self, f.name) == f.default:
                continue
            raise ValueError(f"{f.name} is read only with {when[0]}={when[1]}; with {when[0]}="
                             f"{getattr(self, when[0])} it would be ignored: add --set {when[0]}="
                             f"{when[1]}, or drop {f.name}")

    def validate(self) -> None:
        """Subclasses raise ValueError naming the parameter and its valid range."""

    @property
    def warp(self) -> Warp:
        return Warp(self.temperature, self.top_k, self.top_p)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class StepResult:
    """What one decoder iteration produced.

    A decoder whose block length depends on sampled values (how many draft tokens were accepted)
    does not read that length back itself: it returns a padded ``tokens`` buffer with a 0-d
    device tensor ``length`` (and may give ``accepted`` as a 0-d device tensor too), and the
    generate loop reads both back together with the tokens, in its one host sync per iteration.
    """

    # [m] tokens to append, m >= 1 (or a padded buffer, see `length`); [B, m] for B rows
    tokens: torch.Tensor
    # draft tokens shown to the target per row (tree nodes, k*gamma: Spectr); a list: per row
    proposed: int | list[int] = 0
    accepted: int | torch.Tensor = 0  # of those, accepted (an int, or a 0-d / [B] device tensor)
    length: torch.Tensor | None = None  # 0-d / [B] device tensor: only tokens[..., :length] count
    # 0-d device tensor: the draft cache is valid only up to this many positions (the loop crops
    # it there, after the read-back), for drafts whose kept row diverges from the emitted path
    draft_cache_len: torch.Tensor | None = None
    # draft tokens on one path that could have been accepted (the drafted depth); list: per row;
    # a [B] device tensor where only the device knows it (read back with the tokens)
    depth: int | list[int] | torch.Tensor = 0

    @classmethod
    def block(cls, draft: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor,
              proposed: int | list[int], draft_cache_len: torch.Tensor | None = None,
              depth: int | list[int] | torch.Tensor | None = None) -> StepResult:
        """``draft[:n]`` followed by ``nxt``, with ``n`` left on the device: the buffer is
        ``draft`` with ``nxt`` written at index n, of which n + 1 count. One sequence: draft
        ``[gamma]``, n and nxt 0-d; B rows: draft ``[B, gamma]``, n and nxt ``[B]``. ``depth``
        (default: the draft's length) may be per row (`Decoder.draft_lens`)."""
        buf, length = block_tokens(draft, n, nxt)
        return cls(buf, proposed, n, length, draft_cache_len,
                   depth=draft.shape[-1] if depth is None else depth)


def block_tokens(draft: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`StepResult.block`'s buffer as a pure function (a kernel's last step): ``draft[..., :n]``
    then ``nxt`` in a buffer of gamma + 1, and its length n + 1."""
    n1, nxt1 = n[..., None], nxt[..., None]
    return torch.cat([draft, nxt1], -1).scatter(-1, n1, nxt1), n + 1


class PhaseTimer:
    """Time per phase ("draft", "target") of the forwards a generation runs.

    ``with timer(phase):`` times a block; ``time_s`` maps phase -> seconds so far; ``sync()`` waits
    for the device (the generate loop calls it only at the prefill / decode boundaries, where energy
    windows need it). Nested phases never double count: the inner block's time goes to the inner
    phase only, the outer phase gets the rest.

    ``PhaseTimer(device)`` (or ``PhaseTimer.for_device(device)``) picks the implementation:
    `CpuPhaseTimer` (``perf_counter``, no synchronisation) or, on CUDA, `CudaPhaseTimer`, which
    records CUDA events around each block instead of synchronising (DESIGN.md section 7) and reads
    them in `flush` - call that right after a host read-back, when the events are complete.
    """

    def __new__(cls, device: torch.device | str | None = None):
        if cls is PhaseTimer:
            cls = CudaPhaseTimer if torch.device(device or "cpu").type == "cuda" else CpuPhaseTimer
        return super().__new__(cls)

    @classmethod
    def for_device(cls, device: torch.device | str) -> PhaseTimer:
        return PhaseTimer(device)

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device or "cpu")
        self._time_s: dict[str, float] = {"draft": 0.0, "target": 0.0}
        self._stack: list[str] = []

    @property
    def time_s(self) -> dict[str, float]:
        """Seconds per phase so far (on CUDA this reads the pending events, waiting if needed)."""
        self.flush()
        return self._time_s

    def sync(self) -> None:
        """Wait for the device to finish the queued work (a no-op on CPU)."""

    def flush(self) -> None:
        """Fold pending measurements into ``time_s`` (a no-op on CPU)."""

    def _open(self, phase: str) -> None:
        raise NotImplementedError

    def _close(self, phase: str) -> None:
        raise NotImplementedError

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self._stack:
            self._close(self._stack[-1])
        self._stack.append(phase)
        self._open(phase)
        try:
            yield
        finally:
            self._close(phase)
            self._stack.pop()
            if self._stack:
                self._open(self._stack[-1])


class CpuPhaseTimer(PhaseTimer):
    """Host wall time (``perf_counter``) per phase; touches no device API."""

    def __init__(self, device: torch.device | str | None = None):
        super().__init__(device)
        self._t0 = 0.0

    def _open(self, phase: str) -> None:
        self._t0 = time.perf_counter()

    def _close(self, phase: str) -> None:
        self._time_s[phase] = self._time_s.get(phase, 0.0) + time.perf_counter() - self._t0


class CudaPhaseTimer(PhaseTimer):
    """GPU time per phase from a pair of CUDA events recorded on the current stream around each
    block: no host synchronisation while timing. Events wait in a list until `flush`, which reads
    them (``Event.elapsed_time``) and returns them to a pool for reuse. `flush` right after a
    read-back of the same stream costs no stall; otherwise it waits for the last pending event."""

    def __init__(self, device: torch.device | str | None = None):
        super().__init__(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._pool: list[torch.cuda.Event] = []
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | None = None

    def _event(self) -> torch.cuda.Event:
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _open(self, phase: str) -> None:
        self._start = self._event()

    def _close(self, phase: str) -> None:
        assert self._start is not None
        self._pending.append((phase, self._start, self._event()))
        self._start = None

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)
        self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        for _, _, end in self._pending:
            if not end.query():  # not yet complete: only when flushed before a read-back
                end.synchronize()
        for phase, start, end in self._pending:
            self._time_s[phase] = self._time_s.get(phase, 0.0) + start.elapsed_time(end) / 1e3
            self._pool += (start, end)
        self._pending.clear()


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed [k, T]`` or ``[B, k, T]`` (bool) -> the 4-D additive mask ``[1 or B, 1, k, T]``
    transformers takes as-is: 0 where allowed, the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None] if allowed.dim() == 2 else mask[:, None]


def tree_inputs(anc_rows: torch.Tensor, depths: torch.Tensor, cached: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tree forward (`ModelRunner.forward_tree`) over a cache of ``cached``
    positions, the last M of them earlier tree nodes: ``(allowed [K, cached + K], position_ids
    [1, K])``. ``anc_rows [(1,) K, M + K]``, ``depths [(1,) K]``."""
    if anc_rows.dim() == 3:  # one tree per sequence: here one sequence
        anc_rows, depths = anc_rows[0], depths[0]
    k = anc_rows.shape[0]
    prefix = cached - (anc_rows.shape[1] - k)
    allowed = torch.cat([anc_rows.new_ones(k, prefix), anc_rows], 1)
    return allowed, (prefix - 1 + depths)[None]


def model_kwargs(hidden: tuple[int, ...], features: torch.Tensor | None) -> dict[str, Any]:
    """What a forward passes to the model besides ids, mask, positions and cache: whether to
    return the hidden states (`pick_hidden` keeps the requested ones; a boolean, since
    transformers before 5.2x takes no list of layer indices) and a head's input features."""
    out: dict[str, Any] = {}
    if hidden:
        out["output_hidden_states"] = True
    if features is not None:
        out["features"] = features
    return out


def pick_hidden(out, hidden: tuple[int, ...]) -> torch.Tensor | None:
    """The requested hidden states of a forward's output, concatenated on the last axis
    (``[B, k, len(hidden) * H]``), or None when none were requested."""
    if not hidden:
        return None
    return torch.cat([out.hidden_states[i] for i in hidden], -1)


class ModelRunner:
    """One model with its KV cache; counts and times forwards.

    ``hidden``: indices into transformers' ``hidden_states`` (0 the embeddings, i the input of
    layer i, -1 the last layer's output after the final norm) to keep from every forward: after
    each forward `hidden` holds them, concatenated, ``[B, k, len(hidden) * H]`` (None when none
    are requested). A draft head's forwards take ``features [B, k, F]`` (the target's hidden
    states, or its own), passed to the model as ``features=``."""

    compiled = False  # forwards through torch.compile (`static.StaticRunner`)
    compile_s = 0.0  # seconds spent compiling, outside the timed forwards (`static.StaticRunner`)
    prewarm_s = 0.0  # of them, before the prefill (made with the runner): kept out of compile_s

    def __init__(self, model, timer: PhaseTimer, phase: str, hidden: tuple[int, ...] = ()):
        self.model = model
        self.cache = kv.new_cache(model)
        self.forwards = 0
        # (rows, new tokens, KV columns attended) of every forward, padding included: the loop
        # turns them into FLOPs and bytes (`mtad_energy.energy.work`) after the decode phase
        self.forward_shapes: list[Forward] = []
        self._timer = timer
        self._phase = phase
        self.hidden_layers = tuple(hidden)
        self.hidden: torch.Tensor | None = None  # the last forward's requested hidden states

    def __call__(self, input_ids: torch.Tensor, counts: list[int] | None = None,
                 features: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """input_ids ``[B, k]`` -> float32 logits ``[B, k, V]``; appends k positions to the cache.
        ``counts`` (rows of different lengths, `batch.RowsRunner`): row b's input is left-padded
        and only its last counts[b] tokens are real; here every row is whole."""
        self.forwards += 1
        rows, k = input_ids.shape
        # the cache's length before this forward (O(1); len(self) walks every layer)
        self.forward_shapes.append(Forward(rows, k, self.cache.get_seq_length() + k,
                                           0 if features is None else features.shape[-1]))
        with self._timer(self._phase):
            out = self.model(input_ids=input_ids, **cache_kwargs(self.cache), use_cache=True,
                             **kwargs, **model_kwargs(self.hidden_layers, features))
            self.hidden = pick_hidden(out, self.hidden_layers)
        return out.logits.float()

    def prefill(self, input_ids: torch.Tensor, counts: list[int] | None = None,
                features: torch.Tensor | None = None) -> torch.Tensor:
        """The prompt's forward (a `StaticRunner` runs it uncompiled: its length varies)."""
        return self(input_ids, counts, features)

    def forward_tree(self, input_ids: torch.Tensor, anc_rows: torch.Tensor,
                     depths: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """K token-tree nodes in one forward (`tree.tree_forward`): ``input_ids [B, K]``,
        ``anc_rows [K, M + K]`` (bool: node i sees tree node j; the M earlier nodes are the last
        M cached positions), ``depths [K]`` (1 for a node on the prefix) -> logits ``[B, K, V]``.
        Each node sees the whole prefix, its ancestors and itself, at position prefix + depth - 1.
        """
        allowed, pos = tree_inputs(anc_rows, depths, len(self))
        dtype = getattr(self.model, "dtype", torch.float32)  # first floating parameter's dtype
        return self(input_ids, attention_mask=additive_mask(allowed, dtype), position_ids=pos,
                    features=features)

    def keep_tree(self, n_tree: int, nodes: torch.Tensor) -> None:
        """Of the last ``n_tree`` cached positions (a token tree), keep ``nodes [m]`` (tree node
        indices, root first; ``[B, m]`` per sequence in `batch.RowsRunner`), drop the rest:
        afterwards the cache equals a sequential run of that path (no recompute)."""
        prefix = len(self) - n_tree
        self.keep_positions(prefix, prefix + nodes.reshape(-1))

    def __len__(self) -> int:
        return kv.cache_len(self.cache)

    def crop(self, length: int) -> None:
        kv.crop(self.cache, length)

    @property
    def row_lengths(self) -> list[int]:
        """Tokens cached per row (all rows alike here: one sequence or beams of one)."""
        return [len(self)]

    def crop_rows(self, lengths: list[int]) -> None:
        """Keep the first lengths[b] tokens of row b (rows of one sequence: one length)."""
        self.crop(lengths[0])

    def select_rows(self, rows: torch.Tensor) -> None:
        kv.select_rows(self.cache, rows)

    def repeat_rows(self, n: int) -> None:
        kv.repeat_rows(self.cache, n)

    def keep_positions(self, prefix_len: int, positions: torch.Tensor) -> None:
        """Keep the first ``prefix_len`` positions followed by ``positions [m]`` (a token tree's
        kept path), dropping the rest."""
        keep = torch.cat([torch.arange(prefix_len, device=positions.device), positions])
        kv.keep_positions(self.cache, keep)


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small host list as a long tensor on ``device`` without a host sync (pinned memory and a
    non-blocking copy on CUDA)."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class DecodeState:
    """B sequences decoded together (B = 1: one sequence, what most decoders handle).
    ``ids[b, :lengths[b]]`` are row b's tokens so far (prompt included). Rows that are done
    (EOS or max_new_tokens) are no longer `active`: they still ride along in the forwards, their
    output ignored."""

    ids: torch.Tensor  # [B, `ids_width`] on the model device
    lengths: list[int]
    prompt_lens: list[int]
    max_new_tokens: int
    target: ModelRunner
    draft: ModelRunner | None
    generator: torch.Generator
    eos_token_id: int | None = None
    active: list[bool] = field(default_factory=list)
    # host mirror of ``ids``: row b's tokens so far (the loop keeps it from its one read-back),
    # for decoders that draft on the host (n-gram lookup) without reading the device
    tokens: list[list[int]] = field(default_factory=list)
    # what a decoder keeps from one iteration to the next of this generation (a head's input
    # features); decoders are reused across generations, so it lives here, not on them
    carry: dict[str, Any] = field(default_factory=dict)
    # where the step's pure tensor functions run: eagerly, or compiled (`kernels`)
    kernels: Kernels = field(default_factory=Kernels)

    def __post_init__(self) -> None:
        self.active = self.active or [True] * len(self.lengths)
        self._lengths_dev: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def n(self) -> int:
        """Tokens so far of the one sequence (a decoder that handles B rows uses `lengths`)."""
        if self.batch != 1:
            raise ValueError("DecodeState.n is for one sequence; this state holds "
                             f"{self.batch} rows (use lengths)")
        return self.lengths[0]

    def uniform(self, *shape: int) -> torch.Tensor:
        """Uniforms in [0, 1) of ``shape`` on the model device, from the generation's generator:
        a kernel's draws (`kernels`)."""
        return uniforms(shape, self.generator, self.ids.device)

    def row_remaining(self, b: int) -> int:
        return self.prompt_lens[b] + self.max_new_tokens - self.lengths[b]

    @property
    def remaining(self) -> int:
        """Tokens still wanted by the row that wants the most (0 when every row is done)."""
        return max((self.row_remaining(b) for b in range(self.batch) if self.active[b]),
                   default=0)

    def row_depths(self, depth: int) -> torch.Tensor:
        """``[B]`` long on the device: ``depth`` capped by what each row still wants (a row that
        is done: 1), the depth a row's own search of at most ``depth`` tokens would run to."""
        return to_device([max(1, min(depth, self.row_remaining(b))) if self.active[b] else 1
                          for b in range(self.batch)], self.ids.device)

    def lengths_on_device(self) -> torch.Tensor:
        """``[B]`` long: `lengths` on the model device (copied once per change of lengths)."""
        if self._lengths_dev is None:
            self._lengths_dev = to_device(self.lengths, self.ids.device)
        return self._lengths_dev

    @property
    def last_token(self) -> torch.Tensor:
        """``[B, 1]``: each row's one token the target cache has not seen."""
        if self.batch == 1:
            return self.ids[:, self.n - 1:self.n]
        return self.ids.gather(1, self.lengths_on_device()[:, None] - 1)

    def draft_pending(self) -> torch.Tensor:
        """``[1, k]``, k >= 1: the tokens the draft cache has not seen (one sequence)."""
        return self.ids[:, self.draft.row_lengths[0]:self.n]

    def draft_feed(self) -> tuple[torch.Tensor, list[int] | None]:
        """What the draft has not seen, for B rows: ``(ids [B, k], counts)`` with row b's
        counts[b] tokens right-aligned (left padding before them; `batch.RowsRunner` masks it);
        one sequence: ``(draft_pending(), None)``."""
        if self.batch == 1:
            return self.draft_pending(), None
        counts = [n - c for n, c in zip(self.lengths, self.draft.row_lengths, strict=True)]
        k = max(counts)
        idx = self.lengths_on_device()[:, None] - k + torch.arange(k, device=self.ids.device)
        return self.ids.gather(1, idx.clamp_min(0)), counts

    def append_rows(self, block: torch.Tensor, host: list[list[int]]) -> None:
        """Append to each row b the first len(host[b]) tokens of ``block [B, M]`` (on the device;
        ``host[b]``: those tokens read back, [] for a row that takes none). One copy for all
        rows: the whole block lands after each row's tokens (``ids`` has M - 1 columns to spare,
        `ids_width`), and only the first len(host[b]) count."""
        m = block.shape[1]
        if self.batch == 1:
            self.ids[:, self.lengths[0]:self.lengths[0] + m].copy_(block)
        else:
            at = self.lengths_on_device()[:, None] + torch.arange(m, device=block.device)
            self.ids.scatter_(1, at, block)
        for b, tokens in enumerate(host):
            self.lengths[b] += len(tokens)
            if self.tokens:
                self.tokens[b].extend(tokens)
        self._lengths_dev = None


def ids_width(prompt_lens: list[int], max_new_tokens: int, lookahead: int) -> int:
    """Columns of `DecodeState.ids`: the longest row, and room for a whole block of lookahead +
    1 tokens after any row's last (`DecodeState.append_rows` writes blocks whole)."""
    return max(prompt_lens) + max_new_tokens + lookahead + 1


def cap_per_row(n: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """``n [B]`` capped at each row's own draft length (a no-op when no row's is shorter)."""
    if len(set(lens)) == 1:  # all draft max(lens): n cannot exceed it
        return n
    return torch.minimum(n, to_device(lens, n.device))


def next_token(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_k: int,
               top_p: float) -> torch.Tensor:
    """``[B, 1]``: one token per row from warped p at the last position of ``logits [B, k, V]``
    (uniforms ``u [B, 1]``): a kernel."""
    return sample_u(warp_probs(logits[:, -1], temperature, top_k, top_p), u)[:, None]


def target_step(s: DecodeState, warp: Warp) -> StepResult:
    """One token per row sampled from warped p after the sequence: ``ar``'s step, and what a
    drafting decoder does when only one token is left (drafting would be wasted)."""
    logits = s.target(s.last_token)  # [B, 1, V]
    return StepResult(s.kernels(next_token, logits, s.uniform(s.batch, 1), *warp.args))


class Decoder:
    """Base class of every decoder: a name, a frozen params dataclass, and ``step``."""

    name: ClassVar[str]
    help: ClassVar[str]
    Params: ClassVar[type[DecoderParams]] = DecoderParams
    needs_draft: ClassVar[bool] = False
    # drafts without the pair's draft model (prompt lookup, heads): a loaded draft is ignored
    drafts_without_model: ClassVar[bool] = False
    # the kind of draft head it runs on the target's hidden states ("eagle", "medusa"): the
    # pair's ``heads[head]``, run as its draft model (its forwards count as draft forwards)
    head: ClassVar[str | None] = None
    # whether `step` handles a DecodeState of B > 1 rows (batched generation)
    batched: ClassVar[bool] = False

    def __init__(self, params: DecoderParams | None = None):
        self.params = params if params is not None else self.Params()

    @property
    def lookahead(self) -> int:
        """Positions beyond the emitted ones the target may see in one iteration."""
        return 0

    @property
    def verify_width(self) -> int:
        """Tokens of the widest forward an iteration runs (a chain's verify; trees override)."""
        return self.lookahead + 1

    def lookahead_for(self, max_new_tokens: int) -> int:
        """The lookahead a generation of ``max_new_tokens`` can use: `draft_len` caps every
        iteration's draft one short of the tokens still wanted (``gamma=1000000`` with 8 new
        tokens drafts at most 7)."""
        return min(self.lookahead, max(0, max_new_tokens - 1))

    def cache_rows(self, role: str) -> int:
        """Cache rows one sequence expands to at most in ``role``'s model ("target" / "draft"):
        the beam width of a beam search over that model, Spectr's k drafts; 1 otherwise."""
        return 1

    def draft_len(self, s: DecodeState) -> int:
        """Draft positions worth proposing this iteration: the lookahead, capped one short of the
        tokens still wanted (the bonus token from p fills the last) by the row that wants the
        most. 0: take a `target_step`."""
        return max(0, min(self.lookahead, s.remaining - 1))

    def draft_lens(self, s: DecodeState) -> list[int]:
        """`draft_len` per row, as each row would draft alone: capped by what the row itself
        still wants; 0 for a row that is done. A batch drafts ``max(draft_lens)``; a lossy
        rule must not accept past a row's own length, and statistics count it per row."""
        return [max(0, min(self.lookahead, s.row_remaining(b) - 1)) if s.active[b] else 0
                for b in range(s.batch)]

    def draft_model(self, pair) -> Any:
        """What the draft runner runs: the pair's draft model (``needs_draft``), its head of kind
        ``head``, or None (no draft runner)."""
        if self.head is not None:
            return pair.heads.get(self.head)
        return pair.draft if self.needs_draft else None

    def target_hidden(self, pair) -> tuple[int, ...]:
        """Hidden states every target forward must return (`ModelRunner` indices)."""
        return ()

    def draft_hidden(self) -> tuple[int, ...]:
        """Hidden states every draft forward must return (a head's output feature)."""
        return ()

    def prefill(self, s: DecodeState) -> None:
        """Called once after the loop's prefill of the target (and a draft model), inside the
        prefill phase: a head decoder primes its head from the target's hidden states."""

    def step(self, s: DecodeState) -> StepResult:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {"decoder": self.name, **dataclasses.asdict(self.params)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"
