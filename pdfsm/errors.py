"""Typed errors. Protocol errors say whose fault they are: ours (local) or the peer's (remote)."""

from __future__ import annotations

from typing import Any

from pdfsm.fsm import Fault

__all__ = [
    "ClockDomainError",
    "CompatibilityMismatch",
    "ConnectorClosed",
    "EngineIdMismatch",
    "EngineSyncError",
    "HandshakeError",
    "InvalidInput",
    "LayoutMismatch",
    "LocalProtocolError",
    "OwnerError",
    "PdfsmError",
    "ProtocolError",
    "RemoteProtocolError",
    "UnsupportedPP",
]


class PdfsmError(Exception):
    """Base of pdfsm's errors."""


class InvalidInput(PdfsmError, ValueError):
    """An argument handed to pdfsm was refused before anything was accepted; names the field and,
    where one entry of a batch was bad (a step's ``reqs_to_recv``), the request it belongs to."""

    def __init__(self, field: str, problem: str, *, request_id: str | None = None) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem
        self.request_id = request_id


class ProtocolError(PdfsmError):
    """An event that is illegal in the state its machine is in. The machine is unchanged."""

    fault: Fault

    def __init__(self, reason: str, *, machine: str, key: Any, state: str, event: Any, seq: int) -> None:
        super().__init__(
            f"{self.fault.value} fault: {machine} {key!r} in {state} refused "
            f"{type(event).__name__} (seq {seq}): {reason}"
        )
        self.reason = reason
        self.machine = machine
        self.key = key
        self.state = state
        self.event = event
        self.seq = seq


class LocalProtocolError(ProtocolError):
    """We did something illegal: the scheduler, an adapter or pdfsm itself misused a machine."""

    fault = Fault.LOCAL


class RemoteProtocolError(ProtocolError):
    """The peer did something illegal: a duplicate, late, forged or malformed message."""

    fault = Fault.REMOTE


class ConnectorClosed(PdfsmError, RuntimeError):
    """The Connector was shut down: nothing is accepted, and nothing reported, after ``shutdown()``."""


class EngineSyncError(PdfsmError, RuntimeError):
    """A collective of the engine-id sync failed on this rank (a rank of the group hung past the
    group's timeout, died, or the group is broken); this rank adopted no id."""

    def __init__(self, step: str, group_rank: int, cause: BaseException) -> None:
        super().__init__(f"engine-id sync failed in its {step} on group rank {group_rank}, no id adopted: "
                         f"{type(cause).__name__}: {cause}")
        self.step = step
        self.group_rank = group_rank


class OwnerError(PdfsmError, RuntimeError):
    """A call from a second thread while another owns the object: a core pumped on two threads at
    once, or a Connector called while another thread is inside one of its methods."""


class ClockDomainError(PdfsmError):
    """A deadline from one clock was about to be compared with another clock's time."""


class HandshakeError(PdfsmError):
    """A handshake reply was refused. Checked in order: compatibility, engine id, layout."""

    remote_fault = True


class CompatibilityMismatch(HandshakeError):
    def __init__(self, expected: str, got: str) -> None:
        super().__init__(f"compatibility hash mismatch: expected {expected!r}, remote has {got!r}")


class EngineIdMismatch(HandshakeError):
    def __init__(self, expected: str, got: str) -> None:
        super().__init__(
            f"remote engine id mismatch: the request names {expected!r}, the remote says {got!r}"
        )
        self.expected = expected
        self.got = got


class LayoutMismatch(HandshakeError):
    """The two engines' TP sizes, block sizes or block counts cannot work together."""


class UnsupportedPP(HandshakeError):
    """The transport cannot serve pp_rank > 0; a local limit, refused before any I/O."""

    remote_fault = False

    def __init__(self, pp_rank: int) -> None:
        super().__init__(
            f"pp_rank {pp_rank} > 0 cannot be served: this transport does not support pipeline "
            "parallelism (set a PP-capable transport or run the producer with PP size 1)"
        )
