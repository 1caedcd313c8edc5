"""The state's device bookkeeping between iterations (`DecodeState`, `step.block_out`): what the
kernels hand back so the host makes no ops for it, and the ids that catch up when asked for."""

from __future__ import annotations

import torch

from mtad_energy.decoding.rules.sampling import split_uniforms, uniforms
from mtad_energy.decoding.runtime.state import DecodeState
from mtad_energy.decoding.runtime.step import block_out, block_read


def _state(rows: list[list[int]], width: int = 12, recent: int = 3) -> DecodeState:
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
    lens = [len(r) for r in rows]
    return DecodeState(ids, list(lens), lens, 8, None, None, torch.Generator(),
                       tokens=[list(r) for r in rows], recent_width=recent)


def test_one_flat_draw_split_is_the_separate_draws_it_replaces():
    shapes = ((4, 5), (4, 1), (2, 3, 2))
    g = torch.Generator().manual_seed(7)
    separate = [uniforms(s, g, "cpu") for s in shapes]
    g = torch.Generator().manual_seed(7)
    flat = uniforms((sum(torch.Size(s).numel() for s in shapes),), g, "cpu")
    for a, b in zip(separate, split_uniforms(flat, *shapes), strict=True):
        assert torch.equal(a, b)


def test_block_out_hands_back_each_rows_last_tokens_after_its_block_and_the_packed_read():
    recent = torch.tensor([[1, 2, 3], [4, 5, 6]])
    block = torch.tensor([[7, 8, 9], [10, 11, 12]])  # row 0 takes 2 tokens, row 1 takes 3
    length, accepted = torch.tensor([2, 3]), torch.tensor([1, 2])
    after, read = block_out(block, length, recent, accepted, length)
    assert after.tolist() == [[3, 7, 8], [10, 11, 12]]
    assert read.tolist() == [[1, 2, 7, 8, 9], [2, 3, 10, 11, 12]]
    assert torch.equal(block_read(block, accepted, length), read)


def test_a_state_reads_its_last_tokens_from_recent_and_its_ids_catch_up_from_the_host():
    s = _state([[1, 2, 3, 4], [5, 6]])
    assert s.recent.tolist()[1][1:] == [5, 6] and s.recent.tolist()[0] == [2, 3, 4]
    block = torch.tensor([[7, 8], [9, 0]])
    after = torch.tensor([[4, 7, 8], [6, 9, 9]])  # what a kernel made: row 1 took one token
    s.append_rows(block, [[7, 8], [9]], torch.tensor([2, 1]), after)
    assert s.ids_buffer[0, 4:].tolist() == [0] * 8  # nothing written on the device
    assert s.last_token.tolist() == [[8], [9]]
    assert s.last_tokens(2).tolist() == [[7, 8], [9, 9]]
    assert s.ids[0, :6].tolist() == [1, 2, 3, 4, 7, 8] and s.ids[1, :3].tolist() == [5, 6, 9]
    assert s.lengths_on_device().tolist() == [6, 3]
    # a block written the eager way lands after each row's tokens, the ids caught up first
    s.append_rows(torch.tensor([[1, 2], [3, 4]]), [[1, 2], [3, 4]], 2)
    assert s.ids[0, :8].tolist() == [1, 2, 3, 4, 7, 8, 1, 2]
    assert s.ids[1, :5].tolist() == [5, 6, 9, 3, 4]
    assert s.last_token.tolist() == [[2], [4]] and s.recent.tolist() == [[8, 1, 2], [9, 3, 4]]
