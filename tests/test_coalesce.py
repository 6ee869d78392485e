"""Descriptor coalescing: the coalesced list moves exactly the bytes of the per-block list."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transports.coalesce import (
    DescArray,
    Region,
    SliceError,
    block_descs,
    block_indices,
    coalesce,
    read_descs,
    read_indices,
    slice_span,
)


def expand(local: DescArray, remote: DescArray) -> list[tuple[int, int, int, int]]:
    """Every byte the descriptors move, in order: (local device, local address, remote device,
    remote address)."""
    out: list[tuple[int, int, int, int]] = []
    for (la, ln, ld), (ra, rn, rd) in zip(local.tolist(), remote.tolist(), strict=True):
        assert ln == rn
        out.extend((ld, la + k, rd, ra + k) for k in range(ln))
    return out


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[int], list[int], Region, Region, int, int, int, int]:
    """A block table of any shape: contiguous runs, shuffled, reversed, with duplicates, slices."""
    lslices = draw(st.sampled_from([1, 1, 2, 4]))
    rslices = draw(st.sampled_from([1, 1, 2, 4]))
    unit = draw(st.integers(1, 4))  # bytes per slice
    lnum = draw(st.integers(1, 24))
    rnum = draw(st.integers(1, 24))
    n = draw(st.integers(0, 20))
    style = draw(st.sampled_from(["runs", "random", "reversed", "contiguous", "dups"]))

    def table(num: int) -> list[int]:
        if style == "contiguous" and n <= num:
            start = draw(st.integers(0, num - n))
            return list(range(start, start + n))
        if style == "reversed" and n <= num:
            start = draw(st.integers(0, num - n))
            return list(range(start + n - 1, start - 1, -1))
        if style == "runs":
            out: list[int] = []
            while len(out) < n:
                start = draw(st.integers(0, num - 1))
                k = draw(st.integers(1, n - len(out)))
                out.extend(min(start + i, num - 1) for i in range(k))
            return out
        if style == "dups":
            return [draw(st.integers(0, min(2, num - 1))) for _ in range(n)]
        return [draw(st.integers(0, num - 1)) for _ in range(n)]

    local, remote = table(lnum), table(rnum)
    lbase = draw(st.integers(0, 1 << 20))
    rbase = draw(st.integers(0, 1 << 20))
    ldev, rdev = draw(st.integers(0, 1)), draw(st.integers(0, 1))
    lreg = Region(lbase, unit * lslices, lnum, ldev)
    rreg = Region(rbase, unit * rslices, rnum, rdev)
    return (local, remote, lreg, rreg, draw(st.integers(0, lslices - 1)), lslices,
            draw(st.integers(0, rslices - 1)), rslices)


@settings(max_examples=400, deadline=None)
@given(tables())
def test_coalesced_moves_the_same_bytes_in_the_same_pairing(
    t: tuple[list[int], list[int], Region, Region, int, int, int, int],
) -> None:
    local, remote, lreg, rreg, li, ls, ri, rs = t
    dl, dr = block_descs(local, remote, lreg, rreg, local_slice=li, local_slices=ls,
                         remote_slice=ri, remote_slices=rs)
    assert dl.shape == (len(local), 3)
    cl, cr = coalesce(dl, dr)
    assert expand(cl, cr) == expand(dl, dr)
    assert len(cl) <= len(dl)
    # Nothing that could have been merged was left apart.
    for i in range(1, len(cl)):
        assert not (cl[i, 0] == cl[i - 1, 0] + cl[i - 1, 1] and cr[i, 0] == cr[i - 1, 0] + cr[i - 1, 1]
                    and cl[i, 2] == cl[i - 1, 2] and cr[i, 2] == cr[i - 1, 2])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 64), st.integers(0, 1 << 30), st.integers(0, 1 << 30), st.data())
def test_a_contiguous_table_is_one_descriptor(stride: int, n: int, lbase: int, rbase: int, data: st.DataObject) -> None:
    num = n + data.draw(st.integers(0, 8))
    lstart = data.draw(st.integers(0, num - n))
    rstart = data.draw(st.integers(0, num - n))
    dl, dr = read_descs(range(lstart, lstart + n), range(rstart, rstart + n),
                        [Region(lbase, stride, num)], [Region(rbase, stride, num)])
    assert dl.tolist() == [[lbase + lstart * stride, n * stride, 0]]
    assert dr.tolist() == [[rbase + rstart * stride, n * stride, 0]]


def test_regions_are_never_merged_with_each_other() -> None:
    # Two regions that happen to be adjacent in memory on both sides stay two descriptors.
    local = [Region(0, 16, 4), Region(64, 16, 4)]
    remote = [Region(1000, 16, 4), Region(1064, 16, 4)]
    dl, dr = read_descs(range(4), range(4), local, remote)
    assert dl.tolist() == [[0, 64, 0], [64, 64, 0]]
    assert dr.tolist() == [[1000, 64, 0], [1064, 64, 0]]


def test_slices_of_consecutive_blocks_are_not_contiguous() -> None:
    # Remote TP 1, local TP 2: the local rank reads slice 1 of 2 of each remote block.
    dl, dr = read_descs([0, 1, 2], [5, 6, 7], [Region(0, 8, 8)], [Region(0, 16, 8)],
                        remote_slice=1, remote_slices=2)
    # Local blocks are contiguous, the remote slices are 8 bytes apart: a run must be adjacent
    # on both sides, so nothing merges.
    assert dl.tolist() == [[0, 8, 0], [8, 8, 0], [16, 8, 0]]
    assert dr.tolist() == [[88, 8, 0], [104, 8, 0], [120, 8, 0]]
    # Both sides sliced the same way (TP 2 reading TP 2's half, say) do not merge either.
    dl, dr = read_descs([0, 1], [0, 1], [Region(0, 16, 8)], [Region(0, 16, 8)], local_slice=1, local_slices=2,
                        remote_slice=1, remote_slices=2)
    assert len(dl) == 2


def test_fragmented_reversed_and_duplicate_tables() -> None:
    reg = Region(0, 4, 16)
    dl, dr = read_descs([3, 2, 1, 0], [0, 1, 2, 3], [reg], [reg])
    assert len(dl) == 4  # reversed on one side: nothing merges
    dl, dr = read_descs([0, 1, 2, 9, 10], [4, 5, 6, 7, 8], [reg], [reg])
    assert dl.tolist() == [[0, 12, 0], [36, 8, 0]]
    assert dr.tolist() == [[16, 12, 0], [28, 8, 0]]
    dl, dr = read_descs([1, 1], [2, 3], [reg], [reg])
    assert len(dl) == 2  # a duplicate local block is not adjacent to itself


def test_a_device_change_breaks_a_run() -> None:
    dl = np.array([[0, 4, 0], [4, 4, 1]], dtype=np.uint64)
    dr = np.array([[0, 4, 0], [4, 4, 0]], dtype=np.uint64)
    cl, _ = coalesce(dl, dr)
    assert len(cl) == 2


def test_bad_input_is_refused() -> None:
    reg = Region(0, 16, 4)
    with pytest.raises(SliceError, match="outside"):
        block_descs([4], [0], reg, reg)
    with pytest.raises(SliceError, match="outside"):
        block_descs([0], [-1], reg, reg)
    with pytest.raises(SliceError, match="local blocks for"):
        block_descs([0, 1], [0], reg, reg)
    with pytest.raises(SliceError, match="slice sizes differ"):
        block_descs([0], [0], reg, reg, remote_slices=2, remote_slice=0)
    with pytest.raises(SliceError, match="equal slices"):
        slice_span(10, 3, 0)
    with pytest.raises(SliceError, match="does not exist"):
        slice_span(16, 2, 2)
    with pytest.raises(SliceError, match="regions"):
        read_descs([0], [0], [reg], [])


def test_empty_table() -> None:
    dl, dr = read_descs([], [], [Region(0, 8, 2)], [Region(0, 8, 2)])
    assert dl.shape == (0, 3) and dr.shape == (0, 3)


def test_block_indices_are_region_major() -> None:
    assert block_indices([2, 0], 3, 2).tolist() == [2, 0, 5, 3]
    with pytest.raises(SliceError):
        block_indices([3], 3, 1)


def test_block_indices_of_some_regions() -> None:
    """Layer pairing indexes a subset of the local regions, in the remote rank's order."""
    assert block_indices([2, 0], 3, [3, 1]).tolist() == [11, 9, 5, 3]
    assert block_indices([2, 0], 3, (0, 1)).tolist() == block_indices([2, 0], 3, 2).tolist()
    assert block_indices([1], 3, [2]).tolist() == [7]
    with pytest.raises(SliceError, match="32-bit"):
        block_indices([0], 1 << 20, [1 << 11])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_read_indices_equal_block_indices_side_by_side(data: st.DataObject) -> None:
    nl, nr = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    nreg_local = data.draw(st.integers(1, 5))
    positions = data.draw(st.lists(st.integers(0, nreg_local - 1), min_size=1, max_size=nreg_local, unique=True))
    n = data.draw(st.integers(0, 10))
    bad = data.draw(st.booleans())
    ids = st.integers(-2, 14) if bad else st.integers(0, 11)
    local = data.draw(st.lists(ids, min_size=n, max_size=n))
    remote = data.draw(st.lists(ids, min_size=n, max_size=n))
    try:
        want = (block_indices(local, nl, positions), block_indices(remote, nr, len(positions)))
    except SliceError as exc:
        with pytest.raises(SliceError, match=str(exc).split(" outside")[0]):
            read_indices(tuple(local), tuple(remote), nl, nr, positions)
        return
    li, ri = read_indices(tuple(local), tuple(remote), nl, nr, positions)
    assert li.tolist() == want[0].tolist() and ri.tolist() == want[1].tolist()
    assert li.dtype == ri.dtype == np.int32 and li.flags.c_contiguous and ri.flags.c_contiguous


