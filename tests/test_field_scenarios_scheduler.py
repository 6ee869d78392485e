"""Review s13: the scheduler-facing Connector under how vLLM's scheduler really behaves.

Each test drives Connectors over the simulated transport through a sequence a real serving
scheduler produces (aborts, handshake outages, prefix sharing, id reuse, shutdown with work in
flight, router-shaped params) and asserts what docs/embedding.md promises.
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest
from helpers import LeaseWorld, prefix_hit, reply

from pdfsm.commands import HandOff
from pdfsm.connector import Connector, ConnectorMetadata, KVTransferParams
from pdfsm.errors import InvalidInput
from pdfsm.events import CoreConfig, NotificationReceived
from pdfsm.fsm import Fault
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern


class Rig:
    """Prefill engine P (TP ``p_tp``) and decode engine D (TP ``d_tp``) on one simulated network and
    one shared clock; each step is a vLLM step: ``get_finished(finished_req_ids)`` then
    ``get_block_ids_with_load_errors()`` on every worker, reports counted per request."""

    def __init__(self, *, p_tp: int = 1, d_tp: int = 1, d_cfg: dict[str, Any] | None = None,
                 p_cfg: dict[str, Any] | None = None, num_blocks: int = 128) -> None:
        self.net, self.now = SimNetwork(), 0
        self.p_tp, self.d_tp = p_tp, d_tp
        self.pt = [SimTransport(self.net, f"P-{t}", tp_rank=t, num_blocks=num_blocks, block_bytes=64 // p_tp)
                   for t in range(p_tp)]
        for t in self.pt:
            t.fill(range(num_blocks))
        self.p = [Connector(CoreConfig(engine_id="P", compat_hash="h", tp_rank=t, tp_size=p_tp, **(p_cfg or {})),
                            self.pt[t], SimHandshaker(self.net), clock=self.clock, port=9) for t in range(p_tp)]
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", tp_size=p_tp,
                                                        ranks=tuple(t.rank_info() for t in self.pt)))
        self.dt = [SimTransport(self.net, f"D-{t}", tp_rank=t, num_blocks=num_blocks, block_bytes=64 // d_tp)
                   for t in range(d_tp)]
        self.d = [Connector(CoreConfig(engine_id="D", compat_hash="h", tp_rank=t, tp_size=d_tp, lease_margin_ns=100,
                                       **(d_cfg or {})), self.dt[t], SimHandshaker(self.net), clock=self.clock)
                  for t in range(d_tp)]
        self.recv: list[dict[str, int]] = [{} for _ in range(d_tp)]
        self.sent: list[dict[str, int]] = [{} for _ in range(p_tp)]
        self.invalid: list[dict[str, set[int]]] = [{} for _ in range(d_tp)]  # per request, its step's set
        self.failed: list[dict[str, HandOff]] = [{} for _ in range(d_tp)]
        self.aborted: list[set[str]] = [set() for _ in range(d_tp)]
        self.step_invalid: list[list[set[int]]] = [[] for _ in range(d_tp)]

    def clock(self) -> int:
        return self.now

    def prefill(self, rid: str, blocks: list[int]) -> KVTransferParams:
        stamp = time.time_ns()  # the scheduler's one stamp for every rank's hold (docs/embedding.md)
        every = [p.request_finished(rid, blocks, issued_wall_ns=stamp) for p in self.p]  # each rank holds its part
        return every[0]

    def load(self, rid: str, local: list[int], params: Any) -> None:
        for d in self.d:
            d.load(rid, local, params, computed_blocks=prefix_hit(params, local))

    def step(self, n: int = 1, dt: int = 1_000) -> None:
        for _ in range(n):
            self.now += dt
            for r, d in enumerate(self.d):
                _, got = d.get_finished(set())
                bad = d.get_block_ids_with_load_errors()
                self.step_invalid[r].append(set(bad))
                for rid in got:
                    self.recv[r][rid] = self.recv[r].get(rid, 0) + 1
                    self.invalid[r][rid] = set(bad)
                for f in d.last.failed:
                    self.failed[r][f.request_id] = f
                self.aborted[r] |= d.last.aborted
            for r, p in enumerate(self.p):
                for rid in p.get_finished(set())[0]:
                    self.sent[r][rid] = self.sent[r].get(rid, 0) + 1

    def block_ok(self, d_rank: int, local: int, remote: int) -> bool:
        """Decode rank ``d_rank``'s block ``local`` holds prefill block ``remote`` (TP 1 to TP 1)."""
        assert self.p_tp == 1 and self.d_tp == 1
        return self.dt[d_rank].block(local) == pattern(self.pt[0].agent, remote, self.pt[0].block_bytes)


