"""Found by review: NIXL transport under churn (peers added and dropped, reads cancelled, closed,
peers killed, calls from other threads). Each test failed before its fix.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any

import pytest
from test_nixl_transport import stuck
from transport_helpers import LOOPBACK, listening_addresses, random_kv, zero_kv

from pdfsm.commands import PostRead
from pdfsm.events import Event, HandshakeReply
from pdfsm.topology import ReadSource
from pdfsm.wire import Notification
from transports.base import TransportError
from transports.nixl import NixlTransport, nixl_available

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

if nixl_available():
    logging.getLogger("nixl").setLevel(logging.WARNING)

_names = itertools.count()


def name(prefix: str) -> str:
    return f"r14{prefix}-{os.getpid()}-{next(_names)}"


def reply_of(t: NixlTransport, engine: str = "P") -> HandshakeReply:
    return HandshakeReply(engine_id=engine, compat_hash="", tp_size=1, ranks=(t.rank_info(),))


def read(rid: str, engine: str = "P", local: tuple[int, ...] = (0, 1), remote: tuple[int, ...] = (4, 5)) -> PostRead:
    return PostRead(rid, engine, ReadSource(0, 0), local, remote, Notification(f"p-{rid}", 0, 1))


def test_fresh_reply_refused_because_of_another_agents_draining_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop rule refuses re-adding an *agent* that is still draining (module docstring,
    docs/transports.md "Drop rule"), and add_peer says "a fresh reply for a connected engine
    replaces it". Here engine P's old connection (agent A) drains a slow read; P was re-added
    with agent B (the documented drop-then-add flow); a fresh reply for P naming B again (B has
    no read, is not draining) must replace B's connection. Instead add_peer drops B's live
    connection first and then refuses because *some* connection of key P (A's) is draining:
    the call raises, yet P has lost its live connection (nothing can be read from it), and it
    keeps being refused for as long as A drains (under cancel_policy "wait", as long as A's
    peer hangs)."""
    pa = NixlTransport(name("pa"), random_kv(2, 16, 256, seed=1))
    pb = NixlTransport(name("pb"), random_kv(2, 16, 256, seed=2))
    d = NixlTransport(name("d"), zero_kv(2, 16, 256))
    events: list[Event] = []
    for t in (pa, pb, d):
        t.bind(events.append if t is d else (lambda ev: None), time.monotonic_ns)
    try:
        key = ("P", 0)
        d.add_peer(key, reply_of(pa), 1)
        unstick = stuck(d.agent, monkeypatch)
        d.post_read(read("slow"))  # A's READ is still running
        d.drop_peer(key)  # A drains
        d.add_peer(key, reply_of(pb), 2)  # P comes back with agent B: accepted
        assert d.peers[key][0].agent == pb.agent_name
        refused = None
        try:
            d.add_peer(key, reply_of(pb), 3)  # a fresh reply for the connected engine: B again
        except TransportError as exc:
            refused = exc
        live = d.peers.get(key, {}).get(0)
        assert refused is None, f"refused ({refused}); P's connection afterwards: {live and live.agent}"
        assert live is not None and live.agent == pb.agent_name and live.attempt == 3
        unstick()
    finally:
        monkeypatch.undo()
        d.close()
        pa.close()
        pb.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs Linux /proc")
def test_transports_built_on_two_threads_both_listen_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """ucx_devices="lo" (the default) must hold for every transport, whichever thread builds it.
    _ucx_env (transports/nixl.py) sets the process-wide UCX_NET_DEVICES around backend
    creation and pops it afterwards, with no lock, and treats a variable it finds as the user's.
    Two transports built at once on two threads (each thread then owns its transport, as the
    threading rule allows): the second finds the first one's temporary "lo", leaves it alone,
    and the first pops it before the second's UCX backend reads it, so the second listens on
    every interface. The interleaving is forced here by pausing inside create_backend (the
    window is the whole backend creation, tens of milliseconds)."""
    api = __import__("transports.nixl", fromlist=["import_nixl"]).import_nixl()
    real = api.nixl_agent.create_backend
    first_created, second_inside, first_built = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str | None] = {}

    def create_backend(self: Any, backend: str, init: dict[str, str] | None = None) -> Any:
        if threading.current_thread().name == "second":
            second_inside.set()  # past _ucx_env, which found the first one's "lo"
            first_built.wait(10)  # the first transport is built: its _ucx_env popped the variable
            seen["second"] = os.environ.get("UCX_NET_DEVICES")  # what UCX reads as it creates the backend
            return real(self, backend, init or {})
        out = real(self, backend, init or {})
        first_created.set()
        second_inside.wait(10)
        return out

    monkeypatch.setattr(api.nixl_agent, "create_backend", create_backend)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    built: dict[str, NixlTransport] = {}
    before = set(listening_addresses())

    def build(tag: str) -> None:
        if tag == "second":
            first_created.wait(10)
        built[tag] = NixlTransport(name(tag), zero_kv(1, 4, 64))
        if tag == "first":
            first_built.set()

    threads = [threading.Thread(target=build, args=(tag,), name=tag) for tag in ("first", "second")]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    try:
        assert set(built) == {"first", "second"}
        assert seen["second"] == "lo", f"the second backend was created with UCX_NET_DEVICES={seen['second']!r}"
        opened = {addr for inode, addr in listening_addresses().items() if inode not in before}
        assert opened and opened <= LOOPBACK, f"listening on {opened - LOOPBACK} besides loopback"
    finally:
        monkeypatch.undo()
        for t in built.values():
            t.bind(lambda ev: None, time.monotonic_ns)  # this thread closes them
            t.close()
