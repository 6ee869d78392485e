"""The scheduler-facing API over the simulated transport: validation, every path, each report once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from helpers import reply

from pdfsm.commands import HandOff
from pdfsm.connector import Connector, ConnectorMetadata, KVTransferParams
from pdfsm.errors import InvalidInput
from pdfsm.events import CoreConfig
from pdfsm.fsm import Fault
from pdfsm.topology import Layout, read_plan
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern


class World:
    """A producer engine and a consumer engine (each one Connector per TP rank) on one network."""

    def __init__(self, *, p_tp: int = 1, d_tp: int = 1, mla: bool = False, policy: str = "recompute",
                 lease_ns: int = 10**12, read_timeout_ns: int = 10**12, pp: int = 1, d_pp_support: bool = True,
                 tombstones: int = 65536) -> None:
        self.net, self.now = SimNetwork(), 0
        self.mla, self.p_tp, self.d_tp = mla, p_tp, d_tp

        def clock() -> int:
            return self.now

        bb = 256
        pbb = bb // (1 if mla else p_tp)
        self.pt = [[SimTransport(self.net, f"P-pp{p}-tp{t}", pp_rank=p, tp_rank=t, block_bytes=pbb)
                    for t in range(p_tp)] for p in range(pp)]
        for ranks in self.pt:
            for t in ranks:
                t.fill(range(64))
        self.p = [Connector(CoreConfig(engine_id="P", tp_rank=t, tp_size=p_tp, pp_size=pp, mla=mla, compat_hash="h",
                                       lease_ns=lease_ns), self.pt[0][t], SimHandshaker(self.net), clock=clock,
                            wall_clock=clock, port=9)
                  for t in range(p_tp)]
        self.net.serve("127.0.0.1", 9, lambda p: reply(
            "P", tp_size=p_tp, pp_size=pp, mla=mla, ranks=tuple(t.rank_info() for t in self.pt[p])))
        self.dt = [SimTransport(self.net, f"D-tp{t}", tp_rank=t, block_bytes=bb // (1 if mla else d_tp),
                                supports_pp=d_pp_support) for t in range(d_tp)]
        self.d = [Connector(CoreConfig(engine_id="D", tp_rank=t, tp_size=d_tp, mla=mla, compat_hash="h",
                                       policy=policy, read_timeout_ns=read_timeout_ns,  # type: ignore[arg-type]
                                       lease_margin_ns=100, tombstones=tombstones),
                            self.dt[t], SimHandshaker(self.net), clock=clock, wall_clock=clock) for t in range(d_tp)]
        self.pp = pp
        self.failed: list[HandOff] = []

    def prefill(self, rid: str, blocks: list[int]) -> KVTransferParams:
        params = [p.request_finished(rid, blocks) for p in self.p]  # every rank holds its part
        return params[0]

    def run(self, steps: int = 8) -> tuple[dict[str, int], dict[str, int]]:
        """Step everything; count how often each request is reported on each side."""
        sent: dict[str, int] = {}
        recv: dict[str, int] = {}
        for _ in range(steps):
            self.now += 1_000
            for d in self.d:
                for rid in d.get_finished()[1]:
                    recv[rid] = recv.get(rid, 0) + 1
                self.failed.extend(d.last.failed)
            for p in self.p:
                for rid in p.get_finished()[0]:
                    sent[rid] = sent.get(rid, 0) + 1
        return sent, recv

    def verify(self, d_rank: int, local: list[int], remote: list[int]) -> bool:
        t = self.dt[d_rank]
        plan = read_plan(Layout(self.d_tp, 1, d_rank), Layout(self.p_tp, self.pp), self.mla)
        for lb, rb in zip(local, remote, strict=True):
            want = bytearray(t.block_bytes)
            for src in plan.sources:
                p = self.pt[src.pp_rank][src.tp_rank]
                chunk = p.block_bytes // src.remote_slices
                data = pattern(p.agent, rb, p.block_bytes)[src.remote_slice * chunk:(src.remote_slice + 1) * chunk]
                at = src.local_slice * (t.block_bytes // src.local_slices)
                want[at:at + len(data)] = data
            if self.pp == 1 and t.block(lb) != bytes(want):
                return False
        return True


@pytest.mark.parametrize(("p_tp", "d_tp", "mla"), [(1, 1, False), (2, 1, False), (1, 2, False), (4, 2, False),
                                                   (2, 4, False), (4, 1, True), (1, 2, True)])
def test_blocks_move_and_every_request_is_reported_once(p_tp: int, d_tp: int, mla: bool) -> None:
    w = World(p_tp=p_tp, d_tp=d_tp, mla=mla)
    params = w.prefill("p1", [3, 9, 4])
    for d in w.d:
        d.load("d1", [10, 11, 12], params)
    sent, recv = w.run()
    assert recv == {"d1": d_tp} and sent == {"p1": p_tp}
    assert all(w.verify(r, [10, 11, 12], [3, 9, 4]) for r in range(d_tp))
    assert all(not d.get_block_ids_with_load_errors() for d in w.d)


def test_partial_prefix_hit_reads_the_blocks_after_the_computed_ones() -> None:
    w = World()
    params = w.prefill("p1", [1, 2, 3])
    w.d[0].load("d1", [20], params, computed_blocks=2)
    _, recv = w.run()
    assert recv == {"d1": 1} and w.verify(0, [20], [3])


def test_failure_policy_fail_is_reported_with_invalid_blocks_in_the_same_step() -> None:
    w = World(policy="fail")
    params = w.prefill("p1", [1, 2])
    w.net.script("d1", 0, 0, ReadScript(polls=1, end="err"))
    w.d[0].load("d1", [5, 6], params)
    for _ in range(6):
        w.now += 1
        _, recv = w.d[0].get_finished()
        if recv:
            break
    assert recv == {"d1"}
    assert w.d[0].get_block_ids_with_load_errors() == {5, 6}
    assert w.d[0].last.failed[0].policy == "fail"
    sent, _ = w.run()
    assert sent == {"p1": 1}  # the producer was told to release after the failed read


@pytest.mark.parametrize("stage", ["handshaking", "reading", "notified"])
def test_abort_at_every_stage_reports_once_and_frees_nothing_early(stage: str) -> None:
    w = World()
    params = w.prefill("p1", [1, 2])
    w.net.script("d1", 0, 0, ReadScript(polls=3))
    d = w.d[0]
    d.load("d1", [5, 6], params)
    if stage == "reading":
        for _ in range(3):
            d.step()
        assert d.core.consumers["d1"].state.name == "READING"
    if stage == "notified":
        for _ in range(8):
            d.step()
        assert d.core.consumers["d1"].state.name == "NOTIFIED"
    d.abort("d1")
    d.abort("d1")  # twice: harmless
    invalid: set[int] = set()
    recv: dict[str, int] = {}
    for _ in range(8):
        _, got = w.run(steps=1)
        recv.update(got)
        invalid |= d.get_block_ids_with_load_errors()
    assert recv == {"d1": 1}
    assert not w.dt[0].reads  # no read left in flight when it was reported
    # Blocks some read did not fill are reported with the request; a completed read's are valid.
    assert invalid == (set() if stage == "notified" else {5, 6})


def test_a_request_failed_then_aborted_still_reports_its_blocks_invalid() -> None:
    w = World()
    params = w.prefill("p1", [1, 2])
    w.net.script("d1", 0, 0, ReadScript(polls=1, end="err"))
    d = w.d[0]
    d.load("d1", [5, 6], params)
    for _ in range(4):
        d.step()
    assert d.core.consumers["d1"].state.name == "FAILED"
    d.abort("d1")  # before the scheduler collected it
    _, recv = w.run(steps=1)
    assert recv == {"d1": 1} and d.last.aborted == {"d1"}
    assert d.get_block_ids_with_load_errors() == {5, 6}


@pytest.mark.parametrize("when", ["queued", "live", "finished"])
def test_a_request_id_is_loaded_once_refused_at_once_otherwise(when: str) -> None:
    """vLLM PR 27987 (duplicate request ids reached the engine): a second load of an id in use is
    refused synchronously, and the first request is untouched (not quarantined, not lost)."""
    w = World()
    params, again = w.prefill("p1", [1, 2]), w.prefill("p2", [3, 4])
    d = w.d[0]
    d.load("d1", [5, 6], params)
    sent: dict[str, int] = {}
    recv: dict[str, int] = {}
    if when == "live":
        d.step()
        assert d.core.consumers["d1"].state.name in ("HANDSHAKING", "READING")
    if when == "finished":
        sent, recv = w.run()
        assert recv == {"d1": 1}
    with pytest.raises(InvalidInput) as err:
        d.load("d1", [7, 8], again)
    assert err.value.field == "request_id"
    # A finished id says why it is still refused, and until when (vLLM keeps ids across preemption).
    assert ("remembered" in err.value.problem and "tombstone" in err.value.problem) if when == "finished" \
        else "already in use" in err.value.problem
    more_sent, more = w.run()
    sent.update(more_sent)
    recv.update(more)
    assert recv == {"d1": 1} and sent == {"p1": 1}  # p2 was never read: the scheduler knows, it was told
    assert not d.core.violations[Fault.LOCAL] and not d.last.failed


def test_a_producer_request_is_held_once_but_early_notifications_wait_for_it() -> None:
    w = World()
    p = w.p[0]
    params = p.request_finished("p1", [1, 2])
    with pytest.raises(InvalidInput, match="already in use"):
        p.request_finished("p1", [3, 4])  # params for blocks nobody would hold
    w.d[0].load("d1", [5, 6], params)
    sent, _ = w.run()
    assert sent == {"p1": 1}
    with pytest.raises(InvalidInput, match="RELEASED"):
        p.request_finished("p1", [3, 4])
    # A consumer that reads and notifies before the producer registered the request (vLLM PR 43509):
    # the early notification is staged, and the hold it waits for is accepted.
    early = msgspec.structs.replace(params, remote_request_id="p9")
    w.d[0].load("d9", [7, 8], early)
    w.run(steps=3)
    assert p.core.producers["p9"].state.name == "STAGED"
    p.request_finished("p9", [1, 2])
    sent, _ = w.run(steps=2)
    assert sent == {"p9": 1}
    assert not p.core.violations[Fault.LOCAL]


def test_notify_only_request_tells_the_producer_and_is_not_reported() -> None:
    w = World(p_tp=2, mla=True)
    params = w.prefill("p1", [1])
    w.d[0].load("d1", [], params)
    sent, recv = w.run()
    assert recv == {} and sent == {"p1": 2}


def test_lease_releases_blocks_the_consumer_never_read() -> None:
    w = World(lease_ns=5_000)
    w.prefill("p1", [1, 2])
    sent, _ = w.run(steps=8)
    assert sent == {"p1": 1}
    assert w.p[0].last.step >= 1


def test_read_deadline_cancels_fails_and_releases_the_producer() -> None:
    w = World(read_timeout_ns=5_000)
    params = w.prefill("p1", [1, 2])
    w.net.script("d1", 0, 0, ReadScript(end="hang"))
    w.d[0].load("d1", [5, 6], params)
    sent, recv = w.run(steps=10)
    assert recv == {"d1": 1} and sent == {"p1": 1}
    (failed,) = w.failed
    assert "deadline passed" in failed.reason and failed.invalid_blocks == (5, 6)


def test_peer_killed_mid_transfer_fails_the_request_with_its_policy() -> None:
    w = World()
    params = w.prefill("p1", [1, 2])
    w.net.script("d1", 0, 0, ReadScript(polls=2))
    w.d[0].load("d1", [5, 6], params)
    for _ in range(3):
        w.d[0].step()
    w.net.kill("P-pp0-tp0")
    _, recv = w.run()
    assert recv == {"d1": 1}
    (failed,) = w.failed
    assert "disconnected" in failed.reason and failed.policy == "recompute"
    # The transport reports the engine gone once, as NIXL does; the engine machine follows.
    gone = [r for r in w.d[0].core.log.records() if type(r.event).__name__ == "PeerDisconnected"]
    assert len(gone) == 1 and gone[0].machine == "engine" and gone[0].state == "DISCONNECTED"


def test_pp_with_and_without_transport_support() -> None:
    w = World(pp=2)
    params = w.prefill("p1", [1])
    w.d[0].load("d1", [5], params)
    _, recv = w.run()
    assert recv == {"d1": 1} and not w.d[0].get_block_ids_with_load_errors()
    w2 = World(pp=2, d_pp_support=False)
    params = w2.prefill("p1", [1])
    w2.d[0].load("d1", [5], params)
    assert w2.d[0].config.supports_pp is False
    _, recv = w2.run(steps=1)
    assert recv == {"d1": 1}
    assert "pipeline parallelism" in w2.d[0].last.failed[0].reason


def test_bad_input_is_refused_by_name_and_nothing_accepted_is_lost() -> None:
    w = World()
    params = w.prefill("p1", [1, 2])
    d = w.d[0]
    d.load("good", [5, 6], params)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: d.load("", [1], params), "request_id"),
        (lambda: d.load("x", [-1], params), "local_block_ids"),
        (lambda: d.load("x", [1, 2, 3], params), "local_block_ids"),
        (lambda: d.load("x", [1], {"remote_engine_id": "P"}), "remote_request_id"),  # the missing field, named
        # A lone surrogate (json.loads gives one for "\\ud800") named by its field, not a UnicodeEncodeError.
        (lambda: d.load("x", [1], {**params.to_dict(), "remote_port": "\ud800"}), "remote_port"),
        (lambda: d.load("x", [1], {**params.to_dict(), "remote_tp_size": 0}), "remote_tp_size"),
        (lambda: w.p[0].request_finished("y", [1.5]), "block_ids"),  # type: ignore[list-item]
        (lambda: w.p[0].request_finished("y", [1], lease_ns=0), "lease_ns"),
        (lambda: d.heartbeat(params, 0), "extend_ns"),
        (lambda: d.heartbeat(params, "5"), "extend_ns"),  # type: ignore[arg-type]
        (lambda: d.load("x", None, params), "local_block_ids"),  # type: ignore[arg-type]
        (lambda: d.load("x", [1], None), "kv_transfer_params"),  # type: ignore[arg-type]
        (lambda: d.load("x", [1], params, lease_start_ns="0"), "lease_start_ns"),  # type: ignore[arg-type]
        # A typed instance is checked too: its constructor checks neither types nor bounds.
        (lambda: d.load("x", [1], KVTransferParams(remote_tp_size=1, remote_engine_id="P", remote_request_id="p1",
                                                   lease_ns="1")), "lease_ns"),  # type: ignore[arg-type]
        (lambda: d.load("x", [1], {**params.to_dict(), "remote_port": 70000}), "remote_port"),
        (lambda: w.p[0].request_finished("y", [1], lease_ns=True), "lease_ns"),
        # Past the transport's cache (64 blocks): a read would fail on it later, or write elsewhere.
        (lambda: d.load("x", [64], params), "local_block_ids"),
        (lambda: w.p[0].request_finished("y", [2, 64]), "block_ids"),
    ]
    for call, field in cases:
        with pytest.raises(InvalidInput) as err:
            call()
        assert err.value.field == field
    _, recv = w.run()
    assert recv == {"good": 1}
    with pytest.raises(InvalidInput, match=r"block 64 is out of range: this worker.s KV cache has 64 blocks"):
        d.load("x", [63, 64], params)
    d.load("x", [63], {**w.prefill("p2", [63]).to_dict(), "router": "\ud800"})  # a router's own key: ignored
    _, recv = w.run()
    assert recv == {"x": 1} and not d.last.failed


def test_the_address_a_producer_mints_into_its_params_is_checked_when_built() -> None:
    """Params naming a port past 65535 or a host that is not a string were minted and held, then
    refused by every consumer (blamed on the params) while the blocks waited out the lease."""
    net = SimNetwork()
    cases: list[tuple[dict[str, Any], str]] = [({"port": 70000}, "port"), ({"port": -1}, "port"),
                                               ({"host": None}, "host"), ({"host": "\ud800"}, "host")]
    for n, (kw, field) in enumerate(cases):
        with pytest.raises(InvalidInput) as err:
            Connector(CoreConfig(engine_id="Q"), SimTransport(net, f"Q{n}"), SimHandshaker(net), **kw)
        assert err.value.field == field


def test_start_load_kv_takes_a_whole_step_of_metadata() -> None:
    w = World()
    params = w.prefill("p1", [1])
    w.d[0].start_load_kv(ConnectorMetadata(reqs_to_recv={"d1": ((7,), params)}, aborted=("ghost",)))
    _, recv = w.run()
    assert recv == {"d1": 1}


def test_start_load_kv_refuses_a_bad_step_whole() -> None:
    w = World()
    params = w.prefill("p1", [1])
    d = w.d[0]
    d.load("x", [3], params)
    fresh = [w.prefill(f"p{i}", [i]) for i in (2, 3)]
    bad = ConnectorMetadata(reqs_to_recv={"a": ((7,), fresh[0]), "b": ((7, 8), fresh[1])}, aborted=("x",))
    with pytest.raises(InvalidInput, match="2 local blocks for 1 remote"):
        d.start_load_kv(bad)
    _, recv = w.run()
    assert recv == {"x": 1}  # "a" was never submitted, and the abort of x was not applied either
    assert not d.last.aborted


def test_params_built_by_hand_must_say_the_producers_tp_size() -> None:
    """A dict without ``remote_tp_size`` is refused (vLLM router PR 191); an instance built by
    hand defaulted it to 1, which no check could tell from a TP 1 producer's."""
    with pytest.raises(TypeError, match="remote_tp_size"):
        KVTransferParams(remote_engine_id="P", remote_request_id="p1", lease_ns=1)  # type: ignore[call-arg]
    with pytest.raises(InvalidInput, match="remote_tp_size: missing") as err:
        KVTransferParams.parse({"remote_engine_id": "P", "remote_request_id": "p1", "tp_size": 2})
    assert "vLLM's tp_size" in str(err.value)