# --- 1. a step refused whole must say which request was bad ------------------------------------------


@pytest.mark.parametrize("bad", ["no_remote_tp_size", "more_local_blocks", "params_already_loaded",
                                 "negative_block"])
def test_a_refused_step_names_the_request_that_was_bad(bad: str) -> None:
    """``start_load_kv``'s docstring: "Every entry is checked before any is submitted: a bad one
    raises InvalidInput naming it, and the step is refused whole". A vLLM step carries hundreds of
    ``reqs_to_recv`` entries built from router params; when one is refused the whole step is, so the
    embedder must learn which request to fail (recompute) and resubmit the others. The error must
    name that request's id, not only a field every entry has."""
    rig = Rig()
    good = rig.prefill("p-good", [1, 2])
    other = rig.prefill("p-bad", [3, 4])
    entry: tuple[Any, Any]
    if bad == "no_remote_tp_size":
        d = other.to_dict()
        del d["remote_tp_size"]
        entry = ((7, 8), d)
    elif bad == "more_local_blocks":
        entry = ((7, 8, 9), other)
    elif bad == "params_already_loaded":
        rig.d[0].load("earlier", [20, 21], other)
        entry = ((7, 8), other)
    else:
        entry = ((7, -8), other)
    meta = ConnectorMetadata(reqs_to_recv={"req-good-0001": ((5, 6), good), "req-BAD-0002": entry})  # type: ignore[dict-item]
    with pytest.raises(InvalidInput) as err:
        rig.d[0].start_load_kv(meta)
    assert "req-BAD-0002" in str(err.value), f"the error does not say which request: {err.value}"


# --- 2. many requests against one engine whose handshake fails, then succeeds ------------------------


def test_many_requests_waiting_on_one_refused_handshake_then_the_engine_comes_back() -> None:
    """vLLM PR 40364 / issue 55181: a failed handshake must take every waiting request to a terminal
    report under the failure policy, not leave them pending. Twenty requests of one step wait on one
    handshake to a prefill whose side channel refuses: each is reported exactly once, failed with
    ``recompute``, its own blocks (and only those) invalid in that step. The scheduler then reuses
    those same blocks for the next wave: once the retry pause has passed and the prefill answers,
    every new request reads the right bytes and every prefill hold is released exactly once."""
    rig = Rig(d_cfg={"handshake_retry_ns": 50_000})
    rig.net.handshake_faults[("127.0.0.1", 9)] = "refuse"
    n = 20
    first: dict[str, tuple[tuple[int, ...], KVTransferParams]] = {
        f"a{i}": ((2 * i, 2 * i + 1), rig.prefill(f"pa{i}", [i, i + 1])) for i in range(n)}
    rig.d[0].start_load_kv(ConnectorMetadata(reqs_to_recv=first))
    rig.step(4)
    assert rig.recv[0] == {f"a{i}": 1 for i in range(n)}
    assert {rid: f.policy for rid, f in rig.failed[0].items()} == {f"a{i}": "recompute" for i in range(n)}
    assert all(set(rig.failed[0][f"a{i}"].invalid_blocks) == {2 * i, 2 * i + 1} for i in range(n))
    assert set().union(*rig.step_invalid[0]) == set(range(2 * n))
    del rig.net.handshake_faults[("127.0.0.1", 9)]
    rig.now += 100_000  # past the retry pause
    second: dict[str, tuple[tuple[int, ...], KVTransferParams]] = {
        f"b{i}": ((2 * i, 2 * i + 1), rig.prefill(f"pb{i}", [i + 1, i + 2])) for i in range(n)}
    rig.d[0].start_load_kv(ConnectorMetadata(reqs_to_recv=second))
    rig.step(4)
    assert {rid: c for rid, c in rig.recv[0].items() if rid.startswith("b")} == {f"b{i}": 1 for i in range(n)}
    assert not any(rid.startswith("b") for rid in rig.failed[0])
    assert all(rig.block_ok(0, 2 * i, i + 1) and rig.block_ok(0, 2 * i + 1, i + 2) for i in range(n))
    assert rig.sent[0] == {f"pb{i}": 1 for i in range(n)}  # the a-wave holds wait for their lease
    assert not rig.d[0].core.violations[Fault.LOCAL]


# --- 3. prefill holds that share prefix blocks ----------------------------------------------------------