@settings(max_examples=300, deadline=None)
@given(tables(), st.integers(1, 4), st.booleans(), st.data())
def test_read_descs_equals_coalescing_region_by_region(
    t: tuple[list[int], list[int], Region, Region, int, int, int, int], nreg: int, merge: bool,
    data: st.DataObject,
) -> None:
    local, remote, lreg, rreg, li, ls, ri, rs = t
    # Regions of the same geometry at other bases and devices, some adjacent in memory.
    lregs = [lreg._replace(base=lreg.base + k * data.draw(st.sampled_from([lreg.stride * lreg.num_blocks, 1 << 24])),
                           device=data.draw(st.integers(0, 1))) for k in range(nreg)]
    rregs = [rreg._replace(base=rreg.base + k * rreg.stride * rreg.num_blocks) for k in range(nreg)]
    kw = {"local_slice": li, "local_slices": ls, "remote_slice": ri, "remote_slices": rs}
    dl, dr = read_descs(local, remote, lregs, rregs, merge=merge, **kw)
    parts = [block_descs(local, remote, a, b, **kw) for a, b in zip(lregs, rregs, strict=True)]
    if merge:
        parts = [coalesce(a, b) for a, b in parts]
    want_l = np.concatenate([a for a, _ in parts]) if parts else np.empty((0, 3), dtype=np.uint64)
    want_r = np.concatenate([b for _, b in parts]) if parts else np.empty((0, 3), dtype=np.uint64)
    assert dl.tolist() == want_l.tolist()
    assert dr.tolist() == want_r.tolist()
