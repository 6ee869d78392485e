"""Every byte of every decode KV block, end to end through Connectors.

What tests/test_topology_bytes.py does not cover, checked the same way (a pattern that encodes
(layer, K/V, head, remote block, token, dim) in every int32 of every producer block; every decode
block compared with the reference, blocks outside the request must keep their own sentinel):

- producer PP 4 into consumer PP 1, and layers split unevenly over the stages (5 layers over 2
  stages, 7 over 4), on both sides when the PP sizes are equal (docs/transports.md, "Layer pairing
  and pipeline parallelism": each producer PP rank holds a contiguous range of layers; regions are
  paired by layer id, not by position);
- partial local prefix hits: fewer local blocks than remote ones, the prompt's last blocks here
  (``computed_blocks``: Connector.load's docstring, docs/embedding.md);
- different block counts on each side (a consumer with fewer blocks than the producer and more);
- repeated remote block ids in the producer's table;
- many layers (K and V as separate regions, ``2*layer + kv``, as docs/transports.md says to
  number them), registered on the decode side in another order than the producer's;
- a few of the same over real NIXL in this process (both ``xfer_mode`` s).

Each producer rank must release exactly once, by the full notification count
(``expected_notifications``), never by expiry, and hear parts 0..of-1 once each.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pytest
import torch

from pdfsm.connector import Connector, ConnectorMetadata, KVTransferParams, StepOutput
from pdfsm.events import CoreConfig, HandshakeReply, NotificationReceived
from pdfsm.topology import expected_notifications
from transports.sim import SimHandshaker, SimNetwork
from transports.torch import TorchNetwork, TorchTransport

try:
    from transports.nixl import NixlTransport, nixl_available
except ImportError:  # pragma: no cover
    NixlTransport = None  # type: ignore[assignment,misc]

    def nixl_available() -> bool:
        return False

if nixl_available():
    logging.getLogger("nixl").setLevel(logging.WARNING)

Key = tuple[int, int]
HEADS, TOK, DIM, LAT = 4, 4, 2, 4
LEASE, MARGIN, STEP_NS = 10_000_000_000, 1_000_000_000, 100_000
RID, PRID = "dec-req", "pre-req"
PAUSE = 0.0002
_names = itertools.count()


def split(layers: int, sizes: tuple[int, ...]) -> list[range]:
    """Contiguous layer ranges of the given sizes."""
    assert sum(sizes) == layers
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class Case:
    p_tp: int
    d_tp: int
    mla: bool
    p_split: tuple[int, ...]  # layers per producer PP stage
    d_split: tuple[int, ...]  # layers per consumer PP stage
    remote: tuple[int, ...]
    local: tuple[int, ...]
    p_blocks: int = 12
    d_blocks: int = 10
    kind: str = "torch"
    xfer_mode: Literal["prepped", "descs"] = "prepped"
    name: str = ""

    @property
    def layers(self) -> int:
        return sum(self.p_split)

    @property
    def kvs(self) -> tuple[int, ...]:
        return (0,) if self.mla else (0, 1)

    @property
    def width(self) -> int:
        return LAT if self.mla else DIM

    def heads(self, tp: int, tp_size: int) -> range:
        if self.mla:
            return range(1)
        n = HEADS // tp_size
        return range(tp * n, (tp + 1) * n)

    def region_id(self, layer: int, kv: int) -> int:
        return layer if self.mla else 2 * layer + kv

    def value(self, layer: int, kv: int, heads: range, block: int) -> np.ndarray:
        """One producer block of one region: every int32 encodes (layer, kv, head, block, token, dim)."""
        h = np.array(heads)[:, None, None]
        t = np.arange(TOK)[None, :, None]
        d = np.arange(self.width)[None, None, :]
        v = 1 + d + self.width * (t + TOK * (block + 64 * (h + HEADS * (kv + 2 * layer))))
        v = v.astype(np.int32)
        out: np.ndarray = v[0] if self.mla else v
        return out

    def effective_remote(self) -> tuple[int, ...]:
        """Connector.load: a shorter local table reads the LAST remote blocks."""
        return self.remote[len(self.remote) - len(self.local):]

    def __str__(self) -> str:
        return self.name or (f"{self.kind}-{self.xfer_mode}-P{self.p_tp}x{self.p_split}-D{self.d_tp}x{self.d_split}"
                             f"-{'mla' if self.mla else 'mha'}")


def sentinel(q: int, d: int, region: int, block: int) -> int:
    return -(1 + block + 1000 * (region + 1000 * (d + 10 * q)))


class World:
    def __init__(self, case: Case) -> None:
        self.c = c = case
        self.now = 1_000_000_000
        self.net, self.tnet = SimNetwork(), TorchNetwork()
        self.p_layers = split(c.layers, c.p_split)
        self.d_layers = split(c.layers, c.d_split)
        self.p: dict[Key, Connector] = {}
        self.d: dict[Key, Connector] = {}
        self.d_regions: dict[Key, dict[int, torch.Tensor]] = {}
        self.p_regions: dict[Key, dict[int, torch.Tensor]] = {}
        self.outputs: dict[tuple[str, Key], list[StepOutput]] = {}
        self.transports: list[Any] = []
        for pp, tp in itertools.product(range(len(c.p_split)), range(c.p_tp)):
            self.p[(pp, tp)] = self._rank("P", pp, tp)
        self.net.serve("p-host", 5, self._reply)
        for q, d in itertools.product(range(len(c.d_split)), range(c.d_tp)):
            self.d[(q, d)] = self._rank("D", q, d)

    def clock(self) -> int:
        return self.now

    def _reply(self, pp: int) -> HandshakeReply:
        c = self.c
        return HandshakeReply(engine_id="P", compat_hash="m", tp_size=c.p_tp, pp_size=len(c.p_split), block_size=TOK,
                              num_blocks=c.p_blocks, mla=c.mla,
                              ranks=tuple(self.p[(pp, tp)].transport.rank_info() for tp in range(c.p_tp)))

    def _rank(self, side: str, pp: int, tp: int) -> Any:
        c = self.c
        if side == "P":
            layers, heads, n = self.p_layers[pp], c.heads(tp, c.p_tp), c.p_blocks
            regions = {}
            for x in layers:
                for kv in c.kvs:
                    arr = np.stack([c.value(x, kv, heads, b) for b in range(n)])
                    regions[c.region_id(x, kv)] = torch.from_numpy(arr)
            ids = list(regions)
            self.p_regions[(pp, tp)] = regions
        else:
            layers, heads, n = self.d_layers[pp], c.heads(tp, c.d_tp), c.d_blocks
            regions = {}
            for x in layers:
                for kv in c.kvs:
                    rid = c.region_id(x, kv)
                    shape = c.value(x, kv, heads, 0).shape
                    arr = np.stack([np.full(shape, sentinel(pp, tp, rid, b), dtype=np.int32) for b in range(n)])
                    regions[rid] = torch.from_numpy(arr)
            ids = list(reversed(regions))  # registered in another order: pairing is by layer id
            self.d_regions[(pp, tp)] = regions
        tensors = [regions[x] for x in ids]
        name = f"{side}{pp}.{tp}-{os.getpid()}-{next(_names)}"
        transport: TorchTransport | NixlTransport
        if c.kind == "torch":
            transport = TorchTransport(self.tnet, name, tensors, layers=ids, pp_rank=pp, tp_rank=tp)
        else:
            transport = NixlTransport(name, tensors, layers=ids, pp_rank=pp, tp_rank=tp, xfer_mode=c.xfer_mode)
        self.transports.append(transport)
        tp_size, pp_size = (c.p_tp, len(c.p_split)) if side == "P" else (c.d_tp, len(c.d_split))
        cfg = CoreConfig(engine_id=side, tp_rank=tp, tp_size=tp_size, pp_rank=pp, pp_size=pp_size, mla=c.mla,
                         compat_hash="m", block_size=TOK, strict=True, lease_ns=LEASE, lease_margin_ns=MARGIN,
                         read_timeout_ns=6 * LEASE)
        conn = Connector(cfg, transport, SimHandshaker(self.net), clock=self.clock, host=f"{side.lower()}-host",
                         port=5)
        self.outputs[(side, (pp, tp))] = []
        return conn

    # --- driving -----------------------------------------------------------------------------------

    def step(self, side: str, k: Key, meta: ConnectorMetadata | None = None) -> StepOutput:
        conn = (self.p if side == "P" else self.d)[k]
        conn.start_load_kv(meta if meta is not None else ConnectorMetadata())
        conn.get_finished()
        self.outputs[(side, k)].append(conn.last)
        return conn.last

    def count(self, side: str, k: Key, fld: str, rid: str) -> int:
        return sum(rid in getattr(o, fld) for o in self.outputs[(side, k)])

    def run(self, local: tuple[int, ...] | None = None) -> None:
        c = self.c
        self.transfer([(RID, PRID, tuple(c.remote), c.local if local is None else local)])
        for _ in range(2):  # nothing more comes
            self.steps()

    def transfer(self, reqs: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]) -> None:
        """Hold each (decode id, prefill id, remote table, local table) on every prefill rank, load
        them all on every decode rank in one scheduler step, and step until every rank reported
        every one."""
        recv = {}
        for did, pid, remote, local in reqs:
            got = {k: conn.request_finished(pid, list(remote)) for k, conn in self.p.items()}
            recv[did] = (local, KVTransferParams.parse(got[(0, 0)].to_dict()))
        tails = {did: len(remote) - len(local) for did, _, remote, local in reqs}  # the prompt's last blocks
        meta = ConnectorMetadata(reqs_to_recv=recv, lease_ages=dict.fromkeys(recv, 0), computed_blocks=tails)
        pids = [pid for _, pid, _, _ in reqs]
        first, deadline = True, time.monotonic() + 15
        while True:
            self.steps(meta if first else None)
            first = False
            if (all(self.count("D", k, "finished_recving", did) for k in self.d for did in recv)
                    and all(self.count("P", k, "finished_sending", pid) for k in self.p for pid in pids)):
                return
            assert time.monotonic() < deadline, self.status()
            time.sleep(PAUSE)

    def steps(self, meta: ConnectorMetadata | None = None) -> None:
        """One scheduler step on every decode rank (``meta`` to each), then on every prefill rank."""
        for k in self.d:
            self.step("D", k, meta)
        for k in self.p:
            self.step("P", k)
        self.now += STEP_NS

    def status(self) -> str:
        lines = []
        for (side, k), outs in self.outputs.items():
            fails = [f for o in outs for f in o.failed]
            lines.append(f"{side}{k}: recv={self.count(side, k, 'finished_recving', RID)} "
                         f"send={self.count(side, k, 'finished_sending', PRID)} failed={fails}")
        return "timed out:\n" + "\n".join(lines)

    # --- checks ------------------------------------------------------------------------------------

    def assert_clean_reports(self) -> None:
        for k in self.d:
            assert self.count("D", k, "finished_recving", RID) == 1, (k, self.status())
            outs = self.outputs[("D", k)]
            fails = [f for o in outs for f in o.failed]
            assert not fails, (k, fails)
            assert not any(o.invalid_block_ids for o in outs), k
        for k in self.p:
            assert self.count("P", k, "finished_sending", PRID) == 1, (k, self.status())
            assert self.count("P", k, "expired", PRID) == 0, k

    def assert_notifications(self) -> None:
        c = self.c
        of = expected_notifications(c.p_tp, c.d_tp)
        for k, conn in self.p.items():
            notes = [rec.event for rec in conn.core.log.records()
                     if isinstance(rec.event, NotificationReceived) and rec.event.request_id == PRID]
            assert sorted(n.part for n in notes) == list(range(of)), (k, notes)

    def expected(self, k: Key, local: tuple[int, ...], remote: tuple[int, ...]) -> dict[int, np.ndarray]:
        c = self.c
        q, d = k
        heads = c.heads(d, c.d_tp)
        out = {}
        for x in self.d_layers[q]:
            for kv in c.kvs:
                rid = c.region_id(x, kv)
                shape = c.value(x, kv, heads, 0).shape
                arr = np.stack([np.full(shape, sentinel(q, d, rid, b), dtype=np.int32) for b in range(c.d_blocks)])
                for lb, rb in zip(local, remote, strict=True):
                    arr[lb] = c.value(x, kv, heads, rb)
                out[rid] = arr
        return out

    def assert_bytes(self, local: tuple[int, ...] | None = None, remote: tuple[int, ...] | None = None) -> None:
        c = self.c
        local = c.local if local is None else local
        remote = c.effective_remote() if remote is None else remote
        problems = []
        for k in self.d:
            want = self.expected(k, local, remote)
            got = {x: t.numpy() for x, t in self.d_regions[k].items()}
            assert got.keys() == want.keys()
            for x in want:
                bad = sorted({int(b) for b in np.argwhere(got[x] != want[x])[:, 0]})
                if bad:
                    problems.append(f"decode rank {k} region {x}: blocks {bad} differ "
                                    f"(e.g. block {bad[0]}: got {got[x][bad[0]].ravel()[:6]}, "
                                    f"want {want[x][bad[0]].ravel()[:6]})")
        assert not problems, "\n".join(problems[:12])

    def close(self) -> None:
        for conns in (self.p, self.d):
            for conn in conns.values():
                with contextlib.suppress(Exception):
                    conn.shutdown()
        for t in self.transports:
            if isinstance(t, TorchTransport):
                t.close()


@pytest.fixture
def worlds() -> Any:
    made: list[World] = []
    yield made
    for w in made:
        w.close()


def full(case: Case, worlds: list[World]) -> World:
    w = World(case)
    worlds.append(w)
    w.run()
    w.assert_clean_reports()
    w.assert_bytes()
    w.assert_notifications()
    return w


SHUF_R, SHUF_L = (7, 2, 5, 3, 11), (4, 9, 0, 6, 1)

# --- PP splits, uneven splits, many layers ----------------------------------------------------------

_PP_TOPOS = ((1, 1, False), (4, 1, False), (1, 4, False), (2, 4, True), (4, 2, True))
PP_CASES = [  # each split with two TP/MLA layouts, rotating
    Case(*_PP_TOPOS[(i + j) % len(_PP_TOPOS)], ps, ds, SHUF_R, SHUF_L)
    for i, (ps, ds) in enumerate((((1, 1, 1, 1), (4,)), ((3, 2), (5,)), ((2, 3), (2, 3)), ((1, 3, 2, 1), (7,)),
                                  ((2, 1, 1, 3), (2, 1, 1, 3))))
    for j in (0, 2)
]


@pytest.mark.parametrize("case", PP_CASES, ids=str)
def test_pp_splits_move_every_layer_into_the_right_region(case: Case, worlds: list[World]) -> None:
    full(case, worlds)


# --- tables: partial prefix hits, block counts, repeats ------------------------------------------

TABLE_SHAPES = {
    # name: (remote, local, p_blocks, d_blocks)
    "prefix-hit-2of5": ((7, 2, 5, 3, 11), (4, 9), 12, 10),
    "prefix-hit-1of4-contig": ((3, 4, 5, 6), (8,), 12, 10),
    "contig-both": ((3, 4, 5, 6), (5, 6, 7, 8), 12, 10),
    "d-fewer-blocks": ((30, 31, 2, 39), (0, 3, 2, 1), 40, 4),
    "d-more-blocks": ((1, 0, 2), (60, 33, 61), 3, 64),
    "repeated-remote": ((5, 5, 2, 5), (0, 1, 2, 3), 12, 10),
    "repeated-remote-prefix": ((1, 2, 2, 2, 9), (7, 8, 6), 12, 10),
}
TOPOS = ((1, 1, False, (2,), (2,)), (2, 1, False, (1, 1), (2,)), (1, 2, False, (1, 1), (1, 1)),
         (4, 2, False, (2,), (2,)), (2, 4, True, (1, 1), (2,)), (4, 1, True, (2,), (2,)))
TABLE_CASES = [
    Case(p_tp, d_tp, mla, ps, ds, r, lo, pb, db,
         name=f"{n}-P{p_tp}x{len(ps)}-D{d_tp}x{len(ds)}-{'mla' if mla else 'mha'}")
    for i, (n, (r, lo, pb, db)) in enumerate(TABLE_SHAPES.items())
    for j, (p_tp, d_tp, mla, ps, ds) in enumerate(TOPOS)
    if (i + j) % 3 == 0
]


@pytest.mark.parametrize("case", TABLE_CASES, ids=str)
def test_tables_move_the_right_blocks_and_nothing_else(case: Case, worlds: list[World]) -> None:
    full(case, worlds)


def test_many_layers_pp4_into_pp1_tp4_into_tp1(worlds: list[World]) -> None:
    """40 layers as 80 K/V regions over 4 uneven stages, shuffled table, partial prefix hit."""
    full(Case(4, 1, False, (13, 7, 11, 9), (40,), (9, 1, 4, 12, 3, 0, 8), (2, 7, 5, 0, 3), 16, 8), worlds)


# --- over real NIXL in this process ------------------------------------------------------------------

NIXL_CASES = [
    Case(p_tp, d_tp, mla, ps, ds, r, lo, pb, db, kind="nixl", xfer_mode=mode,
         name=f"nixl-{mode}-{n}-P{p_tp}x{ps}-D{d_tp}x{ds}-{'mla' if mla else 'mha'}")
    for mode in ("prepped", "descs")
    for (n, p_tp, d_tp, mla, ps, ds, r, lo, pb, db) in (
        ("pp-uneven-prefix-dfewer", 2, 1, False, (3, 2), (5,), (30, 31, 2, 39, 7), (0, 3, 2), 40, 4),
        ("pp-uneven-equal-dmore", 1, 2, False, (2, 3), (2, 3), (1, 0, 2, 2), (60, 33, 61, 5), 3, 64),
        ("mla-pp3-prefix", 2, 1, True, (1, 1, 2), (4,), SHUF_R, SHUF_L[:3], 12, 10),
    )
]


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
@pytest.mark.parametrize("case", NIXL_CASES, ids=str)
def test_nixl_layouts_move_the_right_bytes(case: Case, worlds: list[World]) -> None:
    full(case, worlds)


# --- several requests through one pair of engines ---------------------------------------------------


def run_requests(w: World, reqs: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]],
                 batches: list[list[int]]) -> None:
    """``reqs``: (decode id, prefill id, remote table, local table). Each batch of request indices
    is held on every prefill rank, then loaded on every decode rank in one scheduler step, and
    driven until every rank reported every request of the batch once."""
    for batch in batches:
        w.transfer([reqs[i] for i in batch])
    for _ in range(2):
        w.steps()
    for did, pid, _, _ in reqs:
        for k in w.d:
            assert w.count("D", k, "finished_recving", did) == 1, (k, did)
        for k in w.p:
            assert w.count("P", k, "finished_sending", pid) == 1, (k, pid)
            assert w.count("P", k, "expired", pid) == 0, (k, pid)
    for (side, k), outs in w.outputs.items():
        assert not [f for o in outs for f in o.failed], (side, k)
        assert not any(o.invalid_block_ids for o in outs), (side, k)


_KINDS: tuple[tuple[str, Literal["prepped", "descs"]], ...] = (("torch", "prepped"), ("nixl", "prepped"),
                                                               ("nixl", "descs"))
MULTI = [
    Case(p_tp, d_tp, mla, ps, ds, (), (), 24, 24, kind=kind, xfer_mode=mode,
         name=f"{kind}-{mode}-P{p_tp}x{ps}-D{d_tp}x{ds}-{'mla' if mla else 'mha'}")
    for (kind, mode) in _KINDS
    for (p_tp, d_tp, mla, ps, ds) in ((1, 2, False, (2, 1), (3,)), (4, 2, False, (1, 2), (1, 2)),
                                      (2, 1, True, (2, 1), (3,)))
    if kind == "torch" or nixl_available()
]


@pytest.mark.parametrize("case", MULTI, ids=str)
def test_several_requests_sharing_producer_blocks(case: Case, worlds: list[World]) -> None:
    """Requests whose producer tables share blocks (a prefix cached on the producer), loaded first
    one at a time (the first handshakes, the next take the connected path) then two at once, some
    with a partial local prefix hit: every request's blocks hold its bytes, the rest untouched."""
    w = World(case)
    worlds.append(w)
    reqs = [
        ("d0", "p0", (3, 4, 5, 6), (10, 11, 12, 13)),
        ("d1", "p1", (3, 4, 5, 9, 17), (0, 20)),          # prefix hit: its last two remote blocks
        ("d2", "p2", (3, 4, 23, 1), (5, 2, 7, 1)),
        ("d3", "p3", (6, 5, 4, 3, 2, 1), (22, 21, 9)),    # prefix hit, reversed table
    ]
    run_requests(w, reqs, [[0], [1], [2, 3]])
    local = tuple(b for r in reqs for b in r[3])
    remote = tuple(b for r in reqs for b in r[2][len(r[2]) - len(r[3]):])
    w.assert_bytes(local, remote)


