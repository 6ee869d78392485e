"""Regression tests for races and bugs found in PD-disaggregation KV-transfer code in the field.

The bug corpus (tests/test_bug_corpus.py) is a sample. Each test here is another scenario from
a real thread (vLLM, SGLang, NIXL, Mooncake, llm-d, LightLLM...; the URL and a one-line
summary are in its docstring, in our own words) or derived from the domain (``test_scenario_``).
Every test drives the real machines, through the core or through a Connector over the simulated
transport, and asserts what pdfsm guarantees: the event is illegal (rejected, state unchanged,
attributed to the right side, recorded) or handled (a defined transition; blocks freed once;
reported once; the failure policy applied; invalid blocks no later than the request).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from helpers import collect, connected, ev, handshake, make_core, read, reply, tick

from pdfsm.commands import CancelRead, DropPeer, FinishedSending, HandOff, PostRead, SendNotification, StartHandshake
from pdfsm.connector import Connector
from pdfsm.core import Core
from pdfsm.errors import InvalidInput, LayoutMismatch, LocalProtocolError, RemoteProtocolError
from pdfsm.events import (
    AbortRequested,
    BlocksHeld,
    Collect,
    CoreConfig,
    Deadline,
    Event,
    EvictRequested,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    Heartbeat,
    NotificationReceived,
    PeerAdded,
    PeerDisconnected,
    Reported,
)
from pdfsm.fsm import Fault
from pdfsm.log import Outcome, Record
from pdfsm.wire import HeartbeatMessage
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport, pattern

# --- small helpers -----------------------------------------------------------------------------


def hand_offs(core: Core, t: int = 0, step: int = 1) -> list[HandOff]:
    return [c for c in collect(core, t, step) if isinstance(c, HandOff)]


def frees(core: Core) -> list[FinishedSending]:
    return [c for c in core.take_commands() if isinstance(c, FinishedSending)]


def faults(core: Core) -> list[Record]:
    return [r for r in core.log.records() if r.fault is not None]


class Pair:
    """One producer and one consumer Connector over a simulated network, on a shared clock."""

    def __init__(self, *, d_config: dict[str, Any] | None = None, p_lease_ns: int = 120_000_000_000) -> None:
        self.net, self.now = SimNetwork(), 0
        self.prod = SimTransport(self.net, "P-0")
        self.prod.fill(range(64))
        self.p = Connector(CoreConfig(engine_id="P", compat_hash="h", lease_ns=p_lease_ns), self.prod,
                           SimHandshaker(self.net), clock=self.clock, port=9)
        prod = self.prod
        self.net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(prod.rank_info(),)))
        self.cons = SimTransport(self.net, "D-0")
        self.d = Connector(CoreConfig(engine_id="D", compat_hash="h", **(d_config or {})), self.cons,
                           SimHandshaker(self.net), clock=self.clock)

    def clock(self) -> int:
        return self.now

    def run(self, steps: int = 6) -> tuple[list[set[str]], list[set[str]]]:
        """Step both sides; what each side reported finished, step by step (consumer, producer)."""
        d_seen: list[set[str]] = []
        p_seen: list[set[str]] = []
        for _ in range(steps):
            d_seen.append(self.d.get_finished()[1])
            p_seen.append(self.p.get_finished()[0])
        return d_seen, p_seen


def flat(seen: list[set[str]]) -> list[str]:
    return sorted(x for s in seen for x in s)


# --- block lists: local vs remote, partial prefix hits --------------------------------------------


def test_vllm_pr_50558_more_local_than_remote_blocks_is_refused_up_front() -> None:
    """https://github.com/vllm-project/vllm/pull/50558 -- decode allocated more blocks than the
    prefiller exported (prefix caching), tripping an assert deep in the read path (or silently
    misaligning the block lists). pdfsm refuses the load by name before anything is submitted, and
    a core fed mismatched lists directly fails the request (local fault) with its policy."""
    pair = Pair()
    params = pair.p.request_finished("p1", [1, 2])
    with pytest.raises(InvalidInput, match="local_block_ids"):
        pair.d.load("d1", [5, 6, 7], params)
    assert not pair.d.core.log.inbox and "d1" not in pair.d.core.consumers

    core = make_core(strict=False)
    core.apply(read("r1", blocks=(5, 6, 7), remote_blocks=(1, 2)))
    assert not [c for c in core.take_commands() if isinstance(c, (StartHandshake, PostRead))]
    assert core.violations[Fault.LOCAL] == 1
    (off,) = hand_offs(core)
    assert off.outcome == "failed" and off.invalid_blocks == (5, 6, 7) and off.policy == "recompute"


def test_vllm_pr_48758_partial_prefix_hit_reads_the_blocks_after_the_hit_not_the_head() -> None:
    """https://github.com/vllm-project/vllm/pull/48758 -- with a partial local prefix hit the
    connector trimmed the remote block list from the wrong end (head instead of tail), reading
    blocks the decoder already had into the slots of the ones it lacked. pdfsm reads only the
    last remote blocks, byte for byte, and the producer is released once."""
    pair = Pair()
    params = pair.p.request_finished("p1", [10, 11, 12])
    pair.d.load("d1", [40], params, computed_blocks=2)  # the first two blocks were a local prefix hit
    d_seen, p_seen = pair.run()
    assert flat(d_seen) == ["d1"] and flat(p_seen) == ["p1"]
    assert pair.cons.block(40) == pattern("P-0", 12, 64)
    (note,) = [m for _, m in pair.cons.sent]
    assert note.request_id == "p1"


@pytest.mark.parametrize(("case", "remote", "local", "computed", "reads"), [
    # The prefill held a block past its 4-block prompt (the first sampled token's; vLLM issue
    # 30358, PR 55053): no prefix hit, the prompt's blocks are the first four.
    ("producer-extra-block", [4, 5, 6, 7, 8], [30, 31, 32, 33], 0, [4, 5, 6, 7]),
    # A prefix hit of one block, then the next two prompt blocks: the middle, not the tail.
    ("middle", [4, 5, 6, 7], [30, 31], 1, [5, 6]),
])
def test_vllm_pr_50558_blocks_pair_by_prompt_position_not_from_the_tail(
        case: str, remote: list[int], local: list[int], computed: int, reads: list[int]) -> None:
    """https://github.com/vllm-project/vllm/pull/50558 (review: "position not count") -- the
    connector paired local blocks with the *last* remote ones, which silently read the wrong
    prompt blocks whenever the producer held a block past its prompt or the local blocks did not
    end where the producer's did; the request was reported received. pdfsm pairs local block
    ``i`` with remote block ``computed_blocks + i``, byte for byte."""
    pair = Pair()
    params = pair.p.request_finished("p1", remote)
    pair.d.load("d1", local, params, computed_blocks=computed)
    d_seen, p_seen = pair.run()
    assert flat(d_seen) == ["d1"] and flat(p_seen) == ["p1"], case
    assert [pair.cons.block(b) for b in local] == [pattern("P-0", r, 64) for r in reads]


def test_vllm_pr_50558_a_partial_load_that_does_not_say_its_prefix_hit_is_refused() -> None:
    """https://github.com/vllm-project/vllm/pull/50558 -- fewer local blocks than remote ones are
    ambiguous (a prefix hit, or a producer holding blocks past its prompt); guessing the tail
    corrupted silently. Refused by name, nothing accepted; with ``computed_blocks`` it loads. A
    decode prompt longer than the producer's (a proxy appending the first sampled token, MTP
    lookahead blocks: vLLM PRs 46694, 50173) reaches past the producer's blocks: refused."""
    pair = Pair()
    params = pair.p.request_finished("p1", [4, 5, 6, 7])
    with pytest.raises(InvalidInput, match="computed_blocks"):
        pair.d.load("d1", [20, 21], params)
    with pytest.raises(InvalidInput, match="local_block_ids"):  # prompt blocks 3 and 4: P has 0..3
        pair.d.load("d1", [20, 21], params, computed_blocks=3)
    with pytest.raises(InvalidInput, match="computed_blocks"):
        pair.d.load("d1", [20], params, computed_blocks=-1)
    assert not pair.d.core.log.inbox and "d1" not in pair.d.core.consumers
    pair.d.load("d1", [20], params, computed_blocks=3)
    d_seen, _ = pair.run()
    assert flat(d_seen) == ["d1"] and pair.cons.block(20) == pattern("P-0", 7, 64)


