"""`StepResult`: what one decoder iteration hands the generate loop, and `block_tokens`, its
buffer as a pure function."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
