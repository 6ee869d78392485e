"""Race hunting beyond tests/test_race.py: shapes and fault mixes the default scenarios leave out.

Two kinds of test live here:

- regressions for interleaving bugs the tester found in the real machines (handshake attempt
  numbers reused by a re-created engine; a notify-only PP 2 request told twice of failure; a PP
  engine lost and watched again with the request's old time), each naming the shrunk steps and
  the invariant they broke;
- clean searches over shapes the default scenarios do not combine (PP 2 with handshake faults,
  asymmetric TP with MLA, 3-4 requests, every fault at once, the opt-in faults: one PP rank's
  connection dropped and handshaken again, a refused post, idle eviction within a lease),
  derandomized with a fixed budget, each well under 20 s on a slow 2-core machine.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdfsm import consumer as C
from pdfsm import producer as P
from pdfsm.core import Core, Tables
from pdfsm.events import BlocksHeld, HandshakeDone, HandshakeFailed, Heartbeat, Promised
from pdfsm.fsm import Go, on
from pdfsm.testing import FAULTS, Scenario, Variant, World, hunt
from pdfsm.testing.coverage import explore_options
from pdfsm.testing.explore import replay_choices
from pdfsm.testing.invariants import EXTRA_INVARIANTS
from pdfsm.testing.world import EXTRA_FAULTS

HANDSHAKE_FAULTS = frozenset({"evict", "disconnect", "handshake-refuse", "handshake-timeout", "peer-refused"})


# --- bug A: handshake attempt numbers restart when an engine is forgotten --------------------------
#
# engine.py numbers handshake attempts per RemoteEngine object (``m.attempt``, from 0). Once a FAILED
# or DISCONNECTED engine is evicted (the core's own idle timer, core.py:_expire, or EvictRequested)
# the machine is forgotten and the next request starts a fresh one whose first attempt is #1 again,
# so a reply still on its way for the *old* #1 passes the ``_stale`` guard and is taken for the new
# attempt's answer.


def stale_replies_never_accepted(w: World) -> None:
    """A handshake answer the world delivers late (after its attempt was reported timed out)
    answers an abandoned attempt: the engine machine must ignore it, whatever attempt it is on now."""
    last = w.journal[-1] if w.journal else ""
    if "gets a late answer" not in last:
        return
    rank = int(last.split(" D", 1)[1].split(" ", 1)[0])
    kind = HandshakeFailed if last.endswith(": refused") else HandshakeDone
    mine = [r for r in w.records()[f"D{rank}"] if r.machine == "engine" and isinstance(r.event, kind)]
    if mine and mine[-1].state != mine[-1].before:
        r = mine[-1]
        attempt = r.event.attempt if isinstance(r.event, (HandshakeDone, HandshakeFailed)) else "?"
        w.fail(f"D{rank}: a late {kind.__name__} for abandoned attempt #{attempt} was taken as the answer to "
               f"the engine's current attempt ({r.before} -> {r.state})")


def test_late_reply_to_a_forgotten_engines_attempt_is_not_taken_for_the_new_attempts() -> None:
    """No injected fault but a handshake timeout: the core's own idle eviction forgets the FAILED
    engine, the next request handshakes it again as attempt #1, and the first incarnation's late
    reply to its own #1 is accepted (the new attempt's real answer is then ignored as stale)."""
    steps = [
        "prefill: p0 finishes prefill",
        "scheduler: D0 asks to read r0",
        "handshake: D0 gets the answer for (P, pp 0) #1: timed out",
        "timer: time passes to the next deadline",  # t=120: idle eviction of the FAILED engine
        "prefill: p1 finishes prefill",
        "scheduler: D0 asks to read r1",  # a fresh engine machine: StartHandshake attempt #1 again
        "handshake: D0 gets a late answer for (P, pp 0) #1",  # the first incarnation's reply
    ]
    _, message = replay_choices(steps, Scenario(requests=2, faults=frozenset({"handshake-timeout"})), None,
                                [stale_replies_never_accepted], strict=True)
    assert not message, message


