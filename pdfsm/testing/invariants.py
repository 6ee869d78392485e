"""The invariants a correct implementation keeps (how PD transfer must behave), as checks on a :class:`World`.

``STEP_INVARIANTS`` hold after every step; ``END_INVARIANTS`` once the world has settled
(:meth:`World.drain`). Each is a plain function ``(world) -> None`` that calls
``world.fail(...)``; a user's own invariants take the same shape, and may ``assert`` instead
(:meth:`World.check` turns an AssertionError into the same violation, steps and logs included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdfsm import consumer, engine, producer
from pdfsm.events import HandshakeFailed
from pdfsm.fsm import Fault
from pdfsm.records import Outcome

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from pdfsm.records import Record
    from pdfsm.testing.world import World

__all__ = ["END_INVARIANTS", "EXTRA_INVARIANTS", "STEP_INVARIANTS"]


def reported_at_most_once(w: World) -> None:
    """1. A request is reported to the scheduler exactly once (never twice)."""
    for (rank, rid), offs in w.hand_offs.items():
        if len(offs) > 1:
            w.fail(f"D{rank} reported {rid} {len(offs)} times: {[o.outcome for o in offs]}")


def no_report_while_reading(w: World) -> None:
    """2. No local block goes back to the scheduler while a READ into it may still run."""
    for rank, rid, pp, tp in w.reads:
        if (rank, rid) in w.hand_offs:
            w.fail(f"D{rank} handed {rid} back while its read from ({pp}, {tp}) was still in flight")


def failures_carry_their_blocks(w: World) -> None:
    """3. A failed request is reported with its invalid blocks and the configured policy."""
    for (rank, rid), offs in w.hand_offs.items():
        i = int(rid[1:])
        for off in offs:
            if off.outcome == "failed" and (off.invalid_blocks != w.blocks[i] or off.policy != w.s.policy):
                w.fail(f"D{rank} reported {rid} failed with blocks {off.invalid_blocks} and policy {off.policy}; "
                       f"expected {w.blocks[i]} and {w.s.policy}")


def notify_only_never_reported(w: World) -> None:
    """A notify-only request owes the producer a notification but is never reported."""
    for (rank, rid) in w.hand_offs:
        if not w.blocks[int(rid[1:])]:
            w.fail(f"D{rank} reported notify-only request {rid} to the scheduler")


def received_bytes_are_the_promised_ones(w: World) -> None:
    """2 and 4 seen from the data: every block read came from the named engine, unreused."""
    for (rank, rid), offs in w.hand_offs.items():
        if offs[0].outcome != "received":
            continue
        for agent, block, got, promised in w.read_versions.get((rank, rid), []):
            if got != promised:
                w.fail(f"D{rank} received {rid} with block {block} from {agent} in version {got}, "
                       f"but the prefill wrote version {promised}: the bytes are not the request's")


def received_requests_read_every_source(w: World) -> None:
    """A request reported received read every source of its plan to the end (a failed or missing
    read post-processed as a success, vLLM PR 40364, reads nothing the byte check could see)."""
    for (rank, rid), offs in w.hand_offs.items():
        if offs[0].outcome != "received":
            continue
        plan = w.consumers[rank].plan(w.s.producer_tp, w.s.producer_pp)
        missing = [(s.pp_rank, s.tp_rank) for s in plan.sources if (rank, rid, s.pp_rank, s.tp_rank) not in w.read_done]
        if missing:
            w.fail(f"D{rank} reported {rid} received, but its reads from {missing} never completed")


def producer_frees_once(w: World) -> None:
    """4. P releases a request's blocks exactly once (never twice)."""
    for (agent, rid), frees in w.freed.items():
        if len(frees) > 1:
            w.fail(f"{agent} freed the blocks of {rid} {len(frees)} times")


