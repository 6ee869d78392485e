"""Transports for pdfsm: real NIXL, in-process torch, and a deterministic simulation."""

from transports.base import (
    Capabilities,
    Clock,
    Handshaker,
    Submit,
    Transport,
    TransportError,
    XferState,
)

__all__ = ["Capabilities", "Clock", "Handshaker", "Submit", "Transport", "TransportError", "XferState"]
