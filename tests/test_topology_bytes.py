"""End-to-end byte checks of heterogeneous topologies through the Connector (review).

Prefill TP 1/2/4 x decode TP 1/2/4, MLA on and off, producer PP 2 read by a consumer with PP 1
and with PP 2, models with fewer KV heads than a TP (1 or 2: ranks hold copies of a head),
block sizes 1, 4 and 16 tokens, non-contiguous block tables; over the torch
transport (one region per layer and K/V, HND: ``[blocks, heads, tokens, dim]``, heads outermost;
MLA: one replicated latent region per layer) and the sim transport (one region per rank: a block
is ``[heads, layers, K/V, tokens, dim]``, heads still outermost, so a TP slice is a head range).

The producer's KV holds a pattern of (layer, K/V, head, token, dim); blocks outside the table
hold other values and the consumer's blocks start as a sentinel. Each side is driven like a
scheduler drives its workers (``request_finished`` on every prefill rank, then
``start_load_kv`` / ``get_finished`` / ``get_block_ids_with_load_errors`` each step on every
decode rank), decode ranks one at a time so each producer rank can be checked to release only
once every consumer rank that owes it a notification has given it.

Then one fault per run on the last decode rank's last read: the transfer ends ERR, the decode side
aborts while the read is in flight, or the read hangs until the producer's lease runs out.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pdfsm.commands import PostRead
from pdfsm.connector import Connector, ConnectorMetadata, KVTransferParams, StepOutput
from pdfsm.consumer import S as ConsumerS
from pdfsm.events import CoreConfig, HandleFailure, HandshakeReply, NotificationReceived
from pdfsm.fsm import Fault
from pdfsm.topology import Layout, ReadPlan, expected_notifications, heads_held, read_plan
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport
from transports.torch import TorchNetwork, TorchTransport

Arr = npt.NDArray[np.int32]
Key = tuple[int, int]  # (pp_rank, tp_rank)

H, LAYERS, DIM, LAT, TMAX = 4, 2, 2, 4, 1024  # KV heads, layers, head dim, MLA latent width, token bound
P_BLOCKS, D_BLOCKS = 12, 10
SENTINEL = -7
LEASE, MARGIN, STEP_NS = 10_000_000_000, 1_000_000_000, 100_000
RID, PRID = "dec-req", "pre-req"  # the consumer's local id differs from the producer's
TABLES = (((7, 2, 5, 3), (4, 9, 0, 6)), ((1, 2, 3, 10, 11), (8, 7, 6, 5, 1)))  # (remote, local)
PAUSE = 0.0005  # between steps over the torch transport: its reads run on worker threads
TPS = (1, 2, 4)
Kind = Literal["torch", "sim"]
KINDS: tuple[Kind, ...] = ("torch", "sim")


def values(layer: int, kv: int, head: Any, token: Any, dim: Any, width: int) -> Arr:
    """The pattern: distinct for every (layer, K/V, head, token, dim)."""
    return np.asarray(1 + dim + width * (token + TMAX * (head + H * (kv + 2 * layer))), dtype=np.int32)


def table_array(n: int, table: tuple[int, ...], block: Callable[[int], Arr], other: Callable[[int], int]) -> Arr:
    """``n`` blocks: ``table[i]`` holds ``block(i)``, every other block ``b`` the value ``other(b)``."""
    first = block(0)
    arr = np.empty((n, *first.shape), dtype=np.int32)
    for b in range(n):
        arr[b] = other(b)
    for i, b in enumerate(table):
        arr[b] = block(i)
    return arr


@dataclass(frozen=True)
class Topo:
    kind: Kind
    p_tp: int
    d_tp: int
    mla: bool
    p_pp: int
    d_pp: int
    block_size: int = 4
    table: int = 0
    kv: int = 0  # the model's KV heads, said to both engines (0: not said; H heads, no TP above them)

    @property
    def remote(self) -> tuple[int, ...]:
        return TABLES[self.table][0]

    @property
    def local(self) -> tuple[int, ...]:
        return TABLES[self.table][1]

    @property
    def width(self) -> int:
        return LAT if self.mla else DIM

    @property
    def kvs(self) -> tuple[int, ...]:
        return (0,) if self.mla else (0, 1)

    @staticmethod
    def layers(pp: int, pp_size: int) -> range:
        n = LAYERS // pp_size
        return range(pp * n, (pp + 1) * n)

    def heads(self, tp: int, tp_size: int) -> range:
        if self.mla:
            return range(1)  # the latent is replicated on every rank
        return heads_held(tp_size, tp, self.kv or H)

    def region_id(self, layer: int, kv: int) -> int:
        return layer if self.mla else 2 * layer + kv

    def region_block(self, layer: int, kv: int, heads: range, i: int) -> Arr:
        """One block of one torch region (HND ``[heads, tokens, dim]``; MLA ``[tokens, latent]``),
        holding request tokens ``i*block_size ..``."""
        tok = i * self.block_size + np.arange(self.block_size)
        dim = np.arange(self.width)
        if self.mla:
            return values(layer, 0, 0, tok[:, None], dim[None, :], self.width)
        return values(layer, kv, np.array(heads)[:, None, None], tok[None, :, None], dim[None, None, :], self.width)

    def sim_block(self, layers: range, heads: range, i: int) -> Arr:
        """One block of a sim rank: ``[heads, layers, K/V, tokens, dim]`` (MLA ``[layers, tokens, latent]``)."""
        if self.mla:
            return np.stack([self.region_block(x, 0, heads, i) for x in layers])
        return np.stack([np.stack([self.region_block(x, kv, heads, i) for kv in self.kvs], axis=1)
                         for x in layers], axis=1)

    def plan(self, q: int, d: int) -> ReadPlan:
        return read_plan(Layout(self.d_tp, self.d_pp, d, q), Layout(self.p_tp, self.p_pp), self.mla, self.kv)

    def notifiers(self, pp: int, tp: int) -> set[Key]:
        """The consumer ranks that owe producer rank (pp, tp) a notification."""
        out = set()
        for q, d in itertools.product(range(self.d_pp), range(self.d_tp)):
            plan = self.plan(q, d)
            if (pp, tp) in {(s.pp_rank, s.tp_rank) for s in plan.sources} | set(plan.notify_only):
                out.add((q, d))
        return out

    def __str__(self) -> str:
        return (f"{self.kind}-P{self.p_tp}x{self.p_pp}-D{self.d_tp}x{self.d_pp}-{'mla' if self.mla else 'mha'}"
                f"-bs{self.block_size}-t{self.table}{f'-kv{self.kv}' if self.kv else ''}")


# --- fault injection (test side only) ------------------------------------------------------------


class FaultySim(SimTransport):
    """A sim transport whose read ``fault_key`` (request, pp, tp) ends ERR or hangs until cancelled."""

    fault_key: tuple[str, int, int] | None = None
    mode = "err"

    def post_read(self, cmd: PostRead) -> None:
        src = cmd.source
        if (cmd.request_id, src.pp_rank, src.tp_rank) == self.fault_key:
            self.network.script(cmd.request_id, src.pp_rank, src.tp_rank,
                                ReadScript(end="err" if self.mode == "err" else "hang"))
        super().post_read(cmd)


class FaultyTorch(TorchTransport):
    """A torch transport whose read ``fault_key`` ends ERR before copying, or hangs: it stops only
    once cancelled and once ``gate`` is open (until then it may still write, as a real READ may)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.fault_key: tuple[str, int, int] | None = None
        self.mode = "err"
        self.gate = threading.Event()
        self.gate.set()
        self.stuck = threading.Event()

    def _copy(self, read: Any) -> tuple[HandleFailure | None, str]:
        src = read.cmd.source
        if (read.cmd.request_id, src.pp_rank, src.tp_rank) != self.fault_key:
            return super()._copy(read)
        if self.mode == "err":
            return HandleFailure.ERR, "injected: the transfer reported ERR"
        self.stuck.set()
        read.cancel.wait(30)
        self.gate.wait(30)
        return HandleFailure.CANCELLED, "injected hang: stopped after the cancel"


