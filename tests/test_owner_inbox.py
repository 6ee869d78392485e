"""The one-caller-at-a-time owner rule (``connector._one_caller``) and the COUNT/BLOCK inbox policies, with
real threads. Every wait is bounded (a hang is a failed assertion, never a hung test)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest
from test_scheduler_threads_inbox import _Rig
from test_thread_boundaries import Bounded, no_escaped_thread_exceptions  # noqa: F401 (autouse fixture)
from transport_helpers import random_kv, zero_kv

from pdfsm.connector import Connector, StepOutput
from pdfsm.errors import OwnerError
from pdfsm.events import CoreConfig, Dropped, HandshakeReply, ReadRequested, Tick
from pdfsm.log import EventLog, Overflow
from transports.sim import SimHandshaker, SimNetwork
from transports.torch import TorchNetwork, TorchTransport

pytestmark = pytest.mark.filterwarnings(
    "error::pytest.PytestUnhandledThreadExceptionWarning",
    "error::pytest.PytestUnraisableExceptionWarning",
)

BOUND = 3.0




class _GatedRig(_Rig):
    """The rig, with a clock that can hold one thread at one call: the first clock read on the
    armed thread signals ``entered`` and waits (bounded) for ``release``. ``Connector.load`` reads
    the clock after ``_open`` and before it submits, so this holds the call right there, as a
    GIL switch at that point would."""

    def __init__(self, **kw: Any) -> None:
        self.armed: int | None = None
        self.entered, self.release = threading.Event(), threading.Event()
        super().__init__(**kw)

    def clock(self) -> int:
        if self.armed is not None and threading.get_ident() == self.armed:
            self.armed = None
            self.entered.set()
            self.release.wait(BOUND)
        return self.now


def _steal_mid_load(rig: _GatedRig, a_load: Any) -> Bounded:
    """Thread A runs ``a_load`` (a ``load``); once A is inside it, thread B calls ``load('dB')``,
    which is refused with OwnerError (A is inside a call); then A goes on. Returns A's Bounded."""
    pb = rig.p.request_finished("pB", [2])

    def a() -> Any:
        rig.armed = threading.get_ident()
        return a_load()

    runner = Bounded(a)
    assert rig.entered.wait(BOUND), "A never reached its load"

    def b() -> None:
        rig.d.load("dB", (2,), pb)

    b_thread = Bounded(b)
    assert b_thread.wait(BOUND) and len(b_thread.out) == 1 and isinstance(b_thread.out[0], OwnerError), \
        b_thread.out
    assert all(getattr(e, "request_id", None) != "dB" for e in rig.d.core.log.inbox), "a refused call queued"
    rig.release.set()
    return runner


def test_count_a_call_from_another_thread_mid_call_is_refused_and_the_owners_load_is_kept() -> None:
    """Scenario: decode Connector over a COUNT inbox of 1. The scheduler thread A loads d0 (the
    inbox is now at its bound), then starts ``load('dX')``; while A is inside that call (after
    ``_open`` made it owner, before its submit) thread B calls ``load('dB')`` and returns. A's load
    returns normally. A then steps (becoming owner again) until everything is reported.

    Expected (docs/decisions.md "The owner thread's own submissions are never refused": dropping a
    scheduler call "would lose a request the caller was told was accepted"; COUNT drops "only what
    nobody here asked for"): B's call is refused with OwnerError (one thread at a time) and d0 and
    dX are each reported exactly once. (B's call once took ownership mid-call, so A's
    ``ReadRequested`` for dX met the full inbox as a foreign thread's and was dropped: dX was never
    reported, its local block refused for ever.)"""
    rig = _GatedRig(d_log=EventLog(inbox_limit=1, overflow=Overflow.COUNT))
    p0, px = rig.p.request_finished("p0", [0]), rig.p.request_finished("pX", [1])
    rig.d.load("d0", (0,), p0)  # the inbox is at its bound now (main thread: owner, goes in)
    runner = _steal_mid_load(rig, lambda: rig.d.load("dX", (1,), px))
    assert runner.wait(BOUND) and runner.out == [None], runner.out
    rig.step(10)
    dropped = [r.event for r in rig.d.core.log.records() if isinstance(r.event, Dropped)]
    assert rig.recv == {"d0": 1, "dX": 1} and not dropped, (
        f"reported {rig.recv}; Dropped records: {[(e.count, e.by_source) for e in dropped]}")


