"""Transport bandwidth: pdfsm over NIXL against raw NIXL on the same descriptors, and torch copy_.

Two OS processes, like a real prefill/decode pair on one host: this script starts
itself with ``--serve`` as the producer (prefill) rank, which owns, per block size,
a NIXL agent over ``--regions`` KV tensors of random bytes (``--total-mib`` in all)
and keeps making progress; the consumer (decode) rank, here, reads them. Metadata
crosses the pipe as hex of msgspec MessagePack (nothing pickled).

Cases: every block size (4 KiB, 16 KiB, 64 KiB, 1 MiB by default; the bytes of one
block of one region) and block table (``contiguous``: block ``i`` into block ``i``;
``shuffled``: both tables random permutations). Each read moves every block of every
region (64 MiB). Methods:

- ``pdfsm``: a Connector-driven read, from ``Connector.load`` to the step whose
  ``get_finished`` reports it (handshake, connection and prepared lists set up by a
  warm-up read); the transport's default ``xfer_mode="prepped"``.
- ``pdfsm_descs``: the same with ``xfer_mode="descs"`` (coalesced in Python, then
  ``get_xfer_descs`` + ``initialize_xfer`` per read).
- ``raw``: NIXL driven by hand on the same agent with the same prepared descriptors
  and indices (computed before timing): ``make_prepped_xfer``, ``transfer``,
  ``check_xfer_state`` until done, release.
- ``raw_descs``: by hand, ``get_xfer_descs`` + ``initialize_xfer`` on the same
  coalesced descriptors pdfsm builds.
- ``copy`` / ``copy_1t``: ``Tensor.copy_`` of the same bytes within this process
  (from touched, random memory) with torch's default threads / one thread: the
  memory-bandwidth limit.

The machine is shared and noisy, so the script runs ``--reps`` *rounds*, each of
every case and every method once, so every case sees the same phases of the noise.
Within a round the methods run as two back-to-back pairs, (pdfsm, raw) then
(pdfsm_descs, raw_descs), then the two copies; which method of a pair goes first
alternates from round to round. Before the pairs, one untimed READ of the same table
(``raw_descs``: neither timed method's own handles or index arrays). A READ right after
a 64 MiB ``copy_`` (the previous case's) ran 3 to 10% slower than the same READ after
another READ, which made the per-round ratios two clusters (whichever method ran first
lost) and their median a noisy pick between them; after the untimed READ both methods
of a pair run after a READ, and the ratio does not depend on which went first (measured
both ways). Bandwidth is the best of the rounds (median alongside). pdfsm against raw
NIXL is, per case, the median of the ratios of the back-to-back pdfsm and raw runs of
each round; the ratio of two best-of figures is printed too but is a lottery here.
Bytes are verified once per case before timing.

``--json`` prints one JSON object: ``pdfsm_vs_raw_nixl`` (worst case),
``pdfsm_vs_raw_nixl_best_of``, ``pdfsm_descs_vs_raw_descs``,
``coalesced_contiguous_vs_copy`` (worst contiguous case: best-of pdfsm over the
best copy_ of the run, ``copy_gib_s``), ``prepped_vs_descs_median``, per-case
figures (``cases``) and the cost of setting a read up in each mode (``setup_cost``).

``--num-threads N`` gives the reading agent UCX's thread pool (split at N descriptors), which
the transport leaves off by default (docs/decisions.md); with 4 threads a contiguous table
moves at about 0.6x ``copy_`` here, against 0.43x without.

``--kv-device cuda`` puts both processes' tensors on the GPU (NIXL VRAM; ``copy_`` is then
device to device, synchronised before the clock stops).

    PYTHONPATH=$PWD python benchmarks/transport.py [--json] [--kv-device cuda]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from pdfsm.connector import Connector, KVTransferParams
from pdfsm.events import CoreConfig, Event, HandshakeReply, RankInfo
from pdfsm.wire import Notification, notify_codec
from transports.coalesce import block_indices, read_descs
from transports.nixl import NixlTransport, _all_blocks, import_nixl
from transports.sim import SimHandshaker, SimNetwork

ROOT = Path(__file__).resolve().parent.parent
GIB = float(1 << 30)
METHODS = ("pdfsm", "raw", "pdfsm_descs", "raw_descs", "copy", "copy_1t")
PAIRS = (("pdfsm", "raw"), ("pdfsm_descs", "raw_descs"))  # compared with each other, run back to back


def round_order(rep: int) -> list[str]:
    """The methods of round ``rep``: each pair back to back, its first alternating, then the copies."""
    pairs = [m for pair in PAIRS for m in (pair if rep % 2 == 0 else pair[::-1])]
    return [*pairs, *(m for m in METHODS if m not in pairs)]
TABLES = ("contiguous", "shuffled")
_agents = itertools.count()  # consumer agent names unique in this process


def quiet() -> None:
    """NIXL configures its "nixl" logger, INFO to stdout, when first imported: import it, then
    lower it (stdout carries this script's table or JSON)."""
    import_nixl()
    logging.getLogger("nixl").setLevel(logging.WARNING)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def kv(regions: int, blocks: int, block_bytes: int, seed: int, device: str) -> list[torch.Tensor]:
    out = []
    for k in range(regions):
        gen = torch.Generator().manual_seed(seed * 1000 + k)
        out.append(torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8, generator=gen).to(device))
    return out


