"""`StepResult`: what one decoder iteration hands the generate loop, and `block_tokens`, its
buffer as a pure function."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# the counts a step may leave on the device, in the order `StepResult.read` packs them
COUNTS = ("accepted", "length", "draft_kept", "device_depth")


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

    # [B, m] tokens to append per row, m >= 1 ([m]: one sequence); None: only in ``read`` (a
    # step handed back packed, `StepResult.from_read`)
    tokens: torch.Tensor | None
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
    # the device counts ``read`` holds that the step hands back in it alone, no tensor of their
    # own (names in `COUNTS`): a verify's graph call returns its block and counts packed, so a
    # GPU host clones one tensor of them (`graph_call.graph_outputs`), not one each
    packed: tuple[str, ...] = ()

    @classmethod
    def from_read(cls, read: torch.Tensor, recent: torch.Tensor | None, counts: tuple[str, ...],
                  tokens: torch.Tensor | None = None, **host: Any) -> StepResult:
        """A step handed back packed: ``read [B, F + m]`` (`block_read`) holds its device
        ``counts`` (names in `COUNTS` order, F of them) and its block; ``recent``: the rows'
        last tokens after it (`block_out`; None: the loop writes ``tokens`` into the ids);
        ``host``: the counts the host knows (``proposed``, ``depth``)."""
        assert all(c in COUNTS for c in counts), counts
        return cls(tokens, recent=recent, read=read, packed=counts, **host)

    def device_counts(self) -> tuple[str, ...]:
        """The counts on the device, in `COUNTS` order (tensors, or `packed` in ``read``): what
        the read-back holds before the tokens."""
        return tuple(c for c in COUNTS
                     if c in self.packed or isinstance(getattr(self, c), torch.Tensor))

    def count(self, name: str) -> torch.Tensor | Sequence[int] | None:
        """Count ``name`` (`COUNTS`) as the step holds it: its own tensor or host value, or a
        `packed` one's column of ``read`` (``[B]``, a view: for a caller inspecting a step;
        the loop reads ``read`` whole)."""
        if name not in self.packed:
            return getattr(self, name)
        return self.read[:, self.device_counts().index(name)]

    def block_view(self) -> torch.Tensor:
        """The block's tokens, ``tokens`` or a packed step's columns of ``read`` (a view, for a
        caller inspecting a step)."""
        return self.tokens if self.tokens is not None else self.read[:, len(self.device_counts()):]

    def block_rows(self, rows: int) -> torch.Tensor | None:
        """``[B, m]``: the tokens as B rows; None for a step whose tokens are only in ``read``
        (the loop then needs none: ``recent`` holds the rows' last tokens)."""
        if self.tokens is None:
            return None
        return self.tokens if self.tokens.dim() == 2 else self.tokens.reshape(rows, -1)

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
