"""Descriptor coalescing: turn a block table into as few (address, length, device) runs as possible.

A read moves, for every KV region (a layer's K or V cache, say), each remote block
``remote_blocks[i]`` into local block ``local_blocks[i]``. Described block by block,
that is one descriptor pair per block and region; a transfer engine pays a fixed
cost per descriptor, so a 4 KiB block table of a thousand blocks costs a thousand
descriptors even when both sides are one contiguous range.

:func:`coalesce` merges consecutive pairs that are adjacent on *both* sides (the
local run and the remote run continue exactly where the previous pair ended, on
the same devices) into one pair. That is the only merge that keeps the pairing of
bytes: a run adjacent on one side only, a reversed table, duplicates or a slice of
each block (when TP sizes differ, only ``1/slices`` of each block moves, so block
``b``'s slice and block ``b+1``'s slice are ``stride - length`` bytes apart) stay
separate descriptors. The result is never longer than the per-block list, and a
fully contiguous table becomes one descriptor per region.

Regions are never merged with one another: a transfer engine checks every
descriptor against one registration, and two tensors registered apart may not be
one registration even when they happen to be adjacent in memory.

Everything here is plain integers and NumPy arrays (``uint64``, N x 3, the layout
NIXL's ``get_xfer_descs`` takes), with no I/O, so it is shared by the NIXL and
torch transports and checked by property tests against the per-block expansion.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = [
    "DescArray",
    "Region",
    "SliceError",
    "block_descs",
    "block_indices",
    "coalesce",
    "read_descs",
    "read_indices",
    "slice_span",
]

DescArray = npt.NDArray[np.uint64]
"""N x 3 ``uint64``: one (address, length, device id) row per descriptor."""

Blocks = Sequence[int] | npt.NDArray[np.integer]


class SliceError(ValueError):
    """Block ids out of range, tables of different lengths, or slices that cannot pair up."""


class Region(NamedTuple):
    """One registered KV region: ``num_blocks`` blocks of ``stride`` bytes from ``base``."""

    base: int
    stride: int
    num_blocks: int
    device: int = 0


def slice_span(stride: int, slices: int, index: int) -> tuple[int, int]:
    """(offset, length) of slice ``index`` of ``slices`` equal slices of a ``stride``-byte block."""
    if slices < 1 or not 0 <= index < slices:
        raise SliceError(f"slice {index} of {slices} does not exist")
    if stride % slices:
        raise SliceError(f"a {stride}-byte block cannot be cut into {slices} equal slices")
    length = stride // slices
    return index * length, length


def _ids(blocks: Blocks, num_blocks: int, side: str) -> npt.NDArray[np.int64]:
    if isinstance(blocks, (tuple, list)):
        try:  # one C pass (see block_indices); NumPy's conversion for anything struct refuses
            ids = np.frombuffer(_ints(len(blocks), "q").pack(*blocks), dtype=np.int64)
        except struct.error:
            ids = np.fromiter(blocks, dtype=np.int64, count=len(blocks))
    else:
        ids = np.asarray(blocks, dtype=np.int64).reshape(-1)
    _check_range(ids, num_blocks, side)
    return ids


def _check_range(ids: npt.NDArray[np.signedinteger[Any]], num_blocks: int, side: str) -> None:
    # One reduction checks both bounds: a negative id, seen unsigned, is larger than any count.
    unsigned = np.uint64 if ids.dtype == np.int64 else np.uint32
    if ids.size and int(ids.view(unsigned).max()) >= num_blocks:
        bad = ids[(ids < 0) | (ids >= num_blocks)][0]
        raise SliceError(f"{side} block {int(bad)} outside 0..{num_blocks - 1}")


def block_descs(
    local_blocks: Blocks,
    remote_blocks: Blocks,
    local: Region,
    remote: Region,
    *,
    local_slice: int = 0,
    local_slices: int = 1,
    remote_slice: int = 0,
    remote_slices: int = 1,
) -> tuple[DescArray, DescArray]:
    """The per-block descriptor pairs of one region: row ``i`` moves ``remote_blocks[i]``'s
    slice into ``local_blocks[i]``'s slice. Raises :class:`SliceError` for bad input."""
    lb = _ids(local_blocks, local.num_blocks, "local")
    rb = _ids(remote_blocks, remote.num_blocks, "remote")
    if lb.size != rb.size:
        raise SliceError(f"{lb.size} local blocks for {rb.size} remote blocks")
    loff, llen = slice_span(local.stride, local_slices, local_slice)
    roff, rlen = slice_span(remote.stride, remote_slices, remote_slice)
    if llen != rlen:
        raise SliceError(f"slice sizes differ: local {llen} bytes, remote {rlen} bytes")
    n = lb.size
    out_l = np.empty((n, 3), dtype=np.uint64)
    out_r = np.empty((n, 3), dtype=np.uint64)
    out_l[:, 0] = lb.astype(np.uint64) * np.uint64(local.stride) + np.uint64(local.base + loff)
    out_r[:, 0] = rb.astype(np.uint64) * np.uint64(remote.stride) + np.uint64(remote.base + roff)
    out_l[:, 1] = llen
    out_r[:, 1] = rlen
    out_l[:, 2] = local.device
    out_r[:, 2] = remote.device
    return out_l, out_r