def test_vllm_issue_52234_out_of_range_remote_blocks_fail_with_invalid_blocks() -> None:
    """https://github.com/vllm-project/vllm/issues/52234 -- decode driven with remote block ids
    beyond the producer's cache returned HTTP 200 with garbage tokens: a failed receive was not
    treated as a failure. pdfsm fails the request (the read cannot be set up), reports its local
    blocks invalid in the same step with the recompute policy, copies nothing, and lets the
    producer release its real blocks."""
    pair = Pair()
    params = pair.p.request_finished("p1", [1, 2])
    forged = msgspec.structs.replace(params, remote_block_ids=(100, 101))  # P has 64 blocks
    pair.d.load("d1", [5, 6], forged)
    for _ in range(4):
        if "d1" in pair.d.get_finished()[1]:
            break
    assert pair.d.get_block_ids_with_load_errors() == {5, 6}
    (failed,) = pair.d.last.failed
    assert failed.policy == "recompute" and "setup" in failed.reason
    assert pair.cons.block(5) == bytes(64)  # nothing was copied
    _, p_seen = pair.run(3)
    assert flat(p_seen) == ["p1"] and not pair.p.last.expired


# --- hung, aborted and late transfers --------------------------------------------------------------


def test_sglang_pr_31800_read_stuck_in_transferring_times_out_and_is_reported_once() -> None:
    """https://github.com/sgl-project/sglang/pull/31800 -- the Mooncake receiver only applied its
    timeout while waiting for input, so a request whose transfer started but never finished
    stayed in Transferring forever and leaked its decode slot. pdfsm's read deadline covers the
    reading state: the hung read is cancelled, the request is reported once, failed, with its
    blocks invalid, only after the cancel is confirmed; the producer is told and released."""
    pair = Pair()
    params = pair.p.request_finished("p1", [1, 2])
    pair.net.script("d1", 0, 0, ReadScript(end="hang"))
    pair.d.load("d1", [5, 6], params)
    d_seen, p_seen = pair.run(3)
    assert flat(d_seen) == [] and flat(p_seen) == []  # NIXL itself would wait for ever
    assert pair.d.core.consumers["d1"].state.name == "READING"
    pair.now = pair.d.config.read_timeout_ns + 1
    reported = pair.d.get_finished()[1]
    assert reported == {"d1"}
    (failed,) = pair.d.last.failed
    assert "deadline" in failed.reason and pair.d.get_block_ids_with_load_errors() == {5, 6}
    states = [r.state for r in pair.d.core.log.records() if r.machine == "consumer"]
    assert states[-3:] == ["FAILING", "FAILED", "RELEASED"]  # reported only after the cancel landed
    d_seen, p_seen = pair.run(3)
    assert flat(d_seen) == [] and flat(p_seen) == ["p1"] and not pair.p.last.expired


