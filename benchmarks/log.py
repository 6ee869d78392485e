"""Durable log throughput: FileSink appends and LogReader replay against plain msgpack.

Rows come from a real :class:`~pdfsm.core.Core` driven through request lifecycles
(consumer reads with handshakes, notify-only requests, producer holds and
releases, failures), so their sizes and event mix are what an engine logs.

- append: ``FileSink.write`` of every batch then ``close`` (which writes the rest
  and fsyncs), with fsync ``never`` and ``every 10 ms``. Baseline, same process,
  one thread: ``Encoder.encode`` of the rows as msgpack arrays, each with a 4-byte
  length prefix (the least framing that can be read back), one ``writev`` per
  batch, fdatasync every 10 ms where the policy asks, and at the end.
- replay: ``LogReader.batches()`` (CRC, chain and seq checks, decode into
  ``Record``). Baseline: read the baseline file back and ``Decoder(list[Record])``
  each array.

The baseline runs twice, with one array per handed-over batch and with one per
``BATCH_RECORDS`` rows (pdfsm's frame size); each ratio uses the faster of the two.

Rounds are interleaved (baseline, pdfsm, baseline, ...) and medians reported;
ratios are pdfsm time over baseline time (lower is better).

    PYTHONPATH=$PWD python benchmarks/log.py [--rows 300000] [--batch 1024] [--rounds 7] [--json]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog

from pdfsm.core import Core
from pdfsm.events import (
    AbortRequested,
    BlocksHeld,
    Collect,
    CoreConfig,
    Deadline,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeReply,
    Heartbeat,
    NotificationReceived,
    PeerAdded,
    RankInfo,
    ReadRequested,
    Tick,
)
from pdfsm.filelog import LogReader, crc32c, encode_frame
from pdfsm.filesink import BATCH_RECORDS, FileSink, FsyncPolicy
from pdfsm.log import EventLog, MemorySink, Record

_LEN = struct.Struct("<I")


def make_rows(n: int) -> list[Record]:
    """At least ``n`` rows from a core driven through mixed request lifecycles."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sink = MemorySink()
    log = EventLog(sink=sink, window=1024)
    core = Core(CoreConfig(engine_id="decode-0", tp_size=2, compat_hash="c0ffee"), log)
    t = 1_000
    engines = [f"prefill-{e}" for e in range(4)]
    for e, engine_id in enumerate(engines):
        rid = f"warm-{e}"
        core.submit(ReadRequested(source="scheduler", t_ns=t, request_id=rid, remote_request_id=f"p-{rid}",
                                  engine_id=engine_id, remote_tp=2, host="10.0.0.7", port=5600 + e,
                                  local_blocks=(1,), remote_blocks=(2,)))
        core.pump()
        reply = HandshakeReply(engine_id=engine_id, compat_hash="c0ffee", tp_size=2, num_blocks=4096,
                               ranks=tuple(RankInfo(pp_rank=0, tp_rank=r, agent=f"{engine_id}-agent-{r}",
                                                    metadata=b"\x00" * 64) for r in range(2)))
        core.submit(HandshakeDone(source="handshake", t_ns=t + 1, engine_id=engine_id, pp_rank=0, attempt=1,
                                  reply=reply))
        core.submit(PeerAdded(source="handshake", t_ns=t + 2, engine_id=engine_id, pp_rank=0, attempt=1))
        core.submit(HandleDone(source="xfer-0", t_ns=t + 3, request_id=rid, pp_rank=0, tp_rank=0))
        core.pump()
    i = 0
    while log.next_seq < n:
        i += 1
        t += 1_000_000
        rid = f"cmpl-{i:08d}-decode"
        engine_id = engines[i % len(engines)]
        kind = i % 10
        if kind < 6:  # a normal read, sometimes with a deadline
            blocks = tuple(range(i % 97, i % 97 + 1 + i % 13))
            deadline = Deadline("monotonic", t + 5_000_000_000) if i % 3 == 0 else None
            core.submit(ReadRequested(source="scheduler", t_ns=t, request_id=rid, remote_request_id=f"p-{rid}",
                                      engine_id=engine_id, remote_tp=2, host="10.0.0.7", port=5600 + i % len(engines),
                                      local_blocks=blocks,
                                      remote_blocks=tuple(b + 1000 for b in blocks), deadline=deadline))
            core.submit(HandleDone(source="xfer-1", t_ns=t + 10, request_id=rid, pp_rank=0, tp_rank=0))
        elif kind == 6:  # a failed read
            core.submit(ReadRequested(source="scheduler", t_ns=t, request_id=rid, remote_request_id=f"p-{rid}",
                                      engine_id=engine_id, remote_tp=2, local_blocks=(5, 6), remote_blocks=(7, 8)))
            core.submit(HandleFailed(source="xfer-1", t_ns=t + 10, request_id=rid, pp_rank=0, tp_rank=0,
                                     why=HandleFailure.ERR, detail="NIXL_ERR_REMOTE_DISCONNECT"))
        elif kind == 7:  # an abort while reading
            core.submit(ReadRequested(source="scheduler", t_ns=t, request_id=rid, remote_request_id=f"p-{rid}",
                                      engine_id=engine_id, remote_tp=2, local_blocks=(9,), remote_blocks=(10,)))
            core.submit(AbortRequested(source="scheduler", t_ns=t + 5, request_id=rid))
            core.submit(HandleDone(source="xfer-1", t_ns=t + 10, request_id=rid, pp_rank=0, tp_rank=0))
        else:  # producer side: hold, heartbeat, notification
            core.submit(BlocksHeld(source="scheduler", t_ns=t, request_id=rid, block_ids=(1, 2, 3, 4)))
            core.submit(Heartbeat(source="listener", t_ns=t + 1, request_id=rid, extend_ns=1_000_000_000,
                                  sender="decode-0:0"))
            core.submit(NotificationReceived(source="notify", t_ns=t + 2, request_id=rid, part=0, of=1,
                                             sender="decode-0:0"))
        core.submit(Collect(source="scheduler", t_ns=t + 20, step=i))
        if i % 50 == 0:
            core.submit(Tick(source="timer", t_ns=t + 30))
        core.pump()
    log.close()
    assert not any(r.fault for r in sink.records), "the workload must record no violation"
    return sink.records[:n]


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall-clock and process CPU seconds (all threads) of ``fn()``."""
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def base_append(path: Path, batches: list[list[Record]], interval_ns: int | None, chunk: int) -> None:
    encode = msgspec.msgpack.Encoder().encode
    pack = _LEN.pack
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    last = time.monotonic_ns()
    for batch in batches:
        iov: list[bytes] = []
        for i in range(0, len(batch), chunk):
            payload = encode(batch[i:i + chunk])
            iov += (pack(len(payload)), payload)
        os.writev(fd, iov)
        if interval_ns is not None and time.monotonic_ns() - last >= interval_ns:
            os.fdatasync(fd)
            last = time.monotonic_ns()
    os.fdatasync(fd)
    os.close(fd)


def base_replay(path: Path) -> int:
    decode = msgspec.msgpack.Decoder(list[Record]).decode
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            head = f.read(4)
            if not head:
                return n
            n += len(decode(f.read(_LEN.unpack(head)[0])))


def pdfsm_append(
    path: Path, batches: list[list[Record]], policy: FsyncPolicy
) -> tuple[FileSink, tuple[float, float], float]:
    """The sink, (wall, CPU) seconds until close returned, and the owner's time handing batches over."""
    sink = FileSink(path, fsync=policy)
    t0, c0 = time.perf_counter(), time.process_time()
    handoff = 0.0
    for batch in batches:
        t = time.perf_counter()
        sink.write(batch)
        handoff += time.perf_counter() - t
    sink.close()
    return sink, (time.perf_counter() - t0, time.process_time() - c0), handoff


