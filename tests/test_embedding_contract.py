"""What a serving-scheduler author embedding pdfsm meets (docs/embedding.md, the Connector).

Each test reproduced a broken promise of the embedding contract, found by review from a vLLM
scheduler's point of view over the simulated transport (the in-process one any embedder tries
first), and asserts the behaviour the docs promise.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import SimPair
from test_connector import World

from pdfsm.connector import Connector
from pdfsm.errors import InvalidInput, PdfsmError
from pdfsm.events import CoreConfig
from pdfsm.filesink import FileSink, FsyncPolicy
from pdfsm.log import EventLog
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport

ROOT = Path(__file__).resolve().parents[1]


def _connected_world(**kw: Any) -> World:
    """A decode connector already connected to the producer engine (one request went through)."""
    w = World(**kw)
    w.d[0].load("warm-d", [3], w.p[0].request_finished("warm-p", [4]))
    _, recv = w.run(steps=4)
    assert recv == {"warm-d": 1}
    return w


# --- 1. a heartbeat the producer refuses is reported as told -------------------------------------


def test_heartbeat_beyond_the_wire_cap_is_refused_not_counted_as_told() -> None:
    """``heartbeat(params, extend_ns)`` returns how many producer ranks were told; the docs say that
    when this is every rank the consumer may count the lease as extended and pass a later
    ``lease_start_ns``. The wire caps ``extend_ns`` at one hour (``HeartbeatMessage``), but the
    Connector only checks ``extend_ns >= 1`` and msgspec does not check constraints on encode: a
    two-hour heartbeat is sent, the producer refuses it as an undecodable message (a remote fault
    blamed on us), its lease is not extended and expires, yet ``heartbeat`` returned 1. The
    consumer then trusts reads of blocks the producer has released. Expected: InvalidInput naming
    ``extend_ns`` before anything is sent."""
    w = _connected_world(lease_ns=3_000)
    params = w.prefill("p1", [1])
    two_hours = 2 * 3_600_000_000_000
    told = None
    with pytest.raises(InvalidInput) as err:
        told = w.d[0].heartbeat(params, two_hours)
    assert err.value.field == "extend_ns", f"heartbeat returned told={told}"


# --- 2. shutdown loses a request loaded in the same step -----------------------------------------


@pytest.mark.parametrize("engine", ["unknown", "connected"])
def test_shutdown_reports_a_request_loaded_in_the_same_step_as_aborted(engine: str) -> None:
    """docs/embedding.md, ``shutdown()``: "aborts every consumer request still handshaking or
    reading (reads cancelled), returns the last report (every request not reported before, blocks
    invalid as for any abort) ... nothing is reported after it". A request ``load``-ed in the step
    that shuts down is still queued in the inbox when shutdown picks what to abort (it looks at
    ``core.consumers`` before pumping). Engine unknown: the request is left HANDSHAKING with the
    handshaker closed and is never reported. Engine connected: its read is posted after the abort
    list was taken, cancelled by ``transport.close()``, and reported *failed* (recompute policy)
    instead of aborted. Expected: reported once, among ``aborted``, with its blocks invalid."""
    w = _connected_world() if engine == "connected" else World()
    params = w.prefill("p1", [1, 2])
    d = w.d[0]
    w.net.script("d1", 0, 0, ReadScript(polls=100))  # a read still in flight when the worker stops
    d.load("d1", [5, 6], params)
    out = d.shutdown()
    left = {rid: str(m.state) for rid, m in d.core.consumers.items()}
    assert "d1" in out.finished_recving, f"never reported; left live: {left}"
    assert "d1" in out.aborted, f"reported as failed, not aborted: {[f.reason for f in out.failed]}"
    assert {5, 6} <= out.invalid_block_ids


# --- 3. router params with an absurd TP size hang the step thread ------------------------------------


@pytest.mark.parametrize("field", ["remote_tp_size", "remote_pp_size"])
def test_an_absurd_remote_layout_size_is_refused_at_once(field: str) -> None:
    """``KVTransferParams.remote_tp_size``/``remote_pp_size`` come from the router and are only
    checked ``>= 1``. ``load`` builds a read plan eagerly (``Connector._check_layout`` ->
    ``topology.read_plan``), which materialises one ``ReadSource`` per remote rank: 2**20 takes
    seconds, 2**40 never returns (the owner thread spins, memory grows), and every distinct size
    is kept forever in ``core.plans``. The side channel already caps TP and PP sizes at
    ``MAX_RANKS`` (1024), so such params can never work. Expected: InvalidInput naming the field,
    in milliseconds. (Run in a child process: the bug is a hang.)"""
    code = textwrap.dedent(f"""
        from pdfsm.connector import Connector
        from pdfsm.errors import InvalidInput
        from pdfsm.events import CoreConfig
        from transports.sim import SimHandshaker, SimNetwork, SimTransport
        net = SimNetwork()
        c = Connector(CoreConfig(engine_id="D"), SimTransport(net, "D-0"), SimHandshaker(net))
        try:
            c.load("x", [1], dict(lease_ns=60_000_000_000,
                                  remote_engine_id="P", remote_request_id="p", remote_block_ids=(1,),
                                  {field}=2**40))
            print("ACCEPTED")
        except InvalidInput as exc:
            print("REFUSED", exc.field)
    """)
    try:
        done = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                              timeout=4)
    except subprocess.TimeoutExpired:
        pytest.fail(f"load() with {field}=2**40 did not return within 4 s (the read plan is built rank by rank)")
    assert done.stdout.split() == ["REFUSED", field], done.stdout + done.stderr[-2000:]


def test_a_remote_layout_of_more_than_max_ranks_in_all_is_refused_before_a_plan_is_built() -> None:
    """Scenario: params with remote TP 1024 and PP 1024, each within MAX_RANKS. Expected: refused
    (InvalidInput) before a read plan is built, since no producer has that many ranks. Before
    (found by review): the plan, one entry per remote rank (2**20), took 1.5 s and 300 MB of the
    owner thread, and was kept for ever."""
    net = SimNetwork()
    c = Connector(CoreConfig(engine_id="D"), SimTransport(net, "D-0"), SimHandshaker(net))
    with pytest.raises(InvalidInput, match="more than 1024"):
        c.load("x", [1], dict(lease_ns=60_000_000_000, remote_engine_id="P", remote_request_id="p",
                              remote_block_ids=(1,), remote_tp_size=1024, remote_pp_size=1024))
    assert not c.core.plans
    c.load("y", [1], dict(lease_ns=60_000_000_000, remote_engine_id="P", remote_request_id="q",
                          remote_block_ids=(1,), remote_tp_size=32, remote_pp_size=32))


def test_params_naming_no_remote_block_are_refused_and_notify_nobody() -> None:
    """vLLM PR 18590 / 18632: a prompt shorter than one block leaves the prefill nothing to hold,
    and the decode side must not send it a "free" notification. Scenario: params with
    `remote_block_ids=[]` (pdfsm's producer never mints them: `request_finished` refuses an empty
    hold) loaded with no local block. Expected: InvalidInput naming the field, nothing submitted.
    Before (found by review): accepted as notify-only, a notification went to a producer that
    never held the request, which staged it a whole lease and then recorded a remote fault."""
    net = SimNetwork()
    c = Connector(CoreConfig(engine_id="D"), SimTransport(net, "D-0"), SimHandshaker(net))
    with pytest.raises(InvalidInput, match="names no block") as err:
        c.load("x", [], dict(lease_ns=60_000_000_000, remote_engine_id="P", remote_request_id="p",
                             remote_block_ids=[], remote_tp_size=1))
    assert err.value.field == "remote_block_ids" and not c.core.log.inbox


# --- 4. a lease beyond 64 bits kills the durable log ---------------------------------------------------


def _durable(tmp_path: Path, name: str) -> tuple[Connector, FileSink, list[int]]:
    net, now = SimNetwork(), [0]
    sink = FileSink(tmp_path / name, fsync=FsyncPolicy.never())
    c = Connector(CoreConfig(engine_id="P", compat_hash="h"), SimTransport(net, f"{name}-0"), SimHandshaker(net),
                  log=EventLog(sink=sink), clock=lambda: now[0], port=9)
    return c, sink, now


@pytest.mark.parametrize("where", ["request_finished", "params"])
def test_a_lease_beyond_64_bits_is_refused_before_it_kills_the_durable_log(tmp_path: Path, where: str) -> None:
    """The same class of bug as the 2**64 block id (test_connector_contract): ``lease_ns`` is
    checked only from below, both as ``request_finished(..., lease_ns=)`` and as the params'
    ``lease_ns`` in ``load``. 2**64 is accepted, recorded in the event (``BlocksHeld.deadline``,
    ``ReadRequested.lease_ns``), and the file log's writer thread dies on it (msgpack cannot encode
    it): every later ``get_finished`` raises ``LogWriteError``, so nothing on this connector is ever
    reported again. Expected: InvalidInput naming ``lease_ns``, and the log still works."""
    c, sink, now = _durable(tmp_path, where)
    try:
        if where == "request_finished":
            c.request_finished("huge", [1], lease_ns=2**64)
        else:
            c.load("huge", [1], {"remote_engine_id": "Q", "remote_request_id": "q", "remote_block_ids": (1,),
                                 "remote_tp_size": 1, "lease_ns": 2**64})
    except InvalidInput as err:
        assert err.field == "lease_ns"
    try:
        now[0] = 100
        c.get_finished()
        sink.sync(timeout=5)
        now[0] = 200
        c.get_finished()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"one out-of-range lease killed the connector's log: {exc!r}")


# --- 5. the connector keeps accepting work after shutdown ------------------------------------------


def test_calls_after_shutdown_are_refused(tmp_path: Path) -> None:
    """``shutdown()``: "nothing is reported after it, and the log is flushed and closed". Yet
    ``request_finished`` after shutdown is accepted and returns params a router would hand to a
    consumer (for blocks the stopping scheduler is freeing), ``load`` is accepted too, and the
    next ``get_finished`` raises ``LogWriteError`` from the closed log (with an in-memory log the
    loaded request is even read and reported after shutdown). Expected: a typed pdfsm error at the
    call, naming the shutdown."""
    c, _, _ = _durable(tmp_path, "p")
    c.shutdown()
    with pytest.raises(PdfsmError):
        c.request_finished("late", [1])
    with pytest.raises(PdfsmError):
        c.load("late-d", [1], {"lease_ns": 60_000_000_000,
                               "remote_engine_id": "Q", "remote_request_id": "q", "remote_block_ids": (1,)})


# --- 6. an invalid CoreConfig is accepted and every later load is blamed on the params ---------------


@pytest.mark.parametrize(("fields", "field"), [
    ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ({"tp_size": 0}, "tp_size"),
    ({"engine_id": ""}, "engine_id"),
    ({"policy": "bogus"}, "policy"),
    ({"lease_ns": -5}, "lease_ns"),
])
def test_connector_refuses_an_invalid_core_config_by_name(fields: dict[str, Any], field: str) -> None:
    """``CoreConfig`` is a msgspec Struct, whose constructor checks nothing, and ``Connector``
    takes it as is. With ``tp_rank=2, tp_size=2`` every ``load`` raises
    ``InvalidInput("remote_tp_size", "local rank (0, 2) outside ...")``, blaming the router's
    params for our own config; with ``engine_id=""`` a producer holds blocks and hands out params
    that every consumer refuses (``remote_engine_id`` must be non-empty); a bogus ``policy`` is
    copied into every failed hand-off. Expected: InvalidInput naming the config field when the
    Connector is built, before the transport is bound."""
    net = SimNetwork()
    cfg = {"engine_id": "D", **fields}
    with pytest.raises(InvalidInput) as err:
        Connector(CoreConfig(**cfg), SimTransport(net, "D-0"), SimHandshaker(net))
    assert field in err.value.field


def test_connector_refuses_a_transport_that_says_a_negative_cache_size() -> None:
    """A custom transport's ``capabilities.num_blocks`` is checked like the config: a negative
    count would refuse every block id with a nonsensical range; 0 says nothing and checks nothing."""
    net = SimNetwork()
    t = SimTransport(net, "D-0")
    t.capabilities = msgspec.structs.replace(t.capabilities, num_blocks=-1)
    with pytest.raises(InvalidInput) as err:
        Connector(CoreConfig(engine_id="D"), t, SimHandshaker(net))
    assert err.value.field == "transport.capabilities.num_blocks"


# --- 7. a PP mismatch is reported against the wrong field ------------------------------------------


def test_a_pp_size_mismatch_names_remote_pp_size() -> None:
    """Docs: "Bad arguments raise pdfsm.errors.InvalidInput naming the field". A consumer with PP
    size 2 loading params whose ``remote_pp_size`` is 3 gets ``InvalidInput`` with field
    ``remote_tp_size`` ("PP sizes cannot be matched"): ``Connector._check_layout`` names
    ``remote_tp_size`` for every TopologyError. Expected: the field that is wrong,
    ``remote_pp_size``."""
    net = SimNetwork()
    c = Connector(CoreConfig(engine_id="D", pp_size=2), SimTransport(net, "D-0"), SimHandshaker(net))
    with pytest.raises(InvalidInput) as err:
        c.load("x", [1], {"lease_ns": 60_000_000_000,
                          "remote_engine_id": "P", "remote_request_id": "p", "remote_block_ids": (1,),
                          "remote_tp_size": 1, "remote_pp_size": 3})
    assert err.value.field == "remote_pp_size", str(err.value)


def test_start_load_kv_refuses_what_is_not_connector_metadata_by_name() -> None:
    """``start_load_kv`` promises InvalidInput naming what is wrong with a step's metadata, but a
    plain dict (what a hand-rolled ``build_connector_meta`` might return) or ``None`` raises
    ``AttributeError: ... has no attribute 'reqs_to_recv'``. Expected: InvalidInput."""
    w = World()
    bads: tuple[Any, ...] = (None, {"reqs_to_recv": {}})
    for bad in bads:
        with pytest.raises(InvalidInput):
            w.d[0].start_load_kv(bad)


# --- 8. PP rank > 0 on a transport without PP ---------------------------------------------------


def test_a_pp_rank_above_zero_on_a_transport_without_pp_is_refused_at_once() -> None:
    """The domain: "a transport that cannot do PP must refuse pp_rank > 0 with a clear error,
    early". The NIXL and torch transports raise ValueError when built at ``pp_rank > 0`` with
    ``supports_pp=False`` (docs/transports.md, construction row); the simulated one accepts it
    silently, and so does the Connector given ``CoreConfig(pp_rank=1, pp_size=2)`` over any
    transport whose capabilities say ``supports_pp=False`` (it only turns its own
    ``supports_pp`` off). Expected: the sim transport refuses like the others, and the Connector
    refuses the combination with InvalidInput naming ``pp_rank``."""
    net = SimNetwork()
    with pytest.raises(ValueError, match="supports_pp"):
        SimTransport(net, "P-pp1", pp_rank=1, supports_pp=False)
    t = SimTransport(net, "P-pp1b", supports_pp=False)
    with pytest.raises(InvalidInput) as err:
        Connector(CoreConfig(engine_id="P", pp_rank=1, pp_size=2), t, SimHandshaker(net))
    assert err.value.field == "pp_rank"



# --- 9. start_load_kv can say when a queued request's params arrived ------------------------------


def test_start_load_kv_takes_the_arrival_of_queued_params() -> None:
    """docs/embedding.md maps vLLM's ``update_state_after_alloc`` to ``reqs_to_recv``, and says a
    request that waited in a queue must pass its arrival as ``lease_start_ns``, or a read could be
    trusted after the producer reused the blocks; the metadata had no way to carry it (every entry
    started its lease now). ``ConnectorMetadata.lease_ages`` carries it: a request whose params
    arrived more than a lease ago fails at once, blocks invalid, nothing read."""
    from pdfsm.connector import ConnectorMetadata

    w = _connected_world(lease_ns=3_000)
    w.d[0].get_block_ids_with_load_errors()  # the warm-up's, if its read outlived the short lease
    params = w.prefill("p1", [1])
    w.now = 10_000  # the request queued for longer than the producer's lease
    w.d[0].start_load_kv(ConnectorMetadata(reqs_to_recv={"d1": ((5,), params)}, lease_ages={"d1": 9_900}))
    _, recving = w.d[0].get_finished()
    assert recving == {"d1"} and w.d[0].get_block_ids_with_load_errors() == {5}
    assert "lease" in w.d[0].last.failed[0].reason
    with pytest.raises(InvalidInput) as err:  # a start for a request the step does not load
        w.d[0].start_load_kv(ConnectorMetadata(lease_ages={"ghost": 0}))
    assert err.value.field == "lease_ages"


# --- blocks stay guarded until their report is handed out ------------------------------------------


def test_a_released_hold_guards_its_blocks_until_get_finished_reports_it() -> None:
    """A hold the consumer's notice released inside a step (``start_load_kv`` steps too) used to
    leave ``held()`` and free its blocks for ``load`` before ``get_finished`` reported it finished
    sending: the scheduler still owned them (a helper's hunt over random API sequences)."""
    w = SimPair()
    w.d.load("d1", [5, 6], w.p.request_finished("p1", [3, 4]))
    for _ in range(5):
        w.now += 1_000
        w.d.get_finished()
        w.p.step()  # the consumer's notice arrives and releases p1 here, not in get_finished
    assert w.p.held() == {"p1": (3, 4)}
    other = SimPair()
    with pytest.raises(InvalidInput, match="block 3 is held for 'p1'"):
        w.p.load("x1", [3], other.p.request_finished("q1", [7]))
    assert w.p.get_finished()[0] == {"p1"}
    assert w.p.held() == {}
    w.p.load("x1", [3], other.p.request_finished("q2", [7]))  # reported: free again


def test_a_finished_load_guards_its_blocks_until_get_finished_reports_it() -> None:
    """The consumer side of the same rule: a load whose read completed inside a step still owns
    its blocks until ``get_finished`` reports it (docs/embedding.md: "free again once that
    request is reported finished"). Hand-offs are made only by get_finished's collect, so this
    held before the producer side's fix too; it pins the rule for both."""
    w = SimPair()
    w.d.load("d1", [5, 6], w.p.request_finished("p1", [3, 4]))
    for _ in range(4):
        w.now += 1_000
        w.d.step()
        w.p.step()
    assert "d1" in w.d.core.consumers or w.d.core.pending_hand_offs
    with pytest.raises(InvalidInput, match="block 5 is still loaded into by 'd1'"):
        w.d.load("d2", [5], w.p.request_finished("p2", [7]))
    assert w.d.get_finished()[1] == {"d1"}
    w.d.load("d2", [5], w.p.request_finished("p3", [7]))


def test_an_id_whose_released_hold_is_not_reported_yet_is_refused_for_a_new_hold() -> None:
    """With the core's tombstones off, a released hold's id was free again before get_finished
    reported it: a new hold under it took the id over, and the old report then freed the new
    hold's blocks for load while a consumer could read them (found by review)."""
    w = SimPair()
    w.p = Connector(CoreConfig(engine_id="P", compat_hash="h", tombstones=0), w.prod, SimHandshaker(w.net),
                    clock=w.clock, port=9)
    w.d.load("d1", [5, 6], w.p.request_finished("p1", [3, 4]))
    for _ in range(5):
        w.now += 1_000
        w.d.get_finished()
        w.p.step()
    assert w.p.core.producers.get("p1") is None  # released and forgotten by the core
    with pytest.raises(InvalidInput, match="its hold is not reported finished yet"):
        w.p.request_finished("p1", [10, 11])
    assert w.p.get_finished()[0] == {"p1"} and w.p.held() == {}
    w.p.request_finished("p1", [10, 11])  # reported: the id is free
    assert w.p.held() == {"p1": (10, 11)}


def test_a_hold_naming_a_block_twice_is_reported_once_on_a_worker_that_loads_too() -> None:
    """A hold may name a block twice (vLLM's tables repeat the null block:
    tests/test_address_and_block_checks.py). On a worker that also loads, the block index let go
    of the block at its first mention and raised KeyError at the second as get_finished handed the
    report out, losing that step's reports (a helper's hunt over id reuse)."""
    w = SimPair(p_lease_ns=1_000_000)
    w.p.request_finished("x", [3, 3])
    with pytest.raises(InvalidInput, match="block 3 is held for 'x'"):  # builds the block index
        w.p.load("d", [3], SimPair().p.request_finished("q", [1]))
    w.now += 2_000_000  # the lease runs out
    assert w.p.get_finished()[0] == {"x"} and w.p.last.expired == {"x"}
    assert w.p.held() == {} and not w.p.busy()
