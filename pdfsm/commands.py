"""Commands: what the machines ask the outside world to do.

The core does no I/O. Applying an event may emit commands; the adapter that
owns the transport carries them out on the owner thread and reports every
outcome back as an event (a posted read finishes as :class:`~pdfsm.events.HandleDone`
or :class:`~pdfsm.events.HandleFailed`, a handshake as
:class:`~pdfsm.events.HandshakeDone` or :class:`~pdfsm.events.HandshakeFailed`).

Two commands are for the scheduler rather than the transport:
:class:`HandOff` (a consumer request is finished: received, failed or aborted)
and :class:`FinishedSending` (a producer request's blocks may be freed).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pdfsm.events import HandshakeReply, Policy
from pdfsm.topology import ReadSource
from pdfsm.wire import Notification

__all__ = [
    "AddPeer",
    "CancelRead",
    "Command",
    "DropPeer",
    "FinishedSending",
    "HandOff",
    "PostRead",
    "SendNotification",
    "StartHandshake",
]


class Command(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Base of every command."""


class StartHandshake(Command, frozen=True):
    """Fetch the remote engine's metadata over the side channel (on the handshake thread)."""

    engine_id: str
    pp_rank: int
    attempt: int
    host: str
    port: int


class AddPeer(Command, frozen=True):
    """Register the remote agents of a validated handshake reply with the transport."""

    engine_id: str
    pp_rank: int
    attempt: int
    reply: HandshakeReply


class DropPeer(Command, frozen=True):
    """Forget the remote agents of an engine (disconnected, failed or evicted)."""

    engine_id: str
    pp_rank: int


class PostRead(Command, frozen=True, kw_only=False):
    """Read ``remote_blocks`` of remote rank ``source`` into ``local_blocks``.

    ``source`` also says which slice of each block moves when TP sizes differ
    (see :mod:`pdfsm.topology`). ``notification`` is delivered to the remote
    rank by the transport only once the read has completed (NIXL PR 252).
    Positional fields: one is built for every read, on the hot path.
    """

    request_id: str
    engine_id: str
    source: ReadSource
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    notification: Notification


class CancelRead(Command, frozen=True):
    """Stop the read from rank (pp_rank, tp_rank); the outcome still comes back as an event."""

    request_id: str
    pp_rank: int
    tp_rank: int


class SendNotification(Command, frozen=True):
    """Send a plain notification (no read) to remote rank (pp_rank, tp_rank)."""

    engine_id: str
    pp_rank: int
    tp_rank: int
    notification: Notification


class HandOff(Command, frozen=True):
    """A consumer request goes back to the scheduler, exactly once.

    ``outcome`` is ``"received"``, ``"failed"`` or ``"aborted"``. For a failed
    request, ``invalid_blocks`` are the local blocks that must not be trusted
    and ``policy`` says what the scheduler does about it.
    """

    request_id: str
    outcome: Literal["received", "failed", "aborted"]
    invalid_blocks: tuple[int, ...] = ()
    policy: Policy = "recompute"
    reason: str = ""


class FinishedSending(Command, frozen=True):
    """A producer request's blocks may be freed: every consumer read them, or the lease expired."""

    request_id: str
    block_ids: tuple[int, ...]
    expired: bool = False
