"""The transport contract (docs/transports.md, transports/base.py), the same scenario run
over the sim, torch and (where installed) NIXL transports. The core was tested mostly on the sim
transport, so a scenario where the transports disagree is a bug in one of them: a sim that is kinder
than production hides core bugs, a production transport that differs from the sim breaks the core.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transport_helpers import random_kv, zero_kv

from pdfsm.commands import PostRead
from pdfsm.events import Event, HandleDone, HandleFailed, HandleFailure, HandshakeReply, PeerDisconnected
from pdfsm.topology import ReadSource
from pdfsm.wire import Notification
from transports.sim import ReadScript, SimNetwork, SimTransport
from transports.torch import TorchNetwork, TorchTransport

try:
    from transports.nixl import NixlTransport, nixl_available
    HAVE_NIXL = nixl_available()
except ImportError:  # pragma: no cover
    HAVE_NIXL = False

if HAVE_NIXL:
    logging.getLogger("nixl").setLevel(logging.WARNING)

_names = itertools.count()
BLOCKS, BLOCK_BYTES = 8, 256
KINDS = ["sim", "torch", pytest.param("nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="NIXL not installed"))]


def name(prefix: str) -> str:
    return f"rvc-{prefix}-{os.getpid()}-{next(_names)}"


def reply(engine: str, *ts: Any) -> HandshakeReply:
    return HandshakeReply(engine_id=engine, compat_hash="", tp_size=1, ranks=tuple(t.rank_info() for t in ts))


def read(rid: str, local: tuple[int, ...] = (0, 1), remote: tuple[int, ...] = (4, 5)) -> PostRead:
    return PostRead(rid, "P", ReadSource(0, 0), local, remote, Notification(f"p-{rid}", 0, 1))


def outcomes(events: list[Event], rid: str | None = None) -> list[Event]:
    return [e for e in events if isinstance(e, (HandleDone, HandleFailed)) and (rid is None or e.request_id == rid)]


def losses(events: list[Event]) -> list[PeerDisconnected]:
    return [e for e in events if isinstance(e, PeerDisconnected)]


class World:
    """One consumer ``d`` and producers made on demand, over one kind of transport. ``gone(p)``
    makes a producer unreachable the way that kind can (sim/torch: kill; NIXL: close its agent)."""

    def __init__(self, kind: str, *, latency_s: float = 0.0) -> None:
        self.kind = kind
        self.net: Any = SimNetwork() if kind == "sim" else TorchNetwork() if kind == "torch" else None
        self.producers: list[Any] = []
        self.events: list[Event] = []
        self.d = self._make("d", zero_kv(1, BLOCKS, BLOCK_BYTES), latency_s=latency_s)
        self.d.bind(self.events.append, time.monotonic_ns)

    def _make(self, prefix: str, kv: list[torch.Tensor], latency_s: float = 0.0) -> Any:
        n = name(prefix)
        if self.kind == "sim":
            t = SimTransport(self.net, n, num_blocks=BLOCKS, block_bytes=BLOCK_BYTES)
            t.memory[:] = kv[0].reshape(-1).numpy().tobytes()
            return t
        if self.kind == "torch":
            return TorchTransport(self.net, n, kv, latency_s=latency_s)
        return NixlTransport(n, kv)

    def producer(self, seed: int) -> Any:
        p = self._make("p", random_kv(1, BLOCKS, BLOCK_BYTES, seed=seed))
        p.bind(lambda ev: None, time.monotonic_ns)
        self.producers.append(p)
        return p

    def gone(self, p: Any) -> None:
        if self.kind == "nixl":
            p.close()
        else:
            self.net.kill(p.agent if self.kind == "sim" else p.agent_name)

    def pump(self, until: Callable[[], bool], timeout: float = 8.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, f"timed out; events so far: {self.events}"
            self.d.progress()
            for p in self.producers:
                if not getattr(p, "_closed", False):
                    p.progress()
            if self.kind == "torch":
                time.sleep(0.001)

    def settle(self, rounds: int = 20) -> None:
        """A few more rounds, so that an event that should not come has had its chance."""
        for _ in range(rounds):
            self.d.progress()
            if self.kind == "torch":
                time.sleep(0.002)

    def close(self) -> None:
        self.d.close()
        for p in self.producers:
            p.close()


# --- a read on a replaced connection must neither report nor mask the live connection's loss ------------


@pytest.mark.parametrize("same_agent", [True, False], ids=["same-agent", "new-agent"])
@pytest.mark.parametrize("kind", ["sim", "torch"])
def test_loss_of_a_replaced_connection_neither_reports_nor_masks_the_live_one(kind: str, same_agent: bool) -> None:
    """docs/transports.md, "An engine is reported gone once ... and only for its current
    connection: a read still running on a connection replaced since ends DISCONNECTED without
    reporting the live one gone". The core's engine table ignores a PeerDisconnected whose attempt
    is not the current one (engine.py ``_stale_loss``) and otherwise never re-handshakes a
    CONNECTED engine: so the loss of the *current* connection must be reported with the current
    attempt, or every later request reuses a dead connection.

    Scenario: engine P connected at attempt 1, read ``old`` in flight, P dropped and re-added at
    attempt 2 (the same agent, or a restarted one), read ``new`` on it; then the agent(s) die.
    Expected (torch does this): ``old`` ends DISCONNECTED silently; ``new`` ends DISCONNECTED with
    one PeerDisconnected(attempt=2)."""
    w = World(kind, latency_s=0.3)
    try:
        p1 = w.producer(seed=1)
        p2 = p1 if same_agent else w.producer(seed=2)
        w.d.add_peer(("P", 0), reply("P", p1), 1)
        if kind == "sim":
            w.net.script("old", 0, 0, ReadScript(polls=3))
            w.net.script("new", 0, 0, ReadScript(polls=3))
        w.d.post_read(read("old"))
        w.d.drop_peer(("P", 0))
        w.d.add_peer(("P", 0), reply("P", p2), 2)
        w.d.post_read(read("new"))
        w.gone(p1)
        if not same_agent:
            w.gone(p2)
        w.pump(lambda: len(outcomes(w.events)) == 2 and bool(losses(w.events)))
        w.settle()
        assert all(isinstance(e, HandleFailed) and e.why is HandleFailure.DISCONNECTED for e in outcomes(w.events))
        assert [e.attempt for e in losses(w.events)] == [2], (
            f"{kind}: expected exactly one PeerDisconnected for the live connection (attempt 2), got "
            f"{[(e.attempt, e.detail) for e in losses(w.events)]}")
    finally:
        w.close()


# --- a producer that shut down is gone, for reads and for sends -------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_producer_that_closed_its_transport_is_gone(kind: str) -> None:
    """A producer engine that shut down (Connector.shutdown -> transport.close()) is gone to its
    consumers. docs/transports.md, post_read: "if the peer is found gone, do not raise: accept the
    read, end it HandleFailed(DISCONNECTED) and submit one PeerDisconnected"; send: "raise on
    failure, after submitting PeerDisconnected if the peer is gone". torch (the closed agent left
    the network) and NIXL (its agent is destroyed) both do that. Expected the same of the sim, the
    transport the core's race tests run on: otherwise a consumer of a stopped producer 'reads'
    blocks nobody serves any more and the engine is never re-handshaken."""
    w = World(kind)
    try:
        p = w.producer(seed=3)
        w.d.add_peer(("P", 0), reply("P", p), 4)
        w.d.post_read(read("a"))
        w.pump(lambda: bool(outcomes(w.events)))
        assert isinstance(outcomes(w.events)[0], HandleDone)
        p.close()
        if kind == "nixl":
            time.sleep(0.2)  # the disconnect reaches the consumer's UCX endpoint
        send_raised = False
        try:
            w.d.send(("P", 0), 0, Notification("hb", 0, 1))
        except Exception:  # noqa: BLE001 - the contract: raise on failure
            send_raised = True
        w.d.post_read(read("b"))
        w.pump(lambda: len(outcomes(w.events)) == 2)
        w.settle()
        ev = outcomes(w.events)[1]
        assert send_raised, f"{kind}: send() to a producer that closed its transport did not raise"
        assert isinstance(ev, HandleFailed) and ev.why is HandleFailure.DISCONNECTED, f"{kind}: {ev}"
        assert [e.attempt for e in losses(w.events)] == [4], losses(w.events)
    finally:
        w.close()


# --- one outcome per read: reposting a key after its first read ended; cancel of nothing -----------------


@pytest.mark.parametrize("kind", KINDS)
def test_same_key_reposted_after_its_read_ended_and_cancels_of_nothing(kind: str) -> None:
    """"One outcome per posted read" (docs/transports.md): the same (request, pp, tp) posted again
    once its first read ended (a retried request) is a new read with its own single outcome and
    the right bytes; cancel_read of an unknown or already-ended read is a no-op (base.py: "Stop a
    read"; the core cancels on deadline races); close() twice is harmless. Passes on all three."""
    w = World(kind)
    try:
        p = w.producer(seed=5)
        w.d.add_peer(("P", 0), reply("P", p))
        w.d.cancel_read("never-posted", 0, 0)
        w.d.post_read(read("r", (0, 1), (4, 5)))
        w.pump(lambda: len(outcomes(w.events)) == 1)
        w.d.cancel_read("r", 0, 0)  # after its end: nothing
        w.d.post_read(read("r", (6, 2), (1, 7)))
        w.pump(lambda: len(outcomes(w.events)) == 2)
        w.settle()
        assert [type(e) for e in outcomes(w.events)] == [HandleDone, HandleDone]
        src = _block_bytes(w, p)
        got = _block_bytes(w, w.d)
        for lb, rb in [(0, 4), (1, 5), (6, 1), (2, 7)]:
            assert got[lb] == src[rb], f"{kind}: local block {lb} is not remote block {rb}"
        w.d.close()
        w.d.close()  # idempotent
        assert len(outcomes(w.events)) == 2
    finally:
        w.close()


def _block_bytes(w: World, t: Any) -> list[bytes]:
    if w.kind == "sim":
        return [t.block(b) for b in range(BLOCKS)]
    return [t.tensors[0][b].numpy().tobytes() for b in range(BLOCKS)]
