"""The timer wheel against a dict model: any sequence of arm, disarm, due and earliest agrees."""

from __future__ import annotations

from helpers import connected, ev, make_core, read
from hypothesis import given
from hypothesis import strategies as st

from pdfsm.events import AbortRequested, Collect, HandleDone
from pdfsm.timers import Timers

keys = st.sampled_from([f"r{i}" for i in range(8)])
times = st.integers(0, 200)
ops = st.lists(st.one_of(
    st.tuples(st.just("arm"), keys, times),
    st.tuples(st.just("disarm"), keys, times),
    st.tuples(st.just("due"), st.just(""), times),
    st.tuples(st.just("earliest"), st.just(""), st.just(0)),
), max_size=60)


@given(ops)
def test_the_wheel_agrees_with_a_dict(sequence: list[tuple[str, str, int]]) -> None:
    wheel, model = Timers(shift=4), dict[str, int]()  # 16 ns slots: crowded slots, and many
    now = 0
    for op, key, t in sequence:
        if op == "arm":
            if key in model:  # the core disarms before it re-arms a key
                wheel.disarm(key, model.pop(key))
            deadline = now + t
            wheel.arm(key, deadline)
            model[key] = deadline
        elif op == "disarm":
            if key in model and t % 2:
                wheel.disarm(key, model.pop(key))
            else:
                wheel.disarm(key, now + t)  # a stale deadline: nothing happens
                if model.get(key) == now + t:
                    del model[key]
        elif op == "due":
            now += t
            ripe = sorted((d, k) for k, d in model.items() if d <= now)
            assert wheel.due(now) == ripe
            for _, k in ripe:
                del model[k]
        else:
            assert wheel.earliest() == min(model.values(), default=None)
        assert len(wheel) == len(model)


def test_due_takes_a_crowded_slot_in_order_a_little_at_a_time() -> None:
    """100k deadlines in one slot, ten coming due per tick, with arms and disarms in between:
    each tick gets exactly what is ripe (the slot is sorted once, not scanned per tick)."""
    wheel = Timers()
    for i in range(100_000):
        wheel.arm(f"r{i}", 1_000 + i)
    for tick in range(1_000):
        now = 1_000 + tick * 10 + 9
        if tick % 7 == 0:
            wheel.disarm(f"r{now - 1_000}", now)  # the last one of this tick is disarmed
            wheel.arm(f"late{tick}", now + 5)  # armed into the slot being consumed
        ripe = [(d, f"r{d - 1_000}") for d in range(now - 9, now + 1)]
        if tick % 7 == 0:
            ripe.pop()
        if tick % 7 == 1:
            ripe.append((now - 5, f"late{tick - 1}"))
            ripe.sort()
        assert wheel.due(now) == ripe
    assert len(wheel) == 100_000 - 10_000


def test_earliest_of_a_crowded_slot_is_not_a_scan_each_time() -> None:
    """100k deadlines in one slot, taken earliest first: each earliest() is amortized O(1)."""
    wheel = Timers()
    for i in range(100_000):
        wheel.arm(f"r{i}", 1_000 + i)
    for i in range(100_000):
        assert wheel.earliest() == 1_000 + i
        wheel.disarm(f"r{i}", 1_000 + i)
    assert wheel.earliest() is None


def test_terminal_states_are_forgotten_after_tombstone_ns() -> None:
    """A released request's late news is classified while its tombstone lasts; after
    ``tombstone_ns`` the key is forgotten (memory stays flat in a long run)."""
    core = connected(make_core(tombstone_ns=1_000, read_timeout_ns=10**12))
    core.apply(read("r1", t=0))
    core.apply(ev(HandleDone, 0, request_id="r1", pp_rank=0, tp_rank=0))
    core.apply(ev(Collect, 0, step=1))
    core.apply(ev(AbortRequested, 500, request_id="r1"))
    assert core.log.records()[-1].reason == "already released"
    core.apply(read("r2", t=2_000))  # r2 finishing is what trims: r1's tombstone is 2 us old
    core.apply(ev(HandleDone, 2_000, request_id="r2", pp_rank=0, tp_rank=0))
    core.apply(ev(Collect, 2_000, step=2))
    core.apply(ev(AbortRequested, 2_100, request_id="r1"))
    assert core.log.records()[-1].reason == "no such request: nothing to abort"