def test_sglang_pr_30352_abort_mid_transfer_releases_the_producer_after_the_read_stops() -> None:
    """https://github.com/sgl-project/sglang/pull/30352 (also vLLM PR 41269) -- a decode-side abort
    reaching the prefill side while its transfer still ran was an unrecognized message there, and
    prefill blocks of requests decode gave up on stayed pinned until a timeout. pdfsm keeps the
    decode blocks until the cancelled read has stopped, reports the request aborted exactly once,
    and then notifies the producer, which releases at once (not by expiry)."""
    pair = Pair()
    params = pair.p.request_finished("p1", [1, 2])
    pair.net.script("d1", 0, 0, ReadScript(polls=50))
    pair.d.load("d1", [5, 6], params)
    pair.run(2)
    pair.d.abort("d1")
    assert pair.d.core.consumers["d1"].state.name == "READING"  # the abort is queued, not yet applied
    d_seen, p_seen = pair.run(4)
    assert flat(d_seen) == ["d1"]
    records = pair.d.core.log.records()
    assert [r.state for r in records if r.machine == "consumer"][-3:] == ["ABORTING", "ABORTED", "RELEASED"]
    assert flat(p_seen) == ["p1"]
    freed = [r for r in pair.p.core.log.records() if r.machine == "producer"][-1]
    assert freed.state == "RELEASED" and freed.fault is None


def test_vllm_issue_52234_load_after_the_producer_lease_is_failed_without_reading() -> None:
    """https://github.com/vllm-project/vllm/issues/52234 -- a stale reference, loaded after the
    producer had reused its blocks, was read anyway and served the previous prompt's answer.
    pdfsm fails such a load at once, without a handshake or a read, invalid blocks reported with
    the policy; the producer released the blocks by expiry, once."""
    pair = Pair()
    params = pair.p.request_finished("p1", [1, 2], lease_ns=2_000_000_000)
    pair.now = 3_000_000_000
    assert pair.p.get_finished()[0] == {"p1"} and pair.p.last.expired == {"p1"}
    pair.d.load("d1", [5, 6], params, lease_start_ns=0)
    assert "d1" in pair.d.get_finished()[1]
    assert pair.d.get_block_ids_with_load_errors() == {5, 6}
    assert "lease" in pair.d.last.failed[0].reason
    assert not pair.d.core.engines and not pair.cons.reads and not pair.cons.sent
    assert pair.p.get_finished()[0] == set()  # released once


def test_aws_do_eks_pr_84_late_read_after_expiry_is_distrusted_and_blamed_on_the_peer() -> None:
    """https://github.com/aws-samples/aws-do-eks/pull/84 -- with a NIXL lease shorter than the
    decode queueing time, decode read blocks prefill had already released; prefill only logged
    "unrecognized request ... may have expired" and the garbage was served with HTTP 200. In pdfsm
    the consumer does not trust a read that completes past the lease margin (failed, invalid
    blocks), and the producer records the late notification as a remote violation without
    releasing anything twice."""
    d = connected(make_core(lease_margin_ns=100))
    d.apply(read("r1", remote="p1", lease_ns=1_000, t=0))
    d.apply(ev(HandleDone, 950, request_id="r1", pp_rank=0, tp_rank=0))  # deadline was 900
    (off,) = hand_offs(d, 950)
    assert off.outcome == "failed" and off.invalid_blocks == (1, 2) and "deadline" in off.reason

    p = make_core(strict=False, engine_id="P", lease_ns=1_000)
    p.apply(ev(BlocksHeld, 0, request_id="p1", block_ids=(1, 2)))
    tick(p, 1_000)
    (expired,) = frees(p)
    assert expired.expired
    p.apply(ev(NotificationReceived, 1_050, request_id="p1", part=0, of=1))
    assert not frees(p)
    last = faults(p)[-1]
    assert last.fault is Fault.REMOTE and last.outcome is Outcome.REJECTED and "reused" in last.reason


def test_scenario_deadline_passing_after_completion_changes_nothing() -> None:
    """Derived: a timer firing for a request whose reads already completed (and was handed back)
    must not fail it, report it again, or cancel anything."""
    core = connected(make_core(read_timeout_ns=1_000))
    core.apply(read("r1", t=0))
    core.apply(ev(HandleDone, 999, request_id="r1", pp_rank=0, tp_rank=0))
    tick(core, 5_000)
    assert core.consumers["r1"].state.name == "NOTIFIED"
    assert not [c for c in core.take_commands() if isinstance(c, CancelRead)]
    assert [h.outcome for h in hand_offs(core, 5_000)] == ["received"]
    tick(core, 10_000)
    assert not hand_offs(core, 10_000, step=2) and not faults(core)


def test_scenario_duplicate_transfer_completion_quarantines_the_request() -> None:
    """Derived (NIXL can report one handle's end twice when a poll is retried): a second DONE for a
    handle already completed is a local protocol violation. In production mode it is recorded and
    the request is quarantined: its other read is cancelled and, once stopped, the request is
    reported failed with its blocks invalid, never trusted as received."""
    core = connected(make_core(strict=False), remote_tp=2)
    core.apply(read("r1", remote_tp=2))
    core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=0))
    core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=0))  # the duplicate
    assert core.rejections[Fault.LOCAL] == 1
    assert core.consumers["r1"].state.name == "FAILING"
    assert [c.tp_rank for c in core.take_commands() if isinstance(c, CancelRead)] == [1]
    assert not hand_offs(core)  # the sibling read may still write
    core.apply(ev(HandleFailed, request_id="r1", pp_rank=0, tp_rank=1, why=HandleFailure.CANCELLED))
    (off,) = hand_offs(core, step=2)
    assert off.outcome == "failed" and off.invalid_blocks == (1, 2) and "quarantined" in off.reason