def test_two_prefill_holds_sharing_prefix_blocks_are_both_held_and_each_released_once() -> None:
    """vLLM's prefix cache on the prefill side: two requests with a common system prompt share their
    first physical blocks (reference-counted), and both finish with ``request_finished`` naming them.
    Both holds must be accepted, each decode request reads its own full block list, and each hold is
    reported in ``finished_sending`` exactly once, after its own reader, not the other's."""
    rig = Rig()
    pa = rig.prefill("pa", [1, 2, 3])
    pb = rig.prefill("pb", [1, 2, 4])  # the same prefix blocks 1 and 2
    rig.net.script("db", 0, 0, ReadScript(polls=6))
    rig.load("da", [10, 11, 12], pa)
    rig.load("db", [20, 21, 22], pb)
    rig.step(3)
    assert rig.sent[0] == {"pa": 1}, "pb released before its own reader finished"
    rig.step(6)
    assert rig.recv[0] == {"da": 1, "db": 1} and rig.sent[0] == {"pa": 1, "pb": 1}
    assert all(rig.block_ok(0, lb, rb) for lb, rb in ((10, 1), (11, 2), (12, 3), (20, 1), (21, 2), (22, 4)))


# --- 4. shutdown while a failed request still waits for a sibling read ----------------------------------


def test_shutdown_with_a_failing_request_whose_sibling_read_hangs_reports_it_once() -> None:
    """Prefill TP 2, decode TP 1: each decode request posts two reads. One ended ERR, the other hangs
    (NIXL has no stall timeout), so the request is FAILING, waiting for the sibling. The worker shuts
    down: docs/embedding.md promises the last report holds "every request not reported before" and
    that nothing is reported after it. The request must be in it once, its blocks invalid, and no
    read may be left in flight."""
    rig = Rig(p_tp=2)
    real_cancel = rig.dt[0].cancel_read
    rig.dt[0].cancel_read = lambda request_id, pp_rank, tp_rank: None  # type: ignore[method-assign]
    params = rig.prefill("p1", [1, 2])
    rig.net.script("d1", 0, 1, ReadScript(polls=0, end="err"))
    rig.net.script("d1", 0, 0, ReadScript(end="hang"))
    rig.load("d1", [5, 6], params)
    for _ in range(4):
        rig.d[0].step()
    assert rig.d[0].core.consumers["d1"].state.name == "FAILING"
    rig.dt[0].cancel_read = real_cancel  # type: ignore[method-assign]  # close() releases, as NIXL's does
    out = rig.d[0].shutdown()
    assert out.finished_recving == {"d1"} and {5, 6} <= out.invalid_block_ids
    assert not rig.dt[0].reads


# --- 5. a request id reused after it finished ------------------------------------------------------------


def test_a_request_id_reused_once_forgotten_loads_and_is_reported_once() -> None:
    """Client-supplied request ids (vLLM's X-Request-Id, before PR 27987's suffix) come back: the same
    id is loaded again long after the first request with it finished. Once pdfsm has forgotten the
    first (past ``tombstones`` later requests), the new request must be an ordinary request: read,
    reported exactly once, with the right bytes, and the old request's report not repeated."""
    rig = Rig(d_cfg={"tombstones": 2}, p_cfg={"tombstones": 2})
    rig.load("x", [5, 6], rig.prefill("p-x", [1, 2]))
    rig.step(3)
    assert rig.recv[0] == {"x": 1}
    for i in range(3):
        rig.load(f"f{i}", [10 + i], rig.prefill(f"pf{i}", [3]))
    rig.step(3)
    rig.load("x", [7, 8], rig.prefill("p-x2", [3, 4]))
    rig.step(3)
    assert rig.recv[0]["x"] == 2 and not rig.failed[0]
    assert rig.block_ok(0, 7, 3) and rig.block_ok(0, 8, 4)
    assert rig.sent[0].get("p-x2") == 1


# --- 6. block reuse around an abort whose read outran its cancel -----------------------------------------


def test_blocks_of_an_aborting_request_stay_busy_until_it_is_reported_then_are_reusable() -> None:
    """SGLang PR 35049 / vLLM PR 32255: a decode request aborted mid-transfer must keep its blocks
    until the transfer stopped, or the next request given them is overwritten. With NIXL's default
    cancel (the read keeps running), the aborted request is ABORTING: a load into its blocks is
    refused. Once its read stopped it is reported (aborted, blocks invalid) and the same blocks load
    cleanly for the next request."""
    rig = Rig()
    rig.dt[0].cancel_read = lambda request_id, pp_rank, tp_rank: None  # type: ignore[method-assign]
    rig.net.script("d1", 0, 0, ReadScript(polls=12))
    rig.load("d1", [5, 6], rig.prefill("p1", [1, 2]))
    rig.step(2)
    assert rig.d[0].core.consumers["d1"].state.name == "READING"
    rig.d[0].abort("d1")
    rig.step(1)
    assert rig.d[0].core.consumers["d1"].state.name == "ABORTING" and not rig.recv[0]
    nxt = rig.prefill("p2", [3, 4])
    with pytest.raises(InvalidInput) as err:
        rig.d[0].load("d2", [6, 7], nxt)
    assert err.value.field == "local_block_ids"
    rig.step(12)
    assert rig.recv[0] == {"d1": 1} and "d1" in rig.aborted[0]
    rig.load("d2", [6, 7], nxt)
    rig.step(3)
    assert rig.recv[0]["d2"] == 1 and rig.invalid[0]["d2"] == set()
    assert rig.block_ok(0, 6, 3) and rig.block_ok(0, 7, 4)


