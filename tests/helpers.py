"""Small builders shared by the tests: a core, events with defaults, a connected engine."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from pdfsm.commands import HandOff, SendNotification
from pdfsm.connector import Connector, KVTransferParams
from pdfsm.core import Core
from pdfsm.events import (
    AbortRequested,
    Collect,
    CoreConfig,
    Event,
    HandleDone,
    HandshakeDone,
    HandshakeFailed,
    HandshakeReply,
    PeerAdded,
    RankInfo,
    ReadRequested,
    Tick,
)
from pdfsm.log import EventLog, MemorySink
from transports.sim import SimHandshaker, SimNetwork, SimTransport, pattern

E = TypeVar("E", bound=Event)

ROOT = Path(__file__).resolve().parent.parent


def child_env(first: Path = ROOT, **extra: str) -> dict[str, str]:
    """This process's environment for a child Python, ``first`` ahead on its path: prepended to
    PYTHONPATH, never replacing it (an install with ``pip --target`` is found through it)."""
    path = os.pathsep.join(p for p in (str(first), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **extra, "PYTHONPATH": path}


def make_core(*, strict: bool = True, sink: MemorySink | None = None, **config: Any) -> Core:
    cfg = {"engine_id": "D", "compat_hash": "h", "strict": strict, **config}
    return Core(CoreConfig(**cfg), EventLog(sink=sink) if sink is not None else None)


def ev(cls: type[E], t: int = 0, source: str = "test", **fields: Any) -> E:
    return cls(source=source, t_ns=t, **fields)


def reply(engine_id: str = "P", *, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1, compat_hash: str = "h",
          ranks: tuple[RankInfo, ...] | None = None, **kw: Any) -> HandshakeReply:
    if ranks is None:
        ranks = tuple(RankInfo(pp_rank=pp_rank, tp_rank=t, agent=f"{engine_id}-{pp_rank}-{t}") for t in range(tp_size))
    return HandshakeReply(engine_id=engine_id, compat_hash=compat_hash, tp_size=tp_size, pp_size=pp_size,
                          ranks=ranks, **kw)


def read(rid: str, *, remote: str | None = None, engine: str = "P", blocks: tuple[int, ...] = (1, 2),
         remote_blocks: tuple[int, ...] | None = None, t: int = 0, **kw: Any) -> ReadRequested:
    return ev(ReadRequested, t, request_id=rid, remote_request_id=remote or f"p-{rid}", engine_id=engine,
              local_blocks=blocks, remote_blocks=remote_blocks if remote_blocks is not None else blocks, **kw)


def handshake(core: Core, engine: str = "P", *, pp_rank: int = 0, tp_size: int = 1, attempt: int = 1,
              t: int = 0) -> None:
    """Complete a pending handshake with a valid reply, then the transport adds the peer."""
    core.apply(ev(HandshakeDone, t, engine_id=engine, pp_rank=pp_rank, attempt=attempt,
                  reply=reply(engine, tp_size=tp_size, pp_rank=pp_rank, mla=core.config.mla,
                              kv_heads=core.config.kv_heads, block_size=core.config.block_size)))
    core.apply(ev(PeerAdded, t, engine_id=engine, pp_rank=pp_rank, attempt=attempt))


def connected(core: Core, engine: str = "P", *, remote_tp: int = 1) -> Core:
    """Connect ``engine`` by running one request through it to the end."""
    core.apply(read("warm-up", engine=engine, remote_tp=remote_tp))
    handshake(core, engine, tp_size=remote_tp)
    plan = core.plan(remote_tp, 1)
    for src in plan.sources:
        core.apply(ev(HandleDone, request_id="warm-up", pp_rank=src.pp_rank, tp_rank=src.tp_rank))
    core.apply(ev(Collect, step=0))
    core.take_commands()
    return core


def tick(core: Core, t: int) -> None:
    core.apply(ev(Tick, t))


def collect(core: Core, t: int = 0, step: int = 1) -> list[Any]:
    core.apply(ev(Collect, t, step=step))
    return core.take_commands()


def run_cli(*argv: str) -> int:
    """``pdfsm ...`` in-process. The CLI configures structlog for the process (stderr, its level);
    the test-wide configuration is put back so later tests do not print into a closed capture."""
    import structlog

    from pdfsm.cli import main

    saved = structlog.get_config()
    try:
        return main(list(argv))
    finally:
        structlog.configure(**saved)


def run_cli_captured(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``pdfsm ...`` in-process: exit code, stdout, stderr."""
    code = run_cli(*argv)
    out, err = capsys.readouterr()
    return code, out, err


def write_worker_log(directory: Path, records: Any) -> Path:
    """A worker's log directory holding ``records`` (log records, in order) as its one segment."""
    from pdfsm.filelog import segment_name, write_segment

    directory.mkdir()
    write_segment(directory / segment_name(0), records, salt=bytes(8), meta={}, wall_ns=0,
                  mono_ns=0)
    return directory