def pdfsm_replay(path: Path) -> int:
    n = 0
    for batch in LogReader(path).batches():
        n += len(batch)
    return n


_REC_HEAD = struct.Struct("<IIQHqq")  # length, crc, seq, schema, wall, mono: a per-record frame


def per_record_frames(rows: list[Record]) -> bytes:
    """The rejected design: each record framed and CRC-chained on its own (for the comparison)."""
    encode, prev = msgspec.msgpack.Encoder().encode, 0
    out: list[bytes] = []
    wall, mono = time.time_ns(), time.monotonic_ns()
    for row in rows:
        payload = encode(row)
        head = _REC_HEAD.pack(len(payload), 0, row.seq, 1, wall, mono)
        prev = crc32c(payload, crc32c(head, prev))
        out += (prev.to_bytes(4, "little"), head, payload)
    return b"".join(out)


def batch_frames(rows: list[Record]) -> bytes:
    """What pdfsm's writer does per frame, minus the thread and the file: encode, frame, CRC."""
    encode, prev = msgspec.msgpack.Encoder().encode, 0
    out: list[bytes] = []
    for i in range(0, len(rows), BATCH_RECORDS):
        chunk = rows[i:i + BATCH_RECORDS]
        payload = encode(chunk)
        head, prev = encode_frame(payload, len(chunk), chunk[0].seq, prev, wall_ns=time.time_ns(),
                                  mono_ns=time.monotonic_ns())
        out += (head, payload)
    return b"".join(out)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size


