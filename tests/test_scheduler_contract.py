"""The Connector against the contract vLLM's scheduler holds a KV connector to.

Each test drives pdfsm's Connector through a sequence a real vLLM scheduler produces, and asserts
what vLLM's own code requires of ``KVConnectorBase_V1`` (vllm/distributed/kv_transfer/kv_connector/
v1/base.py), of its reference ``NixlConnector`` (v1/nixl_connector.py), and of the scheduler that
consumes the outputs (vllm/v1/core/sched/scheduler.py, ``_update_from_kv_xfer_finished``):

- ``finished_recving``: ``assert req_id in self.requests``; a request still waiting for remote KV is
  then scheduled, any other must already be finished (``assert RequestStatus.is_finished``), and its
  blocks are freed. So each loaded request comes back exactly once, and a request the scheduler
  already freed (aborted before it was scheduled, loaded notify-only) never does.
- ``finished_sending``: ``assert req_id in self.requests`` and the blocks are freed; base.py: only
  requests that "previously returned True from request_finished()".
- ``get_block_ids_with_load_errors``: the failed blocks appear "no later than" the step that
  reports the request; the scheduler maps every id back to the request holding it, so a block of
  a request that did not fail would make a healthy request recompute (or fail).

The steps pass ``finished_req_ids`` as vLLM's model runner does (a set).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from helpers import reply
from test_connector import World

from pdfsm.connector import Connector, ConnectorMetadata, KVTransferParams
from pdfsm.errors import ConnectorClosed, InvalidInput
from pdfsm.events import CoreConfig
from pdfsm.fsm import Fault
from pdfsm.log import EventLog, Overflow
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern


class _Pair:
    """One producer and one consumer Connector (TP 1) with configurable config, blocks and logs,
    stepped as vLLM steps a worker: ``get_finished(finished_req_ids)`` then
    ``get_block_ids_with_load_errors()``, each report attributed to the step that made it."""

    def __init__(self, *, d_cfg: dict[str, Any] | None = None, p_cfg: dict[str, Any] | None = None,
                 num_blocks: int = 64, log: Callable[[], EventLog | None] = lambda: None) -> None:
        self.net, self.now = SimNetwork(), 0
        self.pt = SimTransport(self.net, "P-0", num_blocks=num_blocks)
        self.pt.fill(range(num_blocks))
        self.p = Connector(CoreConfig(engine_id="P", compat_hash="h", **(p_cfg or {})), self.pt,
                           SimHandshaker(self.net), clock=self.clock, port=9, log=log())
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(self.pt.rank_info(),)))
        self.dt = SimTransport(self.net, "D-0", num_blocks=num_blocks)
        self.d = Connector(CoreConfig(engine_id="D", compat_hash="h", lease_margin_ns=100, **(d_cfg or {})),
                           self.dt, SimHandshaker(self.net), clock=self.clock, log=log())
        self.recv: dict[str, int] = {}
        self.sent: dict[str, int] = {}
        self.steps: list[tuple[frozenset[str], frozenset[str], set[int]]] = []  # (recving, failed+aborted, invalid)

    def clock(self) -> int:
        return self.now

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.now += 1_000
            _, recving = self.d.get_finished(set())
            invalid = self.d.get_block_ids_with_load_errors()
            last = self.d.last
            self.steps.append((frozenset(recving), frozenset({f.request_id for f in last.failed}) | last.aborted,
                               invalid))
            for rid in recving:
                self.recv[rid] = self.recv.get(rid, 0) + 1
            for rid in self.p.get_finished(set())[0]:
                self.sent[rid] = self.sent.get(rid, 0) + 1


# --- single-use params --------------------------------------------------------------------------


def test_params_of_a_load_still_reading_stay_single_use_past_the_tombstone_count() -> None:
    """docs/embedding.md: a second ``load`` of the same (engine, remote request) "while the first is
    live or after it was reported (the newest ``tombstones`` are remembered)" raises InvalidInput:
    the count bounds only what is remembered after the report. ``Connector._loaded`` is one FIFO
    of ``tombstones`` entries for live and finished loads alike, so ``tombstones`` later loads
    evict the entry of a load that is still reading, and the same params are accepted again.
    The second read notifies the producer, which reports the request in ``finished_sending``
    (vLLM's scheduler frees and reuses the blocks) while the first read still copies them."""
    w = _Pair(d_cfg={"tombstones": 2})
    params = [w.p.request_finished(f"p{i}", [i]) for i in range(4)]
    for i, prm in enumerate(params):
        w.net.script(f"d{i}", 0, 0, ReadScript(polls=50))  # slow reads: all four still live
        w.d.load(f"d{i}", [10 + i], prm)
    w.step(2)
    assert w.d.core.consumers["d0"].state.name == "READING"
    with pytest.raises(InvalidInput) as err:
        w.d.load("retry", [30], params[0])  # a router retry of d0's params, d0 still reading
    assert err.value.field == "kv_transfer_params"


# --- what the prefill side may hold and report ---------------------------------------------------


def test_vllm_shaped_transfer_params_are_refused_by_name() -> None:
    """An embedder migrating from NixlConnector hands ``load`` the dict vLLM's prefill returns
    (NixlConnectorScheduler.request_finished: ``do_remote_prefill``, ``remote_block_ids``, ...,
    ``tp_size``). docs/embedding.md says pdfsm's dict differs (``remote_tp_size``, not ``tp_size``;
    no ``do_remote_*``), and that bad arguments raise InvalidInput naming the field before anything
    is accepted. ``KVTransferParams.parse`` drops unknown keys, so ``tp_size=2`` is silently read
    as ``remote_tp_size=1``: the load is accepted, fails later as a *remote* fault against a
    healthy producer (whose engine is evicted), and the producer is never notified (its blocks
    wait for the lease). Correct: InvalidInput at ``load``, naming ``tp_size``."""
    w = World(p_tp=2)
    w.prefill("p1", [1, 2])
    vllm_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
                   "lease_ns": 60_000_000_000,
                   "remote_engine_id": "P", "remote_request_id": "p1", "remote_host": "127.0.0.1",
                   "remote_port": 9, "tp_size": 2}
    with pytest.raises(InvalidInput) as err:
        w.d[0].load("d1", [5, 6], vllm_params)
    assert "tp_size" in f"{err.value.field} {err.value.problem}"