# --- the producer's count: parts, duplicates, heartbeats ------------------------------------------


def test_scenario_notification_part_out_of_range_or_inconsistent_count_is_refused() -> None:
    """Derived: a notification naming a part outside 0..of-1, or disagreeing with the count the
    earlier parts gave, is the consumer's protocol error: refused, attributed REMOTE, recorded,
    and the request keeps counting; the right parts still release it exactly once."""
    core = make_core(strict=False, engine_id="P")
    core.apply(ev(BlocksHeld, request_id="p1", block_ids=(3, 4)))
    core.apply(ev(NotificationReceived, request_id="p1", part=2, of=2))  # out of range
    core.apply(ev(NotificationReceived, request_id="p1", part=0, of=0))  # no parts at all
    core.apply(ev(NotificationReceived, request_id="p1", part=0, of=2))
    core.apply(ev(NotificationReceived, request_id="p1", part=1, of=4))  # disagrees on the count
    assert core.producers["p1"].state.name == "HOLDING" and core.producers["p1"].of == 2
    reasons = [r.reason for r in faults(core)]
    assert reasons == ["part out of range", "part out of range",
                       "notification parts disagree on how many to expect"]
    assert core.rejections[Fault.REMOTE] == 3 and core.rejections[Fault.LOCAL] == 0
    assert not frees(core)
    core.apply(ev(NotificationReceived, request_id="p1", part=1, of=2))
    (freed,) = frees(core)
    assert freed.block_ids == (3, 4) and not freed.expired


def test_vllm_pr_53244_heartbeat_uses_the_producer_id_and_keeps_the_lease() -> None:
    """https://github.com/vllm-project/vllm/pull/53244 -- heartbeats carried the router's id rather
    than the prefill side's internal request id, so they renewed nothing and leases expired under
    queued requests. pdfsm's heartbeat is built from the producer's id in the params: the lease
    survives its original end, while an unheartbeated twin expires on time."""
    pair = Pair()
    warm = pair.p.request_finished("warm", [9])
    pair.d.load("d-warm", [9], warm)  # connects the engine
    pair.run(3)
    lease = 2_000_000_000
    params = pair.p.request_finished("p1", [1, 2], lease_ns=lease)
    pair.p.request_finished("p2", [3, 4], lease_ns=lease)
    pair.now = 1_000_000_000
    assert pair.d.heartbeat(params, extend_ns=10_000_000_000) == 1
    (hb,) = [m for _, m in pair.cons.sent if isinstance(m, HeartbeatMessage)]
    assert hb.request_id == "p1"
    pair.run(1)
    pair.now = 3_000_000_000
    _, p_seen = pair.run(2)
    assert flat(p_seen) == ["p2"] and pair.p.core.producers["p1"].state.name == "HOLDING"
    renewed = msgspec.structs.replace(params, lease_ns=10_000_000_000)
    pair.d.load("d1", [5, 6], renewed, lease_start_ns=1_000_000_000)
    d_seen, p_seen = pair.run(4)
    assert flat(d_seen) == ["d1"] and flat(p_seen) == ["p1"]
    assert pair.cons.block(5) == pattern("P-0", 1, 64)


def test_scenario_heartbeats_for_unknown_or_finished_requests() -> None:
    """Derived: heartbeats for a request P never registered are staged one lease and then
    discarded as a remote fault (never a KeyError); after release they are ignored; after the
    lease expired they are a remote violation (the consumer is about to read reused blocks)."""
    core = make_core(strict=False, engine_id="P", lease_ns=1_000)
    core.apply(ev(Heartbeat, 0, request_id="ghost", extend_ns=500))
    assert core.producers["ghost"].state.name == "STAGED"
    tick(core, 1_000)
    assert "ghost" not in core.producers and not frees(core)
    assert faults(core)[-1].reason == "heartbeats for a request that was never registered"

    core.apply(ev(BlocksHeld, 2_000, request_id="done", block_ids=(1,)))
    core.apply(ev(NotificationReceived, 2_100, request_id="done", part=0, of=1))
    assert len(frees(core)) == 1
    core.apply(ev(Heartbeat, 2_200, request_id="done", extend_ns=500))
    assert core.log.records()[-1].outcome is Outcome.IGNORED

    core.apply(ev(BlocksHeld, 3_000, request_id="late", block_ids=(2,)))
    tick(core, 4_000)
    assert [f.expired for f in frees(core)] == [True]
    before = core.violations[Fault.REMOTE]
    core.apply(ev(Heartbeat, 4_100, request_id="late", extend_ns=500))
    assert core.violations[Fault.REMOTE] == before + 1 and "late" not in core.producers
    assert not frees(core)


def test_vllm_pr_49796_duplicate_registration_of_a_held_request_is_refused() -> None:
    """https://github.com/vllm-project/vllm/pull/49796 -- a client-controlled transfer id reused by
    two prefill requests overwrote the first one's bookkeeping, leaking its KV blocks until restart.
    pdfsm refuses the second registration (a local fault), leaves the first untouched, and frees
    the first request's blocks exactly once."""
    core = make_core(strict=False, engine_id="P")
    core.apply(ev(BlocksHeld, request_id="xfer-1", block_ids=(3, 4)))
    core.apply(ev(BlocksHeld, request_id="xfer-1", block_ids=(5, 6)))
    held = core.producers["xfer-1"]
    assert held.state.name == "HOLDING" and held.block_ids == (3, 4)
    assert faults(core)[-1].fault is Fault.LOCAL and core.rejections[Fault.LOCAL] == 1
    core.apply(ev(NotificationReceived, request_id="xfer-1", part=0, of=1))
    assert [f.block_ids for f in frees(core)] == [(3, 4)]
    with pytest.raises(LocalProtocolError, match="blocks already held"):
        strict = make_core(engine_id="P")
        strict.apply(ev(BlocksHeld, request_id="x", block_ids=(1,)))
        strict.apply(ev(BlocksHeld, request_id="x", block_ids=(2,)))