def _add(times: dict[str, list[float]], key: str, wall_cpu: tuple[float, float]) -> None:
    times[key].append(wall_cpu[0])
    times[key + "_cpu"].append(wall_cpu[1])


def run(rows: int, batch: int, rounds: int, workdir: Path) -> dict[str, Any]:
    data = make_rows(rows)
    batches = [data[i:i + batch] for i in range(0, len(data), batch)]
    n = len(data)
    chunks = sorted({batch, BATCH_RECORDS})
    times: dict[str, list[float]] = defaultdict(list)
    sizes: dict[str, int] = {}
    sample = data[:50_000]
    for r in range(-1, rounds):  # round -1 warms up (page cache, allocator) and is not counted
        for policy, interval in (("never", None), ("10ms", 10_000_000)):
            for chunk in chunks:
                bpath = workdir / f"base-{policy}-{chunk}.bin"
                _add(times, f"base_append_{policy}_{chunk}",
                     _timed(lambda: base_append(bpath, batches, interval, chunk)))  # noqa: B023
                if policy == "10ms":
                    got = base_replay(bpath)  # once untimed: the same page-cache state as pdfsm's file
                    _add(times, f"base_replay_{chunk}", _timed(lambda: base_replay(bpath)))  # noqa: B023
                    assert got == n
                sizes["base_bytes"] = _size(bpath)
                bpath.unlink()
            ppath = workdir / f"pdfsm-{policy}"
            fsync = FsyncPolicy.never() if interval is None else FsyncPolicy.every(10)
            gc.collect()
            sink, elapsed, handoff = pdfsm_append(ppath, batches, fsync)
            _add(times, f"pdfsm_append_{policy}", elapsed)
            times["handoff"].append(handoff)
            sizes["pdfsm_bytes"], sizes["pdfsm_frames"] = _size(ppath), sink.frames
            if policy == "10ms":
                assert pdfsm_replay(ppath) == n
                _add(times, "pdfsm_replay", _timed(lambda: pdfsm_replay(ppath)))  # noqa: B023
            shutil.rmtree(ppath)
        times["per_record_frames"].append(_timed(lambda: per_record_frames(sample))[0] / len(sample) * n)
        times["batch_frames"].append(_timed(lambda: batch_frames(sample))[0] / len(sample) * n)
        if r < 0:
            times.clear()
    med = {k: statistics.median(v) for k, v in times.items()}

    def best(prefix: str) -> tuple[float, int]:
        """The faster baseline: records per msgpack blob as handed over, or as pdfsm frames them."""
        return min((med[f"{prefix}_{c}"], c) for c in chunks)

    base_never, base_10ms, base_replay_t = best("base_append_never"), best("base_append_10ms"), best("base_replay")
    return {
        "rows": n,
        "batch": batch,
        "frame_records": BATCH_RECORDS,
        "rounds": rounds,
        "append_events_per_s": round(n / med["pdfsm_append_10ms"]),
        "append_never_events_per_s": round(n / med["pdfsm_append_never"]),
        "replay_events_per_s": round(n / med["pdfsm_replay"]),
        "baseline_append_events_per_s": round(n / base_10ms[0]),
        "baseline_append_never_events_per_s": round(n / base_never[0]),
        "baseline_replay_events_per_s": round(n / base_replay_t[0]),
        "append_vs_baseline": round(med["pdfsm_append_10ms"] / base_10ms[0], 3),
        "append_never_vs_baseline": round(med["pdfsm_append_never"] / base_never[0], 3),
        "replay_vs_baseline": round(med["pdfsm_replay"] / base_replay_t[0], 3),
        # the same ratios in process CPU time (all threads): less sensitive to other load on the machine
        "append_vs_baseline_cpu": round(med["pdfsm_append_10ms_cpu"] / med[f"base_append_10ms_{base_10ms[1]}_cpu"], 3),
        "append_never_vs_baseline_cpu": round(
            med["pdfsm_append_never_cpu"] / med[f"base_append_never_{base_never[1]}_cpu"], 3),
        "replay_vs_baseline_cpu": round(med["pdfsm_replay_cpu"] / med[f"base_replay_{base_replay_t[1]}_cpu"], 3),
        "baseline_records_per_blob": {"append_10ms": base_10ms[1], "append_never": base_never[1],
                                      "replay": base_replay_t[1]},
        "baseline_events_per_s_by_blob": {k: round(n / v) for k, v in sorted(med.items())
                                          if k.startswith("base_") and not k.endswith("_cpu")},
        "per_record_framing_ns_per_event": round(med["per_record_frames"] / n * 1e9, 1),
        "frame_framing_ns_per_event": round(med["batch_frames"] / n * 1e9, 1),
        "owner_handoff_ns_per_event": round(med["handoff"] / n * 1e9, 1),
        "bytes_per_event": round(sizes["pdfsm_bytes"] / n, 1),
        "baseline_bytes_per_event": round(sizes["base_bytes"] / n, 1),
        "frames": sizes["pdfsm_frames"],
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=300_000)
    ap.add_argument("--batch", type=int, default=1024, help="rows per sink.write (one core pump)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pdfsm-bench-", dir=args.dir))
    try:
        res = run(args.rows, args.batch, args.rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(msgspec.json.encode(res).decode())
        return
    print(f"{res['rows']} rows ({res['bytes_per_event']} B/event on disk, baseline {res['baseline_bytes_per_event']}),"
          f" {res['batch']} rows per write, {res['frame_records']} per frame,"
          f" median of {res['rounds']} interleaved rounds, {res['cpus']} CPUs")
    print("baseline: the faster of plain msgpack blobs of the handed-over batch or of pdfsm's frame size")
    print(f"{'':28}{'pdfsm ev/s':>14}{'baseline ev/s':>16}{'time ratio':>12}{'CPU ratio':>11}")
    for label, key, base, ratio in (
        ("append, fsync never", "append_never_events_per_s", "baseline_append_never_events_per_s",
         "append_never_vs_baseline"),
        ("append, fsync every 10 ms", "append_events_per_s", "baseline_append_events_per_s", "append_vs_baseline"),
        ("replay (read + decode)", "replay_events_per_s", "baseline_replay_events_per_s", "replay_vs_baseline"),
    ):
        print(f"{label:28}{res[key]:>14,}{res[base]:>16,}{res[ratio]:>12.2f}{res[ratio + '_cpu']:>11.2f}")
    print(f"owner thread: {res['owner_handoff_ns_per_event']} ns per event to hand a batch to the writer thread")
    print(f"encode + frame + CRC in memory: {res['frame_framing_ns_per_event']} ns per event in {BATCH_RECORDS}-record"
          f" frames, {res['per_record_framing_ns_per_event']} ns with a frame and chained CRC per record")


if __name__ == "__main__":
    main()
