"""What the NIXL and torch transport tests share: KV tensors, a Connector-driven rank, waiting, and
tests/nixl_peer.py run as another OS process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from helpers import child_env

from pdfsm.connector import Connector
from pdfsm.events import Event


def random_kv(regions: int, blocks: int, block_bytes: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8, generator=gen) for _ in range(regions)]


def zero_kv(regions: int, blocks: int, block_bytes: int) -> list[torch.Tensor]:
    return [torch.zeros(blocks, block_bytes, dtype=torch.uint8) for _ in range(regions)]


LOOPBACK = frozenset({"0100007F", "00000000000000000000000001000000"})  # 127.0.0.1, ::1 as /proc writes them


def listening_addresses(pid: int | str = "self") -> dict[str, str]:
    """A process's listening TCP sockets, socket inode -> local address (as /proc writes it): its
    socket inodes matched against the kernel's tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = {}
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    out[cols[9]] = cols[1].rsplit(":", 1)[0]
    return out


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


ROOT = Path(__file__).resolve().parent.parent


class PeerProcess:
    """tests/nixl_peer.py in a subprocess, under agent name ``agent``; its lines over a pipe,
    nothing pickled. ``wait_for`` blocks for a line; ``stop`` asks it to quit, then kills."""

    def __init__(self, agent: str, blocks: int, block_bytes: int, *extra: str, regions: int = 2, seed: int = 1,
                 quiet: bool = False) -> None:
        self.agent = agent
        env = child_env()
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "nixl_peer.py"), "--agent", agent, "--blocks", str(blocks),
             "--block-bytes", str(block_bytes), "--regions", str(regions), "--seed", str(seed), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if quiet else None, text=True,
            env=env, cwd=ROOT)
        self.lines: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for("READY", timeout=60)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line.strip())
                self._cv.notify_all()

    def wait_for(self, prefix: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"no {prefix!r} from the peer; got {self.lines[-5:]}")
                self._cv.wait(left)

    def has(self, prefix: str) -> bool:
        with self._cv:
            return any(line.startswith(prefix) for line in self.lines)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("QUIT\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
