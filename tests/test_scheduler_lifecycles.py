"""The scheduler-facing contract (docs/embedding.md) under lifecycles a vLLM-like scheduler
and real transports produce: components that raise, shutdown, lease expiry racing a late reader,
and a refused step resubmitted without its bad entry.

Everything runs over the simulated transport and handshaker on a simulated clock (deterministic).
"""

from __future__ import annotations

from typing import Any

import pytest
import structlog
import structlog.testing
from test_connector import World

from pdfsm.commands import StartHandshake
from pdfsm.connector import ConnectorMetadata
from pdfsm.errors import InvalidInput
from pdfsm.fsm import Fault
from transports.sim import ReadScript

T0 = 10**9  # the simulated clocks start here: issued_wall_ns == 0 would mean "not known"


def _steps(w: World, n: int, recv: dict[str, int], invalid: dict[str, set[int]], failed: dict[str, str],
           sent: dict[str, int]) -> None:
    """``n`` scheduler steps on decode rank 0 and every prefill rank, attributed per request."""
    d = w.d[0]
    for _ in range(n):
        w.now += 1_000
        _, got = d.get_finished(set())
        bad = d.get_block_ids_with_load_errors()
        for rid in got:
            recv[rid] = recv.get(rid, 0) + 1
            invalid[rid] = set(bad)
        for off in d.last.failed:
            failed[off.request_id] = off.reason
        for p in w.p:
            for rid in p.get_finished(set())[0]:
                sent[rid] = sent.get(rid, 0) + 1


# --- 1. a handshaker that raises when asked to start ---------------------------------------------------


@pytest.mark.parametrize("read_timeout_ns", [10**12, 3_000], ids=["no_deadline", "short_deadline"])
def test_a_handshake_start_that_raises_fails_its_request_and_does_not_wedge_the_engine(read_timeout_ns: int) -> None:
    """docs/embedding.md: each consumer request is reported exactly once, "failed (handshake, read
    error, poll raising, deadline, peer gone)", and a failed handshake is retried after
    ``handshake_retry_ns`` (docs/decisions.md, "A failed handshake is retried only after a pause").
    ``Connector._execute`` turns a raising ``transport.add_peer`` into ``HandshakeFailed`` and a
    raising ``post_read`` into a SETUP failure, but a raising ``handshaker.start`` (a custom
    handshaker resolving the host synchronously, ``SideChannelHandshaker.start`` whose thread pool
    refuses new work) is only logged: the engine machine stays HANDSHAKING for ever, with no
    attempt in flight. The request waits for its read deadline (30 s by default; here 1000 s),
    and every later request to that producer waits on the same dead attempt: the engine is never
    handshaken again. Expected: the start failure is a handshake failure: the request is reported
    failed (blocks invalid) at once, and a request after the retry pause handshakes afresh.
    ``short_deadline``: the read deadline reports the first request, isolating the wedge: the
    second request, long after the retry pause, also waits on the dead attempt and times out."""
    w = World(read_timeout_ns=read_timeout_ns)
    w.now = T0
    d = w.d[0]
    real_start = d.handshaker.start
    starts: list[StartHandshake] = []

    def start(cmd: StartHandshake) -> None:
        starts.append(cmd)
        if len(starts) == 1:
            raise OSError("getaddrinfo failed: temporary failure in name resolution")
        real_start(cmd)

    d.handshaker.start = start  # type: ignore[method-assign]
    d.load("d1", [5, 6], w.prefill("p1", [1, 2]))
    recv: dict[str, int] = {}
    invalid: dict[str, set[int]] = {}
    failed: dict[str, str] = {}
    sent: dict[str, int] = {}
    _steps(w, 5, recv, invalid, failed, sent)
    engine = {k: str(m.state) for k, m in d.core.engines.items()}
    assert recv == {"d1": 1}, f"d1 not reported after a handshake start that raised; engine {engine}, " \
                              f"request {d.core.consumers['d1'].state.name if 'd1' in d.core.consumers else '-'}"
    assert "d1" in failed and invalid["d1"] == {5, 6}
    w.now += 2 * d.config.handshake_retry_ns  # past the retry pause: the producer answers now
    d.load("d2", [7, 8], w.prefill("p2", [3, 4]))
    _steps(w, 6, recv, invalid, failed, sent)
    assert recv.get("d2") == 1 and "d2" not in failed and invalid["d2"] == set(), (
        f"the engine was never handshaken again ({len(starts)} start(s)): every request to it waits "
        f"for its read deadline; engine {engine}")
    assert w.verify(0, [7, 8], [3, 4])


# --- 2. shutdown when closing a component raises ---------------------------------------------------------


