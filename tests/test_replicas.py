"""The pure parts of replica handling, without ranks: write shares against ``torch.chunk``, the
checksum's sensitivity, and a plan of 1,024 simulated holders (docs/design.md#replica-agreement)."""

from __future__ import annotations

import pytest
import torch

from nemo_moe_export.adapters import HFShard
from nemo_moe_export.export.plan import write_share, write_shares
from nemo_moe_export.export.replicas import checksum


def _holders(key, tensor, offsets, global_shape, replicas):
    """The same box as each of ``replicas`` holders sees it."""
    return [HFShard(key, global_shape, offsets, tensor, j == 0, key, replica=j, replicas=replicas)
            for j in range(replicas)]


@pytest.mark.parametrize("rows,replicas", [(10, 4), (5, 4), (3, 8), (64, 24), (1, 2), (7, 1)])
def test_holders_write_the_torch_chunk_rows_of_their_box_once(rows, replicas):
    torch.manual_seed(0)
    full = torch.randn(rows + 3, 6)
    box = full[2:2 + rows]  # a box at row offset 2 of a larger tensor
    shares = [write_share(p) for p in _holders("w", box, (2, 0), tuple(full.shape), replicas)]
    chunks = torch.chunk(box, replicas)  # the reference split
    for j, share in enumerate(shares):
        if j >= len(chunks) or chunks[j].numel() == 0:
            assert share is None, j
            continue
        assert share.primary and share.replicas == 1
        start = sum(len(c) for c in chunks[:j])
        assert share.offsets == (2 + start, 0) and torch.equal(share.tensor, chunks[j])
        assert share.tensor.data_ptr() == chunks[j].data_ptr()  # a view, never a copy
    assert sum(s.tensor.numel() for s in shares if s is not None) == box.numel()


def test_transposed_and_zero_dim_pieces():
    torch.manual_seed(0)
    grouped = torch.randn(6, 4)
    view = grouped.t()  # non-contiguous HF-orientation view of a grouped-layout expert
    shares = write_shares(_holders("t", view, (0, 0), (4, 6), 3))
    assert [s.offsets for s in shares] == [(0, 0), (2, 0)]
    assert torch.equal(torch.cat([s.tensor for s in shares]), view)
    scalar = torch.tensor(7, dtype=torch.int64)
    shares = [write_share(p) for p in _holders("s", scalar, (), (), 4)]
    assert shares[0] is not None and all(s is None for s in shares[1:])  # holder 0 writes a 0-dim tensor
    lone = HFShard("x", (3,), (0,), torch.ones(3), False, "x")  # a secondary of the old kind writes nothing
    assert write_share(lone) is None


def test_a_plan_for_1024_simulated_holders_writes_each_byte_once_and_evenly():
    piece = torch.empty(5000, 7168, dtype=torch.bfloat16, device="meta")  # no memory: shapes only
    shares = write_shares(_holders("embed", piece, (0, 0), (5000, 7168), 1024))
    rows = [s.tensor.shape[0] for s in shares]
    assert rows == [len(c) for c in torch.chunk(torch.arange(5000), 1024)]  # 1,000 holders of 5 rows
    assert [s.offsets[0] for s in shares] == [sum(rows[:i]) for i in range(len(rows))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.float8_e4m3fn, torch.uint8])
def test_checksum_is_equal_for_equal_bits_and_changes_with_any_word(dtype):
    torch.manual_seed(0)
    base = (torch.randn(20000) * 4).to(dtype)
    assert torch.equal(checksum(base), checksum(base.clone()))
    shifted = torch.cat([base[:1], base])[1:]  # same values at an unaligned storage offset
    assert torch.equal(checksum(shifted), checksum(base))
    bits = base.view(torch.uint8).clone()
    for byte, flip in ((0, 1), (1234, 0x80), (bits.numel() - 1, 0x40)):  # incl. a word's sign bit
        changed = bits.clone()
        changed[byte] ^= flip
        assert not torch.equal(checksum(changed.view(dtype)), checksum(base)), (byte, flip)
    if dtype != torch.bool:
        swapped = base.clone()
        first = 3
        second = first + 8 * 512 // base.element_size()  # one checksum row further: the same column
        if not torch.equal(swapped[first:first + 1].view(torch.uint8), swapped[second:second + 1].view(torch.uint8)):
            swapped[[first, second]] = swapped[[second, first]]
            assert not torch.equal(checksum(swapped), checksum(base))


def test_checksum_of_non_contiguous_and_empty_tensors():
    torch.manual_seed(0)
    grid = torch.randn(40, 30)
    assert torch.equal(checksum(grid.t()), checksum(grid.t().contiguous()))
    assert checksum(torch.zeros(0)).tolist() == [0, 0, 0]
    assert checksum(torch.tensor(1.5)).shape == (3,)