# --- the decode side: what finished_recving may and may not hold -----------------------------------


def test_a_load_and_its_abort_in_one_step_are_reported_once_as_aborted() -> None:
    """vLLM: a request aborted after ``update_state_after_alloc`` queued its load still reaches
    the worker in that step's metadata (NixlConnectorScheduler.build_connector_meta sends every
    ``_reqs_need_recv`` entry), and the scheduler frees its blocks only when it comes back in
    ``finished_recving`` (the ``assert RequestStatus.is_finished(req.status)`` branch). So a step
    with both the load and the abort must report the request exactly once, as aborted (not failed:
    the policy must not be applied), its unread blocks invalid in that same step."""
    w = _Pair()
    params = w.p.request_finished("p1", [1, 2])
    w.d.start_load_kv(ConnectorMetadata(reqs_to_recv={"d1": ((5, 6), params)}, aborted=("d1",)))
    w.step(6)
    assert w.recv == {"d1": 1}
    ((recving, bad, invalid),) = [s for s in w.steps if s[0]]
    assert recving == {"d1"} and bad == {"d1"} and invalid == {5, 6}
    assert not w.dt.reads and not w.d.core.violations[Fault.LOCAL]


def test_notify_only_loads_are_never_reported_even_when_they_fail_or_are_aborted() -> None:
    """vLLM's NixlConnectorScheduler.request_finished, for a decode request aborted before it was
    scheduled, queues a load with no local block (``self._reqs_need_recv[id] = (request, [])``)
    and frees the request at once; a full prefix hit loads no block either. Such a request must
    never appear in ``finished_recving`` (``assert req_id in self.requests``) nor have blocks in
    the error set, whatever becomes of it: here one whose producer address refuses handshakes,
    and one aborted too (vLLM PR 57570; docs/embedding.md tells the scheduler not to wait for
    such a request, the hang of vLLM PR 56640)."""
    w = _Pair()
    params = w.p.request_finished("p1", [1])
    nowhere = msgspec.structs.replace(params, remote_engine_id="X", remote_port=77, remote_request_id="x1")
    w.d.load("n-unreachable", [], nowhere)
    w.d.load("n-aborted", [], w.p.request_finished("p2", [2]))
    w.d.abort("n-aborted")
    w.d.load("n-ok", [], w.p.request_finished("p3", [3]))
    w.step(6)
    assert w.recv == {} and all(not invalid for _, _, invalid in w.steps)
    # Each that reached its producer released it: the aborted one too, by the notice it owed the
    # engine still handshaking when it was aborted (sent once the engine connected).
    assert w.sent == {"p2": 1, "p3": 1}


