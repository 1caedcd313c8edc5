"""`DecodeState`: the B sequences of one generation as a decoder's `step` sees them, and the
host-list helpers around it (`to_device`, `ids_width`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from mtad_energy.decoding.rules.sampling import uniforms
from mtad_energy.decoding.runtime.calls import EagerCalls
from mtad_energy.decoding.runtime.runner import ModelRunner


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

    ids_buffer: torch.Tensor  # [B, `ids_width`] on the model device: `ids`, maybe stale
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
    # where the step's pure tensor functions run: eagerly, or compiled (`calls`)
    calls: EagerCalls = field(default_factory=EagerCalls)
    # tokens per row `recent` holds: what a draft's catch-up and a verify's first token take
    recent_width: int = 1

    def __post_init__(self) -> None:
        self.active = self.active or [True] * len(self.lengths)
        self._lengths_dev: torch.Tensor | None = None
        self._last: torch.Tensor | None = None  # [B, 1]: each row's last token, when known
        self._recent: torch.Tensor | None = None  # [B, T]: `recent`, when a kernel made it
        self._uploaded: dict[tuple[int, ...], torch.Tensor] = {}
        self._aranges: dict[int, torch.Tensor] = {}
        self._ids_stale = False  # the host mirror `tokens` is ahead of `ids_buffer`
        self.device = self.ids_buffer.device

    @property
    def ids(self) -> torch.Tensor:
        """``[B, ids_width]`` on the model device: ``ids[b, :lengths[b]]`` are row b's tokens
        (after them: any). A step whose kernel hands back `recent` leaves it behind, since the
        next step reads no more than that: it is copied from the host mirror `tokens` when next
        asked for, not written every iteration."""
        if self._ids_stale:
            width = self.ids_buffer.shape[1]
            flat = [t for row in self.tokens for t in row + [0] * (width - len(row))]
            self.ids_buffer = to_device(flat, self.device).view(self.batch, width)
            self._ids_stale = False
        return self.ids_buffer

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
        a kernel's draws (`calls`)."""
        return uniforms(shape, self.generator, self.device)

    def uniforms(self, *shapes: tuple[int, ...]) -> torch.Tensor:
        """The uniforms of several draws of ``shapes`` in one flat tensor (one host op, not one
        per draw), which the kernel splits (`sampling.split_uniforms`)."""
        return uniforms((sum(math.prod(s) for s in shapes),), self.generator, self.device)

    def row_remaining(self, b: int) -> int:
        return self.prompt_lens[b] + self.max_new_tokens - self.lengths[b]

    @property
    def remaining(self) -> int:
        """Tokens still wanted by the row that wants the most (0 when every row is done)."""
        return max((self.row_remaining(b) for b in range(self.batch) if self.active[b]),
                   default=0)

    def on_device(self, values: list[int]) -> torch.Tensor:
        """``[B]`` long: per-row host values (a decoder's draft lengths, its rows' caps) on the
        model device, copied once per distinct list in this generation: they change only as rows
        near their end, so most iterations copy nothing. Read-only (shared between calls)."""
        key = tuple(values)
        t = self._uploaded.get(key)
        if t is None:
            t = self._uploaded[key] = to_device(list(key), self.device)
        return t

    def row_depths(self, depth: int) -> torch.Tensor:
        """``[B]`` long on the device: ``depth`` capped by what each row still wants (a row that
        is done: 1), the depth a row's own search of at most ``depth`` tokens would run to."""
        return self.on_device([max(1, min(depth, self.row_remaining(b))) if self.active[b] else 1
                               for b in range(self.batch)])

    def lengths_on_device(self) -> torch.Tensor:
        """``[B]`` long: `lengths` on the model device (copied when the rows' lengths changed
        otherwise than by what the device counted, `append_rows`)."""
        if self._lengths_dev is None:
            self._lengths_dev = to_device(self.lengths, self.device)
        return self._lengths_dev

    def _arange(self, k: int) -> torch.Tensor:
        """``[k]``: 0 .. k-1 on the model device (made once per k; read-only)."""
        t = self._aranges.get(k)
        if t is None:
            t = self._aranges[k] = torch.arange(k, device=self.device)
        return t

    @property
    def recent(self) -> torch.Tensor:
        """``[B, T]`` (T = `recent_width`): each row's last T tokens (left of a short row's
        first token: any, never real). A verify kernel hands back the next iteration's
        (`step.block_out`), so a batch's last tokens and a draft's catch-up are slices of it,
        not gathers from ``ids``; gathered from ``ids`` when no kernel did (the first
        iteration, a step whose kernels hand back none: BiLD's, a beam search's)."""
        if self._recent is None:
            self._recent = self._gather_last(self.recent_width)
        return self._recent

    @property
    def last_token(self) -> torch.Tensor:
        """``[B, 1]``: each row's one token the target cache has not seen."""
        if self._last is not None:  # the last block was one token
            return self._last
        if self._recent is not None or self.batch == 1:
            return self.last_tokens(1)
        return self._gather_last(1)

    def draft_feed(self) -> tuple[torch.Tensor, list[int] | None]:
        """What the draft has not seen: ``(ids [B, k], counts)`` with row b's counts[b] tokens
        right-aligned (left padding before them; `batch.RowsRunner` masks it); one sequence:
        ``(ids [1, k], None)``."""
        counts = [n - c for n, c in zip(self.lengths, self.draft.row_lengths, strict=True)]
        return self.last_tokens(max(counts)), (counts if self.batch > 1 else None)

    def last_tokens(self, k: int) -> torch.Tensor:
        """``[B, k]``: each row's last k tokens, right-aligned (left of a short row's first
        token: any): a slice of `recent` when it holds them, of ``ids`` for one sequence, else
        gathered from ``ids``."""
        if self.batch == 1 and self._recent is None:
            return self.ids[:, self.n - k:self.n]
        if k <= self.recent_width:
            return self.recent[:, self.recent_width - k:]
        return self._gather_last(k)

    def _gather_last(self, k: int) -> torch.Tensor:
        """``[B, k]``: each row's last k tokens gathered from ``ids``, right-aligned."""
        idx = self.lengths_on_device()[:, None] - k + self._arange(k)
        return self.ids.gather(1, idx.clamp_min(0))

    def draft_rewind(self) -> None:
        """Crop the draft back to the emitted tokens before this step, dropping what it drafted
        after them (a token tree): the next `draft_feed` hands it the accepted tokens with the
        bonus, up to depth + 1 of them, in the forward it runs anyway. Nothing to keep per row
        on the device: compiled, the rollback only moves the write position (SGLang's EAGLE
        worker extends its draft over the accepted tokens likewise)."""
        self.draft.crop_rows(list(self.lengths))

    def append_rows(self, block: torch.Tensor | None, host: list[list[int]],
                    counts: torch.Tensor | int | None = None,
                    recent: torch.Tensor | None = None) -> None:
        """Append to each row b the first len(host[b]) tokens of ``block [B, M]`` (on the device;
        ``host[b]``: those tokens read back, [] for a row that takes none). ``recent``: the
        kernel's `recent` after the block, or None. With it nothing is written on the device:
        `ids` catches up from the host mirror when asked for. Else one copy for all rows: the
        whole block lands after each row's tokens (``ids`` has M - 1 columns to spare,
        `ids_width`), and only the first len(host[b]) count; ``counts``: when every row takes
        what the device counted for it (the block's ``length [B]``, or all M), that count: the
        lengths on the device advance by it, with no copy from the host. ``block`` None (a step
        handed back packed, `StepResult.from_read`): only with ``recent``. A row that takes less
        than its block is done, so the rows that go on hold exactly ``recent`` (and a block of
        one token: their last tokens)."""
        behind = bool(self.tokens) and recent is not None
        if block is None and not behind:
            raise ValueError("append_rows: a step without its tokens (packed in its read-back) "
                             "must hand back `recent` to a state that mirrors its tokens")
        if behind:
            self._ids_stale = True
        elif self.batch == 1:
            self.ids[:, self.lengths[0]:self.lengths[0] + block.shape[1]].copy_(block)
        else:
            at = self.lengths_on_device()[:, None] + self._arange(block.shape[1])
            self.ids.scatter_(1, at, block)
        for b, tokens in enumerate(host):
            self.lengths[b] += len(tokens)
            if self.tokens:
                self.tokens[b].extend(tokens)
        moved = not behind and counts is not None and self._lengths_dev is not None
        self._lengths_dev = self._lengths_dev + counts if moved else None
        self._last = block if block is not None and block.shape[1] == 1 else None
        self._recent = recent


def ids_width(prompt_lens: list[int], max_new_tokens: int, lookahead: int) -> int:
    """Columns of `DecodeState.ids`: the longest row, and room for a whole block of lookahead +
    1 tokens after any row's last (`DecodeState.append_rows` writes blocks whole)."""
    return max(prompt_lens) + max_new_tokens + lookahead + 1

