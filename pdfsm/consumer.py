"""The consumer (decode-side) request: everything that affects its state machine lives here.

Life of a request that reads its KV blocks from a remote producer::

    NEW -> HANDSHAKING -> READING -> NOTIFIED -> RELEASED
                    \\          \\
                     +-> FAILED  +-> FAILING -> FAILED -> RELEASED
    (abort)  ABORTING -> ABORTED -> RELEASED

- It waits in HANDSHAKING for every remote engine it reads from, posts one
  read per remote source rank (the multi-handle join), and only when every
  handle has stopped does it leave the reading states: a failed request whose
  sibling reads still run stays FAILING, so no block is reported or reused
  while a read may still write into it (vLLM PRs 40364, 56104, 32255).
- NOTIFIED, FAILED and ABORTED wait for the scheduler to collect the request;
  the hand-off (a :class:`~pdfsm.events.Reported` event) moves it to RELEASED
  and happens exactly once, with the invalid block ids in the same hand-off.
  A handshake failure takes the same road, so the failure policy applies to
  it too (vLLM PR 40364).
- A notify-only request (no blocks to read: a full local prefix hit) sends
  the producer its notifications and ends RELEASED without being handed off,
  since the scheduler is not waiting for it (vLLM PR 57570).

The first option of the two busiest cells is the common case in one guard;
it implies none of the options after it hold, so it only saves their cost.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from pdfsm.commands import CancelRead, HandOff, PostRead, SendNotification
from pdfsm.engine import EngineState, RemoteEngine, ask_owed_eviction, pay_drop
from pdfsm.errors import UnsupportedPP
from pdfsm.events import (
    AbortRequested,
    DeadlinePassed,
    EngineFailed,
    EngineReady,
    EvictRequested,
    HandleDone,
    HandleFailed,
    Promised,
    Quarantined,
    ReadRequested,
    Reported,
    Source,
)
from pdfsm.fsm import Fault, Go, Ignore, Illegal, Machine, State, Table, on
from pdfsm.topology import ReadPlan, TopologyError
from pdfsm.wire import Notification

if TYPE_CHECKING:
    from pdfsm.core import Core

__all__ = ["TABLE", "ConsumerRequest", "ConsumerState"]


class ConsumerState:
    NEW: Final[State] = State("NEW")
    HANDSHAKING: Final[State] = State("HANDSHAKING")
    READING: Final[State] = State("READING")
    NOTIFIED: Final[State] = State("NOTIFIED")
    FAILING: Final[State] = State("FAILING")
    FAILED: Final[State] = State("FAILED")
    ABORTING: Final[State] = State("ABORTING")
    ABORTED: Final[State] = State("ABORTED")
    RELEASED: Final[State] = State("RELEASED", terminal=True)


S = ConsumerState
CONNECTED: Final[State] = EngineState.CONNECTED
HANDSHAKING: Final[State] = EngineState.HANDSHAKING
CONNECTING: Final[State] = EngineState.CONNECTING
ENGINE_FAILED: Final[State] = EngineState.FAILED


class ConsumerRequest(Machine):
    """A decode-side request. Its parameters are the event that created it (``req``); the
    rest is what changes, and only the owner thread, through the table, changes it."""

    __slots__ = ("attempts", "deadline", "done", "engines", "error", "held_at", "outcome", "pending", "plan",
                 "promised", "remote_fault", "req", "request_id", "trust", "waited", "waiting")

    def __init__(self, request_id: str) -> None:
        super().__init__(S.NEW)
        self.request_id = request_id
        self.req: ReadRequested | None = None
        self.plan: ReadPlan | None = None
        self.engines: tuple[RemoteEngine, ...] = ()  # engines held: ready for it, or read from
        self.held_at: tuple[int, ...] = ()  # each held engine's attempt when held (empty: the fast path's one)
        self.attempts = 0  # the plan's engines' handshake attempts, summed, when its reads were posted
        self.waiting = 0  # bit p: still waiting for remote engine (engine_id, p)
        self.waited = 0  # bit p: did wait for it (news from it may still be on its way)
        self.pending = 0  # bit i: the read from plan.sources[i] has not stopped
        self.done = 0  # bit i: the read from plan.sources[i] completed
        # None: not armed / not known yet (a clock may read 0 or less: no value of it means "none")
        self.deadline: int | None = None
        self.trust: int | None = None  # reads completing at or after it are not trusted
        self.promised = 0  # until when a heartbeat sent after the load asked the producer to hold (0: none)
        self.error = ""  # the first failure, in words
        self.remote_fault = False
        self.outcome = ""

    def __repr__(self) -> str:
        return f"ConsumerRequest({self.request_id!r}, {self.state})"

    @property
    def local_blocks(self) -> tuple[int, ...]:
        return self.req.local_blocks if self.req is not None else ()

    @property
    def t_start(self) -> int:
        return self.req.t_ns if self.req is not None else 0


# --- guards: read only ------------------------------------------------------------------------


def times_of(ev: ReadRequested, core: Core) -> tuple[int, int]:
    """(deadline, trust). Reads completing at or after ``trust`` are not believed: it is a margin
    before the producer's lease can end (after it the producer may have reused the blocks). The
    deadline, when the request gives up on reads still running, is the read timeout or, earlier,
    ``trust``. The read timeout is liveness, not safety: a read seen complete after it but well
    inside the lease holds the right bytes. With the lease not known it is the only bound there is.

    Remembers its last answer on the core (``times_for``, ``times``): a cache, not state, so the
    guards that call it still change nothing a transition reads."""
    if ev is core.times_for:
        return core.times
    t_ns, deadline, lease_ns = ev.t_ns, ev.deadline, ev.lease_ns
    timeout = deadline.t_ns if deadline is not None else t_ns + core.read_timeout_ns
    if not lease_ns:
        times = (timeout, timeout)
    else:
        start = ev.lease_start_ns
        trust = (t_ns if start is None else start) + lease_ns - core.lease_margin_ns
        times = (min(timeout, trust), trust)
    core.times_for, core.times = ev, times
    return times


def notify_until(req: ReadRequested, trust: int, core: Core, promised: int = 0) -> int:
    """Until when a notification can still find the producer holding the blocks: the trust bound
    (:func:`times_of`), or the end this worker's heartbeats asked for (before the load, or after
    it: ``promised``, :class:`~pdfsm.events.Promised`) less the margin if later. A request that
    stops after its trust bound but within that still tells the producer, which would otherwise
    keep the blocks for the whole extension, then blame this side."""
    promised = max(req.promised_ns, promised)
    # Only for params that name their hold (issued_wall_ns): a notice past the trust bound may
    # reach a producer that released at its lease (the heartbeat lost) and holds the id again
    # since; it tells that new hold apart by the issue time, which unnamed params cannot give.
    return max(trust, promised - core.lease_margin_ns) if promised and req.issued_wall_ns else trust


def _can_read_now(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    """The common case: valid, blocks to read, one PP rank, its engine already connected."""
    blocks = ev.local_blocks
    if not blocks or ev.remote_pp != 1 or len(blocks) != len(ev.remote_blocks):
        return False
    d = ev.deadline
    if d is not None and d.clock != core.clock:
        return False
    if times_of(ev, core)[0] <= max(ev.t_ns, core.latest_t_ns):  # as _lease_over: never a refusal
        return False
    if (ev.remote_tp, 1) not in core.plans:  # the first request of a layout takes the long road
        return False
    e = core.engines.get((ev.engine_id, 0))
    if e is None or e.state is not CONNECTED or e.stalled:  # e.usable, spelt out: the hot path
        return False
    return e.reply is not None and _contradiction(e, ev, 0, core.hold_skew_ns) is None


def _contradiction(e: RemoteEngine, req: ReadRequested, pp: int, skew: int) -> str | None:
    """How the request's params contradict one connected engine, if they do: the address it was
    handshaken at (two engines sharing one engine id, as vLLM's data-parallel prefill ranks once
    did, PR 18903: the engine id check of the handshake passes for both), a rank that started after
    the params were issued, or its validated reply's TP or PP size, or a block id it does not have.
    Reading with such params would move another engine's blocks, another process's, the wrong
    slices or the wrong blocks, and notify the wrong ranks."""
    # Every request runs this: each field of the params (a Struct) is read once, the reply's
    # from the engine's native copies (RemoteEngine.connect).
    port = req.port
    if e.elsewhere(req.host, port):
        return (f"the params place {req.engine_id} at {req.host}:{port}; pp_rank {pp} was handshaken at "
                f"{e.host}:{e.port} (two engines share one engine id, or it moved)")
    r = e.reply
    if r is None:
        return None
    issued = req.issued_wall_ns
    if _predates(issued, e, skew):
        rank = max(r.ranks, key=lambda x: x.started_wall_ns)
        ahead = (rank.started_wall_ns - issued) / 1e9
        return (f"the params were issued {ahead:.3f} s before {req.engine_id} rank (pp {rank.pp_rank}, tp "
                f"{rank.tp_rank}) started: that rank restarted since, and the blocks they name are another "
                "process's")
    remote_pp = req.remote_pp
    if e.reply_tp != req.remote_tp or e.reply_pp != remote_pp:
        return (f"the params say {req.engine_id} has TP {req.remote_tp} and PP {remote_pp}; its handshake"
                f" (pp_rank {pp}) says TP {e.reply_tp} and PP {e.reply_pp}")
    n = e.num_blocks
    if n and (blocks := req.remote_blocks) and (top := max(blocks)) >= n:
        return f"remote block {top} is out of range: {req.engine_id} pp_rank {pp} has {n} blocks"
    incarnation = req.incarnation
    if incarnation:
        stage = req.incarnation_pp
        if stage is None and remote_pp == 1:
            stage = 0
        if pp == stage and _foreign(incarnation, e.incarnations):
            return _restarted(req, f"{req.engine_id} pp_rank {pp}'s ranks")
    return None


def _predates(issued_wall_ns: int, e: RemoteEngine, skew: int) -> bool:
    """A rank of ``e`` started more than ``skew`` after the params were issued (both on wall
    clocks): a process that replaced the one that held them. One TP rank restarted alone keeps the
    minting rank's incarnation, so only the times tell (docs/decisions.md)."""
    return bool(issued_wall_ns and skew) and e.started_ns - issued_wall_ns > skew