def test_vllm_pr_56468_reused_transfer_id_never_credits_an_old_completion_to_a_new_request() -> None:
    """https://github.com/vllm-project/vllm/pull/56468 -- MoRIIO mapped transfer ids to requests
    last-write-wins, so a colliding request inherited the first one's completion and the
    scheduler freed live blocks. In pdfsm a released id cannot be registered again (local fault),
    and a late notification for it is a remote violation that frees nothing."""
    core = make_core(strict=False, engine_id="P")
    core.apply(ev(BlocksHeld, request_id="t1", block_ids=(3,)))
    core.apply(ev(NotificationReceived, request_id="t1", part=0, of=1))
    assert len(frees(core)) == 1
    core.apply(ev(BlocksHeld, request_id="t1", block_ids=(8,)))  # the colliding request
    assert faults(core)[-1].fault is Fault.LOCAL and "reused" in faults(core)[-1].reason
    core.apply(ev(NotificationReceived, request_id="t1", part=0, of=1))  # the old completion, late
    assert faults(core)[-1].fault is Fault.REMOTE
    assert not frees(core) and "t1" not in core.producers


# --- topology: TP ratios, MLA, PP -------------------------------------------------------------------


def test_sglang_issue_15674_prefill_tp2_decode_tp1_each_prefill_rank_counts_its_own_part() -> None:
    """https://github.com/sgl-project/sglang/issues/15674 -- non-MLA models with prefill TP larger
    than decode TP broke under load. pdfsm: the decode rank reads both prefill ranks, each into
    its own head slice, and every prefill rank expects exactly one notification, built from the
    producer's id, released by it alone."""
    d = connected(make_core(), remote_tp=2)
    d.apply(read("d1", remote="p1", remote_tp=2))
    posts = [c for c in d.take_commands() if isinstance(c, PostRead)]
    assert [(p.source.tp_rank, p.source.local_slice, p.source.local_slices) for p in posts] == [(0, 0, 2), (1, 1, 2)]
    assert {(p.notification.request_id, p.notification.part, p.notification.of) for p in posts} == {("p1", 0, 1)}
    for rank in (0, 1):
        p = make_core(engine_id="P", tp_rank=rank, tp_size=2)
        p.apply(ev(BlocksHeld, request_id="p1", block_ids=(1, 2)))
        note = posts[rank].notification
        p.apply(ev(NotificationReceived, request_id=note.request_id, part=note.part, of=note.of))
        assert len(frees(p)) == 1


def test_llm_d_issue_2433_decode_tp4_prefill_tp1_prefill_waits_for_all_four_parts() -> None:
    """https://github.com/llm-d/llm-d/issues/2433 -- prefill TP1 / decode TP4 failed at transfer
    time and the client saw a hang. pdfsm: each of the four decode ranks reads its own quarter of
    the one prefill rank's heads and sends part d of 4; the prefill rank frees its blocks only
    when all four parts are in, and a repeated part is refused."""
    notes = []
    for rank in range(4):
        d = connected(make_core(tp_rank=rank, tp_size=4))
        d.apply(read("d1", remote="p1", remote_tp=1))
        (post,) = [c for c in d.take_commands() if isinstance(c, PostRead)]
        assert (post.source.tp_rank, post.source.remote_slice, post.source.remote_slices) == (0, rank, 4)
        notes.append(post.notification)
    assert [(n.part, n.of) for n in notes] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    p = make_core(engine_id="P")
    p.apply(ev(BlocksHeld, request_id="p1", block_ids=(7,)))
    for n in notes[:3]:
        p.apply(ev(NotificationReceived, request_id=n.request_id, part=n.part, of=n.of))
        assert not frees(p)
    with pytest.raises(RemoteProtocolError, match="duplicate"):
        p.apply(ev(NotificationReceived, request_id="p1", part=2, of=4))
    p.apply(ev(NotificationReceived, request_id="p1", part=3, of=4))
    (freed,) = frees(p)
    assert freed.block_ids == (7,) and not freed.expired


def test_sglang_pr_24648_decode_tp2_prefill_tp1_each_rank_copies_its_own_head_slice() -> None:
    """https://github.com/sgl-project/sglang/pull/24648 -- with prefill TP1 and decode TP2 the
    sender's head-slice offset arithmetic overflowed (unsigned 64-bit). End to end over the simulated
    transport: each decode rank gets exactly its half of every prefill block, and the prefill
    side frees the blocks only after both parts notified."""
    net, now = SimNetwork(), [0]
    prod = SimTransport(net, "P-0", block_bytes=64)
    prod.fill(range(64))
    p = Connector(CoreConfig(engine_id="P", compat_hash="h"), prod, SimHandshaker(net), clock=lambda: now[0], port=9)
    net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(prod.rank_info(),)))
    ranks = [SimTransport(net, f"D-{r}", tp_rank=r, block_bytes=32) for r in range(2)]
    ds = [Connector(CoreConfig(engine_id="D", compat_hash="h", tp_rank=r, tp_size=2), ranks[r], SimHandshaker(net),
                    clock=lambda: now[0]) for r in range(2)]
    params = p.request_finished("p1", [4, 5])
    ds[0].load("d1", [10, 11], params)
    released: list[str] = []
    for _ in range(4):
        released += p.get_finished()[0]
        ds[0].get_finished()
    assert released == []  # one part of two
    ds[1].load("d1", [10, 11], params)
    for _ in range(4):
        released += p.get_finished()[0]
        ds[1].get_finished()
    assert released == ["p1"]
    for r in range(2):
        for local, remote in ((10, 4), (11, 5)):
            assert ranks[r].block(local) == pattern("P-0", remote, 64)[r * 32:(r + 1) * 32]


