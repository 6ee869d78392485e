"""The Connector under scheduler call orders a real engine produces.

Each test drives pdfsm's scheduler-facing API (docs/embedding.md) through a sequence that a vLLM-like
engine produces (a worker thread other than the one that built the connector, a bounded inbox fed by
transfer threads, router-built params, producer request ids that come back) and asserts the outcome
the contract promises, through the public API only.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from helpers import reply

from pdfsm.connector import Connector, ConnectorMetadata, KVTransferParams
from pdfsm.errors import InvalidInput
from pdfsm.events import CoreConfig, HandshakeReply
from pdfsm.log import EventLog, Overflow
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern


class _Rig:
    """Prefill P and decode D (TP 1 each) on one simulated network and one shared clock (the wall
    clock too, so the params' transit is measured on it). ``step`` is one vLLM step on each side:
    ``get_finished(finished_req_ids)`` then ``get_block_ids_with_load_errors()``."""

    def __init__(self, *, p_cfg: dict[str, Any] | None = None, d_cfg: dict[str, Any] | None = None,
                 p_log: EventLog | None = None, d_log: EventLog | None = None, num_blocks: int = 64) -> None:
        self.net, self.now = SimNetwork(), 0
        self.pt = SimTransport(self.net, "P-0", num_blocks=num_blocks)
        self.pt.fill(range(num_blocks))
        self.p = Connector(CoreConfig(engine_id="P", compat_hash="h", **(p_cfg or {})), self.pt,
                           SimHandshaker(self.net), clock=self.clock, wall_clock=self.clock, port=9, log=p_log)
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(self.pt.rank_info(),)))
        self.dt = SimTransport(self.net, "D-0", num_blocks=num_blocks)
        self.d = Connector(CoreConfig(engine_id="D", compat_hash="h", lease_margin_ns=100, **(d_cfg or {})),
                           self.dt, SimHandshaker(self.net), clock=self.clock, wall_clock=self.clock, log=d_log)
        self.recv: dict[str, int] = {}
        self.sent: dict[str, int] = {}
        self.invalid: dict[str, set[int]] = {}
        self.failed: set[str] = set()

    def clock(self) -> int:
        return self.now

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.now += 1_000
            _, recving = self.d.get_finished(set())
            bad = self.d.get_block_ids_with_load_errors()
            self.failed |= {f.request_id for f in self.d.last.failed}
            for rid in recving:
                self.recv[rid] = self.recv.get(rid, 0) + 1
                self.invalid[rid] = set(bad)
            for rid in self.p.get_finished(set())[0]:
                self.sent[rid] = self.sent.get(rid, 0) + 1

    def block_ok(self, local: int, remote: int) -> bool:
        return self.dt.block(local) == pattern(self.pt.agent, remote, self.pt.block_bytes)


# --- 1. a connector built on one thread, stepped on another -------------------------------------------


def test_a_connector_built_off_the_step_thread_never_drops_the_schedulers_own_calls() -> None:
    """vLLM builds the KV connector while the worker initializes and runs every step on the worker's
    step thread; nothing in docs/embedding.md says both must be one thread ("Call every Connector
    method from one thread, the worker's step thread (the owner)"). The contract: "The embedder's own
    calls never block on, or are dropped by, a full inbox (they run on the owner thread)", and
    docs/decisions.md: dropping them "would lose a request the caller was told was accepted".

    Both Connectors are built on the main thread over a COUNT inbox of 4 events; the step thread then
    holds 20 prefill requests and loads them in one ``start_load_kv``. Expected: each decode request
    reported exactly once and each hold released exactly once. pdfsm takes the building thread as the
    owner until the first pump, so the step thread's submissions past the inbox bound are dropped:
    the requests are never reported, the holds never released, and their blocks stay refused."""
    rig = _Rig(p_log=EventLog(inbox_limit=4, overflow=Overflow.COUNT),
               d_log=EventLog(inbox_limit=4, overflow=Overflow.COUNT))
    n = 20
    out: list[BaseException] = []

    def worker() -> None:
        try:
            reqs: dict[str, tuple[tuple[int, ...], KVTransferParams]] = {
                f"d{i}": ((i,), rig.p.request_finished(f"p{i}", [i])) for i in range(n)}
            rig.d.start_load_kv(ConnectorMetadata(reqs_to_recv=reqs))
            rig.step(8)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out.append(exc)

    t = threading.Thread(target=worker, daemon=True, name="review14-step-thread")
    t.start()
    t.join(10)
    assert not t.is_alive() and not out, out
    assert rig.recv == {f"d{i}": 1 for i in range(n)}, (
        f"never reported: {sorted(set(f'd{i}' for i in range(n)) - set(rig.recv))}")
    assert rig.sent == {f"p{i}": 1 for i in range(n)}


def test_a_connector_built_off_the_step_thread_does_not_deadlock_its_own_step() -> None:
    """As above, with the default overflow policy (``BLOCK``) and a small inbox: the step thread's
    own ``request_finished`` and ``start_load_kv`` must go in over the bound (the owner's calls never
    wait, docs/embedding.md), and the step must end. pdfsm makes the step thread wait for room that
    only a pump can make, and the only thread that would pump is the one waiting: the worker hangs."""
    p_log = EventLog(inbox_limit=4, overflow=Overflow.BLOCK)
    d_log = EventLog(inbox_limit=4, overflow=Overflow.BLOCK)
    rig = _Rig(p_log=p_log, d_log=d_log)
    n = 12

    def worker() -> None:
        reqs: dict[str, tuple[tuple[int, ...], KVTransferParams]] = {
            f"d{i}": ((i,), rig.p.request_finished(f"p{i}", [i])) for i in range(n)}
        rig.d.start_load_kv(ConnectorMetadata(reqs_to_recv=reqs))
        rig.step(6)

    t = threading.Thread(target=worker, daemon=True, name="review14-step-thread")
    t.start()
    t.join(5)
    hung = t.is_alive()
    if hung:  # a closed log stops BLOCK waits, so the thread ends and the test can too
        p_log.close()
        d_log.close()
        t.join(5)
    assert not hung, "the step thread deadlocked waiting for inbox room only its own pump can make"
    assert rig.recv == {f"d{i}": 1 for i in range(n)}


# --- 2. a COUNT inbox and a transport whose outcomes come from its own threads -------------------------


def test_a_read_outcome_dropped_by_a_full_count_inbox_still_ends_in_one_report() -> None:
    """docs/embedding.md: each consumer request is reported in ``get_finished`` exactly once, whatever
    happened to it; ``shutdown()`` returns "every request not reported before". With ``Overflow.COUNT``
    other threads' events are "counted and recorded" when the inbox is full. The torch transport's
    worker threads submit each read's outcome themselves; eight reads finish between two steps over an
    inbox of 2, so most ``HandleDone`` events are dropped.

    Expected: every request still reported once (at the latest failed by its deadline, blocks invalid,
    and certainly in the last report of ``shutdown()``). pdfsm leaves each request whose outcome was
    dropped READING until its deadline, then FAILING for ever: the cancel finds no read (it ended), so
    nothing will ever say the read stopped. The requests are never reported, not even by
    ``shutdown()``, and their blocks stay pinned."""
    torch = pytest.importorskip("torch")
    from transports.torch import TorchNetwork, TorchTransport

    def kv(seed: int | None) -> list[Any]:
        if seed is None:
            return [torch.zeros(32, 64, dtype=torch.uint8)]
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(0, 256, (32, 64), dtype=torch.uint8, generator=gen)]

    tnet, net = TorchNetwork(), SimNetwork()
    pt = TorchTransport(tnet, "p", kv(1))
    dt = TorchTransport(tnet, "d", kv(None), workers=4)
    prefill = Connector(CoreConfig(engine_id="P"), pt, SimHandshaker(net), host="p-host", port=1)
    hs = HandshakeReply(engine_id="P", compat_hash="", tp_size=1, num_blocks=32, ranks=(pt.rank_info(),))
    net.serve("p-host", 1, lambda pp: hs)
    decode = Connector(CoreConfig(engine_id="D", read_timeout_ns=100_000_000), dt, SimHandshaker(net),
                       log=EventLog(inbox_limit=2, overflow=Overflow.COUNT))
    reported: dict[str, int] = {}
    try:
        decode.load("warm", [31], prefill.request_finished("pw", [31]))  # connects the engine
        for _ in range(50):
            for rid in decode.get_finished()[1]:
                reported[rid] = reported.get(rid, 0) + 1
            if "warm" in reported:
                break
            time.sleep(0.005)
        assert reported == {"warm": 1}
        for i in range(8):
            decode.load(f"d{i}", [i], prefill.request_finished(f"p{i}", [i]))
        decode.step()  # posts the eight reads
        time.sleep(0.3)  # they all finish before the next step
        end = time.monotonic() + 1.0  # ten read timeouts
        while time.monotonic() < end:
            for rid in decode.get_finished()[1]:
                reported[rid] = reported.get(rid, 0) + 1
            time.sleep(0.01)
    finally:
        last = decode.shutdown()
        prefill.shutdown()
    for rid in last.finished_recving:
        reported[rid] = reported.get(rid, 0) + 1
    want = {"warm": 1, **{f"d{i}": 1 for i in range(8)}}
    assert reported == want, f"never reported: {sorted(set(want) - set(reported))}"


# --- 3. block ids without an order in the router's params ---------------------------------------------


@pytest.mark.parametrize("how", ["dict", "struct"])
def test_remote_block_ids_given_as_a_set_are_refused(how: str) -> None:
    """docs/embedding.md: "Block ids are a sequence (a list or tuple: its order pairs local blocks with
    remote ones; a set is refused)". A Python router that deduplicates the prefill's block ids with
    ``set()`` hands the decode side params whose ``remote_block_ids`` has no order: local block i
    would be filled from whichever remote block the set happens to yield i-th, and the request
    reported received over the wrong bytes. Expected: ``load`` raises InvalidInput naming
    ``remote_block_ids``. pdfsm converts the set to a tuple in the set's iteration order and loads it:
    here local blocks 5, 6, 7 end up holding remote blocks 64, 1, 33 instead of 1, 33, 64."""
    rig = _Rig(num_blocks=128)
    params = rig.p.request_finished("p1", [1, 33, 64])
    bad: Any
    if how == "dict":
        bad = {**params.to_dict(), "remote_block_ids": {1, 33, 64}}
    else:
        bad = KVTransferParams(**{**params.to_dict(), "remote_block_ids": {1, 33, 64}})
    try:
        rig.d.load("d1", [5, 6, 7], bad)
    except InvalidInput as exc:
        assert exc.field == "remote_block_ids"
        return
    rig.step(4)
    assert rig.recv == {"d1": 1}
    pairs = [(5, 1), (6, 33), (7, 64)]
    wrong = [(lb, rb) for lb, rb in pairs if not rig.block_ok(lb, rb)]
    pytest.fail(f"a set of remote block ids was accepted (read as {list(bad_ids(bad))}); local blocks "
                f"{[lb for lb, _ in wrong]} hold other remote blocks than the router's order, reported "
                f"{'invalid' if rig.invalid['d1'] else 'valid'}")


def bad_ids(bad: Any) -> tuple[int, ...]:
    return tuple(KVTransferParams.parse(bad).remote_block_ids)


# --- 4. a producer request id that comes back, and a stale notification ---------------------------------


def test_a_stale_notification_does_not_release_a_new_hold_under_a_reused_request_id() -> None:
    """Client-supplied request ids come back (vLLM's X-Request-Id before its random suffix); pdfsm
    accepts a prefill hold under an id once it has forgotten the last one (docs/embedding.md refuses
    it only "while remembered"; tests/test_field_scenarios_scheduler.py reuses a decode id the same
    way). A decode read of hold ``px`` completes; its notification is delayed on the network past the
    hold's lease; the prefill reports ``px`` expired and, after ``tombstones`` more requests, forgets
    it. The late notification then arrives and is staged as "early news" of a request not held yet.

    The prefill scheduler now finishes a new request under the same id ``px`` (other blocks). The
    contract: a hold is reported in ``finished_sending`` when every expected consumer part notified
    (for *this* hold) or when its lease expired. Expected: the new ``px`` stays held until its own
    reader has read it, and that reader gets the right bytes. pdfsm used to release it in the step it
    was held, from the stale notification (the prefill then freed and reused the blocks, and the
    decode request read reused memory and was reported received with no invalid block); now the
    notification names the hold by its params' issue time and the stale one is not counted."""
    rig = _Rig(p_cfg={"tombstones": 2, "lease_ns": 8_000, "hold_skew_ns": 1_000},  # times scaled down
               d_cfg={"tombstones": 2})
    rig.now = 1_000_000  # a wall clock at 0 says nothing of when params were issued
    first = rig.p.request_finished("px", [1, 2])
    rig.net.fault_notification("px", "delay", 40)  # the read's notification is slow on the wire
    rig.d.load("d1", [5, 6], first)
    rig.step(12)
    assert rig.recv == {"d1": 1} and rig.sent == {"px": 1} and rig.p.last.step  # expired, reported once
    for i in range(3):  # more requests: the prefill forgets px
        rig.d.load(f"f{i}", [10 + i], rig.p.request_finished(f"pf{i}", [3 + i]))
    rig.step(4)
    for _ in range(60):  # the delayed notification lands
        if not rig.pt.inbox:
            break
        rig.step()
    assert not rig.pt.inbox
    rig.net.script("d2", 0, 0, ReadScript(polls=3))
    second = rig.p.request_finished("px", [7, 8])  # the id comes back for a new request
    rig.d.load("d2", [20, 21], second)
    rig.step()
    released_early = rig.sent["px"] == 2
    if released_early:  # the prefill scheduler frees and reuses the blocks at once
        rig.pt.memory[7 * rig.pt.block_bytes:9 * rig.pt.block_bytes] = bytes(2 * rig.pt.block_bytes)
    rig.step(6)
    assert rig.recv.get("d2") == 1
    garbage = not (rig.block_ok(20, 7) and rig.block_ok(21, 8))
    assert not released_early, (
        "the new hold was released by the previous hold's late notification before its reader read it"
        + (f"; d2 was reported with {'invalid' if rig.invalid['d2'] else 'valid'} blocks holding reused memory"
           if garbage else ""))
    assert not garbage or rig.invalid["d2"] >= {20, 21}