def leases_expire_on_time(w: World) -> None:
    """6. Deadlines are compared in one clock domain: no lease expires before its time."""
    for (agent, rid), frees in w.freed.items():
        start = w.lease_from.get((agent, rid), 0)
        if any(f.expired for f in frees) and w.now - start < w.s.lease_ns:
            w.fail(f"{agent} expired the lease of {rid} after {w.now - start} ns, before its {w.s.lease_ns} ns")


def holds_end_on_time(w: World) -> None:
    """6, the other bound: no hold is kept past its lease from the end of prefill, or a heartbeat's
    extension from its arrival (a lease in the wrong unit, or heartbeats adding up, would pin
    blocks for ever; the settled world's end check alone let both through: a helper's mutants)."""
    for (pp, tp), core in w.producers.items():
        name = f"P{pp}.{tp}"
        for rid, m in core.producers.items():
            if m.state is producer.S.HOLDING and m.deadline > (bound := w.hold_until.get((name, rid), 0)):
                w.fail(f"{name} holds {rid} until {m.deadline} ns, past the {bound} ns its lease and heartbeats allow")


def notifications_name_producer_requests(w: World) -> None:
    """5. Notifications carry the producer's request id, never the consumer's local id."""
    valid = {w.prid(i) for i in range(w.s.requests)}
    for note in w.notifications:
        if note.request_id not in valid:
            w.fail(f"a notification names {note.request_id!r}, which is no producer request")


def no_request_waits_on_an_idle_engine(w: World) -> None:
    """Every request still handshaking is on the waiting list of a handshake in progress."""
    live = (engine.S.HANDSHAKING, engine.S.CONNECTING)
    for rank, core in enumerate(w.consumers):
        for rid, m in core.consumers.items():
            if m.state is not consumer.S.HANDSHAKING or m.req is None:
                continue
            for pp in range(w.s.producer_pp):
                if (m.waiting >> pp) & 1:
                    e = core.engines.get((m.req.engine_id, pp))
                    if e is None or e.state not in live or (rid not in e.waiters and rid not in e.aside):
                        state = e.state if e is not None else "absent"
                        w.fail(f"D{rank}: {rid} waits for engine ({m.req.engine_id}, {pp}), which is {state} "
                               "and will never tell it")


def nothing_overdue(w: World) -> None:
    """Right after a tick, every lease and read deadline at or before it has expired (on each core
    the step ticked: one whose timer fell behind expires nothing until its late Tick comes)."""
    if not w.ticked:
        return
    tick = w.last_tick_ns
    for name in w.ticked:
        core = w.core(name)
        for table, timers in ((core.consumers, core.deadlines), (core.producers, core.leases)):
            for key, m in table.items():
                if m.deadline is not None and m.deadline <= tick and key in timers:
                    w.fail(f"{name}: {key} is overdue: its deadline {m.deadline} passed at the tick of "
                           f"{tick}, and it is still {m.state}")


def transport_only_from_its_owner(w: World) -> None:
    """NIXL is not thread-safe: the transport is called from the owner thread only."""
    if w.transport_calls_off_owner:
        w.fail("the handshake thread called the transport while the owner thread polls it")


def pp_only_where_supported(w: World) -> None:
    """A transport that cannot do PP is never asked to serve pp_rank > 0."""
    if w.pp_asked_of_non_pp:
        w.fail("a transport without PP support was asked to serve pp_rank > 0")


def no_local_violation(w: World) -> None:
    """8. The world injects only remote faults: an illegal event blamed on us is a bug of ours.
    (A handled local fault, such as refusing PP on a transport without it, is the design.)"""
    if w.rejections(Fault.LOCAL):
        bad = [r for recs in w.records().values() for r in recs
               if r.fault is Fault.LOCAL and r.outcome.name == "REJECTED"]
        first = bad[0]
        w.fail(f"a local violation: {first.machine} {type(first.event).__name__} in {first.before}: {first.reason}")


def every_request_reported(w: World) -> None:
    """1. At rest, every request with blocks was reported exactly once on every consumer rank."""
    for rank, rid in sorted(w.requested):
        if w.blocks[int(rid[1:])] and len(w.hand_offs.get((rank, rid), [])) != 1:
            w.fail(f"D{rank} never reported {rid}")