def _restarted(req: ReadRequested, whose: str) -> str:
    return (f"the params were minted by producer incarnation {req.incarnation!r}, none of {whose} now: it "
            "restarted under the same engine id, and the blocks they name are another process's")


def _foreign(incarnation: str, said: frozenset[str]) -> bool:
    """Params minted by ``incarnation`` were minted by none of the ranks that said these (every
    rank says its incarnation: one that says none cannot be ruled out)."""
    return bool(said) and "" not in said and incarnation not in said


def contradictions(req: ReadRequested, core: Core) -> Iterator[tuple[int, str]]:
    """(pp_rank, why) for each connected engine a request contradicts (a notify-only one too: it
    would notify the wrong ranks, or another engine)."""
    pps = core.plan(req.remote_tp, req.remote_pp).pp_ranks
    found = False
    for pp in pps:
        e = core.engines.get((req.engine_id, pp))
        if e is not None and e.state is CONNECTED:
            why = _contradiction(e, req, pp, core.hold_skew_ns)
            if why is not None:
                found = True
                yield pp, why
    if found or not req.incarnation or req.incarnation_pp is not None or req.remote_pp == 1:
        return
    # PP params that do not say their minting stage (older producers): judged against every stage
    # at once, once all are connected; a plan that reads some stages only cannot tell.
    engines = [core.engines.get((req.engine_id, pp)) for pp in pps]
    said = [e.incarnations for e in engines if e is not None and e.state is CONNECTED and e.reply is not None]
    if len(said) == len(pps) == req.remote_pp and _foreign(req.incarnation, frozenset().union(*said)):
        for pp in pps:
            yield pp, _restarted(req, f"{req.engine_id}'s ranks")


def disagreement(req: ReadRequested, core: Core) -> str | None:
    """The first contradiction between a request and the connected engines it reads from, if any."""
    return next((why for _, why in contradictions(req, core)), None)