def test_late_refusal_to_a_forgotten_engines_attempt_does_not_fail_the_new_request() -> None:
    """The same road, the late answer a refusal: r1 is failed ("handshake with P pp_rank 0 failed:
    connection refused") by an answer to a handshake it never made, and its own attempt's answer,
    which would have connected it, is then ignored as stale."""
    steps = [
        "prefill: p0 finishes prefill",
        "scheduler: D0 asks to read r0",
        "handshake: D0 gets the answer for (P, pp 0) #1: timed out",
        "timer: time passes to the next deadline",
        "prefill: p1 finishes prefill",
        "scheduler: D0 asks to read r1",
        "handshake: D0 gets a late answer for (P, pp 0) #1: refused",
    ]
    _, message = replay_choices(steps, Scenario(requests=2, faults=frozenset({"handshake-timeout"})), None,
                                [stale_replies_never_accepted], strict=True)
    assert not message, message


def test_hunt_finds_no_stale_handshake_answer_after_eviction() -> None:
    """Found by search too (example ~506 of 600, about 5 s): handshake timeouts and idle eviction.
    (With timeouts alone, the core's own idle timer evicting, 3 requests find it at example ~1761.)"""
    found = hunt(Scenario(requests=3, faults=frozenset({"handshake-timeout", "evict"})),
                 invariants=[stale_replies_never_accepted], max_examples=600)
    assert not found.found, found.message


def test_stale_peer_added_from_a_forgotten_engine_is_not_a_local_violation() -> None:
    """With the adapter's PeerAdded as its own step (as connector.py submits it to the inbox): the
    engine is lost while CONNECTING, forgotten, handshaken again as attempt #1, and the old PeerAdded
    for #1 reaches the new HANDSHAKING machine: rejected as a LOCAL violation ("peer added before its
    handshake reply was validated"), which quarantines the engine and fails r1."""
    steps = [
        "prefill: p0 finishes prefill",
        "scheduler: D0 asks to read r0",
        "handshake: D0 gets the answer for (P, pp 0) #1",
        "fault: the producer disconnects",
        "prefill: p1 finishes prefill",
        "timer: idle eviction of the producer engine",
        "scheduler: D0 asks to read r1",
        "adapter D0: PeerAdded reaches D0",
    ]
    _, message = replay_choices(steps, Scenario(requests=2, add_peer_async=True), None, strict=True)
    assert not message, message


def test_hunt_finds_no_stale_attempt_with_async_peer_added_and_three_requests() -> None:
    """The search that found bug A (example ~135 of 300; about 5 s)."""
    found = hunt(Scenario(requests=3, add_peer_async=True, handshake_retry_ns=0, max_steps=80), max_examples=300)
    assert not found.found, found.message


# --- bug B: a notify-only request released in a cascade gets the sibling engine's news -------------
#
# consumer.py: with PP 2, a notify-only request whose two engines are both FAILED (inside their retry
# pause) gets two fail-fast EngineFailed in one cascade (engine.py:_fail_fast). The first takes it
# HANDSHAKING -> RELEASED (_engine_failed_notify_only); the second reaches the RELEASED tombstone, whose
# cell has no stale-news option (unlike READING/FAILED/ABORTED..., guarded by _stopped_waiting_for_it),
# so it is rejected as a LOCAL violation ("engine news for a released request"); strict mode raises.


def test_notify_only_request_failed_by_both_pp_engines_at_once() -> None:
    steps = [
        "prefill: p0 finishes prefill",
        "scheduler: D0 asks to read r0",
        "handshake: D0 gets the answer for (P, pp 0) #1: refused",
        "handshake: D0 gets the answer for (P, pp 1) #1: refused",
        "prefill: p1 finishes prefill",
        "scheduler: D0 asks to read r1",  # r1 is notify-only: both engines fail fast in one cascade
    ]
    _, message = replay_choices(steps, Scenario(requests=2, producer_pp=2, notify_only=(1,),
                                                faults=frozenset({"handshake-refuse"})), None, strict=True)
    assert not message, message