def every_promise_released(w: World) -> None:
    """4. At rest, every registered producer request was freed exactly once."""
    for key in w.registered:
        if len(w.freed.get(key, [])) != 1:
            w.fail(f"{key[0]} still holds the blocks of {key[1]}")


def notices_reach_only_their_holders(w: World) -> None:
    """At rest, every notification that reached a producer rank's live process names a hold that
    process registered: a process that replaced a restarted rank never held its predecessor's
    (it stages the notice of a hold it never had; a helper's hunt found PP stage 1 told so)."""
    live = {w.incarnation(pp, tp) for pp, tp in w.started}
    for process, rid in sorted(w.reached - w.held_by):
        if process in live:
            w.fail(f"{process} was told of {rid}, a hold it never had (its rank restarted since the params)")


def nothing_left_running(w: World) -> None:
    """At rest no read is in flight and every request machine is terminal."""
    if w.reads:
        w.fail(f"reads still in flight at rest: {sorted(w.reads)}")
    for name, core in zip(("D",) * len(w.consumers), w.consumers, strict=True):
        if core.consumers:
            w.fail(f"{name}: requests not terminal at rest: {sorted(core.consumers)}")
    for (pp, tp), core in w.producers.items():
        if core.producers:
            w.fail(f"P{pp}.{tp}: requests not terminal at rest: {sorted(core.producers)}")


def effects_not_stamped_before_their_cause(w: World) -> None:
    """A derived event is stamped no earlier than the event it follows from: news is acted on at
    the time it arrives. (An effect stamped with an older time makes time-guarded options, such as
    an engine's retry pause, decide on a moment already past.) Opt-in: see ``EXTRA_INVARIANTS``."""
    for name, records in w.records().items():
        t_of = {r.seq: r.event.t_ns for r in records}
        for r in records:
            if r.cause is not None and r.cause in t_of and r.event.t_ns < t_of[r.cause]:
                ev: Any = r.event
                key = (ev.engine_id, ev.pp_rank) if r.machine == "engine" else getattr(ev, "request_id", "")
                w.fail(f"{name}: {type(ev).__name__} for {r.machine} {key!r} (seq {r.seq}) is stamped "
                       f"{ev.t_ns}, before the event it follows from (seq {r.cause}, at {t_of[r.cause]})")


def stopped_requests_told_every_rank(w: World) -> None:
    """At rest, a request that stopped (received, failed, aborted, or notify-only) while the
    producer still held for it told every producer rank it reads or skips (MLA) that it is done,
    or tried to: a rank not told keeps the blocks a whole lease (vLLM PR 41269). Checked where the
    world broke no connection, for stages connected at some moment between the stop and the end of
    the lease the scheduler knew of, less the margin, and whose handshakes did not fail before that
    bound (a stage not reached by then, or failed when the request stopped or while notices were
    owed to it, may rightly not be told: docs/decisions.md), and where no stage's list of owed
    notices can fill (``max_staged`` at least one per request and producer TP rank: a notice past
    it is not kept)."""
    if (w.restarts or w.disconnects or w.link_drops or w.handshake_faults or "evict" in w.faults_used
            or w.s.max_staged < w.s.requests * w.s.producer_tp):
        return
    records = w.records()
    failed = {(int(name[1:]), pp): t for name, recs in records.items() if name.startswith("D")
              for pp, t in _first_handshake_failures(recs).items()}
    # A request with blocks stops as it is handed back; a notify-only one when its core lets it go:
    # it tells the ranks once every stage of the plan is ready, or at its deadline the connected
    # ones, unless that is past the trust bound (docs/decisions.md, "A notify-only request tells
    # its stages together").
    stops = dict(w.stopped_at)
    for (rank, rid), t in _let_go(records).items():
        if (rank, rid) in w.requested and not w.blocks[int(rid[1:])]:
            stops[(rank, rid)] = t
    for (rank, rid), at in sorted(stops.items()):
        i = int(rid[1:])
        by = w.tell_by[(rank, rid)]
        if at >= by:
            continue
        plan = w.consumers[rank].plan(w.s.producer_tp, w.s.producer_pp)
        ranks = [(s.pp_rank, s.tp_rank) for s in plan.sources] + list(plan.notify_only)
        # PP params that say their minting stage (0, with wall clocks) tell another stage only once
        # that stage vouched: not connected by the bound, it leaves them to the lease (decisions.md,
        # "Params name the producer process that minted them"; a focused search found this excuse
        # missing).
        vouched = (i not in w.minted_by or 0 not in {s.pp_rank for s in plan.sources}
                   or _connected_between(records[f"D{rank}"], 0, at, by))
        untold = [(pp, tp) for pp, tp in ranks if (rank, w.prid(i), pp, tp) not in w.told
                  and failed.get((rank, pp), by + 1) > by
                  and _connected_between(records[f"D{rank}"], pp, at, by)
                  and (pp == 0 or vouched)]
        if untold:
            w.fail(f"D{rank} stopped {rid} at {at} ns, before its producer's lease ran out, and never told "
                   f"producer ranks {untold}: they hold its blocks a whole lease")


