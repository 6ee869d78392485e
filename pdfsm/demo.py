"""The demo: a prefill engine and a decode engine move KV blocks, then their logs are replayed.

Each engine has one :class:`~pdfsm.connector.Connector` per TP rank (a worker).
The prefill side fills its blocks with deterministic content, finishes each
request under a lease and hands the ``kv_transfer_params`` to the decode side,
which reads them, verifies every byte it read, and reports each request to its
scheduler loop exactly once. At the end both engines' logs are replayed (any
divergence is an error) and summarized.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from pdfsm.connector import Connector, KVTransferParams
from pdfsm.events import CoreConfig, HandshakeReply
from pdfsm.replay import render, replay, summarize
from pdfsm.topology import Layout, read_plan
from transports.sim import SimHandshaker, SimNetwork, SimTransport, pattern

__all__ = ["add_arguments", "run"]

HOST, PORT = "127.0.0.1", 7100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--mla", action="store_true", help="replicated latent KV: read one producer rank")
    parser.add_argument("--blocks", type=int, default=64, help="KV blocks per worker")
    parser.add_argument("--block-bytes", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", help="write each engine's event log here")
    parser.add_argument("--quiet", action="store_true", help="summaries only, no timelines")


@dataclass
class _Engine:
    name: str
    tp: int
    workers: list[Connector] = field(default_factory=list)
    transports: list[SimTransport] = field(default_factory=list)


def _engine(net: SimNetwork, name: str, tp: int, args: argparse.Namespace, clock: list[int], port: int) -> _Engine:
    eng = _Engine(name, tp)
    for rank in range(tp):
        t = SimTransport(net, f"{name}-tp{rank}", tp_rank=rank, num_blocks=args.blocks,
                         block_bytes=args.block_bytes // (tp if not args.mla else 1))
        cfg = CoreConfig(engine_id=name, tp_rank=rank, tp_size=tp, mla=args.mla, compat_hash="demo-model-v1")
        eng.transports.append(t)
        eng.workers.append(Connector(cfg, t, SimHandshaker(net), clock=lambda: clock[0], host=HOST, port=port))
    return eng


def _expected(d_rank: int, args: argparse.Namespace, prefill: _Engine, decode: _Engine,
              local: int, remote: int) -> bytes:
    """What decode rank ``d_rank``'s block ``local`` must hold after reading remote block ``remote``."""
    plan = read_plan(Layout(decode.tp, 1, d_rank), Layout(prefill.tp), args.mla)
    size = decode.transports[d_rank].block_bytes
    out = bytearray(size)
    for src in plan.sources:
        p = prefill.transports[src.tp_rank]
        chunk = p.block_bytes // src.remote_slices
        data = pattern(p.agent, remote, p.block_bytes)[src.remote_slice * chunk:(src.remote_slice + 1) * chunk]
        at = src.local_slice * (size // src.local_slices)
        out[at:at + len(data)] = data
    return bytes(out)


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    net, clock = SimNetwork(), [0]
    prefill = _engine(net, "prefill", args.prefill_tp, args, clock, PORT)
    decode = _engine(net, "decode", args.decode_tp, args, clock, 0)
    for t in prefill.transports:
        t.fill(range(args.blocks))
    infos = tuple(t.rank_info() for t in prefill.transports)
    net.serve(HOST, PORT, lambda pp: HandshakeReply(
        engine_id="prefill", compat_hash="demo-model-v1", tp_size=args.prefill_tp, num_blocks=args.blocks,
        mla=args.mla, ranks=infos))

    free_p, free_d = list(range(args.blocks)), list(range(args.blocks))
    reading: dict[str, tuple[KVTransferParams, list[int], set[int]]] = {}  # ranks yet to report
    sending: dict[str, tuple[list[int], set[int]]] = {}
    started = done = bad_bytes = step = 0
    while done < args.requests or sending:
        step += 1
        clock[0] += 1_000_000
        n = rng.randint(1, 4)
        if len(reading) < 4 and started < args.requests and min(len(free_p), len(free_d)) >= n:
            started += 1
            rid = f"req-{started}"
            p_blocks = [free_p.pop(rng.randrange(len(free_p))) for _ in range(n)]
            params = KVTransferParams(remote_engine_id="", remote_request_id="")
            for w in prefill.workers:  # every producer rank holds its part of the blocks
                params = w.request_finished(rid, p_blocks)
            sending[rid] = (p_blocks, set(range(prefill.tp)))
            d_blocks = [free_d.pop(rng.randrange(len(free_d))) for _ in range(n)]
            for w in decode.workers:
                w.load(f"d-{rid}", d_blocks, params)
            reading[f"d-{rid}"] = (params, d_blocks, set(range(decode.tp)))
        for rank, w in enumerate(decode.workers):
            _, recving = w.get_finished()
            for rid in recving:
                params, d_blocks, ranks = reading[rid]
                ranks.discard(rank)
                remote = params.remote_block_ids
                bad_bytes += sum(decode.transports[rank].block(lb) != _expected(rank, args, prefill, decode, lb, rb)
                                 for lb, rb in zip(d_blocks, remote, strict=True))
                if not ranks:
                    del reading[rid]
                    free_d.extend(d_blocks)
                    done += 1
        for rank, w in enumerate(prefill.workers):
            finished, _ = w.get_finished()
            for rid in finished:
                p_blocks, ranks = sending[rid]
                ranks.discard(rank)
                if not ranks:
                    del sending[rid]
                    free_p.extend(p_blocks)
        if step > 10_000:
            print("demo: no progress after 10000 steps")
            return 1
    print(f"demo: {done} requests moved from prefill (TP {prefill.tp}) to decode (TP {decode.tp})"
          f"{' with MLA' if args.mla else ''} over the simulated transport in {step} steps; "
          f"blocks with wrong bytes: {bad_bytes}")
    failures = 0
    for eng in (prefill, decode):
        for rank, w in enumerate(eng.workers):
            w.shutdown()
            records = w.core.log.records()
            replay(records)
            summary = summarize(records)
            failures += len(summary.stuck) + len(summary.violations)
            for line in render(summary, title=f"{eng.name} tp{rank} (replayed: no divergence)",
                               timelines=0 if args.quiet else 2):
                print(line)
    return 0 if bad_bytes == 0 and failures == 0 else 1