def test_scenario_mla_decode_tp_larger_reads_whole_blocks_and_counts_parts() -> None:
    """Derived (MLA, decode TP 2 > prefill TP 1): the latent KV is not split by heads, so each decode
    rank reads the whole block from the one prefill rank; that rank still expects one part per
    decode rank and frees only after both."""
    notes = []
    for rank in range(2):
        d = connected(make_core(mla=True, tp_rank=rank, tp_size=2))
        d.apply(read("d1", remote="p1", remote_tp=1))
        cmds = d.take_commands()
        (post,) = [c for c in cmds if isinstance(c, PostRead)]
        assert post.source.remote_slices == 1 and post.source.local_slices == 1
        assert not [c for c in cmds if isinstance(c, SendNotification)]
        notes.append(post.notification)
    p = make_core(engine_id="P", mla=True)
    p.apply(ev(BlocksHeld, request_id="p1", block_ids=(1,)))
    p.apply(ev(NotificationReceived, request_id="p1", part=notes[0].part, of=notes[0].of))
    assert not frees(p)
    p.apply(ev(NotificationReceived, request_id="p1", part=notes[1].part, of=notes[1].of))
    assert len(frees(p)) == 1


def _two_pp(core: Core, rid: str = "r1") -> None:
    core.apply(read(rid, remote_pp=2))
    for pp in (0, 1):
        core.apply(ev(HandshakeDone, engine_id="P", pp_rank=pp, attempt=1, reply=reply(pp_rank=pp, pp_size=2)))
        core.apply(ev(PeerAdded, engine_id="P", pp_rank=pp, attempt=1))


def test_sglang_pr_15027_pp_transfer_is_done_only_after_every_pp_rank() -> None:
    """https://github.com/sgl-project/sglang/pull/15027 -- with a pipeline-parallel prefill the decode
    side declared the transfer complete after one PP rank's chunks (ids from different PP ranks
    were deduplicated), costing accuracy. pdfsm tracks each (pp_rank, tp_rank) read: the request
    is reported received only once both PP ranks' reads are done, each carrying its own
    notification."""
    core = make_core()
    _two_pp(core)
    posts = [c for c in core.take_commands() if isinstance(c, PostRead)]
    assert sorted(p.source.pp_rank for p in posts) == [0, 1]
    core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=0))
    assert core.consumers["r1"].state.name == "READING" and not hand_offs(core)
    core.apply(ev(HandleDone, request_id="r1", pp_rank=1, tp_rank=0))
    assert [h.outcome for h in hand_offs(core, step=2)] == ["received"]


def test_scenario_pp_one_rank_read_fails_cancels_the_other_and_reports_once() -> None:
    """Derived (PP with some ranks failing): one PP rank's read errors while the other's is in
    flight; the other is cancelled, nothing is reported until it stopped, then the request is
    failed once with its invalid blocks."""
    core = make_core()
    _two_pp(core)
    core.take_commands()
    core.apply(ev(HandleFailed, request_id="r1", pp_rank=1, tp_rank=0, why=HandleFailure.ERR))
    assert [(c.pp_rank, c.tp_rank) for c in core.take_commands() if isinstance(c, CancelRead)] == [(0, 0)]
    assert not hand_offs(core)
    core.apply(ev(HandleFailed, request_id="r1", pp_rank=0, tp_rank=0, why=HandleFailure.CANCELLED))
    (off,) = hand_offs(core, step=2)
    assert off.outcome == "failed" and off.invalid_blocks == (1, 2) and "(1, 0) err" in off.reason
    assert all(e.readers == 0 for e in core.engines.values())


@pytest.mark.parametrize("failing_first", [True, False])
def test_scenario_pp_one_rank_handshake_fails_the_other_is_let_go(failing_first: bool) -> None:
    """Derived (PP with some ranks failing): the handshake with PP rank 1 fails while PP rank 0's
    succeeds, in either order. The request fails once with the policy, posts no read, and holds
    no engine, so the healthy one can still be evicted."""
    core = make_core(strict=False)
    core.apply(read("r1", remote_pp=2))
    ok: list[Event] = [ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply(pp_rank=0, pp_size=2)),
          ev(PeerAdded, engine_id="P", pp_rank=0, attempt=1)]
    bad: list[Event] = [ev(HandshakeFailed, engine_id="P", pp_rank=1, attempt=1, error="pp1 crashed")]
    for e in (bad + ok) if failing_first else (ok + bad):
        core.apply(e)
    assert not [c for c in core.take_commands() if isinstance(c, PostRead)]
    (off,) = hand_offs(core)
    assert off.outcome == "failed" and "pp_rank 1" in off.reason and off.policy == "recompute"
    assert core.engines[("P", 0)].readers == 0
    core.apply(ev(EvictRequested, engine_id="P", pp_rank=0))
    assert ("P", 0) not in core.engines


# --- handshakes: bad replies, disconnects, eviction, restarts --------------------------------------