def test_hunt_notify_only_with_pp_2() -> None:
    """The search that found bug B (at example 3; under 1 s)."""
    found = hunt(Scenario(requests=3, producer_pp=2, notify_only=(1,), max_steps=80), max_examples=300)
    assert not found.found, found.message


# --- bug C: a PP engine lost while a sibling handshakes is watched again with the request's old time -----
#
# consumer.py:_rewatch_lost (HANDSHAKING x EngineReady, when a held engine is no longer connected)
# calls _watch_unconnected(m, m.req, core): the EngineWanted it derives (core.watch) is stamped with
# the ReadRequested's t_ns, not the EngineReady's, and the FAILED engine's _retry_later guard, like
# _watch_unconnected's own fail-fast check, compares that old time with retry_at. So a request that
# watches again, after the retry pause is over, an engine another request's handshake failed is
# failed at once with that handshake's error instead of retrying it. Fix: watch with the news'
# time, e.g. _watch_unconnected(m, msgspec.structs.replace(m.req, t_ns=ev.t_ns), core), or a t_ns
# parameter used for both the break check and core.watch.

LINK_DROP = frozenset({"link-drop"})


def test_a_lost_pp_engine_watched_again_after_its_retry_pause_is_retried() -> None:
    """r0 (PP 2) holds pp 0 while pp 1 handshakes; pp 0's connection drops; r1 re-handshakes pp 0,
    refused (pp 0 FAILED, retry at t=10); at t=15 pp 1 answers and r0 watches pp 0 again, stamped
    t=0: failed fast with r1's "connection refused" instead of a retry that would have connected."""
    steps = [
        "prefill: p0 finishes prefill",
        "scheduler: D0 asks to read r0",
        "handshake: D0 gets the answer for (P, pp 0) #1",
        "fault: D0 loses its connection to (P, pp 0)",
        "transport: D0 reports (P, pp 0) disconnected",
        "prefill: p1 finishes prefill",
        "scheduler: D0 asks to read r1",
        "handshake: D0 gets the answer for (P, pp 0) #2: refused",
        "timer: 5 ns pass",
        "timer: 5 ns pass",
        "timer: 5 ns pass",  # t=15: pp 0's retry pause (10 ns) is over
        "handshake: D0 gets the answer for (P, pp 1) #1",  # r0 rewatches pp 0
    ]
    world, message = replay_choices(steps, Scenario(requests=2, producer_pp=2, faults=LINK_DROP | {"handshake-refuse"}),
                                    None, EXTRA_INVARIANTS, strict=True)
    assert not message, message
    assert [o.outcome for o in world.hand_offs[(0, "r0")]] == ["received"], world.hand_offs[(0, "r0")]


def test_hunt_finds_no_effect_stamped_before_its_cause_with_a_pp_link_drop() -> None:
    """The search that found bug C (example 33 of 300, under 2 s): the 7 steps of a rewatch."""
    found = hunt(Scenario(requests=2, producer_pp=2, faults=LINK_DROP, max_steps=60),
                 invariants=EXTRA_INVARIANTS, max_examples=300)
    assert not found.found, found.message


def test_a_pp_link_drop_reaches_the_consumers_rewatch_of_a_lost_engine() -> None:
    """The option no fault could reach before link-drop (disconnect took every PP rank, for good)."""
    hits = explore_options({"pp2 link-drop": Scenario(requests=2, producer_pp=2, faults=LINK_DROP, max_steps=60)},
                           300)  # first reached within 200 examples
    rewatch = ("consumer", "HANDSHAKING", "EngineReady", "-> HANDSHAKING (rewatch lost) when held engine lost")
    assert rewatch in hits