def test_an_error_of_load_or_request_finished_names_its_request() -> None:
    """``InvalidInput.request_id`` was set only for a step's entries (``start_load_kv``); a direct
    call's error left it None, though the call is about exactly one request."""
    w = World()
    params = w.prefill("p1", [1, 2])
    with pytest.raises(InvalidInput) as err:
        w.d[0].load("d1", [1, 1], params)
    assert err.value.request_id == "d1" and err.value.field == "local_block_ids"
    with pytest.raises(InvalidInput) as err:
        w.p[0].request_finished("p2", [])
    assert err.value.request_id == "p2" and err.value.field == "block_ids"
    with pytest.raises(InvalidInput) as err:
        w.p[0].request_finished("p3", [3], issued_wall_ns=0)
    assert err.value.request_id == "p3" and err.value.field == "issued_wall_ns"


def test_params_are_single_use() -> None:
    """A second load of the same params could read blocks the producer released after the first
    read: refused, whether the first is still live, already reported, or in the same step."""
    w = World()
    params = w.prefill("p1", [1])
    d = w.d[0]
    d.load("x", [3], params)
    with pytest.raises(InvalidInput, match="already loaded by 'x'"):
        d.load("y", [4], params)
    w.run()
    with pytest.raises(InvalidInput, match="single-use"):
        d.load("z", [4], params)
    twice = w.prefill("p2", [2])
    with pytest.raises(InvalidInput, match="params 'a' loads too"):
        d.start_load_kv(ConnectorMetadata(reqs_to_recv={"a": ((5,), twice), "b": ((6,), twice)}))