def test_block_a_call_from_another_thread_mid_call_is_refused_and_the_scheduler_never_hangs() -> None:
    """Scenario: as above over a BLOCK inbox of 1: the scheduler thread A is inside ``load('dX')``
    when thread B calls ``load('dB')`` once and returns (B never steps: an API thread's one call).

    Expected (docs/embedding.md "Threads": the caller's own calls "go in over a full inbox and are
    never waited for"; a call while another thread is inside one raises OwnerError): B is refused,
    A's load returns and A's later steps report d0 and dX. (B once took ownership, and A's submit
    waited for room only its own pump could make: the scheduler thread deadlocked in ``load``.)"""
    log = EventLog(inbox_limit=1, overflow=Overflow.BLOCK)
    rig = _GatedRig(d_log=log)
    p0, px = rig.p.request_finished("p0", [0]), rig.p.request_finished("pX", [1])
    rig.d.load("d0", (0,), p0)

    def a_load_then_step() -> None:
        rig.d.load("dX", (1,), px)
        rig.step(10)

    runner = _steal_mid_load(rig, a_load_then_step)
    finished = runner.wait(BOUND)
    if not finished:  # a closed log ends BLOCK waits, so the thread and the test can end
        log.close()
        runner.wait(BOUND)
    assert finished, "the scheduler thread deadlocked in its own load(): it lost ownership mid-call"
    assert rig.recv == {"d0": 1, "dX": 1}


# --- torch workers, a foreign flood, both policies ----------------------------------------------------


def _torch_pair(log: EventLog, *, latency_s: float, workers: int = 2,
                blocks: int = 32) -> tuple[Connector, Connector, TorchTransport]:
    tnet, net = TorchNetwork(), SimNetwork()
    pt = TorchTransport(tnet, "p", random_kv(1, blocks, 64, seed=5))
    dt = TorchTransport(tnet, "d", zero_kv(1, blocks, 64), latency_s=latency_s, workers=workers)
    prefill = Connector(CoreConfig(engine_id="P"), pt, SimHandshaker(net), host="p-host", port=1)
    reply = HandshakeReply(engine_id="P", compat_hash="", tp_size=1, num_blocks=blocks, ranks=(pt.rank_info(),))
    net.serve("p-host", 1, lambda pp: reply)
    decode = Connector(CoreConfig(engine_id="D"), dt, SimHandshaker(net), log=log)
    return prefill, decode, dt


def test_count_flood_with_torch_outcomes_stays_bounded_and_counts_every_drop_once() -> None:
    """Scenario: COUNT inbox of 4; a foreign thread floods droppable Ticks while the step thread
    (not the building thread) loads 24 requests read by 4 torch workers and steps until all are
    reported; a sampler watches the inbox length.

    Expected: every request reported exactly once; flood ticks applied + sum of Dropped records
    from the flood == ticks submitted (each drop counted once, as Dropped); the inbox never exceeds
    limit + reads started + one step's own work."""
    limit, n = 4, 24
    log = EventLog(inbox_limit=limit, overflow=Overflow.COUNT)
    prefill, decode, _ = _torch_pair(log, latency_s=0.001, workers=4)
    stop = threading.Event()
    sent = Counter[str]()
    peak = [0]

    def flood() -> None:
        i = 0
        while not stop.is_set():
            log.submit(Tick(source="flood", t_ns=i))
            sent["flood"] += 1
            i += 1

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], len(log.inbox))

    threads = [threading.Thread(target=flood, daemon=True), threading.Thread(target=sample, daemon=True)]
    recv: Counter[str] = Counter()

    def scheduler() -> None:
        for i in range(n):
            decode.load(f"d{i}", [i], prefill.request_finished(f"p{i}", [i]))
        deadline = time.monotonic() + BOUND
        while len(recv) < n and time.monotonic() < deadline:
            recv.update(decode.get_finished()[1])
            prefill.get_finished()
        stop.set()
        for t in threads:
            t.join(BOUND)
        recv.update(decode.get_finished()[1])

    for t in threads:
        t.start()
    runner = Bounded(scheduler)
    finished = runner.wait(BOUND * 3)
    stop.set()
    assert finished and runner.out == [None], runner.out
    rows = log.records()
    applied = sum(1 for r in rows if isinstance(r.event, Tick) and r.event.source == "flood")
    counted = sum(r.event.by_source.get("flood", 0) for r in rows if isinstance(r.event, Dropped))
    assert recv == Counter({f"d{i}": 1 for i in range(n)})
    assert applied + counted == sent["flood"], (applied, counted, sent["flood"])
    # own work of one step: n loads (worst case, all in one call) + outcomes of n reads + a tick
    assert peak[0] <= limit + 2 * n + 2, peak[0]
    decode.shutdown()
    prefill.shutdown()


