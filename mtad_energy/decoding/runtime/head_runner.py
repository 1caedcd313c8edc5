"""Running a draft head inside a decode step (the loading of its checkpoint is `models.heads`):
what the head decoders (`medusa`, `eagle`) share: the runner of a cache-free head, the
target's features carried from one iteration to the next, and the target's tree verify.

A head reads the target's hidden state at the last position the target cache holds (the cache
invariant of `runtime.runner`: every token but the last one). After the prefill that is the prompt's
second-to-last token (zero for a one-token prompt, which has none); after a verify it is the
deepest accepted node of the tree, whose hidden state the verify forward returned.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from mtad_energy.decoding.runtime.runner import ModelRunner
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.timer import PhaseTimer
from mtad_energy.energy.work import Forward

# head -> {(backend, mode): its compiled calls (`compiled.CompiledFunctions`: the head, or the
# head then a function) with the signatures run so far}: kept across generations, like the static
# graphs
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class HeadCall(NamedTuple):
    """A cache-free head's call to compile before the windows open (`Decoder.warm_forwards`):
    its forward on inputs of ``features`` width (one row per sequence), then ``fn(logits,
    *args)`` (None: the forward alone), as `HeadRunner.then` runs it."""

    features: int
    fn: Callable[..., Any] | None = None
    args: tuple = ()


def _head_then(head, fn: Callable[..., Any], features: torch.Tensor, *args: Any) -> Any:
    """``fn(head(features) as float32, *args)``: what `HeadRunner.then` compiles as one call."""
    return fn(head(features).float(), *args)


class HeadRunner(ModelRunner):
    """A cache-free draft head (Medusa's) run as the draft model: ``runner(features [B, F]) ->
    float32 logits`` counted and timed as ``phase``'s forwards. With ``compile`` it runs through
    ``torch.compile`` (one graph per input shape, CUDA graphs on CUDA); a shape's first calls run
    untimed and go to ``compile_s``, as in `static.StaticRunner`. Holds no cache: rollback and
    row lengths are no-ops. Records each call as a `Forward` of one token per row (the head
    attends over nothing) for the FLOP/byte rule."""

    def __init__(self, head, timer: PhaseTimer, phase: str, rows: int, compile: bool = False,
                 options=None, warm: tuple[HeadCall, ...] = ()):
        self.model = head
        self.forwards = 0
        self.forward_shapes: list[Forward] = []
        self._timer = timer
        self._phase = phase
        self._rows = rows
        self.hidden_layers = ()
        self.hidden = None
        self.compiled = bool(compile)
        self.compile_s = 0.0
        if self.compiled:
            from mtad_energy.decoding.runtime.compiled import (
                CompiledFunctions,
                CompileOptions,
                resolved_mode,
            )

            opts = options or CompileOptions()
            self._device = next(head.parameters()).device
            per_head = _COMPILED.setdefault(head, {})
            key = (opts.backend, resolved_mode(opts, self._device))
            self._calls = per_head.get(key)
            if self._calls is None:  # one graph per input signature: never dynamic
                self._calls = per_head[key] = CompiledFunctions.for_forwards(
                    opts, self._device, dynamic=False)
            self.prewarm_s = self._prewarm(warm)  # before any window opens: not in compile_s

    def __call__(self, features: torch.Tensor, counts: list[int] | None = None,
                 **kwargs) -> torch.Tensor:
        return self._run(None, features)

    def then(self, calls, features: torch.Tensor, fn: Callable[..., Any], *args: Any) -> Any:
        """`ModelRunner.then` for the head: its forward of ``features [B, F]``, then ``fn(logits
        [B, K, V], *args)`` through ``calls`` (Medusa's candidate tree); compiled, the two are
        one graph call."""
        if not self.compiled:
            return calls(fn, self(features), *args)
        return self._run(fn, features, *args)

    def _run(self, fn: Callable[..., Any] | None, features: torch.Tensor, *args: Any) -> Any:
        """The head's forward (``fn`` None: its float32 logits), or the head and ``fn`` in one
        compiled call (one graph per function and input signature, compiled untimed on first
        use)."""
        self.forwards += 1
        self.forward_shapes.append(Forward(features.shape[0], 1, 1, features.shape[-1]))
        if not self.compiled:
            with self._timer(self._phase):
                return self.model(features).float()
        features = features.contiguous()
        self.compile_s += self._compile(fn, features, args)  # a new signature, untimed
        with self._timer(self._phase):  # (a CUDA graph's outputs cloned: `graph_outputs`)
            out = self._calls.compiled(fn, self._target(fn))(features, *args)
            return out if fn is not None else out.float()

    def _compile(self, fn: Callable[..., Any] | None, features: torch.Tensor,
                 args: tuple) -> float:
        """Compile (and on CUDA record) the call of ``fn`` on ``features``' and ``args``'
        signature if it is new: its untimed first calls; returns their seconds (0: known)."""
        from mtad_energy.decoding.runtime.compiled import signature

        shape = (fn, tuple(features.shape), features.dtype, signature(args))
        if shape in self._calls.warmed:
            return 0.0
        seconds = self._calls.warm(fn, (features, *args), target=self._target(fn))
        self._calls.warmed.add(shape)
        return seconds

    def _prewarm(self, calls: tuple[HeadCall, ...]) -> float:
        """Compile ``calls`` (`Decoder.warm_forwards`) on zero features of their width, one row
        per sequence, before the generation; returns the seconds it took."""
        dtype = next(self.model.parameters()).dtype
        return sum(self._compile(c.fn, torch.zeros(self._rows, c.features, dtype=dtype,
                                                   device=self._device), c.args)
                   for c in calls)

    def _target(self, fn: Callable[..., Any] | None) -> Callable[..., Any]:
        """What compiles for ``fn``: the head (``fn`` None) or the head then ``fn``."""
        return self.model if fn is None else partial(_head_then, self.model, fn)

    def __len__(self) -> int:
        return 0

    @property
    def row_lengths(self) -> list[int]:
        return [0] * self._rows

    def crop_rows(self, lengths: list[int]) -> None:
        pass

    def crop(self, length: int) -> None:
        pass


def release_heads() -> None:
    """Forget the heads' compiled calls and the signatures they ran (after dynamo forgot its
    graphs: `static.reset_compiled`)."""
    _COMPILED.clear()


def prefill_features(s: DecodeState, width: int) -> torch.Tensor:
    """``[B, 1, width]``: the target's features at the last position its cache holds after the
    prefill (the prompt's second-to-last token), zero for a row whose prompt has one token."""
    hidden = s.target.hidden  # [B, W, F] right-aligned from the prefill, or None (no prefill)
    if hidden is None:
        return torch.zeros(s.batch, 1, width, dtype=_dtype(s), device=s.device)
    has = torch.tensor([n > 1 for n in s.prompt_lens], device=hidden.device)
    return hidden[:, -1:] * has[:, None, None].to(hidden.dtype)


def _dtype(s: DecodeState) -> torch.dtype:
    return next(p.dtype for p in s.target.model.parameters() if p.is_floating_point())
