"""The transport protocol: what pdfsm needs from a KV-block transfer engine.

A transport moves blocks and notifications; it never decides anything. Every
outcome it observes (a read done or failed, a notification or a heartbeat
arrived, a peer gone) becomes an event submitted to the owning core's log by
the thread that observed it: a transport with worker threads submits from
those threads, one that must be polled (NIXL) submits from :meth:`progress`,
which the owner thread calls every step.

Every method but ``progress`` is called on the owner thread, in the order the
core emitted the commands; a transport is never called from two threads at
once unless it says so (NIXL's agent is not guaranteed thread-safe: SGLang
PR 28897).
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable
from typing import Protocol

import msgspec

from pdfsm.commands import PostRead, StartHandshake
from pdfsm.events import EngineKey, Event, HandshakeReply, RankInfo
from pdfsm.wire import NotifyMessage

__all__ = ["Capabilities", "Clock", "Handshaker", "Submit", "Transport", "TransportError", "XferState", "refuse_pp"]

Submit = Callable[[Event], None]
"""Thread-safe: hand an event to the owning core's log."""

Clock = Callable[[], int]
"""Monotonic nanoseconds, in the owning core's clock domain."""


class XferState(enum.Enum):
    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


class TransportError(RuntimeError):
    """A transport refused an operation (bad peer, unregistered memory, peer gone)."""


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a transport can do; checked before anything is asked of it."""

    name: str
    supports_pp: bool = True
    memory_kinds: frozenset[str] = frozenset({"DRAM"})
    # Blocks in this worker's KV cache (every region has as many; 0: not said). The Connector
    # refuses block ids at or past it up front, instead of a read failing on them later.
    num_blocks: int = 0
    # Every call must come from the thread that bound it (NIXL's agent is not thread-safe): the
    # Connector refuses any other thread up front, before a call could reach the transport.
    thread_bound: bool = False


def new_incarnation() -> str:
    """A fresh token for :attr:`RankInfo.incarnation`: one per transport start, never reused."""
    return secrets.token_hex(8)


def refuse_pp(capabilities: Capabilities, agent: str, pp_rank: int) -> None:
    """Raise if a transport without PP support is asked about a remote rank at ``pp_rank > 0``."""
    if pp_rank > 0 and not capabilities.supports_pp:
        raise TransportError(f"{capabilities.name} transport {agent!r} does not support pipeline parallelism "
                             f"(supports_pp=False): refusing remote pp_rank {pp_rank}")


class Transport(Protocol):
    capabilities: Capabilities

    def bind(self, submit: Submit, clock: Clock) -> None:
        """Where outcomes go and how they are timed; called once, before anything else."""

    def rank_info(self) -> RankInfo:
        """This worker's entry in a handshake reply (agent name, transport metadata, and an
        incarnation drawn afresh each time the transport starts)."""

    def add_peer(self, key: EngineKey, reply: HandshakeReply, attempt: int = 0) -> None:
        """Make every remote rank of a validated reply reachable; raise to refuse. ``attempt`` is
        the handshake attempt the connection belongs to; a ``PeerDisconnected`` about this
        connection carries it (0: not tracked)."""

    def drop_peer(self, key: EngineKey) -> None:
        """Forget a peer's ranks, once no read of ours to them is alive."""

    def post_read(self, cmd: PostRead) -> None:
        """Start a read; raise if it cannot even start. Its outcome comes back as an event."""

    def cancel_read(self, request_id: str, pp_rank: int, tp_rank: int) -> None:
        """Stop a read; it ends as HandleFailed(CANCELLED) once surely stopped, or as done."""

    def send(self, key: EngineKey, tp_rank: int, message: NotifyMessage) -> None:
        """Send a notification or heartbeat to remote rank (key, tp_rank); raise on failure."""

    def progress(self) -> None:
        """Owner thread, every step: poll what must be polled and submit what it found."""

    def stop_reads(self) -> None:
        """End every read still in flight for good, each reported as it ends (``HandleDone`` if it
        had completed, else ``HandleFailed(CANCELLED)``: NIXL's at once, its release being best
        effort; torch's and sim's once the read stopped); sends still work. A Connector's shutdown
        calls it, if the transport has it, before :meth:`close`, so the requests it stops tell
        their producers to release (after ``close`` nothing can be sent)."""

    def close(self) -> None:
        """Release everything; reads still in flight end as failed."""


class Handshaker(Protocol):
    """Fetches remote engines' handshake replies; outcomes come back as HandshakeDone/Failed."""

    def bind(self, submit: Submit, clock: Clock) -> None:
        """Where outcomes go and how they are timed; called once, before anything else."""

    def start(self, cmd: StartHandshake) -> None:
        """Begin one handshake attempt; never blocks the owner thread."""

    def progress(self) -> None:
        """Owner thread, every step: submit whatever finished (threaded handshakers submit themselves)."""

    def close(self) -> None:
        """Stop; attempts in flight are abandoned (their replies would be stale anyway)."""
