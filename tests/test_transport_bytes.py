"""Every byte lands where it must (property tests found by review; all pass).

Random layouts (TP both ways, MLA, PP, heads shared out over TP ranks) and random block tables
(fragmented, reversed, partial prefix hits, repeated remote ids), read through a reference model
(plain torch indexing: for each local block and layer, the right heads of the right remote block)
and through the sim, torch and NIXL transports, compared byte for byte. Also: the coalesced
descriptor list against the per-block one, NIXL's prepared-list indices against the per-block
list, and topology invariants (every head of every layer of every consumer rank read exactly
once; every producer rank hears exactly the parts it expects).

KV layout (as pdfsm/engines.py): every region is ``[num_blocks, heads, head_bytes]`` with this
rank's heads (``H / tp``; one head, held by several ranks, when the TP is larger than the model's
heads, which the plan is then told; or one replicated latent head with MLA), so a TP slice of a
block is a contiguous range of heads.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfsm.commands import PostRead
from pdfsm.events import HandleDone, HandleFailed, HandshakeReply, NotificationReceived
from pdfsm.topology import Layout, ReadSource, expected_notifications, heads_held, heads_problem, read_plan
from pdfsm.wire import Notification
from transports.coalesce import Region, read_descs, read_indices, slice_span
from transports.sim import SimNetwork, SimTransport
from transports.torch import TorchNetwork, TorchTransport

try:
    from transports.nixl import NixlTransport, _all_blocks, nixl_available
    HAVE_NIXL = nixl_available()
except ImportError:  # pragma: no cover
    HAVE_NIXL = False

if HAVE_NIXL:
    logging.getLogger("nixl").setLevel(logging.WARNING)

def SETTINGS(n: int) -> settings:
    return settings(derandomize=True, deadline=None, max_examples=n, database=None,
                    suppress_health_check=list(HealthCheck))
_names = itertools.count()


def name(prefix: str) -> str:
    return f"rv13-{prefix}-{os.getpid()}-{next(_names)}"


# --- the scenario --------------------------------------------------------------------------------


class Scenario:
    """Two engines' layouts, the model's KV bytes, and one request's block tables."""

    def __init__(self, *, p_tp: int, d_tp: int, p_pp: int, d_pp: int, layers: int, heads: int, head_bytes: int,
                 mla: bool, p_blocks: int, d_blocks: int, remote: list[int], local: list[int],
                 p_orders: dict[tuple[int, int], list[int]], d_orders: dict[tuple[int, int], list[int]],
                 seed: int, dtype: torch.dtype = torch.uint8, shared: bool = False, chunk: int = 4 << 20,
                 kv_heads: int = 0) -> None:
        self.dtype, self.shared, self.chunk = dtype, shared, chunk
        self.kv_heads = kv_heads  # what both engines say (CoreConfig.kv_heads): needed once a TP exceeds heads
        self.p_tp, self.d_tp, self.p_pp, self.d_pp = p_tp, d_tp, p_pp, d_pp
        self.layers, self.heads, self.head_bytes, self.mla = layers, heads, head_bytes, mla
        self.p_blocks, self.d_blocks = p_blocks, d_blocks
        self.remote_all, self.local = remote, local
        # A partial local prefix hit of the prompt's last blocks (Connector.load's computed_blocks).
        self.remote = remote[len(remote) - len(local):] if local else []
        self.p_orders, self.d_orders = p_orders, d_orders
        gen = torch.Generator().manual_seed(seed)
        h = 1 if mla else heads
        # The model's KV: per layer, [p_blocks, H, head_bytes] as the producer engine holds it.
        self.model = [torch.randint(0, 256, (p_blocks, h, head_bytes), dtype=torch.uint8, generator=gen)
                      for _ in range(layers)]
        # What every consumer region holds before the read (checked unchanged outside the table).
        self.d_init = {(q, d): {x: torch.randint(0, 256, (d_blocks, self.d_heads, head_bytes), dtype=torch.uint8,
                                                 generator=gen) for x in self.d_layers(q)}
                       for q in range(d_pp) for d in range(d_tp)}

    def __repr__(self) -> str:
        return (f"Scenario(p_tp={self.p_tp}, d_tp={self.d_tp}, p_pp={self.p_pp}, d_pp={self.d_pp}, "
                f"layers={self.layers}, heads={self.heads}, head_bytes={self.head_bytes}, mla={self.mla}, "
                f"p_blocks={self.p_blocks}, d_blocks={self.d_blocks}, remote={self.remote_all}, "
                f"local={self.local}, p_orders={self.p_orders}, d_orders={self.d_orders}, dtype={self.dtype}, "
                f"shared={self.shared}, chunk={self.chunk}, kv_heads={self.kv_heads})")

    def registered(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` (uint8) as the transport registers them: viewed as ``dtype``, and
        with ``shared`` as adjacent views into one buffer (one allocation cut into layers, as vLLM
        does), so regions touch in memory."""
        if self.shared:
            big = torch.cat([t.reshape(-1) for t in tensors])
            out, off = [], 0
            for t in tensors:
                out.append(big[off:off + t.numel()].view(t.shape))
                off += t.numel()
        else:
            out = [t.clone() for t in tensors]
        return [t.view(self.dtype) for t in out]

    def held(self, tp_size: int, rank: int) -> range:
        """The model heads a rank holds (MLA: the one latent head, on every rank)."""
        return range(1) if self.mla else heads_held(tp_size, rank, self.heads)

    @property
    def p_heads(self) -> int:
        return len(self.held(self.p_tp, 0))

    @property
    def d_heads(self) -> int:
        return len(self.held(self.d_tp, 0))

    def p_layers(self, pp: int) -> list[int]:
        n = self.layers // self.p_pp
        return list(range(pp * n, (pp + 1) * n))

    def d_layers(self, q: int) -> list[int]:
        n = self.layers // self.d_pp
        return list(range(q * n, (q + 1) * n))

    def p_tensor(self, pp: int, t: int, layer: int) -> torch.Tensor:
        """Producer rank (pp, t)'s region of ``layer``: its heads of every block."""
        assert layer in self.p_layers(pp)
        full = self.model[layer]
        heads = self.held(self.p_tp, t)
        return full[:, heads.start:heads.stop].clone()

    def expected(self, q: int, d: int, layer: int) -> torch.Tensor:
        """The reference: what consumer rank (q, d)'s region of ``layer`` must hold after the read."""
        want = self.d_init[(q, d)][layer].clone()
        full = self.model[layer]
        heads = self.held(self.d_tp, d)
        mine = full[:, heads.start:heads.stop]
        if self.local:
            want[self.local] = mine[self.remote]
        return want

    def plan(self, q: int, d: int) -> Any:
        return read_plan(Layout(self.d_tp, self.d_pp, d, q), Layout(self.p_tp, self.p_pp), self.mla, self.kv_heads)


@st.composite
def tables(draw: st.DrawFn, p_blocks: int, d_blocks: int) -> tuple[list[int], list[int]]:
    """(remote table as the router announced it, local table): local ids distinct (the
    Connector refuses repeats), remote ids may repeat; contiguous, reversed, runs or random;
    the local table may be shorter (a partial prefix hit)."""
    m = draw(st.integers(0, min(p_blocks, 10)))
    style = draw(st.sampled_from(["contiguous", "reversed", "runs", "random", "repeats"]))
    if style == "contiguous":
        s = draw(st.integers(0, p_blocks - m))
        remote = list(range(s, s + m))
    elif style == "reversed":
        s = draw(st.integers(0, p_blocks - m))
        remote = list(range(s + m - 1, s - 1, -1))
    elif style == "runs":
        remote = []
        while len(remote) < m:
            s = draw(st.integers(0, p_blocks - 1))
            k = draw(st.integers(1, m - len(remote)))
            remote.extend(min(s + i, p_blocks - 1) for i in range(k))
    elif style == "repeats":
        remote = [draw(st.integers(0, min(2, p_blocks - 1))) for _ in range(m)]
    else:
        remote = [draw(st.integers(0, p_blocks - 1)) for _ in range(m)]
    n = draw(st.integers(0, min(m, d_blocks)))
    lstyle = draw(st.sampled_from(["contiguous", "reversed", "random"]))
    if lstyle == "contiguous":
        s = draw(st.integers(0, d_blocks - n))
        local = list(range(s, s + n))
    elif lstyle == "reversed":
        s = draw(st.integers(0, d_blocks - n))
        local = list(range(s + n - 1, s - 1, -1))
    else:
        local = draw(st.permutations(range(d_blocks)))[:n]
    return remote, local


@st.composite
def scenarios(draw: st.DrawFn, *, pp: bool = True, max_tp: int = 4, one_layer: bool = False,
              tps: tuple[int, ...] = (1, 2, 4)) -> Scenario:
    sizes = [t for t in tps if t <= max_tp]
    p_tp = draw(st.sampled_from(sizes))
    d_tp = draw(st.sampled_from([t for t in sizes if max(t, p_tp) % min(t, p_tp) == 0]))
    mla = draw(st.booleans())
    p_pp = draw(st.sampled_from([1, 1, 2])) if pp and not one_layer else 1
    d_pp = draw(st.sampled_from([1, p_pp]))
    layers = 1 if one_layer else p_pp * draw(st.integers(1, 2))
    heads = max(p_tp, d_tp) * draw(st.integers(1, 2))
    fewer = [h for h in (1, 2, 4) if h < max(p_tp, d_tp) and not heads_problem(p_tp, h) and not heads_problem(d_tp, h)]
    kv_heads = 0  # not said: every rank holds a distinct share
    if not mla and fewer and draw(st.booleans()):  # a TP above the model's heads: ranks hold copies
        heads = kv_heads = draw(st.sampled_from(fewer))
    head_bytes = draw(st.sampled_from([1, 2, 4, 8]))
    p_blocks, d_blocks = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    dtype = draw(st.sampled_from([d for d in (torch.uint8, torch.int16, torch.int32) if head_bytes % d.itemsize == 0]))
    shared, chunk = draw(st.booleans()), draw(st.sampled_from([4 << 20, 4 << 20, 1, 3]))
    remote, local = draw(tables(p_blocks, d_blocks))
    p_orders = {(q, t): draw(st.permutations(list(range(q * (layers // p_pp), (q + 1) * (layers // p_pp)))))
                for q in range(p_pp) for t in range(p_tp)}
    d_orders = {(q, d): draw(st.permutations(list(range(q * (layers // d_pp), (q + 1) * (layers // d_pp)))))
                for q in range(d_pp) for d in range(d_tp)}
    return Scenario(p_tp=p_tp, d_tp=d_tp, p_pp=p_pp, d_pp=d_pp, layers=layers, heads=heads, head_bytes=head_bytes,
                    mla=mla, p_blocks=p_blocks, d_blocks=d_blocks, remote=remote, local=local, p_orders=p_orders,
                    d_orders=d_orders, seed=draw(st.integers(0, 1 << 16)), dtype=dtype, shared=shared, chunk=chunk,
                    kv_heads=kv_heads)


def reply(sc: Scenario, pp: int, infos: list[Any]) -> HandshakeReply:
    return HandshakeReply(engine_id="P", compat_hash="", tp_size=sc.p_tp, pp_size=sc.p_pp, mla=sc.mla,
                          num_blocks=sc.p_blocks, ranks=tuple(infos), kv_heads=sc.kv_heads)


def check_notifications(sc: Scenario, heard: dict[tuple[int, int], list[NotificationReceived]]) -> None:
    """Every producer rank hears exactly parts 0..of-1 of its request, of = the expected count."""
    want = expected_notifications(sc.p_tp, sc.d_tp)
    for pp in range(sc.p_pp):
        for t in range(sc.p_tp):
            notes = heard.get((pp, t), [])
            assert {n.request_id for n in notes} <= {"preq"}, notes
            assert sorted(n.part for n in notes) == list(range(want)), (pp, t, notes)
            assert {n.of for n in notes} == {want}, (pp, t, notes)


# --- a read through a transport family, every consumer rank of the engine ------------------------


def run_ranks(sc: Scenario, make: Callable[..., Any],
              wait: Callable[[list[Any], dict[tuple[int, int], list[Any]], int, list[Any]], bool],
              ) -> dict[tuple[int, int], dict[int, torch.Tensor]]:
    """Every producer and consumer rank of the scenario over one transport family (``make(name,
    kv, layers=, pp_rank=, tp_rank=, consumer=)``), each consumer rank's reads posted and its
    notify-only ranks told; then ``wait(d_events, p_events, posted, transports)`` until done."""
    prods: dict[tuple[int, int], Any] = {}
    cons: dict[tuple[int, int], Any] = {}
    p_events: dict[tuple[int, int], list[Any]] = defaultdict(list)
    d_events: list[Any] = []
    try:
        for (pp, t), order in sc.p_orders.items():
            kv = sc.registered([sc.p_tensor(pp, t, x) for x in order])
            prods[(pp, t)] = tr = make(name(f"P{pp}.{t}"), kv, layers=order, pp_rank=pp, tp_rank=t, consumer=False)
            tr.bind(p_events[(pp, t)].append, time.monotonic_ns)
        out: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        posted = 0
        for (q, d), order in sc.d_orders.items():
            kv = sc.registered([sc.d_init[(q, d)][x] for x in order])
            out[(q, d)] = {x: k.view(torch.uint8) for x, k in zip(order, kv, strict=True)}
            cons[(q, d)] = tr = make(name(f"D{q}.{d}"), kv, layers=order, pp_rank=q, tp_rank=d, consumer=True)
            tr.bind(d_events.append, time.monotonic_ns)
            plan = sc.plan(q, d)
            for pp in plan.pp_ranks:
                tr.add_peer(("P", pp), reply(sc, pp, [prods[(pp, t)].rank_info() for t in range(sc.p_tp)]))
            note = Notification("preq", plan.part, plan.of)
            for src in plan.sources:
                tr.post_read(PostRead(f"r{q}.{d}", "P", src, tuple(sc.local), tuple(sc.remote), note))
                posted += 1
            for pp, t in plan.notify_only:
                tr.send(("P", pp), t, note)
        deadline = time.monotonic() + 10
        while not wait(d_events, p_events, posted, [*cons.values(), *prods.values()]):
            assert time.monotonic() < deadline, "timed out"
        assert all(isinstance(e, HandleDone) for e in d_events), d_events
        for p in prods.values():
            p.progress()
        check_notifications(sc, {k: [e for e in v if isinstance(e, NotificationReceived)]
                                 for k, v in p_events.items()})
        return out
    finally:
        for tr in (*cons.values(), *prods.values()):
            tr.close()


def _reads_done(d_events: list[Any], posted: int) -> bool:
    return sum(isinstance(e, (HandleDone, HandleFailed)) for e in d_events) >= posted


def run_torch(sc: Scenario) -> dict[tuple[int, int], dict[int, torch.Tensor]]:
    tnet = TorchNetwork()

    def make(agent: str, kv: list[torch.Tensor], *, consumer: bool, **ranks: Any) -> TorchTransport:
        extra: dict[str, Any] = {"chunk_bytes": sc.chunk} if consumer else {}
        return TorchTransport(tnet, agent, kv, workers=1, **ranks, **extra)

    def wait(d_events: list[Any], p_events: Any, posted: int, transports: list[Any]) -> bool:
        time.sleep(0.0005)  # its worker threads report
        return _reads_done(d_events, posted)

    return run_ranks(sc, make, wait)


def run_sim(sc: Scenario) -> dict[tuple[int, int], dict[int, torch.Tensor]]:
    """The sim transport has one region per agent: one layer, no PP."""
    assert sc.layers == 1 and sc.p_pp == sc.d_pp == 1
    net = SimNetwork()
    hb = sc.head_bytes
    prods, cons = {}, {}
    p_events: dict[tuple[int, int], list[Any]] = defaultdict(list)
    d_events: list[Any] = []
    for t in range(sc.p_tp):
        tr = SimTransport(net, name(f"P{t}"), tp_rank=t, num_blocks=sc.p_blocks, block_bytes=sc.p_heads * hb)
        tr.memory[:] = sc.p_tensor(0, t, 0).numpy().tobytes()
        tr.bind(p_events[(0, t)].append, time.monotonic_ns)
        prods[t] = tr
    out = {}
    posted = 0
    for d in range(sc.d_tp):
        tr = SimTransport(net, name(f"D{d}"), tp_rank=d, num_blocks=sc.d_blocks, block_bytes=sc.d_heads * hb)
        tr.memory[:] = sc.d_init[(0, d)][0].numpy().tobytes()
        tr.bind(d_events.append, time.monotonic_ns)
        cons[d] = tr
        plan = sc.plan(0, d)
        tr.add_peer(("P", 0), reply(sc, 0, [prods[t].rank_info() for t in range(sc.p_tp)]))
        note = Notification("preq", plan.part, plan.of)
        for src in plan.sources:
            tr.post_read(PostRead(f"r{d}", "P", src, tuple(sc.local), tuple(sc.remote), note))
            posted += 1
        for pp, t in plan.notify_only:
            tr.send(("P", pp), t, note)
    for _ in range(3):
        for tr in cons.values():
            tr.progress()
    assert len(d_events) == posted and all(isinstance(e, HandleDone) for e in d_events), d_events
    for tr in prods.values():
        tr.progress()
    check_notifications(sc, {k: [e for e in v if isinstance(e, NotificationReceived)] for k, v in p_events.items()})
    for d, tr in cons.items():
        arr = np.frombuffer(bytes(tr.memory), dtype=np.uint8).reshape(sc.d_blocks, sc.d_heads, hb)
        out[(0, d)] = {0: torch.from_numpy(arr.copy())}
    return out


def run_nixl(sc: Scenario, xfer_mode: Any) -> dict[tuple[int, int], dict[int, torch.Tensor]]:
    want_notes = sc.p_tp * sc.p_pp * expected_notifications(sc.p_tp, sc.d_tp)

    def make(agent: str, kv: list[torch.Tensor], *, consumer: bool, **ranks: Any) -> NixlTransport:
        extra: dict[str, Any] = {"xfer_mode": xfer_mode} if consumer else {}
        return NixlTransport(agent, kv, **ranks, **extra)

    def wait(d_events: list[Any], p_events: dict[tuple[int, int], list[Any]], posted: int,
             transports: list[Any]) -> bool:
        if _reads_done(d_events, posted) and sum(
                isinstance(e, NotificationReceived) for v in p_events.values() for e in v) >= want_notes:
            return True
        for tr in transports:  # polled by the owner: nothing reports otherwise
            tr.progress()
        return False

    return run_ranks(sc, make, wait)


def assert_matches_reference(sc: Scenario, got: dict[tuple[int, int], dict[int, torch.Tensor]]) -> None:
    assert set(got) == {(q, d) for q in range(sc.d_pp) for d in range(sc.d_tp)}
    for (q, d), regions in got.items():
        assert set(regions) == set(sc.d_layers(q))
        for x, tensor in regions.items():
            want = sc.expected(q, d, x)
            if not torch.equal(tensor, want):
                bad = sorted({int(b) for b in (tensor != want).nonzero()[:, 0]})
                raise AssertionError(f"consumer rank (pp {q}, tp {d}) layer {x}: blocks {bad} differ from the "
                                     f"reference\n{sc!r}")


# --- reference vs transports -----------------------------------------------------------------------


@SETTINGS(60)
@given(scenarios())
def test_torch_transport_moves_the_reference_bytes(sc: Scenario) -> None:
    assert_matches_reference(sc, run_torch(sc))


@SETTINGS(80)
@given(scenarios(one_layer=True, max_tp=6, tps=(1, 2, 3, 4, 6)))
def test_sim_and_torch_transports_move_the_reference_bytes(sc: Scenario) -> None:
    sim = run_sim(sc)
    assert_matches_reference(sc, sim)
    torch_out = run_torch(sc)
    for k in sim:
        assert torch.equal(sim[k][0], torch_out[k][0])


@pytest.mark.nixl
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed")
@SETTINGS(16)
@given(scenarios(max_tp=2), st.sampled_from(["prepped", "descs"]))
def test_nixl_transport_moves_the_reference_bytes(sc: Scenario, xfer_mode: str) -> None:
    assert_matches_reference(sc, run_nixl(sc, xfer_mode))


# --- descriptors -----------------------------------------------------------------------------------


@st.composite
def region_pairs(draw: st.DrawFn) -> tuple[list[Region], list[Region], list[int], list[int], ReadSource]:
    """Paired regions (per pair its own slice unit), a table (unique local ids, remote ids
    may repeat) and a slice geometry as the topology makes them."""
    kind = draw(st.sampled_from(["whole", "remote-sliced", "local-sliced"]))
    k = draw(st.sampled_from([2, 4]))
    src = {"whole": ReadSource(0, 0),
           "remote-sliced": ReadSource(0, 0, remote_slice=draw(st.integers(0, k - 1)), remote_slices=k),
           "local-sliced": ReadSource(0, 0, local_slice=draw(st.integers(0, k - 1)), local_slices=k)}[kind]
    nreg = draw(st.integers(1, 4))
    lnum, rnum = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    lregs, rregs = [], []
    lbase, rbase = draw(st.integers(0, 4096)), draw(st.integers(0, 4096))
    ldev, rdev = draw(st.integers(0, 1)), draw(st.integers(0, 1))
    for _ in range(nreg):
        unit = draw(st.integers(1, 8))  # bytes moved per block in this region pair
        lstride, rstride = unit * src.local_slices, unit * src.remote_slices
        gap_l, gap_r = draw(st.sampled_from([0, 0, 8])), draw(st.sampled_from([0, 0, 8]))
        lregs.append(Region(lbase, lstride, lnum, ldev))
        rregs.append(Region(rbase, rstride, rnum, rdev))
        lbase += lstride * lnum + gap_l  # regions may be adjacent in memory: still never merged
        rbase += rstride * rnum + gap_r
    remote, local = draw(tables(rnum, lnum))
    remote = remote[len(remote) - len(local):] if local else []
    return lregs, rregs, local, remote, src


def per_byte(dl: np.ndarray, dr: np.ndarray) -> list[tuple[int, int, int, int]]:
    out: list[tuple[int, int, int, int]] = []
    for (la, ln, ld), (ra, rn, rd) in zip(dl.tolist(), dr.tolist(), strict=True):
        assert ln == rn
        out.extend((ld, la + i, rd, ra + i) for i in range(ln))
    return out


@SETTINGS(300)
@given(region_pairs())
def test_coalesced_descriptors_move_the_per_block_bytes_inside_their_regions(
        t: tuple[list[Region], list[Region], list[int], list[int], ReadSource]) -> None:
    lregs, rregs, local, remote, src = t
    kw: dict[str, Any] = dict(local_slice=src.local_slice, local_slices=src.local_slices,
                              remote_slice=src.remote_slice, remote_slices=src.remote_slices)
    bl, br = read_descs(local, remote, lregs, rregs, merge=False, **kw)
    cl, cr = read_descs(local, remote, lregs, rregs, **kw)
    assert len(bl) == len(local) * len(lregs) and len(cl) <= len(bl)
    # The per-block list is exactly the reference: region k, row i moves remote_blocks[i]'s slice.
    want: list[tuple[tuple[int, int, int], tuple[int, int, int]]] = []
    for lreg, rreg in zip(lregs, rregs, strict=True):
        loff, llen = slice_span(lreg.stride, src.local_slices, src.local_slice)
        roff, rlen = slice_span(rreg.stride, src.remote_slices, src.remote_slice)
        assert llen == rlen
        want.extend(((lreg.base + lb * lreg.stride + loff, llen, lreg.device),
                     (rreg.base + rb * rreg.stride + roff, rlen, rreg.device))
                    for lb, rb in zip(local, remote, strict=True))
    assert [(tuple(a), tuple(b)) for a, b in zip(bl.tolist(), br.tolist(), strict=True)] == want
    moved = per_byte(cl, cr)
    assert moved == per_byte(bl, br)
    # Destinations never overlap (local ids are distinct).
    dst = [(ld, la) for ld, la, _, _ in moved]
    assert len(set(dst)) == len(dst)
    # Each descriptor lies inside one region, on both sides, and inside the slice of every block.
    for (la, ln, ld), (ra, _, rd) in zip(cl.tolist(), cr.tolist(), strict=True):
        assert any(r.device == ld and r.base <= la and la + ln <= r.base + r.stride * r.num_blocks for r in lregs)
        assert any(r.device == rd and r.base <= ra and ra + ln <= r.base + r.stride * r.num_blocks for r in rregs)
    for _ld, la, _rd, ra in moved:
        for regs, addr, slices, index in ((lregs, la, src.local_slices, src.local_slice),
                                          (rregs, ra, src.remote_slices, src.remote_slice)):
            (reg,) = [r for r in regs if r.base <= addr < r.base + r.stride * r.num_blocks]
            off, length = slice_span(reg.stride, slices, index)
            assert off <= (addr - reg.base) % reg.stride < off + length


@SETTINGS(200)
@given(st.data())
def test_prepped_indices_select_the_per_block_descriptors(data: st.DataObject) -> None:
    """NIXL's "prepped" path: the local list over every local region (region-major), the remote
    list over every remote region, indexed by read_indices at the paired local positions, must
    select the same descriptor pairs as the per-block list of "descs" mode."""
    lregs_all, rregs, local, remote, src = data.draw(region_pairs())
    # The local rank holds more regions than the remote one (PP), in another order.
    extra = data.draw(st.integers(0, 2))
    nloc = len(rregs) + extra
    positions = data.draw(st.permutations(range(nloc)))[:len(rregs)]
    local_regions: list[Region | None] = [None] * nloc
    for k, pos in enumerate(positions):
        local_regions[pos] = lregs_all[k]
    num = lregs_all[0].num_blocks
    filler_stride = lregs_all[0].stride
    top = max(r.base + r.stride * r.num_blocks for r in lregs_all)
    for i in range(nloc):
        if local_regions[i] is None:
            local_regions[i] = Region(top, filler_stride, num, lregs_all[0].device)
            top += filler_stride * num
    lfull = _all_blocks_np(local_regions, src.local_slices, src.local_slice)  # type: ignore[arg-type]
    rfull = _all_blocks_np(rregs, src.remote_slices, src.remote_slice)
    li, ri = read_indices(tuple(local), tuple(remote), num, rregs[0].num_blocks, positions)
    bl, br = read_descs(local, remote, [local_regions[p] for p in positions], rregs, merge=False,  # type: ignore[misc]
                        local_slice=src.local_slice, local_slices=src.local_slices,
                        remote_slice=src.remote_slice, remote_slices=src.remote_slices)
    assert lfull[li].tolist() == bl.tolist()
    assert rfull[ri].tolist() == br.tolist()


def _all_blocks_np(regions: list[Region], slices: int, index: int) -> np.ndarray:
    if HAVE_NIXL:
        return _all_blocks(regions, slices, index)
    parts = []
    for reg in regions:
        off, length = slice_span(reg.stride, slices, index)
        parts.append([[reg.base + b * reg.stride + off, length, reg.device] for b in range(reg.num_blocks)])
    return np.array([row for part in parts for row in part], dtype=np.uint64)


# --- topology ----------------------------------------------------------------------------------


@SETTINGS(400)
@given(st.sampled_from([1, 2, 3, 4, 6, 8]), st.sampled_from([1, 2, 3, 4, 6, 8]), st.sampled_from([1, 2, 3]),
       st.booleans(), st.booleans(), st.integers(1, 3))
def test_every_head_of_every_layer_is_read_once_and_every_producer_rank_hears_its_count(
        p_tp: int, d_tp: int, p_pp: int, same_pp: bool, mla: bool, mult: int) -> None:
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        return
    d_pp = p_pp if same_pp else 1
    heads = 1 if mla else max(p_tp, d_tp) * mult
    p_heads, d_heads = (1, 1) if mla else (heads // p_tp, heads // d_tp)
    layers = p_pp * 2
    heard: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for q in range(d_pp):
        d_layers = range(q * layers // d_pp, (q + 1) * layers // d_pp)
        for d in range(d_tp):
            plan = read_plan(Layout(d_tp, d_pp, d, q), Layout(p_tp, p_pp), mla)
            assert plan.of == expected_notifications(p_tp, d_tp)
            covered: Counter[tuple[int, int]] = Counter()
            for src in plan.sources:
                assert 0 <= src.pp_rank < p_pp and 0 <= src.tp_rank < p_tp
                # The heads the source moves, in global numbering, on both sides.
                r_len, l_len = p_heads // src.remote_slices, d_heads // src.local_slices
                assert r_len == l_len > 0 and p_heads % src.remote_slices == 0 == d_heads % src.local_slices
                r_first = (0 if mla else src.tp_rank * p_heads) + src.remote_slice * r_len
                l_first = (0 if mla else d * d_heads) + src.local_slice * l_len
                assert r_first == l_first, (src, d)
                p_layers = range(src.pp_rank * layers // p_pp, (src.pp_rank + 1) * layers // p_pp)
                for x in p_layers:
                    for h in range(l_first, l_first + l_len):
                        covered[(x, h)] += 1
            mine = (range(1) if mla else range(d * d_heads, (d + 1) * d_heads))
            assert covered == Counter({(x, h): 1 for x in d_layers for h in mine}), (q, d, plan)
            told = [(s.pp_rank, s.tp_rank) for s in plan.sources] + list(plan.notify_only)
            assert len(set(told)) == len(told)
            for rank in told:
                heard[rank].append((plan.part, plan.of))
    want = expected_notifications(p_tp, d_tp)
    assert set(heard) == {(pp, t) for pp in range(p_pp) for t in range(p_tp)}
    for rank, parts in heard.items():
        assert sorted(parts) == [(i, want) for i in range(want)], rank


# --- explicit examples ---------------------------------------------------------------------------


def _scenario(**kw: Any) -> Scenario:
    base: dict[str, Any] = dict(p_tp=1, d_tp=1, p_pp=1, d_pp=1, layers=1, heads=4, head_bytes=4, mla=False,
                                p_blocks=8, d_blocks=8, remote=[], local=[], seed=7)
    base.update(kw)
    layers, p_pp, d_pp = base["layers"], base["p_pp"], base["d_pp"]
    base.setdefault("p_orders", {(q, t): list(range(q * layers // p_pp, (q + 1) * layers // p_pp))[::-1]
                                 for q in range(p_pp) for t in range(base["p_tp"])})
    base.setdefault("d_orders", {(q, d): list(range(q * layers // d_pp, (q + 1) * layers // d_pp))[::-1]
                                 for q in range(d_pp) for d in range(base["d_tp"])})
    return Scenario(**base)


@pytest.mark.parametrize(("p_tp", "d_tp", "mla"), [(4, 2, False), (1, 2, False), (2, 4, True), (4, 1, True)])
def test_prefix_hit_reversed_table_repeated_remote_ids_pp2_into_pp1(p_tp: int, d_tp: int, mla: bool) -> None:
    """A partial prefix hit (the last 4 of 6 remote blocks), a reversed local table, a remote id
    repeated, PP 2 into PP 1, layers registered in reverse, adjacent int16 regions: the torch
    read, checked against the reference (the sim transport has no PP)."""
    sc = _scenario(p_tp=p_tp, d_tp=d_tp, mla=mla, p_pp=2, layers=4, remote=[0, 1, 5, 5, 6, 2], local=[7, 6, 5, 4],
                   shared=True, dtype=torch.int16)
    assert sc.remote == [5, 5, 6, 2]
    assert_matches_reference(sc, run_torch(sc))


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_sim_torch_agree_on_a_fragmented_table(p_tp: int, d_tp: int) -> None:
    sc = _scenario(p_tp=p_tp, d_tp=d_tp, remote=[3, 4, 0, 7, 7, 1], local=[0, 1, 2, 6, 5, 3], chunk=3)
    sim, torch_out = run_sim(sc), run_torch(sc)
    assert_matches_reference(sc, sim)
    assert_matches_reference(sc, torch_out)


@pytest.mark.nixl
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed")
@pytest.mark.parametrize(("p_tp", "d_tp", "xfer_mode"), [(4, 1, "prepped"), (1, 4, "descs"), (2, 2, "prepped")])
def test_nixl_prefix_hit_fragmented_table_pp2_into_pp1(p_tp: int, d_tp: int, xfer_mode: str) -> None:
    sc = _scenario(p_tp=p_tp, d_tp=d_tp, p_pp=2, layers=4, heads=4, remote=[2, 3, 4, 0, 0, 7], local=[1, 2, 6, 3],
                   shared=True)
    assert_matches_reference(sc, run_nixl(sc, xfer_mode))


def test_consumer_tp_above_the_kv_heads_unsaid_is_refused_not_misread() -> None:
    """2 KV heads, producer TP 1, consumer TP 4: each consumer rank holds one replicated head
    (vLLM's tp_size > num_kv_heads). Not told the model's heads (``kv_heads`` 0), the plan takes
    every rank to hold a distinct share and slices the producer block in 4 (half a head); the
    slice sizes differ from the local block (one head), so the read is refused at post time: no
    wrong bytes. Told (below), the plan reads the whole head."""
    tnet = TorchNetwork()
    p = TorchTransport(tnet, name("P"), [torch.zeros(4, 2, 8, dtype=torch.uint8)])
    d = TorchTransport(tnet, name("D"), [torch.zeros(4, 1, 8, dtype=torch.uint8)], tp_rank=1)
    try:
        p.bind(lambda ev: None, time.monotonic_ns)
        d.bind(lambda ev: None, time.monotonic_ns)
        d.add_peer(("P", 0), HandshakeReply(engine_id="P", compat_hash="", tp_size=1, ranks=(p.rank_info(),)))
        (src,) = read_plan(Layout(4, 1, 1), Layout(1), False).sources
        with pytest.raises(Exception, match="slice sizes differ"):
            d.post_read(PostRead("r", "P", src, (0,), (0,), Notification("p", 1, 4)))
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize(("p_tp", "d_tp", "kv_heads"), [(1, 4, 2), (4, 1, 2), (2, 4, 1), (4, 2, 1), (4, 4, 2)])
def test_a_tp_above_the_kv_heads_reads_each_head_once_sim_and_torch(p_tp: int, d_tp: int, kv_heads: int) -> None:
    """Heads replicated over ranks (a TP larger than the model's KV heads, said as ``kv_heads``),
    on the decode side, the prefill side or both: every consumer rank gets its heads (read once,
    from the first covered rank holding them), and every producer rank, copies included, hears
    the parts it expects (check_notifications, in the runners)."""
    sc = _scenario(p_tp=p_tp, d_tp=d_tp, heads=kv_heads, kv_heads=kv_heads, remote=[3, 4, 0, 7, 7, 1],
                   local=[0, 1, 2, 6, 5, 3], chunk=3)
    assert_matches_reference(sc, run_sim(sc))
    assert_matches_reference(sc, run_torch(sc))


@pytest.mark.nixl
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL is not installed")
@pytest.mark.parametrize(("p_tp", "d_tp", "kv_heads", "xfer_mode"), [(1, 4, 2, "prepped"), (4, 1, 2, "descs"),
                                                                     (4, 2, 1, "prepped"), (2, 4, 1, "descs")])
def test_nixl_a_tp_above_the_kv_heads_pp2_into_pp1(p_tp: int, d_tp: int, kv_heads: int, xfer_mode: str) -> None:
    sc = _scenario(p_tp=p_tp, d_tp=d_tp, p_pp=2, layers=4, heads=kv_heads, kv_heads=kv_heads,
                   remote=[2, 3, 4, 0, 0, 7], local=[1, 2, 6, 3], shared=True)
    assert_matches_reference(sc, run_nixl(sc, xfer_mode))
