"""Warping and sampling as small pure tensor functions.

Warping follows the paper (and docs/design.md section 3): temperature, then keep the top-k tokens and
renormalise, then top-p where a token is dropped when the probability mass *strictly before it*
already exceeds p (so the most likely token is always kept). The same warp is applied to p and q.

Randomness is explicit: each sampler has a form that takes its uniforms (``sample_u``,
``gumbel_topk_u``), pure and free of host reads, so the compiled path can run it inside a graph
(`DecodeState.calls`) with the uniforms drawn from the generation's generator outside; the
generator forms draw the same uniforms in the same order and call it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mtad_energy.decoding.rules.counted import cpu_only

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Warp:
    """Sampling warp. ``temperature == 0`` means greedy (a one-hot distribution)."""

    temperature: float = 1.0
    top_k: int = 10
    top_p: float = 0.9

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = keep all tokens), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus cut), got {self.top_p}")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp_probs(logits, self.temperature, self.top_k, self.top_p)

    @property
    def args(self) -> tuple[float, int, float]:
        """``(temperature, top_k, top_p)``: the warp as `warp_probs`' arguments (plain numbers,
        what a compiled kernel specialises on)."""
        return self.temperature, self.top_k, self.top_p

    def support(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        return warp_support(logits, self.temperature, self.top_k, self.top_p)


def warp_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 10,
               top_p: float = 0.9) -> torch.Tensor:
    """Warped distribution ``[..., V]`` (float32) from logits ``[..., V]``. Computed on rows
    ``[R, V]`` (a reshape): inductor in torch 2.11 fails to compile the top-k nucleus of a 3-D
    ``[1, k, V]`` input on CUDA, and compiles the 2-D one (seen on an H200)."""
    if logits.dim() != 2:
        return _warp_rows(logits.reshape(-1, logits.shape[-1]), temperature, top_k,
                          top_p).reshape(logits.shape)
    return _warp_rows(logits, temperature, top_k, top_p)


def _warp_rows(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
               ) -> torch.Tensor:
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if temperature != 1.0:
        logits = logits / temperature
    vocab = logits.shape[-1]
    top = None
    if 0 < top_k < vocab:
        top = logits.topk(top_k, dim=-1)  # values descending, with their indices
        if _only_top_k(logits, top.values, top_k):
            # no token tied with the k-th beyond the k: the whole warp lives in the k candidates
            return _warp_top_k(top.values, top.indices, vocab, top_p)
        logits = logits.masked_fill(logits < top.values[..., -1:], NEG_INF)  # ties at the cut stay
    probs = logits.softmax(-1)
    if top_p < 1.0:
        drop = (_nucleus_drop(logits, probs, top_p) if top is None
                else _nucleus_drop_top_k(logits, probs, top.values, top.indices, top_p))
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def warp_support(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 10,
                 top_p: float = 0.9) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The warped distribution on a set of tokens holding all its mass: ``(tokens [..., k],
    probs [..., k])`` when top-k leaves exactly its k candidates (on the CPU, where checking for
    ties at the cut reads nothing back from a device), else ``(None, warp_probs(...) [..., V])``
    (tokens: the whole vocabulary). The probabilities are `warp_probs`' at those tokens, bit for
    bit; every token outside ``tokens`` has probability 0. For consumers whose work grows with
    the candidates (Gumbel-top-k over a beam's W x V joint): V values -> k."""
    logits = logits.float()
    if temperature > 0 and 0 < top_k < logits.shape[-1] and _may_read(logits):
        scaled = logits / temperature if temperature != 1.0 else logits
        top = scaled.topk(top_k, dim=-1)
        if _only_top_k(scaled, top.values, top_k):
            return top.indices, _top_k_probs(top.values, top_p)
    return None, warp_probs(logits, temperature, top_k, top_p)