# --- the world ------------------------------------------------------------------------------------


class Rank:
    """One worker and everything its Connector reported, step by step."""

    def __init__(self, key: Key, conn: Connector, transport: Any) -> None:
        self.key, self.conn, self.transport = key, conn, transport
        self.outputs: list[StepOutput] = []

    def step(self, meta: ConnectorMetadata | None = None) -> StepOutput:
        self.conn.start_load_kv(meta if meta is not None else ConnectorMetadata())
        sending, recving = self.conn.get_finished()
        invalid = self.conn.get_block_ids_with_load_errors()  # the same step's failures
        last = self.conn.last
        assert sending == last.finished_sending and recving == last.finished_recving
        assert invalid == last.invalid_block_ids
        self.outputs.append(last)
        return last

    def count(self, field: str, rid: str) -> int:
        return sum(rid in getattr(o, field) for o in self.outputs)

    def report(self, rid: str) -> StepOutput:
        (out,) = [o for o in self.outputs if rid in o.finished_recving]
        return out

    def notes(self) -> list[NotificationReceived]:
        return [rec.event for rec in self.conn.core.log.records()
                if isinstance(rec.event, NotificationReceived) and rec.event.request_id == PRID]


class World:
    """A prefill engine (P) and a decode engine (D), every rank a Connector, on one fake clock."""

    def __init__(self, topo: Topo, *, p_strict: bool = True) -> None:
        self.topo = t = topo
        self.now = 1_000_000_000
        self.net, self.tnet = SimNetwork(), TorchNetwork()
        self.p: dict[Key, Rank] = {}
        self.d: dict[Key, Rank] = {}
        self.d_regions: dict[Key, dict[int, torch.Tensor]] = {}
        self.params: KVTransferParams | None = None
        self.held_at = self.arrived = 0
        for pp, tp in itertools.product(range(t.p_pp), range(t.p_tp)):
            self.p[(pp, tp)] = self._rank("P", pp, tp, p_strict)
        self.net.serve("p-host", 5, self._reply)
        for q, d in itertools.product(range(t.d_pp), range(t.d_tp)):
            self.d[(q, d)] = self._rank("D", q, d, True)

    def clock(self) -> int:
        return self.now

    def _reply(self, pp: int) -> HandshakeReply:
        t = self.topo
        return HandshakeReply(engine_id="P", compat_hash="m", tp_size=t.p_tp, pp_size=t.p_pp, block_size=t.block_size,
                              num_blocks=P_BLOCKS, mla=t.mla, kv_heads=t.kv,
                              ranks=tuple(self.p[(pp, tp)].transport.rank_info() for tp in range(t.p_tp)))

    def _transport(self, side: str, pp: int, tp: int) -> Any:
        t = self.topo
        name = f"{side}{pp}.{tp}"
        if side == "P":
            layers, heads, n, table = t.layers(pp, t.p_pp), t.heads(tp, t.p_tp), P_BLOCKS, t.remote

            def other(b: int) -> int:
                return -(1000 + 37 * b + 5 * (pp * t.p_tp + tp))
        else:
            layers, heads, n, table = t.layers(pp, t.d_pp), t.heads(tp, t.d_tp), D_BLOCKS, ()

            def other(b: int) -> int:
                return SENTINEL
        if t.kind == "sim":
            arr = table_array(n, table, lambda i: t.sim_block(layers, heads, i), other)
            cls = SimTransport if side == "P" else FaultySim
            sim = cls(self.net, name, pp_rank=pp, tp_rank=tp, num_blocks=n, block_bytes=arr[0].nbytes)
            sim.memory[:] = arr.tobytes()
            return sim
        regions = {t.region_id(x, kv): torch.from_numpy(table_array(
            n, table, lambda i, x=x, kv=kv: t.region_block(x, kv, heads, i), other))  # type: ignore[misc]
            for x in layers for kv in t.kvs}
        if side == "P":
            return TorchTransport(self.tnet, name, list(regions.values()), layers=list(regions), pp_rank=pp,
                                  tp_rank=tp)
        self.d_regions[(pp, tp)] = regions
        ids = list(reversed(regions))  # registered in another order than the producer's: paired by layer id
        return FaultyTorch(self.tnet, name, [regions[x] for x in ids], layers=ids, pp_rank=pp, tp_rank=tp)

    def _rank(self, side: str, pp: int, tp: int, strict: bool) -> Rank:
        t = self.topo
        transport = self._transport(side, pp, tp)
        tp_size, pp_size = (t.p_tp, t.p_pp) if side == "P" else (t.d_tp, t.d_pp)
        cfg = CoreConfig(engine_id=side, tp_rank=tp, tp_size=tp_size, pp_rank=pp, pp_size=pp_size, mla=t.mla,
                         kv_heads=t.kv, compat_hash="m", block_size=t.block_size, strict=strict, lease_ns=LEASE,
                         lease_margin_ns=MARGIN, read_timeout_ns=6 * LEASE)
        conn = Connector(cfg, transport, SimHandshaker(self.net), clock=self.clock, host=f"{side.lower()}-host", port=5)
        return Rank((pp, tp), conn, transport)

    # --- the scheduler's part -------------------------------------------------------------------

    def hold(self) -> None:
        """Every prefill rank holds the request's blocks; the router gets rank (0, 0)'s params."""
        stamp = time.time_ns()  # the scheduler's one stamp for every rank's hold (docs/embedding.md)
        got = {k: r.conn.request_finished(PRID, list(self.topo.remote), issued_wall_ns=stamp)
               for k, r in self.p.items()}
        self.params = KVTransferParams.parse(got[(0, 0)].to_dict())
        assert (self.params.remote_tp_size, self.params.remote_pp_size) == (self.topo.p_tp, self.topo.p_pp)
        assert {p.remote_block_ids for p in got.values()} == {self.topo.remote}
        self.held_at = self.arrived = self.now

    def load_meta(self) -> ConnectorMetadata:
        assert self.params is not None
        return ConnectorMetadata(reqs_to_recv={RID: (self.topo.local, self.params)},
                                 lease_ages={RID: self.now - self.arrived})

    def drive(self, r: Rank, until: Callable[[], bool], meta: ConnectorMetadata | None = None) -> None:
        deadline = time.monotonic() + 10
        while True:
            r.step(meta)
            meta = None
            self.now += STEP_NS
            if until():
                return
            assert time.monotonic() < deadline, f"decode rank {r.key}: timed out"
            if self.topo.kind == "torch":
                time.sleep(PAUSE)

    def receive(self, r: Rank) -> None:
        """Load on decode rank ``r`` and step it alone until it reports the request."""
        self.drive(r, lambda: r.count("finished_recving", RID) > 0, self.load_meta())

    def step_producers(self, rounds: int = 2) -> None:
        for _ in range(rounds):
            for r in self.p.values():
                r.step()
            self.now += STEP_NS

    def inject(self, f: Key, key: tuple[str, int, int], mode: str) -> None:
        tr = self.d[f].transport
        tr.fault_key, tr.mode = key, mode

    def in_flight(self, f: Key, key: tuple[str, int, int]) -> bool:
        """Only the faulty read of rank ``f`` is still running (its siblings ended)."""
        tr = self.d[f].transport
        return set(tr.reads) == {key} and (self.topo.kind == "sim" or tr.stuck.is_set())

    # --- what is checked ----------------------------------------------------------------------------

    def d_state(self, k: Key) -> dict[int, Arr]:
        if self.topo.kind == "torch":
            return {x: t.numpy().copy() for x, t in self.d_regions[k].items()}
        tr = self.d[k].transport
        shape = self.expected(k)[0].shape
        return {0: np.frombuffer(bytes(tr.memory), dtype=np.int32).reshape(shape)}

    def expected(self, k: Key) -> dict[int, Arr]:
        """The reference: this consumer rank's heads of its layers, for each request token."""
        t = self.topo
        layers, heads = t.layers(k[0], t.d_pp), t.heads(k[1], t.d_tp)

        def other(b: int) -> int:
            return SENTINEL
        if t.kind == "sim":
            return {0: table_array(D_BLOCKS, t.local, lambda i: t.sim_block(layers, heads, i), other)}
        return {t.region_id(x, kv): table_array(D_BLOCKS, t.local,
                                                lambda i, x=x, kv=kv: t.region_block(x, kv, heads, i),  # type: ignore[misc]
                                                other)
                for x in layers for kv in t.kvs}

    def assert_bytes(self, k: Key, *, outside_table_only: bool = False) -> None:
        got, want = self.d_state(k), self.expected(k)
        assert got.keys() == want.keys()
        rows = [b for b in range(D_BLOCKS) if b not in self.topo.local] if outside_table_only else list(range(D_BLOCKS))
        for x in want:
            g, w = got[x][rows], want[x][rows]
            bad = sorted({rows[int(i)] for i in np.argwhere(g != w)[:, 0]})
            assert not bad, f"{self.topo}: decode rank {k} region {x}: blocks {bad} differ from the reference"

    def assert_received(self, k: Key) -> None:
        r = self.d[k]
        assert r.count("finished_recving", RID) == 1
        out = r.report(RID)
        assert not out.failed and RID not in out.aborted
        assert all(not o.invalid_block_ids for o in r.outputs)

    def assert_released(self, done: set[Key]) -> None:
        """Each producer rank has released exactly once iff every consumer rank that owes it a
        notification is in ``done``, never by expiry."""
        for k, r in self.p.items():
            want = 1 if self.topo.notifiers(*k) <= done else 0
            assert r.count("finished_sending", PRID) == want, (self.topo, k, done)
            assert r.count("expired", PRID) == 0, (self.topo, k)

    def assert_notifications(self) -> None:
        """Each producer rank heard parts 0..of-1 of its request once each, ``of`` the expected count."""
        t = self.topo
        of = expected_notifications(t.p_tp, t.d_tp)
        for k, r in self.p.items():
            assert len(t.notifiers(*k)) == of
            notes = r.notes()
            assert sorted(n.part for n in notes) == list(range(of)), (t, k, notes)
            assert {n.of for n in notes} == {of}, (t, k, notes)

    def assert_nothing_in_flight(self) -> None:
        for r in self.d.values():
            core = r.conn.core
            assert not r.transport.reads and not core.consumers and core.pending_hand_offs == 0
            assert len(core.deadlines) == 0 and all(e.readers == 0 for e in core.engines.values())
        for r in self.p.values():
            core = r.conn.core
            assert not core.producers and len(core.leases) == 0 and not r.transport.inbox

    def finish(self) -> None:
        """A few more steps report nothing again; shutdown has nothing left to report."""
        before = {(side, k): len(r.outputs) for side, ranks in (("P", self.p), ("D", self.d)) for k, r in ranks.items()}
        for _ in range(2):
            for r in (*self.p.values(), *self.d.values()):
                out = r.step()
                assert not (out.finished_sending or out.finished_recving or out.invalid_block_ids), (r.key, out)
        assert all(len(r.outputs) == before[(s, k)] + 2
                   for s, ranks in (("P", self.p), ("D", self.d)) for k, r in ranks.items())
        for r in (*self.p.values(), *self.d.values()):
            last = r.conn.shutdown()
            assert not (last.finished_sending or last.finished_recving or last.invalid_block_ids)

    def close(self) -> None:
        for r in (*self.p.values(), *self.d.values()):
            if isinstance(r.transport, FaultyTorch):
                r.transport.gate.set()
            with contextlib.suppress(Exception):
                r.conn.shutdown()
            if isinstance(r.transport, TorchTransport):
                r.transport.close()


