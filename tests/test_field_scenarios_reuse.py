"""Real-world PD transfer failure scenarios not in the bug corpus, driven through the
public API (``Connector`` over the deterministic sim transport).

Each test names its real source and asserts the outcome the contract (docs/embedding.md,
docs/decisions.md) or safety requires.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers import prefix_hit, reply

from pdfsm.connector import Connector, KVTransferParams
from pdfsm.errors import InvalidInput
from pdfsm.events import CoreConfig
from pdfsm.fsm import Fault
from pdfsm.wire import Notification
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern

WALL0 = 10**18


class Rig:
    """Prefill engine P (TP ``p_tp``) and decode engine D (TP ``d_tp``) on one simulated network,
    one shared monotonic clock and one shared wall clock (the hosts' clocks agree)."""

    def __init__(self, *, p_tp: int = 1, d_tp: int = 1, d_cfg: dict[str, Any] | None = None,
                 p_cfg: dict[str, Any] | None = None, num_blocks: int = 64) -> None:
        self.net, self.now = SimNetwork(), 0
        self.p_tp, self.d_tp = p_tp, d_tp
        self.p_cfg = p_cfg or {}
        self.pt = [SimTransport(self.net, f"P-{t}", tp_rank=t, num_blocks=num_blocks, block_bytes=64 // p_tp)
                   for t in range(p_tp)]
        for t in self.pt:
            t.fill(range(num_blocks))
        self.p = [self._producer(t) for t in range(p_tp)]
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", tp_size=p_tp,
                                                        ranks=tuple(t.rank_info() for t in self.pt)))
        self.dt = [SimTransport(self.net, f"D-{t}", tp_rank=t, num_blocks=num_blocks, block_bytes=64 // d_tp)
                   for t in range(d_tp)]
        self.d = [Connector(CoreConfig(engine_id="D", compat_hash="h", tp_rank=t, tp_size=d_tp, lease_margin_ns=100,
                                       **(d_cfg or {})), self.dt[t], SimHandshaker(self.net), clock=self.clock,
                            wall_clock=self.wall) for t in range(d_tp)]
        self.recv: list[dict[str, int]] = [{} for _ in range(d_tp)]
        self.sent: list[dict[str, int]] = [{} for _ in range(p_tp)]
        self.invalid: list[dict[str, set[int]]] = [{} for _ in range(d_tp)]

    def _producer(self, t: int) -> Connector:
        return Connector(CoreConfig(engine_id="P", compat_hash="h", tp_rank=t, tp_size=self.p_tp, **self.p_cfg),
                         self.pt[t], SimHandshaker(self.net), clock=self.clock, wall_clock=self.wall, port=9)

    def clock(self) -> int:
        return self.now

    def wall(self) -> int:
        return WALL0 + self.now

    def prefill(self, rid: str, blocks: list[int]) -> KVTransferParams:
        # Every rank holds, under the scheduler's one stamp (a self-stamped hold of a multi-rank
        # producer is held hold_skew_ns longer); the router gets rank 0's params.
        stamp = self.wall()
        minted = [p.request_finished(rid, blocks, issued_wall_ns=stamp) for p in self.p]
        return minted[0]

    def load(self, rid: str, local: list[int], params: Any) -> None:
        for d in self.d:
            d.load(rid, local, params, computed_blocks=prefix_hit(params, local))

    def step_d(self) -> None:
        for r, d in enumerate(self.d):
            _, got = d.get_finished(set())
            bad = d.get_block_ids_with_load_errors()
            for rid in got:
                self.recv[r][rid] = self.recv[r].get(rid, 0) + 1
                self.invalid[r][rid] = set(bad)

    def step_p(self) -> None:
        for r, p in enumerate(self.p):
            for rid in p.get_finished(set())[0]:
                self.sent[r][rid] = self.sent[r].get(rid, 0) + 1

    def step(self, n: int = 1, dt: int = 1_000) -> None:
        for _ in range(n):
            self.now += dt
            self.step_d()
            self.step_p()

    def late_alarms(self, t: int) -> list[str]:
        """Producer rank ``t``'s records of a notification after its lease: vLLM's error-level
        "Potentially invalid KV blocks ... retrieved" alarm (aws-do-eks PR 84)."""
        return [r.reason for r in self.p[t].core.log.records() if r.reason and "reused blocks" in r.reason]


# --- 1. a notify-only request whose handshake is applied after its lease is over ----------------------


def test_vllm_pr_41269_notify_only_ready_after_the_lease_sends_no_late_notice() -> None:
    """vLLM PR 41269 (a rejection/full-prefix-hit notice sent after prefill's lease ran out is an
    error-level "invalid KV blocks retrieved" alarm, aws-do-eks PR 84) and SGLang PR 32267 (a
    decode scheduler stall). docs/decisions.md: "A notify-only load whose lease is known to be over
    sends nothing"; ``_notify_unread``: "not once the lease the params gave is over".

    A full local prefix hit (notify-only load) waits for the prefill's handshake. The handshake
    thread's reply lands in the inbox, then the decode worker's step loop stalls past the lease
    (prefill expires its hold). When the worker steps again the request learns the engine is
    ready after its trust bound: it must send nothing (the prefill already released by itself),
    exactly as it does when its deadline tick wins, and the prefill must record no
    "notification after the lease expired" alarm for a request nobody read."""
    rig = Rig(p_cfg={"lease_ns": 60_000})
    rig.now = 1_000
    params = rig.prefill("p1", [1, 2])
    rig.d[0].load("d1", [], params)  # full local prefix hit: notify-only
    rig.d[0].step()
    assert rig.d[0].core.consumers["d1"].state.name == "HANDSHAKING"
    rig.now = 3_000
    rig.d[0].handshaker.progress()  # as a handshake thread does: the reply is submitted during the stall
    rig.now = 70_000  # the decode worker stalls; the prefill's 60 us lease runs out meanwhile
    rig.step_p()
    assert rig.p[0].last.expired == {"p1"}
    rig.now = 90_000
    rig.step_d()
    rig.now = 91_000
    rig.step_p()
    notes = [m for _, m in rig.dt[0].sent if isinstance(m, Notification)]
    assert notes == [], f"a notice was sent after the lease the params gave was over: {notes}"
    assert rig.late_alarms(0) == []
    assert rig.recv[0] == {}  # notify-only: never reported


# --- 2. a failed/aborted request whose last read stops after the lease notifies ranks nothing read -----


@pytest.mark.parametrize("how", ["sibling_err", "abort"])
def test_vllm_pr_41269_request_stopping_after_the_lease_sends_no_late_notice_to_unread_ranks(how: str) -> None:
    """vLLM PR 41269 / aws-do-eks PR 84 (late notice = false corruption alarm on prefill), with
    NIXL's cancel that does not stop a READ already posted (SGLang PR 35360: "there is always a
    real in-flight window"). Prefill TP 2, decode TP 1: the decode request reads P rank 0 and
    P rank 1. Either the read from P rank 0 ends ERR at once (``sibling_err``) or the request is
    aborted at once (``abort``, rank 0's read cancelled at once); the read from P rank 1 outruns
    its cancel and only stops long after both prefill ranks' leases expired.

    When the last read stops the request notifies the ranks it did not read. By then the lease
    the params gave is over: the prefill released by itself, and a notice now reaches P rank 0
    (which nothing read after its lease) as "notification after the lease expired: that read may
    have seen reused blocks". As for a request that stops before reading (``_notify_unread``, connected_only),
    nothing should be sent once the trust bound has passed."""
    rig = Rig(p_tp=2, p_cfg={"lease_ns": 60_000})
    rig.dt[0].cancel_read = lambda request_id, pp_rank, tp_rank: None  # type: ignore[method-assign]
    params = rig.prefill("p1", [1, 2])
    if how == "sibling_err":
        rig.net.script("d1", 0, 0, ReadScript(polls=0, end="err"))
    else:
        rig.net.script("d1", 0, 0, ReadScript(polls=0, end="hang"))
    rig.net.script("d1", 0, 1, ReadScript(polls=150, end="err"))  # stuck ~150 us, then ends
    rig.load("d1", [5, 6], params)
    if how == "abort":
        for _ in range(4):
            rig.d[0].step()
        assert rig.d[0].core.consumers["d1"].state.name == "READING"
        rig.d[0].abort("d1")
        real = SimTransport.cancel_read.__get__(rig.dt[0])
        rig.dt[0].cancel_read = lambda request_id, pp_rank, tp_rank: (  # type: ignore[method-assign]
            real(request_id, pp_rank, tp_rank) if tp_rank == 0 else None)
    trust = None
    for _ in range(100):
        rig.step(1)
        m = rig.d[0].core.consumers.get("d1")
        if m is not None and m.trust is not None:
            trust = m.trust
    was = rig.p[0].core.remembered(2, "p1")
    assert was is not None and was.name == "EXPIRED"
    before = len(rig.dt[0].sent)
    rig.step(120)
    assert rig.recv[0] == {"d1": 1} and rig.invalid[0]["d1"] == {5, 6}
    late = [(agent, m) for agent, m in rig.dt[0].sent[before:] if isinstance(m, Notification)]
    assert late == [], f"notices sent after the trust bound ({trust} ns), when the prefill had expired: {late}"
    assert rig.late_alarms(0) == [], "P rank 0 (read by nobody after its lease) raised a corruption alarm"


# --- 3. a prefill request id reused once the prefill forgot it ------------------------------------------


@pytest.mark.parametrize("how", ["forgotten_by_time", "producer_restarted"])
def test_vllm_pr_45688_router_request_id_reused_on_prefill_is_not_refused_on_decode(how: str) -> None:
    """vLLM PR 45688 (request-id randomization is turned off for PD: the router's ids are the
    engines' ids) and PR 27987 (client X-Request-Id values collide and come back). The router
    reuses request id ``req-42`` for a new prompt long after the first ``req-42`` was read and
    released (``forgotten_by_time``: past the prefill's ``tombstone_ns``), or after the prefill
    restarted under the same engine id (``producer_restarted``: a new incarnation that never held
    the old one). The prefill accepts the new hold and mints new params (new blocks, new
    ``issued_wall_ns``, new incarnation). These are not a second use of the first params: the
    decode core itself has forgotten the first load too. The decode must load them and read the
    new blocks, not refuse them with "already loaded by 'd1'" (a valid request failed, and a
    whole ``start_load_kv`` step refused with it)."""
    rig = Rig(p_cfg={"lease_ns": 50_000, "tombstone_ns": 100_000}, d_cfg={"tombstone_ns": 100_000})
    rig.load("d1", [5, 6], rig.prefill("req-42", [1, 2]))
    rig.step(3)
    assert rig.recv[0] == {"d1": 1} and rig.sent[0] == {"req-42": 1}
    if how == "forgotten_by_time":
        rig.now += 1_000_000
        rig.load("d-other", [9], rig.prefill("req-other", [9]))  # traffic: old tombstones age out
        rig.step(3)
        assert rig.p[0].core.remembered(2, "req-42") is None and rig.d[0].core.remembered(1, "d1") is None
    else:
        rig.net.kill(rig.pt[0].agent)
        del rig.net.agents[rig.pt[0].agent]
        rig.pt[0] = SimTransport(rig.net, "P-0b", num_blocks=64, block_bytes=64)
        rig.pt[0].fill(range(64))
        rig.p[0] = rig._producer(0)
        # The decode's cached handshake is the dead process's: the first request minted by the new
        # one is refused as a contradiction and evicts it (docs/decisions.md), the next handshakes afresh.
        rig.load("d-probe", [10], rig.prefill("req-probe", [10]))
        rig.step(3)
        assert rig.recv[0].get("d-probe") == 1
    params = rig.prefill("req-42", [3, 4])  # the prefill accepts the reused id
    rig.load("d2", [7, 8], params)
    rig.step(4)
    assert rig.recv[0].get("d2") == 1 and rig.invalid[0]["d2"] == set()
    assert rig.dt[0].block(7) == pattern(rig.pt[0].agent, 3, 64)
    assert rig.dt[0].block(8) == pattern(rig.pt[0].agent, 4, 64)


# --- 4. a request id the notification wire cannot carry ------------------------------------------------


def test_vllm_issue_10583_client_request_id_the_notification_cannot_carry_is_refused_up_front() -> None:
    """vLLM issue 10583 / PR 9550: the request id is caller-supplied (OpenAI ``request_id`` /
    X-Request-Id) and, in PD, it is the prefill request id the notification carries (PR 45688).
    ``_check_id`` allows 256 *characters*, but a notification is capped at 1024 *bytes*
    (``MAX_NOTIFY_BYTES``): an id of 256 four-byte characters is accepted by ``request_finished``
    and by ``load``, and then no notification for it can ever be encoded. docs/embedding.md: bad
    arguments raise ``InvalidInput`` naming the field before anything is accepted; a decode
    worker's step must never raise. Either the prefill refuses the id up front, or the transfer
    completes: received once, the prefill released once."""
    rig = Rig()
    rid = "\U0001F600" * 256
    try:
        params = rig.prefill(rid, [1, 2])
    except InvalidInput as exc:
        assert exc.field == "request_id"
        return
    rig.load("d1", [5, 6], params)
    rig.step(3)  # must not raise
    assert rig.recv[0] == {"d1": 1} and rig.invalid[0]["d1"] == set()
    assert rig.sent[0] == {rid: 1}


# --- 5. coverage: decode TP > 1 under a randomized vLLM-like scheduler (passes) -------------------------


def _rand_run(seed: int, p_tp: int, d_tp: int, lease_ns: int) -> list[str]:
    rnd = random.Random(seed)
    rig = Rig(p_tp=p_tp, d_tp=d_tp, p_cfg={"lease_ns": lease_ns},
              d_cfg={"read_timeout_ns": 25_000, "handshake_retry_ns": 3_000})
    errors: list[str] = []
    p_free, d_free = list(range(64)), list(range(64))
    holds: dict[str, tuple[int, ...]] = {}
    loads: dict[str, tuple[tuple[int, ...], int, str]] = {}
    reported: dict[str, list[int]] = {}
    invalid: dict[str, set[int]] = {}
    p_done: dict[str, list[int]] = {}
    n = 0
    for step in range(220):
        if step < 140:
            for _ in range(rnd.randint(0, 3)):
                k = rnd.randint(1, 3)
                if len(p_free) < k or len(d_free) < k:
                    continue
                n += 1
                hold, rid = f"p{n}", f"d{n}"
                blocks = tuple(p_free.pop(rnd.randrange(len(p_free))) for _ in range(k))
                for t, pt in enumerate(rig.pt):
                    bb = pt.block_bytes
                    for i, b in enumerate(blocks):
                        pt.memory[b * bb:(b + 1) * bb] = pattern(hold, i, 64)[t * bb:(t + 1) * bb]
                params = rig.prefill(hold, list(blocks))
                holds[hold] = blocks
                local_n = rnd.choice([k, k, k, k - 1, 0]) if k > 1 else rnd.choice([1, 1, 1, 0])
                local = tuple(d_free.pop(rnd.randrange(len(d_free))) for _ in range(local_n))
                for t in range(p_tp):
                    x = rnd.random()
                    if x < 0.15:
                        rig.net.script(rid, 0, t, ReadScript(polls=rnd.randint(0, 3), end=rnd.choice(["err", "raise"])))
                    elif x < 0.3:
                        rig.net.script(rid, 0, t, ReadScript(polls=rnd.randint(3, 40)))
                for d in rig.d:
                    try:
                        d.load(rid, list(local), params, computed_blocks=prefix_hit(params, local))
                    except InvalidInput as exc:
                        errors.append(f"load {rid} into free blocks refused: {exc}")
                if local:
                    loads[rid] = (local, k - len(local), hold)
            r = rnd.random()
            if r < 0.12 and loads:
                victim = rnd.choice(sorted(loads))
                for d in rig.d:
                    d.abort(victim)
            elif r < 0.15:
                rig.net.handshake_faults[("127.0.0.1", 9)] = "refuse"
            elif r < 0.22:
                rig.net.handshake_faults.pop(("127.0.0.1", 9), None)
        else:
            rig.net.handshake_faults.clear()
        rig.now += 1_000
        for r_, d in enumerate(rig.d):
            _, got = d.get_finished(set())
            bad = d.get_block_ids_with_load_errors()
            for rid in got:
                reported.setdefault(rid, []).append(r_)
                if reported[rid].count(r_) > 1:
                    errors.append(f"{rid} reported twice by decode rank {r_}")
                invalid.setdefault(rid, set()).update(bad & set(loads.get(rid, ((), 0, ""))[0]))
        for rid in list(loads):
            if sorted(reported.get(rid, [])) == list(range(d_tp)):  # vLLM's KVOutputAggregator
                local, first, hold = loads.pop(rid)
                if not set(local) & invalid.get(rid, set()):
                    for i, lb in enumerate(local):
                        if b"".join(rig.dt[x].block(lb) for x in range(d_tp)) != pattern(hold, first + i, 64):
                            errors.append(f"{rid} reported with valid block {lb} holding the wrong bytes")
                            break
                d_free.extend(local)
        for t, p in enumerate(rig.p):
            for hold in p.get_finished(set())[0]:
                p_done.setdefault(hold, []).append(t)
        for hold, ranks in list(p_done.items()):
            if len(ranks) != len(set(ranks)):
                errors.append(f"{hold} released twice by one rank")
            if sorted(set(ranks)) == list(range(p_tp)) and hold in holds:
                live = [k for dt in rig.dt for k, rd in dt.reads.items() if rd.cmd.notification.request_id == hold]
                if live and not any(hold in p.last.expired for p in rig.p):
                    errors.append(f"{hold} released by notification with reads in flight {live}")
                blocks = holds.pop(hold)
                for pt in rig.pt:  # the prefill reuses them at once
                    for b in blocks:
                        pt.memory[b * pt.block_bytes:(b + 1) * pt.block_bytes] = bytes(pt.block_bytes)
                p_free.extend(blocks)
    if loads:
        errors.append(f"never reported: {sorted(loads)[:5]}")
    if holds:
        errors.append(f"holds never released: {sorted(holds)[:5]}")
    if any(c.core.violations[Fault.LOCAL] for c in rig.p + rig.d):
        errors.append("a local violation was recorded")
    return errors


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 2), (1, 4), (4, 2)])
def test_llm_d_issue_2433_random_schedules_with_decode_tp_above_one_keep_the_contract(p_tp: int, d_tp: int) -> None:
    """llm-d issue 2433 / SGLang PR 24648 (decode TP larger than prefill: each prefill rank waits for
    every decode rank's part) under a toy vLLM pair of schedulers: decode TP > 1 aggregated as
    vLLM's KVOutputAggregator does (finished once every decode worker reported it, invalid blocks
    unioned), read faults, slow reads, partial and full prefix hits, aborts on every rank, handshake
    outages, short and long leases, blocks reused at once on both sides. Each decode rank reports
    each request once, valid blocks hold the producer's bytes, every hold is released once per
    prefill rank and never by notification while a read of it runs."""
    problems = {}
    for seed in range(3):
        errs = _rand_run(seed, p_tp, d_tp, lease_ns=12_000 if seed % 2 else 60_000)
        if errs:
            problems[seed] = errs[:3]
    assert not problems, problems
