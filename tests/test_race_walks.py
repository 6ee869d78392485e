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

from pdfsm.testing import Scenario, World
from pdfsm.testing.invariants import END_INVARIANTS
from pdfsm.testing.world import InvariantViolation

_F = frozenset({"abort", "read-err", "read-raise", "notify-drop", "notify-duplicate", "heartbeat", "forge"})
SHAPES = {
    "tp21": Scenario(requests=2, consumer_tp=2, producer_tp=1, faults=_F),
    "tp12": Scenario(requests=2, consumer_tp=1, producer_tp=2, faults=_F),
    "mla12": Scenario(requests=2, producer_tp=2, mla=True, faults=_F),
    "mla21": Scenario(requests=2, consumer_tp=2, producer_tp=1, mla=True, faults=_F),
    "mla24": Scenario(requests=2, consumer_tp=2, producer_tp=4, mla=True, faults=_F),
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