# --- 7. params as a router really forwards them -----------------------------------------------------------


def test_params_round_tripped_through_a_json_router_with_extra_keys_load() -> None:
    """The router receives ``kv_transfer_params`` as JSON in the prefill response and forwards them
    in the decode request's JSON body, adding its own keys (vLLM's ``do_remote_prefill`` flags, a
    ``tp_size`` beside pdfsm's ``remote_tp_size``). Block ids come back as a JSON list. Such a dict
    must load and read the right bytes."""
    rig = Rig()
    params = rig.prefill("p1", [4, 7])
    body = json.loads(json.dumps({**params.to_dict(), "do_remote_prefill": True, "do_remote_decode": False,
                                  "tp_size": 1, "router_hint": {"pool": "a"}}))
    assert isinstance(body["remote_block_ids"], list)
    rig.d[0].load("d1", [5, 6], body)
    rig.step(3)
    assert rig.recv[0] == {"d1": 1} and rig.invalid[0]["d1"] == set()
    assert rig.block_ok(0, 5, 4) and rig.block_ok(0, 6, 7) and rig.sent[0] == {"p1": 1}


# --- 8. decode TP 2, aborted while one rank finished and the other still reads ----------------------------


def test_decode_tp2_abort_with_one_rank_done_reports_once_per_rank_and_releases_once() -> None:
    """vLLM aggregates ``finished_recving`` over decode workers (a request is done once every worker
    reported it) and unions their invalid blocks. A request aborted while rank 0's read completed
    and rank 1's still runs: each rank must report it exactly once; the union must mark the blocks
    invalid (rank 1's slice was never written); the prefill hold (two consumer parts) is released
    exactly once, only after rank 1's read stopped."""
    rig = Rig(d_tp=2)
    params = rig.prefill("p1", [1, 2])
    rig.dt[1].cancel_read = lambda request_id, pp_rank, tp_rank: None  # type: ignore[method-assign]
    rig.net.script("d1", 0, 0, ReadScript(polls=0))
    rig.d[0].load("d1", [5, 6], params)
    for _ in range(4):
        rig.d[0].step()
    rig.net.script("d1", 0, 0, ReadScript(polls=8, end="err"))  # rank 1's read is slow, then fails
    rig.d[1].load("d1", [5, 6], params)
    for _ in range(3):
        rig.d[1].step()
    assert rig.d[0].core.consumers["d1"].state.name == "NOTIFIED"
    assert rig.d[1].core.consumers["d1"].state.name == "READING"
    for d in rig.d:
        d.abort("d1")
    rig.step(2)
    assert not rig.sent[0], "released while decode rank 1 still reads"
    rig.step(10)
    assert rig.recv == [{"d1": 1}, {"d1": 1}]
    assert {5, 6} <= rig.invalid[0]["d1"] | rig.invalid[1]["d1"]
    assert rig.sent[0] == {"p1": 1}


# --- 9. a randomized vLLM-like scheduler against the contract -------------------------------------------


def _content(hold: str, idx: int, rank: int, size: int) -> bytes:
    return pattern(f"{hold}/{rank}", idx, size)


