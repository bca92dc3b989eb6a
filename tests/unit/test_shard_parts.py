"""A sharded replica's parts of a flat buffer, cut and joined again (sparknet.parallel.mesh): what the driver does
with the parts of the global weights a sharded replica's ranks send, and what a resumed stage's ranks do with the
whole. The layouts are FSDP2's (each weight's first dimension cut as ``torch.chunk`` cuts it, buffers whole), tensor
parallelism's (any dimension), and both at once (a split copy's parts sharded again over the worker's copies)."""

from __future__ import annotations

import pytest
import torch

from sparknet.parallel.mesh import cut_shard, join_shards
from sparknet.weights import shard_slice, worker_layouts


def _layouts(shapes: list[tuple[int, ...]], sharded: list[bool], parts: int) -> list[list[tuple[int, ...]]]:
    """Each rank's layout, as Net.shard_layout gives it (FSDP2's: the first dimension of each sharded weight)."""
    return worker_layouts([(shape, None, cut) for shape, cut in zip(shapes, sharded)], shard=parts)


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_the_parts_of_a_buffer_join_into_it_again(parts):
    # uneven rows (7 and 3 over 2, 3 or 4 ranks: the last parts small or empty), a whole buffer, a vector
    shapes, sharded = [(7, 5), (7,), (3, 7), (3,), (4,), (1,)], [True, True, True, True, False, True]
    whole = torch.arange(sum(torch.Size(s).numel() for s in shapes), dtype=torch.float32)
    layouts = _layouts(shapes, sharded, parts)
    pieces = [cut_shard(whole, layout) for layout in layouts]
    # every sharded row is held once, a whole buffer by every rank
    assert sum(p.numel() for p in pieces) == whole.numel() + (parts - 1) * 4
    assert torch.equal(join_shards(pieces, layouts), whole)


def test_parts_that_leave_rows_out_are_refused():
    shapes, sharded = [(4, 2)], [True]
    layouts = _layouts(shapes, sharded, 2)
    whole = torch.arange(8, dtype=torch.float32)
    with pytest.raises(ValueError, match="cover 4 of its 8 values"):
        join_shards([cut_shard(whole, layouts[0])], layouts[:1])
    with pytest.raises(ValueError, match="does not match the layout"):
        cut_shard(whole[:6], layouts[0])


def test_a_layout_cuts_rows_as_torch_chunk_does():
    for rows, parts in [(7, 2), (7, 3), (3, 4), (1, 2), (8, 4)]:
        chunks = torch.arange(rows).chunk(parts)
        got = [layout[0][0][:2] for layout in worker_layouts([((rows, 5), None, True)], shard=parts)]
        held = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
        assert got[:len(held)] == held and all(first == end == 0 for first, end in got[len(held):])


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_a_fragment_of_the_whole_is_one_slice_of_each_part(parts):
    # every cut of the whole, at a weight's edge, inside a row, inside a whole buffer: each rank's slice of its part
    # holds the fragment's values it holds, in order (the values are their own indices)
    shapes, sharded = [(7, 5), (7,), (3, 7), (3,), (4,), (1,)], [True, True, True, True, False, True]
    whole = torch.arange(sum(torch.Size(s).numel() for s in shapes), dtype=torch.float32)
    layouts = _layouts(shapes, sharded, parts)
    for layout in layouts:
        mine = cut_shard(whole, layout)
        for start in range(whole.numel() + 1):
            for stop in range(start, whole.numel() + 1):
                held = mine[shard_slice(slice(start, stop), layout)]
                assert torch.equal(held, mine[(mine >= start) & (mine < stop)]), (start, stop)
        assert shard_slice(slice(0, whole.numel()), layout) == slice(0, mine.numel())


@pytest.mark.parametrize("split, shard", [(1, 1), (2, 1), (4, 1), (2, 2), (2, 3)])
def test_parts_cut_along_any_dimension_and_sharded_again_join_into_the_buffer_again(split, shard):
    # tensor parallelism's cuts: a column-split weight and bias (dimension 0), a row-split weight (dimension 1, its
    # bias whole), a convolution's output channels, a weight cut along its last of three dimensions; then each part's
    # first dimension cut again over the copies (FSDP2 over a split net: a row weight's part a block of rows and
    # columns), a buffer whole on every rank
    weights = [((8, 3), 0), ((8,), 0), ((5, 8), 1), ((5,), None), ((4, 2, 3, 3), 0), ((2, 3, 4), 2)]
    params = [True, True, True, True, False, True]
    whole = torch.arange(sum(torch.Size(s).numel() for s, _ in weights), dtype=torch.float32)
    layouts = worker_layouts([(s, d, p and shard > 1) for (s, d), p in zip(weights, params)], split, shard)
    pieces = [cut_shard(whole, layout) for layout in layouts]
    for rank, piece in enumerate(pieces):  # each rank's values are torch.chunk's of torch.chunk's of the weight
        c, m = divmod(rank, split)
        offset, held = 0, 0
        for (shape, dim), param in zip(weights, params):
            tensor = whole[offset:offset + torch.Size(shape).numel()].view(shape)
            offset += tensor.numel()
            want = tensor if dim is None else tensor.chunk(split, dim)[m]
            if param and shard > 1:
                chunks = want.chunk(shard, 0)
                want = chunks[c] if c < len(chunks) else want[:0]
            assert torch.equal(piece[held:held + want.numel()], want.reshape(-1)), (rank, shape)
            held += want.numel()
        assert held == piece.numel()
        for start in range(0, whole.numel() + 1, 7):  # a fragment of the whole: one slice of every part
            for stop in range(start, whole.numel() + 1, 5):
                assert torch.equal(piece[shard_slice(slice(start, stop), layouts[rank])],
                                   piece[(piece >= start) & (piece < stop)]), (rank, start, stop)
    assert torch.equal(join_shards(pieces, layouts), whole)