@pytest.mark.parametrize("part", ["handshaker", "transport"])
def test_shutdown_returns_the_last_report_even_when_closing_a_component_raises(part: str) -> None:
    """docs/embedding.md, ``shutdown()``: it "aborts every consumer request still handshaking or
    reading (reads cancelled), returns the last report (every request not reported before, blocks
    invalid as for any abort) ... nothing is reported after it". A worker stops once; an exception
    from closing the handshaker (a side-channel socket already gone) or the transport (a NIXL
    deregistration, an agent torn down) propagates out of ``shutdown()`` instead: no report is
    returned, the aborted request is left unreported (ABORTED, never collected), the log is not
    closed, and the connector is left half closed (the connector keeps accepting calls that the
    docs say raise ConnectorClosed). The Connector already contains transport exceptions in every
    command it carries out (``_execute``: "a transport bug must not take the engine down").
    Expected: the request is still in the returned report, aborted, its blocks invalid."""
    w = World()
    w.now = T0
    d = w.d[0]
    w.net.script("d1", 0, 0, ReadScript(end="hang"))
    d.load("d1", [5, 6], w.prefill("p1", [1, 2]))
    for _ in range(3):
        d.step()
    assert d.core.consumers["d1"].state.name == "READING"
    target: Any = d.handshaker if part == "handshaker" else d.transport
    real_close = target.close

    def close() -> None:
        real_close()
        raise OSError(f"{part} close failed")

    target.close = close
    try:
        out = d.shutdown()
    except OSError as exc:
        left = {rid: m.state.name for rid, m in d.core.consumers.items()}
        pytest.fail(f"shutdown() raised {exc!r} and returned no report; left unreported: {left}")
    assert out.finished_recving == {"d1"} and out.aborted == {"d1"} and out.invalid_block_ids == {5, 6}


def test_shutdown_over_a_transport_written_before_stop_reads_is_quiet() -> None:
    """``Transport.stop_reads`` is newer than the protocol's first version: a transport an embedder
    wrote before it has none. Shutdown called it all the same and logged an error with a traceback
    every time (found by review); close() stops such a transport's reads, as it always did."""
    w = World()
    w.now = T0
    d = w.d[0]
    real = d.transport

    class Older:
        def __getattr__(self, name: str) -> Any:
            if name == "stop_reads":
                raise AttributeError(name)
            return getattr(real, name)

    d.transport = Older()
    w.net.script("d1", 0, 0, ReadScript(end="hang"))
    d.load("d1", [5, 6], w.prefill("p1", [1, 2]))
    for _ in range(3):
        d.step()
    with structlog.testing.capture_logs() as logs:
        out = d.shutdown()
    assert out.aborted == {"d1"} and out.invalid_block_ids == {5, 6}
    assert not [e for e in logs if e.get("log_level") == "error"], logs


# --- 3. passing: coverage of lifecycles the other files do not drive ----------------------------------------


def test_a_refused_step_resubmitted_without_its_bad_entry_is_applied_whole_and_reported_once() -> None:
    """docs/embedding.md: a bad entry's error names its request "so the embedder can fail that one
    and resubmit the rest". A step with a load, a prefill hold, an abort of a request still
    reading, and one bad load (params already loaded by a live request) is refused whole; the
    same step without the bad entry is then accepted and every part of it takes effect once."""
    w = World()
    w.now = T0
    d = w.d[0]
    w.net.script("old", 0, 0, ReadScript(polls=40))
    used = w.prefill("p-old", [1])
    d.load("old", [3], used)
    for _ in range(3):
        d.step()
    assert d.core.consumers["old"].state.name == "READING"
    good = w.prefill("p-good", [2, 4])
    meta: dict[str, Any] = {"reqs_to_recv": {"good": ((10, 11), good), "bad": ((12,), used)},
                            "reqs_to_send": {"held": (9,)}, "aborted": ("old",)}
    with pytest.raises(InvalidInput) as err:
        d.start_load_kv(ConnectorMetadata(**meta))
    assert err.value.request_id == "bad"
    assert "good" not in d.core.consumers and "held" not in d.core.producers
    assert d.core.consumers["old"].state.name == "READING"  # the step's abort was not applied
    del meta["reqs_to_recv"]["bad"]
    d.start_load_kv(ConnectorMetadata(**meta))
    recv: dict[str, int] = {}
    invalid: dict[str, set[int]] = {}
    failed: dict[str, str] = {}
    sent: dict[str, int] = {}
    _steps(w, 8, recv, invalid, failed, sent)
    assert recv == {"old": 1, "good": 1} and not failed
    assert 3 in invalid["old"] and not invalid["good"] & {10, 11}  # the step's set: only the aborted read
    assert d.last.step == 8 and "held" in d.core.producers
    assert sent == {"p-old": 1, "p-good": 1}
    assert w.verify(0, [10, 11], [2, 4])


def test_a_hold_expired_before_the_second_decode_rank_reads_is_released_once_and_the_late_read_fails() -> None:
    """Decode TP 2 reading prefill TP 1: rank 0 reads at once, rank 1 is scheduled long after the
    producer's lease ran out. docs/embedding.md: the hold is in ``finished_sending`` exactly once
    (``last.expired``: the lease), and the late rank's read of blocks the producer released must not
    be trusted: it is reported once, failed, its blocks invalid in that step. The late notification
    does not release the hold a second time."""
    w = World(d_tp=2, lease_ns=20_000)
    w.now = T0
    params = w.prefill("p1", [1, 2])
    w.d[0].load("d1", [5, 6], params)
    sent: list[tuple[int, frozenset[str]]] = []
    late: list[tuple[set[str], set[int], int]] = []
    for i in range(40):
        w.now += 1_000
        w.d[0].get_finished(set())
        if i == 30:
            w.d[1].load("d1", [5, 6], params)
        if i >= 30:
            _, got = w.d[1].get_finished(set())
            if got:
                late.append((got, w.d[1].get_block_ids_with_load_errors(), len(w.d[1].last.failed)))
        if w.p[0].get_finished(set())[0]:
            sent.append((i, w.p[0].last.expired))
    assert [e for _, e in sent] == [frozenset({"p1"})] and sent[0][0] < 30
    assert late == [({"d1"}, {5, 6}, 1)]
    assert not w.p[0].core.violations[Fault.LOCAL]
