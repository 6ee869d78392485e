"""A deterministic, programmable transport: a whole simulated network inside one process.

Nothing here runs on its own. Reads advance, notifications arrive and handshakes
answer only when an agent's :meth:`SimTransport.progress` (or the handshaker's)
is called, in insertion order, so a test decides exactly what happens when, and
the same calls always produce the same events.

What can be programmed, per read (request id, remote pp_rank, remote tp_rank):
spend N polls in PROC, then end DONE, ERR, with the poll raising, or hang until
cancelled (:class:`ReadScript`). Per notification: drop, duplicate, or delay it
by N progress calls of the receiver (reordering it behind later ones). Per
listener: refuse or never answer a handshake. Any agent can be killed: its
peers' reads to it end DISCONNECTED (and, as with NIXL, the engine is reported gone once
with a ``PeerDisconnected``) and sends to it raise.

Memory is a bytearray per agent. A read copies bytes when it completes, so
bytes a producer overwrote before that are what the consumer gets: the race
tester detects premature reuse by verifying content.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from typing import Literal

import msgspec

from pdfsm.commands import PostRead, StartHandshake
from pdfsm.events import (
    EngineKey,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    HandshakeReply,
    PeerDisconnected,
    RankInfo,
    Source,
)
from pdfsm.wire import NotifyMessage, notification_event, notify_codec
from transports.base import Capabilities, Clock, Submit, TransportError, refuse_pp
from transports.coalesce import SliceError, slice_span

__all__ = ["ReadScript", "SimHandshaker", "SimNetwork", "SimTransport", "pattern"]

End = Literal["done", "err", "raise", "hang"]


class ReadScript(msgspec.Struct, frozen=True):
    """How one read behaves: ``polls`` progress calls in PROC, then ``end``."""

    polls: int = 1
    end: End = "done"


class _Layout(msgspec.Struct, frozen=True, array_like=True):
    num_blocks: int
    block_bytes: int


_layout_codec = msgspec.msgpack.Decoder(_Layout)


def pattern(agent: str, block: int, size: int) -> bytes:
    """Deterministic content for a producer block, the same in every process, so a consumer
    can verify what it read."""
    digest = hashlib.blake2b(f"{agent}:{block}".encode(), digest_size=32).digest()
    return (digest * (size // 32 + 1))[:size]


class SimNetwork:
    """The agents, listeners and programmed faults of one simulated world."""

    def __init__(self) -> None:
        self.agents: dict[str, SimTransport] = {}
        self.dead: set[str] = set()
        self.listeners: dict[tuple[str, int], Callable[[int], HandshakeReply]] = {}
        self.handshake_faults: dict[tuple[str, int], Literal["refuse", "hang"]] = {}
        self.handshake_polls = 1
        self.default_read = ReadScript()
        self.read_scripts: dict[tuple[str, int, int], ReadScript] = {}
        self.notify_faults: dict[str, deque[tuple[str, int]]] = {}  # producer request id -> actions
        self.started = 0  # transports started so far: their incarnations, deterministic

    def serve(self, host: str, port: int, reply_for: Callable[[int], HandshakeReply]) -> None:
        """Answer handshakes at (host, port): ``reply_for(pp_rank)`` is the reply."""
        self.listeners[(host, port)] = reply_for

    def script(self, request_id: str, pp_rank: int, tp_rank: int, script: ReadScript) -> None:
        """How the read of consumer request ``request_id`` (the decode side's id, not the
        producer's) from remote rank (``pp_rank``, ``tp_rank``) goes: polls in flight, then its
        end; used by the next read of that key only. Unscripted reads follow ``default_read``."""
        self.read_scripts[(request_id, pp_rank, tp_rank)] = script

    def fault_notification(self, request_id: str, action: Literal["drop", "duplicate", "delay"], n: int = 1) -> None:
        """The next notification for producer request ``request_id`` is dropped, sent twice, or
        delayed by ``n`` progress calls of its receiver."""
        self.notify_faults.setdefault(request_id, deque()).append((action, n))

    def kill(self, agent: str) -> None:
        self.dead.add(agent)

    def revive(self, agent: str) -> None:
        self.dead.discard(agent)

    def reachable(self, name: str, incarnation: str = "") -> SimTransport | None:
        """The live agent ``name``; with ``incarnation``, only while it is still that process."""
        agent = None if name in self.dead else self.agents.get(name)
        return agent if agent is None or incarnation in ("", agent.incarnation) else None

    def deliver(self, sender: str, receiver: str, raw: bytes, request_id: str = "") -> None:
        """Put raw notification bytes in a receiver's inbox, applying any programmed fault."""
        target = self.reachable(receiver)
        if target is None:
            raise TransportError(f"{receiver}: peer unreachable")
        action, n = ("", 0)
        faults = self.notify_faults.get(request_id)
        if faults:
            action, n = faults.popleft()
        if action == "drop":
            return
        delay = n if action == "delay" else 0
        copies = 2 if action == "duplicate" else 1
        for _ in range(copies):
            target.inbox.append([delay, sender, raw])


class _Read:
    __slots__ = ("attempt", "cancelled", "cmd", "local_range", "polls", "remote", "remote_range", "script")

    def __init__(self, cmd: PostRead, remote: str, attempt: int, script: ReadScript,
                 local_range: tuple[int, int], remote_range: tuple[int, int]) -> None:
        self.cmd, self.remote, self.attempt, self.script = cmd, remote, attempt, script
        self.polls = script.polls
        self.cancelled = False
        self.local_range, self.remote_range = local_range, remote_range  # (offset, length) in a block


class SimTransport:
    """One simulated agent: a worker's KV memory and its view of the network."""

    def __init__(
        self,
        network: SimNetwork,
        agent: str,
        *,
        pp_rank: int = 0,
        tp_rank: int = 0,
        num_blocks: int = 64,
        block_bytes: int = 64,
        supports_pp: bool = True,
        started_wall_ns: int = 0,
    ) -> None:
        if agent in network.agents:
            raise ValueError(f"agent {agent!r} already exists")
        if pp_rank > 0 and not supports_pp:  # as the NIXL and torch transports refuse it
            raise ValueError(f"pp_rank {pp_rank} on a transport built with supports_pp=False")
        if num_blocks < 1 or block_bytes < 1:  # a 0-byte block "moved" and verified: nothing was tested
            raise ValueError(f"num_blocks ({num_blocks}) and block_bytes ({block_bytes}) must be >= 1")
        self.network, self.agent = network, agent
        network.started += 1
        self.incarnation = f"sim-{network.started}"
        self.started_wall_ns = started_wall_ns  # deterministic: the test says when (0: not said)
        self.pp_rank, self.tp_rank = pp_rank, tp_rank
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.capabilities = Capabilities(name="sim", supports_pp=supports_pp, memory_kinds=frozenset({"DRAM"}),
                                         num_blocks=num_blocks)
        self.memory = bytearray(num_blocks * block_bytes)
        self.peers: dict[EngineKey, dict[int, str]] = {}
        self.reads: dict[tuple[str, int, int], _Read] = {}
        self.inbox: deque[list[object]] = deque()  # [delay, sender, raw]
        self.sent: list[tuple[str, NotifyMessage]] = []
        self.closed = False
        self._disconnected: set[EngineKey] = set()  # engines already reported gone, until re-added
        self._attempts: dict[EngineKey, int] = {}  # the handshake attempt of each peer's connection
        self._submit: Submit | None = None
        self._clock: Clock = lambda: 0
        network.agents[agent] = self

    # --- memory, for tests and demos ------------------------------------------------------------

    def block(self, b: int) -> bytes:
        return bytes(self.memory[b * self.block_bytes:(b + 1) * self.block_bytes])

    def fill(self, blocks: range | list[int] | tuple[int, ...]) -> None:
        for b in blocks:
            self.memory[b * self.block_bytes:(b + 1) * self.block_bytes] = pattern(self.agent, b, self.block_bytes)

    # --- the protocol ---------------------------------------------------------------------------

    def bind(self, submit: Submit, clock: Clock) -> None:
        self._submit, self._clock = submit, clock

    def _emit(self, ev: object) -> None:
        assert self._submit is not None, "bind() first"
        self._submit(ev)  # type: ignore[arg-type]

    def rank_info(self) -> RankInfo:
        layout = msgspec.msgpack.encode(_Layout(self.num_blocks, self.block_bytes))
        return RankInfo(pp_rank=self.pp_rank, tp_rank=self.tp_rank, agent=self.agent, metadata=layout,
                        incarnation=self.incarnation, started_wall_ns=self.started_wall_ns)

    def add_peer(self, key: EngineKey, reply: HandshakeReply, attempt: int = 0) -> None:
        refuse_pp(self.capabilities, self.agent, key[1])
        ranks: dict[int, str] = {}
        for info in reply.ranks:
            if self.network.reachable(info.agent, info.incarnation) is None:  # gone, or restarted since its reply
                raise TransportError(f"cannot add remote agent {info.agent!r}: unreachable, or restarted "
                                     "since its handshake reply")
            ranks[info.tp_rank] = info.agent
        self.peers[key] = ranks
        self._attempts[key] = attempt
        self._disconnected.discard(key)

    def drop_peer(self, key: EngineKey) -> None:
        self.peers.pop(key, None)
        self._attempts.pop(key, None)
        self._disconnected.discard(key)  # a later loss is of no peer: nothing to report

    def post_read(self, cmd: PostRead) -> None:
        src = cmd.source
        remote = self.peers.get((cmd.engine_id, src.pp_rank), {}).get(src.tp_rank)
        if remote is None:
            raise TransportError(f"no peer for ({cmd.engine_id}, pp {src.pp_rank}, tp {src.tp_rank})")
        peer = self.network.agents[remote]
        if any(not 0 <= b < self.num_blocks for b in cmd.local_blocks):
            raise TransportError(f"local block out of range 0..{self.num_blocks - 1}")
        if any(not 0 <= b < peer.num_blocks for b in cmd.remote_blocks):
            raise TransportError(f"remote block out of range 0..{peer.num_blocks - 1}")
        if len(cmd.local_blocks) != len(cmd.remote_blocks):
            raise TransportError(f"{len(cmd.local_blocks)} local blocks for {len(cmd.remote_blocks)} remote blocks")
        try:  # the same checks as the NIXL and torch transports
            lspan = slice_span(self.block_bytes, src.local_slices, src.local_slice)
            rspan = slice_span(peer.block_bytes, src.remote_slices, src.remote_slice)
        except SliceError as exc:
            raise TransportError(str(exc)) from None
        if rspan[1] != lspan[1]:
            raise TransportError(f"slice sizes differ: remote {rspan[1]} bytes, local {lspan[1]} bytes")
        key = (cmd.request_id, src.pp_rank, src.tp_rank)
        if key in self.reads:
            raise TransportError(f"read {key} is already in flight")
        script = self.network.read_scripts.pop(key, self.network.default_read)
        self.reads[key] = _Read(cmd, remote, self._attempts.get((cmd.engine_id, src.pp_rank), 0), script, lspan, rspan)

    def cancel_read(self, request_id: str, pp_rank: int, tp_rank: int) -> None:
        read = self.reads.get((request_id, pp_rank, tp_rank))
        if read is not None:
            read.cancelled = True

    def send(self, key: EngineKey, tp_rank: int, message: NotifyMessage) -> None:
        if self.closed:
            raise TransportError(f"{self.agent}: closed")
        remote = self.peers.get(key, {}).get(tp_rank)
        if remote is None:
            raise TransportError(f"no peer for ({key[0]}, pp {key[1]}, tp {tp_rank})")
        if remote in self.network.dead:  # as the NIXL and torch transports: the engine reported gone, then raise
            self._lost(key, f"{remote} went away", self._attempts.get(key, 0))
            raise TransportError(f"{remote}: peer unreachable")
        self.network.deliver(self.agent, remote, notify_codec.encode(message), message.request_id)
        self.sent.append((remote, message))

    def _lost(self, engine: EngineKey, detail: str, attempt: int) -> None:
        """As NIXL does: an engine whose agent went away is reported gone once."""
        if engine not in self._disconnected:
            self._disconnected.add(engine)
            self._emit(PeerDisconnected(source=Source.TRANSFER, t_ns=self._clock(), engine_id=engine[0],
                                        pp_rank=engine[1], detail=detail, attempt=attempt))

    def progress(self) -> None:
        now = self._clock()
        for key, read in list(self.reads.items()):
            rid, pp, tp = key
            failure: tuple[HandleFailure, str] | None = None
            if read.cancelled:
                failure = (HandleFailure.CANCELLED, "")
            elif read.remote in self.network.dead:
                failure = (HandleFailure.DISCONNECTED, f"{read.remote} went away")
            elif read.polls > 0 or read.script.end == "hang":
                read.polls -= 1
                continue
            elif read.script.end == "err":
                failure = (HandleFailure.ERR, "transfer reported ERR")
            elif read.script.end == "raise":
                failure = (HandleFailure.RAISED, "polling the transfer raised")
            del self.reads[key]
            if failure is None:
                self._complete(read)
                self._emit(HandleDone(source=Source.TRANSFER, t_ns=now, request_id=rid, pp_rank=pp, tp_rank=tp))
            else:
                self._emit(HandleFailed(source=Source.TRANSFER, t_ns=now, request_id=rid, pp_rank=pp, tp_rank=tp,
                                        why=failure[0], detail=failure[1]))
                engine = (read.cmd.engine_id, pp)
                if failure[0] is HandleFailure.DISCONNECTED and read.attempt == self._attempts.get(engine) \
                        and engine in self.peers:  # a replaced connection's loss says nothing of the current one
                    self._lost(engine, failure[1], read.attempt)
        for _ in range(len(self.inbox)):
            item = self.inbox.popleft()
            delay, sender, raw = item
            assert isinstance(delay, int) and isinstance(sender, str) and isinstance(raw, bytes)
            if delay > 0:
                item[0] = delay - 1
                self.inbox.append(item)
                continue
            self._emit(notification_event(raw, sender=sender, source=Source.NOTIFY, t_ns=now))

    def _complete(self, read: _Read) -> None:
        """Copy the bytes and, only now that they are in place, deliver the notification."""
        peer = self.network.agents[read.remote]
        (loff, length), (roff, _) = read.local_range, read.remote_range
        for lb, rb in zip(read.cmd.local_blocks, read.cmd.remote_blocks, strict=True):
            src = rb * peer.block_bytes + roff
            dst = lb * self.block_bytes + loff
            self.memory[dst:dst + length] = peer.memory[src:src + length]
        note = read.cmd.notification
        self.network.deliver(self.agent, read.remote, notify_codec.encode(note), note.request_id)
        self.sent.append((read.remote, note))

    def stop_reads(self) -> None:
        for rid, pp, tp in list(self.reads):
            self.cancel_read(rid, pp, tp)
        self.progress()

    def close(self) -> None:
        self.stop_reads()
        self.closed = True  # as a NIXL agent destroyed: nothing more goes out
        self.network.kill(self.agent)  # and peers' reads and sends to it fail


class SimHandshaker:
    """Answers handshakes from the network's listeners after ``network.handshake_polls`` calls."""

    def __init__(self, network: SimNetwork) -> None:
        self.network = network
        self.pending: list[list[object]] = []  # [polls left, cmd]
        self._submit: Submit | None = None
        self._clock: Clock = lambda: 0

    def bind(self, submit: Submit, clock: Clock) -> None:
        self._submit, self._clock = submit, clock

    def start(self, cmd: StartHandshake) -> None:
        self.pending.append([self.network.handshake_polls, cmd])

    def progress(self) -> None:
        assert self._submit is not None, "bind() first"
        keep: list[list[object]] = []
        for item in self.pending:
            polls, cmd = item
            assert isinstance(polls, int) and isinstance(cmd, StartHandshake)
            where = (cmd.host, cmd.port)
            fault = self.network.handshake_faults.get(where)
            if polls > 0 or fault == "hang":
                item[0] = polls - 1
                keep.append(item)
                continue
            t, eid, pp, attempt = self._clock(), cmd.engine_id, cmd.pp_rank, cmd.attempt
            reply_for = self.network.listeners.get(where)
            if reply_for is None or fault == "refuse":
                self._submit(HandshakeFailed(source=Source.HANDSHAKE, t_ns=t, engine_id=eid, pp_rank=pp,
                                             attempt=attempt, error=f"connection refused by {cmd.host}:{cmd.port}"))
            else:
                try:
                    reply = reply_for(cmd.pp_rank)
                except Exception as exc:  # noqa: BLE001 - the listener's code: an error answer, as the side channel's
                    # (raising out of progress() kept every pending handshake waiting for its timeout)
                    why = f"reply_for raised {type(exc).__name__}: {exc}"
                    self._submit(HandshakeFailed(source=Source.HANDSHAKE, t_ns=t, engine_id=eid, pp_rank=pp,
                                                 attempt=attempt, error=why))
                    continue
                self._submit(HandshakeDone(source=Source.HANDSHAKE, t_ns=t, engine_id=eid, pp_rank=pp,
                                           attempt=attempt, reply=reply))
        self.pending = keep

    def close(self) -> None:
        self.pending.clear()