@pytest.mark.parametrize("overflow", [Overflow.BLOCK, Overflow.COUNT], ids=["block", "count"])
def test_shutdown_on_another_thread_than_the_stepping_one_reports_each_request_once(overflow: Overflow) -> None:
    """Scenario: a step thread S loads 8 requests over a torch transport with slow reads (more
    than the inbox of 2 holds), steps twice and ends; the main thread then calls shutdown() while
    the reads' workers are still running (they report CANCELLED into the full inbox).

    Expected: shutdown returns within the bound (no worker left waiting for room), and every
    request is reported exactly once across the steps and shutdown's last report."""
    log = EventLog(inbox_limit=2, overflow=overflow)
    prefill, decode, _dt = _torch_pair(log, latency_s=5.0, workers=2)
    recv: Counter[str] = Counter()

    def step_thread() -> None:
        for i in range(8):
            decode.load(f"d{i}", [i], prefill.request_finished(f"p{i}", [i]))
        for _ in range(2):
            recv.update(decode.get_finished()[1])

    s = Bounded(step_thread)
    assert s.wait(BOUND) and s.out == [None], s.out
    stopping = Bounded(decode.shutdown)
    finished = stopping.wait(BOUND)
    if not finished:
        log.close()
        stopping.wait(BOUND)
    prefill.shutdown()
    assert finished, "shutdown() on another thread deadlocked"
    (last,) = stopping.out
    assert isinstance(last, StepOutput), last
    recv.update(last.finished_recving)
    assert recv == Counter({f"d{i}": 1 for i in range(8)})


def test_loads_from_another_thread_while_one_steps_are_refused_between_its_pump_and_bookkeeping() -> None:
    """Scenario: thread A is inside ``get_finished`` (its step); its pump has just returned and
    nobody is inside ``pump``; thread B calls ``load('dB')`` there, and again (other params) after
    A's step cleared its queued ids, before A pumps again (A is held at each point, where a GIL
    switch could fall: as its step reads the queued ids right after the pump, and in the
    transport's progress).

    Expected (docs/embedding.md: a call while another thread is inside a Connector method is
    refused with OwnerError, changing nothing): both of B's loads raise OwnerError and no
    ReadRequested for dB reaches the core. (The first was once accepted, then forgotten by A's
    bookkeeping, so the second was accepted too: two ReadRequested for one id.)"""
    rig = _GatedRig()
    p1, p2 = rig.p.request_finished("p1", [1]), rig.p.request_finished("p2", [2])
    core, dt = rig.d.core, rig.dt
    real_progress = dt.progress
    gates = {name: (threading.Event(), threading.Event()) for name in ("pumped", "progress")}
    a_ident: list[int] = []

    def hold(name: str) -> None:
        if a_ident and threading.get_ident() == a_ident[0]:
            entered, release = gates[name]
            if not entered.is_set():
                entered.set()
                release.wait(BOUND)

    class PumpedThenHeld(dict[int, set[str]]):
        """The step's bookkeeping right after its pump reads this first: A holds there."""

        def values(self) -> Any:
            hold("pumped")
            return super().values()

    def progress() -> None:
        hold("progress")
        real_progress()

    rig.d._queued = PumpedThenHeld(rig.d._queued)
    dt.progress = progress  # type: ignore[method-assign]

    def a() -> None:
        a_ident.append(threading.get_ident())
        rig.d.get_finished()

    runner = Bounded(a)
    outcomes: list[object] = []
    assert gates["pumped"][0].wait(BOUND)
    first = Bounded(lambda: rig.d.load("dB", (3,), p1))
    assert first.wait(BOUND) and len(first.out) == 1 and isinstance(first.out[0], OwnerError), first.out
    gates["pumped"][1].set()
    assert gates["progress"][0].wait(BOUND)
    second = Bounded(lambda: rig.d.load("dB", (4,), p2))
    assert second.wait(BOUND)
    outcomes.extend(second.out)
    gates["progress"][1].set()
    assert runner.wait(BOUND) and runner.out == [None], runner.out
    rig.step(20)
    leaked = sorted(b for b in rig.d._writes.get("dB", ()) if b in rig.d._writing)
    reads = [r for r in core.log.records() if isinstance(r.event, ReadRequested) and r.event.request_id == "dB"]
    assert isinstance(outcomes[0], OwnerError), (
        f"second load of 'dB' accepted; ReadRequested records for dB: "
        f"{[(r.outcome.name, r.reason) for r in reads]}; reported {rig.recv}; blocks still held for dB: {leaked}")
    assert reads == [] and leaked == [] and "dB" not in rig.recv


@pytest.mark.parametrize("overflow", [Overflow.COUNT, Overflow.BLOCK], ids=["count", "block"])
def test_a_submission_after_close_is_counted_even_with_room_in_the_inbox(overflow: Overflow) -> None:
    """Scenario: a transport thread submits an outcome after the log was closed (the core will
    never pump again), with the inbox far from its bound. Expected: not queued where nobody will
    ever apply it, but counted as dropped under its source (nothing kept silently)."""
    log = EventLog(inbox_limit=64, overflow=overflow)
    log.close()
    done = Bounded(lambda: log.submit(Tick(source="late", t_ns=1)))
    assert done.wait(BOUND) and done.out == [None]
    assert not log.inbox and log.take_dropped() == {"late": 1}
