"""Cost of applying events, log append included, against hand-written bookkeeping.

The workload is the whole lifecycle of a request on both sides, one engine pair
already connected, every event going through a log inbox and a pump:

    producer: BlocksHeld ............................ NotificationReceived -> released
    consumer:       ReadRequested -> HandleDone -> (Collect) Reported       -> handed off

Two baselines read the same event objects from the same kind of inbox, emit the same
commands, and record nothing:

- :class:`DictBaseline` (``ratio_vs_baseline``, the goal's baseline) is the least
  bookkeeping that does the job: dicts of metadata, counters, a finished list, the same
  deadline bookkeeping.
- :class:`NixlBaseline` (``ratio_vs_vllm_style``, for context) keeps the books vLLM's NixlConnectorWorker
  keeps for these events, method by method (``start_load_kv``, ``_read_blocks_for_req``,
  ``_read_blocks``, ``_pop_done_transfers``, ``get_finished``, ``_get_new_notifs``), with its
  per-request topology calls and ``logger.debug`` calls; what pdfsm's core does not do either is
  left out (its docstring lists what).

All of them run in this process, in interleaved rounds (each first in turn, a ``gc.collect()``
before each); medians are reported. pdfsm runs as installed: its hot path compiled with mypyc
(setup.py), or pure Python (``PDFSM_PURE_PYTHON=1``); the table's first line says which. On the
2-core development VM (Python 3.11, not PGO), 2026-11-28: compiled, pdfsm 1.04-1.10M events/s
(0.9-1.0 us per recorded event) and 2.3-2.5x the dict baseline (2.0-2.2M/s), 1.5-1.6x the
vLLM-style one; pure Python 0.50M/s and 5.1x (the goal asks 1M/s and 3x). A pair whose windows
and tombstones are already full, as in a long run, is timed alongside (``long_run_*``):
0.71-0.75M/s, 3.3-3.4x.

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
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import structlog

import pdfsm
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


class _Topology:
    """The per-request topology lookups of vLLM's ``TpKVTopology`` (vllm/distributed/kv_transfer/
    kv_connector/utils.py): the remote ranks and the TP ratio, recomputed from the engine's TP size
    on every call, as vLLM computes them for every request."""

    def __init__(self, tp_rank: int, tp_size: int, remote_tp_size: dict[str, int]) -> None:
        self.tp_rank, self.tp_size, self.remote_tp_size = tp_rank, tp_size, remote_tp_size

    def tp_ratio(self, remote_tp_size: int) -> int:
        """``TpKVTopology.tp_ratio``: D/P when D is larger, else -(P/D)."""
        if self.tp_size >= remote_tp_size:
            return self.tp_size // remote_tp_size
        return -(remote_tp_size // self.tp_size)

    def tp_ratio_from_engine_id(self, engine_id: str) -> int:
        """``TpKVTopology.tp_ratio_from_engine_id``."""
        return self.tp_ratio(self.remote_tp_size[engine_id])

    def get_target_remote_ranks(self, remote_tp_size: int) -> list[int]:
        """``TpKVTopology.get_target_remote_ranks``: the producer ranks this rank reads."""
        ratio = self.tp_ratio(remote_tp_size)
        if ratio > 0:
            return [self.tp_rank // ratio]
        return [self.tp_rank * -ratio + i for i in range(-ratio)]

    def get_target_remote_ranks_from_engine_id(self, engine_id: str) -> list[int]:
        """``TpKVTopology.get_target_remote_ranks_from_engine_id``."""
        return self.get_target_remote_ranks(self.remote_tp_size[engine_id])


class NixlBaseline:
    """The same events, with the books vLLM's ``NixlConnectorWorker`` keeps, and nothing else.

    Each method mirrors one part of ``NixlConnectorWorker`` in vllm-project/vllm,
    vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py (read at commit 002a1057e9ae),
    limited to bookkeeping that has a counterpart in pdfsm's core: what each request is waiting
    for, its transfer handles, notification counts, send expiries, what is finished, and the
    ``logger.debug`` calls vLLM makes on these paths whether or not debug is enabled (pdfsm checks
    a cached flag instead). Left out, because pdfsm's core does not do them either: building the
    per-request metadata (the ``ReadRequested``/``BlocksHeld`` events are built before the clock
    starts, for both sides), decoding notification strings (the transport adapter's job in
    pdfsm), logical-to-kernel block mapping, descriptor ids, the NIXL calls themselves (here, the
    same commands pdfsm emits) and heterogeneous block-size post-processing. Like vLLM it has no
    state machine, no log and no read deadline of its own; the deadline bookkeeping pdfsm does is
    kept as in :class:`DictBaseline`.
    """

    def __init__(self) -> None:
        self.inbox: deque[Event] = deque()
        self.logger = logging.getLogger("bench.nixl")  # vLLM's module logger; debug is off
        self.kv_topo = _Topology(0, 1, {"P": 1})
        self.world_size = 1
        self.remote_agents: dict[str, dict[int, str]] = {"P": {0: "agent-P-0"}}  # handshake done
        self.recving_metadata: dict[str, ReadRequested] = {}
        self.recving_transfers: defaultdict[str, list[int]] = defaultdict(list)  # handles: remote ranks here
        self.sources = {0: ReadSource(0, 0)}  # the read's source by remote rank (a command field)
        self.reqs_to_send: dict[str, int] = {}  # expiry, oldest first
        self.reqs_to_process: set[str] = set()
        self.consumer_notification_counts_by_req: defaultdict[str, int] = defaultdict(int)
        self.done_recving: set[str] = set()
        self.failed_recv_reqs: set[str] = set()
        self.send_blocks: dict[str, tuple[int, ...]] = {}  # the scheduler's side: blocks to free
        self.deadlines: dict[str, int] = {}  # pdfsm's read deadline (vLLM has none), as DictBaseline
        self.commands: list[object] = []
        self.handlers: dict[type, Callable[[Any], None]] = {
            ReadRequested: self.start_load_kv, HandleDone: self.pop_done_transfer, Collect: self.get_finished,
            BlocksHeld: self.add_req_to_send, NotificationReceived: self.get_new_notif, Tick: self.expire_sends}

    def pump(self) -> None:
        inbox, handlers = self.inbox, self.handlers
        while inbox:
            ev = inbox.popleft()
            handlers[type(ev)](ev)

    def start_load_kv(self, ev: ReadRequested) -> None:
        """``start_load_kv``, the body of its loop over the step's requests to receive: keep the
        request's metadata, check the remote engine is known (a handshake otherwise), read."""
        rid, engine_id = ev.request_id, ev.engine_id
        self.logger.debug("start_load_kv for request %s from remote engine %s. Num local_block_ids: %s. "
                          "Num remote_block_ids: %s. ", rid, engine_id, len(ev.local_blocks), len(ev.remote_blocks))
        self.recving_metadata[rid] = ev
        if engine_id not in self.remote_agents:
            return  # the handshake path; never taken here (the engine is connected, as for pdfsm)
        self.deadlines[rid] = ev.t_ns + TIMEOUT_NS
        self.read_blocks_for_req(rid, ev)

    def read_blocks_for_req(self, rid: str, ev: ReadRequested) -> None:
        """``_read_blocks_for_req``: one read per remote rank the topology names."""
        engine_id = ev.engine_id
        remote_ranks = self.kv_topo.get_target_remote_ranks_from_engine_id(engine_id)
        tp_ratio = self.kv_topo.tp_ratio_from_engine_id(engine_id)
        for i, remote_rank in enumerate(remote_ranks):
            if tp_ratio < 0 and i > 0:
                break  # MLA reads one rank (never here: no MLA)
            self.logger.debug("Remote agent %s available, calling _read_blocks on remote rank %s for req %s",
                              engine_id, remote_rank, rid)
            self.read_blocks(rid, ev, remote_rank)

    def read_blocks(self, rid: str, ev: ReadRequested, remote_rank: int) -> None:
        """``_read_blocks``: post the read (its notification names the producer's request) and keep
        its handle by request in ``_recving_transfers``."""
        note = Notification(ev.remote_request_id, 0, self.world_size)
        self.commands.append(PostRead(rid, ev.engine_id, self.sources[remote_rank], ev.local_blocks,
                                      ev.remote_blocks, note))
        self.recving_transfers[rid].append(remote_rank)

    def pop_done_transfer(self, ev: HandleDone) -> None:
        """``_pop_done_transfers`` for the request whose transfer completed: keep the handles still
        in progress; with none left, the request is done receiving."""
        rid = ev.request_id
        handles = self.recving_transfers.get(rid)
        if handles is None:
            return
        in_progress = []
        for handle in handles:
            if handle == ev.tp_rank:
                continue  # DONE
            in_progress.append(handle)  # PROC
        if not in_progress:
            self.done_recving.add(rid)
            del self.recving_transfers[rid]
            self.deadlines.pop(rid, None)
        else:
            self.recving_transfers[rid] = in_progress

    def get_finished(self, ev: Collect) -> None:
        """``get_finished`` at a scheduler step: what finished receiving leaves ``_recving_metadata``
        and goes back to the scheduler; then the expired sends."""
        done_recving, self.done_recving = self.done_recving, set()
        done_recving.update(self.failed_recv_reqs)
        self.failed_recv_reqs.clear()
        if len(done_recving) > 0:
            self.logger.debug("Rank %s, get_finished: %s requests done sending and %s requests done recving",
                              0, 0, len(done_recving))
        for rid in done_recving:
            meta = self.recving_metadata.pop(rid, None)
            assert meta is not None
            self.commands.append(HandOff(request_id=rid, outcome="received"))
        self.expire_sends(ev)

    def add_req_to_send(self, ev: BlocksHeld) -> None:
        """``start_load_kv``, the producer's part: the request joins ``_reqs_to_process`` (it was in
        the batch) and, with its expiry, ``_reqs_to_send``."""
        rid = ev.request_id
        self.send_blocks[rid] = ev.block_ids
        self.reqs_to_process.add(rid)
        if rid in self.reqs_to_process:
            self.reqs_to_send[rid] = ev.t_ns + TIMEOUT_NS

    def get_new_notif(self, ev: NotificationReceived) -> None:
        """``_get_new_notifs``, for one notification: unknown requests are reported; otherwise count
        it, and release the blocks when every consumer rank has notified."""
        rid = ev.request_id
        if rid not in self.reqs_to_send and rid not in self.reqs_to_process:
            self.logger.error("Potentially invalid KV blocks for unrecognized request %s", rid)
            return
        n_consumers = ev.of  # vLLM parses the consumer's TP size from the message; here, 1:1 TP
        tp_ratio = self.kv_topo.tp_ratio(n_consumers)
        consumers_per_producer = -tp_ratio if n_consumers > self.world_size else 1
        counts = self.consumer_notification_counts_by_req
        counts[rid] += 1
        if counts[rid] == consumers_per_producer:
            del counts[rid]
            self.reqs_to_process.remove(rid)
            self.reqs_to_send.pop(rid, None)
            self.commands.append(FinishedSending(request_id=rid, block_ids=self.send_blocks.pop(rid)))

    def expire_sends(self, ev: Tick | Collect) -> None:
        """The end of ``get_finished``: release sends whose expiry passed, oldest first, stopping at
        the first that has not (every step)."""
        now = ev.t_ns
        while self.reqs_to_send:
            rid, expires = next(iter(self.reqs_to_send.items()))
            if now < expires:
                break
            self.consumer_notification_counts_by_req.pop(rid, 0)
            self.logger.warning("Releasing expired KV blocks for request %s", rid)
            self.reqs_to_process.remove(rid)
            del self.reqs_to_send[rid]
            self.commands.append(FinishedSending(request_id=rid, block_ids=self.send_blocks.pop(rid), expired=True))


