"""One engine in its own OS process, for the demo and the soak run.

A prefill or a decode engine: one worker per (pp_rank, tp_rank), each a
:class:`~pdfsm.connector.Connector` over a :class:`~transports.nixl.NixlTransport` (or the
simulated transport) and a paged torch KV cache, all driven by one owner thread (this
process's main loop). The parent (pdfsm.run) plays the router and both schedulers: it sends
operations as JSON lines on stdin and reads results as JSON lines on stdout, marked with
``PDFSM `` because NIXL writes log lines of its own to stdout. Nothing is pickled.

KV layout: each worker registers ``layers`` tensors shaped ``[num_blocks, heads, head_bytes]``
(heads are this rank's share, ``topology.heads_held``: ``heads / tp``, one head when the TP is
larger, or one replicated latent head with MLA), so a
block's heads are contiguous and a TP slice of a block is a contiguous range of heads. The
bytes of request ``seed``, layer ``l``, the request's ``i``-th block and global head ``h`` are
a deterministic function of those four, the same in every process: the decode side recomputes
them and checks every byte it read.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch

from pdfsm.connector import Connector, KVTransferParams
from pdfsm.consumer import S
from pdfsm.engine_messages import (
    HEADS,
    LEASE_MARGIN_S,
    MARK,
    MAX_LINE_BYTES,
    MAX_REASON_CHARS,
    NUM_BLOCKS,
    Abort,
    Finish,
    Forge,
    Load,
    Op,
    OpType,
    Prefill,
    Result,
    Tamper,
    read_lines,
)
from pdfsm.errors import InvalidInput
from pdfsm.events import (
    CONSUMER,
    CoreConfig,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeReply,
    NotificationReceived,
)
from pdfsm.filelog import LogWriteError
from pdfsm.fsm import Fault
from pdfsm.log import EventLog
from pdfsm.topology import heads_held, heads_problem
from pdfsm.wire import Notification

__all__ = ["Engine", "log_name", "main", "request_bytes"]

COMPAT = "pdfsm-demo-model-v1"


_encode = msgspec.json.Encoder().encode
_decode_op = msgspec.json.Decoder(OpType).decode


_EMIT_LOCK = threading.Lock()  # the op reader reports bad lines from its own thread: one line at a time


def emit(result: Result) -> None:
    reason = result.reason
    if len(reason) > MAX_REASON_CHARS:  # it may quote an op's input: the line must stay under the bound
        cut = f"{reason[:MAX_REASON_CHARS]}... ({len(reason) - MAX_REASON_CHARS} more characters)"
        result = msgspec.structs.replace(result, reason=cut)
    line = MARK + _encode(result).decode() + "\n"
    with _EMIT_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


def request_bytes(seed: int, layer: int, blocks: int, heads: int, head_bytes: int) -> torch.Tensor:
    """The KV bytes of a request's layer: ``[blocks, heads, head_bytes]``, the same in every process."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + layer) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randint(0, 256, (blocks, heads, head_bytes), dtype=torch.uint8, generator=gen)


_SAFE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_MAX_NAME_CHARS = 100  # of the id in a directory name: with the rank suffix, far under NAME_MAX (255 bytes)


def log_name(engine_id: str) -> str:
    """``engine_id`` as a file name: itself when short and of letters, digits and ``._-`` only;
    else those characters kept (others as ``_``), cut short, and a digest of the whole id, so a
    log never lands outside its directory nor two ids in one log."""
    safe = "".join(c if c in _SAFE_CHARS else "_" for c in engine_id)
    if safe == engine_id and len(safe) <= _MAX_NAME_CHARS:
        return engine_id
    digest = hashlib.sha256(engine_id.encode(errors="surrogatepass")).hexdigest()[:12]
    return f"{safe[:_MAX_NAME_CHARS]}-{digest}"