def test_vllm_pr_26338_reply_missing_a_tp_rank_is_a_remote_layout_failure() -> None:
    """https://github.com/vllm-project/vllm/pull/26338 -- when the prefill instance spanned nodes, the
    handshake answer lacked the metadata of the ranks on other nodes. pdfsm refuses a reply that
    does not carry (pp_rank, tp_rank) metadata for every TP rank it claims: a typed layout
    failure blamed on the remote side; the waiting request fails with its policy, and no peer
    is added."""
    core = make_core(strict=False)
    core.apply(read("r1", remote_tp=2))
    half = reply("P", tp_size=2, ranks=(reply("P", tp_size=2).ranks[0],))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=half))
    engine = core.engines[("P", 0)]
    assert engine.state.name == "FAILED" and isinstance(engine.error, LayoutMismatch)
    assert faults(core)[-1].fault is Fault.REMOTE
    assert not [c for c in core.take_commands() if type(c).__name__ == "AddPeer"]
    (off,) = hand_offs(core)
    assert off.outcome == "failed" and off.invalid_blocks == (1, 2)


def test_scenario_peer_disconnect_while_connecting_fails_waiters_then_retries() -> None:
    """Derived: the peer goes away after its reply was accepted but before the transport added it.
    Waiting requests fail with their policy, the half-added peer is dropped, the late PeerAdded
    of that attempt is ignored as stale, and after the retry pause a new request handshakes
    afresh (attempt 2)."""
    core = make_core(strict=False, handshake_retry_ns=1_000)
    core.apply(read("r1"))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply()))
    assert core.engines[("P", 0)].state.name == "CONNECTING"
    core.take_commands()
    core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=0, detail="reset by peer"))
    assert [type(c) for c in core.take_commands()] == [DropPeer]
    core.apply(ev(PeerAdded, engine_id="P", pp_rank=0, attempt=1))
    assert core.engines[("P", 0)].state.name == "FAILED" and core.log.records()[-1].outcome is Outcome.IGNORED
    (off,) = hand_offs(core)
    assert off.outcome == "failed" and "disconnected" in off.reason
    core.apply(read("r2", t=500))  # within the pause: fails fast with the cached error
    assert core.consumers["r2"].state.name == "FAILED"
    core.apply(read("r3", t=1_000))
    (start,) = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    assert start.attempt == 2


def test_scenario_eviction_requested_during_handshake_is_ignored() -> None:
    """Derived: idle eviction racing an outstanding handshake must not tear the engine down under
    the requests waiting for it; they still hear the outcome and read."""
    core = make_core()
    core.apply(read("r1"))
    core.apply(ev(EvictRequested, engine_id="P", pp_rank=0))
    assert core.engines[("P", 0)].state.name == "HANDSHAKING"
    assert core.log.records()[-1].outcome is Outcome.IGNORED
    handshake(core)
    assert core.consumers["r1"].state.name == "READING"
    assert [c for c in core.take_commands() if isinstance(c, PostRead)]


def test_scenario_abort_racing_handshake_completion() -> None:
    """Derived: the scheduler aborts a request while its handshake is outstanding, and the
    handshake completes right after. The aborted request is not woken (no read is posted for
    it), it is reported aborted exactly once, it holds no engine, and a request that joined the
    same handshake still reads."""
    core = make_core()
    core.apply(read("r1"))
    core.apply(read("r2", blocks=(3, 4)))
    core.apply(ev(AbortRequested, request_id="r1"))
    handshake(core)
    posts = [c for c in core.take_commands() if isinstance(c, PostRead)]
    assert [p.request_id for p in posts] == ["r2"]
    assert [(h.request_id, h.outcome) for h in hand_offs(core)] == [("r1", "aborted")]
    assert core.engines[("P", 0)].readers == 1  # r2 only
    core.apply(ev(AbortRequested, request_id="r1"))  # a second abort, after the hand-off
    assert core.log.records()[-1].outcome is Outcome.IGNORED
    assert not hand_offs(core, step=2)


def test_vllm_pr_55471_producer_restarted_under_the_same_engine_id_is_handshaken_again() -> None:
    """https://github.com/vllm-project/vllm/pull/55471 -- a prefill peer whose transfer metadata was
    invalidated while it kept the same engine id stayed cached, so later requests kept using the
    stale path. pdfsm: the new process's params name an incarnation the cached reply does not, and
    nothing holds the cached engine, so it is evicted and handshaken again before the params are
    judged: the request reads the new process's blocks (before, it was refused, a recompute, and
    the new process's hold waited out its lease), the new producer is told at once, and nothing is
    read from the dead agent."""
    pair = Pair()
    warm = pair.p.request_finished("warm", [1])
    pair.d.load("d-warm", [1], warm)
    pair.run(3)
    pair.net.kill("P-0")
    fresh = SimTransport(pair.net, "P-0-restarted")
    fresh.fill(range(64))
    p2 = Connector(CoreConfig(engine_id="P", compat_hash="h"), fresh, SimHandshaker(pair.net), clock=pair.clock,
                   port=9)
    pair.net.serve("127.0.0.1", 9, lambda pp: reply("P", ranks=(fresh.rank_info(),)))
    pair.d.load("d1", [5, 6], p2.request_finished("p1", [2, 3]))
    got: list[str] = []
    released: list[str] = []
    for _ in range(4):
        got += pair.d.get_finished()[1]
        assert not pair.d.last.failed
        released += p2.get_finished()[0]
    assert got == ["d1"] and released == ["p1"]
    assert [pair.cons.block(b) for b in (5, 6)] == [pattern("P-0-restarted", b, 64) for b in (2, 3)]
    starts = [r for r in pair.d.core.log.records() if r.machine == "engine" and r.state == "HANDSHAKING"]
    assert len(starts) == 2  # the first connection, and the one the new params asked for
    assert not any(pair.d.core.violations.values())
    pair.d.load("d2", [7, 8], p2.request_finished("p2", [2, 3]))  # params are single-use: new ones
    got = []
    for _ in range(4):
        got += pair.d.get_finished()[1]
        p2.get_finished()
    assert got == ["d2"] and not pair.d.last.failed
    assert pair.cons.block(7) == pattern("P-0-restarted", 2, 64)


