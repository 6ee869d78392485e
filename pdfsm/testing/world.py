"""A deterministic simulated prefill/decode world whose every interleaving is a choice.

Consumer ranks (decode workers) and producer ranks (prefill workers) are real
:class:`~pdfsm.core.Core` objects. Everything between them is simulated here: the
schedulers, the handshake thread, each read handle, each notification in flight,
the timers, and the faults. Each event source keeps its own order (a FIFO: a
scheduler's requests, one handle's completion); which source delivers next is a
*choice*, and so is every fault (a read ends ERR or its poll raises, a notification
is dropped or duplicated, a handshake is refused or answered by the wrong listener,
the peer disconnects, the lease runs out, a decode worker's timer falls behind). A
driver (Hypothesis, or the exhaustive search) makes the choices; the world applies them
and checks the invariants after every step. Time is counted in units the cores see as
milliseconds, each step a microsecond later (UNIT_NS, STEP_NS), so logs read as they would.

Ground truth is kept beside the machines: which reads are in flight, which producer
blocks have been freed and reused (a read that completes after its blocks were
reused copies the wrong bytes), what each request was promised. The invariants in
:mod:`pdfsm.testing.invariants` read it.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final, get_args

import msgspec
import structlog

from pdfsm.commands import (
    AddPeer,
    CancelRead,
    Command,
    DropPeer,
    FinishedSending,
    HandOff,
    PostRead,
    SendNotification,
    StartHandshake,
)
from pdfsm.core import Core, Tables
from pdfsm.events import (
    AbortRequested,
    BlocksHeld,
    Collect,
    CoreConfig,
    Deadline,
    Event,
    EvictRequested,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    HandshakeReply,
    Heartbeat,
    NotificationReceived,
    PeerAdded,
    PeerDisconnected,
    Policy,
    Promised,
    RankInfo,
    ReadRequested,
    SendFailed,
    Source,
    StagedDropped,
    Tick,
)
from pdfsm.fsm import Fault
from pdfsm.log import EventLog, MemorySink, Outcome, Record
from pdfsm.timers import Timers
from pdfsm.topology import MAX_KV_HEADS, TopologyError, heads_problem, tp_ratio
from pdfsm.wire import Notification

# Who stamps each event the world makes, as in production: a counterexample's trace then puts
# each on its thread's track.
_SOURCES: Final[dict[type, str]] = {
    **dict.fromkeys((BlocksHeld, ReadRequested, Collect, AbortRequested, EvictRequested, Promised), Source.SCHEDULER),
    **dict.fromkeys((HandshakeDone, HandshakeFailed, PeerAdded), Source.HANDSHAKE),
    **dict.fromkeys((HandleDone, HandleFailed, PeerDisconnected), Source.TRANSFER),
    **dict.fromkeys((NotificationReceived, SendFailed), Source.NOTIFY),
    Heartbeat: Source.LISTENER,
    Tick: Source.TIMER,
}

__all__ = ["EXTRA_FAULTS", "FAULTS", "Choice", "InvariantViolation", "Scenario", "Variant", "World"]

# The world's cores log nothing: violations are expected, and the log records them anyway.
_QUIET = structlog.wrap_logger(structlog.ReturnLogger(),
                               wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))

FAULTS = frozenset({"read-err", "read-raise", "abort", "disconnect", "evict", "handshake-refuse",
                    "handshake-timeout", "peer-refused", "notify-drop", "notify-duplicate", "forge", "heartbeat"})
# Opt-in faults: not in a Scenario's default ``faults`` (FAULTS), so the default scenarios, the mutant
# suite and their derandomized searches stay as they were; name them in ``Scenario.faults`` to use them.
EXTRA_FAULTS = frozenset({"link-drop", "post-refuse", "rank-restart", "late-tick", "second-reader",
                          "heartbeat-drop"})
COMPAT = "race-model-v1"
# With "rank-restart", wall-clock times are said: params their issue time, ranks their start time.
# A worker's restart takes RESTART_NS, more than the cores' HOLD_SKEW_NS: any params issued before
# it are older than the new rank by more than the skew.
WALL0, HOLD_SKEW_NS, RESTART_NS = 1_000_000, 5, 10
# The world counts time in units (a Scenario's ``*_ns`` fields, the step names, ``World.now``); the
# cores see a unit as UNIT_NS, and every step adds STEP_NS more, so a counterexample's logs read
# in milliseconds with no two steps at one time (equal times tie-break by log order when merged).
# A step's extra stays under one unit (STEP_CAP steps, then it stops growing), so every comparison
# of a time with a deadline armed at an earlier step comes out as it did in units: the same runs.
UNIT_NS: Final = 1_000_000
STEP_NS: Final = 1_000
STEP_CAP: Final = UNIT_NS // STEP_NS - 1
_MAX_UNITS: Final = 1 << 32  # a time field's bound: in ns it must stay far inside the log's 64 bits
QUIRKS = frozenset({"poll-errors-escape", "add-peer-off-owner", "notify-on-post", "no-rebase", "no-start-times"})


class Scenario(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of a world: engines, requests, timeouts, and which faults may be chosen."""

    requests: int = 2
    blocks: int = 2  # per request
    notify_only: tuple[int, ...] = ()  # request indices whose prompt is a full local prefix hit
    consumer_tp: int = 1
    producer_tp: int = 1
    producer_pp: int = 1
    mla: bool = False
    kv_heads: int = 0  # the model's KV heads, said to every engine (CoreConfig.kv_heads; 0: not said)
    supports_pp: bool = True
    policy: Policy = "recompute"
    lease_ns: int = 60
    read_timeout_ns: int = 40
    faults: frozenset[str] = FAULTS
    wrong_listener: bool = False  # another engine's listener may answer the handshake
    scheduler_deadlines: bool = False  # the prefill scheduler hands leases as deadlines on its own clock
    scheduler_clock_offset: int = -1_000  # its clock minus the worker's
    lease_margin_ns: int = 5
    max_staged: int = 4096  # the producer's bound on staged early notifications
    add_peer_async: bool = False  # the peer-added outcome is its own step (others may come between)
    handshake_retry_ns: int = 10  # the pause after a failed handshake before the next request retries
    tombstone_ns: int = 0  # the cores' tombstone_ns (0: their default); idle engines go after max(it, retry)
    idle_engine_ns: int = 150  # a connected engine unread this long is evicted (0: never)
    # A read still running this long after its cancel marks its engine stage stalled (CoreConfig's;
    # 0: the read timeout).
    cancel_grace_ns: int = 0
    prefix: tuple[str, ...] = ()  # choices made first, by name, to start exploring from a deep point
    max_steps: int = 40

    def __post_init__(self) -> None:
        _check_names("Scenario.faults", "fault", self.faults, FAULTS | EXTRA_FAULTS)
        # A size of 0 made a world with no rank to check (every hunt passed) or failed mid-search;
        # the times CoreConfig's check (pdfsm.connector._check_config) refuses are refused here too:
        # a lease or read timeout of 0 made every read fail at once, and every hunt pass.
        for name in ("requests", "blocks", "consumer_tp", "producer_tp", "producer_pp", "max_steps",
                     "lease_ns", "read_timeout_ns"):
            _check_int(name, getattr(self, name), 1, _MAX_UNITS)
        for name in ("lease_margin_ns", "handshake_retry_ns", "tombstone_ns", "idle_engine_ns", "cancel_grace_ns",
                     "max_staged"):
            _check_int(name, getattr(self, name), 0, _MAX_UNITS)
        _check_int("scheduler_clock_offset", self.scheduler_clock_offset, -_MAX_UNITS, _MAX_UNITS)
        _check_int("kv_heads", self.kv_heads, 0, MAX_KV_HEADS)
        if self.lease_ns <= self.lease_margin_ns:  # no read is ever trusted: every request fails, silently
            raise ValueError(f"Scenario.lease_ns ({self.lease_ns}) must be more than lease_margin_ns "
                             f"({self.lease_margin_ns}): reads are trusted only until the lease minus the margin")
        if self.policy not in get_args(Policy):  # copied into every failure report, and matched by invariant 3
            raise ValueError(f"Scenario.policy must be one of {get_args(Policy)}, got {self.policy!r}")
        stray = [i for i in self.notify_only if not 0 <= i < self.requests]
        if stray:  # they would quietly be ignored
            raise ValueError(f"Scenario.notify_only {stray}: request indices are 0..{self.requests - 1}")
        try:  # TP sizes that cannot exchange blocks: every request failed at once, and every hunt passed
            tp_ratio(self.consumer_tp, self.producer_tp)
        except TopologyError as exc:
            raise ValueError(f"Scenario.consumer_tp {self.consumer_tp} and producer_tp {self.producer_tp}: "
                             f"{exc}") from None
        if self.kv_heads:  # heads the ranks cannot hold: every request failed at once, and every hunt passed
            why = "mla is one head" if self.mla else (heads_problem(self.consumer_tp, self.kv_heads)
                                                      or heads_problem(self.producer_tp, self.kv_heads))
            if why:
                raise ValueError(f"Scenario.kv_heads {self.kv_heads}: {why}")
        if isinstance(self.prefix, str):  # a plain string is a sequence of letters, each taken for a step
            raise ValueError(f"Scenario.prefix must be a tuple of step names, got {self.prefix!r}")


