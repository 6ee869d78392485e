"""Leases and clock domains end to end, through Connectors on the simulated transport.

One true time (``World.now``); each process reads it through its own clocks: a monotonic clock
(``clock``, any offset: another node's CLOCK_MONOTONIC) and a wall clock (``wall_clock``, NTP
keeps hosts within milliseconds unless a test says otherwise). The scheduler has a monotonic
clock of its own. Each test asserts what docs/embedding.md and docs/decisions.md promise: a read
is trusted only if it completes ``lease_margin_ns`` before the producer's lease can have run out
("What the decode side trusts ends with the lease it was given, counted from the issue").
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from helpers import reply

from pdfsm.connector import Connector, ConnectorMetadata, KVTransferParams
from pdfsm.events import CoreConfig
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern

S = 1_000_000_000
MS = 1_000_000
WALL0 = 1_700_000_000 * S  # a plausible time.time_ns()
BB = 64  # bytes per simulated block (whole block at TP 1)


class World:
    """Producer P (TP 1) and decode D (TP ``d_tp``), every process on its own clocks."""

    def __init__(self, *, d_tp: int = 1, p_lease_ns: int = 4 * S, p_off: int = 0, p_wall: int = 0,
                 d_offs: tuple[int, ...] | None = None, d_walls: tuple[int, ...] | None = None,
                 s_off: int = 0, d_cfg: dict[str, Any] | None = None, start: int = 50 * S) -> None:
        self.net, self.now = SimNetwork(), start
        self.p_off, self.p_wall, self.s_off = p_off, p_wall, s_off
        self.d_offs = d_offs or (0,) * d_tp
        self.d_walls = d_walls or (0,) * d_tp
        self.pt = SimTransport(self.net, "P-0", num_blocks=64, block_bytes=BB)
        self.pt.fill(range(64))
        self.p = Connector(CoreConfig(engine_id="P", compat_hash="h", lease_ns=p_lease_ns), self.pt,
                           SimHandshaker(self.net), clock=lambda: self.now + self.p_off,
                           wall_clock=lambda: WALL0 + self.now + self.p_wall, port=9)
        pt = self.pt
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(pt.rank_info(),)))
        self.dt = [SimTransport(self.net, f"D-{r}", tp_rank=r, num_blocks=64, block_bytes=BB // d_tp)
                   for r in range(d_tp)]
        self.d = [Connector(CoreConfig(engine_id="D", compat_hash="h", tp_rank=r, tp_size=d_tp, **(d_cfg or {})),
                            self.dt[r], SimHandshaker(self.net), clock=self._dclock(r), wall_clock=self._dwall(r))
                  for r in range(d_tp)]
        self.received: list[set[str]] = [set() for _ in range(d_tp)]
        self.failed: list[dict[str, Any]] = [{} for _ in range(d_tp)]
        self.released: list[str] = []
        self.expired: list[str] = []

    def _dclock(self, r: int) -> Any:
        return lambda: self.now + self.d_offs[r]

    def _dwall(self, r: int) -> Any:
        return lambda: WALL0 + self.now + self.d_walls[r]

    def sched(self) -> int:
        """The decode scheduler's own CLOCK_MONOTONIC."""
        return self.now + self.s_off

    def run(self, steps: int = 1, dt: int = 0) -> None:
        for _ in range(steps):
            self.now += dt
            for r, d in enumerate(self.d):
                got = d.get_finished()[1]
                for off in d.last.failed:
                    self.failed[r][off.request_id] = off
                self.received[r] |= got - set(self.failed[r]) - d.last.aborted
            self.released += sorted(self.p.get_finished()[0])
            self.expired += sorted(self.p.last.expired)

    def connect(self) -> None:
        params = self.p.request_finished("warm-up", [63])
        for d in self.d:
            d.load("warm-up", [63], params)
        self.run(3)
        assert all("warm-up" in got for got in self.received), self.failed
        assert self.released == ["warm-up"]
        self.released.clear()
        for got in self.received:
            got.clear()

    def reuse(self, blocks: list[int]) -> None:
        for b in blocks:
            self.pt.memory[b * BB:(b + 1) * BB] = pattern("another-request", b, BB)

    def bytes_ok(self, r: int, local: list[int], remote: list[int]) -> bool:
        """Decode rank ``r``'s slice of each local block holds the producer's original bytes."""
        n = len(self.d)
        width = BB // n
        for lb, rb in zip(local, remote, strict=True):
            want = pattern("P-0", rb, BB)[r * width:(r + 1) * width]
            if self.dt[r].block(lb) != want:
                return False
        return True


