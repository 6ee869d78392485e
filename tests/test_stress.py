"""Real threads: transfer workers and noisy producers submit events while one owner applies them.

Many requests move over the torch transport (its worker threads submit every read's outcome)
and over NIXL (its progress thread delivers notifications, polled on the owner thread), while
extra threads keep submitting heartbeats and forged notifications straight into the logs. No
event may be lost, sequence numbers stay contiguous, every request is reported exactly once with
its bytes intact, nothing is blamed on us, and each log replays without divergence.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdfsm.connector import Connector
from pdfsm.events import CoreConfig, HandleDone, HandshakeReply, Heartbeat, NotificationReceived
from pdfsm.fsm import Fault
from pdfsm.log import EventLog, MemorySink
from pdfsm.replay import replay
from transports.sim import SimHandshaker, SimNetwork
from transports.torch import TorchNetwork, TorchTransport

REQUESTS, BLOCKS, BLOCK_BYTES, NOISE_THREADS, NOISE_EACH = 120, 256, 512, 4, 150


class Worker:
    def __init__(self, engine_id: str, rank: int, tp: int, transport: Any, net: SimNetwork, host: str) -> None:
        self.sink = MemorySink()
        self.transport = transport
        config = CoreConfig(engine_id=engine_id, tp_rank=rank, tp_size=tp, lease_ns=60_000_000_000)
        self.conn = Connector(config, transport, SimHandshaker(net), log=EventLog(sink=self.sink),
                              host=host, port=1)
        self.sending: list[str] = []
        self.recving: list[str] = []

    def step(self) -> None:
        s, r = self.conn.get_finished()
        self.sending += s
        self.recving += r


def _stress(make_transport: Callable[[str, int, list[torch.Tensor]], Any]) -> None:
    net = SimNetwork()
    gen = torch.Generator().manual_seed(7)
    p_kv = [[torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=gen)] for _ in range(2)]
    prefill = [Worker("P", r, 2, make_transport("P", r, p_kv[r]), net, "p-host") for r in range(2)]
    d_kv = [torch.zeros(BLOCKS, 2 * BLOCK_BYTES, dtype=torch.uint8)]
    decode = Worker("D", 0, 1, make_transport("D", 0, d_kv), net, "")
    reply = HandshakeReply(engine_id="P", compat_hash="", tp_size=2, num_blocks=BLOCKS,
                           ranks=tuple(w.transport.rank_info() for w in prefill))
    net.serve("p-host", 1, lambda pp: reply)

    rng = random.Random(3)
    tables: dict[str, tuple[list[int], list[int]]] = {}
    for i in range(REQUESTS):
        remote = rng.sample(range(BLOCKS), 2)
        local = [2 * i % BLOCKS, (2 * i + 1) % BLOCKS] if i < BLOCKS // 2 else rng.sample(range(BLOCKS), 2)
        tables[f"d{i}"] = (local, remote)

    def noise(k: int) -> None:  # producers on other threads: heartbeats and forged notifications
        for j in range(NOISE_EACH):
            core = prefill[j % 2].conn.core
            now = time.monotonic_ns()
            if j % 3:
                core.submit(Heartbeat(source=f"noise-{k}", t_ns=now, request_id=f"p{j % REQUESTS}", extend_ns=10**9))
            else:
                core.submit(NotificationReceived(source=f"noise-{k}", t_ns=now, request_id=f"forged-{k}-{j}",
                                                 part=0, of=1, sender="mallory"))

    threads = [threading.Thread(target=noise, args=(k,)) for k in range(NOISE_THREADS)]
    for t in threads:
        t.start()
    started = 0
    deadline = time.monotonic() + 60
    workers = [*prefill, decode]
    while len(decode.recving) < REQUESTS or any(len(w.sending) < REQUESTS for w in prefill):
        assert time.monotonic() < deadline, "timed out"
        if started < REQUESTS and len(decode.recving) > started - 32:  # at most 32 in flight
            i = started
            local, remote = tables[f"d{i}"]
            held = [w.conn.request_finished(f"p{i}", remote) for w in prefill]  # every rank holds its part
            params = held[0]
            decode.conn.load(f"d{i}", local, params)
            started += 1
        for w in workers:
            w.step()
        if started >= REQUESTS and len(decode.recving) < REQUESTS:
            time.sleep(0.0005)
        # Verify each request's bytes as soon as it is reported, before its local blocks are reused.
        for rid in decode.recving[-8:]:
            local, remote = tables[rid]
            for lb, rb in zip(local, remote, strict=True):
                got = d_kv[0][lb]
                assert torch.equal(got[:BLOCK_BYTES], p_kv[0][0][rb]), rid
                assert torch.equal(got[BLOCK_BYTES:], p_kv[1][0][rb]), rid
    for t in threads:
        t.join()
    for w in workers:
        w.conn.step()
        w.conn.shutdown()

    assert sorted(decode.recving) == sorted(tables) and len(decode.recving) == REQUESTS  # each once
    for w in prefill:
        assert sorted(w.sending) == sorted(f"p{i}" for i in range(REQUESTS))
    for w in workers:
        records = w.sink.records
        assert [r.seq for r in records] == list(range(len(records)))  # contiguous, nothing lost
        assert w.conn.core.rejections[Fault.LOCAL] == 0
        # every request terminal; only the forged notifications wait, staged until their bound
        assert not w.conn.core.consumers
        assert all(rid.startswith("forged-") and m.state.name == "STAGED" for rid, m in w.conn.core.producers.items())
        replay(records)
    done = [r for r in decode.sink.records if isinstance(r.event, HandleDone)]
    assert len(done) == 2 * REQUESTS  # every read's outcome, submitted by a worker thread, arrived
    noise_in = sum(1 for w in prefill for r in w.sink.records if r.event.source.startswith("noise-"))
    assert noise_in == NOISE_THREADS * NOISE_EACH


def test_torch_worker_threads_and_noise_threads() -> None:
    tnet = TorchNetwork()
    _stress(lambda eng, rank, kv: TorchTransport(tnet, f"{eng}{rank}", kv, tp_rank=rank, workers=4,
                                                 latency_s=0.0005))


@pytest.mark.nixl
def test_nixl_progress_threads_and_noise_threads() -> None:
    nixl = pytest.importorskip("transports.nixl")
    if not nixl.nixl_available():
        pytest.skip("NIXL is not installed")
    stamp = time.monotonic_ns()
    _stress(lambda eng, rank, kv: nixl.NixlTransport(f"stress-{stamp}-{eng}{rank}", kv, tp_rank=rank))
