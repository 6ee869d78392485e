"""Deadlines on a hashed timer wheel: arming and disarming are O(1), and a tick visits only
the slots that are due, so its cost follows what expires, never how much is waiting.

Every deadline is on the owning core's clock (events carry times already in it). A lease that
a heartbeat extends is disarmed at its old deadline and armed at the new one, so nothing is
ever out of order in a scan and no early-stopping scan can skip a due entry (vLLM PR 50789).
"""

from __future__ import annotations

import heapq

__all__ = ["Timers"]


class Timers:
    """Keyed deadlines, bucketed in slots of ``2**shift`` ns (16.8 ms by default)."""

    __slots__ = ("_order", "_shift", "_slots")

    def __init__(self, shift: int = 24) -> None:
        self._shift = shift
        self._slots: dict[int, dict[str, int]] = {}
        self._order: list[int] = []  # heap of slot numbers; may hold slots emptied since

    def arm(self, key: str, deadline: int) -> None:
        slot = deadline >> self._shift
        keys = self._slots.get(slot)
        if keys is None:
            self._slots[slot] = {key: deadline}
            heapq.heappush(self._order, slot)
        else:
            keys[key] = deadline

    def disarm(self, key: str, deadline: int) -> None:
        keys = self._slots.get(deadline >> self._shift)
        if keys is not None and keys.get(key) == deadline:
            del keys[key]

    def due(self, now: int) -> list[tuple[int, str]]:
        """Every (deadline, key) at or before ``now``, earliest first, disarmed."""
        out: list[tuple[int, str]] = []
        slots, order, last = self._slots, self._order, now >> self._shift
        while order and order[0] <= last:
            slot = order[0]
            keys = slots.get(slot)
            if keys and slot == last:  # the slot ``now`` falls in: take only what is ripe
                ripe = [(d, k) for k, d in keys.items() if d <= now]
                for _, k in ripe:
                    del keys[k]
                out.extend(ripe)
                if keys:
                    break
            elif keys:
                out.extend((d, k) for k, d in keys.items())
            slots.pop(slot, None)
            heapq.heappop(order)
        out.sort()
        return out

    def earliest(self) -> int | None:
        """The earliest armed deadline, or None."""
        slots, order = self._slots, self._order
        while order:
            keys = slots.get(order[0])
            if keys:
                return min(keys.values())
            slots.pop(order[0], None)
            heapq.heappop(order)
        return None

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._slots.values())

    def __contains__(self, key: object) -> bool:
        return any(key in keys for keys in self._slots.values())
