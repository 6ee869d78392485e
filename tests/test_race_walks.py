"""Seeded random walks over many world shapes: the race tester's searches are derandomized in CI
(the same few hundred interleavings every run), and a helper's random walks found bugs they had
not (a staged heartbeat's promise lost, tests/test_producer_paths.py; a world-model bug,
tests/test_race_shapes.py). Each
walk makes up to 40 random choices from ``random.Random(seed)``, settles and checks every
invariant: deterministic, broad, about ten seconds in all (such a bug showed in about one walk in
a thousand: a net, not a proof)."""

from __future__ import annotations

import random

import pytest

from pdfsm import consumer
from pdfsm.core import Core, Tables
from pdfsm.events import DeadlinePassed
from pdfsm.fsm import Go, on
from pdfsm.testing import Scenario, Variant, World
from pdfsm.testing.explore import replay_choices
from pdfsm.testing.invariants import END_INVARIANTS
from pdfsm.testing.world import InvariantViolation

_F = frozenset({"abort", "read-err", "read-raise", "notify-drop", "notify-duplicate", "heartbeat", "forge"})
SHAPES = {
    "tp21": Scenario(requests=2, consumer_tp=2, producer_tp=1, faults=_F),
    "tp12": Scenario(requests=2, consumer_tp=1, producer_tp=2, faults=_F),
    "mla12": Scenario(requests=2, producer_tp=2, mla=True, faults=_F),
    "mla21": Scenario(requests=2, consumer_tp=2, producer_tp=1, mla=True, faults=_F),
    "mla24": Scenario(requests=2, consumer_tp=2, producer_tp=4, mla=True, faults=_F),
    "heads14": Scenario(requests=2, consumer_tp=1, producer_tp=4, kv_heads=2, faults=_F),  # read 2 ranks, tell 2
    "heads41": Scenario(requests=2, consumer_tp=4, producer_tp=2, kv_heads=1, faults=_F),
    "pp2": Scenario(requests=2, producer_pp=2, producer_tp=2, faults=_F),
    "pp2-no-pp": Scenario(requests=2, producer_pp=2, supports_pp=False, faults=_F),
    "notify-only": Scenario(requests=3, notify_only=(0, 2), producer_tp=2, faults=_F),
    "extra": Scenario(requests=2, producer_tp=2, faults=_F | {"post-refuse", "late-tick", "second-reader"}),
    "restart": Scenario(requests=2, faults=_F | {"rank-restart", "link-drop"}),
    "async": Scenario(requests=2, producer_pp=2, add_peer_async=True, scheduler_deadlines=True, faults=_F),
    "idle": Scenario(requests=3, idle_engine_ns=20, faults=_F),
    "short-lease": Scenario(requests=2, producer_tp=2, lease_ns=12, read_timeout_ns=40, lease_margin_ns=3, faults=_F),
    "grace": Scenario(requests=2, producer_tp=2, cancel_grace_ns=3, read_timeout_ns=10, faults=_F),
    "handshakes": Scenario(requests=3, faults=_F | {"handshake-refuse", "handshake-timeout", "peer-refused",
                                                    "disconnect", "evict"}),
}
WALKS = 150


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_seeded_random_walks_keep_every_invariant(shape: str) -> None:
    for seed in range(WALKS):
        rnd = random.Random(seed)
        world = World(SHAPES[shape])
        try:
            for _ in range(rnd.randint(1, 40)):
                choices = world.enabled()
                if not choices:
                    break
                world.choose(rnd.choice(choices))
            world.drain()
            for invariant in END_INVARIANTS:
                invariant(world)
        except InvariantViolation as exc:
            pytest.fail(f"{shape}, seed {seed}: {exc}")


# --- the notice invariant and notify-only requests -----------------------------------------------
# A notify-only request tells the producer's stages together, once every stage is ready, or at its
# deadline the connected ones; past the trust bound, nobody (docs/decisions.md, "A notify-only
# request tells its stages together"). A helper's walks found the invariant counting its stop from
# when it was asked, so a stage connected before a deadline at the trust bound counted as owed.

_NOTIFY_PP2 = ["prefill: p0 finishes prefill", "scheduler: D0 asks to read r0",
               "handshake: D0 gets the answer for (P, pp 0) #1", "timer: time passes to the next deadline"]


def _silent_timeout(m: consumer.ConsumerRequest, ev: DeadlinePassed, core: Core) -> None:
    """The bug planted: a notify-only request timing out tells no connected stage."""
    consumer._stop_waiting(m, core, ev.t_ns)
    core.finished(m, "dropped", ev.t_ns)


def test_a_notify_only_request_is_owed_notices_from_when_its_core_lets_it_go() -> None:
    """Scenario: PP 2, notify-only r0; stage 0 answers, stage 1 does not before the deadline.
    Expected: with the deadline at the read timeout, before the trust bound, stage 0 is told at the
    deadline, and a table that tells nobody then is caught; with the request asked so late that its
    deadline is the trust bound, nobody is told and the invariant holds (the walk's counterexample)."""
    on_time = Scenario(requests=1, producer_pp=2, notify_only=(0,), lease_ns=60, read_timeout_ns=20,
                       lease_margin_ns=5, faults=frozenset())
    world, violation = replay_choices(_NOTIFY_PP2, on_time, None, strict=True)
    assert not violation and any(n.request_id == "p0" for n in world.notifications)
    planted = Variant("silent", "a timed-out notify-only request tells nobody", Tables(
        consumer=consumer.TABLE.patched("silent", on(consumer.S.HANDSHAKING, DeadlinePassed,
                                                     Go(consumer.S.RELEASED, _silent_timeout)))))
    _, violation = replay_choices(_NOTIFY_PP2, on_time, planted, strict=True)
    assert "never told producer ranks [(0, 0), (1, 0)]" in violation  # stage 1 was owed its notice too
    late = Scenario(requests=1, producer_pp=2, notify_only=(0,), lease_ns=60, read_timeout_ns=40,
                    lease_margin_ns=5, faults=frozenset())
    steps = [*_NOTIFY_PP2[:1], *["timer: 5 ns pass"] * 4, *_NOTIFY_PP2[1:]]
    world, violation = replay_choices(steps, late, None, strict=True)
    assert not violation and not world.notifications