def _foreign_deadline(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    return ev.deadline is not None and ev.deadline.clock != core.clock


def _bad_topology(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    try:
        core.plan(ev.remote_tp, ev.remote_pp)
    except TopologyError:
        return True
    return len(ev.local_blocks) != len(ev.remote_blocks)


def _bad_topology_notify_only(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    return not ev.local_blocks and _bad_topology(m, ev, core)


def _pp_unsupported(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    return not core.config.supports_pp and ev.remote_pp > 1


def _pp_unsupported_notify_only(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    return not ev.local_blocks and _pp_unsupported(m, ev, core)


def _lease_over(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    """Too late to start reading, judged at the latest time the core has applied (a request
    stamped before a Tick past its deadline would post a read of released blocks)."""
    return bool(ev.local_blocks) and times_of(ev, core)[0] <= max(ev.t_ns, core.latest_t_ns)


def _lease_over_notify_only(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    """Nothing to read and the lease known to be over (past :func:`notify_until`, so also with the
    clocks' skew): the producer releases by itself; a notification now would reach it after its
    release, to no use (an older producer, or one that forgot the hold, would record it as a
    violation: vLLM PR 41269's late rejection notices).
    Judged at the latest time the core has applied, not the request's stamp: a request stamped
    before a Tick past the lease but applied after it would otherwise notify a released hold."""
    return (not ev.local_blocks and ev.lease_ns > 0
            and notify_until(ev, times_of(ev, core)[1], core) <= max(ev.t_ns, core.latest_t_ns))


def _lease_ended(m: ConsumerRequest, t_ns: int, core: Core) -> bool:
    """Past :func:`notify_until`: the producer may have released, so it is told nothing more."""
    req = m.req
    return (req is not None and req.lease_ns > 0 and m.trust is not None
            and t_ns >= notify_until(req, m.trust, core, m.promised))


def _lease_over_notify_only_when_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> bool:
    """As :func:`_lease_over_notify_only`, found once the engine is ready (the step that applies
    the handshake's result may come after the lease, before the deadline's tick)."""
    return m.req is not None and not m.req.local_blocks and _lease_ended(m, ev.t_ns, core)


def _past_deadline(m: ConsumerRequest, ev: EngineReady, core: Core) -> bool:
    """Too late to start reading."""
    return m.deadline is not None and ev.t_ns >= m.deadline


def _untrusted(m: ConsumerRequest, ev: HandleDone, core: Core) -> bool:
    """Too late to trust a read: it could have completed after the producer reused the blocks."""
    return m.trust is not None and ev.t_ns >= m.trust


def _disagrees(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    return disagreement(ev, core) is not None


def _disagrees_when_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> bool:
    return m.req is not None and disagreement(m.req, core) is not None


def _read_past_deadline(m: ConsumerRequest, ev: EngineReady, core: Core) -> bool:
    """A read's deadline passed (its Tick not applied yet): it fails now, before another stage is
    handshaken again for it (notify-only requests have their own options)."""
    return not _nothing_to_read(m, ev, core) and _past_deadline(m, ev, core)


def _read_disagrees_when_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> bool:
    """A read's params contradict a handshake reply: refused now, before another stage is
    handshaken again for it."""
    return not _nothing_to_read(m, ev, core) and _disagrees_when_ready(m, ev, core)


def _disagrees_notify_only(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    return not ev.local_blocks and _disagrees(m, ev, core)


def _disagrees_notify_only_when_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> bool:
    return m.req is not None and not m.req.local_blocks and _disagrees_when_ready(m, ev, core)


def _engines_pending(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    """A stage not connected, or stalled: the engine table decides (handshake, or fail fast)."""
    eid = ev.engine_id
    return not all(core.engine_usable((eid, pp)) for pp in core.plan(ev.remote_tp, ev.remote_pp).pp_ranks)


def _nothing_to_read(m: ConsumerRequest, ev: object, core: Core) -> bool:
    req = ev if isinstance(ev, ReadRequested) else m.req
    return req is None or not req.local_blocks


def _not_waiting_for_it(m: ConsumerRequest, ev: EngineReady | EngineFailed, core: Core) -> bool:
    return m.req is None or ev.engine_id != m.req.engine_id or not (m.waiting >> ev.pp_rank) & 1


def _stopped_waiting_for_it(m: ConsumerRequest, ev: EngineReady | EngineFailed, core: Core) -> bool:
    """News from an engine the request waited for, derived before the request stopped waiting
    (a sibling engine failed it earlier in the same cascade): stale, not a bug."""
    return (m.req is not None and ev.engine_id == m.req.engine_id and bool((m.waited >> ev.pp_rank) & 1)
            and not (m.waiting >> ev.pp_rank) & 1)


def _other_engines_pending(m: ConsumerRequest, ev: EngineReady, core: Core) -> bool:
    return m.waiting & ~(1 << ev.pp_rank) != 0


def _held_engine_lost(m: ConsumerRequest, ev: EngineReady, core: Core) -> bool:
    """An engine of the plan, other than the one now ready, is no longer connected, or stalled."""
    if m.plan is None or m.req is None or len(m.plan.pp_ranks) == 1:
        return False
    eid = m.req.engine_id
    return not all(core.engine_usable((eid, pp)) for pp in m.plan.pp_ranks if pp != ev.pp_rank)


def _bit(m: ConsumerRequest, ev: HandleDone | HandleFailed) -> int:
    """The source's bit in ``pending``/``done``, or 0 for a rank this request does not read."""
    i = m.plan.position.get((ev.pp_rank, ev.tp_rank)) if m.plan is not None else None
    return 0 if i is None else 1 << i


def _last_in_flight(m: ConsumerRequest, ev: HandleDone | HandleFailed, core: Core) -> bool:
    """The common case: the event completes the only read still in flight, in time."""
    i = m.plan.position.get((ev.pp_rank, ev.tp_rank)) if m.plan is not None else None
    return i is not None and m.pending == 1 << i and (m.trust is None or ev.t_ns < m.trust)


def _untrusted_with_siblings(m: ConsumerRequest, ev: HandleDone, core: Core) -> bool:
    return _untrusted(m, ev, core) and _siblings_in_flight(m, ev, core)


def _not_in_flight(m: ConsumerRequest, ev: HandleDone | HandleFailed, core: Core) -> bool:
    return not m.pending & _bit(m, ev)


def _siblings_in_flight(m: ConsumerRequest, ev: HandleDone | HandleFailed, core: Core) -> bool:
    return m.pending & ~_bit(m, ev) != 0


# --- actions: write, never raise --------------------------------------------------------------


def _accept(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    m.req = ev
    try:
        m.plan = core.plan(ev.remote_tp, ev.remote_pp)
    except TopologyError:
        m.plan = None


def _arm_deadline(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    m.deadline, m.trust = times_of(ev, core)
    core.deadlines.arm(m.request_id, m.deadline)


def _disarm_deadline(m: ConsumerRequest, core: Core) -> None:
    if m.deadline is not None:
        core.deadlines.disarm(m.request_id, m.deadline)
        m.deadline = None


def _hold(m: ConsumerRequest, e: RemoteEngine) -> None:
    """Keep ``e`` from being evicted while this request may still read from it."""
    if e not in m.engines:
        m.engines = (*m.engines, e)
        m.held_at = (*m.held_at, 0)  # held, nothing read yet: set as its reads are posted
        e.readers += 1


def _read_over(m: ConsumerRequest, e: RemoteEngine) -> int:
    """The attempt of ``e``'s connection this request read over (0: held, nothing posted)."""
    return m.held_at[m.engines.index(e)] if m.held_at else m.attempts  # empty: the fast path's one engine


def _let_go(m: ConsumerRequest, core: Core, t_ns: int) -> None:
    """Release the engines held; a lost one's peer goes with its last reader, and so does one
    whose eviction was asked meanwhile. Callers notify first: the notification to a lost stage's
    live ranks needs that peer."""
    for e in m.engines:
        e.readers -= 1
        if e.stalled and _read_over(m, e) == e.attempt:
            e.stalled = False  # a reader of the connection that stalled let go: it answers again
        if not e.readers and (e.drop_owed or e.evict_owed):  # rare: the flags first, no call
            pay_drop(e, core)
            ask_owed_eviction(e, core, t_ns)
    m.engines = m.held_at = ()


def _of_other_params(m: ConsumerRequest, ev: Promised, core: Core) -> bool:
    return m.req is None or m.req.hold != ev.hold


def _promise(m: ConsumerRequest, ev: Promised, core: Core) -> None:
    m.promised = max(m.promised, ev.promised_ns)


def _stop_waiting(m: ConsumerRequest, core: Core, t_ns: int) -> None:
    """Leave every engine's waiting list, let go of those already ready, disarm the deadline."""
    if m.waiting:
        assert m.req is not None
        core.unwatch(m.request_id, m.req.engine_id, m.waiting)
        m.waiting = 0
    _let_go(m, core, t_ns)
    _disarm_deadline(m, core)


def _post_reads(m: ConsumerRequest, core: Core, t_ns: int) -> None:
    req, plan = m.req, m.plan
    assert req is not None and plan is not None
    note = Notification(req.remote_request_id, plan.part, plan.of, req.issued_wall_ns, core.engine_id)
    emit, rid, eid = core.emit, m.request_id, req.engine_id
    for src in plan.sources:
        emit(PostRead(rid, eid, src, req.local_blocks, req.remote_blocks, note))
    m.pending = plan.all_read
    engines = core.engines
    if not m.engines and len(plan.pp_ranks) == 1:  # the common case, spelt out: no loop, no generator
        e = engines[(eid, plan.pp_ranks[0])]
        e.readers += 1
        e.idle_since = max(e.idle_since, t_ns)  # used now: not forgotten for being idle (Core.engine_idle)
        m.engines = (e,)
        m.attempts = e.attempt
    else:
        for pp in plan.pp_ranks:
            e = engines[(eid, pp)]
            _hold(m, e)
            e.idle_since = max(e.idle_since, t_ns)
        m.held_at = tuple(e.attempt for e in m.engines)  # the connections the reads go over
        m.attempts = _attempts(m, core)


def _attempts(m: ConsumerRequest, core: Core) -> int:
    """The plan's engines' handshake attempts, summed (-1: one is forgotten). Attempts only grow,
    so a sum unchanged since the reads were posted means no engine was handshaken again since."""
    assert m.req is not None and m.plan is not None
    total, eid = 0, m.req.engine_id
    for pp in m.plan.pp_ranks:
        e = core.engines.get((eid, pp))
        if e is None:
            return -1
        total += e.attempt
    return total


def _read_now(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    """_accept and _arm_deadline, spelt out: this runs for nearly every request. Guards before it
    computed (and cached) the plan."""
    m.req = ev
    m.plan = core.plans[(ev.remote_tp, ev.remote_pp)]
    m.deadline, m.trust = times_of(ev, core)
    core.deadlines.arm(m.request_id, m.deadline)
    _post_reads(m, core, ev.t_ns)


def _wait_for_engines(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    _accept(m, ev, core)
    _arm_deadline(m, ev, core)
    _watch_unconnected(m, ev, core, ev.t_ns)


def _watch_unconnected(m: ConsumerRequest, req: ReadRequested, core: Core, t_ns: int, evicting: int = 0) -> None:
    """Wait for every engine of the plan not connected now (or in the mask ``evicting``: asked to
    be evicted just before, and handshaken again); hold the connected ones, so none is evicted
    while a sibling still handshakes (vLLM PR 54689)."""
    assert m.plan is not None
    for pp in m.plan.pp_ranks:
        key = (req.engine_id, pp)
        e = core.engines.get(key)
        if e is not None and e.usable and not (evicting >> pp) & 1:
            _hold(m, e)
        elif not (m.waiting >> pp) & 1:  # the engine table decides: handshake, or fail fast
            m.waiting |= 1 << pp
            core.watch(m.request_id, key, req.host, req.port, t_ns)  # now: retry pauses are judged by it
            if e is not None and e.state is ENGINE_FAILED and e.pausing(t_ns, req.host, req.port):
                break  # it fails the request at once: news from a second would reach it ended
    m.waited |= m.waiting


def _notify_unread(m: ConsumerRequest, core: Core, t_ns: int, *, connected_only: bool = False) -> None:
    """Tell every producer rank we will not read (again) that it may release: each completed
    read carried its own notification; the rest, and MLA's skipped ranks, get one here (with
    ``connected_only``, only the ranks of engines that are connected: a request stopping before it
    read, while a PP producer's stage 1 still handshakes, tells stage 0 instead of pinning its
    blocks a whole lease; the others cannot be told).
    Not past :func:`notify_until` (the trust bound, or later what heartbeats promised): the
    producer released by itself (a notice then is of no use, and an older producer reads it as a
    read of reused blocks: vLLM PR 41269's late notices; these say ``unread``). Not when the
    params contradict a connected engine of the plan either: they may name the wrong ranks, or
    another engine, or a process that has restarted since (its successor never held them)."""
    req, plan = m.req, m.plan
    assert req is not None and plan is not None
    # Judged at the latest time known: a read's end stamped before the trust bound may be applied
    # after a tick past it, when the producer may have released already.
    if (m.done == plan.all_read and not plan.notify_only) or _lease_ended(m, max(t_ns, core.latest_t_ns), core):
        return
    # The params were checked against the engines when the reads were posted, or by the guard of
    # this very transition; only a stop before reading, or an engine handshaken again since the
    # reads were posted (a restarted producer), needs the check again.
    if (connected_only or (m.attempts and m.attempts != _attempts(m, core))) and disagreement(req, core) is not None:
        return
    note = Notification(req.remote_request_id, plan.part, plan.of, req.issued_wall_ns, core.engine_id,
                        unread=True)
    eid = req.engine_id
    unread = [(src.pp_rank, src.tp_rank) for i, src in enumerate(plan.sources) if not (m.done >> i) & 1]
    for pp, tp in unread + list(plan.notify_only):
        cmd = SendNotification(engine_id=eid, pp_rank=pp, tp_rank=tp, notification=note)
        minting = awaits_minting_stage(req, pp, core)
        if minting is None and core.engine_connected((eid, pp)):
            core.emit(cmd)
            continue
        # Owed to the stage's own handshake, or to the minting stage's while its verdict is pending
        # (send_owed judges it then).
        e = core.engines.get((eid, pp if minting is None else minting))
        if e is not None and (e.state is HANDSHAKING or e.state is CONNECTING):
            # Owed once it connects (send_owed): a request aborted or timed out while the handshake
            # ran would otherwise pin the producer's blocks a whole lease (vLLM PR 41269); so would
            # one whose stage lost a rank and is handshaken again for a newer request before this
            # one's last read stopped (the old peer is dropped then: found by a helper's hunt).
            if m.trust is not None and _may_owe(req):
                _owe(e, req, notify_until(req, m.trust, core, m.promised), cmd, core)
        elif minting is None and not connected_only:
            core.emit(cmd)  # a stage lost and not handshaken again: the transport says why it cannot go
        # Otherwise told nothing, the hold ending at its lease: a minting stage not handshaking gives
        # no verdict to come; a stage handshaking that cannot be owed this notice (no lease to bound
        # it, params a stage alone cannot check, or its list full) may connect to a process that
        # never held it (found by a helper's hunt).


def awaits_minting_stage(req: ReadRequested, pp: int, core: Core) -> int | None:
    """The stage that minted PP params (they say it), when it is another than ``pp`` and not
    connected: only its reply can confirm the params' process, so ``pp``'s ranks are not told
    before it has (a stage that connected first would otherwise hear of params the minting stage
    refuses: a hold it never had; found by a helper's review). None: nothing to wait for, or a
    plan that does not read the minting stage (a PP consumer stage: it cannot tell, and does not
    check)."""
    stage = req.incarnation_pp
    if stage is None or stage == pp or not req.incarnation or req.remote_pp == 1:
        return None
    if core.engine_connected((req.engine_id, stage)) or stage not in core.plan(req.remote_tp, req.remote_pp).pp_ranks:
        return None
    return stage


def _may_owe(req: ReadRequested) -> bool:
    """A notice can wait for a handshake only with a lease to bound it (one unknown has no end) and
    params whose minting process one stage can check (PP params that do not say their stage are
    judged against every stage at once: a stage connecting alone cannot tell)."""
    stageless = bool(req.incarnation) and req.incarnation_pp is None and req.remote_pp > 1
    return req.lease_ns > 0 and not stageless


def cancel_reads_over(e: RemoteEngine, core: Core) -> None:
    """Cancel the reads still running over ``e``'s connection, taken as lost while held (stalled):
    its peer is dropped as the next handshake starts, and a read nobody cancelled would go on
    writing blocks nobody watches, its request then telling the old hold's ranks over the new
    connection (found by a helper's long random walks). Each request fails as its reads end."""
    for m in core.consumers.values():
        plan = m.plan
        if m.state is S.READING and plan is not None and e in m.engines and _read_over(m, e) == e.attempt:
            for i, src in enumerate(plan.sources):
                if (m.pending >> i) & 1 and src.pp_rank == e.pp_rank:
                    core.emit(CancelRead(request_id=m.request_id, pp_rank=src.pp_rank, tp_rank=src.tp_rank))


def send_owed(e: RemoteEngine, core: Core, t_ns: int, replaced: set[int]) -> None:
    """The notices owed to ``e``'s ranks by requests that stopped while it handshook, now that it
    is connected: not once their lease is over, nor when their params contradict its reply or a
    sibling stage's (but the ``replaced`` ones, evicted right after)."""
    owed, e.notices = e.notices, []
    now, skew = max(t_ns, core.latest_t_ns), core.hold_skew_ns
    for req, trust, cmd in owed:
        minting = awaits_minting_stage(req, cmd.pp_rank, core)
        # A stage connecting before the minting stage passes its notices on to that stage's verdict;
        # the minting stage connecting now (not CONNECTED yet) is the verdict, judged below.
        if minting is not None and minting != e.pp_rank:
            _owe(core.engines.get((req.engine_id, minting)), req, trust, cmd, core)
            continue
        if cmd.pp_rank != e.pp_rank and cmd.pp_rank not in replaced:
            # The minting stage vouched for the params; a notice it held for another stage still
            # handshaking waits for that stage's own reply, which alone shows whether a process
            # restarted there since (it never held the request: found by a helper's hunt).
            target = core.engines.get((req.engine_id, cmd.pp_rank))
            if target is not None and (target.state is HANDSHAKING or target.state is CONNECTING):
                _owe(target, req, trust, cmd, core)
                continue
        # The stage itself, and every other stage already connected (one may be the minting stage
        # and show the params are of a process since replaced), as for a notice sent now.
        if (now < trust and _contradiction(e, req, e.pp_rank, skew) is None
                and all(pp in replaced for pp, _ in contradictions(req, core))):
            core.emit(cmd)


def _owe(e: RemoteEngine | None, req: ReadRequested, trust: int, cmd: SendNotification, core: Core) -> None:
    """Owe ``cmd`` to ``e``'s handshake (send_owed judges it once ``e`` connects), while it runs
    and has room; otherwise it is told nothing, and the hold ends at its lease."""
    if e is not None and (e.state is HANDSHAKING or e.state is CONNECTING) and len(e.notices) < core.config.max_staged:
        e.notices.append((req, trust, cmd))


def _notify_only_now(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    _accept(m, ev, core)
    _notify_unread(m, core, ev.t_ns)
    core.finished(m, "notified", ev.t_ns)


def _engine_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> None:
    m.waiting &= ~(1 << ev.pp_rank)
    _hold(m, core.engines[(ev.engine_id, ev.pp_rank)])  # a sibling engine may take a while yet


def _rewatch_lost(m: ConsumerRequest, ev: EngineReady, core: Core) -> None:
    """The last engine is ready, but one that was ready before has disconnected (or failed)
    since: it is handshaken again before anything is read from it."""
    assert m.req is not None
    _engine_ready(m, ev, core)
    _watch_unconnected(m, m.req, core, ev.t_ns)


def _all_engines_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> None:
    m.waiting = 0
    _post_reads(m, core, ev.t_ns)


def _notify_when_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> None:
    m.waiting = 0
    _disarm_deadline(m, core)
    _notify_unread(m, core, ev.t_ns)
    _let_go(m, core, ev.t_ns)
    core.finished(m, "notified", ev.t_ns)


def _fail(m: ConsumerRequest, error: str, remote_fault: bool) -> None:
    if not m.error:
        m.error, m.remote_fault = error, remote_fault


def _refuse(m: ConsumerRequest, ev: ReadRequested, core: Core, error: str, remote_fault: bool) -> None:
    """Fail a request before any read: reported at the next collect, nobody notified."""
    _accept(m, ev, core)
    _fail(m, error, remote_fault)
    core.ready(m)


# One action per refusing option of (NEW, ReadRequested): the table's guard decided why.
def _refuse_pp(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    _refuse(m, ev, core, str(UnsupportedPP(ev.remote_pp - 1)), False)


def _refuse_layout(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    _refuse(m, ev, core, "the two engines' layouts cannot exchange KV blocks", False)


def _refuse_lease_over(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    _refuse(m, ev, core, "the producer's lease may already have run out: its blocks cannot be trusted", True)
    m.trust = times_of(ev, core)[1]
    _notify_unread(m, core, ev.t_ns, connected_only=True)  # held still only if heartbeats asked (notify_until)


def _refuse_contradiction(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    """The params contradict a connected engine's handshake reply. Either may be the stale one: a
    producer restarted under the same engine id with another layout hands out params its old reply
    contradicts, and no read to the old agent would ever say so (smg 2382). So each engine that
    contradicts is also asked to be evicted (it is, unless a read still holds it): the next
    request handshakes afresh instead of being refused for ever."""
    _refuse(m, ev, core, _evict_contradicted(ev, core, ev.t_ns), True)


def _evict_contradicted(req: ReadRequested, core: Core, t_ns: int) -> str:
    """Ask to evict every connected engine the request contradicts, but one with a rank younger
    than the params (they are the stale side); returns the first reason."""
    found = list(contradictions(req, core))
    skew = core.hold_skew_ns
    _evict(req, core, t_ns, [pp for pp, _ in found
                             if not _predates(req.issued_wall_ns, core.engines[(req.engine_id, pp)], skew)])
    return found[0][1] if found else ""


def _evict(req: ReadRequested, core: Core, t_ns: int, stages: list[int]) -> None:
    """Ask to evict these connected stages, and the stages of their layout past the params' PP
    size: no plan of these params reads them, so nothing else would (a producer restarted with
    fewer PP stages: its old stage 1 still claimed layers the new stage 0 holds, and every read
    was refused)."""
    evict = set(stages)
    for pp in stages:
        reply = core.engines[(req.engine_id, pp)].reply
        if reply is not None:
            evict.update(p for p in range(req.remote_pp, reply.pp_size) if (req.engine_id, p) in core.engines)
    for pp in sorted(evict):
        core.derive(EvictRequested(source=Source.CORE, t_ns=t_ns, engine_id=req.engine_id, pp_rank=pp))


def _stale_reply(m: ConsumerRequest, ev: ReadRequested, core: Core) -> bool:
    """The params contradict connected engines whose replies may be the stale side (none has a rank
    that started after the params were issued), and every connected stage of the plan can be
    evicted now (no request holds it) and no stage is in a failed handshake's retry pause: a
    producer restarted under the same engine id while idle here (a new process, address or
    layout). Its fresh params are judged by fresh handshakes, not refused against the old reply,
    which cost a recompute and left the new process's hold to its lease (found by two helpers'
    hunts, after SGLang PR 36029 and NIXL issue 795)."""
    if next(contradictions(ev, core), None) is None:
        return False
    skew, t_ns = core.hold_skew_ns, ev.t_ns
    for pp in core.plan(ev.remote_tp, ev.remote_pp).pp_ranks:
        e = core.engines.get((ev.engine_id, pp))
        if e is None:
            continue
        if e.state is CONNECTED and (e.readers or _predates(ev.issued_wall_ns, e, skew)):
            return False
        if e.state is ENGINE_FAILED and e.pausing(t_ns, ev.host, ev.port):
            return False  # the request fails at once: a handshake started now would be for nobody
    return True


def _handshake_again(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    """Evict every connected stage of the plan, not the contradicted ones only (a sibling kept
    would judge a stop meanwhile alone, without the minting stage's verdict), and wait for fresh
    handshakes; once they are ready, params they still contradict are refused, or dropped, with no
    eviction (the replies are then the newer side)."""
    stages = [pp for pp in core.plan(ev.remote_tp, ev.remote_pp).pp_ranks
              if core.engine_connected((ev.engine_id, pp))]
    _evict(ev, core, ev.t_ns, stages)
    _accept(m, ev, core)
    _arm_deadline(m, ev, core)
    # Derived after the evictions, so the watches start fresh machines.
    _watch_unconnected(m, ev, core, ev.t_ns, sum(1 << pp for pp in stages))


def _drop_contradicted(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    """Notify-only params that contradict a connected engine: notifying it would tell the wrong
    ranks, or another engine, of a request it does not hold. Nobody is told (the producer's lease
    releases its blocks) and, as for a read, the engine is asked to be evicted."""
    _drop(m, ev, core, _evict_contradicted(ev, core, ev.t_ns), True)


def _drop_contradicted_when_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> None:
    """As :func:`_drop_contradicted`, found once the engine is ready: nobody is told."""
    assert m.req is not None
    _stop_when_ready(m, ev, core, disagreement(m.req, core) or "")
    core.finished(m, "dropped", ev.t_ns)


def _drop(m: ConsumerRequest, ev: ReadRequested, core: Core, error: str, remote_fault: bool) -> None:
    """Drop a notify-only request before anything is sent: nobody is told, nothing reported."""
    _accept(m, ev, core)
    _fail(m, error, remote_fault)
    core.finished(m, "dropped", ev.t_ns)


_LEASE_OVER: Final = "the producer's lease is over: it releases the blocks itself, unnotified"


def _drop_lease_over(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    _drop(m, ev, core, _LEASE_OVER, False)


def _drop_lease_over_when_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> None:
    _stop_when_ready(m, ev, core, _LEASE_OVER, remote_fault=False)
    core.finished(m, "dropped", ev.t_ns)


def _drop_notify_only(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    _drop(m, ev, core, str(UnsupportedPP(ev.remote_pp - 1)), False)


def _drop_bad_layout(m: ConsumerRequest, ev: ReadRequested, core: Core) -> None:
    _drop(m, ev, core, "the two engines' layouts cannot exchange KV blocks", False)


def _engine_failed(m: ConsumerRequest, ev: EngineFailed, core: Core) -> None:
    _fail(m, f"handshake with {ev.engine_id} pp_rank {ev.pp_rank} failed: {ev.error}", ev.remote_fault)
    _notify_unread(m, core, ev.t_ns, connected_only=True)
    _stop_waiting(m, core, ev.t_ns)
    core.ready(m)


def _engine_failed_notify_only(m: ConsumerRequest, ev: EngineFailed, core: Core) -> None:
    _fail(m, f"handshake with {ev.engine_id} pp_rank {ev.pp_rank} failed (ranks not connected are left to "
             f"the producer's lease): {ev.error}", ev.remote_fault)
    _notify_unread(m, core, ev.t_ns, connected_only=True)
    _stop_waiting(m, core, ev.t_ns)
    core.finished(m, "dropped", ev.t_ns)


def _timed_out_waiting(m: ConsumerRequest, ev: DeadlinePassed, core: Core) -> None:
    _fail(m, "deadline passed while waiting for the remote engine", True)
    _notify_unread(m, core, ev.t_ns, connected_only=True)
    _stop_waiting(m, core, ev.t_ns)
    core.ready(m)


def _timed_out_notify_only(m: ConsumerRequest, ev: DeadlinePassed, core: Core) -> None:
    _fail(m, "deadline passed while waiting for the remote engine (ranks not connected are left to the "
             "producer's lease)", True)
    _notify_unread(m, core, ev.t_ns, connected_only=True)
    _stop_waiting(m, core, ev.t_ns)
    core.finished(m, "dropped", ev.t_ns)


def _aborted_waiting(m: ConsumerRequest, ev: AbortRequested, core: Core) -> None:
    _notify_unread(m, core, ev.t_ns, connected_only=True)
    _stop_waiting(m, core, ev.t_ns)
    core.ready(m)


def _abort_notify_only(m: ConsumerRequest, ev: AbortRequested, core: Core) -> None:
    """Nothing was read and the scheduler is not waiting for it: stop, telling the connected
    engines' ranks; the producer's lease releases the rest."""
    _notify_unread(m, core, ev.t_ns, connected_only=True)
    _stop_waiting(m, core, ev.t_ns)
    core.finished(m, "dropped", ev.t_ns)


def _quarantine_waiting(m: ConsumerRequest, ev: Quarantined, core: Core) -> None:
    _fail(m, f"quarantined: {ev.reason}", False)
    _notify_unread(m, core, ev.t_ns, connected_only=True)
    _stop_waiting(m, core, ev.t_ns)
    core.ready(m)


def _quarantine_notify_only(m: ConsumerRequest, ev: Quarantined, core: Core) -> None:
    _fail(m, f"quarantined: {ev.reason}", False)
    _notify_unread(m, core, ev.t_ns, connected_only=True)
    _stop_waiting(m, core, ev.t_ns)
    core.finished(m, "dropped", ev.t_ns)


def _stopped(m: ConsumerRequest, ev: HandleDone | HandleFailed) -> None:
    bit = _bit(m, ev)
    m.pending &= ~bit
    if isinstance(ev, HandleDone):
        m.done |= bit
    else:
        _fail(m, f"read from rank ({ev.pp_rank}, {ev.tp_rank}) {ev.why.value}"
                 + (f": {ev.detail}" if ev.detail else ""), ev.why.remote_fault)


def _sibling_stopped(m: ConsumerRequest, ev: HandleDone | HandleFailed, core: Core) -> None:
    _stopped(m, ev)


def _failed_cancel_rest(m: ConsumerRequest, ev: HandleFailed, core: Core) -> None:
    """One read failed: the request is failed whatever its siblings do, so stop them now rather
    than wait for them (a hung read has no timeout of its own)."""
    _stopped(m, ev)
    _cancel_reads(m, core, ev.t_ns)


def _late_stopped(m: ConsumerRequest, ev: HandleDone, core: Core) -> None:
    """A read completed too late to be trusted: it may have copied reused blocks. Not trusted (an
    aborting request reports them invalid; its siblings were cancelled with the abort)."""
    _stopped(m, ev)
    bound = "the producer's lease less the margin" if m.req and m.req.lease_ns else "the read timeout: no lease known"
    _fail(m, f"read from rank ({ev.pp_rank}, {ev.tp_rank}) completed after the deadline to trust it ({bound})", True)


def _late(m: ConsumerRequest, ev: HandleDone, core: Core) -> None:
    _late_stopped(m, ev, core)
    _cancel_reads(m, core, ev.t_ns)


def _late_last(m: ConsumerRequest, ev: HandleDone, core: Core) -> None:
    """The last read, late (nothing left to cancel)."""
    _late_stopped(m, ev, core)
    _last_stopped(m, ev, core)


def _stop_when_ready(m: ConsumerRequest, ev: EngineReady, core: Core, error: str, *,
                     remote_fault: bool = True) -> None:
    """The last engine is ready but the request will not read: nothing was posted, so nobody is
    notified (the producer's lease releases its blocks). The ready engine already forgot it."""
    _fail(m, error, remote_fault)
    m.waiting &= ~(1 << ev.pp_rank)
    _stop_waiting(m, core, ev.t_ns)


def _give_up_when_ready(m: ConsumerRequest, ev: EngineReady, core: Core, error: str) -> None:
    _stop_when_ready(m, ev, core, error)
    core.ready(m)


def _timed_out_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> None:
    _notify_unread(m, core, ev.t_ns, connected_only=True)
    _give_up_when_ready(m, ev, core, "deadline passed while waiting for the remote engine")


def _refused_when_ready(m: ConsumerRequest, ev: EngineReady, core: Core) -> None:
    """The params contradict the handshake (a plan built on them would notify the wrong ranks)."""
    assert m.req is not None
    _give_up_when_ready(m, ev, core, disagreement(m.req, core) or "")


def _last_stopped(m: ConsumerRequest, ev: HandleDone | HandleFailed, core: Core) -> None:
    _stopped(m, ev)
    _disarm_deadline(m, core)
    _notify_unread(m, core, ev.t_ns)
    _let_go(m, core, ev.t_ns)
    core.ready(m)


def _read_done(m: ConsumerRequest, ev: HandleDone, core: Core) -> None:
    """The last read completed: _last_stopped for a HandleDone, spelt out for the common case."""
    plan = m.plan
    assert plan is not None
    done = m.done = m.done | m.pending
    m.pending = 0
    if m.deadline is not None:
        core.deadlines.disarm(m.request_id, m.deadline)
        m.deadline = None
    if done != plan.all_read or plan.notify_only:
        _notify_unread(m, core, ev.t_ns)
    _let_go(m, core, ev.t_ns)
    core.ready(m)


def cancel_pending(m: ConsumerRequest, pp_rank: int, tp_rank: int) -> bool:
    """The request is stopping and its read from rank (pp_rank, tp_rank) has not stopped: a
    cancel of it is still wanted (an adapter retrying one that raised asks)."""
    plan = m.plan
    return plan is not None and m.state in STOPPING and any(
        (m.pending >> i) & 1 and src.pp_rank == pp_rank and src.tp_rank == tp_rank
        for i, src in enumerate(plan.sources))


def _cancel_reads(m: ConsumerRequest, core: Core, t_ns: int) -> None:
    """Cancel the reads in flight, and watch them stop: the request's timer now fires
    ``cancel_grace_ns`` on (its read deadline no longer matters: it is stopping)."""
    assert m.plan is not None
    for i, src in enumerate(m.plan.sources):
        if (m.pending >> i) & 1:
            core.emit(CancelRead(request_id=m.request_id, pp_rank=src.pp_rank, tp_rank=src.tp_rank))
    _disarm_deadline(m, core)
    m.deadline = max(t_ns, core.latest_t_ns) + core.cancel_grace_ns  # from now: the event may be stamped earlier
    core.deadlines.arm(m.request_id, m.deadline)


def _hung_reads_connected(m: ConsumerRequest, ev: DeadlinePassed, core: Core) -> bool:
    """Reads still in flight a grace after their cancel, over a connection still live (the one
    they were posted on: not handshaken again since) and not yet marked stalled."""
    return bool(_hung_engines(m, core))


def _hung_engines(m: ConsumerRequest, core: Core) -> list[RemoteEngine]:
    """The usable stages a cancelled read of this request still runs on, over the connection it
    was posted on."""
    if m.plan is None or m.req is None:
        return []
    eid = m.req.engine_id
    stages = sorted({src.pp_rank for i, src in enumerate(m.plan.sources) if (m.pending >> i) & 1})
    return [e for pp in stages if (e := core.engines.get((eid, pp))) is not None and e.usable
            and e in m.engines and _read_over(m, e) == e.attempt]


def _hung(m: ConsumerRequest, ev: DeadlinePassed, core: Core) -> None:
    """The peer no longer answers: a cancelled read did not stop within the grace (SGLang PR
    10222: a dead prefill's rooms must fail; TRT-LLM PR 12313: blocks leaked until the pool ran
    out). Its stage is marked stalled: new requests for it fail fast with their policy (the engine
    table) instead of pinning their blocks behind the hung reads, until a reader of that
    connection lets go (a read of it stopped). The connection is kept: reads still running on it
    finish, and notices still go out over it, once the peer answers again. This request still
    waits for its own reads to stop before it is reported."""
    m.deadline = None
    for e in _hung_engines(m, core):
        e.stalled = True


def _hang_watched(m: ConsumerRequest, ev: DeadlinePassed, core: Core) -> None:
    m.deadline = None


def _abort_reads(m: ConsumerRequest, ev: AbortRequested, core: Core) -> None:
    _cancel_reads(m, core, ev.t_ns)


def _expire_reads(m: ConsumerRequest, ev: DeadlinePassed, core: Core) -> None:
    _fail(m, "deadline passed before every read completed", True)
    m.deadline = None
    _cancel_reads(m, core, ev.t_ns)


def _quarantine_reads(m: ConsumerRequest, ev: Quarantined, core: Core) -> None:
    _fail(m, f"quarantined: {ev.reason}", False)
    _cancel_reads(m, core, ev.t_ns)


def _quarantine_done(m: ConsumerRequest, ev: Quarantined, core: Core) -> None:
    _fail(m, f"quarantined: {ev.reason}", False)


def _hand_off(m: ConsumerRequest, ev: Reported, core: Core) -> None:
    st = m.state
    if st is S.NOTIFIED:
        core.emit(HandOff(request_id=m.request_id, outcome="received"))
        if core.log_info:  # the one line per finished request; the outcome is recorded either way
            core.finished(m, "received", ev.t_ns)
        else:
            m.outcome = "received"
    elif st is S.FAILED:
        core.emit(HandOff(request_id=m.request_id, outcome="failed", invalid_blocks=m.local_blocks,
                          policy=core.config.policy, reason=m.error))
        core.finished(m, "failed", ev.t_ns)
    else:  # aborted: its blocks are invalid too unless every read into them completed, trusted
        plan = m.plan  # (m.error: one completed late, or the request failed before the abort)
        whole = plan is not None and bool(plan.all_read) and m.done == plan.all_read and not m.error
        core.emit(HandOff(request_id=m.request_id, outcome="aborted", reason=m.error,
                          invalid_blocks=() if whole else m.local_blocks))
        core.finished(m, "aborted", ev.t_ns)


def _why(m: ConsumerRequest, ev: object, core: Core) -> str:
    return m.error


# --- the table --------------------------------------------------------------------------------

LIVE = (S.HANDSHAKING, S.READING, S.NOTIFIED, S.FAILING, S.FAILED, S.ABORTING, S.ABORTED)
AFTER_READS = (S.NOTIFIED, S.FAILED, S.ABORTED)  # every handle stopped, waiting for hand-off
STOPPING = (S.FAILING, S.ABORTING)  # failed or aborted, handles still in flight
local, remote = Fault.LOCAL, Fault.REMOTE

_not_in_flight_illegal = Illegal(local, "completion for a read that is not in flight", when=_not_in_flight)


def _join(stay: State, end: State) -> tuple[Go, Go]:
    """A stopping request waits for every sibling read: the last one to stop moves it to ``end``."""
    return Go(stay, _sibling_stopped, when=_siblings_in_flight), Go(end, _last_stopped)

TABLE: Final[Table] = Table(
    "consumer",
    states=(S.NEW, *LIVE, S.RELEASED),
    initial=S.NEW,
    events=(ReadRequested, EngineReady, EngineFailed, HandleDone, HandleFailed, AbortRequested, Promised,
            DeadlinePassed, Reported, Quarantined),
    cells=(
        # NEW: the request does not exist yet (or its record was forgotten).
        on(
            S.NEW,
            ReadRequested,
            Go(S.READING, _read_now, when=_can_read_now),
            Illegal(local, "deadline is on another clock: rebase it first", when=_foreign_deadline),
            Go(S.RELEASED, _drop_notify_only, when=_pp_unsupported_notify_only, fault=local,
               reason="transport cannot serve pp_rank > 0; producer left to its lease"),
            Go(S.FAILED, _refuse_pp, when=_pp_unsupported, fault=local,
               reason="transport cannot serve pp_rank > 0"),
            # Nothing to read, so nobody waits for it: dropped, never handed to the scheduler.
            Go(S.RELEASED, _drop_bad_layout, when=_bad_topology_notify_only, fault=local,
               reason="the engines' layouts cannot exchange KV blocks; producer left to its lease"),
            Go(S.FAILED, _refuse_layout, when=_bad_topology, fault=local,
               reason="the engines' layouts cannot exchange KV blocks"),
            Go(S.FAILED, _refuse_lease_over, when=_lease_over),
            Go(S.RELEASED, _drop_lease_over, when=_lease_over_notify_only),
            Go(S.HANDSHAKING, _handshake_again, when=_stale_reply,
               reason="the params contradict the cached handshake reply of an engine no request holds: "
                      "handshaken again, the params judged by the fresh reply"),
            Go(S.RELEASED, _drop_contradicted, when=_disagrees_notify_only, fault=remote,
               reason="the params contradict the producer's handshake reply; producer left to its lease",
               explain=_why),
            Go(S.FAILED, _refuse_contradiction, when=_disagrees, fault=remote,
               reason="the params contradict the producer's handshake reply", explain=_why),
            Go(S.HANDSHAKING, _wait_for_engines, when=_engines_pending),
            Go(S.RELEASED, _notify_only_now, when=_nothing_to_read),
            Go(S.READING, _read_now),
        ),
        on(S.NEW, (HandleDone, HandleFailed, DeadlinePassed, Reported, Quarantined), Illegal(local, "no such request")),
        on(S.NEW, AbortRequested, Ignore("no such request: nothing to abort")),
        # A heartbeat after the load: until when its notices are owed (the Connector sends it only
        # for a live load; a promise made before the load comes in ReadRequested).
        on(S.NEW, Promised, Ignore("no such request: a load carries the promises made before it")),
        *(on(st, Promised, Ignore("a promise for other params: a later load under this request id",
                                  when=_of_other_params), Go(st, _promise))
          for st in (S.HANDSHAKING, S.READING, *STOPPING)),
        on((*AFTER_READS, S.RELEASED), Promised, Ignore("every read has stopped: its notices were settled then")),
        # A request id is never requested twice.
        on((*LIVE, S.RELEASED), ReadRequested, Illegal(local, "request id already in use")),
        # HANDSHAKING: waiting for remote engines.
        on(
            S.HANDSHAKING,
            EngineReady,
            Illegal(local, "not waiting for that engine", when=_not_waiting_for_it),
            Go(S.HANDSHAKING, _engine_ready, when=_other_engines_pending),
            Go(S.RELEASED, _drop_contradicted_when_ready, when=_disagrees_notify_only_when_ready, fault=remote,
               reason="the params contradict the producer's handshake reply; producer left to its lease",
               explain=_why),
            Go(S.RELEASED, _drop_lease_over_when_ready, when=_lease_over_notify_only_when_ready),
            Go(S.FAILED, _timed_out_ready, when=_read_past_deadline),
            Go(S.FAILED, _refused_when_ready, when=_read_disagrees_when_ready, fault=remote,
               reason="the params contradict the producer's handshake reply", explain=_why),
            Go(S.HANDSHAKING, _rewatch_lost, when=_held_engine_lost),
            Go(S.RELEASED, _notify_when_ready, when=_nothing_to_read),
            Go(S.READING, _all_engines_ready),
        ),
        on(
            S.HANDSHAKING,
            EngineFailed,
            Illegal(local, "not waiting for that engine", when=_not_waiting_for_it),
            Go(S.RELEASED, _engine_failed_notify_only, when=_nothing_to_read),
            Go(S.FAILED, _engine_failed),
        ),
        on(S.HANDSHAKING, (HandleDone, HandleFailed), Illegal(local, "no read has been posted")),
        on(S.HANDSHAKING, AbortRequested, Go(S.RELEASED, _abort_notify_only, when=_nothing_to_read),
           Go(S.ABORTED, _aborted_waiting)),
        on(
            S.HANDSHAKING,
            DeadlinePassed,
            Go(S.RELEASED, _timed_out_notify_only, when=_nothing_to_read),
            Go(S.FAILED, _timed_out_waiting),
        ),
        on(
            S.HANDSHAKING,
            Quarantined,
            Go(S.RELEASED, _quarantine_notify_only, when=_nothing_to_read),
            Go(S.FAILED, _quarantine_waiting),
        ),
        # Engine news reaches only requests that wait, or waited, for it.
        on((S.READING, *AFTER_READS, *STOPPING), (EngineReady, EngineFailed),
           Ignore("stale engine news: the request no longer waits for that engine", when=_stopped_waiting_for_it),
           Illegal(local, "engine news for a request that is not waiting for an engine")),
        # Only derived news names a request, and a request leaves every waiting list as it stops:
        # news after its release was derived before, in the cascade a sibling stage's news released
        # it in (a notify-only PP request whose two stages timed out in one Tick: a local violation,
        # found by a helper's long hunts), its tombstone maybe gone since (NEW: tombstones 0 or 1).
        on((S.NEW, S.RELEASED), (EngineReady, EngineFailed),
           Ignore("stale engine news: derived before a sibling stage's news released the request")),
        # READING: the multi-handle join.
        on(
            S.READING,
            HandleDone,
            Go(S.NOTIFIED, _read_done, when=_last_in_flight),
            _not_in_flight_illegal,
            Go(S.FAILING, _late, when=_untrusted_with_siblings),
            Go(S.FAILED, _late_last, when=_untrusted),
            Go(S.READING, _sibling_stopped),
        ),
        on(
            S.READING,
            HandleFailed,
            _not_in_flight_illegal,
            Go(S.FAILING, _failed_cancel_rest, when=_siblings_in_flight),
            Go(S.FAILED, _last_stopped),
        ),
        on(S.READING, AbortRequested, Go(S.ABORTING, _abort_reads)),
        on(S.READING, DeadlinePassed, Go(S.FAILING, _expire_reads)),
        on(S.READING, Quarantined, Go(S.FAILING, _quarantine_reads)),
        # FAILING / ABORTING: wait for every sibling read to stop before anything is reported.
        on(
            S.FAILING,
            (HandleDone, HandleFailed),
            _not_in_flight_illegal,
            *_join(S.FAILING, S.FAILED),
        ),
        on(
            S.ABORTING,
            HandleDone,
            _not_in_flight_illegal,
            Go(S.ABORTING, _late_stopped, when=_untrusted_with_siblings),
            Go(S.ABORTED, _late_last, when=_untrusted),
            *_join(S.ABORTING, S.ABORTED),
        ),
        on(S.ABORTING, HandleFailed, _not_in_flight_illegal, *_join(S.ABORTING, S.ABORTED)),
        on(S.FAILING, AbortRequested, Go(S.ABORTING)),
        on(S.ABORTING, AbortRequested, Ignore("already aborting")),
        *(on(st, DeadlinePassed, Go(st, _hung, when=_hung_reads_connected, reason="cancelled reads outlived "
                                    "cancel_grace_ns: their engine stage is marked stalled"),
             Go(st, _hang_watched, reason="cancelled reads outlived cancel_grace_ns, over connections "
                                         "already lost, replaced or marked stalled"))
          for st in STOPPING),
        on(STOPPING, Quarantined, Ignore("already stopping: waiting for in-flight reads")),
        # Every read has stopped: waiting for the scheduler to collect the request.
        on((*AFTER_READS, S.RELEASED), (HandleDone, HandleFailed),
           Illegal(local, "completion for a read that is not in flight")),
        on(S.NOTIFIED, AbortRequested, Ignore("reads complete: handed back at the next collect")),
        on(S.FAILED, AbortRequested, Go(S.ABORTED)),  # still queued; goes back as aborted
        on(S.ABORTED, AbortRequested, Ignore("already aborted")),
        on(AFTER_READS, DeadlinePassed, Ignore("every read has stopped")),
        on(S.NOTIFIED, Quarantined, Go(S.FAILED, _quarantine_done)),
        on((S.FAILED, S.ABORTED), Quarantined, Ignore("already failed or aborted")),
        on(AFTER_READS, Reported, Go(S.RELEASED, _hand_off)),
        on((S.HANDSHAKING, S.READING, *STOPPING), Reported,
           Illegal(local, "not finished: it cannot be handed back yet")),
        # RELEASED: handed back; only late news arrives here.
        on(S.RELEASED, AbortRequested, Ignore("already released")),
        on(S.RELEASED, DeadlinePassed, Ignore("already released")),
        on(S.RELEASED, Reported, Illegal(local, "already handed back: a request is reported once")),
        on(S.RELEASED, Quarantined, Ignore("already released")),
    ),
)
