"""Concrete promises of the docs (docs/embedding.md, docs/side-channel.md,
docs/engine-id-sync.md, docs/race-testing.md) and of the docstrings they name, checked against
the code. Each test quotes the claim it checks; a failing test is a mismatch (code or doc)."""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import structlog
from helpers import eventually

from pdfsm.connector import Connector
from pdfsm.errors import InvalidInput
from pdfsm.events import CoreConfig, HandshakeReply, RankInfo
from pdfsm.sidechannel import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    ReplyMessage,
    SideChannelError,
    SideChannelServer,
    check_reply,
    fetch_reply,
    pack_frame,
    request_codec,
    response_codec,
)
from pdfsm.wire import WireError
from transports.sim import SimHandshaker, SimNetwork, SimTransport

ROOT = Path(__file__).resolve().parents[1]




def _reply(pp_rank: int = 0, **kw: object) -> HandshakeReply:
    fields: dict[str, object] = {"engine_id": "P", "compat_hash": "h", "tp_size": 1, "block_size": 16,
                                 "num_blocks": 64}
    fields.update(kw)
    return HandshakeReply(ranks=(RankInfo(pp_rank=pp_rank, tp_rank=0, agent="P-0", metadata=b"m"),),
                          **fields)  # type: ignore[arg-type]


# --- docs/race-testing.md ---------------------------------------------------------------------------------


def test_exhaust_refuses_a_prefix_step_that_is_not_enabled() -> None:
    """docs/race-testing.md: "`Scenario` sets the shape (... a seed `prefix` of named steps, each
    made before the search starts: a step that is not enabled then is a `ValueError`, so a misspelt
    seed is never silently skipped)". `exhaust(scenario, ...)` is one of the two documented
    searches; it builds its worlds without ever looking at ``Scenario.prefix``, so a misspelt seed
    (and a correct one too) is silently ignored and the search starts from the root."""
    from pdfsm.testing import Scenario, exhaust

    typo = Scenario(requests=1, faults=frozenset(), prefix=("prefill: p0 finishes prefil",))
    with pytest.raises(ValueError, match="not enabled"):
        exhaust(typo, depth=2)


def test_all_options_tracks_as_many_options_as_documented() -> None:
    """docs/race-testing.md: "`all_options()` lists what is tracked (124 options)"."""
    from pdfsm.testing.coverage import all_options

    documented = int(re.search(r"lists what is tracked \((\d+) options\)",
                               (ROOT / "docs" / "race-testing.md").read_text())[1])  # type: ignore[index]
    assert len(all_options()) == documented


# --- docs/embedding.md: the CoreConfig checked when the Connector is built --------------------------------


def _build(**fields: object) -> Connector:
    net = SimNetwork()
    return Connector(CoreConfig(engine_id="P", **fields), SimTransport(net, "P-0"),  # type: ignore[arg-type]
                     SimHandshaker(net))


def test_a_block_size_the_handshake_cannot_carry_is_refused_when_the_connector_is_built() -> None:
    """docs/embedding.md: "The `CoreConfig` is checked when the `Connector` is built (..., sizes and
    times in range, ...): a bad config is named there, not blamed later on a peer's params."
    The side channel bounds a reply's `block_size` below 2^31 (docs/side-channel.md, `check_reply`,
    run by the listener before sending), but `_check_config` accepts any block size up to 2^62. A
    producer built with `block_size=2**31` is accepted; every handshake reply it serves is then
    refused by its own listener as `internal`, which the consumer sees as the remote's refusal."""
    cfg_block = 1 << 31
    with pytest.raises(WireError):  # what the wire makes of the reply that config produces
        check_reply(_reply(block_size=cfg_block))
    with SideChannelServer(lambda pp: _reply(pp, block_size=cfg_block)) as server:
        with pytest.raises(SideChannelError) as failed:
            fetch_reply("127.0.0.1", server.port, engine_id="D", pp_rank=0)
        assert failed.value.kind == "remote" and "internal" in str(failed.value)
    with pytest.raises(InvalidInput) as err:
        _build(block_size=cfg_block)
    assert err.value.field == "block_size"


