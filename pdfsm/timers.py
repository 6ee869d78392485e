"""Deadlines on a hashed timer wheel: arming and disarming are O(1), and a tick visits only
the slots that are due, so its cost follows what expires, never how much is waiting.

Every deadline is on the owning core's clock (events carry times already in it). A lease that
a heartbeat extends is disarmed at its old deadline and armed at the new one, so nothing is
ever out of order in a scan and no early-stopping scan can skip a due entry (vLLM PR 50789).
"""

from __future__ import annotations

import bisect
import heapq

from mypy_extensions import mypyc_attr

__all__ = ["Timers"]


@mypyc_attr(allow_interpreted_subclasses=True)  # the race tester's planted bugs subclass it (mutants.py)
class Timers:
    """Keyed deadlines, bucketed in slots of ``2**shift`` ns (16.8 ms by default).

    Neither :meth:`earliest` nor :meth:`due` may cost a scan of a crowded slot every step (100k
    requests admitted in one burst share one slot): the earliest slot is sorted once into
    ``_run`` and consumed from its end, entries disarmed since being skipped as they surface
    (amortized O(log n) per entry, whatever the slot holds).
    """

    __slots__ = ("_order", "_run", "_run_slot", "_shift", "_slots")

    def __init__(self, shift: int = 24) -> None:
        self._shift = shift
        self._slots: dict[int, dict[str, int]] = {}
        self._order: list[int] = []  # heap of slot numbers; may hold slots emptied since
        self._run: list[tuple[int, str]] = []  # the slot ``_run_slot``'s entries, latest first
        self._run_slot: int | None = None  # None: no slot sorted (every int is a slot, -1 too)

    def arm(self, key: str, deadline: int) -> None:
        slot = deadline >> self._shift
        keys = self._slots.get(slot)
        if keys is None:
            self._slots[slot] = {key: deadline}
            heapq.heappush(self._order, slot)
        else:
            keys[key] = deadline
        run_slot = self._run_slot
        if run_slot is not None and slot == run_slot:  # typed: no boxed comparison on the hot path
            bisect.insort(self._run, (-deadline, key))

    def disarm(self, key: str, deadline: int) -> None:
        keys = self._slots.get(deadline >> self._shift)
        if keys is not None:
            armed = keys.get(key)
            if armed is not None and armed == deadline:
                del keys[key]

    def due(self, now: int) -> list[tuple[int, str]]:
        """Every (deadline, key) at or before ``now``, earliest first, disarmed."""
        out: list[tuple[int, str]] = []
        slots, order, last = self._slots, self._order, now >> self._shift
        while order and order[0] <= last:
            slot = order[0]
            keys = slots.get(slot)
            if keys and slot == last:  # the slot ``now`` falls in: take only what is ripe, in order
                run = self._sorted_run(slot, keys)
                while run and -run[-1][0] <= now:
                    neg, key = run.pop()
                    if keys.get(key) == -neg:
                        del keys[key]
                        out.append((-neg, key))
                if keys:
                    break
            elif keys:
                out.extend((d, k) for k, d in keys.items())
            self._drop_front()
        out.sort()
        return out

    def earliest(self) -> int | None:
        """The earliest armed deadline, or None."""
        slots, order = self._slots, self._order
        while order:
            slot = order[0]
            keys = slots.get(slot)
            if keys:
                run = self._sorted_run(slot, keys)
                while run:
                    neg, key = run[-1]
                    if keys.get(key) == -neg:
                        return -neg
                    run.pop()  # disarmed, or taken by ``due``, since the run was sorted
                self._run_slot = None  # every entry of the run was stale: sort what the slot holds now
                continue
            self._drop_front()
        return None

    def _sorted_run(self, slot: int, keys: dict[str, int]) -> list[tuple[int, str]]:
        """The slot's entries sorted latest first, sorted once per slot (arm keeps it sorted)."""
        if slot != self._run_slot or not self._run:
            self._run_slot = slot
            self._run[:] = sorted([(-d, k) for k, d in keys.items()])
        return self._run

    def _drop_front(self) -> None:
        slot = heapq.heappop(self._order)
        self._slots.pop(slot, None)
        if slot == self._run_slot:
            self._run_slot = None
            self._run.clear()

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._slots.values())

    def __contains__(self, key: object) -> bool:
        return any(key in keys for keys in self._slots.values())
