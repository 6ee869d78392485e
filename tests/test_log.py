"""The event log: contiguous sequence numbers, many producer threads, bounded memory, explicit overflow."""

from __future__ import annotations

import gc
import threading
import time

import msgspec
import pytest
from helpers import ev, make_core, read

from pdfsm.core import Core
from pdfsm.errors import InvalidInput
from pdfsm.events import AbortRequested, BlocksHeld, CoreConfig, Dropped, NotificationReceived, Reported
from pdfsm.log import EventLog, MemorySink, Outcome, Overflow, Record


def test_records_are_contiguous_and_immutable() -> None:
    core = make_core(strict=False)
    for i in range(5):
        core.apply(read(f"r{i}"))
    seqs = [r.seq for r in core.log.records()]
    assert seqs == list(range(len(seqs)))
    rec = core.log.records()[1]
    with pytest.raises(AttributeError):
        rec.state = "X"  # type: ignore[misc]
    assert msgspec.msgpack.Decoder(Record).decode(msgspec.msgpack.encode(rec)) == rec  # as a reader sees it


def test_what_the_log_keeps_is_never_tracked_by_the_garbage_collector() -> None:
    """A record per event, and a tombstone per finished request, stay in memory: tracked objects,
    they made the collector run every ~100 requests and cost about 7 % of applying (docs/benchmarks.md)."""
    core = make_core(strict=False)
    core.apply(read("r"))
    core.apply(ev(BlocksHeld, 2, request_id="p", block_ids=(1, 2)))
    core.apply(ev(NotificationReceived, 3, request_id="p", part=0, of=1, sender="D"))
    assert core.log.window and not any(gc.is_tracked(r) for r in core.log.window)
    assert core._remembered_order and not any(gc.is_tracked(t) for t in core._remembered_order)


def test_rejected_events_are_recorded_with_reason_and_fault() -> None:
    core = make_core(strict=False)
    core.apply(ev(AbortRequested, request_id="ghost"))
    rec = core.log.records()[-1]
    assert rec.outcome is Outcome.IGNORED and "nothing to abort" in rec.reason


def test_derived_events_cannot_be_submitted() -> None:
    core = make_core()
    with pytest.raises(InvalidInput, match="derived"):
        core.submit(ev(Reported, request_id="r"))


def test_many_threads_submit_one_owner_applies_nothing_lost() -> None:
    sink = MemorySink()
    core = Core(CoreConfig(engine_id="D"), EventLog(window=64, sink=sink, inbox_limit=256))
    threads, per_thread = 6, 500
    stop = threading.Event()

    def producer(k: int) -> None:
        for i in range(per_thread):
            core.submit(ev(AbortRequested, i, source=f"thread-{k}", request_id=f"{k}-{i}"))

    workers = [threading.Thread(target=producer, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    while any(w.is_alive() for w in workers) or core.log.inbox:
        core.pump()
        if not core.log.inbox:
            time.sleep(0.0005)
    stop.set()
    core.pump()
    records = sink.records
    assert [r.seq for r in records] == list(range(1 + threads * per_thread))
    assert len(core.log) == 64 and core.log.evicted == len(records) - 64  # memory stays bounded
    for k in range(threads):  # each producer's own order is kept
        mine = [int(r.event.request_id.split("-")[1]) for r in records[1:]
                if isinstance(r.event, AbortRequested) and r.event.source == f"thread-{k}"]
        assert mine == list(range(per_thread))


def test_count_policy_refuses_counts_and_records_the_loss() -> None:
    core = Core(CoreConfig(engine_id="D"), EventLog(inbox_limit=3, overflow=Overflow.COUNT))

    def transfer_thread() -> None:
        for i in range(5):
            core.submit(ev(AbortRequested, i, source="xfer", request_id=f"r{i}"))

    t = threading.Thread(target=transfer_thread)
    t.start()
    t.join()
    core.pump()
    (rec,) = [r for r in core.log.records() if isinstance(r.event, Dropped)]
    assert isinstance(rec.event, Dropped)
    assert rec.event.count == 2 and rec.event.by_source == {"xfer": 2}
    assert rec.fault is not None


def test_the_owner_thread_is_never_refused_nor_made_to_wait() -> None:
    """Over the limit, the owner's own submissions (the scheduler's calls, a polled transport's
    outcomes) go in: waiting would deadlock, dropping would lose what was accepted."""
    for overflow in Overflow:
        core = Core(CoreConfig(engine_id="D"), EventLog(inbox_limit=1, overflow=overflow))
        for i in range(3):
            core.submit(ev(AbortRequested, i, request_id=f"r{i}"))
        assert core.pump() == 3 and not any(isinstance(r.event, Dropped) for r in core.log.records())


def test_block_policy_waits_for_the_owner() -> None:
    core = Core(CoreConfig(engine_id="D"), EventLog(inbox_limit=2, overflow=Overflow.BLOCK))
    done = threading.Event()

    def producer() -> None:
        for i in range(10):
            core.submit(ev(AbortRequested, i, request_id=f"r{i}"))
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.05)
    assert not done.is_set() and len(core.log.inbox) == 2  # blocked, nothing dropped
    while not done.is_set() or core.log.inbox:
        core.pump()
        time.sleep(0.001)
    t.join()
    assert sum(isinstance(r.event, AbortRequested) for r in core.log.records()) == 10


# --- found by review (stop 19) ---------------------------------------------------------------------


def test_a_strict_mode_bad_message_keeps_its_seq_and_the_next_record_does_not_reuse_it() -> None:
    """A core event that raises in strict mode (a BadMessage: a remote fault) was recorded, and
    then its seq was written back as the next one: two records with one seq, and a durable sink
    refusing every later write."""
    from pdfsm.errors import RemoteProtocolError
    from pdfsm.events import BadMessage, Tick

    sink = MemorySink()
    core = make_core(strict=True, sink=sink)
    core.submit(ev(BadMessage, 1, channel="side", sender="x", error="junk", size=3))
    core.submit(ev(Tick, 2))
    with pytest.raises(RemoteProtocolError):
        core.pump()
    core.pump()
    seqs = [(r.seq, type(r.event).__name__) for r in core.log.records()]
    assert seqs == [(0, "Started"), (1, "BadMessage"), (2, "Tick")] and core.log.next_seq == 3
    assert [r.seq for r in sink.records] == [0, 1, 2]


def test_rows_a_sink_refused_are_handed_to_it_again() -> None:
    """flush() cleared its rows before the sink's write: one raising write was a silent hole."""

    class Flaky(MemorySink):
        fail = True

        def write(self, rows: list[object]) -> None:  # type: ignore[override]
            if self.fail:
                self.fail = False
                raise OSError("disk busy")
            super().write(rows)  # type: ignore[arg-type]

    sink = Flaky()
    core = make_core(sink=sink)
    core.submit(ev(AbortRequested, 1, request_id="a"))
    with pytest.raises(OSError, match="disk busy"):
        core.pump()
    core.submit(ev(AbortRequested, 2, request_id="b"))
    core.pump()
    assert [r.seq for r in sink.records] == [r.seq for r in core.log.records()] == [0, 1, 2]


def test_the_owner_s_submission_to_a_closed_log_is_counted_not_queued() -> None:
    """Only other threads' late submissions were counted; the owner's went into an inbox nobody
    will pump again."""
    for overflow in Overflow:
        log = EventLog(inbox_limit=64, overflow=overflow)
        log.owner = threading.get_ident()
        log.close()
        log.submit(ev(AbortRequested, 1, request_id="late"))
        assert not log.inbox and sum(log.take_dropped().values()) == 1