def test_params_forgotten_by_count_while_their_lease_runs_are_not_read_again() -> None:
    """vLLM issue 52234 ("consumed reference reused"): single-use params are remembered for the
    newest ``tombstones`` loads. Once that many other loads had pushed them out, the same params
    loaded again inside their lease, and the read of a block the producer had released and reused
    was reported received with the other request's bytes. Params forgotten while their lease ran
    are refused until it is over (exactly, for the newest ``tombstones`` of them; by a 10 ms slot of
    issue time past that); other params load as before, and after the lease a reload is failed as
    lease-over, never read."""
    lease = 10**9
    w = World(tombstones=4, lease_ns=lease)
    w.now = 10**9  # a wall clock that says when params were issued
    d, pt = w.d[0], w.pt[0][0]
    params = w.prefill("p1", [3])
    d.load("d1", [10], params)
    sent, recv = w.run(4)
    assert recv == {"d1": 1} and sent == {"p1": 1}
    pt.memory[3 * pt.block_bytes:4 * pt.block_bytes] = pattern("other-request", 3, pt.block_bytes)  # reused
    for i in range(4):  # four more loads: d1's params are pushed out of the remembered ones
        w.now += 1
        d.load(f"n{i}", [20 + i], w.prefill(f"q{i}", [30 + i]))
        w.run(2)
    with pytest.raises(InvalidInput, match="forgotten while their lease still ran"):
        d.load("d1-retry", [40], params)
    w.now += 10_000_000  # the next issue-time slot (10 ms): nothing of it was forgotten
    d.load("fresh", [41], w.prefill("p2", [42]))
    assert w.run(4)[1] == {"fresh": 1}
    w.now += lease + 200  # every forgotten lease is over, the margin too
    d.load("d1-late", [43], params)  # not refused by count: the lease says it all
    _, recv = w.run(4)
    assert recv == {"d1-late": 1} and [f.request_id for f in w.failed] == ["d1-late"]