def _let_go(records: dict[str, list[Record]]) -> dict[tuple[int, str], int]:
    """When each decode rank's consumer requests first reached a terminal state (core ns)."""
    out: dict[tuple[int, str], int] = {}
    for name, recs in records.items():
        if name.startswith("D"):
            for t, r in _applied_at(recs):
                if r.machine == "consumer" and r.state in ("RELEASED", "FAILED"):
                    out.setdefault((int(name[1:]), getattr(r.event, "request_id", "")), t)
    return out


def _applied_at(records: list[Record]) -> Iterator[tuple[int, Record]]:
    """Each record with when it took effect, on its core's clock: an event stamped before the
    latest one applied takes effect at that."""
    t = 0
    for r in records:
        t = max(t, r.event.t_ns)
        yield t, r


def _first_handshake_failures(records: list[Record]) -> dict[int, int]:
    """When each engine stage's handshake first failed: a failure drops the notices owed to that
    stage, and a stage failed as a request stops is owed none (docs/decisions.md)."""
    out: dict[int, int] = {}
    for t, r in _applied_at(records):
        if isinstance(r.event, HandshakeFailed) and r.outcome is Outcome.APPLIED:
            out.setdefault(r.event.pp_rank, t)
    return out


def _connected_between(records: list[Record], pp: int, lo: int, hi: int) -> bool:
    """The consumer's engine stage ``pp`` was connected at some moment in [lo, hi) (core ns)."""
    since: int | None = None  # connected from then on
    for t, r in _applied_at(records):
        if r.machine != "engine" or getattr(r.event, "pp_rank", None) != pp:
            continue
        if since is not None and t > lo and since < hi:
            return True
        since = (since if since is not None else t) if r.state == "CONNECTED" else None
    return since is not None and since < hi


STEP_INVARIANTS: list[Callable[[World], None]] = [
    reported_at_most_once, no_report_while_reading, failures_carry_their_blocks, notify_only_never_reported,
    received_bytes_are_the_promised_ones, received_requests_read_every_source, producer_frees_once,
    leases_expire_on_time, holds_end_on_time,
    notifications_name_producer_requests, no_request_waits_on_an_idle_engine, nothing_overdue,
    transport_only_from_its_owner,
    pp_only_where_supported, no_local_violation,
]
END_INVARIANTS: list[Callable[[World], None]] = [every_request_reported, every_promise_released,
                                                 nothing_left_running, stopped_requests_told_every_rank,
                                                 notices_reach_only_their_holders]
EXTRA_INVARIANTS: list[Callable[[World], None]] = [effects_not_stamped_before_their_cause]
"""Step invariants the searches do not check by default (pass them as ``invariants``): each scans
every record after every step, so it costs more than the others."""
