"""`ModelRunner`: one model with its KV cache, counting and timing its forwards.

Cache invariant between iterations (gpt-fast style): the target cache holds every token except the
last one, which is fed at the start of the next iteration together with the draft tokens, so the
bonus token never needs a forward of its own. The draft cache holds a prefix of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mtad_energy.decoding.rules.sampling import uniforms
from mtad_energy.decoding.runtime import cache as kv
from mtad_energy.decoding.runtime import programs
from mtad_energy.decoding.runtime.graph_call import CompilesAfter
from mtad_energy.decoding.runtime.masks import additive_mask, tree_inputs
from mtad_energy.decoding.runtime.timer import PhaseTimer
from mtad_energy.energy.work import Forward
from mtad_energy.hf_cache import cache_kwargs


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


class ModelRunner(CompilesAfter):
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

    def then(self, calls, input_ids: torch.Tensor, fn: Callable[..., Any], *args: Any,
             counts: list[int] | None = None) -> Any:
        """A forward of ``input_ids [B, k]`` (``counts``: as in `__call__`), then ``fn(logits
        [B, k, V], *args)`` through ``calls`` (`DecodeState.calls`): a verify's rule, a
        token drawn from p. The compiled runner runs both in one graph call
        (`static_fused.FusedCalls.then`)."""
        return calls(fn, self(input_ids, counts), *args)

    def verify(self, calls, input_ids: torch.Tensor, fn: Callable[..., Any], *args: Any) -> Any:
        """`then` of a chain verify whose rule returns ``(block, accepted, length [B],
        *handed)``: ``handed``, what the host needs (the read-back packed, the rows' last
        tokens: the rest stays on the device, so a CUDA graph hands back, and its host clones,
        only these). The loop crops the cache to each row's block after the read-back. The
        compiled runner rolls the rejected columns back inside the verify's graph call
        (`static_fused.FusedCalls.verify`), where the crop then finds it done."""
        return self.then(calls, input_ids, fn, *args)[3:]

    def chain(self, calls, input_ids: torch.Tensor, counts: list[int] | None,
              fn: Callable[..., Any], u: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        """A draft's autoregressive loop of S = ``u.shape[0]`` forwards (`programs.chain`), the
        first of ``input_ids [B, k]`` (``counts``: as in `__call__`), each next of the token
        ``fn(logits [B, k, V], u[i] [B, 1], *args) -> (token [B, 1], *extras)`` drew. Returns
        ``(tokens [B, S], *extras stacked on dim 1: [B, S, ...])``. The compiled runner runs
        the same program in one graph call (`static_fused.FusedCalls.chain`)."""
        return programs.chain(RunnerSteps(self, calls, input_ids, counts), fn, u, *args)

    def tree_levels(self, calls, input_ids: torch.Tensor, counts: list[int] | None,
                    branching: tuple[int, ...], anc: torch.Tensor, fn: Callable[..., Any],
                    u: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        """A draft token tree grown level by level (`programs.tree_levels`) from the forward of
        ``input_ids [B, k]`` (``counts``: as in `__call__`), each level a tree forward
        (`forward_tree`). The compiled runner runs a full-depth tree in one graph call
        (`static_fused.FusedCalls.tree_levels`)."""
        return programs.tree_levels(RunnerSteps(self, calls, input_ids, counts), branching,
                                    anc, fn, u, *args)

    def beam_search(self, calls, first_ids: torch.Tensor, counts: list[int] | None,
                    depth: int, width: int, warp_args: tuple, generator: torch.Generator | None,
                    eos_token_id: int | None = None, finish: Callable[..., tuple] | None = None,
                    *finish_args: Any) -> tuple[torch.Tensor, ...]:
        """``depth`` steps of stochastic beam sampling of W = ``width`` beams per sequence
        (`programs.beam_search`) after feeding ``first_ids [B, k]`` (``counts``: as in
        `__call__`), the rows expanded (`repeat_rows`) and reordered (`select_rows`) by this
        runner; the draws' uniforms come from ``generator``, drawn per step for the scores it
        ranks. The compiled runner runs a full-length search in one graph call
        (`static_fused.FusedCalls.beam_search`)."""
        def draws(scores: torch.Tensor, at: int, n: int) -> torch.Tensor | None:
            return uniforms(scores.shape, generator, scores.device) if warp_args[-1] else None

        return programs.beam_search(RunnerSteps(self, calls, first_ids, counts), depth, width,
                                    warp_args, draws, eos_token_id, finish, *finish_args)

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

    def tree_then(self, calls, input_ids: torch.Tensor, anc_rows: torch.Tensor,
                  depths: torch.Tensor, fn: Callable[..., Any], *args: Any,
                  features: torch.Tensor | None = None) -> Any:
        """`forward_tree` (``features``: a head's input), then ``fn(logits [B, K, V], *args)``
        through ``calls`` (a runner returning hidden states: ``fn(logits, hidden [B, K, H],
        *args)``): a tree verify's rule, a head's expansion of its tree (`then` for a token
        tree). The compiled runner runs both in one graph call (`static_fused.FusedCalls.tree_then`).
        """
        logits = self.forward_tree(input_ids, anc_rows, depths, features)
        outs = (logits, self.hidden) if self.hidden_layers else (logits,)
        return calls(fn, *outs, *args)

    def grow_tree(self, calls, input_ids: torch.Tensor, counts: list[int] | None,
                  features: torch.Tensor, nodes: tuple[int, ...], fn: Callable[..., Any],
                  *args: Any) -> Any:
        """A draft head's token tree (`programs.grow_tree`): the forward of ``input_ids [B, k]``
        with the head's ``features [B, k, F]`` (``counts``: as in `__call__`), then the
        decoder's program ``fn(tree_then, kernels, logits, hidden, *args)``, whose ``len(nodes)``
        tree forwards of ``nodes[i]`` nodes each run as `tree_then`. The compiled runner runs a
        tree of any depth up to the decoder's in one graph call
        (`static_fused.FusedCalls.grow_tree`)."""
        return programs.grow_tree(RunnerSteps(self, calls, input_ids, counts, features), fn,
                                  *args)

    def verify_tree(self, calls, input_ids: torch.Tensor, anc_rows: torch.Tensor,
                    depths: torch.Tensor, fn: Callable[..., Any], *args: Any,
                    features: torch.Tensor | None = None) -> Any:
        """`tree_then` of a tree verify whose rule returns ``(block, accepted, length [B], path
        [B, m], *handed)``, then the rollback: each row keeps its ``path`` (root first) of the
        tree (`keep_tree`), which the loop crops to the block's length after the read-back.
        Returns ``handed`` (as `verify`). The compiled runner keeps exactly the first length[b]
        nodes inside the verify's graph call (`static_fused.FusedCalls.verify_tree`)."""
        out = self.tree_then(calls, input_ids, anc_rows, depths, fn, *args, features=features)
        self.keep_tree(input_ids.shape[1], out[3])
        return out[4:]

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

    def crop_rows(self, lengths: list[int], kept: list[int] | None = None) -> None:
        """Keep the first lengths[b] tokens of row b (rows of one sequence: one length).
        ``kept``: the iteration's block lengths read back (a runner that rolled a verify back
        on the device, `verify` or `verify_tree`, may find nothing left to do)."""
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


class RunnerSteps:
    """`programs.Steps` over a runner's own calls: each forward a call of ``runner`` (its
    ``__call__``, `ModelRunner.forward_tree`, `ModelRunner.tree_then`: a compiled runner's may
    fuse), each pure function through ``calls`` (`calls.EagerCalls`), the rows moved by the runner. The
    first forward is of ``input_ids [B, k]`` (``counts``: as in `ModelRunner.__call__`; a
    head's ``features [B, k, F]``)."""

    def __init__(self, runner: ModelRunner, calls, input_ids: torch.Tensor,
                 counts: list[int] | None, features: torch.Tensor | None = None):
        self.runner = runner
        self.call = calls
        self._first = (input_ids, counts)
        self._features = features

    def first(self) -> torch.Tensor:
        return self.runner(*self._first)

    def first_hidden(self) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.runner(*self._first, features=self._features)
        return logits, self.runner.hidden

    def next(self, tokens: torch.Tensor, i: int) -> torch.Tensor:
        return self.runner(tokens)

    def level(self, children: torch.Tensor, anc: torch.Tensor, fed: int) -> torch.Tensor:
        return self.runner.forward_tree(children, anc, anc.sum(-1))

    def tree_then(self, tokens: torch.Tensor, anc: torch.Tensor, depths: torch.Tensor,
                  feats: torch.Tensor, f: Callable[..., Any], *f_args: Any) -> Any:
        return self.runner.tree_then(self.call, tokens, anc, depths, f, *f_args, features=feats)

    def repeat_rows(self, n: int) -> None:
        self.runner.repeat_rows(n)

    def select_rows(self, rows: torch.Tensor, i: int) -> None:
        self.runner.select_rows(rows)
