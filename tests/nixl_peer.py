"""A producer (prefill) engine rank in its own OS process, for the two-process NIXL tests and
the transport benchmark.

It owns a :class:`~transports.nixl.NixlTransport` over KV tensors filled with
:func:`fill_pattern`, and talks to its parent over its stdin and stdout with plain
text lines (nothing is pickled; binary values are hex of msgspec MessagePack):

- out ``RANK <hex>``: its :class:`~pdfsm.events.RankInfo`, once, when ready;
- in ``HOLD <request_id> <block,block,...>``: hold those blocks (``request_finished``),
  answered ``HELD <request_id>``;
- out ``RELEASED <request_id>``: every consumer read them (the notification arrived);
- out ``NOTE <sender> <request_id> <part> <of>``: each notification received;
- in ``QUIT`` or end of input: shut down and exit 0.

NIXL writes its own log lines to stdout too; the parent ignores lines it does not know.
"""

from __future__ import annotations

import argparse
import logging
import queue
import sys
import threading
from collections.abc import Sequence

import msgspec
import torch

from pdfsm.connector import Connector
from pdfsm.events import CoreConfig, NotificationReceived, RankInfo
from pdfsm.log import EventLog, Row
from transports.nixl import NixlTransport, import_nixl
from transports.sim import SimHandshaker, SimNetwork


def fill_pattern(tensor: torch.Tensor, seed: int) -> None:
    """Deterministic bytes, the same in every process: the consumer recomputes them to verify."""
    gen = torch.Generator().manual_seed(seed)
    flat = tensor.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))


def expected_regions(seed: int, regions: int, num_blocks: int, block_bytes: int) -> list[torch.Tensor]:
    out = []
    for k in range(regions):
        t = torch.empty(num_blocks, block_bytes, dtype=torch.uint8)
        fill_pattern(t, seed + k)
        out.append(t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--agent", required=True)
    ap.add_argument("--engine", default="P")
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lease-s", type=float, default=120.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import_nixl()
    logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs INFO to stdout by default
    tensors = expected_regions(args.seed, args.regions, args.blocks, args.block_bytes)
    transport = NixlTransport(args.agent, tensors, tp_rank=args.tp_rank)
    config = CoreConfig(engine_id=args.engine, tp_rank=args.tp_rank, tp_size=args.tp_size,
                        lease_ns=int(args.lease_s * 1e9))
    out = sys.stdout

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    class NoteSink:
        """Reports every notification the core applied, as it is flushed."""

        def write(self, rows: Sequence[Row]) -> None:
            for row in rows:
                ev = row[1]
                if isinstance(ev, NotificationReceived):
                    say(f"NOTE {ev.sender} {ev.request_id} {ev.part} {ev.of}")

        def close(self) -> None:
            pass

    conn = Connector(config, transport, SimHandshaker(SimNetwork()), log=EventLog(sink=NoteSink()))

    say("RANK " + msgspec.msgpack.encode(transport.rank_info()).hex())
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def read_stdin() -> None:
        for line in sys.stdin:
            lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=0.0005)
        except queue.Empty:
            line = ""
        if line is None or line == "QUIT":
            break
        if line.startswith("HOLD "):
            _, rid, blocks = line.split()
            conn.request_finished(rid, [int(b) for b in blocks.split(",") if b])
            say(f"HELD {rid}")
        sending, _ = conn.get_finished()
        for rid in sorted(sending):
            say(f"RELEASED {rid}")
    conn.shutdown()
    return 0


def decode_rank(hex_line: str) -> RankInfo:
    return msgspec.msgpack.decode(bytes.fromhex(hex_line), type=RankInfo)


if __name__ == "__main__":
    sys.exit(main())