class _Sched:
    """A toy vLLM pair of schedulers on a Rig: block pools on both sides, holds written with
    per-hold content when allocated and zeroed when ``finished_sending`` frees them (reuse), loads
    into free decode blocks, aborts, prefix hits, read faults, handshake outages, peer deaths."""

    def __init__(self, seed: int, p_tp: int, wait_cancel: bool, lease_ns: int = 60_000) -> None:
        import random

        self.rnd = random.Random(seed)
        self.rig = Rig(p_tp=p_tp, num_blocks=96, p_cfg={"lease_ns": lease_ns},
                       d_cfg={"read_timeout_ns": 25_000, "handshake_retry_ns": 3_000})
        if wait_cancel:
            self.real_cancel = self.rig.dt[0].cancel_read
            self.rig.dt[0].cancel_read = lambda request_id, pp_rank, tp_rank: None  # type: ignore[method-assign]
        self.p_free = list(range(96))
        self.d_free = list(range(96))
        self.holds: dict[str, tuple[int, ...]] = {}  # live prefill holds
        self.released: dict[str, int] = {}
        self.loads: dict[str, tuple[tuple[int, ...], int, str]] = {}  # live: local, first remote index, hold
        self.reported: dict[str, int] = {}
        self.ranks_done: dict[str, list[int]] = {}
        self.queue: list[Any] = []
        self.queue_delays = True
        self.n = 0
        self.errors: list[str] = []

    def new_request(self) -> None:
        rig, rnd = self.rig, self.rnd
        k = rnd.randint(1, 3)
        if len(self.p_free) < k or len(self.d_free) < k:
            return
        self.n += 1
        hold, rid = f"p{self.n}", f"d{self.n}"
        blocks = tuple(self.p_free.pop(rnd.randrange(len(self.p_free))) for _ in range(k))
        for t, pt in enumerate(rig.pt):
            for i, b in enumerate(blocks):
                pt.memory[b * pt.block_bytes:(b + 1) * pt.block_bytes] = _content(hold, i, t, pt.block_bytes)
        stamp = time.time_ns()  # the scheduler's one stamp for every rank's hold
        every = [p.request_finished(hold, list(blocks), issued_wall_ns=stamp) for p in rig.p]
        params = every[0]
        self.holds[hold] = blocks
        local_n = rnd.choice([k, k, k, k - 1, 0]) if k > 1 else rnd.choice([1, 1, 1, 0])
        local = tuple(self.d_free.pop(rnd.randrange(len(self.d_free))) for _ in range(local_n))
        for t in range(rig.p_tp):
            kind = rnd.random()
            if kind < 0.15:
                rig.net.script(rid, 0, t, ReadScript(polls=rnd.randint(0, 3), end=rnd.choice(["err", "raise"])))
            elif kind < 0.3:
                rig.net.script(rid, 0, t, ReadScript(polls=rnd.randint(3, 40)))
        delay = rnd.choice([0, 0, 0, 5, 20, 70]) if self.queue_delays else 0
        self.queue.append((rig.now + delay * 1_000, rig.now, rid, local, params, blocks, hold))
        self.flush_queue()

    def flush_queue(self) -> None:
        rig, rnd = self.rig, self.rnd
        keep = []
        for item in self.queue:
            if item[0] > rig.now:
                keep.append(item)
                continue
            _, issued, rid, local, params, blocks, hold = item
            if rnd.random() < 0.1:  # aborted while queued: released notify-only, as the docs say
                rig.d[0].load(rid, [], params, lease_start_ns=issued)
                self.d_free += local
                continue
            self.load_one(rid, local, params, blocks, hold, issued)
        self.queue = keep

    def load_one(self, rid: str, local: tuple[int, ...], params: Any, blocks: tuple[int, ...], hold: str,
                 issued: int) -> None:
        rig = self.rig
        try:
            rig.d[0].load(rid, list(local), params, lease_start_ns=issued, computed_blocks=prefix_hit(params, local))
        except InvalidInput as exc:
            self.errors.append(f"load of {rid} into free blocks {local} refused: {exc}")
            self.d_free += local
            return
        if local:
            self.loads[rid] = (local, len(blocks) - len(local), hold)

    def step(self) -> None:
        rig = self.rig
        rig.now += 1_000
        d = rig.d[0]
        _, got = d.get_finished(set())
        invalid = d.get_block_ids_with_load_errors()
        last = d.last
        bad = {f.request_id for f in last.failed} | set(last.aborted)
        if not bad <= got:
            self.errors.append(f"failed/aborted {bad - got} not among finished_recving")
        mine: set[int] = set()
        for rid in got:
            self.reported[rid] = self.reported.get(rid, 0) + 1
            if self.reported[rid] > 1:
                self.errors.append(f"{rid} reported twice")
                continue
            if rid not in self.loads:
                self.errors.append(f"{rid} reported but never loaded with blocks (notify-only or unknown)")
                continue
            local, first, hold = self.loads.pop(rid)
            mine |= set(local)
            if rid in {f.request_id for f in last.failed} and not set(local) <= invalid:
                self.errors.append(f"{rid} failed but its blocks {local} are not all invalid")
            if not set(local) & invalid:
                for i, lb in enumerate(local):
                    want = b"".join(_content(hold, first + i, t, rig.pt[t].block_bytes) for t in range(rig.p_tp))
                    if rig.dt[0].block(lb) != want:
                        self.errors.append(f"{rid} reported with valid block {lb} holding the wrong bytes "
                                           f"(outcome {'aborted' if rid in last.aborted else 'received'})")
                        break
            self.d_free += local
        if not invalid <= mine:
            self.errors.append(f"invalid blocks {invalid - mine} belong to no request reported this step")
        expired: set[str] = set()
        for t, p in enumerate(rig.p):  # vLLM's KVOutputAggregator: finished once every worker said so
            for hold in p.get_finished(set())[0]:
                self.ranks_done.setdefault(hold, []).append(t)
            expired |= p.last.expired
        for hold, ranks in list(self.ranks_done.items()):
            if sorted(ranks) != list(range(rig.p_tp)):
                if len(ranks) != len(set(ranks)):
                    self.errors.append(f"{hold} released twice by one rank")
                continue
            del self.ranks_done[hold]
            self.released[hold] = self.released.get(hold, 0) + 1
            if self.released[hold] > 1:
                self.errors.append(f"{hold} released twice")
                continue
            if hold not in expired:
                live = [k for k, r in rig.dt[0].reads.items() if r.cmd.notification.request_id == hold]
                if live:
                    self.errors.append(f"{hold} released by notification with reads in flight {live}")
            blocks = self.holds.pop(hold)
            for pt in rig.pt:  # the prefill scheduler reuses them at once
                for b in blocks:
                    pt.memory[b * pt.block_bytes:(b + 1) * pt.block_bytes] = bytes(pt.block_bytes)
            self.p_free += blocks