def test_a_late_abort_of_a_reported_or_unknown_request_reports_nothing() -> None:
    """vLLM calls ``request_finished`` on the decode side for every request that ends, including
    ones whose load completed or failed long before; the docs map it to ``abort`` (directly or via
    ``ConnectorMetadata.aborted``). A request already in ``finished_recving`` must not come back a
    second time (vLLM's scheduler would free its blocks twice), nor may an id pdfsm never saw, and
    no block may be reported invalid for them."""
    w = _Pair()
    w.net.script("failed", 0, 0, ReadScript(polls=0, end="err"))
    w.d.load("received", [5], w.p.request_finished("p1", [1]))
    w.d.load("failed", [6], w.p.request_finished("p2", [2]))
    w.step(4)
    assert w.recv == {"received": 1, "failed": 1}
    before = len(w.steps)
    w.d.abort("received")
    w.d.abort("never-seen")
    w.d.start_load_kv(ConnectorMetadata(aborted=("failed", "received", "never-seen")))
    w.step(4)
    assert w.recv == {"received": 1, "failed": 1}
    assert all(not recving and not invalid for recving, _, invalid in w.steps[before:])
    assert not w.d.core.violations[Fault.LOCAL] and not w.d.core.violations[Fault.REMOTE]


def test_a_step_of_many_requests_over_a_tiny_inbox_reports_each_once_with_only_failed_blocks() -> None:
    """One scheduler step can allocate hundreds of remote-prefill requests. Over an inbox of 8
    events (COUNT: what does not fit is dropped for other threads) every request of the step must
    still be accepted (the owner's own submissions are never dropped), reported exactly once, and
    each step's error set must be exactly the blocks of the requests that step reported failed:
    here a quarter of them name a producer that refuses handshakes and some reads end ERR."""
    n = 1200
    w = _Pair(num_blocks=n + 8, log=lambda: EventLog(inbox_limit=8, overflow=Overflow.COUNT))
    dead = {"lease_ns": 60_000_000_000, "remote_engine_id": "X", "remote_host": "127.0.0.1", "remote_port": 77}
    reqs: dict[str, tuple[tuple[int, ...], Any]] = {}
    for i in range(n):
        params = w.p.request_finished(f"p{i}", [i])
        if i % 4 == 3:
            params = msgspec.structs.replace(params, remote_request_id=f"x{i}", **dead)
        elif i % 10 == 1:
            w.net.script(f"d{i}", 0, 0, ReadScript(polls=1, end="err"))
        reqs[f"d{i}"] = ((i,), params)
    w.d.start_load_kv(ConnectorMetadata(reqs_to_recv=reqs))
    w.step(8)
    assert len(w.recv) == n and set(w.recv.values()) == {1}
    failed_all: set[str] = set()
    for recving, bad, invalid in w.steps:
        assert bad <= recving
        assert invalid == {int(rid[1:]) for rid in bad}, "error set is not exactly the failed requests' blocks"
        failed_all |= bad
    assert failed_all == {f"d{i}" for i in range(n) if i % 4 == 3 or (i % 4 != 3 and i % 10 == 1)}
    assert not w.p.core.violations[Fault.LOCAL] and not w.d.core.violations[Fault.LOCAL]


