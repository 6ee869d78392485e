"""Cost of applying events, log append included, against hand-written dict bookkeeping.

The workload is the whole lifecycle of a request on both sides, one engine pair
already connected, every event going through a log inbox and a pump:

    producer: BlocksHeld ............................ NotificationReceived -> released
    consumer:       ReadRequested -> HandleDone -> (Collect) Reported       -> handed off

The baseline does the same bookkeeping the way connectors without a state machine do
it (dicts of metadata, counters, a finished list, the same commands emitted, the same
deadline bookkeeping), reading the same event objects from the same kind of inbox; it
records nothing. Both run in this process, in interleaved rounds; medians are reported.

    python benchmarks/apply.py            # a table
    python benchmarks/apply.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from pdfsm.commands import FinishedSending, HandOff, PostRead
from pdfsm.core import Core
from pdfsm.events import (
    BlocksHeld,
    Collect,
    CoreConfig,
    Event,
    HandleDone,
    HandshakeDone,
    HandshakeReply,
    NotificationReceived,
    PeerAdded,
    RankInfo,
    ReadRequested,
    Tick,
)
from pdfsm.log import EventLog, MemorySink
from pdfsm.topology import ReadSource
from pdfsm.wire import Notification

COLLECT_EVERY = 32
TIMEOUT_NS = 30_000_000_000
BLOCKS = tuple(range(16))


def workload(n: int, offset: int) -> tuple[list[Event], list[Event]]:
    """Producer and consumer events for ``n`` requests, in the order their sources emit them."""
    p_events: list[Event] = []
    d_events: list[Event] = []
    for i in range(offset, offset + n):
        t = i * 1_000
        p_events.append(BlocksHeld(source="scheduler", t_ns=t, request_id=f"p{i}", block_ids=BLOCKS))
        d_events.append(ReadRequested(source="scheduler", t_ns=t, request_id=f"d{i}", remote_request_id=f"p{i}",
                                      engine_id="P", local_blocks=BLOCKS, remote_blocks=BLOCKS))
        d_events.append(HandleDone(source="transfer", t_ns=t + 500, request_id=f"d{i}", pp_rank=0, tp_rank=0))
        p_events.append(NotificationReceived(source="notify", t_ns=t + 600, request_id=f"p{i}", part=0, of=1,
                                             sender="D"))
        if i % COLLECT_EVERY == COLLECT_EVERY - 1:
            d_events.append(Collect(source="scheduler", t_ns=t + 700, step=i))
            p_events.append(Tick(source="timer", t_ns=t + 700))
    return p_events, d_events


def connected_pair(sink: bool) -> tuple[Core, Core]:
    def log() -> EventLog:
        return EventLog(window=65536, sink=MemorySink() if sink else None)

    d = Core(CoreConfig(engine_id="D", compat_hash="h"), log())
    p = Core(CoreConfig(engine_id="P", compat_hash="h"), log())
    d.apply(ReadRequested(source="s", t_ns=0, request_id="warm", remote_request_id="w", engine_id="P",
                          local_blocks=(0,), remote_blocks=(0,)))
    rank = RankInfo(pp_rank=0, tp_rank=0, agent="a")
    reply = HandshakeReply(engine_id="P", compat_hash="h", tp_size=1, ranks=(rank,))
    d.apply(HandshakeDone(source="h", t_ns=0, engine_id="P", pp_rank=0, attempt=1, reply=reply))
    d.apply(PeerAdded(source="h", t_ns=0, engine_id="P", pp_rank=0, attempt=1))
    d.take_commands()
    return p, d


def run_pdfsm(p: Core, d: Core, p_events: list[Event], d_events: list[Event]) -> int:
    """Submit every event to its core's inbox and pump in scheduler-step sized batches."""
    before = p.log.next_seq + d.log.next_seq
    for core, events in ((p, p_events), (d, d_events)):
        submit, pump, take = core.submit, core.pump, core.take_commands
        for k in range(0, len(events), 64):
            for e in events[k:k + 64]:
                submit(e)
            pump()
            take()
    return p.log.next_seq + d.log.next_seq - before


