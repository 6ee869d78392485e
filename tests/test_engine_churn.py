"""Engine churn through Connectors over the simulated transport and handshaker.

Producers restarting under one engine id, handshakes failing and retried after the pause, many
engines handshaken and forgotten, deadlines passing while a handshake runs, a PP producer whose
stage 1 keeps failing. Invariants checked throughout: each consumer request is reported exactly
once; a failed one lists its blocks invalid in the same step; no read is posted to an engine that
is not connected (no SETUP failure); nothing that a peer or the network did is blamed on the
local side (docs/decisions.md, "Production mode quarantines local faults only").
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from helpers import ev, make_core, read, reply

from pdfsm.commands import HandOff, SendNotification, StartHandshake
from pdfsm.connector import Connector, KVTransferParams
from pdfsm.events import (
    AbortRequested,
    Collect,
    CoreConfig,
    EngineWanted,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    HandshakeReply,
    NotificationReceived,
    PeerAdded,
    PeerDisconnected,
    RankInfo,
    Source,
    Tick,
)
from pdfsm.fsm import Fault
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern

US = 1_000


class World:
    """One decode Connector D and any number of producer Connectors on one simulated network and
    one shared clock (1 us per step). Producers are keyed by name; each listens at 127.0.0.1:port
    under an engine id, and can be restarted (a new agent and incarnation, the same id and port)."""

    def __init__(self, **d_cfg: Any) -> None:
        self.net, self.now = SimNetwork(), 0
        self.prods: dict[str, tuple[str, int, SimTransport, Connector]] = {}
        self.gen = 0
        self.cons = SimTransport(self.net, "D-0", num_blocks=512)
        cfg = {"engine_id": "D", "compat_hash": "h", "lease_margin_ns": 100, **d_cfg}
        self.d = Connector(CoreConfig(**cfg), self.cons, SimHandshaker(self.net), clock=self.clock)
        self.reports: Counter[str] = Counter()
        self.offs: dict[str, HandOff] = {}
        self.step_invalid: dict[str, set[int]] = {}  # per request: the invalid set of the step it was reported in
        self.loaded: dict[str, tuple[int, ...]] = {}

    def clock(self) -> int:
        return self.now

    def producer(self, name: str, engine_id: str, port: int, *, serve: bool = True) -> Connector:
        self.gen += 1
        t = SimTransport(self.net, f"{name}-a{self.gen}", num_blocks=64)
        t.fill(range(64))
        p = Connector(CoreConfig(engine_id=engine_id, compat_hash="h"), t, SimHandshaker(self.net),
                      clock=self.clock, port=port)
        if serve:
            def answer(pp: int, t: SimTransport = t, e: str = engine_id) -> HandshakeReply:
                return reply(e, ranks=(t.rank_info(),), num_blocks=t.num_blocks)

            self.net.serve("127.0.0.1", port, answer)
        self.prods[name] = (engine_id, port, t, p)
        return p

    def restart(self, name: str) -> Connector:
        engine_id, port, t, _ = self.prods[name]
        self.net.kill(t.agent)
        return self.producer(name, engine_id, port)

    def params(self, name: str, prid: str, blocks: list[int]) -> KVTransferParams:
        return self.prods[name][3].request_finished(prid, blocks)

    def load(self, rid: str, local: list[int], params: KVTransferParams | dict[str, Any]) -> None:
        self.d.load(rid, local, params)
        self.loaded[rid] = tuple(local)

    def run(self, steps: int = 4, dt: int = US) -> None:
        for _ in range(steps):
            self.now += dt
            _, got = self.d.get_finished()
            invalid = set(self.d.last.invalid_block_ids)
            for rid in got:
                self.reports[rid] += 1
                self.step_invalid[rid] = invalid
            for off in self.d.last.failed:
                self.offs[off.request_id] = off
            for _, _, t, p in self.prods.values():
                if t.agent not in self.net.dead:
                    p.get_finished()

    def failed(self) -> set[str]:
        return set(self.offs)

    def received_ok(self, rid: str, name: str, remote: list[int]) -> bool:
        agent = self.prods[name][2].agent
        return all(self.cons.block(lb) == pattern(agent, rb, 64)
                   for lb, rb in zip(self.loaded[rid], remote, strict=True))

    def setup_failures(self) -> list[Any]:
        return [r for r in self.d.core.log.records()
                if isinstance(r.event, HandleFailed) and r.event.why is HandleFailure.SETUP]

    def check_invariants(self) -> None:
        assert all(n == 1 for n in self.reports.values()), f"reported more than once: {self.reports}"
        for rid, off in self.offs.items():
            assert set(off.invalid_blocks) == set(self.loaded[rid]), (rid, off)
            assert set(self.loaded[rid]) <= self.step_invalid[rid], (rid, self.step_invalid[rid])
            assert off.policy == "recompute"
        assert not self.setup_failures(), "a read was posted to an engine that was not connected"
        assert self.d.core.violations[Fault.LOCAL] == 0, [
            (r.seq, type(r.event).__name__, r.reason) for r in self.d.core.log.records() if r.fault is Fault.LOCAL]


# --- 1. a producer restarting repeatedly under one engine id --------------------------------------


def test_producer_restarting_five_times_with_requests_in_every_state_keeps_every_invariant() -> None:
    """Each round: a read hangs in flight, the producer dies and comes back under the same engine id
    and port (a new incarnation), then params minted by the dead process and fresh params are loaded
    in one step, plus fresh params loaded while the re-handshake runs. The stale-params request fails
    (recompute, blocks invalid, decisions.md "Params name the producer process that minted them"),
    the hung read fails DISCONNECTED (a remote fault), every fresh request reads the new process's
    bytes; every request is reported once and nothing is blamed on the local side."""
    w = World(handshake_retry_ns=10 * US)
    w.producer("P", "P", 9)
    w.load("warm", [0], w.params("P", "pw", [0]))
    w.run(4)
    assert w.reports == Counter({"warm": 1}) and not w.failed()
    blk = 10
    for k in range(5):
        # a read in flight that will never complete on its own
        w.net.script(f"hang{k}", 0, 0, ReadScript(end="hang"))
        w.load(f"hang{k}", [blk], w.params("P", f"ph{k}", [1]))
        stale = w.params("P", f"ps{k}", [2])  # minted by this process, loaded after it died
        w.run(2)
        w.restart("P")
        w.run(2)
        w.load(f"stale{k}", [blk + 1], stale)
        w.load(f"fresh{k}", [blk + 2], w.params("P", f"pf{k}", [3]))
        w.run(1)
        w.load(f"joined{k}", [blk + 3], w.params("P", f"pj{k}", [4]))
        w.run(6)
        assert w.reports[f"hang{k}"] == 1 and f"hang{k}" in w.failed()
        assert w.reports[f"stale{k}"] == 1 and f"stale{k}" in w.failed()
        for rid, rb in ((f"fresh{k}", 3), (f"joined{k}", 4)):
            assert w.reports[rid] == 1 and rid not in w.failed(), (rid, w.offs.get(rid))
            assert w.received_ok(rid, "P", [rb])
        blk += 4
    w.check_invariants()


# --- 2. the retry pause and an engine id that moved -------------------------------------------------


def test_fresh_params_at_the_producers_new_address_are_not_failed_with_the_old_addresss_cached_error() -> None:
    """A producer moved: engine id P is now served at port 10; port 9 refuses. Stale params still
    naming port 9 make a handshake there, which fails; fresh params naming port 10 arrive within
    the retry pause. decisions.md ("An engine id names one address") says params placing an engine
    at another host:port are judged against the address it was handshaken at, "so a producer that
    really moved is handshaken afresh by the next request"; the pause exists so that "a dead producer
    is not hammered" -- but port 10 was never tried. Expected: the port-10 request handshakes port 10
    and reads, instead of failing with "connection refused by 127.0.0.1:9" for a whole pause."""
    w = World(handshake_retry_ns=1_000 * US)
    w.producer("P", "P", 10)
    w.net.handshake_faults[("127.0.0.1", 9)] = "refuse"
    old = w.params("P", "p-old", [1]).to_dict() | {"remote_port": 9}
    w.load("old", [20], old)
    w.run(3)
    assert "old" in w.failed()
    w.load("new", [21], w.params("P", "p-new", [2]))
    w.run(4)
    assert w.reports["new"] == 1
    assert "new" not in w.failed(), f"failed with another address's cached error: {w.offs['new'].reason}"
    assert w.received_ok("new", "P", [2])
    w.check_invariants()


def test_fresh_params_at_the_new_address_do_not_join_a_handshake_still_running_at_the_old_one() -> None:
    """As above, but the fresh params arrive while the handshake to the old address still runs
    (its connect has not timed out yet). They joined it and failed with "connection refused by
    127.0.0.1:9", an address they never named: recomputed, the wrong peer blamed, and every request
    for the moved producer failed the same way until the old attempt ended (vLLM PR 18903, smg
    issue 2382: an engine id served at another address). Found by review. Expected: the request is
    set aside, and handshakes its own address as soon as the old attempt ends."""
    w = World(handshake_retry_ns=1_000 * US)
    w.producer("P", "P", 10)
    w.net.handshake_faults[("127.0.0.1", 9)] = "refuse"
    w.net.handshake_polls = 3  # the refusal takes a few steps to come back
    w.load("old", [20], w.params("P", "p-old", [1]).to_dict() | {"remote_port": 9})
    w.run(1)
    e = w.d.core.engines[("P", 0)]
    assert e.state.name == "HANDSHAKING" and e.port == 9
    w.load("new", [21], w.params("P", "p-new", [2]))
    w.run(1)
    assert "new" in e.aside and "new" not in e.waiters
    w.run(10)
    assert "old" in w.failed() and "refused by 127.0.0.1:9" in w.offs["old"].reason
    assert w.reports["new"] == 1 and "new" not in w.failed(), w.offs.get("new")
    assert w.received_ok("new", "P", [2])
    assert "p-new" not in w.prods["P"][3].core.producers, "the moved producer's hold is released by the notification"
    w.check_invariants()


def test_fresh_params_set_aside_then_judged_against_the_old_address_that_answered() -> None:
    """The old address still answers (its process drains, same engine id): the attempt there
    connects, and the request set aside is judged against that connection as one that waited for
    it always was (decisions.md, "An engine id names one address"): refused once, naming the
    address the engine was handshaken at, nothing evicted; the next such request, once nothing
    holds the old connection, evicts it, handshakes the new address and reads (before, it was
    refused too, and only the one after it read)."""
    w = World(handshake_retry_ns=1_000 * US)
    w.producer("old", "P", 9)
    w.producer("new", "P", 10)
    w.net.handshake_polls = 3
    w.load("a", [20], w.params("old", "p-a", [1]))
    w.run(1)
    w.load("b", [21], w.params("new", "p-b", [2]))
    w.run(10)
    assert w.reports["a"] == 1 and "a" not in w.failed() and w.received_ok("a", "old", [1])
    assert w.reports["b"] == 1 and "handshaken at 127.0.0.1:9" in w.offs["b"].reason
    w.load("c", [22], w.params("new", "p-c", [3]))
    w.run(10)
    assert w.reports["c"] == 1 and "c" not in w.failed() and w.received_ok("c", "new", [3])
    assert w.d.core.engines[("P", 0)].port == 10
    w.load("d", [23], w.params("new", "p-d", [4]))
    w.run(10)
    assert w.reports["d"] == 1 and "d" not in w.failed(), w.offs["d"].reason
    assert w.received_ok("d", "new", [4])
    w.check_invariants()


def test_a_request_aborted_while_set_aside_still_releases_the_moved_producer_once_it_is_handshaken() -> None:
    """A request set aside (it names the new address) is aborted while the old attempt still runs:
    the notice it owes the new producer survives the old attempt's failure, and goes out when the
    next request handshakes the new address, instead of pinning the blocks for the whole lease."""
    w = World(handshake_retry_ns=1_000 * US)
    w.producer("P", "P", 10)
    w.net.handshake_faults[("127.0.0.1", 9)] = "refuse"
    w.net.handshake_polls = 3
    w.load("old", [20], w.params("P", "p-old", [1]).to_dict() | {"remote_port": 9})
    w.run(1)
    w.load("new", [21], w.params("P", "p-new", [2]))
    w.run(1)
    w.d.abort("new")
    w.run(10)
    assert w.reports["new"] == 1 and "old" in w.failed()
    prod = w.prods["P"][3].core.producers
    assert "p-new" in prod  # nobody handshook the new address yet: the notice waits
    w.load("next", [22], w.params("P", "p-next", [3]))
    w.run(10)
    assert w.reports["next"] == 1 and w.received_ok("next", "P", [3])
    assert "p-new" not in prod, "the aborted request's notice went out once the new address connected"
    w.check_invariants()


def test_a_request_set_aside_that_stops_before_it_is_asked_again_starts_no_handshake() -> None:
    """R (PP 2, at address B) waits on stage 1's attempt at B and is set aside at stage 0, whose
    attempt runs at A. One late Tick passes both attempts' timeouts: stage 1's failure stops R, then
    stage 0's end asks R again, in the same cascade. That started a handshake at B for a request
    already stopped, and its EngineReady later reached a released request: a local violation,
    raised in strict mode (found by review). Expected: the stale ask is ignored with its reason."""
    core = make_core(strict=True, handshake_timeout_ns=1_000_000, handshake_retry_ns=10)
    b, a = 10, 9
    core.apply(read("p", t=0, remote_pp=2, port=b, lease_ns=10**12))  # both stages handshake at B
    core.apply(ev(HandshakeFailed, 1, engine_id="P", pp_rank=0, attempt=1, error="refused"))  # stage 0 fails
    core.apply(read("q", t=2_000, port=a, lease_ns=10**12))  # stage 0 now handshakes at A
    core.apply(read("r", t=3_000, remote_pp=2, port=b, lease_ns=10**12))
    e0 = core.engines[("P", 0)]
    assert list(e0.aside) == ["r"] and "r" in core.engines[("P", 1)].waiters
    core.take_commands()
    core.apply(ev(Tick, 5_000_000))  # past both attempts' handshake timeouts
    assert not [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    assert e0.state.name == "FAILED" and not e0.waiters
    gone = [r for r in core.log.records() if isinstance(r.event, EngineWanted) and r.event.request_id == "r"]
    assert gone[-1].reason.startswith("the request no longer waits"), gone[-1]
    assert core.violations[Fault.LOCAL] == 0


def test_request_within_the_pause_fails_fast_and_the_first_after_it_retries() -> None:
    """decisions.md "A failed handshake is retried only after a pause": within handshake_retry_ns of
    the failure a request fails at once with the cached error and its policy, its blocks invalid in
    the same step, and no second handshake is attempted; the first request after the pause retries
    and, the producer back, reads."""
    w = World(handshake_retry_ns=50 * US)
    w.producer("P", "P", 9)
    w.net.handshake_faults[("127.0.0.1", 9)] = "refuse"
    w.load("a", [1], w.params("P", "pa", [1]))
    w.run(3)
    assert "a" in w.failed()
    starts = w.d.core.engines[("P", 0)].attempt
    del w.net.handshake_faults[("127.0.0.1", 9)]  # back, but the pause still runs
    w.load("b", [2], w.params("P", "pb", [2]))
    w.run(1)
    assert w.reports["b"] == 1 and "refused" in w.offs["b"].reason
    assert w.d.core.engines[("P", 0)].attempt == starts  # nobody hammered it
    w.now += 60 * US
    w.load("c", [3], w.params("P", "pc", [3]))
    w.run(4)
    assert w.reports["c"] == 1 and "c" not in w.failed() and w.received_ok("c", "P", [3])
    w.check_invariants()


# --- 3. hundreds of engines handshaken and forgotten ---------------------------------------------------


def test_hundreds_of_engines_connected_lost_refused_and_forgotten_leave_memory_flat_and_stale_news_ignored() -> None:
    """300 producers, each under its own engine id: 150 are connected, read from, then die (their
    reads end DISCONNECTED); 150 refuse the handshake. decisions.md "Failed and disconnected engines
    are forgotten": after max(tombstone_ns, handshake_retry_ns) idle, none is kept. Late news to
    the forgotten attempts (a handshake answer, a disconnect) creates no machine and is no local
    violation ("Handshake attempts are numbered above every forgotten engine's")."""
    w = World(handshake_retry_ns=20 * US, tombstone_ns=40 * US, read_timeout_ns=10_000 * US)
    n = 150
    attempts: dict[str, int] = {}
    for i in range(n):
        w.producer(f"ok{i}", f"E{i}", 100 + i)
        w.net.script(f"r{i}", 0, 0, ReadScript(end="hang"))
        w.load(f"r{i}", [i], w.params(f"ok{i}", f"p{i}", [1]))
        w.producer(f"bad{i}", f"F{i}", 1000 + i, serve=False)
        w.load(f"f{i}", [n + i], w.params(f"bad{i}", f"q{i}", [1]))
    w.run(4)
    assert all(w.d.core.engines[(f"E{i}", 0)].state.name == "CONNECTED" for i in range(n))
    attempts = {f"E{i}": w.d.core.engines[(f"E{i}", 0)].attempt for i in range(n)}
    attempts |= {f"F{i}": w.d.core.engines[(f"F{i}", 0)].attempt for i in range(n)}
    for i in range(n):
        w.net.kill(w.prods[f"ok{i}"][2].agent)
    w.run(4)
    assert all(w.reports[f"r{i}"] == 1 and w.reports[f"f{i}"] == 1 for i in range(n))
    w.run(30, dt=10 * US)  # well past the forgetting time
    core = w.d.core
    assert not core.engines, f"{len(core.engines)} engines kept"
    assert len(core.idle) == 0
    before = core.log.next_seq
    for eid, att in attempts.items():
        core.submit(HandshakeDone(source=Source.HANDSHAKE, t_ns=w.now, engine_id=eid, pp_rank=0, attempt=att,
                                  reply=reply(eid)))
        core.submit(HandshakeFailed(source=Source.HANDSHAKE, t_ns=w.now, engine_id=eid, pp_rank=0, attempt=att,
                                    error="late"))
        core.submit(PeerDisconnected(source=Source.TRANSFER, t_ns=w.now, engine_id=eid, pp_rank=0, detail="late",
                                     attempt=att))
    w.run(2)
    assert core.log.next_seq > before
    assert not core.engines
    w.check_invariants()
    # and a producer that comes back under a forgotten id is handshaken afresh and read from
    w.producer("ok0", "E0", 100)
    w.load("again", [250], w.params("ok0", "p-again", [5]))
    w.run(4)
    assert w.reports["again"] == 1 and "again" not in w.failed() and w.received_ok("again", "ok0", [5])
    w.check_invariants()


# --- 4. a deadline passing while the handshake runs ----------------------------------------------------


def test_deadline_passing_while_handshaking_is_reported_once_and_the_late_handshake_changes_nothing() -> None:
    """decisions.md "A handshake completing after the read timeout still starts no read": the
    request is failed at its deadline (reported once, recompute, its blocks invalid that step), the
    handshake that completes later wakes nobody, no read is posted for it, and the engine then
    serves the next request (a handshake unanswered past handshake_timeout_ns would be failed:
    here the answer comes before that)."""
    w = World(read_timeout_ns=5 * US, handshake_timeout_ns=50 * US)
    w.producer("P", "P", 9)
    w.net.handshake_polls = 12
    w.load("slow", [7], w.params("P", "ps", [1]))
    w.run(8)
    assert w.reports["slow"] == 1 and "slow" in w.failed()
    w.run(10)
    assert w.d.core.engines[("P", 0)].state.name == "CONNECTED"
    assert not w.cons.reads
    assert not any(getattr(r.event, "request_id", None) == "slow" for r in w.d.core.log.records()
                   if type(r.event).__name__ in ("EngineReady", "PostRead"))
    w.net.handshake_polls = 1
    w.load("next", [8], w.params("P", "pn", [2]))
    w.run(3)
    assert w.reports == Counter({"slow": 1, "next": 1}) and w.received_ok("next", "P", [2])
    w.check_invariants()


# --- 5. a PP producer whose stage 1 keeps failing -------------------------------------------------------


def _pp_world(**d_cfg: Any) -> tuple[World, list[SimTransport], list[Connector]]:
    w = World(**d_cfg)
    ts = [SimTransport(w.net, f"P-pp{pp}", pp_rank=pp, num_blocks=64) for pp in range(2)]
    ps = [Connector(CoreConfig(engine_id="P", compat_hash="h", pp_rank=pp, pp_size=2), ts[pp],
                    SimHandshaker(w.net), clock=w.clock, port=9) for pp in range(2)]
    for t in ts:
        t.fill(range(64))

    def reply_for(pp: int) -> Any:  # stage 1 answers with another build's compatibility hash
        return reply("P", pp_rank=pp, pp_size=2, ranks=(ts[pp].rank_info(),), num_blocks=64,
                     compat_hash="h" if pp == 0 else "other-build")

    w.net.serve("127.0.0.1", 9, reply_for)
    return w, ts, ps


def test_pp_producer_stage1_failing_repeatedly_each_request_reported_once_and_stage0_released_at_once() -> None:
    """Stage 0 connects; stage 1's reply is refused every time. Over three retry pauses, requests
    arrive both right after a failure (failed fast) and after the pause (retried): each is reported
    once, failed with recompute and its blocks invalid, and each tells stage 0 it may release
    (decisions.md "Failed and aborted consumer requests still notify the producer": a request
    stopped while another stage handshakes "notifies the ranks of the connected stages"), so stage 0
    releases every hold now, not at its lease."""
    w, _ts, ps = _pp_world(handshake_retry_ns=20 * US)
    released0: Counter[str] = Counter()
    rids: list[str] = []
    for k in range(3):
        for j, delay in enumerate((0, 1)):
            rid = f"r{k}-{j}"
            p0 = ps[0].request_finished(f"p{rid}", [k * 2 + j])
            ps[1].request_finished(f"p{rid}", [k * 2 + j])
            w.load(rid, [k * 2 + j + 1], p0)
            rids.append(rid)
            w.run(2 + delay)
            released0.update(ps[0].get_finished()[0])
        w.now += 25 * US  # past the pause: the next request retries stage 1
    for _ in range(3):
        w.run(1)
        released0.update(ps[0].get_finished()[0])
    assert all(w.reports[r] == 1 for r in rids) and w.failed() == set(rids)
    # r0-0 stopped while stage 0 was still CONNECTING (both answers came in one poll): the notice it
    # owed stage 0 went out once stage 0 connected. Every later request found stage 0 connected.
    assert released0 == Counter({f"p{r}": 1 for r in rids}), released0
    assert w.d.core.violations[Fault.LOCAL] == 0
    w.check_invariants()


# --- 6. the producer dies between its handshake reply and add_peer ---------------------------------------


def test_producer_dying_between_its_reply_and_add_peer_fails_the_waiters_remotely_then_retries() -> None:
    """The reply is in (HandshakeDone queued) but the agent dies before the transport adds it: the
    transport refuses the peer, the waiting requests fail with recompute and their blocks invalid, the
    failure is not the local side's, and after the pause a request reaches the restarted producer."""
    w = World(handshake_retry_ns=20 * US)
    w.producer("P", "P", 9)
    w.load("a", [1], w.params("P", "pa", [1]))
    w.load("b", [2], w.params("P", "pb", [2]))
    w.d.step(rounds=1)
    w.d.step(rounds=1)  # StartHandshake carried out, the handshaker answered: the reply is queued
    assert w.d.core.log.inbox
    w.restart("P")  # the old agent is dead before its reply is applied
    w.run(3)
    assert w.failed() == {"a", "b"} and all("refused the peer" in w.offs[r].reason for r in "ab")
    w.now += 25 * US
    w.load("c", [3], w.params("P", "pc", [3]))
    w.run(4)
    assert w.reports["c"] == 1 and "c" not in w.failed() and w.received_ok("c", "P", [3])
    w.check_invariants()