def _true_trust(w: World, r: int, rid: str) -> int:
    """Decode rank ``r``'s trust bound for ``rid``, as a true time."""
    m = w.d[r].core.consumers[rid]
    assert m.trust is not None
    return m.trust - w.d_offs[r]


# --- 1. decode TP over nodes whose CLOCK_MONOTONICs differ wildly ----------------------------------------


@pytest.mark.parametrize("issued", [True, False], ids=["issued_wall_ns", "no_issued_wall_ns"])
def test_decode_ranks_on_wildly_skewed_nodes_trust_up_to_one_real_instant(issued: bool) -> None:
    """docs/embedding.md: ``lease_ages`` carries "how long before build_connector_meta the params
    arrived, both readings on the scheduler's own clock. A duration means the same on every node"
    and "The worker counts the lease from now - age". Decode TP 2 over two nodes whose
    CLOCK_MONOTONICs read 10**18 ahead of and 7000 s behind the true time, the scheduler's a
    third clock. Both ranks must stop trusting at the same true instant, no later than the
    producer's lease less the margin; a read completing after the producer's lease (blocks
    reused) is received by neither rank."""
    w = World(d_tp=2, d_offs=(10**18, -7000 * S), s_off=123 * S, p_off=-5 * S)
    w.connect()
    t_issue = w.now
    params = w.p.request_finished("p1", [1, 2])
    if not issued:
        params = msgspec.structs.replace(params, issued_wall_ns=0)
    w.now += S // 2
    arrived = w.sched()  # the params reach the decode scheduler
    w.now += 2 * S  # they queue; then build_connector_meta
    age = w.sched() - arrived
    for r in range(2):
        w.net.script("d1", 0, 0, ReadScript(polls=10**6))  # hangs until cancelled (re-armed per rank)
        w.d[r].start_load_kv(ConnectorMetadata(reqs_to_recv={"d1": ((5, 6), params)}, lease_ages={"d1": age}))
    trusts = [_true_trust(w, r, "d1") for r in range(2)]
    margin = CoreConfig(engine_id="x").lease_margin_ns
    bound = (t_issue if issued else t_issue + S // 2) + 4 * S - margin
    assert trusts[0] == trusts[1], f"ranks trust up to different true instants: {trusts}"
    assert trusts[0] <= bound, f"trusted until {trusts[0]}, past {bound}"


# --- 2. wall clocks within the margin of each other ---------------------------------------------------------


@pytest.mark.parametrize("skew", [-(S - MS), S - MS], ids=["decode_wall_behind", "decode_wall_ahead"])
def test_params_that_spent_most_of_the_lease_in_a_router_queue_with_wall_skew_inside_the_margin(skew: int) -> None:
    """docs/embedding.md: the decode side counts the params' time on the way from its own wall
    clock; "This assumes the hosts' wall clocks agree within lease_margin_ns ... a decode clock
    behind the producer's shortens the measured transit by that much, which the margin covers."
    The params spend 3.5 s of a 4 s lease in a router queue; the decode wall clock is 999 ms
    behind (or ahead of) the producer's. ``load`` runs as they arrive (no lease_start_ns). The
    read completes at 3.9 s after issue, before the producer's lease, then the producer reuses its
    blocks at 4 s: whatever the decode side decides, it must never trust past 4 s (true time)."""
    w = World(d_walls=(skew,), d_offs=(77 * S,))
    w.connect()
    t_issue = w.now
    params = w.p.request_finished("p1", [1, 2])
    w.now = t_issue + 3 * S + S // 2
    w.net.script("d1", 0, 0, ReadScript(polls=10**6))
    w.d[0].load("d1", [5, 6], params)
    w.d[0].step()
    m = w.d[0].core.consumers.get("d1")
    if m is not None and m.trust is not None:
        assert m.trust - w.d_offs[0] <= t_issue + 4 * S, "trusted past the producer's lease"


# --- 3. a heartbeat extends the producer's lease while the decode read is slow --------------------------


def test_heartbeat_extends_the_producer_but_decode_trusts_only_the_original_lease_and_both_sides_agree() -> None:
    """docs/embedding.md: "a heartbeat keeps the producer's blocks from being reused under a read
    already running, and what the decode side trusts still ends with the lease it was given".
    A read is slow; the decode scheduler heartbeats (10 s) at 2 s; the producer extends. The read
    completes at 3.5 s (true), after the original lease less the 1 s margin (3 s) but inside
    both the original lease and the extension. The decode side must not report it received;
    the producer must not have released before the read stopped, and releases exactly once."""
    w = World(d_offs=(-3 * S,), p_off=9 * S)
    w.connect()
    t0 = w.now
    params = w.p.request_finished("p1", [1, 2])
    w.net.script("d1", 0, 0, ReadScript(polls=10**6))
    w.d[0].load("d1", [5, 6], params)
    w.run(1)
    w.now = t0 + 2 * S
    assert w.d[0].heartbeat(params, 10 * S) == 1
    w.run(1)
    w.now = t0 + 3 * S + S // 2
    w.run(2)
    w.now = t0 + 20 * S
    w.run(3)
    assert "d1" not in w.received[0]
    assert "d1" in w.failed[0] and set(w.failed[0]["d1"].invalid_blocks) == {5, 6}
    assert w.released.count("p1") == 1


# --- 4. the documented heartbeat recipe for lease_start_ns --------------------------------------------


def test_a_lost_heartbeat_never_makes_reused_blocks_trusted() -> None:
    """docs/decisions.md "What `lease_start_ns` means after a heartbeat": nothing; the start is
    the params' arrival (an earlier version of that decision moved it later by a heartbeat, and
    with params that do not say ``issued_wall_ns`` a lost heartbeat then trusted reused blocks).
    Params without ``issued_wall_ns``, a heartbeat lost on the wire (UCCL issue 1015), the
    producer's lease expires and its blocks are reused; the load passes the arrival as the rule
    says: the read is not reported received with the reused bytes."""
    w = World()
    w.connect()
    t0 = w.now
    params = msgspec.structs.replace(w.p.request_finished("p1", [1, 2]), issued_wall_ns=0)
    w.now = t0 + 2 * S
    w.net.fault_notification("p1", "drop")
    assert w.d[0].heartbeat(params, 10 * S) == 1
    w.now = t0 + 4 * S
    w.run(1)
    assert w.expired == ["p1"]
    w.reuse([1, 2])
    w.now = t0 + 5 * S
    w.net.script("d1", 0, 0, ReadScript(polls=1))
    w.d[0].load("d1", [5, 6], params, lease_start_ns=t0)  # the lease the params gave is over
    w.run(3)
    assert "d1" not in w.received[0], "reused blocks reported received"


# --- 5. the producer's lease and the lease_ns it puts in the params -----------------------------------


@pytest.mark.parametrize("override", [None, 2 * S, 9 * S])
def test_producer_releases_no_earlier_than_the_params_say(override: int | None) -> None:
    """docs/embedding.md: params carry "the producer's lease: it bounds how long a read is
    trusted". The producer (its monotonic clock 10**17 ahead of true time) holds with its config's
    lease or ``request_finished``'s ``lease_ns``: it must not expire the hold before
    ``issued_wall_ns + lease_ns`` (true time), and does so by then plus a step."""
    w = World(p_off=10**17)
    w.connect()
    kw = {} if override is None else {"lease_ns": override}
    params = w.p.request_finished("p1", [1, 2], **kw)
    lease = params.lease_ns
    assert lease == (override or 4 * S)
    issue = params.issued_wall_ns - WALL0
    w.now = issue + lease - 1
    w.run(1)
    assert w.expired == []
    w.now = issue + lease
    w.run(1)
    assert w.expired == ["p1"]


# --- 6. random schedules, every process on its own clocks ----------------------------------------------


def _skewed_schedule(seed: int) -> list[str]:
    import random

    rnd = random.Random(seed)
    d_tp = rnd.choice([1, 2])
    lease = rnd.choice([200_000, 1_000_000, 5_000_000])
    margin = rnd.choice([1, lease // 10, lease // 3])
    walls = tuple(rnd.randint(-(margin - 1), margin - 1) if rnd.random() < 0.7 else 0 for _ in range(d_tp))
    offs = tuple(rnd.choice([0, 10**18, -(10**15), rnd.randint(-(10**12), 10**12)]) for _ in range(d_tp))
    w = World(d_tp=d_tp, p_lease_ns=lease, p_off=rnd.choice([0, 10**17, -(10**13)]), d_offs=offs,
              d_walls=walls, s_off=rnd.choice([0, -(10**14), 10**16]),
              d_cfg={"lease_margin_ns": margin, "read_timeout_ns": rnd.choice([lease // 2, 3 * lease])})
    w.connect()
    errors: list[str] = []
    free = list(range(1, 60))
    dfree = list(range(1, 60))
    held: dict[str, list[int]] = {}
    router: list[tuple[int, str, KVTransferParams]] = []  # (true delivery time, rid, params)
    queued: dict[str, tuple[int, KVTransferParams, list[int]]] = {}  # rid -> (sched arrival, params, d-clock)
    loads: dict[str, tuple[list[int], list[int]]] = {}
    n = 0
    for step in range(rnd.randint(30, 90)):
        op = rnd.random()
        if op < 0.3 and len(free) >= 2:
            rid = f"r{n}"
            n += 1
            blocks = [free.pop(rnd.randrange(len(free))) for _ in range(rnd.randint(1, 2))]
            for b in blocks:
                w.pt.memory[b * BB:(b + 1) * BB] = pattern("P-0", b, BB)
            params = w.p.request_finished(rid, blocks, lease_ns=rnd.choice([None, None, lease // 2, 2 * lease]))
            held[rid] = blocks
            router.append((w.now + rnd.choice([0, lease // 5, lease // 2, lease, 2 * lease]), rid, params))
        for item in [x for x in router if x[0] <= w.now]:  # the router delivers to the decode scheduler
            router.remove(item)
            queued[item[1]] = (w.sched(), item[2], [w.now + o for o in w.d_offs])
        if rnd.random() < 0.2 and queued:
            rid = rnd.choice(sorted(queued))
            params = queued[rid][1]
            if rnd.random() < 0.4:
                w.net.fault_notification(rid, "drop")
            w.d[0].heartbeat(params, rnd.choice([lease, 10 * lease]))
        if rnd.random() < 0.5 and queued:
            rid = rnd.choice(sorted(queued))
            arrived, params, d_arrived = queued.pop(rid)
            if len(dfree) < len(params.remote_block_ids):
                continue
            local = [dfree.pop() for _ in params.remote_block_ids]
            polls = rnd.choice([0, 1, 3, 10, 40])
            how = rnd.choice(["ages", "start", "none"])
            for r, d in enumerate(w.d):
                w.net.script("d" + rid, 0, 0, ReadScript(polls=polls))
                if how == "ages":
                    d.start_load_kv(ConnectorMetadata(reqs_to_recv={"d" + rid: (tuple(local), params)},
                                                      lease_ages={"d" + rid: w.sched() - arrived}))
                elif how == "start":
                    d.load("d" + rid, local, params, lease_start_ns=d_arrived[r])
                else:
                    d.load("d" + rid, local, params)
            loads["d" + rid] = (local, list(params.remote_block_ids))
        w.now += rnd.choice([1, 1000, lease // 20, lease // 5, lease // 2, lease])
        for r, d in enumerate(w.d):
            got = d.get_finished()[1]
            bad = {o.request_id for o in d.last.failed} | d.last.aborted
            for rid in got - bad:
                local, remote = loads[rid]
                if not w.bytes_ok(r, local, remote):
                    errors.append(f"seed {seed}: rank {r} received {rid} with reused bytes")
        for rid in w.p.get_finished()[0]:
            for b in held.pop(rid):
                w.pt.memory[b * BB:(b + 1) * BB] = pattern("reused", b + step, BB)
                free.append(b)
    return errors


def test_random_schedules_on_skewed_clocks_never_trust_reused_blocks() -> None:
    """Random seeded schedules: decode TP 1 or 2, every process's CLOCK_MONOTONIC offset wildly
    (10**18, -10**15, ...), the scheduler's another, decode wall clocks within the margin of the
    producer's (the documented assumption), params delayed in the router up to two leases, queued at
    the decode scheduler, loaded through ``lease_ages``, ``lease_start_ns`` (the arrival on the
    worker's clock) or at once, heartbeats sent and sometimes dropped, lease overrides, slow reads.
    The producer overwrites blocks as soon as it reports them released. No decode rank may report a
    read of overwritten blocks received."""
    errors: list[str] = []
    for seed in range(200):
        errors += _skewed_schedule(seed)
    assert not errors, errors[:5]