class DictBaseline:
    """A connector's bookkeeping without a state machine or a log (vLLM-style dicts)."""

    def __init__(self) -> None:
        self.inbox: deque[Event] = deque()
        self.recving: dict[str, dict[str, Any]] = {}
        self.sending: dict[str, dict[str, Any]] = {}
        self.deadlines: dict[str, int] = {}
        self.leases: dict[str, int] = {}
        self.done_recving: list[str] = []
        self.commands: list[object] = []
        self.src = ReadSource(0, 0)
        self.handlers: dict[type, Callable[[Any], None]] = {
            ReadRequested: self.read, HandleDone: self.done, Collect: self.collect, BlocksHeld: self.held,
            NotificationReceived: self.notified, Tick: self.tick}

    def pump(self) -> None:
        inbox, handlers = self.inbox, self.handlers
        while inbox:
            ev = inbox.popleft()
            handlers[type(ev)](ev)

    def read(self, ev: ReadRequested) -> None:
        rid = ev.request_id
        if rid in self.recving:
            return
        self.recving[rid] = {"remote": ev.remote_request_id, "engine": ev.engine_id, "local": ev.local_blocks,
                             "pending": 1, "state": "reading"}
        self.deadlines[rid] = ev.t_ns + TIMEOUT_NS
        note = Notification(ev.remote_request_id, 0, 1)
        self.commands.append(PostRead(rid, ev.engine_id, self.src, ev.local_blocks, ev.remote_blocks, note))

    def done(self, ev: HandleDone) -> None:
        meta = self.recving.get(ev.request_id)
        if meta is None or meta["pending"] == 0:
            return
        meta["pending"] -= 1
        if meta["pending"] == 0:
            meta["state"] = "done"
            self.deadlines.pop(ev.request_id, None)
            self.done_recving.append(ev.request_id)

    def collect(self, ev: Collect) -> None:
        done, self.done_recving = self.done_recving, []
        for rid in done:
            del self.recving[rid]
            self.commands.append(HandOff(request_id=rid, outcome="received"))

    def held(self, ev: BlocksHeld) -> None:
        self.sending[ev.request_id] = {"blocks": ev.block_ids, "parts": 0, "of": 0}
        self.leases[ev.request_id] = ev.t_ns + TIMEOUT_NS

    def notified(self, ev: NotificationReceived) -> None:
        meta = self.sending.get(ev.request_id)
        if meta is None:
            return
        meta["parts"] |= 1 << ev.part
        if meta["parts"] == (1 << ev.of) - 1:
            del self.sending[ev.request_id]
            del self.leases[ev.request_id]
            self.commands.append(FinishedSending(request_id=ev.request_id, block_ids=meta["blocks"]))

    def tick(self, ev: Tick) -> None:
        pass  # nothing is due; a real baseline would scan its leases here


def run_baseline(base: DictBaseline, p_events: list[Event], d_events: list[Event]) -> int:
    n = 0
    for events in (p_events, d_events):
        append, pump = base.inbox.append, base.pump
        for k in range(0, len(events), 64):
            for e in events[k:k + 64]:
                append(e)
            pump()
            base.commands.clear()
        n += len(events)
    return n


def measure(requests: int, rounds: int, sink: bool) -> dict[str, Any]:
    pdfsm_t: list[float] = []
    base_t: list[float] = []
    records = base_events = 0
    for r in range(rounds):
        p_events, d_events = workload(requests, r * requests)
        p, d = connected_pair(sink)
        base = DictBaseline()
        gc.collect()
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            t0 = time.perf_counter()
            if which == 0:
                records = run_pdfsm(p, d, p_events, d_events)
                pdfsm_t.append(time.perf_counter() - t0)
            else:
                base_events = run_baseline(base, p_events, d_events)
                base_t.append(time.perf_counter() - t0)
    t_pdfsm, t_base = statistics.median(pdfsm_t), statistics.median(base_t)
    return {
        "requests_per_round": requests,
        "rounds": rounds,
        "events_per_s": records / t_pdfsm,
        "ns_per_event": t_pdfsm / records * 1e9,
        "baseline_events_per_s": base_events / t_base,
        "baseline_ns_per_event": t_base / base_events * 1e9,
        "ratio_vs_baseline": t_pdfsm / t_base,
        "records_per_request": records / requests,
        "with_sink": sink,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sink", action="store_true", help="also hand every record to an in-memory sink")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    out = measure(args.requests, args.rounds, args.sink)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"apply: {args.requests} requests x {args.rounds} rounds, both sides, "
          f"{out['records_per_request']:.2f} records per request (medians)")
    print(f"{'':24s}{'events/s':>14s}{'ns/event':>12s}")
    print(f"{'pdfsm (apply + log)':24s}{out['events_per_s']:14,.0f}{out['ns_per_event']:12.0f}")
    print(f"{'dict baseline':24s}{out['baseline_events_per_s']:14,.0f}{out['baseline_ns_per_event']:12.0f}")
    print(f"ratio (pdfsm time / baseline time, same workload): {out['ratio_vs_baseline']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