def coalesce(local: DescArray, remote: DescArray) -> tuple[DescArray, DescArray]:
    """Merge consecutive descriptor pairs that are adjacent on both sides.

    Row ``i`` joins the run of row ``i - 1`` when its local address is where row
    ``i - 1``'s local bytes end, its remote address likewise, and both devices are
    unchanged. Pairs must have equal lengths (they do when built by
    :func:`block_descs`). The expansion of the result, byte by byte and in order, is
    exactly the expansion of the input.
    """
    if local.shape != remote.shape or local.ndim != 2 or local.shape[1] != 3:
        raise SliceError(f"descriptor arrays must both be N x 3, got {local.shape} and {remote.shape}")
    n = local.shape[0]
    if n <= 1:
        return local.copy(), remote.copy()
    if not np.array_equal(local[:, 1], remote[:, 1]):
        raise SliceError("paired descriptors must have equal lengths")
    la, ln, ld = local[:, 0], local[:, 1], local[:, 2]
    ra, rd = remote[:, 0], remote[:, 2]
    cont = (
        (la[1:] == la[:-1] + ln[:-1])
        & (ra[1:] == ra[:-1] + ln[:-1])
        & (ld[1:] == ld[:-1])
        & (rd[1:] == rd[:-1])
    )
    if cont.all():
        total = np.uint64(ln.sum())
        return (np.array([[la[0], total, ld[0]]], dtype=np.uint64),
                np.array([[ra[0], total, rd[0]]], dtype=np.uint64))
    if not cont.any():
        return local.copy(), remote.copy()
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.add.reduceat(ln, starts).astype(np.uint64)
    out_l = local[starts].copy()
    out_r = remote[starts].copy()
    out_l[:, 1] = lengths
    out_r[:, 1] = lengths
    return out_l, out_r


