"""The embedding contract (docs/embedding.md) from a scheduler's point of view.

Two Connectors (decode and prefill) over the simulated network, driven step by step as a vLLM
scheduler would. Each test was written in review as a failing reproduction of a broken promise
(late reads during an abort, params loaded twice, shutdown losing outcomes, ill-typed metadata
and block ids); each now asserts the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_connector import World

from pdfsm.connector import Connector, ConnectorMetadata
from pdfsm.errors import InvalidInput
from pdfsm.events import CoreConfig
from pdfsm.filesink import FileSink, FsyncPolicy
from pdfsm.log import EventLog
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern


def _nixl_wait_cancel(t: SimTransport) -> None:
    """NIXL's default cancel rule (``cancel_policy="wait"``, transports/nixl.py): a cancelled read
    stays in flight and is polled until it ends; ``DONE`` is then reported as ``HandleDone``."""
    t.cancel_read = lambda request_id, pp_rank, tp_rank: None  # type: ignore[method-assign]


def _step(w: World, recv: dict[str, int], invalid: dict[str, set[int]], aborted: set[str],
          sent: dict[str, int]) -> None:
    """One scheduler step on each side; what each reported, attributed per request."""
    w.now += 1_000
    d, p = w.d[0], w.p[0]
    _, got = d.get_finished()
    bad = d.get_block_ids_with_load_errors()
    for rid in got:
        recv[rid] = recv.get(rid, 0) + 1
        invalid[rid] = set(bad)
    aborted |= d.last.aborted
    for rid in p.get_finished()[0]:
        sent[rid] = sent.get(rid, 0) + 1


# --- 1. aborted reads that complete late are trusted ------------------------------------------------


def test_aborted_request_whose_read_completes_after_the_deadline_reports_its_blocks_invalid() -> None:
    """docs/embedding.md: an aborted request's blocks are valid only if "every read into them
    completed in time (... a read that completed late ... leaves them invalid)". With NIXL's
    default cancel rule a cancelled read keeps running and may end DONE, here after the lease
    (less its margin) ran out: the producer has reported the blocks expired and reused them, the
    read copies the reused bytes, and the aborted request comes back with no invalid block."""
    w = World(lease_ns=5_000)  # the consumer's margin is 100 ns: its deadline is load + 4_900
    d, pt = w.d[0], w.pt[0][0]
    _nixl_wait_cancel(w.dt[0])
    params = w.prefill("p1", [1, 2])
    w.net.script("d1", 0, 0, ReadScript(polls=8))  # a slow read
    d.load("d1", [5, 6], params)
    recv: dict[str, int] = {}
    invalid: dict[str, set[int]] = {}
    aborted: set[str] = set()
    sent: dict[str, int] = {}
    for _ in range(2):
        _step(w, recv, invalid, aborted, sent)
    assert d.core.consumers["d1"].state.name == "READING"
    d.abort("d1")  # the client gave up, well before the deadline
    for _ in range(12):
        _step(w, recv, invalid, aborted, sent)
        if sent.get("p1") == 1 and pt.block(1) != bytes(pt.block_bytes):  # expired: the prefill
            pt.memory[1 * pt.block_bytes:3 * pt.block_bytes] = bytes(2 * pt.block_bytes)  # side reuses them
    assert sent == {"p1": 1} and w.p[0].last.step >= 1
    assert recv == {"d1": 1} and aborted == {"d1"}
    assert w.dt[0].block(5) == bytes(pt.block_bytes)  # what the read copied: the reused memory
    assert invalid["d1"] == {5, 6}, "a read that completed after the lease ran out was trusted"


# --- 2. the same producer request read twice ----------------------------------------------------------


@pytest.mark.parametrize("how", ["reload_after_abort", "two_loads_at_once"])
def test_a_read_of_blocks_the_producer_already_released_is_never_trusted(how: str) -> None:
    """Preemption / router retry: the same kv_transfer_params loaded a second time (under a new
    request id). The first load's notification already made the producer report the blocks in
    finished_sending (so its scheduler reuses them); the second read then copies reused blocks
    and is reported received with no invalid block. Correct: refuse the second load
    (InvalidInput) or report its blocks invalid."""
    w = World()
    d, pt = w.d[0], w.pt[0][0]
    params = w.prefill("p1", [1, 2])
    recv: dict[str, int] = {}
    invalid: dict[str, set[int]] = {}
    aborted: set[str] = set()
    sent: dict[str, int] = {}
    if how == "reload_after_abort":
        w.net.script("d1", 0, 0, ReadScript(polls=50))
        d.load("d1", [5, 6], params)
        for _ in range(2):
            _step(w, recv, invalid, aborted, sent)
        d.abort("d1")  # preempted while reading
        for _ in range(2):
            _step(w, recv, invalid, aborted, sent)
        assert recv == {"d1": 1} and sent == {"p1": 1}  # the producer released p1's blocks
    else:
        w.net.script("d2", 0, 0, ReadScript(polls=6))  # the second read is the slower one
        d.load("d1", [5, 6], params)
    try:
        w.net.script("d2", 0, 0, ReadScript(polls=6))
        d.load("d2", [7, 8], params)
    except InvalidInput:
        return  # refused: correct
    reused = False
    for _ in range(12):
        _step(w, recv, invalid, aborted, sent)
        if sent.get("p1") and not reused:  # the prefill scheduler frees p1's blocks: reused at once
            pt.memory[1 * pt.block_bytes:3 * pt.block_bytes] = bytes(2 * pt.block_bytes)
            reused = True
    assert recv.get("d2") == 1
    got_garbage = w.dt[0].block(7) != pattern(pt.agent, 1, pt.block_bytes)
    assert not got_garbage or invalid["d2"] >= {7, 8}, (
        "d2 was reported received with valid blocks that hold the producer's reused memory")


# --- 3. shutdown with requests in flight ------------------------------------------------------------


@pytest.mark.parametrize("durable", [False, True])
def test_shutdown_with_requests_in_flight_leaves_none_unreported(durable: bool, tmp_path: Path) -> None:
    """Each consumer request is reported exactly once "whatever happened to it": shutdown()
    returns the last report, with a request handshaking, one reading (both aborted, blocks
    invalid) and one already read but not collected; nothing can be reported after it."""
    net, now = SimNetwork(), [0]
    pt = SimTransport(net, "P-0")
    pt.fill(range(64))
    from helpers import reply

    net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(pt.rank_info(),)))
    net.serve("127.0.0.1", 10, lambda pp: reply("Q", ranks=(pt.rank_info(),)))
    prod = Connector(CoreConfig(engine_id="P", compat_hash="h"), pt, SimHandshaker(net), clock=lambda: now[0],
                     port=9)
    log = EventLog(sink=FileSink(tmp_path / "d", fsync=FsyncPolicy.never())) if durable else None
    dec = Connector(CoreConfig(engine_id="D", compat_hash="h"), SimTransport(net, "D-0"), SimHandshaker(net),
                    log=log, clock=lambda: now[0])
    done_p = prod.request_finished("p-done", [1])
    read_p = prod.request_finished("p-read", [2])
    dec.load("done", [5], done_p)
    dec.load("reading", [6], read_p)
    net.script("reading", 0, 0, ReadScript(polls=100))
    for _ in range(4):
        dec.step()
    net.handshake_faults[("127.0.0.1", 10)] = "hang"
    hs = msgspec.structs.replace(read_p, remote_engine_id="Q", remote_port=10, remote_request_id="q")
    dec.load("handshaking", [7], hs)
    dec.step()
    states = {rid: m.state.name for rid, m in dec.core.consumers.items()}
    assert states == {"done": "NOTIFIED", "reading": "READING", "handshaking": "HANDSHAKING"}
    out = dec.shutdown()  # the last report: every request not reported before
    assert out.finished_recving == {"done", "reading", "handshaking"}
    assert out.aborted == {"reading", "handshaking"} and out.invalid_block_ids == {6, 7}


# --- 4. wrong types and ranges -------------------------------------------------------------------------


@pytest.mark.parametrize(("meta", "field"), [
    (ConnectorMetadata(aborted="d1"), "aborted"),  # type: ignore[arg-type]
    (ConnectorMetadata(aborted=None), "aborted"),  # type: ignore[arg-type]
    (ConnectorMetadata(reqs_to_recv=None), "reqs_to_recv"),  # type: ignore[arg-type]
    (ConnectorMetadata(reqs_to_send=[("p9", (1,))]), "reqs_to_send"),  # type: ignore[arg-type]
])
def test_start_load_kv_refuses_wrongly_typed_metadata_by_name(meta: ConnectorMetadata, field: str) -> None:
    """"Bad arguments raise pdfsm.errors.InvalidInput naming the field, before anything is
    accepted". ConnectorMetadata is a msgspec Struct whose constructor checks no types. A bare
    string in ``aborted`` is worse than a TypeError: it is iterated character by character, so
    "d" and "1" are aborted and d1 is not."""
    w = World()
    d = w.d[0]
    d.load("d1", [5, 6], w.prefill("p1", [1, 2]))
    with pytest.raises(InvalidInput) as err:
        d.start_load_kv(meta)
    assert err.value.field.startswith(field)
    _, recv = w.run()
    assert recv == {"d1": 1} and not d.last.aborted  # nothing of the refused step was applied


@pytest.mark.parametrize("blocks", [{6, 5}, {5: 0, 6: 1}], ids=["set", "dict"])
def test_block_ids_without_an_order_are_refused(blocks: Any) -> None:
    """Local block i receives remote block i: the order is the mapping. A set or a dict has no
    order the caller chose, yet ``_check_blocks`` (its docstring: "must be a sequence of block
    ids") takes any iterable and silently fixes one."""
    w = World()
    params = w.prefill("p1", [1, 2])
    with pytest.raises(InvalidInput) as err:
        w.d[0].load("d1", blocks, params)
    assert err.value.field == "local_block_ids"
    with pytest.raises(InvalidInput) as err:
        w.p[0].request_finished("p2", blocks)
    assert err.value.field == "block_ids"


def test_a_block_id_beyond_64_bits_is_refused_before_it_kills_the_durable_log(tmp_path: Path) -> None:
    """A block id of 2**64 passes ``_check_blocks`` (the msgspec fast path refuses it, the
    fallback loop accepts any non-negative int), is recorded in the event log, and the file
    log's writer thread dies on it (msgpack cannot encode it): every later get_finished raises
    LogWriteError, so no request on this connector is ever reported again."""
    net, now = SimNetwork(), [0]
    sink = FileSink(tmp_path / "p", fsync=FsyncPolicy.never())
    p = Connector(CoreConfig(engine_id="P", compat_hash="h"), SimTransport(net, "P-0"), SimHandshaker(net),
                  log=EventLog(sink=sink), clock=lambda: now[0], port=9)
    try:
        p.request_finished("huge", [2**64])
    except InvalidInput as err:
        assert err.field == "block_ids"
    p.request_finished("ok", [1], lease_ns=10)
    now[0] = 100
    p.get_finished()
    try:
        sink.sync(timeout=5)  # the writer thread has taken (or died on) everything
        now[0] = 200
        p.get_finished()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"one out-of-range block id killed the connector's log: {exc!r}")


def test_a_repeated_local_block_id_is_refused() -> None:
    """Two remote blocks read into one local block: whichever write lands last wins, silently."""
    from test_connector import World

    w = World()
    params = w.prefill("p1", [1, 2])
    with pytest.raises(InvalidInput, match="repeated"):
        w.d[0].load("d1", [5, 5], params)