def test_a_producer_rank_restarted_alone_is_never_read_as_the_hold_it_replaced() -> None:
    """Opt-in fault rank-restart: one producer rank's process comes back under the same agent name
    and listener with another process's memory. Ranks say when they started, so params issued
    before fail and nothing read from the successor is reported received (every fault kind, TP 2
    on both sides). The same world with replies that do not say it (older producers, quirk
    no-start-times) is caught reading the successor's blocks, in two chosen steps."""
    scenario = Scenario(requests=2, producer_tp=2, consumer_tp=2, faults=FAULTS | {"rank-restart"})
    clean = hunt(scenario, max_examples=150)
    assert not clean.found, clean.message
    unsaid = Variant(id="start times unsaid", quirks=frozenset({"no-start-times"}))
    found = hunt(scenario, unsaid, max_examples=300)
    assert found.found and found.steps <= 3, found.message
    assert "the bytes are not the request's" in found.message and "restarts" in found.message


def test_a_producer_restarted_while_idle_is_handshaken_again_under_every_interleaving() -> None:
    """With rank-restart the world's ranks say their process (incarnation) and the params the
    minting rank's: fresh params that meet a reply from before the restart, the loss not yet
    reported, make the consumer handshake again instead of refusing them (docs/decisions.md, "A
    contradiction with a connected engine's reply evicts it"). The search reaches that option and
    every invariant holds: nothing read from the wrong process, every request ends once."""
    scenario = Scenario(requests=3, producer_tp=2, consumer_tp=2, faults=FAULTS | {"rank-restart"})
    hits = explore_options({"restart tp2": scenario}, 150)
    assert ("consumer", "NEW", "ReadRequested", "-> HANDSHAKING (handshake again) when stale reply") in hits


def test_a_pp_stage_restarted_mid_handshake_is_never_told_of_its_predecessors_hold() -> None:
    """PP 2 with rank-restart and the adapter's PeerAdded a step of its own: a stage restarts while
    the consumer handshakes both, the request is aborted, the minting stage (0) connects while
    stage 1 is still connecting. The end invariant that no notification reaches a process that
    never held its request found the notice stage 0's verdict sent to the new stage-1 process in
    6 chosen steps (1.5 to 9 s) before consumer.send_owed left it to stage 1's own reply; the same
    searches run clean now, and so does the told-every-rank invariant, which excuses a stage whose
    notice waits for a minting stage not connected by the lease's bound."""
    for tp in (1, 2):
        scenario = Scenario(requests=1, producer_pp=2, producer_tp=tp, faults=frozenset({"rank-restart", "abort"}),
                            add_peer_async=True, max_steps=40)
        found = hunt(scenario, max_examples=300)
        assert not found.found, found.message



def _extend_from_old_deadline(m: P.ProducerRequest, ev: Heartbeat, core: Core) -> None:
    P._move_deadline(m, m.deadline + ev.extend_ns, core)  # the bug: extensions add up


def _hold_in_the_wrong_unit(m: P.ProducerRequest, ev: BlocksHeld, core: Core) -> None:
    P._hold(m, ev, core)
    P._move_deadline(m, m.t_start + core.lease_ns * 1000, core)  # the bug: a lease 1000 times too long


@pytest.mark.parametrize(("bug", "cells", "fault"), [
    ("heartbeats-add-up", on(P.S.HOLDING, Heartbeat, Go(P.S.HOLDING, _extend_from_old_deadline)), "heartbeat"),
    ("lease-in-the-wrong-unit", on(P.S.NEW, BlocksHeld, Go(P.S.HOLDING, _hold_in_the_wrong_unit, when=P._on_our_clock),
                                   *P.TABLE.cells[(P.S.NEW, BlocksHeld)][1:]), "handshake-refuse"),
])
def test_a_hold_kept_past_its_lease_and_heartbeats_is_found(bug: str, cells: Any, fault: str) -> None:
    """A producer that keeps blocks far past every bound (heartbeats adding up from the old
    deadline; a lease in the wrong unit) passed every invariant: the settled world jumps time past
    any deadline. A helper's mutants found the gap; holds_end_on_time closes it, and the real
    machines pass it (the searches above and tests/test_race.py)."""
    variant = Variant(bug, bug, Tables(producer=P.TABLE.patched(bug, cells)))
    found = hunt(Scenario(requests=1, faults=frozenset({fault})), variant, max_examples=500)
    assert found.found and "past the" in found.message and found.steps <= 4, found.message