def read_descs(
    local_blocks: Blocks,
    remote_blocks: Blocks,
    local_regions: Sequence[Region],
    remote_regions: Sequence[Region],
    *,
    local_slice: int = 0,
    local_slices: int = 1,
    remote_slice: int = 0,
    remote_slices: int = 1,
    merge: bool = True,
) -> tuple[DescArray, DescArray]:
    """Every descriptor of one read, region after region, coalesced within each region.

    ``local_regions[k]`` pairs with ``remote_regions[k]``: the caller passes them paired
    (the transports pair them by layer, :mod:`transports.layers`, and pass the local
    regions of the remote rank's layers). The same result as :func:`block_descs`
    and :func:`coalesce` region by region, computed for all regions at once (a few
    NumPy calls whatever the number of regions).
    """
    nreg = len(local_regions)
    if nreg != len(remote_regions):
        raise SliceError(f"{nreg} local regions for {len(remote_regions)} remote regions")
    if nreg == 0:
        return np.empty((0, 3), dtype=np.uint64), np.empty((0, 3), dtype=np.uint64)
    lb = _ids(local_blocks, min(r.num_blocks for r in local_regions), "local").astype(np.uint64)
    rb = _ids(remote_blocks, min(r.num_blocks for r in remote_regions), "remote").astype(np.uint64)
    if lb.size != rb.size:
        raise SliceError(f"{lb.size} local blocks for {rb.size} remote blocks")
    n = lb.size
    cols: list[list[int]] = [[] for _ in range(7)]  # local base, stride, device, remote ..., slice length
    for lreg, rreg in zip(local_regions, remote_regions, strict=True):
        loff, llen = slice_span(lreg.stride, local_slices, local_slice)
        roff, rlen = slice_span(rreg.stride, remote_slices, remote_slice)
        if llen != rlen:
            raise SliceError(f"slice sizes differ: local {llen} bytes, remote {rlen} bytes")
        for col, v in zip(cols, (lreg.base + loff, lreg.stride, lreg.device, rreg.base + roff, rreg.stride,
                                 rreg.device, llen), strict=True):
            col.append(v)
    lbase, lstride, ldev, rbase, rstride, rdev, length = (np.array(c, dtype=np.uint64).reshape(nreg, 1) for c in cols)
    la = lbase + lb[None, :] * lstride  # (regions, blocks)
    ra = rbase + rb[None, :] * rstride
    if merge and n > 1:
        cont = (la[:, 1:] == la[:, :-1] + length) & (ra[:, 1:] == ra[:, :-1] + length)
        starts = np.flatnonzero(np.concatenate((np.ones((nreg, 1), dtype=bool), ~cont), axis=1).ravel())
    else:
        starts = np.arange(nreg * n)
    region = starts // max(n, 1)
    runs = np.diff(np.append(starts, nreg * n)).astype(np.uint64)  # a run never crosses a region
    nbytes = runs * length[region, 0]
    out_l = np.empty((starts.size, 3), dtype=np.uint64)
    out_r = np.empty((starts.size, 3), dtype=np.uint64)
    out_l[:, 0], out_l[:, 1], out_l[:, 2] = la.ravel()[starts], nbytes, ldev[region, 0]
    out_r[:, 0], out_r[:, 1], out_r[:, 2] = ra.ravel()[starts], nbytes, rdev[region, 0]
    return out_l, out_r


def block_indices(blocks: Blocks, num_blocks: int, regions: int | Sequence[int]) -> npt.NDArray[np.int32]:
    """Indices into a prepared per-block list laid out region-major (entry ``r * num_blocks + b``
    is block ``b`` of region ``r``), so that a transfer engine which merges adjacent prepared
    entries sees the runs.

    ``regions`` is either a count (every region, ``0..regions-1``, in order) or the positions
    of the regions to index, in the order wanted: with layer pairing, a read from a PP rank
    that holds some layers indexes only the local regions of those layers.

    On the read path, once per side of every read: the ids are packed to ``int32`` by a
    cached :class:`struct.Struct` (one C pass over the Python ints: ~7 us for 1024 ids here,
    against ~27 us for ``np.fromiter``), one reduction checks their range, one broadcast add
    lays them out."""
    offsets = _offsets(regions if isinstance(regions, int) else tuple(regions), num_blocks)
    ids: npt.NDArray[np.signedinteger[Any]]
    try:
        if not isinstance(blocks, (tuple, list)):
            raise TypeError
        ids = np.frombuffer(_ints(len(blocks), "i").pack(*blocks), dtype=np.int32)
    except (TypeError, struct.error):  # not a plain list of 32-bit ints: the general path
        ids = _ids(blocks, num_blocks, "table")
    else:
        _check_range(ids, num_blocks, "table")
    ids32 = ids.astype(np.int32, copy=False)  # in range: checked above, and the sums by _offsets
    return ids32 if offsets is None else (offsets + ids32).reshape(-1)