def _run_sched(seed: int, p_tp: int, wait_cancel: bool, lease_ns: int = 60_000) -> list[str]:
    s = _Sched(seed, p_tp, wait_cancel, lease_ns)
    rnd, rig, new_request = s.rnd, s.rig, s.new_request
    for _ in range(120):
        for _ in range(rnd.randint(0, 3)):
            new_request()
        s.flush_queue()
        r = rnd.random()
        if r < 0.15 and s.loads:
            rig.d[0].abort(rnd.choice(sorted(s.loads)))
        elif r < 0.18:
            rig.net.handshake_faults[("127.0.0.1", 9)] = "refuse"
        elif r < 0.25:
            rig.net.handshake_faults.pop(("127.0.0.1", 9), None)
        elif r < 0.27 and p_tp == 1:
            rig.net.kill(rig.pt[0].agent)
        elif r < 0.32:
            rig.net.revive(rig.pt[0].agent)
        s.step()
    rig.net.handshake_faults.clear()
    rig.net.revive(rig.pt[0].agent)
    if wait_cancel:
        for rid in list(s.loads):
            rig.d[0].abort(rid)
    for _ in range(120):
        s.flush_queue()
        s.step()
    if s.loads:
        s.errors.append(f"never reported: {sorted(s.loads)}")
    if s.holds:
        s.errors.append(f"holds never released: {sorted(s.holds)}")
    return s.errors


@pytest.mark.parametrize("p_tp", [1, 2])
@pytest.mark.parametrize("wait_cancel", [False, True])
def test_a_randomized_vllm_like_scheduler_never_sees_the_contract_broken(p_tp: int, wait_cancel: bool) -> None:
    """docs/embedding.md's contract under a toy vLLM scheduler on both sides: the prefill frees and
    reuses its blocks the moment ``finished_sending`` names them (zeroing them here), the decode
    loads only into free blocks and frees them the moment ``finished_recving`` names the request.
    Requests arrive every step with read faults, slow reads, partial and full prefix hits, aborts at
    any point, handshake outages and producer deaths. Each loaded request must be reported exactly
    once, failed and aborted ones among ``finished_recving``, the step's invalid blocks exactly
    those of the requests it reported failed (or aborted and unread), every block reported valid
    must hold the producer's bytes (never reused memory), loads into free blocks are never refused,
    and every hold is released exactly once, never by notification while a read of it runs."""
    problems: dict[int, list[str]] = {}
    for seed in range(8):
        errs = _run_sched(seed, p_tp, wait_cancel, lease_ns=12_000 if seed % 2 else 60_000)
        if errs:
            problems[seed] = errs[:3]
    assert not problems, problems


# --- 10. a lease that started before the connector's clock reading began ---------------------------------