def on_vocab(tokens: torch.Tensor | None, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """`warp_support`'s ``(tokens, probs)`` as the distribution over the vocabulary ``[..., V]``
    (what `warp_probs` returns, bit for bit)."""
    if tokens is None:
        return probs
    return torch.zeros((*probs.shape[:-1], vocab), dtype=probs.dtype,
                       device=probs.device).scatter_(-1, tokens, probs)


def _may_read(x: torch.Tensor) -> bool:
    """Whether a shortcut may read ``x``'s values on the host: on the CPU (where it is free),
    eagerly. Never on another device (a sync), nor inside a compiled kernel (a graph break)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def _only_top_k(logits: torch.Tensor, values: torch.Tensor, top_k: int) -> bool:
    """Where `_may_read`: whether no token ties the k-th logit beyond the k ``values`` topk
    returned (then the warp's support is exactly those k). Elsewhere False: checking would read a
    value back to the host."""
    return _may_read(logits) and not cpu_only(
        lambda: bool(((logits >= values[..., -1:]).sum(-1) > top_k).any()))


def _top_k_probs(values: torch.Tensor, top_p: float) -> torch.Tensor:
    """Softmax, nucleus and renormalisation over the k candidates ``values [..., k]`` (logits
    descending) when exactly they survive top-k: their warped probabilities ``[..., k]``."""
    p = values.softmax(-1)
    if top_p < 1.0:
        p = p.masked_fill(p.cumsum(-1) - p > top_p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def _warp_top_k(values: torch.Tensor, indices: torch.Tensor, vocab: int, top_p: float) -> torch.Tensor:
    """`_top_k_probs` scattered into ``[..., V]`` at ``indices [..., k]``."""
    return on_vocab(indices, _top_k_probs(values, top_p), vocab)


def _nucleus_drop(logits: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Tokens outside the nucleus ``[..., V]``: the mass strictly before them exceeds top_p.

    Ordered by logit, not by probability: tokens whose float32 probabilities tie must still keep
    their logit order, or the nucleus could drop the most likely token. Sorts the vocabulary."""
    order = logits.argsort(-1, descending=True)
    sorted_p = probs.gather(-1, order)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    drop_sorted = mass_before > top_p
    return drop_sorted.scatter(-1, order, drop_sorted)


def _nucleus_drop_top_k(logits: torch.Tensor, probs: torch.Tensor, values: torch.Tensor,
                        indices: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_nucleus_drop` after a top-k cut, without sorting the vocabulary (O(V + k^2)).

    ``values, indices [..., k]``: the top-k logits (descending) and their tokens. Every kept token
    is one of them, except further tokens tied with the k-th logit; those come last in the order,
    in vocabulary order. mass_before(j) = mass of the tokens with a larger logit + mass of the
    tied tokens ranked before j (tied tokens have equal probabilities)."""
    k = values.shape[-1]
    p_top = probs.gather(-1, indices)  # [..., k]
    rank = torch.arange(k, device=values.device)
    before = ((values[..., None, :] > values[..., :, None])
              | ((values[..., None, :] == values[..., :, None]) & (rank[None, :] < rank[:, None])))
    mass_before = (before.to(p_top.dtype) * p_top[..., None, :]).sum(-1)  # [..., k]
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, indices, mass_before > top_p)
    # tokens tied with the k-th logit beyond the k returned by topk: the first `allowed` of them
    # (in vocabulary order) still start within the nucleus
    kth, p_kth = values[..., -1:], p_top[..., -1:]
    mass_above = (p_top * (values > kth)).sum(-1, keepdim=True)
    ties_in_top = (values == kth).sum(-1, keepdim=True)
    allowed = ((top_p - mass_above) / p_kth).floor().long() + 1 - ties_in_top  # [..., 1]
    extra = (logits == kth).scatter_(-1, indices, False)  # [..., V]
    # counted in float32 (exact below 2^24 tokens): the scan every backend compiles
    extra_rank = extra.float().cumsum(-1) - 1
    return drop.logical_or_(extra & (extra_rank >= allowed))


def log_probs(probs: torch.Tensor) -> torch.Tensor:
    """log of a (warped) distribution; zeros become -inf, never NaN. (log(0) is ~10x slower than
    log of a normal number on CPUs, and a warped row is almost all zeros: take the log of 1
    there and write -inf.)"""
    zero = probs == 0
    return probs.masked_fill(zero, 1.0).log_().masked_fill_(zero, float("-inf"))


def take(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``x[i]`` for a 0-d index tensor ``i``, on the device: plain indexing with a 0-d tensor reads
    it back to the host first (a sync per index on a GPU)."""
    return x.index_select(0, i.reshape(1)).squeeze(0)


def uniforms(shape: tuple[int, ...], generator: torch.Generator | None,
             device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform draws in [0, 1) of ``shape`` from ``generator`` (what the ``*_u`` forms take)."""
    return torch.rand(shape, generator=generator, device=device, dtype=dtype)


def split_uniforms(u: torch.Tensor, *shapes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``u`` (flat, drawn once for several draws: `DecodeState.uniforms`) as one tensor of each
    of ``shapes``, in order: on the CPU, exactly the draws separate `uniforms` calls of those
    shapes make from the same generator state (its stream is serial)."""
    parts = u.split([math.prod(shape) for shape in shapes])
    return tuple(part.view(shape) for part, shape in zip(parts, shapes, strict=True))


def sample_shape(probs: torch.Tensor) -> tuple[int, int]:
    """The uniforms `sample_u` takes for ``probs [..., V]``: one per row, ``(rows, 1)``."""
    return (probs.numel() // probs.shape[-1], 1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`sample_u` with its uniforms drawn from ``generator``."""
    return sample_u(probs, uniforms(sample_shape(probs), generator, probs.device,
                                    torch.promote_types(probs.dtype, torch.float32)))


def sample_u(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row: probs ``[..., V]`` (need not be normalised) and uniforms ``u [R, 1]``
    (R = the rows of probs, `sample_shape`) -> token ids ``[...]``.

    Inverse CDF: one uniform per row and a binary search of the cumulative sum. (torch.multinomial
    draws an exponential variate for every token of the vocabulary, 10-30x the cost on a CPU.) A
    token of probability 0 is never drawn: the search returns the first index whose cumulative
    mass exceeds u, and the mass does not grow at a zero."""
    flat = probs.reshape(-1, probs.shape[-1])
    cdf = flat.cumsum(-1)  # [R, V]
    idx = torch.searchsorted(cdf, u.to(cdf.dtype) * cdf[:, -1:], right=True)
    return idx.clamp_max(flat.shape[-1] - 1).reshape(probs.shape[:-1])


def sample_n_u(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """n i.i.d. draws per row: probs ``[..., V]`` (need not be normalised) and uniforms ``u [...,
    n]`` -> token ids ``[..., n]`` (`sample_u`'s inverse CDF, one cumulative sum for the n)."""
    cdf = probs.cumsum(-1)  # [..., V]
    idx = torch.searchsorted(cdf, u.to(cdf.dtype) * cdf[..., -1:], right=True)
    return idx.clamp_max(probs.shape[-1] - 1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) along the last axis; falls back to p where the residual is empty.

    An empty residual only happens when p == q (then no rejection can occur), but float error
    can produce it; p is the correct limit.
    """
    r = (p - q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(1e-30), p)


def gumbel_topk(log_weights: torch.Tensor, k: int, generator: torch.Generator | None = None,
                stochastic: bool = True) -> torch.Tensor:
    """Indices of k draws *without replacement* proportional to exp(log_weights), per row:
    ``[..., N] -> [..., k]``.

    Gumbel-top-k: adding i.i.d. Gumbel noise and keeping the k largest keys is exactly sequential
    sampling without replacement. ``stochastic=False`` keeps the k largest weights (beam search).
    Entries with weight 0 (-inf) are only returned when fewer than k have positive weight.
    """
    u = uniforms(log_weights.shape, generator, log_weights.device) if stochastic else None
    return gumbel_topk_u(log_weights, k, u)


def gumbel_topk_u(log_weights: torch.Tensor, k: int, u: torch.Tensor | None) -> torch.Tensor:
    """`gumbel_topk` with its uniforms ``u`` (the shape of ``log_weights``) given; None: the k
    largest weights (deterministic)."""
    keys = log_weights
    if u is not None:
        keys = log_weights - torch.log(-torch.log(u.clamp_min(1e-20)))
    return keys.topk(k).indices