def test_a_heartbeat_that_missed_a_pp_stage_promises_nothing() -> None:
    """A PP 2 producer whose stage 1 was not connected when the decode side heartbeated the params:
    the heartbeat reached stage 0 alone. Recording the promise for the params as a whole made a load
    refused past the lease notify stage 1 too, which had expired its hold at its own lease and
    recorded "that read may have seen reused blocks" (found by review). A promise is kept only when
    every rank was told; otherwise the load tells nobody past the lease, as before heartbeats
    were remembered."""
    ms = 1_000_000
    w = World(handshake_retry_ns=20 * US, lease_margin_ns=ms)
    ts = [SimTransport(w.net, f"P-pp{pp}", pp_rank=pp, num_blocks=64) for pp in range(2)]
    ps = [Connector(CoreConfig(engine_id="P", compat_hash="h", pp_rank=pp, pp_size=2, lease_ns=40 * ms), ts[pp],
                    SimHandshaker(w.net), clock=w.clock, port=9) for pp in range(2)]
    for t in ts:
        t.fill(range(64))
    stage1_up = [False]

    def answer(pp: int) -> HandshakeReply:
        ok = pp == 0 or stage1_up[0]
        return reply("P", pp_rank=pp, pp_size=2, ranks=(ts[pp].rank_info(),), num_blocks=64,
                     compat_hash="h" if ok else "another build")

    w.net.serve("127.0.0.1", 9, answer)

    def step(n: int = 1, dt: int = US) -> None:
        w.run(n, dt)
        for p in ps:
            p.get_finished()

    def minted(prid: str, blocks: list[int], **kw: Any) -> KVTransferParams:
        params = ps[0].request_finished(prid, blocks, **kw)
        ps[1].request_finished(prid, blocks, **kw)
        return params

    w.load("warm", [1], minted("pw", [1]))  # stage 0 connects, stage 1 is refused
    step(4)
    issued_at = w.now
    params = minted("p1", [2], issued_wall_ns=10**18)
    assert w.d.heartbeat(params, extend_ns=400 * ms) == 1  # stage 0 only
    step(1)
    stage1_up[0] = True
    w.now += 30 * US
    w.load("other", [3], minted("p2", [3]))  # connects stage 1
    step(4)
    step(1, dt=60 * ms)  # past the 40 ms lease: stage 1 expired p1
    w.d.load("d1", [4], params, lease_start_ns=issued_at)
    w.loaded["d1"] = (4,)
    step(3)
    assert "lease" in w.offs["d1"].reason
    late = [r for r in ps[1].core.log.records() if isinstance(r.event, NotificationReceived)
            and r.event.request_id == "p1"]
    assert not late, [(r.state, r.reason) for r in late]