def test_blocks_a_predecessor_may_still_write_stay_taken() -> None:
    """The old transport's close raised while a read whose cancel did not stop it still wrote
    block 10 (the request never reported): its successor refuses a load into block 10, which that
    read may still write, until the KV cache itself goes (found by review)."""
    w = World()
    w.now = 10**9
    d = w.d[0]
    w.net.script("d1", 0, 0, ReadScript(polls=10**6))
    d.load("d1", [10], w.prefill("p1", [3]))
    w.run(2)
    w.dt[0].cancel_read = lambda *a: None  # type: ignore[method-assign]

    def close() -> None:
        raise RuntimeError("close failed")

    w.dt[0].close = close  # type: ignore[method-assign]
    d.shutdown()
    new = Connector(CoreConfig(engine_id="D", compat_hash="h"), SimTransport(w.net, "D-again"),
                    SimHandshaker(w.net), clock=lambda: w.now, wall_clock=lambda: w.now, predecessor=d)
    with pytest.raises(InvalidInput, match="block 10 is still loaded into by 'd1'"):
        new.load("d2", [10], w.prefill("p2", [4]))
    # Its id stays taken too: a new load under it took the guarded block over, and a later load
    # into block 10 raised a bare StopIteration instead of naming 'd1' (found by review).
    with pytest.raises(InvalidInput, match="'d1' is already in use"):
        new.load("d1", [11], w.prefill("p3", [5]))
    with pytest.raises(InvalidInput, match="block 10 is still loaded into by 'd1'"):
        new.load("d3", [10], w.prefill("p4", [6]))