# --- the scheduler's side: aborts, collects, reused ids, clocks -------------------------------------


def test_lightllm_pr_1329_abort_of_a_request_never_started_is_ignored() -> None:
    """https://github.com/ModelTC/LightLLM/pull/1329 -- aborts that arrived before the PD request was
    registered were lost or raced registration. In pdfsm an abort for a request the consumer never
    had is a recorded no-op: nothing is handed back, nothing is blamed, and the id is not
    poisoned for a later load the scheduler really makes."""
    core = connected(make_core())
    core.apply(ev(AbortRequested, request_id="never"))
    rec = core.log.records()[-1]
    assert rec.outcome is Outcome.IGNORED and "nothing to abort" in rec.reason and rec.fault is None
    assert "never" not in core.consumers and not hand_offs(core)
    core.apply(read("never"))
    core.apply(ev(HandleDone, request_id="never", pp_rank=0, tp_rank=0))
    assert [h.outcome for h in hand_offs(core, step=2)] == ["received"]


def test_scenario_collect_with_nothing_ready_and_a_forged_report() -> None:
    """Derived: a scheduler step that collects when nothing finished hands nothing back and moves
    no machine; a hand-off cannot be forged by submitting the core's own Reported event, and a
    request still reading cannot be reported."""
    core = connected(make_core())
    core.apply(read("r1"))
    core.take_commands()
    assert hand_offs(core) == [] and core.consumers["r1"].state.name == "READING"
    with pytest.raises(InvalidInput, match="derived"):
        core.submit(Reported(source="scheduler", t_ns=0, request_id="r1"))
    core.apply(ev(Collect, step=2))
    assert core.consumers["r1"].state.name == "READING" and not core.take_commands()


def test_scenario_consumer_deadline_on_another_clock_is_refused() -> None:
    """Derived (clock domains, cf. vLLM PR 50326 on the producer side): a consumer read deadline
    taken on the scheduler's clock is refused as a local fault before anything is started;
    rebased onto the worker's clock, the same deadline is armed."""
    core = connected(make_core(clock="worker-1"))
    foreign = Deadline("scheduler-0", 50_000)
    with pytest.raises(LocalProtocolError, match="another clock"):
        core.apply(read("r1", deadline=foreign, t=100))
    assert "r1" not in core.consumers and not core.take_commands()
    rebased = foreign.rebased(there_now_ns=40_000, here_clock="worker-1", here_now_ns=100)
    core.apply(read("r1", deadline=rebased, t=100))
    assert core.consumers["r1"].deadline == 10_100


# --- params that contradict what the producer said in its handshake -------------------------------


def test_scenario_params_remote_tp_disagrees_with_the_handshake_reply() -> None:
    """Derived (cf. vLLM PR 19413, which takes the remote TP size from the handshake): the router's
    kv_transfer_params say the producer has TP 2, but the engine's validated handshake reply says
    TP 4 (stale params, or a producer restarted with another TP under the same id). Reading with a
    TP-2 plan moves the wrong head slices and never notifies producer ranks 2 and 3. The request
    fails (policy applied, invalid blocks), no read is posted, and the peer is blamed."""
    core = make_core(strict=False)
    core.apply(read("r1", remote_tp=2))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply("P", tp_size=4)))
    core.apply(ev(PeerAdded, engine_id="P", pp_rank=0, attempt=1))
    assert not [c for c in core.take_commands() if isinstance(c, (PostRead, SendNotification))]
    (off,) = hand_offs(core)
    assert off.outcome == "failed" and off.invalid_blocks == (1, 2) and off.policy == "recompute"
    (v,) = faults(core)
    assert v.fault is Fault.REMOTE and "TP 2" in v.reason and "TP 4" in v.reason


def test_scenario_params_remote_pp_disagrees_with_the_handshake_reply() -> None:
    """Derived (the symptom of SGLang PR 15027: decode declared done after one PP rank): the params say
    the producer has PP size 1, but PP rank 0's handshake reply says pp_size 2, i.e. rank 0 holds
    only half the layers. Reading rank 0 alone would report the request received with half its KV
    missing; the request fails instead, before any read."""
    core = make_core(strict=False)
    core.apply(read("r1", remote_pp=1))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply("P", pp_size=2)))
    core.apply(ev(PeerAdded, engine_id="P", pp_rank=0, attempt=1))
    assert not [c for c in core.take_commands() if isinstance(c, PostRead)]
    (off,) = hand_offs(core)
    assert off.outcome == "failed" and "PP 2" in off.reason


def test_scenario_params_checked_against_an_engine_already_connected() -> None:
    """The same check on the fast path, where the engine was connected by an earlier request: wrong
    TP, and a remote block the producer does not have (its reply counts 64), both fail at once."""
    core = make_core(strict=False)
    core.apply(read("warm-up"))
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=0, attempt=1, reply=reply("P", num_blocks=64)))
    core.apply(ev(PeerAdded, engine_id="P", pp_rank=0, attempt=1))
    core.take_commands()
    core.apply(read("r1", remote_tp=2))
    core.apply(read("r2", remote_blocks=(3, 64)))
    core.apply(read("r3", remote_blocks=(3, 63)))
    posted = {c.request_id for c in core.take_commands() if isinstance(c, PostRead)}
    assert posted == {"r3"} and core.consumers["r3"].state.name == "READING"
    assert [c.name for c in (core.consumers["r1"].state, core.consumers["r2"].state)] == ["FAILED", "FAILED"]
    assert "remote block 64 is out of range" in core.consumers["r2"].error
    assert {r.fault for r in faults(core)} == {Fault.REMOTE}