@pytest.fixture
def worlds() -> Iterator[list[World]]:
    made: list[World] = []
    yield made
    for w in made:
        w.close()


def _grid() -> list[Topo]:
    out = []
    for i, (kind, p_tp, d_tp, mla, pp) in enumerate(itertools.product(
            KINDS, TPS, TPS, (False, True), ((1, 1), (2, 1), (2, 2)))):
        if kind == "sim" and pp == (2, 1):
            continue  # one region per sim rank: PP 2 into PP 1 needs layer pairing (torch, NIXL)
        # block size and table vary across every other parameter (not in step with PP or MLA)
        out.append(Topo(kind, p_tp, d_tp, mla, pp[0], pp[1], block_size=(1, 4, 16)[(i + i // 6) % 3],
                        table=(p_tp + d_tp + i // 3) % 2))
    return out


def _replicated() -> list[Topo]:
    """Fewer KV heads than a TP on either side or both, every PP split."""
    out = []
    for i, (kind, (p_tp, d_tp, kv), pp) in enumerate(itertools.product(
            KINDS, ((1, 4, 2), (4, 1, 2), (2, 4, 1), (4, 2, 1), (4, 4, 2), (1, 2, 1)), ((1, 1), (2, 1), (2, 2)))):
        if kind == "sim" and pp == (2, 1):
            continue
        out.append(Topo(kind, p_tp, d_tp, False, pp[0], pp[1], block_size=(1, 4, 16)[i % 3], table=i % 2, kv=kv))
    return out


GRID = _grid() + _replicated()

FAULT_LAYOUTS = ((1, 1, False, 1, 1), (4, 1, False, 1, 1), (1, 4, False, 1, 1), (2, 4, True, 1, 1),
                 (4, 2, True, 2, 1), (2, 1, False, 2, 2), (1, 2, True, 2, 2), (4, 4, False, 2, 1))
FAULT_GRID = [Topo(kind, p, d, mla, ppp, dpp, block_size=(4, 16)[i % 2], table=i % 2)
              for i, (kind, (p, d, mla, ppp, dpp)) in enumerate(itertools.product(KINDS, FAULT_LAYOUTS))
              if not (kind == "sim" and (ppp, dpp) == (2, 1))] + [
    Topo(kind, p, d, False, 1, 1, block_size=4, table=i % 2, kv=kv)  # heads read once, copies told
    for i, (kind, (p, d, kv)) in enumerate(itertools.product(KINDS, ((4, 1, 2), (1, 4, 2), (4, 2, 1))))]


# --- every topology, no fault ------------------------------------------------------------------------


@pytest.mark.parametrize("topo", GRID, ids=str)
def test_every_topology_moves_the_reference_bytes_and_releases_each_producer_rank_once(
        topo: Topo, worlds: list[World]) -> None:
    """Decode ranks hold the reference bytes; each producer rank releases once, after its last notifier."""
    w = World(topo)
    worlds.append(w)
    w.hold()
    w.step_producers()
    w.assert_released(set())
    done: set[Key] = set()
    for k, r in sorted(w.d.items()):
        w.receive(r)
        done.add(k)
        w.assert_received(k)
        w.assert_bytes(k)
        w.step_producers()
        w.assert_released(done)
    w.assert_notifications()
    w.assert_nothing_in_flight()
    w.finish()


# --- one fault per run ---------------------------------------------------------------------------------


def _faulty(w: World) -> tuple[Key, tuple[str, int, int], ReadPlan]:
    """The last decode rank and its last read."""
    t = w.topo
    f = (t.d_pp - 1, t.d_tp - 1)
    plan = t.plan(*f)
    s = plan.sources[-1]
    return f, (RID, s.pp_rank, s.tp_rank), plan


def _others_receive(w: World, f: Key) -> set[Key]:
    done: set[Key] = set()
    for k, r in sorted(w.d.items()):
        if k != f:
            w.receive(r)
            done.add(k)
            w.assert_received(k)
            w.assert_bytes(k)
    return done


def _assert_only_f_invalid(w: World, f: Key, out: StepOutput) -> None:
    local = w.topo.local
    assert out.invalid_block_ids == frozenset(local)
    assert w.d[f].count("finished_recving", RID) == 1
    assert all(not o.invalid_block_ids for o in w.d[f].outputs if o is not out)
    for k in w.d:
        if k != f:
            w.assert_received(k)
    w.assert_bytes(f, outside_table_only=True)  # blocks outside the table are never written


@pytest.mark.parametrize("topo", FAULT_GRID, ids=str)
def test_a_read_error_on_one_decode_rank_invalidates_exactly_its_blocks_and_producers_release_once(
        topo: Topo, worlds: list[World]) -> None:
    """One READ ends ERR: that rank reports failed with its blocks invalid; every producer rank releases once."""
    w = World(topo)
    worlds.append(w)
    f, key, _ = _faulty(w)
    w.inject(f, key, "err")
    w.hold()
    done = _others_receive(w, f)
    w.step_producers()
    w.assert_released(done)
    w.receive(w.d[f])
    out = w.d[f].report(RID)
    (handoff,) = out.failed
    assert (handoff.request_id, handoff.outcome, handoff.invalid_blocks, handoff.policy) == (
        RID, "failed", topo.local, "recompute")
    assert f"({key[1]}, {key[2]}) err" in handoff.reason and RID not in out.aborted
    _assert_only_f_invalid(w, f, out)
    w.step_producers()
    w.assert_released(done | {f})
    w.assert_notifications()
    w.assert_nothing_in_flight()
    w.finish()


@pytest.mark.parametrize("topo", FAULT_GRID, ids=str)
def test_an_abort_mid_read_holds_the_blocks_until_the_read_stops_then_invalidates_only_that_rank(
        topo: Topo, worlds: list[World]) -> None:
    """Aborted mid-read: blocks held until the read stops, then reported once, invalid; producers release once."""
    w = World(topo)
    worlds.append(w)
    f, key, _ = _faulty(w)
    w.inject(f, key, "hang")
    fr = w.d[f]
    if topo.kind == "torch":
        fr.transport.gate.clear()  # the read keeps going after the cancel until the gate opens
    w.hold()
    done = _others_receive(w, f)
    w.drive(fr, lambda: w.in_flight(f, key), w.load_meta())
    assert fr.count("finished_recving", RID) == 0
    for r in w.d.values():  # the scheduler aborts the request on every worker
        r.step(ConnectorMetadata(aborted=(RID,)))
    if topo.kind == "torch":
        for _ in range(5):
            time.sleep(PAUSE)
            fr.step()
        assert fr.count("finished_recving", RID) == 0, "reported while a read into its blocks still runs"
        assert fr.conn.core.consumers[RID].state is ConsumerS.ABORTING
        fr.transport.gate.set()
    w.drive(fr, lambda: fr.count("finished_recving", RID) > 0)
    out = fr.report(RID)
    assert RID in out.aborted and not out.failed
    _assert_only_f_invalid(w, f, out)
    w.step_producers()
    w.assert_released(done | {f})
    w.assert_notifications()
    w.assert_nothing_in_flight()
    w.finish()


@pytest.mark.parametrize("topo", FAULT_GRID, ids=str)
def test_an_expired_lease_releases_the_unnotified_producer_ranks_once_and_fails_only_the_slow_rank(
        topo: Topo, worlds: list[World]) -> None:
    """A read hangs past the lease: its producer ranks release once, by expiry; the slow rank fails,
    invalid; nobody is told late (a notice past the lease would read there as a late read)."""
    w = World(topo, p_strict=False)
    worlds.append(w)
    f, key, plan = _faulty(w)
    w.inject(f, key, "hang")
    fr = w.d[f]
    w.hold()
    _others_receive(w, f)
    w.drive(fr, lambda: w.in_flight(f, key), w.load_meta())
    unnotified = frozenset({key[1:], *plan.notify_only})  # completed reads notified the rest
    w.step_producers()
    for k, r in w.p.items():
        assert r.count("finished_sending", PRID) == (0 if k in unnotified else 1), k
    w.now = w.held_at + LEASE + 1
    for r in w.p.values():  # the producer's lease runs out before the consumer gives up
        r.step()
    for k, r in w.p.items():
        assert r.count("finished_sending", PRID) == 1, k
        assert r.count("expired", PRID) == (1 if k in unnotified else 0), k
        if k in unnotified:
            assert PRID in r.outputs[-1].expired
    w.drive(fr, lambda: fr.count("finished_recving", RID) > 0)
    out = fr.report(RID)
    (handoff,) = out.failed
    assert handoff.invalid_blocks == topo.local and "deadline" in handoff.reason
    _assert_only_f_invalid(w, f, out)
    w.step_producers()
    for k, r in w.p.items():
        assert r.count("finished_sending", PRID) == 1, k
        assert r.count("expired", PRID) == (1 if k in unnotified else 0), k
        assert r.conn.core.rejections[Fault.REMOTE] == 0, k
        assert r.conn.core.rejections[Fault.LOCAL] == 0
    of = expected_notifications(topo.p_tp, topo.d_tp)
    for k, r in w.p.items():  # the slow rank's part never arrives: not even late
        parts = sorted(n.part for n in r.notes())
        assert parts == sorted(set(parts)) and len(parts) == (of - 1 if k in unnotified else of), (k, parts)
    w.assert_nothing_in_flight()
    w.finish()