def test_a_heartbeat_tells_a_sibling_stage_only_once_the_minting_stage_is_connected() -> None:
    """PP 2, params minted by stage 0 (they say so); only stage 1 is connected (stage 0's handshake
    was refused). Stage 1 cannot tell whether the params are of its process, so it is not
    heartbeated, as it would not be notified: nothing is told, nothing promised. Before (found by a
    helper's review), stage 1's rank got a heartbeat for params only stage 0 could vouch for."""
    w = World(handshake_retry_ns=20 * US)
    ts = [SimTransport(w.net, f"P-pp{pp}", pp_rank=pp, num_blocks=64) for pp in range(2)]
    ps = [Connector(CoreConfig(engine_id="P", compat_hash="h", pp_rank=pp, pp_size=2), ts[pp],
                    SimHandshaker(w.net), clock=w.clock, port=9) for pp in range(2)]
    w.net.serve("127.0.0.1", 9, lambda pp: reply("P", pp_rank=pp, pp_size=2, ranks=(ts[pp].rank_info(),),
                                                 num_blocks=64, compat_hash="h" if pp == 1 else "another build"))
    w.load("warm", [1], ps[0].request_finished("pw", [1]))  # stage 1 connects, stage 0 is refused
    w.run(4)
    assert w.d.core.engine_connected(("P", 1)) and not w.d.core.engine_connected(("P", 0))
    params = ps[0].request_finished("p1", [2])
    assert params.remote_incarnation and params.remote_incarnation_pp == 0
    assert w.d.heartbeat(params, extend_ns=10**9) == 0
    w.run(2)
    ps[1].get_finished()
    assert not [r for r in ps[1].core.log.records() if getattr(r.event, "request_id", "") == "p1"]