def _check_names(field: str, kind: str, value: object, known: frozenset[str]) -> None:
    """A set of names, each known: a plain string is an iterable of letters (it failed later with a
    cryptic TypeError), and a misspelt name would quietly be left out of the search."""
    if not isinstance(value, (frozenset, set)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{field} must be a frozenset of {kind} names, got {value!r}")
    unknown = value - known
    if unknown:
        raise ValueError(f"unknown {kind}s {sorted(unknown)}: known are {sorted(known)}")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if type(value) is not int:
        raise ValueError(f"Scenario.{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"Scenario.{name} must be at least {low}, got {value}")
    if value > high:
        raise ValueError(f"Scenario.{name} must be at most {high}, got {value}")


@dataclass(frozen=True)
class Variant:
    """A policy to test: the real tables, or ones with a bug planted (see pdfsm.testing.mutants).

    ``quirks`` change the simulated adapter: ``poll-errors-escape`` (a poll that raises is not
    turned into a failed handle), ``add-peer-off-owner`` (the handshake thread adds the peer),
    ``notify-on-post`` (the notification is sent when the read is posted, not when it
    completes), ``no-rebase`` (scheduler deadlines are passed on as they are),
    ``no-start-times`` (handshake replies do not say when each rank started, as older producers').
    """

    id: str = "pdfsm"
    summary: str = "the real machines"
    tables: Tables | None = None
    timers: Callable[[], Timers] | None = None
    quirks: frozenset[str] = frozenset()
    scenario: Scenario | None = None

    def __post_init__(self) -> None:
        _check_names("Variant.quirks", "quirk", self.quirks, QUIRKS)


class InvariantViolation(AssertionError):
    """An invariant failed; the message says which, at which step, and what led there."""


def _name_of(invariant: object) -> str:
    return getattr(invariant, "__name__", repr(invariant))


def _record_crash(core: Core, ev: Event, exc: BaseException) -> int:
    """Record the event whose guard or action raised, as a local violation of its machine that
    changed nothing, and return its seq. The core's hot loop records nothing of a crash
    (actions never raise): the dump would replay cleanly, the request simply stuck where it was.
    The event that raised, maybe one the root derived, and its machine are what the loop left in
    ``core.crash`` on the way out."""
    machine, before, cause, crashed = "core", "-", None, ev
    if core.crash is not None and core.crash[0] is exc:
        _, crashed, m, cause = core.crash
        if m is not None:  # set only on a table's route: the machine the loop picked for it
            machine, before = core._routes[type(crashed)].name, m.state.name
    core.log.append(crashed, machine, before, before, Outcome.REJECTED,
                    f"crashed: {type(exc).__name__}: {exc}", Fault.LOCAL, cause)
    core.log.flush()
    return core.log.next_seq - 1


@dataclass(frozen=True)
class Choice:
    """One thing that can happen next. ``keys`` is what it touches (for commutation)."""

    name: str
    keys: frozenset[str]
    run: Callable[[], None] = field(compare=False, repr=False)


@dataclass
class _Read:
    rank: int
    cmd: PostRead
    agent: str
    cancelled: bool = False
    lost: bool = False  # its connection dropped: it can only end DISCONNECTED


class World:
    """Consumer and producer cores plus a simulated network, schedulers, timers and faults."""

    def __init__(self, scenario: Scenario | None = None, variant: Variant | None = None,
                 invariants: Iterable[Callable[[World], None]] = ()) -> None:
        from pdfsm.testing.invariants import STEP_INVARIANTS

        self.variant = variant or Variant()
        self.s = scenario or self.variant.scenario or Scenario()
        s = self.s
        self.now = 0
        self.step_no = 0
        self.journal: list[str] = []
        self.chosen: list[str] = []  # the choices made before settling: what a counterexample replays
        self.settling = False
        self.invariants = [*STEP_INVARIANTS, *invariants]
        self.sinks: dict[str, MemorySink] = {}

        u = UNIT_NS

        def core(name: str, t_ns: int = 0, **cfg: Any) -> Core:
            sink = self.sinks[name] = MemorySink()
            timers = None
            if self.variant.timers is not None:
                timers = (Timers(), self.variant.timers())  # the leases' wheel: read deadlines stay real
            config = CoreConfig(compat_hash=COMPAT, mla=s.mla, kv_heads=s.kv_heads, policy=s.policy,
                                lease_ns=s.lease_ns * u, read_timeout_ns=s.read_timeout_ns * u,
                                lease_margin_ns=s.lease_margin_ns * u,
                                handshake_retry_ns=s.handshake_retry_ns * u, max_staged=s.max_staged,
                                tombstone_ns=s.tombstone_ns * u, idle_engine_ns=s.idle_engine_ns * u,
                                cancel_grace_ns=s.cancel_grace_ns * u, hold_skew_ns=HOLD_SKEW_NS * u, **cfg)
            return Core(config, EventLog(window=4096, sink=sink), tables=self.variant.tables, timers=timers,
                        logger=_QUIET, t_ns=t_ns)

        def producer(pp: int, tp: int, t_ns: int = 0) -> Core:
            return core(f"P{pp}.{tp}", t_ns, engine_id="P", tp_rank=tp, tp_size=s.producer_tp, pp_rank=pp,
                        pp_size=s.producer_pp)

        self._producer = producer
        self.consumers = [core(f"D{r}", engine_id="D", tp_rank=r, tp_size=s.consumer_tp, supports_pp=s.supports_pp)
                          for r in range(s.consumer_tp)]
        self.producers = {(pp, tp): producer(pp, tp) for pp in range(s.producer_pp) for tp in range(s.producer_tp)}
        self._names = (*(f"D{r}" for r in range(s.consumer_tp)), *(f"P{pp}.{tp}" for pp, tp in self.producers))
        self.walls = "rank-restart" in s.faults  # params and ranks say their wall-clock times
        self.started = dict.fromkeys(self.producers, 0)  # each producer rank's start, on the world's clock
        self.finished_at: dict[int, int] = {}  # when each request's prefill ended (its params' issue)
        self.minted_by: dict[int, str] = {}  # with walls: the incarnation of the rank that minted its params
        self.restarts = 0
        self.sources: dict[str, deque[tuple[str, Any]]] = {}
        # ground truth
        self.blocks = {i: tuple(range(i * s.blocks, (i + 1) * s.blocks)) if i not in s.notify_only else ()
                       for i in range(s.requests)}
        self.version: dict[tuple[str, int], int] = {}  # (agent, block) -> times it was freed and reused
        self.promised: dict[tuple[str, int], int] = {}  # the versions a request's blocks had at prefill
        self.reads: dict[tuple[int, str, int, int], _Read] = {}  # in flight: (rank, rid, pp, tp)
        self.read_versions: dict[tuple[int, str], list[tuple[str, int, int, int]]] = {}
        self.read_done: set[tuple[int, str, int, int]] = set()  # reads that completed: (rank, rid, pp, tp)
        self.hand_offs: dict[tuple[int, str], list[HandOff]] = {}
        self.freed: dict[tuple[str, str], list[FinishedSending]] = {}  # (producer agent, rid)
        self.registered: dict[tuple[str, str], int] = {}  # (producer agent, rid) -> time registered
        self.lease_from: dict[tuple[str, str], int] = {}  # when the lease started, on the worker's clock
        # (producer core, rid) -> the latest its hold may last, on the cores' clocks: a lease from the
        # end of prefill, or a heartbeat's extension from its arrival
        self.hold_until: dict[tuple[str, str], int] = {}
        self.lease_seen: dict[int, int] = {}  # what the decode scheduler knows of each lease's start
        self.delivered: dict[tuple[str, str], set[tuple[int, int]]] = {}  # (producer core, rid) -> parts
        self.ticked: tuple[str, ...] = ()  # the cores the last step ticked (nothing due may stay armed there)
        self.last_tick_ns = -1  # that Tick's time on the cores' clocks
        self.behind: set[str] = set()  # consumer cores whose timer fell behind: no Tick until it catches up
        self.late_ticks = 0
        self._sent = 0
        self.requested: set[tuple[int, str]] = set()
        # A request's last moment to tell the producer (the lease its scheduler knew of when it
        # asked, less the margin), and when one with blocks was handed back: (rank, rid) -> core ns
        # (a notify-only request stops when its core lets it go: the invariant reads the records).
        self.tell_by: dict[tuple[int, str], int] = {}
        self.stopped_at: dict[tuple[int, str], int] = {}
        self.told: set[tuple[int, str, int, int]] = set()  # (rank, producer rid, pp, tp): a notice sent or tried
        # (producer process, producer rid): a hold it registered; a notification that reached it
        self.held_by: set[tuple[str, str]] = set()
        self.reached: set[tuple[str, str]] = set()
        self.handshake_faults = 0  # handshake answers other than a plain "ok"
        self.notifications: list[Notification] = []
        self.peers: dict[tuple[int, str, int], dict[int, str]] = {}  # (rank, engine, pp) -> tp -> agent
        self.peer_attempts: dict[tuple[int, str, int], int] = {}  # (rank, engine, pp) -> attempt that added it
        self.transport_calls_off_owner = 0
        self.pp_asked_of_non_pp = 0
        self.disconnected = False
        self.disconnects = 0
        self.faults_used: set[str] = set()
        self.aborts: dict[str, int] = {}
        self.refuse_peer = False
        self.heartbeats = 0
        self.dead: set[tuple[int, str, int]] = set()  # (rank, engine, pp): connection dropped, not added again
        self.link_drops = 0
        self.second_reads = 0  # "second-reader": holds another decode engine (E) read with the same params
        self.refuse_post: set[int] = set()  # consumer ranks whose transport refuses its next post
        self.post_refusals = 0
        self.reporting_disconnect = False  # applying the transport's PeerDisconnected for one link
        for i in range(s.requests):
            self._push("prefill-scheduler", ("finish", i))

    # --- names ---------------------------------------------------------------------------------

    @staticmethod
    def crid(i: int) -> str:
        return f"r{i}"

    @staticmethod
    def prid(i: int) -> str:
        return f"p{i}"

    @staticmethod
    def agent(engine: str, pp: int, tp: int) -> str:
        return f"{engine}-{pp}-{tp}"

    # --- choosing ------------------------------------------------------------------------------

    def _push(self, source: str, item: tuple[str, Any]) -> None:
        self.sources.setdefault(source, deque()).append(item)

    def enabled(self) -> list[Choice]:
        """Everything that may happen next, in a fixed order."""
        out: list[Choice] = []
        faults = self.s.faults
        for source in sorted(self.sources):
            queue = self.sources[source]
            if queue:
                out.extend(self._choices(source, queue[0]))
        out.append(Choice("scheduler: decode collects finished requests", frozenset({"collect"}), self._collect))
        out.append(Choice("timer: time passes to the next deadline", frozenset({"time"}), self._tick_deadline))
        out.append(Choice("timer: 5 ns pass", frozenset({"time"}), lambda: self._tick(5)))
        for i in range(self.s.requests):
            rid = self.crid(i)
            if "abort" in faults and any((r, rid) in self.requested for r in range(self.s.consumer_tp)) \
                    and self.aborts.get(rid, 0) < 2:  # twice: a repeated abort is real too
                out.append(Choice(f"scheduler: decode aborts {rid}", frozenset({f"c:{rid}"}),
                                  partial(self._abort, rid)))
            if "heartbeat" in faults and self.heartbeats < 2 and self._promised(i):
                out.append(Choice(f"scheduler: decode heartbeats {self.prid(i)}",  # and promises the loads
                                  frozenset({f"p:{self.prid(i)}", f"c:{rid}"}), partial(self._heartbeat, i)))
            if "heartbeat-drop" in faults and self.heartbeats < 2 and self._promised(i):
                out.append(Choice(f"fault: decode heartbeats {self.prid(i)}, and the heartbeat is lost",
                                  frozenset({f"c:{rid}"}), partial(self._heartbeat, i, lost=True)))
        if "disconnect" in faults and self.disconnects < 2 and (self.peers or self.disconnected):  # may repeat
            out.append(Choice("fault: the producer disconnects", frozenset({"engine"}), self._disconnect))
        if "evict" in faults and "evict again" not in self.faults_used:  # at most twice per run
            out.append(Choice("timer: idle eviction of the producer engine", frozenset({"engine"}), self._evict))
        if "forge" in faults and "forge again" not in self.faults_used:
            out.append(Choice("fault: a forged notification reaches the producer", frozenset({"p:forged"}),
                              self._forge))
        if "second-reader" in faults and self.second_reads < 2:
            for target, prid in sorted(k for k, parts in self.delivered.items() if parts):
                out.append(Choice(f"fault: decode engine E reads {prid} from {target} with the same params",
                                  frozenset({f"p:{prid}"}), partial(self._second_reader, target, prid)))
        if "link-drop" in faults and self.link_drops < 2:  # one PP rank's connection, the producer reachable
            for rank, engine, pp in sorted(self.peers):
                if (rank, engine, pp) not in self.dead:
                    out.append(Choice(f"fault: D{rank} loses its connection to ({engine}, pp {pp})",
                                      frozenset({"engine"}), partial(self._link_drop, rank, engine, pp)))
        if "rank-restart" in faults and not self.restarts and self.finished_at:
            for pp, tp in sorted(self.producers):
                out.append(Choice(f"fault: producer rank (pp {pp}, tp {tp}) restarts", frozenset({"engine", "time"}),
                                  partial(self._restart, pp, tp)))
        if "post-refuse" in faults and self.post_refusals < 2:
            for rank in range(self.s.consumer_tp):
                if rank not in self.refuse_post:
                    out.append(Choice(f"fault: D{rank}'s transport will refuse its next post", frozenset({"engine"}),
                                      partial(self._arm_post_refusal, rank)))
        if "late-tick" in faults and self.late_ticks < 2:  # last: the other choices keep their places
            for rank in range(self.s.consumer_tp):
                if f"D{rank}" not in self.behind:
                    out.append(Choice(f"timer: D{rank}'s timer falls behind", frozenset({"time"}),
                                      partial(self._fall_behind, rank)))
        return out

    def _promised(self, i: int) -> bool:
        """Prefill finished and the decode side has not handed the request off yet."""
        return (self.prid(i), 0) in {(k[1], 0) for k in self.lease_from} and not any(
            k[1] == self.crid(i) for k in self.hand_offs)

    def _choices(self, source: str, item: tuple[str, Any]) -> list[Choice]:
        kind, payload = item
        faults = self.s.faults
        if kind == "finish":
            i = payload
            return [Choice(f"prefill: {self.prid(i)} finishes prefill", frozenset({f"p:{self.prid(i)}"}),
                           lambda: self._finish(i))]
        if kind == "register":
            target, agent, i, ev = payload
            return [Choice(f"prefill worker {target}: registers {self.prid(i)}", frozenset({f"p:{self.prid(i)}"}),
                           lambda: self._register(source, target, agent, ev))]
        if kind == "read-request":
            rank, i = payload
            return [Choice(f"scheduler: D{rank} asks to read {self.crid(i)}", frozenset({f"c:{self.crid(i)}"}),
                           lambda: self._read_request(source, rank, i))]
        if kind == "handshake":
            rank, cmd = payload
            name = f"handshake: D{rank} gets the answer for ({cmd.engine_id}, pp {cmd.pp_rank}) #{cmd.attempt}"
            keys = frozenset({"engine"})
            out = [Choice(name, keys, lambda: self._answer(source, rank, cmd, "ok"))]
            if self.s.wrong_listener:
                out.append(Choice(f"{name}: from the wrong listener", keys,
                                  lambda: self._answer(source, rank, cmd, "wrong")))
            if "handshake-refuse" in faults:
                out.append(Choice(f"{name}: refused", keys, lambda: self._answer(source, rank, cmd, "refuse")))
            if "handshake-timeout" in faults:
                out.append(Choice(f"{name}: timed out", keys, lambda: self._answer(source, rank, cmd, "timeout")))
            if "peer-refused" in faults:
                out.append(Choice(f"{name}: the transport refuses the peer", keys,
                                  lambda: self._answer(source, rank, cmd, "peer-refused")))
            return out
        if kind == "late-reply":  # the abandoned attempt resolves anyway: a stale answer either way
            rank, cmd = payload
            name = f"handshake: D{rank} gets a late answer for ({cmd.engine_id}, pp {cmd.pp_rank}) #{cmd.attempt}"
            return [Choice(name, frozenset({"engine"}), lambda: self._answer(source, rank, cmd, "late")),
                    Choice(f"{name}: refused", frozenset({"engine"}),
                           lambda: self._answer(source, rank, cmd, "refuse"))]
        if kind == "late-tick":  # not named "timer: ...": settling delivers it like any pending event
            rank = payload
            return [Choice(f"late timer D{rank}: the Tick it owes reaches D{rank}", frozenset({"time"}),
                           lambda: self._catch_up(source, rank))]
        if kind == "link-down":
            rank, engine, pp, attempt = payload
            return [Choice(f"transport: D{rank} reports ({engine}, pp {pp}) disconnected", frozenset({"engine"}),
                           lambda: self._link_down(source, rank, engine, pp, attempt))]
        if kind == "event":
            target, ev = payload
            return [Choice(f"{source}: {type(ev).__name__} reaches {target}", frozenset({"engine"}),
                           lambda: self._deliver_source(source, target, ev))]
        if kind == "read":
            key = payload
            read = self.reads[key]
            rank, rid, pp, tp = key
            base = f"transfer: D{rank} read of {rid} from ({pp}, {tp})"
            keys = frozenset({f"c:{rid}", f"p:{read.cmd.notification.request_id}", "engine"})
            outcomes = ["cancelled", "done"] if read.cancelled else ["done"]
            if not read.cancelled:
                outcomes += [f for f in ("err", "raise") if f"read-{f}" in faults]
            if (read.agent.startswith("P") and self.disconnected) or read.lost:
                outcomes = ["disconnected"]
            return [Choice(f"{base} ends {o}", keys, partial(self._end_read, source, key, o)) for o in outcomes]
        if kind == "notify":
            target, note, sender = payload
            base = f"network: notification {note.request_id} part {note.part}/{note.of} from {sender} reaches {target}"
            keys = frozenset({f"p:{note.request_id}"})
            out = [Choice(base, keys, lambda: self._notify(source, target, note, sender, "ok"))]
            if "notify-drop" in faults:
                out.append(Choice(f"{base}: dropped", keys, lambda: self._notify(source, target, note, sender, "drop")))
            if "notify-duplicate" in faults:
                out.append(Choice(f"{base}: twice", keys, lambda: self._notify(source, target, note, sender, "dup")))
            return out
        raise AssertionError(f"unknown source item {kind}")

    def choose(self, choice: Choice) -> None:
        """Make one choice, then check every invariant."""
        self.ticked = ()
        self.step_no += 1
        self.journal.append(f"{self.step_no:3d}. {choice.name}")
        if not self.settling:
            self.chosen.append(choice.name)
        choice.run()
        self.check()

    def check(self) -> None:
        """Every step invariant. One may call :meth:`fail` or simply ``assert``: an AssertionError
        becomes an InvariantViolation with the steps, so it shrinks and its logs are written like
        the built-in invariants' (any other exception is a bug in the invariant: it propagates,
        with a note of the invariant and the steps)."""
        invariant = None
        try:
            for invariant in self.invariants:
                invariant(self)
        except InvariantViolation:
            raise
        except AssertionError as exc:
            self.fail(f"invariant {_name_of(invariant)} failed: {exc or 'assert'}")
        except Exception as exc:
            exc.add_note(f"raised by invariant {_name_of(invariant)} after these steps:\n" + "\n".join(self.journal))
            raise

    def fail(self, message: str) -> None:
        raise InvariantViolation(f"{message}\nafter {len(self.chosen)} chosen steps ({self.step_no} in all):\n"
                                 + "\n".join(self.journal))

    # --- running the cores ---------------------------------------------------------------------

    def core(self, name: str) -> Core:
        if name.startswith("D"):
            return self.consumers[int(name[1:])]
        return self.producers[_stage_rank(name)]

    def apply(self, name: str, ev: Event) -> None:
        core = self.core(name)
        try:
            core.apply(ev)
        except InvariantViolation:
            raise
        except Exception as exc:  # noqa: BLE001 - any exception out of a core is a crash
            seq = _record_crash(core, ev, exc)
            self.fail(f"{name} crashed applying {type(ev).__name__}: {type(exc).__name__}: {exc} "
                      f"(recorded in {name}'s log at seq {seq}: replaying the logs stops there)")
        self._execute(name, core.take_commands())

    def _deliver_source(self, source: str, target: str, ev: Event) -> None:
        self.sources[source].popleft()
        self.apply(target, ev)

    def _ev(self, cls: type, **fields: Any) -> Any:
        return cls(source=_SOURCES[cls], t_ns=self.t_ns, **fields)

    @property
    def t_ns(self) -> int:
        """Now on the cores' clocks: the world's time in ns, plus STEP_NS per step so far."""
        return self.now * UNIT_NS + min(self.step_no, STEP_CAP) * STEP_NS

    # --- schedulers ------------------------------------------------------------------------------

    def _finish(self, i: int) -> None:
        """Prefill is done: blocks hold the KV (promised versions); the decode side may read."""
        self.sources["prefill-scheduler"].popleft()
        s = self.s
        for (pp, tp), _ in self.producers.items():
            agent = self.agent("P", pp, tp)
            for b in self._p_blocks(i):
                self.promised[(f"{agent}:{self.prid(i)}", b)] = self.version.get((agent, b), 0)
            deadline = None
            if s.scheduler_deadlines:
                there = (self.now + s.scheduler_clock_offset) * UNIT_NS
                deadline = Deadline("scheduler", there + s.lease_ns * UNIT_NS)
                if "no-rebase" not in self.variant.quirks:
                    deadline = deadline.rebased(there_now_ns=there, here_clock="monotonic",
                                                here_now_ns=self.now * UNIT_NS)
            ev = self._ev(BlocksHeld, request_id=self.prid(i), block_ids=self._p_blocks(i), deadline=deadline)
            self.lease_from[(agent, self.prid(i))] = self.now  # the lease runs from the end of prefill
            self._may_hold(f"P{pp}.{tp}", self.prid(i), ev.t_ns + s.lease_ns * UNIT_NS)
            self._push(f"prefill-worker {agent}", ("register", (f"P{pp}.{tp}", agent, i, ev)))
        self.lease_seen[i] = self.finished_at[i] = self.now
        if self.walls:  # the router gets the params of stage 0's rank 0
            self.minted_by[i] = self.incarnation(0, 0)
        for rank in range(s.consumer_tp):
            self._push(f"decode-scheduler D{rank}", ("read-request", (rank, i)))

    def _read_request(self, source: str, rank: int, i: int) -> None:
        """The decode scheduler allocates blocks and asks its worker to read, knowing when it last
        heard of the producer's lease (prefill's end, or its own last heartbeat)."""
        s = self.s
        ev = self._ev(ReadRequested, request_id=self.crid(i), remote_request_id=self.prid(i), engine_id="P",
                      host="prefill", port=1, remote_tp=s.producer_tp, remote_pp=s.producer_pp,
                      local_blocks=self.blocks[i], remote_blocks=self._p_blocks(i) if self.blocks[i] else (),
                      lease_ns=s.lease_ns * UNIT_NS, lease_start_ns=self.lease_seen[i] * UNIT_NS,
                      issued_wall_ns=self._issued(i), incarnation=self.minted_by.get(i, ""),
                      incarnation_pp=0 if i in self.minted_by else None)
        self.requested.add((rank, ev.request_id))
        self.tell_by[(rank, ev.request_id)] = (self.lease_seen[i] + s.lease_ns - s.lease_margin_ns) * UNIT_NS
        self._deliver_source(source, f"D{rank}", ev)

    def incarnation(self, pp: int, tp: int) -> str:
        """A producer rank's process, as its transport names it: another after each restart."""
        return f"P{pp}.{tp}@{self.started[(pp, tp)]}"

    def _process(self, name: str) -> str:
        """The process a producer rank's core (``P{pp}.{tp}``) runs as now."""
        return self.incarnation(*_stage_rank(name))

    def _issued(self, i: int) -> int:
        """The params' issued_wall_ns (0: wall clocks not modelled)."""
        return (WALL0 + self.finished_at[i]) * UNIT_NS if self.walls else 0

    def _may_hold(self, core: str, rid: str, until: int) -> None:
        self.hold_until[(core, rid)] = max(self.hold_until.get((core, rid), 0), until)

    def _register(self, source: str, target: str, agent: str, ev: BlocksHeld) -> None:
        self.registered[(agent, ev.request_id)] = self.now
        self.held_by.add((self._process(target), ev.request_id))
        self._deliver_source(source, target, ev)

    def _p_blocks(self, i: int) -> tuple[int, ...]:
        return tuple(range(i * self.s.blocks, (i + 1) * self.s.blocks))

    def _collect(self) -> None:
        for rank in range(self.s.consumer_tp):
            self.apply(f"D{rank}", self._ev(Collect, step=self.step_no))

    def _tick(self, dt: int) -> None:
        """Time passes by ``dt`` units; every core whose timer keeps up is ticked."""
        self.now += dt
        self.last_tick_ns = self.t_ns
        self.ticked = tuple(name for name in self._names if name not in self.behind)
        for name in self.ticked:
            self.apply(name, self._ev(Tick))

    def _tick_deadline(self) -> None:
        """To the earliest deadline of a core whose timer keeps up (one behind is not woken by its own)."""
        behind = self.behind
        due = [d for name, c in zip(self._names, self._cores(), strict=True)
               if name not in behind and (d := c.next_deadline()) is not None]
        # A deadline armed at a step is a whole unit plus that step's extra (under a unit): its unit.
        self._tick(max(1, min(due) // UNIT_NS - self.now) if due else 5)

    def _fall_behind(self, rank: int) -> None:
        """A decode worker's timer falls behind (a late timer thread): time passes without its Tick,
        so a read may end, or a handshake be answered, after a deadline the core has not expired yet."""
        self.late_ticks += 1
        self.behind.add(f"D{rank}")
        self._push(f"late timer D{rank}", ("late-tick", rank))

    def _catch_up(self, source: str, rank: int) -> None:
        self.sources[source].popleft()
        name = f"D{rank}"
        self.behind.discard(name)
        self.last_tick_ns, self.ticked = self.t_ns, (name,)
        self.apply(name, self._ev(Tick))

    def _cores(self) -> list[Core]:
        return [*self.consumers, *self.producers.values()]

    def _abort(self, rid: str) -> None:
        self.aborts[rid] = self.aborts.get(rid, 0) + 1
        for rank in range(self.s.consumer_tp):
            self.apply(f"D{rank}", self._ev(AbortRequested, request_id=rid))

    def _heartbeat(self, i: int, lost: bool = False) -> None:
        """The decode scheduler heartbeats a queued request. It counts on the extension only if it
        sent it while the lease it knew of had more than the margin to run: a heartbeat that
        arrives after the lease ended extends nothing. ``lost``: no producer rank gets it, the
        loads are promised all the same (the Connector promises as it sends), and the scheduler
        counts on nothing, as a real one must not."""
        self.heartbeats += 1
        # Counted only where every producer rank holds it already: one staged before its hold
        # registers may be dropped (max_staged), and then nothing extends the lease (found by a
        # helper's long hunts: the world read reused blocks it had wrongly trusted).
        held = all((self.agent("P", pp, tp), self.prid(i)) in self.registered for pp, tp in self.producers)
        if held and not lost and self.now + self.s.lease_margin_ns < self.lease_seen[i] + self.s.lease_ns:
            self.lease_seen[i] = self.now
        hb = self._ev(Heartbeat, request_id=self.prid(i), extend_ns=self.s.lease_ns * UNIT_NS)
        for name in () if lost else self._names[self.s.consumer_tp:]:
            self._may_hold(name, hb.request_id, hb.t_ns + hb.extend_ns)
            self.apply(name, hb)
        for rank in range(self.s.consumer_tp):  # every producer rank was told: a loaded request is promised
            if (rank, self.crid(i)) in self.requested:  # as the Connector hands it to a live load
                self.apply(f"D{rank}", self._ev(Promised, request_id=self.crid(i),
                                                promised_ns=(self.now + self.s.lease_ns) * UNIT_NS, engine_id="P",
                                                remote_request_id=self.prid(i), issued_wall_ns=self._issued(i)))

    def _evict(self) -> None:
        self.faults_used.add("evict again" if "evict" in self.faults_used else "evict")
        for rank in range(self.s.consumer_tp):
            for pp in range(self.s.producer_pp):
                self.apply(f"D{rank}", self._ev(EvictRequested, engine_id="P", pp_rank=pp))

    def _disconnect(self) -> None:
        self.disconnected = True
        self.disconnects += 1
        for rank in range(self.s.consumer_tp):
            for pp in range(self.s.producer_pp):
                self.apply(f"D{rank}", self._ev(PeerDisconnected, engine_id="P", pp_rank=pp, detail="gone",
                                                attempt=self.peer_attempts.get((rank, "P", pp), 0)))

    def _link_drop(self, rank: int, engine: str, pp: int) -> None:
        """One consumer rank's connection to one PP rank of the producer drops; the producer itself
        stays up (a new handshake reaches it). Reads on that connection end DISCONNECTED, sends on it
        fail, and the transport reports the engine gone once, later (it submits to the inbox)."""
        self.link_drops += 1
        self._drop_link(rank, engine, pp)

    def _drop_link(self, rank: int, engine: str, pp: int) -> None:
        self.dead.add((rank, engine, pp))
        for (r, _, p, _), read in self.reads.items():
            if r == rank and p == pp and read.cmd.engine_id == engine:
                read.lost = True
        # The report names the connection that dropped: by the time it is applied a new handshake
        # may be connecting, and it must not fail that one.
        attempt = self.peer_attempts.get((rank, engine, pp), 0)
        self._push(f"transport D{rank}", ("link-down", (rank, engine, pp, attempt)))

    def _link_down(self, source: str, rank: int, engine: str, pp: int, attempt: int) -> None:
        self.sources[source].popleft()
        self.reporting_disconnect = True
        try:
            self.apply(f"D{rank}", self._ev(PeerDisconnected, engine_id=engine, pp_rank=pp, detail="connection lost",
                                            attempt=attempt))
        finally:
            self.reporting_disconnect = False

    def _restart(self, pp: int, tp: int) -> None:
        """One producer rank's process dies and comes back under the same agent name and listener
        (RESTART_NS later): its holds are gone, its memory is another process's (every block's
        version moves on), what was on its way to it is lost, and every consumer connection to
        its stage drops (the transport reports it, later)."""
        self.restarts += 1
        self._tick(RESTART_NS)
        name, agent = f"P{pp}.{tp}", self.agent("P", pp, tp)
        self.producers[(pp, tp)].log.flush()
        self.sinks[f"{name}-before-restart"] = self.sinks.pop(name)
        self.producers[(pp, tp)] = self._producer(pp, tp, self.t_ns)  # its log starts when it does
        self.started[(pp, tp)] = self.now
        self.sources.pop(f"prefill-worker {agent}", None)  # holds it never registered
        for source in [k for k in self.sources if k.startswith("notify ") and k.endswith(f" {name}")]:
            self.sources.pop(source)
        for key in [k for k in self.registered if k[0] == agent]:
            del self.registered[key]
        for key in [k for k in self.delivered if k[0] == name]:
            del self.delivered[key]
        for b in range(self.s.requests * self.s.blocks):
            self.version[(agent, b)] = self.version.get((agent, b), 0) + 1
        for read in self.reads.values():
            if read.agent == agent:  # whatever became of its connection, the process it read from is gone
                read.lost = True
        for rank, engine, p in sorted(self.peers):
            if engine == "P" and p == pp and (rank, engine, p) not in self.dead:
                self._drop_link(rank, engine, p)

    def _arm_post_refusal(self, rank: int) -> None:
        self.post_refusals += 1
        self.refuse_post.add(rank)

    def _forge(self) -> None:
        again = "forge" in self.faults_used
        self.faults_used.add("forge again" if again else "forge")
        name = self._names[self.s.consumer_tp]
        self.apply(name, self._ev(NotificationReceived, request_id="forged2" if again else "forged", part=0, of=1,
                                  sender="mallory"))

    def _second_reader(self, target: str, prid: str) -> None:
        """A router handed the params of a request D is reading, or has read, to another decode
        engine too (a retry after it thought D dead): E reads the hold and notifies every part."""
        self.second_reads += 1
        of = next(iter(self.delivered[(target, prid)]))[1]
        for part in range(of):
            self.apply(target, self._ev(NotificationReceived, request_id=prid, part=part, of=of,
                                        sender=f"E{part}", consumer="E"))

    # --- the simulated network and transport -------------------------------------------------------

    def _answer(self, source: str, rank: int, cmd: StartHandshake, how: str) -> None:
        self.sources[source].popleft()
        self.handshake_faults += how != "ok"
        common = {"engine_id": cmd.engine_id, "pp_rank": cmd.pp_rank, "attempt": cmd.attempt}
        if how == "refuse" or (how in ("ok", "peer-refused") and self.disconnected):
            ev: Event = self._ev(HandshakeFailed, **common, error="connection refused")
        elif how == "timeout":  # the reply still comes, late: a stale answer to an abandoned attempt
            ev = self._ev(HandshakeFailed, **common, error="timed out")
            self._push(f"late handshake D{rank} {cmd.pp_rank}", ("late-reply", (rank, cmd)))
        else:
            engine = "Q" if how == "wrong" else "P"
            said = self.walls and "no-start-times" not in self.variant.quirks
            ranks = tuple(RankInfo(pp_rank=cmd.pp_rank, tp_rank=t, agent=self.agent(engine, cmd.pp_rank, t),
                                   started_wall_ns=(WALL0 + self.started[(cmd.pp_rank, t)]) * UNIT_NS if said else 0,
                                   incarnation=self.incarnation(cmd.pp_rank, t) if self.walls else "")
                          for t in range(self.s.producer_tp))
            reply = HandshakeReply(engine_id=engine, compat_hash=COMPAT, tp_size=self.s.producer_tp,
                                   pp_size=self.s.producer_pp, block_size=16, mla=self.s.mla, ranks=ranks,
                                   kv_heads=self.s.kv_heads)
            ev = self._ev(HandshakeDone, **common, reply=reply)
            self.refuse_peer = how == "peer-refused"
            if "add-peer-off-owner" in self.variant.quirks:
                self.transport_calls_off_owner += 1  # the handshake thread touches the transport
        self.apply(f"D{rank}", ev)

    def _execute(self, name: str, cmds: list[Command]) -> None:
        for cmd in cmds:
            if isinstance(cmd, StartHandshake):
                self._push(f"handshake D{name[1:]} {cmd.pp_rank}", ("handshake", (int(name[1:]), cmd)))
            elif isinstance(cmd, AddPeer):
                rank = int(name[1:])
                if cmd.pp_rank > 0 and not self.s.supports_pp:
                    self.pp_asked_of_non_pp += 1
                # The adapter adds the peer on the owner thread as it carries the command out.
                common = {"engine_id": cmd.engine_id, "pp_rank": cmd.pp_rank, "attempt": cmd.attempt}
                if self.refuse_peer:
                    self.refuse_peer = False
                    self.apply(name, self._ev(HandshakeFailed, **common, error="transport refused the peer"))
                    continue
                self.peers[(rank, cmd.engine_id, cmd.pp_rank)] = {r.tp_rank: r.agent for r in cmd.reply.ranks}
                self.peer_attempts[(rank, cmd.engine_id, cmd.pp_rank)] = cmd.attempt
                self.dead.discard((rank, cmd.engine_id, cmd.pp_rank))  # a new connection
                if self.s.add_peer_async:
                    self._push(f"adapter {name}", ("event", (name, self._ev(PeerAdded, **common))))
                else:
                    self.apply(name, self._ev(PeerAdded, **common))
            elif isinstance(cmd, DropPeer):
                self._drop_peer(name, cmd)
            elif isinstance(cmd, PostRead):
                self._post(name, cmd)
            elif isinstance(cmd, CancelRead):
                read = self.reads.get((int(name[1:]), cmd.request_id, cmd.pp_rank, cmd.tp_rank))
                if read is not None:
                    read.cancelled = True
            elif isinstance(cmd, SendNotification):
                self.notifications.append(cmd.notification)
                self._send(name, cmd.engine_id, cmd.pp_rank, cmd.tp_rank, cmd.notification)
            elif isinstance(cmd, HandOff):
                self.hand_offs.setdefault((int(name[1:]), cmd.request_id), []).append(cmd)
                self.stopped_at.setdefault((int(name[1:]), cmd.request_id), self.t_ns)
            elif isinstance(cmd, FinishedSending):
                self._freed(name, cmd)

    def _drop_peer(self, name: str, cmd: DropPeer) -> None:
        rank = int(name[1:])
        on_it = [(k, r) for k, r in self.reads.items() if k[0] == rank and k[2] == cmd.pp_rank
                 and r.cmd.engine_id == cmd.engine_id and not r.lost]
        # Reads cancelled and still running (a stalled stage taken as lost when a replacement's
        # params contradict it) are the core's to wait for; they end DISCONNECTED once dropped. A read not
        # cancelled would write blocks nobody watches: after a disconnect the transport defers that
        # drop (and reads on a lost connection end anyway).
        in_flight = [k for k, r in on_it if not r.cancelled]
        if in_flight and not self.disconnected and not self.reporting_disconnect:
            self.fail(f"{name} dropped peer ({cmd.engine_id}, {cmd.pp_rank}) with reads in flight: {in_flight}")
        for _, read in on_it:
            read.lost = True
        self.peers.pop((rank, cmd.engine_id, cmd.pp_rank), None)

    def _post(self, name: str, cmd: PostRead) -> None:
        rank, src = int(name[1:]), cmd.source
        if src.pp_rank > 0 and not self.s.supports_pp:
            self.pp_asked_of_non_pp += 1
        agent = self.peers.get((rank, cmd.engine_id, src.pp_rank), {}).get(src.tp_rank)
        if rank in self.refuse_post:  # the transport raises although it knows the peer: the adapter says SETUP
            self.refuse_post.discard(rank)
            self._push(f"adapter {name}", ("event", (name, self._ev(
                HandleFailed, request_id=cmd.request_id, pp_rank=src.pp_rank, tp_rank=src.tp_rank,
                why=HandleFailure.SETUP, detail="post_read raised"))))
            return
        if agent is None:  # what a transport does with a read for an unknown peer: it refuses
            self.apply(name, self._ev(HandleFailed, request_id=cmd.request_id, pp_rank=src.pp_rank,
                                      tp_rank=src.tp_rank, why=HandleFailure.SETUP, detail="no such peer"))
            return
        self.notifications.append(cmd.notification)
        key = (rank, cmd.request_id, src.pp_rank, src.tp_rank)
        if key in self.reads:
            self.fail(f"{name} posted the same read twice: {key}")
        self.reads[key] = _Read(rank, cmd, agent, lost=(rank, cmd.engine_id, src.pp_rank) in self.dead)
        self._push(f"read {key}", ("read", key))
        if "notify-on-post" in self.variant.quirks:
            self._send(name, cmd.engine_id, src.pp_rank, src.tp_rank, cmd.notification)

    def _end_read(self, source: str, key: tuple[int, str, int, int], outcome: str) -> None:
        self.sources[source].popleft()
        read = self.reads.pop(key)
        rank, rid, pp, tp = key
        name = f"D{rank}"
        common = {"request_id": rid, "pp_rank": pp, "tp_rank": tp}
        if outcome == "done":
            self.read_done.add(key)
            versions = self.read_versions.setdefault((rank, rid), [])
            prid = read.cmd.notification.request_id
            versions.extend((read.agent, b, self.version.get((read.agent, b), 0),
                             self.promised.get((f"{read.agent}:{prid}", b), -1)) for b in read.cmd.remote_blocks)
            if "notify-on-post" not in self.variant.quirks:
                self._send(name, read.cmd.engine_id, pp, tp, read.cmd.notification)
            self.apply(name, self._ev(HandleDone, **common))
        elif outcome == "raise" and "poll-errors-escape" in self.variant.quirks:
            self.fail(f"{name} crashed: polling the read of {rid} raised and the exception escaped")
        else:
            why = {"err": HandleFailure.ERR, "raise": HandleFailure.RAISED, "cancelled": HandleFailure.CANCELLED,
                   "disconnected": HandleFailure.DISCONNECTED}[outcome]
            self.apply(name, self._ev(HandleFailed, **common, why=why, detail=outcome))

    def _send(self, name: str, engine: str, pp: int, tp: int, note: Notification) -> None:
        self.told.add((int(name[1:]), note.request_id, pp, tp))
        # No peer (a stage never connected, or dropped): unreachable, as every transport says.
        agent = self.peers.get((int(name[1:]), engine, pp), {}).get(tp, "")
        if self.disconnected or not agent.startswith("P") or (int(name[1:]), engine, pp) in self.dead:
            self.apply(name, self._ev(SendFailed, engine_id=engine, pp_rank=pp, tp_rank=tp,
                                      request_id=note.request_id, error="peer unreachable"))
            return
        target = f"P{pp}.{tp}"
        self._sent += 1
        self._push(f"notify {self._sent:04d} {target}", ("notify", (target, note, name)))

    def _notify(self, source: str, target: str, note: Notification, sender: str, how: str) -> None:
        self.sources[source].popleft()
        if how == "drop":
            return
        ev = self._ev(NotificationReceived, request_id=note.request_id, part=note.part, of=note.of, sender=sender,
                      issued_wall_ns=note.issued_wall_ns, consumer=note.consumer)
        self.reached.add((self._process(target), note.request_id))
        parts = self.delivered.setdefault((target, note.request_id), set())
        parts.add((note.part, note.of))
        self.apply(target, ev)
        if how == "dup":
            self.apply(target, ev)

    def _freed(self, name: str, cmd: FinishedSending) -> None:
        agent = self.agent("P", *_stage_rank(name))
        parts = self.delivered.get((name, cmd.request_id), set())
        in_time = self.registered.get((agent, cmd.request_id), 0) < self.lease_from.get((agent, cmd.request_id), 0) \
            + self.s.lease_ns  # registered after its lease ended: expiring at once is right
        dropped = any(isinstance(rec.event, StagedDropped) and rec.event.request_id == cmd.request_id
                      for rec in self.core(name).log.window)  # staging was full: an explicit, recorded loss
        if cmd.expired and in_time and not dropped and parts and len(parts) == next(iter(parts))[1]:
            self.fail(f"{name} kept {cmd.request_id} until its lease expired although every consumer part "
                      f"had notified it: {sorted(parts)}")
        self.freed.setdefault((agent, cmd.request_id), []).append(cmd)
        for b in cmd.block_ids:  # the blocks are reused at once: a late read copies other data
            self.version[(agent, b)] = self.version.get((agent, b), 0) + 1

    # --- the end of a run -------------------------------------------------------------------------

    def drain(self, limit: int | None = None) -> None:
        """Let everything pending happen without faults, then time pass and the scheduler collect.
        The step limit grows with the world (a fixed 400 failed valid worlds of 14 requests over
        TP 4 and PP 2 as "not settled": found by a helper)."""
        s = self.s
        if limit is None:
            limit = 400 + 40 * s.requests * (s.consumer_tp + s.producer_tp * s.producer_pp)
        self.settling = True
        self.journal.append("     then the world settles (no faults; these steps follow from the ones above):")
        for _ in range(limit):
            heads = [c for c in self.enabled() if not c.name.startswith(("fault", "scheduler: decode aborts",
                                                                         "scheduler: decode heartbeats",
                                                                         "timer: idle"))]
            pending = [c for c in heads if c.keys != frozenset({"collect"}) and not c.name.startswith("timer")]
            if pending:
                clean = [c for c in pending if not c.name.endswith(("dropped", "twice", "refused", "timed out",
                                                                    "listener", "err", "raise"))]
                self.choose((clean or pending)[0])
                continue
            self.choose(Choice("scheduler: decode collects finished requests", frozenset(), self._collect))
            due = [d for c in self._cores() if (d := c.next_deadline()) is not None]
            if not due:
                return
            self.choose(Choice("timer: time passes to the next deadline", frozenset(), self._tick_deadline))
        self.fail(f"the world did not settle within {limit} steps")

    def dump(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write every core's log in the production format (one log directory per core), so
        ``pdfsm replay`` replays the counterexample; returns the log directories."""
        from pdfsm.filelog import segment_name, write_segment

        out = []
        for name, records in self.records().items():
            log = Path(directory) / name
            log.mkdir(parents=True, exist_ok=True)
            meta = {"engine": name, "variant": self.variant.id, "steps": self.journal}
            write_segment(log / segment_name(0), records, salt=bytes(8), meta=meta,
                          wall_ns=0, mono_ns=0)
            out.append(log)
        return out

    def records(self) -> dict[str, list[Record]]:
        for c in self._cores():
            c.log.flush()
        return {name: sink.records for name, sink in self.sinks.items()}

    def coverage(self) -> set[tuple[str, str, str]]:
        """The (machine, state, event type) cells the run exercised."""
        return {(r.machine, r.before, type(r.event).__name__)
                for recs in self.records().values() for r in recs if r.machine != "core"}

    def rejections(self, fault: Fault) -> int:
        """Illegal events (rejected, not handled) blamed on ``fault``, over every core."""
        return sum(c.rejections[fault] for c in self._cores())


def _stage_rank(name: str) -> tuple[int, int]:
    """(pp, tp) of a producer rank's core name, ``P{pp}.{tp}``."""
    pp, tp = name[1:].split(".")
    return int(pp), int(tp)
