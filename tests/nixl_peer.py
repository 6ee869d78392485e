"""A producer (prefill) engine in its own OS process, for the two-process NIXL tests: one rank,
or with ``--all-ranks`` every rank of a PP x TP engine.

Each rank owns a :class:`~transports.nixl.NixlTransport` (its own NIXL agent) and a
Connector, over one KV region per layer it holds, filled with :func:`fill_pattern`
(seed :func:`region_seed`, so the consumer can recompute what each rank holds). PP
rank ``p`` of ``P`` holds layers ``[p*L/P, (p+1)*L/P)`` of ``L = --regions`` and
registers them with their layer ids. With ``--sidechannel`` a real side-channel
listener (:mod:`pdfsm.sidechannel`) answers pp_rank ``p`` with the metadata of PP
rank ``p``'s TP ranks, keyed (pp_rank, tp_rank). It talks to its parent over its
stdin and stdout with plain text lines (nothing is pickled; binary values are hex of
msgspec MessagePack):

- out ``RANK <hex>``: each rank's :class:`~pdfsm.events.RankInfo`, when ready;
- out ``SIDECHANNEL <port>``: with ``--sidechannel``, where it listens;
- out ``READY``: after the above;
- in ``HOLD <request_id> <block,block,...>``: every rank holds those blocks
  (``request_finished``), answered ``HELD <request_id>``;
- out ``RELEASED <request_id> <pp> <tp>``: rank (pp, tp) was read by every consumer rank
  (the notification arrived);
- out ``NOTE <sender> <request_id> <part> <of> <pp> <tp>``: each notification rank (pp, tp)
  received;
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
from pdfsm.events import CoreConfig, HandshakeReply, NotificationReceived, RankInfo
from pdfsm.log import EventLog, Record
from pdfsm.sidechannel import SideChannelServer
from transports.nixl import NixlTransport, import_nixl
from transports.sim import SimHandshaker, SimNetwork


def fill_pattern(tensor: torch.Tensor, seed: int) -> None:
    """Deterministic bytes, the same in every process: the consumer recomputes them to verify."""
    gen = torch.Generator().manual_seed(seed)
    flat = tensor.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))


def region_seed(seed: int, layer: int, pp_rank: int = 0, tp_rank: int = 0) -> int:
    """The seed of the region of ``layer`` on rank (pp_rank, tp_rank): bytes unique to each."""
    return seed + 10000 * pp_rank + 1000 * tp_rank + layer


def layers_of(pp_rank: int, pp_size: int, layers: int) -> range:
    """PP rank ``pp_rank``'s contiguous share of ``layers`` layers."""
    per = layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def expected_regions(seed: int, regions: int, num_blocks: int, block_bytes: int, *, pp_rank: int = 0,
                     tp_rank: int = 0, layers: Sequence[int] | None = None) -> list[torch.Tensor]:
    out = []
    for k in layers if layers is not None else range(regions):
        t = torch.empty(num_blocks, block_bytes, dtype=torch.uint8)
        fill_pattern(t, region_seed(seed, k, pp_rank, tp_rank))
        out.append(t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--agent", required=True, help="agent name (with --all-ranks, the prefix of each rank's)")
    ap.add_argument("--engine", default="P")
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--pp-size", type=int, default=1)
    ap.add_argument("--all-ranks", action="store_true", help="every (pp, tp) rank of the engine, in this process")
    ap.add_argument("--sidechannel", action="store_true", help="answer handshakes on a real side channel")
    ap.add_argument("--regions", type=int, default=2, help="layers of the model, one region each")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-bytes", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lease-s", type=float, default=120.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import_nixl()
    logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs INFO to stdout by default
    out = sys.stdout

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    class NoteSink:
        """Reports every notification the core applied, as it is flushed."""

        def __init__(self, pp: int, tp: int) -> None:
            self.where = f"{pp} {tp}"

        def write(self, records: Sequence[Record]) -> None:
            for rec in records:
                ev = rec.event
                if isinstance(ev, NotificationReceived):
                    say(f"NOTE {ev.sender} {ev.request_id} {ev.part} {ev.of} {self.where}")

        def close(self) -> None:
            pass

    if args.all_ranks:
        where = [(pp, tp) for pp in range(args.pp_size) for tp in range(args.tp_size)]
    else:
        where = [(0, args.tp_rank)]
    conns: dict[tuple[int, int], Connector] = {}
    infos: dict[tuple[int, int], RankInfo] = {}
    for pp, tp in where:
        layers = layers_of(pp, args.pp_size, args.regions)
        tensors = expected_regions(args.seed, args.regions, args.blocks, args.block_bytes, pp_rank=pp, tp_rank=tp,
                                   layers=layers)
        agent = f"{args.agent}-{pp}-{tp}" if args.all_ranks else args.agent
        transport = NixlTransport(agent, tensors, layers=layers, pp_rank=pp, tp_rank=tp)
        config = CoreConfig(engine_id=args.engine, tp_rank=tp, tp_size=args.tp_size, pp_rank=pp,
                            pp_size=args.pp_size, lease_ns=int(args.lease_s * 1e9))
        conns[(pp, tp)] = Connector(config, transport, SimHandshaker(SimNetwork()),
                                    log=EventLog(sink=NoteSink(pp, tp)))
        infos[(pp, tp)] = transport.rank_info()
        say("RANK " + msgspec.msgpack.encode(infos[(pp, tp)]).hex())

    def reply_for(pp_rank: int) -> HandshakeReply:
        ranks = tuple(info for (pp, _), info in sorted(infos.items()) if pp == pp_rank)
        if not ranks:
            raise LookupError(pp_rank)
        return HandshakeReply(engine_id=args.engine, compat_hash="", tp_size=args.tp_size, pp_size=args.pp_size,
                              num_blocks=args.blocks, ranks=ranks)

    server = SideChannelServer(reply_for).start() if args.sidechannel else None
    if server is not None:
        say(f"SIDECHANNEL {server.port}")
    say("READY")
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
            for conn in conns.values():
                conn.request_finished(rid, [int(b) for b in blocks.split(",") if b])
            say(f"HELD {rid}")
        for (pp, tp), conn in conns.items():
            sending, _ = conn.get_finished()
            for rid in sorted(sending):
                say(f"RELEASED {rid} {pp} {tp}")
    if server is not None:
        server.close()
    for conn in conns.values():
        conn.shutdown()
    return 0


def decode_rank(hex_line: str) -> RankInfo:
    return msgspec.msgpack.decode(bytes.fromhex(hex_line), type=RankInfo)


if __name__ == "__main__":
    sys.exit(main())