def _notes(cmds: list[Any]) -> list[tuple[int, str]]:
    return [(c.pp_rank, c.notification.request_id) for c in cmds if isinstance(c, SendNotification)]


def test_a_notice_kept_for_another_address_outlives_the_failed_engine_being_forgotten() -> None:
    """A request set aside for a moved producer (:10) is aborted while the old address (:9) is
    handshaken; its notice is kept for a handshake at :10 across :9's failure (decisions.md). The
    FAILED engine was then forgotten after ``max(tombstone_ns, handshake_retry_ns)`` (240 s here)
    with the notice in it, and the producer held the blocks its whole 600 s lease (found by a
    helper's hunt). Now the engine is kept until the notice can no longer be sent."""
    s = 1_000_000_000
    core = make_core(strict=False)
    core.apply(read("old", t=0, port=9, host="h", lease_ns=600 * s, lease_start_ns=0))
    core.apply(read("new", t=1, port=10, host="h", lease_ns=600 * s, lease_start_ns=0))  # set aside
    core.apply(ev(AbortRequested, 2, request_id="new"))
    core.apply(ev(HandshakeFailed, s, engine_id="P", pp_rank=0, attempt=1, error="refused"))
    core.apply(ev(Collect, s, step=1))
    core.take_commands()
    core.apply(ev(Tick, 241 * s))
    assert ("P", 0) in core.engines, "forgotten with a notice still owed"
    t = 250 * s
    core.apply(read("next", t=t, port=10, host="h", lease_ns=600 * s, lease_start_ns=t))
    e = core.engines[("P", 0)]
    core.apply(ev(HandshakeDone, t + 1, engine_id="P", pp_rank=0, attempt=e.attempt, reply=reply()))
    core.apply(ev(PeerAdded, t + 1, engine_id="P", pp_rank=0, attempt=e.attempt))
    assert (0, "p-new") in _notes(core.take_commands())
    core.apply(ev(Tick, 1_000 * s))  # past the last bound: nothing keeps an engine now
    assert not core.engines[("P", 0)].notices


