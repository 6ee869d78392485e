"""What the NIXL and torch transport tests share: KV tensors, a Connector-driven rank, waiting."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pdfsm.connector import Connector
from pdfsm.events import Event


def random_kv(regions: int, blocks: int, block_bytes: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8, generator=gen) for _ in range(regions)]


def zero_kv(regions: int, blocks: int, block_bytes: int) -> list[torch.Tensor]:
    return [torch.zeros(blocks, block_bytes, dtype=torch.uint8) for _ in range(regions)]


class StepRank:
    """One worker driven through its Connector: what each step reported, accumulated."""

    conn: Connector

    def __init__(self) -> None:
        self.sending: set[str] = set()
        self.recving: set[str] = set()

    def step(self) -> None:
        s, r = self.conn.get_finished()
        self.sending |= s
        self.recving |= r

    def events(self, kind: type[Event]) -> list[Any]:
        """Every recorded event of ``kind`` still in the in-memory log."""
        return [rec.event for rec in self.conn.core.log.records() if isinstance(rec.event, kind)]


def run_until(ranks: Sequence[StepRank], done: Callable[[], bool], timeout: float = 20.0, pause: float = 0.0) -> None:
    """Step every rank until ``done()``; ``pause`` seconds between rounds (for worker threads)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        for rk in ranks:
            rk.step()
        if pause:
            time.sleep(pause)