# --- a full local prefix hit: notify-only -------------------------------------------------------------

NOTIFY_ONLY = [
    Case(p_tp, d_tp, mla, ps, ds, SHUF_R, (), name=f"notify-only-P{p_tp}x{ps}-D{d_tp}x{ds}-{'mla' if mla else 'mha'}")
    for (p_tp, d_tp, mla, ps, ds) in ((1, 4, False, (1, 1), (2,)), (4, 1, False, (1, 1, 1, 1), (4,)),
                                      (4, 2, True, (2, 1), (2, 1)), (2, 4, True, (1, 2), (3,)),
                                      (2, 2, False, (3, 2), (3, 2)))
]


@pytest.mark.parametrize("case", NOTIFY_ONLY, ids=str)
def test_notify_only_releases_every_producer_rank_once_and_writes_nothing(case: Case, worlds: list[World]) -> None:
    """docs/embedding.md: with ``num_external_tokens == 0`` pass no local blocks: the request becomes
    notify-only; the producer must still release every rank (exactly once, not by expiry); the
    request is not reported as received; no decode byte changes."""
    w = World(case)
    worlds.append(w)
    got = {k: conn.request_finished(PRID, list(case.remote)) for k, conn in w.p.items()}
    params = KVTransferParams.parse(got[(0, 0)].to_dict())
    meta = ConnectorMetadata(reqs_to_recv={RID: ((), params)}, lease_ages={RID: 0})
    first, deadline = True, time.monotonic() + 10
    while not all(w.count("P", k, "finished_sending", PRID) for k in w.p):
        for k in w.d:
            w.step("D", k, meta if first else None)
        first = False
        for k in w.p:
            w.step("P", k)
        w.now += STEP_NS
        assert time.monotonic() < deadline, w.status()
        time.sleep(PAUSE)
    for _ in range(3):
        for k in w.d:
            w.step("D", k)
        for k in w.p:
            w.step("P", k)
    for k in w.p:
        assert w.count("P", k, "finished_sending", PRID) == 1, k
        assert w.count("P", k, "expired", PRID) == 0, k
    for k in w.d:
        assert w.count("D", k, "finished_recving", RID) == 0, k
    w.assert_bytes((), ())
    w.assert_notifications()