def stop_while_handshaking(core: Core, how: str) -> list[Any]:
    """Stop request "r", waiting on PP stage 1 of engine P: that stage's handshake fails
    (``how`` ends with "handshake-fails"), an abort, or its deadline (a Tick at 2 us); the
    commands that came of it, a collect included."""
    if how.endswith("handshake-fails"):
        core.apply(ev(HandshakeFailed, 10, engine_id="P", pp_rank=1, attempt=1, error="connection refused"))
    elif how == "abort":
        core.apply(ev(AbortRequested, 10, request_id="r"))
    else:
        core.apply(ev(Tick, 2_000))
    return core.take_commands() + collect(core, 3_000)


def notes(cmds: list[Any]) -> list[tuple[int, int, str]]:
    """(pp_rank, tp_rank, request id) of each notification among ``cmds``, in order."""
    return [(c.pp_rank, c.tp_rank, c.notification.request_id) for c in cmds if isinstance(c, SendNotification)]


class SimPair:
    """One producer and one consumer Connector over a simulated network, on a shared clock; the
    producer can be restarted (a new agent, the same engine id, host and port)."""

    def __init__(self, *, d_config: dict[str, Any] | None = None, p_lease_ns: int = 120_000_000_000,
                 d_transport: type[SimTransport] = SimTransport) -> None:
        self.net, self.now = SimNetwork(), 0
        self.p_lease_ns = p_lease_ns
        self.prod = SimTransport(self.net, "P-0")
        self.prod.fill(range(64))
        self.p = self._producer(self.prod)
        self.cons = d_transport(self.net, "D-0")
        self.invalid: dict[str, set[int]] = {}  # per consumer request, as reported in the same step
        self.d = Connector(CoreConfig(engine_id="D", compat_hash="h", **(d_config or {})), self.cons,
                           SimHandshaker(self.net), clock=self.clock)

    def _producer(self, t: SimTransport) -> Connector:
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(t.rank_info(),), num_blocks=t.num_blocks))
        return Connector(CoreConfig(engine_id="P", compat_hash="h", lease_ns=self.p_lease_ns), t,
                         SimHandshaker(self.net), clock=self.clock, port=9)

    def restart_producer(self, agent: str) -> None:
        """The producer process dies and comes back under the same engine id, host and port."""
        self.net.kill(self.prod.agent)
        self.prod = SimTransport(self.net, agent)
        self.prod.fill(range(64))
        self.p = self._producer(self.prod)

    def clock(self) -> int:
        return self.now

    def run(self, steps: int = 6) -> tuple[list[str], list[str], list[HandOff]]:
        """Step both sides (the clock 1 us per step): what the consumer reported (all outcomes),
        what the producer released, and the consumer's failed hand-offs, in order."""
        recv: list[str] = []
        sent: list[str] = []
        failed: list[HandOff] = []
        for _ in range(steps):
            self.now += 1_000
            got = self.d.get_finished()[1]
            recv += sorted(got)
            for off in self.d.last.failed:
                self.invalid[off.request_id] = set(off.invalid_blocks)
            for rid in got - {off.request_id for off in self.d.last.failed}:
                self.invalid[rid] = set(self.d.get_block_ids_with_load_errors()) if len(got) == 1 else set()
            failed += self.d.last.failed
            sent += sorted(self.p.get_finished()[0])
        return recv, sent, failed


S = 1_000_000_000  # one second in ns
LEASE_BLOCK = 64  # bytes per simulated block of LeaseWorld


