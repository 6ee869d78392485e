"""A small scheduler loop on each side of a prefill/decode pair, embedding pdfsm's Connector.

The prefill scheduler finishes a prompt and asks its connector to hold the blocks
(``request_finished``), which returns the ``kv_transfer_params`` a router would pass
on. The decode scheduler allocates local blocks, asks its connector to load them
(``load``: only the blocks its prefix cache misses, none for a full hit, which only tells
the producer it may release; with the time the params arrived, so reads are trusted only
while the producer's lease holds), aborts a request the client gave up on (``abort``), and
each step collects what finished (``get_finished``) and which blocks failed
(``get_block_ids_with_load_errors``), applying the failure policy. Both run
here over the deterministic simulated transport; swap in another transport and a
side-channel handshaker for real engines.

    python examples/scheduler_loop.py
"""

from __future__ import annotations

import itertools
import logging
from collections import deque

import structlog

from pdfsm.connector import Connector, KVTransferParams
from pdfsm.events import CoreConfig, HandshakeReply
from transports.sim import ReadScript, SimHandshaker, SimNetwork, SimTransport


class DecodeScheduler:
    """Allocates blocks, waits for remote KV, recomputes what failed to load."""

    def __init__(self, connector: Connector, num_blocks: int) -> None:
        self.connector = connector
        self.free = deque(range(num_blocks))
        self.waiting_for_kv: dict[str, list[int]] = {}
        self.running: list[str] = []
        self.recompute: list[str] = []
        self.aborted: list[str] = []

    def add(self, request_id: str, params: KVTransferParams, arrived_ns: int, *, cached: int = 0) -> None:
        """``cached``: how many leading blocks the local prefix cache already holds."""
        blocks = [self.free.popleft() for _ in params.remote_block_ids[cached:]]
        self.connector.load(request_id, blocks, params, lease_start_ns=arrived_ns, computed_blocks=cached)
        if blocks:
            self.waiting_for_kv[request_id] = blocks
        else:  # a full prefix hit: nothing to read, never reported; the producer is told to release
            self.running.append(request_id)

    def abort(self, request_id: str) -> None:
        self.connector.abort(request_id)  # it still comes back once, after its reads stopped

    def step(self) -> None:
        _, recving = self.connector.get_finished()
        invalid = self.connector.get_block_ids_with_load_errors()  # same step as the report
        for rid in recving:
            blocks = self.waiting_for_kv.pop(rid)
            if rid in self.connector.last.aborted:
                self.aborted.append(rid)
            elif invalid.intersection(blocks):
                self.recompute.append(rid)  # policy "recompute": prefill locally
            else:
                self.running.append(rid)
            self.free.extend(blocks)  # the toy decodes in no time


class PrefillScheduler:
    """Prefills prompts and frees their blocks once the connector says they were sent."""

    def __init__(self, connector: Connector, num_blocks: int) -> None:
        self.connector = connector
        self.free = deque(range(num_blocks))
        self.held: dict[str, list[int]] = {}

    def prefill(self, request_id: str, num_blocks: int) -> KVTransferParams:
        blocks = [self.free.popleft() for _ in range(num_blocks)]
        self.held[request_id] = blocks
        return self.connector.request_finished(request_id, blocks)

    def step(self) -> None:
        sending, _ = self.connector.get_finished()
        for rid in sending:
            self.free.extend(self.held.pop(rid))


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))  # one line per request
    net, clock = SimNetwork(), itertools.count(step=1_000_000)
    now = [0]

    def tick() -> int:
        return now[0]

    p_transport = SimTransport(net, "prefill-0", num_blocks=256)
    p_transport.fill(range(256))
    prefill = PrefillScheduler(Connector(CoreConfig(engine_id="prefill", compat_hash="m"), p_transport,
                                         SimHandshaker(net), clock=tick, port=8100), 256)
    net.serve("127.0.0.1", 8100, lambda pp: HandshakeReply(engine_id="prefill", compat_hash="m", tp_size=1,
                                                            num_blocks=256, ranks=(p_transport.rank_info(),)))
    decode = DecodeScheduler(Connector(CoreConfig(engine_id="decode", compat_hash="m"),
                                       SimTransport(net, "decode-0", num_blocks=256), SimHandshaker(net), clock=tick),
                             256)
    net.script("req-3", 0, 0, ReadScript(end="err"))  # one read fails: that request is recomputed
    net.script("req-7", 0, 0, ReadScript(polls=50))  # a slow read, which the client gives up on
    for i in range(8):
        params = prefill.prefill(f"p-req-{i}", num_blocks=1 + i % 3)
        # req-5 has its first block in the local prefix cache, req-6 all of them
        decode.add(f"req-{i}", params, arrived_ns=tick(), cached={5: 1, 6: 3}.get(i, 0))
    step = 0
    while step < 10 or decode.connector.busy() or prefill.connector.busy():  # until nothing is left to move
        now[0] = next(clock)
        if step == 2:
            decode.abort("req-7")
        decode.step()
        prefill.step()
        step += 1
    print(f"decoding: {sorted(decode.running)}")
    print(f"recompute: {decode.recompute}")
    print(f"aborted: {decode.aborted}")
    print(f"prefill blocks still held: {sum(map(len, prefill.held.values()))}")


if __name__ == "__main__":
    main()