class Worker:
    """One (pp_rank, tp_rank): its KV tensors, transport and connector."""

    def __init__(self, args: argparse.Namespace, pp: int, tp: int, log_dir: Path) -> None:
        self.pp, self.tp = pp, tp
        # Every layer on some PP rank, the later ranks taking the remainder (as serving engines split them).
        self.layers = list(range(pp * args.layers // args.pp, (pp + 1) * args.layers // args.pp))
        self.heads = range(1) if args.mla else heads_held(args.tp, tp, args.heads)  # of request_bytes' heads
        self.kv = [torch.zeros(args.num_blocks, len(self.heads), args.head_bytes, dtype=torch.uint8,
                               device=args.kv_device) for _ in self.layers]
        # A restarted engine has a new id: a new log. The id itself is in the segment headers.
        name = f"{log_name(args.engine_id)}-pp{pp}-tp{tp}"
        self.log_dir = log_dir / name
        from pdfsm.filesink import FileSink
        from pdfsm.postmortem import DEMO_WRITER

        # fresh: an earlier run's log here would be refused at our first write (its seqs go on,
        # ours start at 0), after "ready"; refused now, the old log left as it was.
        self.sink = FileSink(self.log_dir, metadata={"engine_id": args.engine_id, "worker": name,
                                                     "writer": DEMO_WRITER}, fresh=True)
        config = CoreConfig(engine_id=args.engine_id, tp_rank=tp, tp_size=args.tp, pp_rank=pp, pp_size=args.pp,
                            mla=args.mla, kv_heads=0 if args.mla else args.heads, compat_hash=args.compat_hash,
                            lease_ns=int(args.lease_s * 1e9),
                            read_timeout_ns=int(args.read_timeout_s * 1e9), policy=args.policy,
                            lease_margin_ns=int(args.lease_margin_s * 1e9))
        self.transport = _transport(args, f"{name}-{os.getpid()}", self.kv, pp, tp, self.layers)
        self.handshaker = _handshaker(args)
        self.conn = Connector(config, self.transport, self.handshaker, log=EventLog(sink=self.sink, window=4096),
                              host=args.host, port=args.port)
        self.tamper = _Tamper(self.conn.core.submit)
        self.transport.bind(self.tamper, time.monotonic_ns)
        if args.drop_notification:
            self.tamper.plan(Tamper(rid=args.drop_notification, kind="drop-notification"))


class _Tamper:
    """Between the transport and the log: applies planned faults to the events it reports. Called
    on the owner thread (NixlTransport reports from ``progress``), so it needs no lock."""

    def __init__(self, submit: Any) -> None:
        self.submit = submit
        self.planned: dict[str, Tamper] = {}
        self.delayed: list[tuple[int, Any]] = []

    def plan(self, op: Tamper) -> None:
        self.planned[op.rid] = op

    def __call__(self, ev: Any) -> None:
        op = self.planned.get(getattr(ev, "request_id", "")) if self.planned else None
        if op is None or not isinstance(ev, HandleDone if op.kind == "fail-read" else NotificationReceived):
            self.submit(ev)
            return
        del self.planned[op.rid]  # the first one only
        if op.kind == "duplicate-notification":
            self.submit(ev)
            self.submit(ev)
        elif op.kind == "delay-notification":
            self.delayed.append((time.monotonic_ns() + int(op.delay_s * 1e9), ev))  # delay_s: at most a day
        elif isinstance(ev, HandleDone):
            self.submit(HandleFailed(source=ev.source, t_ns=ev.t_ns, request_id=ev.request_id, pp_rank=ev.pp_rank,
                                     tp_rank=ev.tp_rank, why=HandleFailure.ERR, detail="injected: read failed"))

    def release_due(self) -> None:
        now = time.monotonic_ns()
        due = [ev for t, ev in self.delayed if t <= now]
        if due:
            self.delayed = [(t, ev) for t, ev in self.delayed if t > now]
            for ev in due:
                self.submit(msgspec.structs.replace(ev, t_ns=now))


def _transport(args: argparse.Namespace, name: str, kv: list[torch.Tensor], pp: int, tp: int,
               layers: list[int]) -> Any:
    from transports.nixl import NixlTransport

    kwargs: dict[str, Any] = {"pp_rank": pp, "tp_rank": tp, "supports_pp": not args.no_pp}
    if args.pp > 1 or args.remote_pp > 1:
        kwargs["layers"] = layers  # a PP rank registers its own layers; reads pair regions by layer
    return NixlTransport(name, kv, **kwargs)


def _handshaker(args: argparse.Namespace) -> Any:
    from pdfsm.sidechannel import SideChannelHandshaker

    return SideChannelHandshaker(args.engine_id)


class Engine:
    """Every worker of one engine, one block pool shared by its ranks (the same block ids on
    every rank, as a serving engine allocates them), and the parent's operations."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdfsm-logs-"))
        self.workers = [Worker(args, pp, tp, self.log_dir) for pp in range(args.pp) for tp in range(args.tp)]
        # Last freed, first reused: a read of blocks after their release sees them overwritten.
        self.free: list[int] = list(range(args.num_blocks))
        self.held: dict[str, tuple[list[int], int, set[int]]] = {}  # rid -> blocks, seed, ranks pending
        self._outcomes: dict[str, list[tuple[str, str]]] = {}
        self.aborts: set[str] = set()
        self.params: dict[str, KVTransferParams] = {}  # what each held consumer request reads
        self.early_frees = 0
        self._next_stats = 0.0
        self.server = None
        if args.role == "prefill":
            from pdfsm.sidechannel import SideChannelServer

            self.server = SideChannelServer(self._reply_for, host=args.host, port=args.port)
            self.server.start()
            port = self.server.port
            for w in self.workers:
                w.conn.port = port
        emit(Result(ev="ready", port=self.server.port if self.server else 0, logs=[str(self.log_dir)]))

    def _reply_for(self, pp_rank: int) -> HandshakeReply:
        """Every TP rank of that PP rank (the side-channel listener thread calls it: rank_info makes
        no NIXL call)."""
        a = self.args
        ranks = tuple(w.transport.rank_info() for w in self.workers if w.pp == pp_rank)
        return HandshakeReply(engine_id=a.reply_engine_id or a.engine_id, compat_hash=a.compat_hash, tp_size=a.tp,
                              pp_size=a.pp, block_size=16, num_blocks=a.num_blocks, mla=a.mla, ranks=ranks,
                              kv_heads=0 if a.mla else a.heads)

    # --- operations from the parent -----------------------------------------------------------

    def prefill(self, op: Prefill) -> None:
        if len(self.free) < op.blocks:
            emit(Result(ev="error", rid=op.rid, refused="pool", reason=f"out of blocks: {len(self.free)} free"))
            return
        if op.rid in self.held:  # the connector would refuse it too, after the bytes were written
            emit(Result(ev="error", rid=op.rid, refused="op", reason="request id already held"))
            return
        blocks = [self.free.pop() for _ in range(op.blocks)]
        a = self.args
        index = torch.tensor(blocks, device=a.kv_device)
        for w in self.workers:
            for k, layer in enumerate(w.layers):
                full = request_bytes(op.seed, layer, op.blocks, 1 if a.mla else a.heads, a.head_bytes)
                mine = full[:, w.heads.start:w.heads.stop]
                w.kv[k].index_copy_(0, index, mine.to(a.kv_device))
        issued = time.time_ns()  # one stamp for every rank's hold: notifications name it exactly
        minted: list[KVTransferParams] = []  # every rank's hold: the params name all of them alike

        def hold(w: Worker) -> None:
            minted.append(w.conn.request_finished(op.rid, blocks, issued_wall_ns=issued))

        if not self._every_rank(op.rid, "hold", blocks, hold):
            return
        params = minted[-1]
        if a.kv_device != "cpu":
            torch.cuda.synchronize()  # the copies are asynchronous; a READ must find them done
        for w in self.workers:  # write-ahead: the hold is in the log before its params leave us
            w.conn.step()
            w.sink.wait_written(5.0)
        self.held[op.rid] = (blocks, op.seed, set(range(len(self.workers))))
        emit(Result(ev="prefilled", rid=op.rid, params=params))

    def _every_rank(self, rid: str, what: str, blocks: list[int], call: Callable[[Worker], object]) -> bool:
        """``call`` on every rank, in order. Each is asked the same, so only the first can refuse
        (``InvalidInput``, having accepted nothing): then ``blocks`` go back to the pool, the
        refusal is an error result, and False says the op ends there."""
        for i, w in enumerate(self.workers):
            try:
                call(w)
            except InvalidInput as exc:
                if i:
                    raise
                self.free.extend(blocks)
                emit(Result(ev="error", rid=rid, refused="op", reason=f"{what} refused: {exc}"))
                return False
        return True

    def load(self, op: Load) -> None:
        if op.rid in self.held:  # one entry per rid: a second would take over the first's books
            emit(Result(ev="error", rid=op.rid, refused="op", reason="request id already held"))
            return
        n = len(op.params.remote_block_ids)  # none: the connector refuses the params
        if len(self.free) < n:
            emit(Result(ev="error", rid=op.rid, refused="pool", reason=f"out of blocks: {len(self.free)} free"))
            return
        blocks = [self.free.pop() for _ in range(n)]
        lease_start = time.monotonic_ns() - int(op.age_s * 1e9)
        if not self._every_rank(op.rid, "load", blocks,
                                lambda w: w.conn.load(op.rid, blocks, op.params, lease_start_ns=lease_start)):
            return
        self.held[op.rid] = (blocks, op.seed, set(range(len(self.workers))))
        self.params[op.rid] = op.params
        if op.abort:
            self.abort(Abort(rid=op.rid))

    def abort(self, op: Abort) -> None:
        """Abort ``op.rid`` now, or mid-read. With its engines connected its reads start in the next
        pump, and a read of a few blocks can complete within that same step: the abort is queued
        behind the load now, so the machine takes it in READING, its reads posted and cancelled.
        Otherwise it waits for the handshake: _abort_due applies it once the machine reads."""
        p = self.params.get(op.rid)
        soon = p is not None and all(w.conn.core.engine_connected((p.remote_engine_id, pp))
                                     for w in self.workers for pp in range(p.remote_pp_size))
        if op.stage == "reading" and not soon:
            self.aborts.add(op.rid)
            return
        if not self._every_rank(op.rid, "abort", [], lambda w: w.conn.abort(op.rid)):
            return

    def tamper(self, op: Tamper) -> None:
        for w in self.workers:
            w.tamper.plan(op)

    def sizes(self) -> dict[str, int]:
        """Entries in every table that grows with requests: all must stay bounded in a long run."""
        out = {"held": len(self.held), "outcomes": len(self._outcomes), "aborts": len(self.aborts),
               "params": len(self.params)}
        for w in self.workers:
            core = w.conn.core
            for name, n in (("consumers", len(core.consumers)), ("producers", len(core.producers)),
                            ("engines", len(core.engines)), ("tombstones", len(core._remembered_order)),
                            ("log_window", len(core.log.window)), ("reads", len(w.transport.reads)),
                            ("tampers", len(w.tamper.planned) + len(w.tamper.delayed))):
                out[name] = out.get(name, 0) + n
        return out

    def _abort_due(self) -> None:
        """Apply each pending abort once every rank's machine reads (or has got past handshaking, or
        the request is gone): an abort applied in READING is mid-read whatever the wire has done,
        since the machine waits for every handle it has not seen stop."""
        for rid in list(self.aborts):
            if rid not in self.held:  # already reported: too late to abort
                self.aborts.discard(rid)
                continue
            # Every rank past handshaking (or finished): a rank aborted while it still handshakes
            # stops without a read, and its producer rank waits out the lease for a notice.
            states = [w.conn.core.consumers[rid].state if rid in w.conn.core.consumers
                      else w.conn.core.remembered(CONSUMER, rid) for w in self.workers]
            if all(s is not None and s not in (S.NEW, S.HANDSHAKING) for s in states):
                self.aborts.discard(rid)
                for w in self.workers:
                    w.conn.abort(rid)

    def forge(self) -> None:
        """A notification for a request the producer never had, sent like a real one."""
        w = self.workers[0]
        core = w.conn.core
        for key in list(core.engines):
            if core.engine_connected(key):
                w.transport.send(key, 0, Notification("never-prefilled", 0, 1))
                return
        emit(Result(ev="error", rid="never-prefilled", reason="no connected producer to forge a notification to"))

    def apply(self, op: Op) -> None:
        if isinstance(op, Prefill):
            self.prefill(op)
        elif isinstance(op, Load):
            self.load(op)
        elif isinstance(op, Abort):
            self.abort(op)
        elif isinstance(op, Tamper):
            self.tamper(op)
        elif isinstance(op, Forge):
            self.forge()

    # --- every step -------------------------------------------------------------------------------

    def step(self) -> None:
        if self.aborts:
            self._abort_due()
        now = time.monotonic()
        if now >= self._next_stats:
            self._next_stats = now + 1.0
            emit(Result(ev="stats", rss=_rss(), live=len(self.held), t_ns=time.monotonic_ns(), sizes=self.sizes()))
        for i, w in enumerate(self.workers):
            if w.tamper.delayed:
                w.tamper.release_due()
            sending, recving = w.conn.get_finished()
            for rid in sending:
                self._ranked(rid, i, w.conn.last.expired)
            last = w.conn.last
            failed = {f.request_id: f for f in last.failed}
            for rid in recving:
                f = failed.get(rid)
                if f is not None and not set(self.held[rid][0]) <= last.invalid_block_ids:
                    emit(Result(ev="error", rid=rid, reason="failed without its blocks reported invalid"))
                outcome = "failed" if f else "aborted" if rid in last.aborted else "received"
                self._ranked(rid, i, outcome=outcome, reason=f"{f.policy}: {f.reason}" if f else "")

    def _ranked(self, rid: str, rank: int, expired: Any = frozenset(), *, outcome: str = "",
                reason: str = "") -> None:
        """One rank finished ``rid``; when every rank has, the engine reports it and frees the blocks."""
        blocks, seed, pending = self.held[rid]
        pending.discard(rank)
        worst = self._outcomes.setdefault(rid, [])
        if outcome:
            worst.append((outcome, reason))
        if rid in expired:  # any rank's lease expiry counts, not only the last rank's (found by a helper)
            worst.append(("expired", ""))
        if pending:
            return
        del self.held[rid]
        self.params.pop(rid, None)
        for w in self.workers:
            w.tamper.planned.pop(rid, None)  # a fault planned for an event that never came
        outcomes = self._outcomes.pop(rid)
        if self.args.role == "prefill":
            emit(Result(ev="released", rid=rid, expired=("expired", "") in outcomes, t_ns=time.monotonic_ns()))
        else:
            final = next((o for o in outcomes if o[0] != "received"), ("received", ""))
            verified = final[0] == "received" and self._verify(blocks, seed)
            emit(Result(ev="done", rid=rid, outcome=final[0], reason=final[1], verified=verified,
                        t_ns=time.monotonic_ns()))
            # The transport's own books, not the machine's: a read still live here could write
            # into these blocks after the next request got them.
            self.early_frees += any(key[0] == rid for w in self.workers for key in w.transport.reads)
        self.free.extend(blocks)

    def _verify(self, blocks: list[int], seed: int) -> bool:
        """Every byte this engine's ranks read, against what the producer wrote."""
        a, index = self.args, torch.tensor(blocks, device=self.args.kv_device)
        if a.kv_device != "cpu":
            torch.cuda.synchronize()  # NIXL wrote the blocks behind the stream's back
        for w in self.workers:
            for k, layer in enumerate(w.layers):
                full = request_bytes(seed, layer, len(blocks), 1 if a.mla else a.heads, a.head_bytes)
                want = full[:, w.heads.start:w.heads.stop]
                if not torch.equal(w.kv[k].index_select(0, index).cpu(), want):
                    return False
        return True

    def _live(self) -> bool:
        """A request machine still open: staged notifications wait out a lease, say."""
        return any(w.conn.core.consumers or w.conn.core.producers for w in self.workers)

    def finish(self, op: Finish) -> None:
        deadline = time.monotonic() + op.grace_s
        settle = time.monotonic() + min(0.2, op.grace_s)  # what peers sent just before is polled in too
        while (self.held or self._live() or time.monotonic() < settle) and time.monotonic() < deadline:
            self.step()
            time.sleep(0.001)
        local = remote = 0
        for w in self.workers:
            local += w.conn.core.rejections[Fault.LOCAL]
            remote += w.conn.core.violations[Fault.REMOTE]
            w.conn.shutdown()
        if self.server is not None:
            self.server.close()
        distinct = len(set(self.free))  # a block released twice is in the pool twice: count it once
        emit(Result(ev="accounting", free=distinct, total=self.args.num_blocks, in_flight=len(self.held),
                    double_frees=len(self.free) - distinct,
                    local_violations=local, remote_violations=remote, early_frees=self.early_frees,
                    logs=[str(w.log_dir) for w in self.workers]))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _read_ops(out: queue.Queue[OpType | None]) -> None:
    """Ops from stdin until it closes; a line too long or not an op is reported and skipped (this
    thread alone tells the engine its input ended: it must not die on one bad line, and if it
    dies all the same the engine still finishes)."""
    try:
        for line in read_lines(lambda n: os.read(sys.stdin.fileno(), n)):
            if line is None:
                emit(Result(ev="error", reason=f"op line over {MAX_LINE_BYTES} bytes: skipped"))
            elif line.strip():
                try:
                    out.put(_decode_op(line))
                # ValueError: msgspec's DecodeError and ValidationError, UnicodeDecodeError (bad UTF-8
                # in a string); RecursionError: arrays nested too deep.
                except (ValueError, RecursionError) as exc:
                    emit(Result(ev="error", reason=f"bad op line: {exc}"))
    finally:
        out.put(None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--reply-engine-id", default="", help="fault: the listener answers with this engine id")
    p.add_argument("--compat-hash", default=COMPAT)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--remote-pp", type=int, default=1)
    p.add_argument("--no-pp", action="store_true", help="the transport cannot serve pp_rank > 0")
    p.add_argument("--mla", action="store_true")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=HEADS,
                   help="the model's KV heads, shared out over the TP ranks (more ranks than heads hold copies)")
    p.add_argument("--head-bytes", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=NUM_BLOCKS)
    p.add_argument("--policy", choices=("recompute", "fail"), default="recompute")
    p.add_argument("--lease-s", type=float, default=30.0)
    p.add_argument("--lease-margin-s", type=float, default=LEASE_MARGIN_S)
    p.add_argument("--read-timeout-s", type=float, default=10.0)
    p.add_argument("--drop-notification", default="", help="fault: lose the first notification for this id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--log-dir", default="")
    p.add_argument("--kv-device", default="cpu", help="where the KV caches live: cpu (NIXL DRAM) or cuda[:N] (VRAM)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kv_device != "cpu" and not (args.kv_device.startswith("cuda") and torch.cuda.is_available()):
        print(f"--kv-device {args.kv_device}: not available here (torch sees "
              f"{torch.cuda.device_count()} CUDA devices); use cpu", file=sys.stderr)
        return 2
    problem = None if args.mla else heads_problem(args.tp, args.heads)
    if problem:  # a remainder would be cut off; 0 heads move nothing
        print(f"--heads {args.heads} --tp {args.tp}: {problem} (or --mla: one latent head on every rank)",
              file=sys.stderr)
        return 2
    import logging

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    logging.getLogger("nixl").setLevel(logging.WARNING)
    try:
        engine = Engine(args)
    except LogWriteError as exc:  # an earlier run's log, or one being written: before "ready", nothing touched
        print(f"--log-dir {args.log_dir}: cannot log there: {exc}", file=sys.stderr)
        return 2
    ops: queue.Queue[OpType | None] = queue.Queue()
    threading.Thread(target=_read_ops, args=(ops,), daemon=True).start()
    while True:
        try:
            op = ops.get(timeout=0.0005)
        except queue.Empty:
            engine.step()
            continue
        while op is not None:  # every op already queued, then one step: a burst costs one step
            if isinstance(op, Finish):
                engine.finish(op)
                return 0
            engine.apply(op)
            try:
                op = ops.get_nowait()
            except queue.Empty:
                break
        if op is None:  # the parent closed our input: finish as if asked
            engine.finish(Finish())
            return 0
        engine.step()

if __name__ == "__main__":
    sys.exit(main())