def sync(device: str) -> None:
    """Wait for the GPU's queued work (a CUDA copy_ returns before it is done)."""
    if device != "cpu":
        torch.cuda.synchronize(device)


# --- the producer process ------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    quiet()
    transports = []
    for bs in args.sizes:
        blocks = args.total // (bs * args.regions)
        t = NixlTransport(f"bench-P-{bs}-{os.getpid()}", kv(args.regions, blocks, bs, seed=bs, device=args.kv_device),
                          backend_params=args.params)
        notes = [0]

        def count(ev: Event, notes: list[int] = notes) -> None:
            notes[0] += 1

        t.bind(count, time.monotonic_ns)
        transports.append(t)
        sys.stdout.write(f"RANK {bs} {msgspec.msgpack.encode(t.rank_info()).hex()}\n")
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not stop.wait(0.002):
        for t in transports:
            t.progress()
    for t in transports:
        t.close()
    return 0


# --- the consumer side ---------------------------------------------------------------------------


class Case:
    """One block size: the consumer transport and Connector, and both block tables."""

    def __init__(self, bs: int, info: RankInfo, args: argparse.Namespace) -> None:
        self.bs = bs
        self.regions = args.regions
        self.blocks = args.total // (bs * args.regions)
        self.nbytes = self.blocks * bs * args.regions
        self.device = args.kv_device
        self.expected = kv(args.regions, self.blocks, bs, seed=bs, device=self.device)  # what the producer holds
        self.dst = [torch.zeros(self.blocks, bs, dtype=torch.uint8, device=self.device) for _ in range(args.regions)]
        self.transport = NixlTransport(f"bench-D-{bs}-{os.getpid()}-{next(_agents)}", self.dst,
                                       num_threads=args.num_threads, backend_params=args.params,
                                       progress_thread=not args.no_progress_thread)
        self.engine = f"P{bs}"
        net = SimNetwork()
        reply = HandshakeReply(engine_id=self.engine, compat_hash="", tp_size=1, ranks=(info,))
        net.serve(self.engine, 1, lambda pp: reply)
        self.conn = Connector(CoreConfig(engine_id=f"D{bs}", read_timeout_ns=600_000_000_000), self.transport,
                              SimHandshaker(net))
        self.peer = info.agent
        rng = np.random.default_rng(bs)
        self.tables = {
            "contiguous": (tuple(range(self.blocks)), tuple(range(self.blocks))),
            "shuffled": (tuple(rng.permutation(self.blocks).tolist()), tuple(rng.permutation(self.blocks).tolist())),
        }
        self.n = 0
        self.recving: set[str] = set()

    def pdfsm(self, table: str, mode: str) -> float:
        local, remote = self.tables[table]
        self.transport.xfer_mode = mode  # type: ignore[assignment]
        self.n += 1
        rid = f"r{self.n}"
        params = KVTransferParams(remote_tp_size=1, lease_ns=60_000_000_000,
                                  remote_engine_id=self.engine, remote_request_id=f"bench-{self.n}",  # single-use
                                  remote_host=self.engine, remote_port=1, remote_block_ids=remote)
        conn = self.conn
        t0 = time.perf_counter()
        conn.load(rid, local, params)
        while True:
            _, recving = conn.get_finished()
            if rid in recving:
                break
        elapsed = time.perf_counter() - t0
        if conn.last.failed:
            raise RuntimeError(f"pdfsm read failed: {conn.last.failed}")
        return elapsed

    def verify(self, table: str) -> None:
        local, remote = self.tables[table]
        sync(self.device)  # NIXL writes VRAM behind the stream's back
        li, ri = torch.tensor(local, device=self.device), torch.tensor(remote, device=self.device)
        for k in range(self.regions):
            if not torch.equal(self.dst[k][li], self.expected[k][ri]):
                raise RuntimeError(f"{self.bs}-byte blocks, {table}: bytes differ in region {k}")
        for t in self.dst:
            t.zero_()