@pytest.mark.parametrize("how", ["lease_ages", "issued_wall_ns"])
def test_a_lease_older_than_the_clock_reading_is_not_restarted_at_zero(how: str) -> None:
    """docs/embedding.md: through ``start_load_kv`` "the worker counts the lease from ``now - age``",
    and params that say when they were issued start the lease no later than ``now - transit``. A
    connector's clock is any ``Clock`` (a process-relative one, or CLOCK_MONOTONIC on a fresh boot
    reads small): right after a decode worker (re)starts, a router retry hands it params that spent
    50 us of a 60 us lease on the way. The producer's lease ends 10 us from now, so a read that
    completes 30 us from now may have copied reused blocks and must not be trusted. pdfsm clamps
    ``now - age`` (and ``now - transit``) to 0, counting the lease from the clock's zero: 59.9 us
    of trust instead of 9.9 us."""
    wall = [10**18]
    rig = Rig()
    rig.d[0]._wall_clock = lambda: wall[0]  # the decode host's wall clock (agrees with the prefill's)
    params = rig.prefill("p1", [1, 2])
    params = msgspec.structs.replace(params, lease_ns=60_000, issued_wall_ns=0)
    rig.now = 1_000  # the decode worker's clock reads 1 us
    rig.net.script("d1", 0, 0, ReadScript(polls=30))  # completes ~30 us from now
    if how == "lease_ages":
        rig.d[0].start_load_kv(ConnectorMetadata(reqs_to_recv={"d1": ((5, 6), params)}, lease_ages={"d1": 50_000}))
    else:
        params = msgspec.structs.replace(params, issued_wall_ns=wall[0] - 50_000)
        rig.d[0].load("d1", [5, 6], params)
    rig.d[0].step()
    m = rig.d[0].core.consumers.get("d1")
    rig.step(40)
    assert rig.recv[0] == {"d1": 1}
    assert rig.invalid[0]["d1"] == {5, 6}, (
        f"a read completing ~30 us after the load was trusted (trust bound {m.trust if m else '?'} ns, "
        f"the producer's lease ended at 11000 ns)")


def test_vllm_pr_50558_one_more_decode_block_than_the_producer_holds_is_refused_then_trimmed() -> None:
    """vLLM PR 50558: a proxy appends the first sampled token to the decode prompt; when the
    prefill prompt filled its last block exactly, the decode worker allocates one block more than
    the producer holds, and vLLM's assertion crashed the request. pdfsm refuses the load at once
    (InvalidInput naming local_block_ids; nothing accepted, so the same params load afterwards);
    the embedder passes the first len(remote_block_ids) local blocks (docs/embedding.md), the
    last one is computed locally, and the read pairs block for block."""
    w = LeaseWorld()
    w.connect()
    params = w.p.request_finished("p1", [4, 5, 6])
    with pytest.raises(InvalidInput) as err:
        w.d.load("d1", [10, 11, 12, 13], params)
    assert err.value.field == "local_block_ids" and "4 local blocks for 3 remote" in str(err.value)
    w.d.load("d1", [10, 11, 12], params)
    w.run(3)
    assert (w.received, w.released, w.failed) == (["d1"], ["p1"], {})
    assert w.read_bytes_ok([10, 11, 12], [4, 5, 6])


# --- a worker that both loads and holds (kv_both) ------------------------------------------------------


class KvBoth:
    """Engine P (prefill) and engine W, whose worker both loads from P and holds for others."""

    def __init__(self) -> None:
        self.net, self.now = SimNetwork(), 0
        self.pt, self.wt = SimTransport(self.net, "P-0"), SimTransport(self.net, "W-0")
        self.pt.fill(range(64))
        self.wt.fill(range(64))
        self.p = Connector(CoreConfig(engine_id="P", compat_hash="h"), self.pt, SimHandshaker(self.net),
                           clock=self.clock, port=9)
        self.w = Connector(CoreConfig(engine_id="W", compat_hash="h", lease_margin_ns=100), self.wt,
                           SimHandshaker(self.net), clock=self.clock, port=10)
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(self.pt.rank_info(),), num_blocks=64))
        self.reports: list[tuple[set[str], set[str]]] = []

    def clock(self) -> int:
        return self.now

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.now += 1_000
            self.reports.append(self.w.get_finished())
            self.p.get_finished()