def test_a_notice_that_cannot_be_owed_is_not_sent_to_a_stage_connecting_to_a_restarted_process() -> None:
    """A PP 2 request whose params do not say their minting stage: its stage 1 is lost, a newer
    request handshakes it again, the restarted process's reply is accepted (AddPeer emitted), and
    then the old request's last read stops. Such a notice cannot be owed (a stage connecting alone
    cannot check those params); it was emitted all the same, after the AddPeer, and reached the new
    process, which never held it (found by a helper's hunt). A stage handshaking is told nothing."""
    s, issued = 1_000_000_000, 1_000 * 1_000_000_000

    def answer(pp: int, incarnation: str, started: int) -> Any:
        return reply("P", pp_rank=pp, pp_size=2, ranks=(RankInfo(
            pp_rank=pp, tp_rank=0, agent=f"P{incarnation}-{pp}", incarnation=incarnation, started_wall_ns=started),))

    core = make_core(strict=False)
    core.apply(read("d1", t=1, remote_pp=2, incarnation="A", lease_ns=100 * s, issued_wall_ns=issued))
    for pp in (0, 1):
        core.apply(ev(HandshakeDone, 2, engine_id="P", pp_rank=pp, attempt=1, reply=answer(pp, "A", issued - 10 * s)))
        core.apply(ev(PeerAdded, 2, engine_id="P", pp_rank=pp, attempt=1))
    core.apply(ev(HandleFailed, 3, request_id="d1", pp_rank=1, tp_rank=0, why=HandleFailure.DISCONNECTED))
    core.apply(ev(PeerDisconnected, 4, engine_id="P", pp_rank=1, attempt=1))
    core.apply(read("d2", t=5, blocks=(5,), remote_blocks=(5,), remote_pp=2, incarnation="B", lease_ns=100 * s,
                    issued_wall_ns=issued + 70 * s))
    core.apply(ev(HandshakeDone, 6, engine_id="P", pp_rank=1, attempt=2, reply=answer(1, "B", issued + 60 * s)))
    core.take_commands()
    core.apply(ev(HandleFailed, 8, request_id="d1", pp_rank=0, tp_rank=0, why=HandleFailure.CANCELLED))
    assert (1, "p-d1") not in _notes(core.take_commands())
    core.apply(ev(PeerAdded, 9, engine_id="P", pp_rank=1, attempt=2))
    assert (1, "p-d1") not in _notes(core.take_commands())