class LeaseWorld:
    """A producer and a decode worker over one simulated network. ``now`` is the true time; each
    side reads it through its own clock (``d_skew``: how far the decode worker's CLOCK_MONOTONIC
    lags the true time, as on a node that booted later)."""

    def __init__(self, *, p_lease_ns: int = 4 * S, d_skew: int = 0, start: int = 20 * S, num_blocks: int = 64,
                 d_config: dict[str, Any] | None = None, p_config: dict[str, Any] | None = None,
                 d_log: EventLog | None = None) -> None:
        self.net, self.now, self.d_skew = SimNetwork(), start, d_skew
        self.prod = SimTransport(self.net, "P-0", num_blocks=num_blocks, block_bytes=LEASE_BLOCK)
        self.prod.fill(range(num_blocks))
        p_cfg = CoreConfig(engine_id="P", compat_hash="h", lease_ns=p_lease_ns, **(p_config or {}))
        self.p = Connector(p_cfg, self.prod, SimHandshaker(self.net), clock=lambda: self.now,
                           wall_clock=lambda: self.now, port=9)
        prod = self.prod
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(prod.rank_info(),)))
        self.cons = SimTransport(self.net, "D-0", num_blocks=num_blocks, block_bytes=LEASE_BLOCK)
        self.d = Connector(CoreConfig(engine_id="D", compat_hash="h", **(d_config or {})), self.cons,
                           SimHandshaker(self.net), clock=lambda: self.now - self.d_skew,
                           wall_clock=lambda: self.now, log=d_log)  # NTP keeps wall clocks together
        self.received: list[str] = []
        self.failed: dict[str, HandOff] = {}
        self.released: list[str] = []
        self.expired: list[str] = []

    def run(self, steps: int = 4, dt: int = 0) -> None:
        """Step both sides ``steps`` times, the true time ``dt`` ns further before each."""
        for _ in range(steps):
            self.now += dt
            got = self.d.get_finished()[1]
            for off in self.d.last.failed:
                self.failed[off.request_id] = off
            self.received += sorted(got - set(self.failed) - self.d.last.aborted)
            self.released += sorted(self.p.get_finished()[0])
            self.expired += sorted(self.p.last.expired)

    def connect(self) -> None:
        """Connect the decode worker to the producer with one request run to the end."""
        self.d.load("warm-up", [63], self.p.request_finished("warm-up", [63]))
        self.run(3)
        assert self.received == ["warm-up"] and self.released == ["warm-up"]
        self.received.clear()
        self.released.clear()

    def reuse(self, blocks: list[int]) -> None:
        """The producer's scheduler hands freed blocks to another request, which overwrites them."""
        for b in blocks:
            self.prod.memory[b * LEASE_BLOCK:(b + 1) * LEASE_BLOCK] = pattern("another-request", b, LEASE_BLOCK)

    def read_bytes_ok(self, local: list[int], remote: list[int]) -> bool:
        return all(self.cons.block(lb) == pattern("P-0", rb, LEASE_BLOCK) for lb, rb in zip(local, remote, strict=True))


def prefix_hit(params: Any, local: Any) -> int:
    """``computed_blocks`` for a load whose local blocks are the prompt's last ones."""
    return len(KVTransferParams.parse(params).remote_block_ids) - len(local)


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``check()`` holds within ``timeout`` seconds (polled): for what another thread
    updates just after the caller has its answer."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def replay_json_schema() -> dict[str, dict[str, str]]:
    """{object: {field: documented type}} from the tables of docs/replay-json.md."""
    out: dict[str, dict[str, str]] = {}
    section = ""
    for line in (Path(__file__).resolve().parents[1] / "docs" / "replay-json.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"\| `(\w+)` \| ([^|]+) \|", line)
        if m and section:
            out.setdefault(section, {})[m[1]] = m[2].strip()
    return out


class RankedEngines:
    """Every producer (pp, tp) worker of engine "P" and every consumer worker of engine "D" as a
    Connector on one SimNetwork (the producer's handshake served at 127.0.0.1:9); ``now`` is
    every worker's clock, monotonic and wall, but producer TP rank ``t``'s wall clock runs
    ``p_wall_ahead[t]`` ns ahead. Block sizes are split by TP (whole under MLA)."""

    def __init__(self, p_tp: int, d_tp: int, *, mla: bool = False, p_pp: int = 1, d_pp: int = 1,
                 block_bytes: int = 240 * 8 * 7, p_config: dict[str, Any] | None = None,
                 d_config: dict[str, Any] | None = None, p_wall_ahead: dict[int, int] | None = None) -> None:
        self.net, self.now = SimNetwork(), 0
        ahead = p_wall_ahead or {}
        self.pt = {(p, t): SimTransport(self.net, f"P{p}.{t}", pp_rank=p, tp_rank=t,
                                        block_bytes=block_bytes // (1 if mla else p_tp))
                   for p in range(p_pp) for t in range(p_tp)}
        for x in self.pt.values():
            x.fill(range(64))
        self.p = {k: Connector(CoreConfig(engine_id="P", tp_rank=k[1], tp_size=p_tp, pp_rank=k[0], pp_size=p_pp,
                                          mla=mla, compat_hash="h", **(p_config or {})),
                               self.pt[k], SimHandshaker(self.net), clock=self.clock,
                               wall_clock=partial(self.wall_clock, ahead.get(k[1], 0)), port=9)
                  for k in self.pt}
        self.net.serve("127.0.0.1", 9, lambda p: reply(
            "P", tp_size=p_tp, pp_size=p_pp, mla=mla, ranks=tuple(self.pt[(p, t)].rank_info() for t in range(p_tp))))
        self.dt = {(p, t): SimTransport(self.net, f"D{p}.{t}", pp_rank=p, tp_rank=t,
                                        block_bytes=block_bytes // (1 if mla else d_tp))
                   for p in range(d_pp) for t in range(d_tp)}
        self.d = {k: Connector(CoreConfig(engine_id="D", tp_rank=k[1], tp_size=d_tp, pp_rank=k[0], pp_size=d_pp,
                                          mla=mla, compat_hash="h", **{"lease_margin_ns": 100, **(d_config or {})}),
                               self.dt[k], SimHandshaker(self.net), clock=self.clock, wall_clock=self.clock)
                  for k in self.dt}

    def clock(self) -> int:
        return self.now

    def wall_clock(self, ahead: int) -> int:
        return self.now + ahead