def read_indices(local_blocks: Blocks, remote_blocks: Blocks, local_num_blocks: int, remote_num_blocks: int,
                 local_regions: Sequence[int]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Both sides' prepared-list indices of one read: remote region ``k`` (of
    ``len(local_regions)``, all of the remote rank's, in order) pairs with local region
    ``local_regions[k]``. The same as :func:`block_indices` on each side, in half the NumPy
    calls: both tables are packed in one pass, range-checked in one reduction and laid out in
    one broadcast add. That matters on the read path, which runs right after a large transfer
    has evicted the caches: there, each NumPy call costs tens of microseconds, not a few."""
    n = len(local_blocks)
    if len(remote_blocks) != n:
        raise SliceError(f"{n} local blocks for {len(remote_blocks)} remote blocks")
    positions = tuple(local_regions)
    offsets = _pair_offsets(positions, local_num_blocks, remote_num_blocks)
    if isinstance(local_blocks, (tuple, list)) and isinstance(remote_blocks, (tuple, list)):
        packed = bytearray(8 * n)
        try:  # each table straight from its tuple (no merged argument tuple)
            fmt = _ints(n, "i")
            fmt.pack_into(packed, 0, *local_blocks)
            fmt.pack_into(packed, 4 * n, *remote_blocks)
        except struct.error:
            pass
        else:
            # Two views of one buffer, (side, 1, block): unsigned for the range check (a negative
            # id is huge unsigned), signed for the layout. As few NumPy calls as it takes.
            top = np.ndarray((2, 1, n), np.uint32, packed).max(axis=2) if n else None
            if top is None or (int(top[0, 0]) < local_num_blocks and int(top[1, 0]) < remote_num_blocks):
                out = (offsets + np.ndarray((2, 1, n), np.int32, packed)).reshape(2, -1)  # (side, region-major)
                return out[0], out[1]
    # Anything else, or an id out of range: side by side, for the general path and its errors.
    return (block_indices(local_blocks, local_num_blocks, positions),
            block_indices(remote_blocks, remote_num_blocks, len(positions)))


@lru_cache(maxsize=256)
def _pair_offsets(positions: tuple[int, ...], local_num_blocks: int, remote_num_blocks: int) -> npt.NDArray[np.int32]:
    local = _offsets(positions, local_num_blocks)
    remote = _offsets(len(positions), remote_num_blocks)
    out = np.zeros((2, len(positions), 1), dtype=np.int32)
    if local is not None:
        out[0] = local
    if remote is not None:
        out[1] = remote
    out.setflags(write=False)
    return out


@lru_cache(maxsize=128)
def _ints(n: int, code: str) -> struct.Struct:
    """Packs ``n`` Python ints as native ``int32`` (``"i"``) or ``int64`` (``"q"``)."""
    return struct.Struct(f"={n}{code}")


@lru_cache(maxsize=256)
def _offsets(regions: int | tuple[int, ...], num_blocks: int) -> npt.NDArray[np.int32] | None:
    positions = tuple(range(regions)) if isinstance(regions, int) else regions
    if not positions:
        raise SliceError("no region to index")
    if min(positions) < 0 or (max(positions) + 1) * num_blocks >= 1 << 31:
        raise SliceError(f"regions {min(positions)}..{max(positions)} x {num_blocks} blocks do not fit "
                         "32-bit prepared indices")
    if positions == (0,):
        return None
    offsets = np.array(positions, dtype=np.int32)[:, None] * np.int32(num_blocks)
    offsets.setflags(write=False)
    return offsets