class Raw:
    """NIXL by hand on the consumer's agent, on the descriptors pdfsm uses."""

    def __init__(self, case: Case) -> None:
        self.case = case
        t = case.transport
        self.agent = t.agent
        peer = t.peers[(case.engine, 0)][0]
        self.kind = t.kind
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _all_blocks(t.regions, 1, 0), t.kind)
        self.remote = self.agent.prep_xfer_dlist(peer.agent, _all_blocks(peer.regions, 1, 0), peer.kind)
        self.note = notify_codec.encode(Notification("bench", 0, 1))  # what pdfsm sends
        self.idx = {}
        self.descs = {}
        for table, (local, remote) in case.tables.items():
            self.idx[table] = (block_indices(local, case.blocks, case.regions),
                               block_indices(remote, case.blocks, case.regions))
            self.descs[table] = read_descs(local, remote, t.regions, peer.regions)

    def _wait(self, handle: Any) -> None:
        agent = self.agent
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL transfer ended {state}")
        handle.release()

    def prepped(self, table: str) -> float:
        li, ri = self.idx[table]
        t0 = time.perf_counter()
        self._wait(self.agent.make_prepped_xfer("READ", self.local, li, self.remote, ri, self.note))
        return time.perf_counter() - t0

    def descs_(self, table: str) -> float:
        dl, dr = self.descs[table]
        agent = self.agent
        t0 = time.perf_counter()
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(dl, self.kind),
                                       agent.get_xfer_descs(dr, self.kind), self.case.peer, self.note)
        self._wait(handle)
        return time.perf_counter() - t0