def test_every_per_step_call_after_shutdown_raises_connector_closed() -> None:
    """docs/embedding.md: after ``shutdown()`` every call raises ConnectorClosed, except
    ``shutdown()`` (the same last report) and ``get_block_ids_with_load_errors()`` (that report's
    blocks). vLLM's worker may still run a step while the engine stops: the calls a step makes
    (``start_load_kv``, ``get_finished(finished_req_ids)``, an abort) must fail loudly and typed,
    never report anything after the last report."""
    w = _Pair()
    w.net.script("d1", 0, 0, ReadScript(end="hang"))
    params = w.p.request_finished("p1", [1])
    w.d.load("d1", [5], params)
    w.step(2)
    out = w.d.shutdown()
    assert out.finished_recving == {"d1"} and out.aborted == {"d1"} and out.invalid_block_ids == {5}
    calls: list[Callable[[], object]] = [
        lambda: w.d.get_finished({"d1"}),
        lambda: w.d.start_load_kv(ConnectorMetadata()),
        lambda: w.d.abort("d1"),
        lambda: w.d.heartbeat(params, 1_000),
        w.d.step,
        lambda: w.d.request_finished("q", [1]),
    ]
    for call in calls:
        with pytest.raises(ConnectorClosed):
            call()
    assert w.d.shutdown() is out and w.d.get_block_ids_with_load_errors() == {5}


# --- the prefill side: finished_sending ------------------------------------------------------------


def test_a_duplicated_notification_does_not_release_a_hold_two_decode_ranks_read() -> None:
    """Decode TP 2 reading prefill TP 1: the producer must wait for both ranks. vLLM's
    ``_get_new_notifs`` counts notifications (``consumer_notification_counts_by_req[req_id] += 1``
    until it equals the number of consumers), so a duplicated first notification would release
    the blocks while rank 1 has not read them. The hold must come back in ``finished_sending``
    once, only after the second rank's read, and the duplicate is the peer's fault, not ours."""
    w = World(p_tp=1, d_tp=2)
    params = w.prefill("p1", [1, 2])
    w.net.fault_notification("p1", "duplicate")
    w.d[0].load("d1", [5, 6], params)
    sent: list[tuple[int, str]] = []
    for i in range(10):
        w.now += 1_000
        w.d[0].get_finished(set())
        if i == 5:
            w.d[1].load("d1", [5, 6], params)  # rank 1 gets to it late
        if i >= 5:
            w.d[1].get_finished(set())
        sent += [(i, rid) for rid in w.p[0].get_finished(set())[0]]
    assert [rid for _, rid in sent] == ["p1"] and sent[0][0] > 5, f"released at step {sent}"
    assert not w.p[0].core.violations[Fault.LOCAL]
    assert all(w.verify(r, [5, 6], [1, 2]) for r in range(2))


def test_notifications_for_a_request_never_held_never_reach_finished_sending() -> None:
    """vLLM's ``_get_new_notifs`` drops a notification for a request it does not track ("Potentially
    invalid KV blocks for unrecognized request"); its scheduler asserts ``req_id in self.requests``
    for every ``finished_sending``. pdfsm stages such a notification (the hold may come later);
    if no hold ever comes, the staged entry must expire without a ``finished_sending`` for it."""
    w = _Pair(p_cfg={"lease_ns": 5_000})
    params = w.p.request_finished("p1", [1])
    w.d.load("d1", [5], params)
    w.step(3)
    w.d.load("dg", [6], msgspec.structs.replace(params, remote_request_id="ghost"))
    w.step(20)  # well past the lease the staged entry waits for a hold
    assert w.sent == {"p1": 1}
    assert "ghost" not in w.p.core.producers