def _trust_the_promise(m: C.ConsumerRequest, ev: Promised, core: Core) -> None:
    """A naive connector: a heartbeat's promise extends how long its reads are trusted."""
    C._promise(m, ev, core)
    if m.trust is not None and m.deadline is not None and m.req is not None:
        m.trust = max(m.trust, ev.promised_ns - core.lease_margin_ns)
        timeout = m.req.deadline.t_ns if m.req.deadline is not None else m.req.t_ns + core.read_timeout_ns
        if (later := min(timeout, m.trust)) > m.deadline:
            core.deadlines.disarm(m.request_id, m.deadline)
            m.deadline = later
            core.deadlines.arm(m.request_id, later)


def test_a_consumer_that_trusts_a_lost_heartbeat_reads_reused_blocks() -> None:
    """The world delivered every heartbeat, so a consumer that trusted a heartbeat's promise for
    its reads passed every search (a helper's mutants). With ``heartbeat-drop`` a heartbeat can be
    lost while the loads are promised all the same: that consumer reads blocks the producer's
    expired lease let it reuse; the real machines run clean."""
    scenario = Scenario(requests=2, faults=frozenset({"heartbeat-drop"}))
    assert not hunt(scenario, max_examples=500).found
    cells = {k: v for st in (C.S.HANDSHAKING, C.S.READING)
             for k, v in on(st, Promised, C.TABLE.cells[(st, Promised)][0], Go(st, _trust_the_promise)).items()}
    variant = Variant("promise-trusted", "a heartbeat's promise extends the reads' trust",
                      Tables(consumer=C.TABLE.patched("promise-trusted", cells)))
    found = hunt(scenario, variant, max_examples=2000)
    assert found.found and "the bytes are not the request's" in found.message, found.message


# --- clean searches: shapes the default scenarios do not cover ------------------------------------

# Each ran clean at 1500 examples with random seeds too, and reaches no table cell the default
# scenarios do not (tests/test_race.py); kept for the shapes and read plans they combine.
CLEAN: dict[str, tuple[Scenario, int]] = {
    # PP 2 with every handshake fault together (evict, disconnect, refused, timed out, peer refused).
    "pp2-handshake-faults": (Scenario(producer_pp=2, faults=HANDSHAKE_FAULTS | {"abort"}, max_steps=60), 500),
    # Asymmetric TP with MLA, both ways (the default MLA scenario is consumer TP 1, producer TP 2).
    "mla-consumer-tp4-producer-tp2": (Scenario(consumer_tp=4, producer_tp=2, mla=True, max_steps=60), 300),
    "mla-consumer-tp2-producer-tp4": (Scenario(consumer_tp=2, producer_tp=4, mla=True, max_steps=60), 300),
    # Four requests, every fault kind at once (Scenario's default ``faults`` is all of FAULTS).
    "four-requests-every-fault": (Scenario(requests=4, faults=FAULTS, max_steps=80), 400),
    # PP 2, the adapter's PeerAdded a step of its own: one PP rank's connection drops and is handshaken
    # again, posts refused, handshakes timed out; engines idle 8 ns are evicted by the cores' own timer.
    "pp2-link-drop-async-idle": (Scenario(producer_pp=2, add_peer_async=True, handshake_retry_ns=2, tombstone_ns=8,
                                          faults=LINK_DROP | {"post-refuse", "handshake-timeout"}, max_steps=60), 400),
    # PP 2 with producer TP 2, three requests, the opt-in faults with every engine fault, abort and read ERR.
    "pp2-tp2-link-drop-every-engine-fault": (Scenario(
        requests=3, producer_pp=2, producer_tp=2, handshake_retry_ns=3, tombstone_ns=10, max_steps=80,
        faults=HANDSHAKE_FAULTS | LINK_DROP | {"post-refuse", "abort", "read-err"}), 300),
}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_real_machines_hold_every_invariant(name: str) -> None:
    scenario, examples = CLEAN[name]
    found = hunt(scenario, invariants=[stale_replies_never_accepted], max_examples=examples)
    assert not found.found, found.message


