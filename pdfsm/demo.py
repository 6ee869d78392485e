"""The demo: a prefill engine and a decode engine move KV blocks, then their logs are replayed.

Each engine has one :class:`~pdfsm.connector.Connector` per TP rank (a worker).
The prefill side fills its blocks with deterministic content, finishes each
request under a lease and hands the ``kv_transfer_params`` to the decode side,
which reads them, verifies every byte it read, and reports each request to its
scheduler loop exactly once. At the end both engines' logs are replayed (any
divergence is an error) and summarized.

With ``--log-dir DIR`` every worker writes its event log durably to its own
directory (``DIR/prefill-tp0``, ``DIR/decode-tp0``...) and the final replay reads
those files back, exactly as ``pdfsm replay DIR`` does afterwards. ``--fault``
plants one fault in the simulated network, for a postmortem to find
(docs/postmortem.md): the demo then still has to end with every request in a
defined state, but violations are expected and do not fail it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdfsm.connector import Connector, KVTransferParams
from pdfsm.events import CoreConfig, HandshakeReply
from pdfsm.postmortem import DEMO_WRITER, LoadedLog, clear_demo_logs, load_all, print_replay, verify, worker_log
from pdfsm.replay import summarize
from pdfsm.topology import Layout, read_plan
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern

__all__ = ["add_arguments", "run"]

HOST, PORT = "127.0.0.1", 7100
FAULTS = ("read-error", "read-hang", "drop-notification", "duplicate-notification")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--mla", action="store_true", help="replicated latent KV: read one producer rank")
    parser.add_argument("--blocks", type=int, default=64, help="KV blocks per worker")
    parser.add_argument("--block-bytes", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", help="write each worker's event log durably under this directory, one "
                        "subdirectory per worker, and replay them from the files")
    parser.add_argument("--quiet", action="store_true", help="summaries only, no timelines")
    parser.add_argument("--fault", choices=FAULTS,
                        help="plant one fault on request --fault-request: its read from producer rank 0 ends ERR "
                        "or hangs, or its first notification is dropped or delivered twice")
    parser.add_argument("--fault-request", type=int, default=3, metavar="N", help="the request hit: req-N (3)")
    parser.add_argument("--lease-ms", type=int, default=200, help="producer lease, simulated ms (200)")
    parser.add_argument("--read-timeout-ms", type=int, default=50, help="consumer read timeout, simulated ms (50)")


@dataclass
class _Engine:
    name: str
    tp: int
    workers: list[Connector] = field(default_factory=list)
    transports: list[SimTransport] = field(default_factory=list)


class _Clock:
    """The simulated clock every worker shares: 1 ms a scheduler step, and 1 us more each time it
    is read, so every event gets its own timestamp in the order it happened and the prefill and
    decode logs interleave correctly when a request is followed across them."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        self.now += 1_000
        return self.now

    def step(self) -> None:
        self.now = (self.now // 1_000_000 + 1) * 1_000_000


def _engine(net: SimNetwork, name: str, tp: int, args: argparse.Namespace, clock: _Clock, port: int) -> _Engine:
    eng = _Engine(name, tp)
    for rank in range(tp):
        worker = f"{name}-tp{rank}"
        t = SimTransport(net, worker, tp_rank=rank, num_blocks=args.blocks,
                         block_bytes=args.block_bytes // (tp if not args.mla else 1))
        # Demo-scale times (the simulated clock moves 1 ms a step) so a planted fault resolves in the run.
        cfg = CoreConfig(engine_id=name, tp_rank=rank, tp_size=tp, mla=args.mla, compat_hash="demo-model-v1",
                         lease_ns=args.lease_ms * 1_000_000, read_timeout_ns=args.read_timeout_ms * 1_000_000,
                         lease_margin_ns=min(10_000_000, args.lease_ms * 100_000))
        log = None if args.log_dir is None else worker_log(args.log_dir, worker, writer=DEMO_WRITER, engine_id=name,
                                                           tp_rank=rank, tp_size=tp, fault=args.fault or "")
        eng.transports.append(t)
        eng.workers.append(Connector(cfg, t, SimHandshaker(net), log=log, clock=clock, host=HOST,
                                     port=port))
    return eng


def _plant(net: SimNetwork, fault: str, n: int) -> None:
    """One fault on request ``req-<n>`` (decode id ``d-req-<n>``); keys as the sim transport expects."""
    if fault in ("read-error", "read-hang"):
        net.script(f"d-req-{n}", 0, 0, ReadScript(polls=1, end="err" if fault == "read-error" else "hang"))
    else:
        net.fault_notification(f"req-{n}", "drop" if fault == "drop-notification" else "duplicate")


def _logs(engines: tuple[_Engine, ...], log_dir: str | None) -> list[LoadedLog]:
    """Every worker's log, read back from its files when they were written (and replayed)."""
    if log_dir is not None:
        return load_all([str(Path(log_dir) / f"{e.name}-tp{rank}") for e in engines for rank in range(e.tp)])
    return [verify(LoadedLog(f"{e.name}-tp{rank}", "(memory)", w.core.log.records()))
            for e in engines for rank, w in enumerate(e.workers)]


def _expected(d_rank: int, args: argparse.Namespace, prefill: _Engine, decode: _Engine,
              local: int, remote: int) -> bytes:
    """What decode rank ``d_rank``'s block ``local`` must hold after reading remote block ``remote``."""
    plan = read_plan(Layout(decode.tp, 1, d_rank), Layout(prefill.tp), args.mla)
    size = decode.transports[d_rank].block_bytes
    out = bytearray(size)
    for src in plan.sources:
        p = prefill.transports[src.tp_rank]
        chunk = p.block_bytes // src.remote_slices
        data = pattern(p.agent, remote, p.block_bytes)[src.remote_slice * chunk:(src.remote_slice + 1) * chunk]
        at = src.local_slice * (size // src.local_slices)
        out[at:at + len(data)] = data
    return bytes(out)


def _refusal(args: argparse.Namespace) -> str | None:
    """What in the options could only fail, or silently not do what was asked."""
    from pdfsm.run import UsageError, check_sizes

    try:
        check_sizes(args, ("requests", "prefill_tp", "decode_tp", "blocks", "block_bytes", "lease_ms",
                           "read_timeout_ms"))
    except UsageError as exc:
        return str(exc)
    if not args.mla:  # each rank holds its share of a block's heads: a remainder is cut off, a 0 moves nothing
        for flag, tp in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
            if args.block_bytes % tp:
                return (f"--block-bytes {args.block_bytes}: the {flag[2:-3]} ranks ({flag} {tp}) each hold an equal "
                        f"part of a block, so {tp} must divide it (or --mla: every rank holds whole blocks)")
    if args.fault and not 1 <= args.fault_request <= args.requests:  # requests are numbered from 1
        return f"--fault-request {args.fault_request}: no such request (req-1 to req-{args.requests})"
    return None


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    refused = _refusal(args)
    if refused:
        print(f"demo: {refused}", file=sys.stderr)
        return 2
    if args.log_dir is not None:
        refused = clear_demo_logs(Path(args.log_dir))
        if refused:
            print(f"demo: {refused}", file=sys.stderr)
            return 2
    net, clock = SimNetwork(), _Clock()
    if args.fault:
        _plant(net, args.fault, args.fault_request)
    prefill = _engine(net, "prefill", args.prefill_tp, args, clock, PORT)
    decode = _engine(net, "decode", args.decode_tp, args, clock, 0)
    for t in prefill.transports:
        t.fill(range(args.blocks))
    infos = tuple(t.rank_info() for t in prefill.transports)
    net.serve(HOST, PORT, lambda pp: HandshakeReply(
        engine_id="prefill", compat_hash="demo-model-v1", tp_size=args.prefill_tp, num_blocks=args.blocks,
        mla=args.mla, ranks=infos))

    free_p, free_d = list(range(args.blocks)), list(range(args.blocks))
    reading: dict[str, tuple[KVTransferParams, list[int], set[int]]] = {}  # ranks yet to report
    sending: dict[str, tuple[list[int], set[int]]] = {}
    started = done = failed = bad_bytes = step = moved_at = 0
    moved = (0, 0)  # (requests done, holds outstanding): a change is progress
    failed_requests: dict[str, str] = {}  # request id -> why its read failed
    while done < args.requests or sending:
        step += 1
        clock.step()
        n = rng.randint(1, 4)
        if len(reading) < 4 and started < args.requests and min(len(free_p), len(free_d)) >= n:
            started += 1
            rid = f"req-{started}"
            p_blocks = [free_p.pop(rng.randrange(len(free_p))) for _ in range(n)]
            params = KVTransferParams(remote_tp_size=1, remote_engine_id="", remote_request_id="")
            stamp = time.time_ns()  # the scheduler's one stamp: every rank's hold is the same hold
            for w in prefill.workers:  # every producer rank holds its part of the blocks
                params = w.request_finished(rid, p_blocks, issued_wall_ns=stamp)
            sending[rid] = (p_blocks, set(range(prefill.tp)))
            d_blocks = [free_d.pop(rng.randrange(len(free_d))) for _ in range(n)]
            for w in decode.workers:
                w.load(f"d-{rid}", d_blocks, params)
            reading[f"d-{rid}"] = (params, d_blocks, set(range(decode.tp)))
        for rank, w in enumerate(decode.workers):
            _, recving = w.get_finished()
            lost = {h.request_id: h.reason for h in w.last.failed}
            for rid in recving:
                params, d_blocks, ranks = reading[rid]
                ranks.discard(rank)
                remote = params.remote_block_ids
                if rid in lost:  # reported failed, with its blocks invalid: the scheduler recomputes it
                    failed += 1
                    failed_requests.setdefault(rid, lost[rid])
                else:
                    bad_bytes += sum(decode.transports[rank].block(lb) != _expected(rank, args, prefill, decode,
                                                                                    lb, rb)
                                     for lb, rb in zip(d_blocks, remote, strict=True))
                if not ranks:
                    del reading[rid]
                    free_d.extend(d_blocks)
                    done += 1
        for rank, w in enumerate(prefill.workers):
            finished, _ = w.get_finished()
            for rid in finished:
                p_blocks, ranks = sending[rid]
                ranks.discard(rank)
                if not ranks:
                    del sending[rid]
                    free_p.extend(p_blocks)
        if (done, len(sending)) != moved:
            moved, moved_at = (done, len(sending)), step
        elif step - moved_at > 10_000:  # not a cap on the run's length: --requests may be any number
            print(f"demo: no progress in 10000 steps (step {step}, {done} of {args.requests} requests done)")
            return 1
    print(f"demo: {done - len(failed_requests)} of {done} requests moved from prefill (TP {prefill.tp}) to decode "
          f"(TP {decode.tp}){' with MLA' if args.mla else ''} over the simulated transport in {step} steps, "
          f"{len(failed_requests)} failed (recomputed); blocks with wrong bytes: {bad_bytes}"
          + (f"; fault planted: {args.fault} on req-{args.fault_request}, failed reads: {failed}"
             if args.fault else ""))
    if failed_requests and not args.fault:
        print(f"demo: reads failed with no fault planted: {next(iter(failed_requests.values()))}", file=sys.stderr)
    for eng in (prefill, decode):
        for w in eng.workers:
            w.shutdown()
    logs = _logs((prefill, decode), args.log_dir)
    code = print_replay(logs, timelines=0 if args.quiet else 2)
    stuck = sum(len(summarize(log.records, timelines=False).stuck) for log in logs)
    violations = sum(1 for log in logs for r in log.records if r.fault is not None)
    if args.log_dir is not None:
        print(f"demo: logs in {args.log_dir}; replay them with: pdfsm replay {args.log_dir}")
    unplanned = (violations or failed_requests) and args.fault is None
    clean = code == 0 and bad_bytes == 0 and stuck == 0 and not unplanned
    return 0 if clean else 1