def test_holds_whose_request_failed_to_load_are_released_once_and_at_once() -> None:
    """Two sequences around a failed load. (1) An engine that is both consumer and producer
    (vLLM's ``kv_role="kv_both"``) holds, as prefill, blocks under the id of a request whose load
    failed (ids are per side): the hold is accepted and comes back in ``finished_sending`` once,
    after a reader read it. (2) The consumer's read of a producer request fails before the
    producer's scheduler called ``request_finished`` for it (the router raced it): the failure
    notification is staged, and the hold that follows is released in that step, exactly once,
    not after its lease."""
    w = _Pair()
    w.net.script("r", 0, 0, ReadScript(polls=0, end="err"))
    w.d.load("r", [5], w.p.request_finished("p1", [1]))
    w.step(4)
    assert w.recv == {"r": 1} and set().union(*(invalid for _, _, invalid in w.steps)) == {5}
    w.dt.fill([5])
    w.net.serve("127.0.0.1", 10, lambda pp: reply("D", ranks=(w.dt.rank_info(),)))
    held = msgspec.structs.replace(w.d.request_finished("r", [5]), remote_port=10)
    w.p.load("back", [7], held)
    sent: dict[str, int] = {}
    got: dict[str, int] = {}
    for _ in range(6):
        w.now += 1_000
        for rid in w.d.get_finished(set())[0]:
            sent[rid] = sent.get(rid, 0) + 1
        for rid in w.p.get_finished(set())[1]:
            got[rid] = got.get(rid, 0) + 1
    assert sent == {"r": 1} and got == {"back": 1} and w.pt.block(7) == pattern("D-0", 5, 64)

    w2 = _Pair()
    early = KVTransferParams(remote_tp_size=1, lease_ns=60_000_000_000,
                             remote_engine_id="P", remote_request_id="p5", remote_port=9, remote_block_ids=(2,))
    w2.net.script("d5", 0, 0, ReadScript(polls=0, end="err"))
    w2.d.load("d5", [5], early)
    w2.step(4)
    assert w2.recv == {"d5": 1} and w2.p.core.producers["p5"].state.name == "STAGED"
    w2.p.request_finished("p5", [2])
    w2.step(1)
    assert w2.sent == {"p5": 1} and not w2.p.last.expired
    w2.step(3)
    assert w2.sent == {"p5": 1}


_Bad = Callable[[KVTransferParams], dict[str, Any]]


@pytest.mark.parametrize(("bad", "field"), [
    (lambda fresh: {"reqs_to_recv": {"x": ((9,), fresh)}, "lease_ages": {"x": True}}, "lease_ages['x'].age"),
    (lambda fresh: {"reqs_to_recv": {7: ((9,), fresh)}}, "reqs_to_recv[7].request_id"),
    (lambda fresh: {"reqs_to_send": {"y": "12"}}, "reqs_to_send['y'].block_ids"),
    (lambda fresh: {"reqs_to_send": {"y": [1.0]}}, "reqs_to_send['y'].block_ids"),
    (lambda fresh: {"aborted": (5,)}, "aborted"),
], ids=["lease_age_bool", "request_id_int", "send_blocks_str", "send_blocks_float", "aborted_int"])
def test_a_step_with_one_ill_typed_entry_is_refused_whole_by_name(bad: _Bad, field: str) -> None:
    """A scheduler's metadata built by hand (or decoded untyped) with one ill-typed entry: the
    step is refused with InvalidInput naming the field, and what was accepted before (a load
    already reading) is neither lost nor reported twice; the refused step's good entries are not
    applied (here a fresh load beside the bad one)."""
    w = _Pair()
    w.d.load("good", [5, 6], w.p.request_finished("p1", [1, 2]))
    fields = bad(w.p.request_finished("p2", [3]))
    fields["reqs_to_recv"] = {**fields.get("reqs_to_recv", {}), "beside": ((20,), w.p.request_finished("p3", [4]))}
    with pytest.raises(InvalidInput) as err:
        w.d.start_load_kv(ConnectorMetadata(**fields))
    assert err.value.field == field
    w.step(6)
    assert w.recv == {"good": 1} and "beside" not in w.d.core.consumers
