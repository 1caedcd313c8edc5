"""`StepResult`: what one decoder iteration hands the generate loop, and `block_tokens`, its
buffer as a pure function."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepResult:
    """What one decoder iteration produced, one type per field (B rows; one sequence: a 1-D
    ``tokens`` and 0-d counts).

    A decoder whose block length depends on sampled values (how many draft tokens were accepted)
    does not read that length back itself: it returns a padded ``tokens`` buffer with a device
    tensor ``length`` (and ``accepted`` on the device too), and the generate loop reads them back
    together with the tokens, in its one host sync per iteration. Counts the host knows when the
    step is built (what was proposed, how deep each row drafted) are per-row sequences.
    `StepResult.block` builds one from a drafted block, accepting a count for every row.
    """

    tokens: torch.Tensor  # [B, m] tokens to append per row, m >= 1 ([m]: one sequence)
    proposed: Sequence[int] = ()  # [B] draft tokens shown to the target (tree nodes, k*gamma); (): none
    accepted: torch.Tensor | None = None  # [B] (0-d) device: of those, accepted; None: none
    length: torch.Tensor | None = None  # [B] (0-d) device: only tokens[..., :length] count; None: all
    # [B] (0-d) device: the draft cache stays valid only up to the row's length before this step
    # plus this many positions (the loop crops it there, after the read-back), for drafts whose
    # kept row diverges from the emitted path
    draft_kept: torch.Tensor | None = None
    depth: Sequence[int] = ()  # [B] draft tokens on one path that could have been accepted; (): none
    # [B] device: the depth where only the device knows it (EAGLE-2's dynamic tree; read back
    # with the tokens, and then used instead of ``depth``)
    device_depth: torch.Tensor | None = None
    # [B, T] device: each row's last T tokens after the block (`DecodeState.recent`), made by the
    # kernel (`block_out`); None: the state gathers them when asked
    recent: torch.Tensor | None = None
    # [B, F + m] device: what the loop reads back, packed by the kernel (`block_out`): the device
    # counts above that are tensors (accepted, length, draft_kept, device_depth: F of them, in
    # that order), then the tokens; None: the loop packs them (three host ops)
    read: torch.Tensor | None = None

    @classmethod
    def block(cls, draft: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor,
              proposed: int | Sequence[int],
              depth: int | Sequence[int] | torch.Tensor | None = None) -> StepResult:
        """``draft[:n]`` followed by ``nxt``, with ``n`` left on the device: the buffer is
        ``draft`` with ``nxt`` written at index n, of which n + 1 count. One sequence: draft
        ``[gamma]``, n and nxt 0-d; B rows: draft ``[B, gamma]``, n and nxt ``[B]``. ``proposed``
        and ``depth`` (default: the draft's length) per row, or one count for every row; a
        ``depth`` tensor is one only the device knows (`device_depth`)."""
        buf, length = block_tokens(draft, n, nxt)
        rows = draft.shape[0] if draft.dim() > 1 else 1
        depth = draft.shape[-1] if depth is None else depth
        return cls(buf, _per_row(proposed, rows), n, length, **depth_fields(depth, rows))


def depth_fields(depth: int | Sequence[int] | torch.Tensor, rows: int) -> dict:
    """`StepResult`'s depth keywords: a tensor (a depth only the device knows) as
    ``device_depth``, else per row (one count for every row, or a count each) as ``depth``."""
    if isinstance(depth, torch.Tensor):
        return {"device_depth": depth}
    return {"depth": _per_row(depth, rows)}


def _per_row(value: int | Sequence[int], rows: int) -> tuple[int, ...]:
    return (value,) * rows if isinstance(value, int) else tuple(value)


def block_out(tokens: torch.Tensor, length: torch.Tensor, recent: torch.Tensor,
              *counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel: what a verify's block ``tokens [B, m]`` (the first ``length [B]`` count) hands the
    loop besides itself, made inside the verify's graph so the host makes neither: each row's
    last T tokens after it (``recent [B, T]``: before it), `StepResult.recent`, and the read-back
    packed, `StepResult.read` (``counts``: the step's device counts in `StepResult`'s order)."""
    t = recent.shape[1]
    at = length[:, None] + torch.arange(t, device=tokens.device)  # [B, T]
    return torch.cat([recent, tokens], 1).gather(1, at), block_read(tokens, *counts)


def block_read(tokens: torch.Tensor, *counts: torch.Tensor) -> torch.Tensor:
    """Kernel: `StepResult.read`, ``[B, F + m]``: the step's device ``counts`` (in
    `StepResult`'s order), then its block ``tokens [B, m]``."""
    return torch.cat([torch.stack(counts, -1).to(tokens.dtype), tokens], 1)


def block_tokens(draft: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`StepResult.block`'s buffer as a pure function (a kernel's last step): ``draft[..., :n]``
    then ``nxt`` in a buffer of gamma + 1, and its length n + 1."""
    n1, nxt1 = n[..., None], nxt[..., None]
    return torch.cat([draft, nxt1], -1).scatter(-1, n1, nxt1), n + 1
