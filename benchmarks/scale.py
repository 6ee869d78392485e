"""Per-step cost of the scheduler-facing API against the number of live requests, and memory per
live request.

One decode connector with N requests reading and one prefill connector with N requests
holding blocks, driven the way a scheduler drives them: each step some requests change
(on the decode side: reads complete and new loads arrive; on the prefill side: consumers'
notifications arrive and new requests finish prefill), then ``get_finished()``. The
transport is a stub that reports exactly the completions it is told to (as NIXL's
notifications would), so what is timed is pdfsm: connector, core, tables, timers, log.

``step_us_N`` is the median cost of a step with N live requests on each side and the same
10 requests changing per step on each side (1% of the smallest size): it measures what the
waiting backlog costs. ``growth_100k_over_1k`` is their ratio (the goal: <= 1.5, cost that
depends on the work, not the backlog). The table also has steps where 1% of N change, to
show the cost per changed request staying flat. ``bytes_per_live_request`` is the growth of
Python memory (tracemalloc) per live request between 1k and 100k, on the side that costs more.

    python benchmarks/scale.py                    # a table
    python benchmarks/scale.py --json             # one JSON object
    python benchmarks/scale.py --plot docs/scale.png
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
import tracemalloc
from collections import deque
from typing import Any

import structlog

from pdfsm.commands import PostRead, StartHandshake
from pdfsm.connector import Connector, KVTransferParams
from pdfsm.events import (
    CoreConfig,
    EngineKey,
    HandleDone,
    HandshakeDone,
    HandshakeReply,
    NotificationReceived,
    RankInfo,
    Source,
)
from pdfsm.wire import NotifyMessage
from transports.base import Capabilities, Clock, Submit

SIZES = (1_000, 10_000, 100_000)
CHANGES = 10
HOUR = 3_600_000_000_000
BLOCKS = (1, 2, 3, 4)


class StubTransport:
    """Reports the completions it is told to: nothing is polled, nothing scanned."""

    capabilities = Capabilities(name="stub", supports_pp=True, memory_kinds=frozenset({"DRAM"}))

    def __init__(self) -> None:
        self.submit: Submit = lambda ev: None
        self.clock: Clock = lambda: 0
        self.due: list[Any] = []

    def bind(self, submit: Submit, clock: Clock) -> None:
        self.submit, self.clock = submit, clock

    def rank_info(self) -> RankInfo:
        return RankInfo(pp_rank=0, tp_rank=0, agent="stub")

    def add_peer(self, key: EngineKey, reply: HandshakeReply, attempt: int = 0) -> None:
        pass

    def drop_peer(self, key: EngineKey) -> None:
        pass

    def post_read(self, cmd: PostRead) -> None:
        pass

    def cancel_read(self, request_id: str, pp_rank: int, tp_rank: int) -> None:
        pass

    def send(self, key: EngineKey, tp_rank: int, message: NotifyMessage) -> None:
        pass

    def progress(self) -> None:
        if self.due:
            due, self.due = self.due, []
            for ev in due:
                self.submit(ev)

    def stop_reads(self) -> None:
        pass

    def close(self) -> None:
        pass


class StubHandshaker:
    def __init__(self) -> None:
        self.submit: Submit = lambda ev: None
        self.clock: Clock = lambda: 0
        self.started: list[StartHandshake] = []

    def bind(self, submit: Submit, clock: Clock) -> None:
        self.submit, self.clock = submit, clock

    def start(self, cmd: StartHandshake) -> None:
        self.started.append(cmd)

    def progress(self) -> None:
        for cmd in self.started:
            reply = HandshakeReply(engine_id=cmd.engine_id, compat_hash="h", tp_size=1, pp_size=1,
                                   ranks=(RankInfo(pp_rank=0, tp_rank=0, agent="prefill"),))
            self.submit(HandshakeDone(source=Source.HANDSHAKE, t_ns=self.clock(), engine_id=cmd.engine_id,
                                      pp_rank=cmd.pp_rank, attempt=cmd.attempt, reply=reply))
        self.started.clear()

    def close(self) -> None:
        pass


class Clock1ms:
    """Simulated time: 1 ms per scheduler step, so no lease or read timeout ever comes due."""

    def __init__(self) -> None:
        self.now = 1

    def __call__(self) -> int:
        return self.now


class Side:
    """One connector with ``n`` live requests, in FIFO order of when they will change."""

    def __init__(self, role: str, n: int) -> None:
        self.clock = Clock1ms()
        self.transport = StubTransport()
        cfg = CoreConfig(engine_id=role, compat_hash="h", lease_ns=HOUR, read_timeout_ns=HOUR)
        self.conn = Connector(cfg, self.transport, StubHandshaker(), clock=self.clock)
        self.role = role
        self.live: deque[str] = deque()
        self.next_id = 0
        self.params = KVTransferParams(remote_tp_size=1, lease_ns=60_000_000_000, remote_engine_id="prefill",
                                       remote_request_id="p", remote_block_ids=BLOCKS)
        for _ in range(n):
            self.add()
            if len(self.live) % 1000 == 0:
                self.conn.get_finished()
        self.conn.get_finished()

    def add(self) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        if self.role == "decode":  # each live load writes its own local blocks (the Connector checks)
            local = tuple(range(self.next_id * len(BLOCKS), (self.next_id + 1) * len(BLOCKS)))
            self.conn.load(rid, local, msgspec_replace(self.params, rid))
        else:
            self.conn.request_finished(rid, BLOCKS)
        self.live.append(rid)

    def change(self) -> None:
        """The oldest live request finishes (its read completes, or its consumer notifies)."""
        rid = self.live.popleft()
        now = self.clock.now
        if self.role == "decode":
            ev: Any = HandleDone(source=Source.TRANSFER, t_ns=now, request_id=rid, pp_rank=0, tp_rank=0)
        else:
            ev = NotificationReceived(source=Source.TRANSFER, t_ns=now, request_id=rid, part=0, of=1)
        self.transport.due.append(ev)

    def step(self, changes: int) -> int:
        """One scheduler step; returns how many requests it reported finished."""
        self.clock.now += 1_000_000
        for _ in range(changes):
            self.change()
            self.add()
        sending, recving = self.conn.get_finished()
        return len(sending) + len(recving)


def msgspec_replace(p: KVTransferParams, rid: str) -> KVTransferParams:
    import msgspec

    return msgspec.structs.replace(p, remote_request_id=f"p-{rid}")


def step_costs(n_sizes: tuple[int, ...], changes: int, steps: int, block: int = 25) -> dict[int, float]:
    """Median microseconds of one step on both sides together, for each live count.

    The sizes take turns in blocks of ``block`` steps, so that a burst of load from elsewhere
    on the machine lands on every size alike instead of on whichever was being timed.
    """
    sides = {n: (Side("decode", n), Side("prefill", n)) for n in n_sizes}
    for decode, prefill in sides.values():  # warm up: every live request has been through a step
        for side in (decode, prefill):
            for _ in range(5):
                side.step(changes)
    samples: dict[int, list[float]] = {n: [] for n in n_sizes}
    gc.collect()
    gc.disable()
    try:
        for _ in range(max(1, steps // block)):
            for n, (decode, prefill) in sides.items():
                for _ in range(block):
                    t0 = time.perf_counter_ns()
                    reported = decode.step(changes) + prefill.step(changes)
                    samples[n].append((time.perf_counter_ns() - t0) / 1e3)
                    assert reported == 2 * changes, f"{reported} finished, expected {2 * changes}"
    finally:
        gc.enable()
    for n, (decode, prefill) in sides.items():
        assert len(decode.conn.core.consumers) >= n and len(prefill.conn.core.producers) >= n
    return {n: statistics.median(s) for n, s in samples.items()}


def traced_memory(role: str, n: int) -> int:
    """Python memory (tracemalloc) held by one side with ``n`` live requests, after a step."""
    gc.collect()
    tracemalloc.start()
    side = Side(role, n)
    side.step(CHANGES)
    gc.collect()
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del side
    return size


def measure(quick: bool) -> dict[str, Any]:
    steps = 100 if quick else 300
    rows = []
    fixed = step_costs(SIZES, CHANGES, steps)
    for n in SIZES:
        one_pct = step_costs((n,), max(1, n // 100), max(20, steps // 10), block=max(20, steps // 10))[n]
        rows.append({"live": n, "step_us": fixed[n], "step_us_1pct": one_pct,
                     "us_per_change_1pct": one_pct / (2 * max(1, n // 100))})
    for r in rows:
        for role in ("decode", "prefill"):
            r[f"mib_{role}"] = traced_memory(role, int(r["live"])) / 2**20
    first, last = rows[0], rows[-1]
    mem = {role: (last[f"mib_{role}"] - first[f"mib_{role}"]) * 2**20 / (last["live"] - first["live"])
           for role in ("decode", "prefill")}
    by = {r["live"]: r for r in rows}
    return {
        "step_us_1k": round(by[1_000]["step_us"], 1),
        "step_us_10k": round(by[10_000]["step_us"], 1),
        "step_us_100k": round(by[100_000]["step_us"], 1),
        "growth_100k_over_1k": round(by[100_000]["step_us"] / by[1_000]["step_us"], 3),
        "changes_per_step": CHANGES,
        "bytes_per_live_request": round(max(mem.values())),
        "bytes_per_live_request_decode": round(mem["decode"]),
        "bytes_per_live_request_prefill": round(mem["prefill"]),
        "rows": [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in rows],
    }


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    live = [r["live"] for r in result["rows"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(live, [r["step_us"] for r in result["rows"]], "o-", label=f"{CHANGES} changing per step")
    a.plot(live, [r["us_per_change_1pct"] * 2 * CHANGES for r in result["rows"]], "s--",
           label=f"1% changing, per {2 * CHANGES} changes")
    a.set(xscale="log", xlabel="live requests per side", ylabel="µs per step (both sides)",
          title="scheduler step cost", ylim=(0, None))
    a.legend()
    for role, mark in (("decode", "o-"), ("prefill", "s-")):
        b.plot(live, [r[f"mib_{role}"] for r in result["rows"]], mark,
               label=f"{role}: {result[f'bytes_per_live_request_{role}']} B per live request")
    b.plot(live, [n * 2048 / 2**20 for n in live], "r:", label="goal: 2048 B per live request")
    b.set(xscale="log", yscale="log", xlabel="live requests per side", ylabel="MiB (tracemalloc)",
          title="memory against live requests")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--plot", metavar="PNG", help="draw step cost and memory against live requests")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = measure(args.quick)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'live per side':>14} {'step µs (' + str(CHANGES) + ' change)':>22} {'step µs (1% change)':>20} "
          f"{'µs per change':>14} {'MiB decode':>11} {'MiB prefill':>12}")
    for r in result["rows"]:
        print(f"{r['live']:>14,} {r['step_us']:>22.1f} {r['step_us_1pct']:>20.1f} {r['us_per_change_1pct']:>14.2f} "
              f"{r['mib_decode']:>11.1f} {r['mib_prefill']:>12.1f}")
    print(f"growth 100k/1k: {result['growth_100k_over_1k']:.3f} (goal <= 1.5)")
    print(f"bytes per live request: decode {result['bytes_per_live_request_decode']}, prefill "
          f"{result['bytes_per_live_request_prefill']} (goal <= 2048)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