def test_params_forgotten_past_the_exact_marks_are_refused_by_their_issue_slot() -> None:
    """With more forgotten params than ``tombstones`` exact marks, the oldest keep a mark of their
    engine and 10 ms of issue time: still refused; params of another slot load."""
    w = World(tombstones=1, lease_ns=10**9)
    w.now = 10**9
    d = w.d[0]
    first = w.prefill("p0", [3])
    d.load("d0", [10], first)
    w.run(6)  # reported: no longer live when it is pushed out
    for i in range(1, 4):  # each 10 ms apart: d0 is pushed from loaded, to exact, to its slot
        w.now += 10_000_000
        d.load(f"d{i}", [10 + i], w.prefill(f"p{i}", [3 + i]))
        w.run(6)
    assert ("P", 10**9 // 10_000_000) in d._forgotten and len(d._forgotten_exact) == 1
    with pytest.raises(InvalidInput, match="forgotten while their lease still ran"):
        d.load("again", [20], first)
    w.now += 10_000_000
    d.load("fresh", [21], w.prefill("p9", [9]))


def test_invalid_block_ids_are_handed_out_once() -> None:
    """A worker that asks for invalid blocks every step but collects every few steps: vLLM's
    connectors clear the set when read, and its scheduler maps each id to whoever holds the block
    now. Answered again, d1's failed blocks 5 and 6, given to d2 meanwhile, were marked invalid
    for d2 (found by review). After shutdown those unread then stay."""
    w = World()
    w.now = 10**9
    d = w.d[0]
    w.net.script("d1", 0, 0, ReadScript(polls=0, end="err"))
    d.start_load_kv(ConnectorMetadata(reqs_to_recv={"d1": ((5, 6), w.prefill("p1", [1, 2]))}))
    recv: set[str] = set()
    for _ in range(4):
        w.now += 1000
        recv |= d.get_finished()[1]
        if recv:
            break
    assert recv == {"d1"} and d.get_block_ids_with_load_errors() == {5, 6}
    d.start_load_kv(ConnectorMetadata(reqs_to_recv={"d2": ((5, 6), w.prefill("p2", [3, 4]))}))
    assert d.get_block_ids_with_load_errors() == set()  # a step without get_finished
    w.net.script("d3", 0, 0, ReadScript(polls=0, end="err"))
    d.load("d3", [9], w.prefill("p3", [7]))
    while "d3" not in d.get_finished()[1]:
        w.now += 1000
    d.shutdown()  # d3's block 9 was reported and never asked for: still owed after shutdown, once
    assert d.get_block_ids_with_load_errors() == {9}
    assert d.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("between", ["get_finished", "shutdown"])
def test_a_second_report_before_the_invalid_blocks_are_asked_for_loses_none(between: str) -> None:
    """vLLM's worker keeps failed blocks until get_block_ids_with_load_errors reads them. A worker
    that called get_finished twice (or shut down) before asking lost the first report's: the
    failed request's blocks came back as good data, and the scheduler decoded from them (found
    by a helper's hunt)."""
    w = World()
    w.now = 10**9
    d = w.d[0]
    w.net.script("d1", 0, 0, ReadScript(polls=0, end="err"))
    d.load("d1", [5, 6], w.prefill("p1", [1, 2]))
    d.load("d2", [7], w.prefill("p2", [3]))  # still reading at shutdown: aborted, block 7 invalid
    w.net.script("d2", 0, 0, ReadScript(polls=10**6))
    recv: set[str] = set()
    while "d1" not in recv:
        w.now += 1000
        recv |= d.get_finished()[1]
    if between == "get_finished":
        d.get_finished()
        assert d.get_block_ids_with_load_errors() == {5, 6}
        assert d.get_block_ids_with_load_errors() == set()  # handed out once
    else:
        assert d.shutdown().invalid_block_ids == {7}
        assert d.get_block_ids_with_load_errors() == {5, 6, 7}


def test_a_connector_restarted_in_process_keeps_its_predecessors_params_single_use() -> None:
    """The scheduler restarts its decode Connector while the producer still holds (found by
    review): the new one remembered none of the old one's loads, accepted params the old one had
    loaded and aborted (their notice released the blocks, since reused) and reported them received.
    Built with ``predecessor=``, it refuses them as the old one would have."""
    w = World(lease_ns=10**6)
    w.now = 10**9
    params = w.prefill("p1", [3])
    w.net.script("d1", 0, 0, ReadScript(polls=50))
    w.d[0].load("d1", [10], params)
    w.run(2)
    with pytest.raises(InvalidInput, match="shut down first"):
        Connector(CoreConfig(engine_id="D", compat_hash="h"), SimTransport(w.net, "D-early"), SimHandshaker(w.net),
                  predecessor=w.d[0])
    w.d[0].shutdown()
    restarted = Connector(CoreConfig(engine_id="D", compat_hash="h", lease_margin_ns=100),
                          SimTransport(w.net, "D-again"), SimHandshaker(w.net), clock=lambda: w.now,
                          wall_clock=lambda: w.now, predecessor=w.d[0])
    with pytest.raises(InvalidInput, match="already loaded by 'd1'"):
        restarted.load("d1", [10], params)
    restarted.load("fresh", [11], w.prefill("p2", [4]))  # other params load as ever
    got: set[str] = set()
    for _ in range(6):
        w.now += 10
        got |= restarted.get_finished()[1]
        w.p[0].get_finished()
    assert got == {"fresh"} and not restarted.last.failed


def test_heartbeat_extends_the_producer_lease() -> None:
    w = World(lease_ns=3_000)
    params = w.prefill("p1", [1])
    w.prefill("warm", [2])
    w.d[0].load("warm-d", [3], w.p[0].request_finished("warm2", [4]))  # connects the engine
    w.run(steps=2)
    assert w.d[0].heartbeat(params, 50_000) == 1
    sent, _ = w.run(steps=5)
    assert "p1" not in sent  # still held thanks to the heartbeat


def test_held_says_the_holds_not_released_yet_and_those_shutdown_left() -> None:
    """An embedder checking for leaks tracked holds itself: ``held()`` says them, a copy."""
    w = World()
    params = w.prefill("p1", [1, 2])
    w.prefill("p2", [3])
    assert w.p[0].held() == {"p1": (1, 2), "p2": (3,)}
    w.d[0].load("d1", [5, 6], params)
    sent, _ = w.run()
    assert sent == {"p1": 1}
    assert w.p[0].held() == {"p2": (3,)}
    w.p[0].held().clear()  # a copy: the connector's books are its own
    w.p[0].shutdown()
    assert w.p[0].held() == {"p2": (3,)}  # shutdown reports no hold: the scheduler frees it



def test_a_sim_listener_whose_reply_raises_fails_the_handshake_at_once() -> None:
    """An embedder's ``reply_for`` with a bug (a HandshakeReply missing a field) raised out of the
    sim handshaker's progress(): the Connector logged it and polled again, every other pending
    handshake waited too, and the request hung until the handshake timeout (60 s by default).
    Now it is an error answer, as the side channel gives: the handshake fails and the request
    is reported failed with the error named."""
    w = World()
    params = w.prefill("p1", [1, 2])

    def broken(pp: int) -> object:
        raise TypeError("Missing required argument 'compat_hash'")

    w.net.serve("127.0.0.1", 9, broken)  # type: ignore[arg-type]
    w.d[0].load("d1", [5, 6], params)
    _, recv = w.run(steps=4)
    assert recv == {"d1": 1}
    (failed,) = w.failed
    assert failed.request_id == "d1" and "reply_for raised TypeError" in failed.reason, failed