def test_vllm_issue_46240_a_hold_of_blocks_a_read_may_still_write_is_refused_until_it_is_reported() -> None:
    """vLLM issue 46240 (kv_both): a decode request aborted while its KV still arrived got
    ``request_finished`` anyway, so the producer role offered blocks an in-flight READ still
    wrote; a second decode engine could read them before the READ landed, and be reported
    received over the wrong bytes. One Connector serves both roles here: a hold of a block a live
    load may still write is refused, as a second load into it is, naming the loading request;
    once that request is reported, the same hold is accepted."""
    k = KvBoth()
    k.net.script("r", 0, 0, ReadScript(end="hang"))
    k.w.load("r", [5, 6], k.p.request_finished("p-r", [1, 2]))
    k.step(2)
    assert k.w.core.consumers["r"].state.name == "READING"
    k.w.abort("r")
    for rid, blocks in (("r", [5, 6]), ("other", [6, 7])):
        with pytest.raises(InvalidInput, match="still loaded into by 'r'") as err:
            k.w.request_finished(rid, blocks)
        assert err.value.field == "block_ids"
    with pytest.raises(InvalidInput, match=r"reqs_to_send\['other'\].*still loaded into by 'r'"):
        k.w.start_load_kv(ConnectorMetadata(reqs_to_send={"other": (6, 7)}))
    k.step(3)  # the cancel lands, the read stops, r is reported
    assert any("r" in recving for _, recving in k.reports)
    params = k.w.request_finished("r", [5, 6])  # the blocks are the scheduler's again
    assert params.remote_block_ids == (5, 6)


def test_a_load_into_blocks_held_for_a_remote_consumer_is_refused_until_they_are_released() -> None:
    """The reverse (kv_both): blocks held for a remote decode may still be read by it; a load into
    them would overwrite the bytes under that read. Refused naming the hold, also when the hold
    and the load come in one step (the step is refused whole); accepted once the hold is released."""
    k = KvBoth()
    k.w.request_finished("h", [5, 6])
    with pytest.raises(InvalidInput, match="block 5 is held for 'h'") as err:
        k.w.load("r", [5, 6], k.p.request_finished("p-r", [1, 2]))
    assert err.value.field == "local_block_ids"
    params = k.p.request_finished("p-s", [3, 4])
    with pytest.raises(InvalidInput, match=r"reqs_to_send\['h2'\]\.block_ids: holds local block 8, which 's'"):
        k.w.start_load_kv(ConnectorMetadata(reqs_to_recv={"s": ((8, 9), params)}, reqs_to_send={"h2": (8,)}))
    assert "s" not in k.w.core.consumers and "h2" not in k.w.core.producers  # nothing of the step taken
    k.w.core.submit(NotificationReceived(source="transfer", t_ns=k.now, request_id="h", part=0, of=1))  # read
    k.step(2)
    assert any("h" in sending for sending, _ in k.reports)  # released: the blocks are free to load into
    k.w.load("r", [5, 6], k.p.request_finished("p-r2", [1, 2]))
    k.step(4)
    assert any("r" in recving for _, recving in k.reports) and k.wt.block(5) == pattern("P-0", 1, 64)


def test_a_notify_only_load_keeps_its_worker_busy_until_the_producer_is_told() -> None:
    """A full prefix hit is loaded notify-only and never reported, so vLLM tracks nothing and may
    stop stepping the decode engine after the step that carried it; a handshake slower than one
    step's rounds (any real TCP one) then left the notice unsent, and the producer held the blocks
    until its lease (found by a helper's hunt). ``busy()`` says when the worker still has work
    only its steps move: stepping while it is true tells the producer, then it is false."""
    rig = Rig()
    rig.net.handshake_polls = 40
    d = rig.d[0]
    assert not d.busy()
    params = rig.prefill("p1", [1, 2])
    d.start_load_kv(ConnectorMetadata(reqs_to_recv={"r1": ((), params)}))
    assert d.busy() and d.core.consumers["r1"].state.name == "HANDSHAKING"  # the step ended mid-handshake
    steps = 0
    while d.busy():
        rig.step()
        steps += 1
        assert steps < 100
    rig.step()
    assert rig.sent[0] == {"p1": 1} and rig.recv[0] == {}  # told once; a notify-only load is never reported
    rig.load("r2", [5, 6], rig.prefill("p2", [3, 4]))
    assert d.busy()
    while d.busy():
        rig.step()
    assert rig.recv[0] == {"r2": 1} and not d.busy()
    d.shutdown()
    assert not d.busy()


def test_a_report_waiting_for_get_finished_keeps_the_worker_busy() -> None:
    """``start_load_kv`` runs a step that may finish a hold: its report waits for the next
    ``get_finished``. ``busy()`` said False then (found by review), and a loop stopping once not
    busy lost the report: the scheduler never freed the blocks."""
    rig = Rig()
    p = rig.p[0]
    rig.load("r", [5, 6], rig.prefill("p1", [1, 2]))
    for _ in range(6):  # the decode side reads and notifies; the producer is not stepped
        rig.now += 1_000
        rig.d[0].get_finished()
    p.start_load_kv(ConnectorMetadata())  # the step that applies the notice
    assert p.busy() and not p.core.producers  # released: only its report is left
    assert p.get_finished()[0] == {"p1"} and not p.busy()