def run_baseline(base: DictBaseline | NixlBaseline, p_events: list[Event], d_events: list[Event]) -> int:
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


def long_run_pair(sink: bool) -> tuple[Core, Core, int]:
    """A connected pair that has already run long enough to fill its windows and its tombstones
    (CoreConfig.tombstones), as in a server that has been up a while: from then on every record
    evicts the oldest and every finished request forgets the oldest one remembered. Returns the
    pair and how many requests it ran (later workloads start after them)."""
    p, d = connected_pair(sink)
    fill = max(p.log.window.maxlen or 0, p.config.tombstones) + 1
    run_pdfsm(p, d, *workload(fill, 0))
    return p, d, fill


def measure(requests: int, rounds: int, sink: bool) -> dict[str, Any]:
    times: dict[str, list[float]] = {"pdfsm": [], "long_run": [], "nixl": [], "dict": []}
    records = base_events = long_records = 0
    long_p, long_d, start = long_run_pair(sink)
    held = []  # every round's events stay alive, so an eviction only drops a reference, as in the others
    for r in range(rounds):
        p_events, d_events = workload(requests, start + r * requests)
        held.append((p_events, d_events))
        p, d = connected_pair(sink)
        runners: list[tuple[str, Callable[[], int]]] = [
            ("pdfsm", lambda: run_pdfsm(p, d, p_events, d_events)),  # noqa: B023 (run in this round)
            ("long_run", lambda: run_pdfsm(long_p, long_d, p_events, d_events)),  # noqa: B023
            ("nixl", lambda: run_baseline(NixlBaseline(), p_events, d_events)),  # noqa: B023
            ("dict", lambda: run_baseline(DictBaseline(), p_events, d_events)),  # noqa: B023
        ]
        for name, run in runners[r % 4:] + runners[:r % 4]:  # each goes first in turn
            gc.collect()
            t0 = time.perf_counter()
            n = run()
            times[name].append(time.perf_counter() - t0)
            if name == "pdfsm":
                records = n
            elif name == "long_run":
                long_records = n
            else:
                base_events = n
    t_pdfsm, t_long, t_base, t_dict = (statistics.median(times[k]) for k in ("pdfsm", "long_run", "nixl", "dict"))
    return {
        "requests_per_round": requests,
        "rounds": rounds,
        "events_per_s": records / t_pdfsm,
        "ns_per_event": t_pdfsm / records * 1e9,
        "baseline_events_per_s": base_events / t_dict,
        "baseline_ns_per_event": t_dict / base_events * 1e9,
        "ratio_vs_baseline": t_pdfsm / t_dict,
        "vllm_style_events_per_s": base_events / t_base,
        "ratio_vs_vllm_style": t_pdfsm / t_base,
        # The same rounds on a pair whose windows and tombstones are full (long_run_pair).
        "long_run_events_per_s": long_records / t_long,
        "long_run_ratio_vs_baseline": t_long / t_dict,
        "records_per_request": records / requests,
        "with_sink": sink,
        "hot_path": pdfsm.HOT_PATH,  # compiled with mypyc, or pure Python and why (setup.py)
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
          f"{out['records_per_request']:.2f} records per request (medians); pdfsm {out['hot_path']}")
    print(f"{'':24s}{'events/s':>14s}{'ns/event':>12s}")
    print(f"{'pdfsm (apply + log)':24s}{out['events_per_s']:14,.0f}{out['ns_per_event']:12.0f}")
    print(f"{'pdfsm, long run':24s}{out['long_run_events_per_s']:14,.0f}{1e9 / out['long_run_events_per_s']:12.0f}")
    print(f"{'dict baseline':24s}{out['baseline_events_per_s']:14,.0f}{out['baseline_ns_per_event']:12.0f}")
    print(f"{'vLLM-style baseline':24s}{out['vllm_style_events_per_s']:14,.0f}"
          f"{1e9 / out['vllm_style_events_per_s']:12.0f}")
    print(f"ratio (pdfsm time / dict baseline time, same workload): {out['ratio_vs_baseline']:.2f} "
          f"(against the vLLM-style baseline: {out['ratio_vs_vllm_style']:.2f}); "
          f"long run: {out['long_run_ratio_vs_baseline']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