def test_a_compat_hash_the_handshake_cannot_carry_is_refused_when_the_connector_is_built() -> None:
    """docs/embedding.md: "The `CoreConfig` is checked when the `Connector` is built (...): a bad
    config is named there, not blamed later on a peer's params." docs/side-channel.md: "`compat_hash`
    at most 1024" characters in a reply (`check_reply`). `_check_config` only checks that
    `compat_hash` is a string: a 1025-character hash is accepted, and no handshake with that engine
    can ever succeed (its listener refuses its own reply as `internal`)."""
    long_hash = "h" * 1025
    with pytest.raises(WireError):
        check_reply(_reply(compat_hash=long_hash))
    with pytest.raises(InvalidInput) as err:
        _build(compat_hash=long_hash)
    assert err.value.field == "compat_hash"


# --- docs/engine-id-sync.md / pdfsm/enginesync.py -----------------------------------------------------------


def test_enginesync_module_docstring_counts_the_values_of_the_agreement(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """pdfsm/enginesync.py module docstring: "1. an ``all_reduce(MAX)`` of four int64 values (the
    highest group rank whose id was refused, plus one; the same for ``src`` outside the group;
    ``src``; ``-src``)" was left stale when the device vote and the fingerprint were added: the
    docstring, docs/engine-id-sync.md and the code must count the same values. Run on a real gloo
    world of one."""
    dist = pytest.importorskip("torch.distributed")
    from pdfsm.enginesync import sync_engine_id

    text = (ROOT / "pdfsm" / "enginesync.py").read_text()
    words = {"four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}
    m = re.search(r"all_reduce\(MAX\)``\s+of\s+(\w+)\s+int64 values", text)
    assert m is not None
    doc_count = words[m[1]]
    doc_md = re.search(r"`all_reduce\(MAX\)` of (\w+) int64 values", (ROOT / "docs" / "engine-id-sync.md").read_text())
    assert doc_md is not None and words[doc_md[1]] == doc_count

    seen: list[int] = []
    real = dist.all_reduce

    def spy(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(int(tensor.numel()))
        return real(tensor, *args, **kwargs)

    store = dist.FileStore(str(tmp_path / "store"), 1)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # gloo listens on loopback, not the host's address
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "all_reduce", spy)
        assert sync_engine_id("engine-a") == "engine-a"
    finally:
        dist.destroy_process_group()
    assert len(seen) == 1
    assert doc_count == seen[0], f"module docstring says {m[1]} values, the code reduces {seen[0]}"


# --- docs/side-channel.md: claims no other test checks (kept: cheap) ---------------------------------------


def test_a_health_check_is_counted_empty_and_not_logged() -> None:
    """docs/side-channel.md: "A connection closed before its first byte (a health check) is counted
    as `empty` and not logged"."""
    with structlog.testing.capture_logs() as logs, SideChannelServer(_reply) as server:
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
        assert eventually(lambda: server.stats()["refused"] == {"empty": 1})
        assert fetch_reply("127.0.0.1", server.port, engine_id="D", pp_rank=0) == _reply(0)
        assert eventually(lambda: server.stats()["served"] == 1)
    assert not [e for e in logs if e["event"] == "side channel refused a request"]


def test_a_reset_mid_request_is_counted_as_connection_error() -> None:
    """docs/side-channel.md: "... a reset mid-request as `connection-error`"."""
    with SideChannelServer(_reply) as server:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.sendall(HEADER.pack(MAGIC, 0, 0, 100)[:6])  # half a header
        time.sleep(0.1)  # the listener is waiting for the rest
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # RST
        assert eventually(lambda: server.stats()["refused"] == {"connection-error": 1}), server.stats()
        assert server.alive


def test_the_client_refuses_a_reply_of_another_protocol_version() -> None:
    """docs/side-channel.md: "A reply whose version differs is refused by the client."
    (A listener that answers every request with version 2, nonce and pp_rank echoed.)"""
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            head = conn.recv(HEADER.size, socket.MSG_WAITALL)
            length = HEADER.unpack(head)[3]
            req = request_codec.decode(conn.recv(length, socket.MSG_WAITALL))
            msg = ReplyMessage(version=PROTOCOL_VERSION + 1, pp_rank=req.pp_rank, nonce=req.nonce,
                               reply=_reply(req.pp_rank))
            conn.sendall(pack_frame(response_codec.encode(msg), secret=None, kind="reply"))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(SideChannelError, match="protocol version") as failed:
            fetch_reply("127.0.0.1", port, engine_id="D", pp_rank=0)
        assert failed.value.kind == "malformed"
    finally:
        t.join(5)
        lsock.close()