@pytest.mark.parametrize(("scenario", "steps"), [
    (Scenario(requests=2, producer_pp=2, notify_only=(1,), faults=frozenset()),
     ["prefill: p0 finishes prefill", "scheduler: D0 asks to read r0", "timer: time passes to the next deadline",
      "timer: 5 ns pass", "prefill: p1 finishes prefill", "scheduler: D0 asks to read r1",
      "timer: time passes to the next deadline"]),
    (Scenario(requests=4, producer_pp=2, producer_tp=2, mla=True, notify_only=(1, 3), policy="fail",
              faults=FAULTS | EXTRA_FAULTS),  # both stages stalled: each refuses r1 at once
     ["prefill: p0 finishes prefill", "scheduler: D0 asks to read r0", "handshake: D0 gets the answer for (P, pp 0) #1",
      "handshake: D0 gets the answer for (P, pp 1) #1", "scheduler: decode aborts r0",
      "timer: time passes to the next deadline"]),
])
def test_a_notify_only_pp_request_released_by_one_stage_ignores_the_other_stages_news(
        scenario: Scenario, steps: list[str]) -> None:
    """Found by a helper's long hunts, with no fault at all: a notify-only request waits for both
    PP stages; the core's handshake bound fails both in one Tick, each deriving EngineFailed for
    it. The first released it (nothing to read); the second, derived before that, reached the
    released request and was rejected as a local violation (strict mode raised)."""
    _, message = replay_choices(steps, scenario, None, strict=True)
    assert message == "", message


def test_the_world_counts_no_heartbeat_a_full_staging_may_drop() -> None:
    """A world-model bug found by a helper's long hunts: the world's decode scheduler counted a
    heartbeat sent before the hold registered, which the producer's staging (max_staged 3: one
    promise at most) then dropped, as documented; the read it trusted past the real lease copied
    reused blocks. It counts one now only where every producer rank holds the request."""
    steps = ["prefill: p0 finishes prefill", "prefill: p1 finishes prefill", "timer: time passes to the next deadline",
             "timer: time passes to the next deadline", "scheduler: decode heartbeats p1",
             "scheduler: decode heartbeats p0", "prefill worker P0.0: registers p0",
             "prefill worker P0.0: registers p1", "timer: time passes to the next deadline"]
    _, message = replay_choices(steps, Scenario(requests=3, max_staged=3, faults=frozenset({"heartbeat", "abort"})),
                                None, strict=True)
    assert message == "", message


def test_a_stalled_stage_taken_as_lost_drops_its_peer_only_under_cancelled_reads() -> None:
    """Found by a helper's long random walks: r0's read fails and its sibling is cancelled; r1
    posts two healthy reads on the same connection; r0's grace passes with the cancelled read
    still running, so the stage is marked stalled; an eviction (idle here, in production a
    replacement producer's contradicting params) takes it as lost with readers, owing the drop;
    r2's handshake paid it, dropping the peer under r1's reads, which nobody cancelled. Taken as
    lost, the stage now has its remaining reads cancelled first (their requests fail as they end)."""
    steps = ["prefill: p0 finishes prefill", "scheduler: D0 asks to read r0", "prefill: p1 finishes prefill",
             "handshake: D0 gets the answer for (P, pp 0) #1", "transfer: D0 read of r0 from (0, 1) ends err",
             "scheduler: D0 asks to read r1", "timer: time passes to the next deadline",
             "timer: idle eviction of the producer engine"]
    scenario = Scenario(requests=3, producer_tp=2, cancel_grace_ns=2, faults=frozenset({"read-err", "evict"}))
    _, message = replay_choices(steps, scenario, None, strict=True)
    assert message == "", message