def copy_time(case: Case, threads: int = 0) -> float:
    """``copy_`` of every region; ``threads`` 0 keeps torch's default (every core)."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        for dst, src in zip(case.dst, case.expected, strict=True):
            dst.copy_(src)
        sync(case.device)
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(saved)


def setup_costs(case: Case, raw: Raw, reps: int = 25) -> dict[str, Any]:
    """Microseconds to set a read up without moving it (median), the way the transport does:
    ``prepped`` builds block indices and calls ``make_prepped_xfer``; ``descs`` coalesces, then
    ``get_xfer_descs`` twice and ``initialize_xfer``. Each handle is released unposted."""
    agent, peer = raw.agent, case.transport.peers[(case.engine, 0)][0]
    out: dict[str, Any] = {"regions": case.regions, "block_bytes": case.bs}
    for table in TABLES:
        for n in sorted({16, 256, case.blocks}):
            local, remote = case.tables[table][0][:n], case.tables[table][1][:n]
            costs: dict[str, list[float]] = {"prepped": [], "descs": []}
            ndescs = 0
            for _ in range(reps):
                t0 = time.perf_counter()
                li = block_indices(local, case.blocks, case.regions)
                ri = block_indices(remote, case.blocks, case.regions)
                agent.make_prepped_xfer("READ", raw.local, li, raw.remote, ri, raw.note).release()
                t1 = time.perf_counter()
                dl, dr = read_descs(local, remote, case.transport.regions, peer.regions)
                agent.initialize_xfer("READ", agent.get_xfer_descs(dl, raw.kind), agent.get_xfer_descs(dr, raw.kind),
                                      case.peer, raw.note).release()
                t2 = time.perf_counter()
                costs["prepped"].append(t1 - t0)
                costs["descs"].append(t2 - t1)
                ndescs = len(dl)
            out[f"{table}/{n}"] = {"prepped_us": round(statistics.median(costs["prepped"]) * 1e6, 1),
                                   "descs_us": round(statistics.median(costs["descs"]) * 1e6, 1),
                                   "coalesced_descriptors": ndescs, "per_block_descriptors": n * case.regions}
    return out


def timed(method: str, case: Case, raw: Raw, table: str) -> float:
    if method == "pdfsm":
        return case.pdfsm(table, "prepped")
    if method == "pdfsm_descs":
        return case.pdfsm(table, "descs")
    if method == "raw":
        return raw.prepped(table)
    if method == "raw_descs":
        return raw.descs_(table)
    return copy_time(case, threads=1 if method == "copy_1t" else 0)


def summarize(case: Case, table: str, times: dict[str, list[float]]) -> dict[str, Any]:
    best = {m: case.nbytes / min(v) / GIB for m, v in times.items()}
    median = {m: case.nbytes / statistics.median(v) / GIB for m, v in times.items()}
    pairs = [r / p for p, r in zip(times["pdfsm"], times["raw"], strict=True)]  # run back to back
    return {"block_bytes": case.bs, "table": table, "blocks_per_region": case.blocks, "bytes": case.nbytes,
            "best_gib_s": best, "median_gib_s": median,
            "pdfsm_vs_raw": best["pdfsm"] / best["raw"],
            "pdfsm_vs_raw_median_of_pairs": statistics.median(pairs),
            "pdfsm_vs_raw_pairs_quartiles": [round(q, 3) for q in statistics.quantiles(pairs, n=4)],
            "pdfsm_descs_vs_raw_descs": best["pdfsm_descs"] / best["raw_descs"],
            "pdfsm_vs_copy": best["pdfsm"] / best["copy"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    quiet()
    t_start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, __file__, "--serve", "--total-mib", str(args.total_mib), "--regions", str(args.regions),
           "--sizes", ",".join(map(str, args.sizes)), "--kv-device", args.kv_device,
           *(f"--backend-param={k}={v}" for k, v in args.params.items())]
    server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert server.stdout is not None and server.stdin is not None
    infos: dict[int, RankInfo] = {}
    for line in server.stdout:
        if line.startswith("RANK "):
            _, bs, blob = line.split()
            infos[int(bs)] = msgspec.msgpack.decode(bytes.fromhex(blob), type=RankInfo)
        elif line.startswith("READY"):
            break
    else:
        raise RuntimeError("the producer process did not start")
    results: list[dict[str, Any]] = []
    try:
        cases: list[tuple[Case, Raw]] = []
        for bs in args.sizes:
            case = Case(bs, infos[bs], args)
            case.pdfsm("contiguous", "prepped")  # warm-up: handshake, connection, prepared lists
            case.pdfsm("contiguous", "descs")
            raw = Raw(case)
            raw.prepped("contiguous")
            for table in TABLES:  # correctness first: the bytes of one read of each table
                case.pdfsm(table, "prepped")
                case.verify(table)
            cases.append((case, raw))
        # Rounds: every case and method once per round, so that every case sees the same
        # phases of a noisy machine; within a pair, which runs first alternates (round_order).
        times: dict[tuple[int, str], dict[str, list[float]]] = {
            (c.bs, t): {m: [] for m in METHODS} for c, _ in cases for t in TABLES}
        for rep in range(args.reps):
            for case, raw in cases:
                for table in TABLES:
                    raw.descs_(table)  # untimed: every timed READ runs after a READ, not a copy_ (neither's)
                    for m in round_order(rep):
                        times[(case.bs, table)][m].append(timed(m, case, raw, table))
        setup = setup_costs(*cases[0])
        for case, _ in cases:
            for table in TABLES:
                results.append(summarize(case, table, times[(case.bs, table)]))
                if not args.json:
                    print(row(results[-1]), flush=True)
            case.conn.shutdown()
    finally:
        server.stdin.close()
        server.wait(30)
    contiguous = [r for r in results if r["table"] == "contiguous"]
    # copy_ is the same operation in every case (the same bytes in the same region shapes), so
    # the memory limit is its best over the whole run: one number, not a per-case lottery.
    copy_limit = max(r["best_gib_s"]["copy"] for r in results)
    return {
        # pdfsm against raw NIXL: per case, the median of the ratios of back-to-back runs (both
        # see the same moment of a noisy machine), then the worst case. The ratio of the two
        # best-of figures, alongside, is a lottery on this machine (one lucky run decides it).
        "pdfsm_vs_raw_nixl": min(r["pdfsm_vs_raw_median_of_pairs"] for r in results),
        "pdfsm_vs_raw_nixl_best_of": min(r["pdfsm_vs_raw"] for r in results),
        "pdfsm_descs_vs_raw_descs": min(r["pdfsm_descs_vs_raw_descs"] for r in results),
        "coalesced_contiguous_vs_copy": min(r["best_gib_s"]["pdfsm"] for r in contiguous) / copy_limit,
        "copy_gib_s": copy_limit,
        "copy_1t_gib_s": max(r["best_gib_s"]["copy_1t"] for r in results),
        "prepped_vs_descs_median": statistics.median(
            r["best_gib_s"]["pdfsm"] / r["best_gib_s"]["pdfsm_descs"] for r in results),
        "setup": {"processes": 2, "regions": args.regions, "bytes_per_read": args.total, "reps": args.reps,
                  "torch_threads": torch.get_num_threads(), "kv_device": args.kv_device,
                  "statistic": "GiB/s: best of rounds (medians alongside); pdfsm/raw: median of back-to-back pairs",
                  "ucx_tls": os.environ.get("UCX_TLS", "default"),
                  "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
                  "num_threads": args.num_threads, "backend_params": args.params,
                  "seconds": round(time.perf_counter() - t_start, 1)},
        "cases": results,
        "setup_cost": setup,
    }


def row(r: dict[str, Any]) -> str:
    b, m = r["best_gib_s"], r["median_gib_s"]
    size = f"{r['block_bytes'] >> 10} KiB" if r["block_bytes"] < 1 << 20 else f"{r['block_bytes'] >> 20} MiB"
    cells = " ".join(f"{b[k]:5.2f} ({m[k]:5.2f})" for k in METHODS)
    return (f"{size:>6} {r['table']:>10} {cells}  {r['pdfsm_vs_raw']:5.3f} {r['pdfsm_vs_raw_median_of_pairs']:5.3f}"
            f"  {r['pdfsm_descs_vs_raw_descs']:5.3f}  {r['pdfsm_vs_copy']:4.2f}")


def header() -> str:
    cols = " ".join(f"{k:>13}" for k in METHODS)
    return (f"{'block':>6} {'table':>10} {cols}  pdfsm/raw best pairs  descs/raw  pdfsm/copy\n"
            f"{'':>18}GiB/s: best of reps (median)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--total-mib", type=int, default=64, help="bytes per read, MiB (default 64)")
    ap.add_argument("--regions", type=int, default=16,
                    help="KV regions per rank, a layer's K or V each (default 16; real models have 32-160)")
    ap.add_argument("--reps", type=int, default=21, help="rounds over every case and method (default 21)")
    ap.add_argument("--sizes", default="4096,16384,65536,1048576", help="block sizes in bytes")
    ap.add_argument("--num-threads", type=int, default=0,
                    help="UCX backend threads of the reading agent (default 0, the transport's: no pool)")
    ap.add_argument("--backend-param", action="append", default=[], metavar="KEY=VALUE",
                    help="a UCX backend parameter for both processes' agents (e.g. split_batch_size=1)")
    ap.add_argument("--no-progress-thread", action="store_true",
                    help="the reading agent without NIXL's progress thread (the owner's polls progress it)")
    ap.add_argument("--kv-device", default="cpu",
                    help="where both processes' KV tensors live: cpu (NIXL DRAM, default) or cuda[:N] (VRAM; "
                         "copy_ is then device to device)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.total = args.total_mib << 20
    args.params = dict(p.split("=", 1) for p in args.backend_param)
    if args.serve:
        return serve(args)
    if not args.json:
        print(f"pdfsm over NIXL vs raw NIXL vs copy_: 2 processes, {args.kv_device}, {args.regions} regions, "
              f"{args.total_mib} MiB per read, {args.reps} reps", flush=True)
        print(header(), flush=True)
    out = run(args)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"\nworst pdfsm/raw NIXL (median of pairs): {out['pdfsm_vs_raw_nixl']:.3f} (goal >= 0.95), "
              f"best-of ratio {out['pdfsm_vs_raw_nixl_best_of']:.3f}; "
              f"worst descs/raw descs: {out['pdfsm_descs_vs_raw_descs']:.3f}; "
              f"worst contiguous pdfsm/copy_: {out['coalesced_contiguous_vs_copy']:.2f} (goal >= 0.5); "
              f"{out['setup']['seconds']} s")
        cost = out["setup_cost"]
        print(f"\nsetting a read up, {cost['block_bytes']}-byte blocks, {cost['regions']} regions (median us):")
        for key, v in cost.items():
            if isinstance(v, dict):
                print(f"  {key:>16} blocks: prepped {v['prepped_us']:8.1f}  descs {v['descs_us']:8.1f}"
                      f"  ({v['coalesced_descriptors']} coalesced of {v['per_block_descriptors']} descriptors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
