"""Write the golden log file of the current format and schema version (run once per release).

    PYTHONPATH=$PWD python tests/make_golden.py

Writes ``tests/golden/v<SCHEMA_VERSION>.pdlog`` (one segment, fixed salt and
times, four records per frame) and ``v<SCHEMA_VERSION>.json`` (the records it
must read back as, in msgspec JSON). It refuses to overwrite: a released golden
file never changes; a new schema version gets a new pair of files.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from pdfsm.core import Core
from pdfsm.events import (
    AbortRequested,
    BadMessage,
    BlocksHeld,
    Collect,
    CoreConfig,
    Deadline,
    EvictRequested,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeDone,
    HandshakeFailed,
    HandshakeReply,
    Heartbeat,
    NotificationReceived,
    PeerAdded,
    PeerDisconnected,
    RankInfo,
    ReadRequested,
    SendFailed,
    Tick,
)
from pdfsm.filelog import SCHEMA_VERSION, write_segment
from pdfsm.log import EventLog, Overflow, Record
from pdfsm.replay import QuietLogger

GOLDEN = Path(__file__).parent / "golden"
SALT = b"golden01"
WALL_NS = 1_700_000_000_000_000_000
MONO_NS = 123_456_789
META = {"engine_id": "golden-D", "created_ns": WALL_NS, "note": f"pdfsm log format 1, schema {SCHEMA_VERSION}"}


def golden_rows() -> list[Record]:
    """Records covering most event types, outcomes, faults, causes, bytes, enums and nested structs."""
    log = EventLog(inbox_limit=2, overflow=Overflow.COUNT)
    core = Core(CoreConfig(engine_id="golden-D", tp_size=2, compat_hash="h1", lease_ns=1_000), log,
                logger=QuietLogger())

    def step(*events: Any) -> None:
        for ev in events:
            core.submit(ev)
        core.pump()

    reply = HandshakeReply(engine_id="P", compat_hash="h1", tp_size=2, num_blocks=64,
                           ranks=(RankInfo(pp_rank=0, tp_rank=0, agent="P-0", metadata=b"\x00\x01\xff"),
                                  RankInfo(pp_rank=0, tp_rank=1, agent="P-1", metadata=b"")))
    step(ReadRequested(source="scheduler", t_ns=10, request_id="r1", remote_request_id="p-r1", engine_id="P",
                       host="10.0.0.2", port=5600, remote_tp=2, local_blocks=(1, 2), remote_blocks=(11, 12),
                       deadline=Deadline("monotonic", 10_000)))
    step(HandshakeDone(source="handshake", t_ns=20, engine_id="P", pp_rank=0, attempt=1, reply=reply))
    step(PeerAdded(source="handshake", t_ns=30, engine_id="P", pp_rank=0, attempt=1))
    step(HandleDone(source="xfer-0", t_ns=40, request_id="r1", pp_rank=0, tp_rank=0))
    step(Collect(source="scheduler", t_ns=50, step=1))
    step(ReadRequested(source="scheduler", t_ns=60, request_id="r2", remote_request_id="p-r2", engine_id="P",
                       remote_tp=2, local_blocks=(3,), remote_blocks=(13,)))
    step(HandleFailed(source="xfer-1", t_ns=70, request_id="r2", pp_rank=0, tp_rank=0, why=HandleFailure.ERR,
                      detail="NIXL_ERR_REMOTE_DISCONNECT"))
    step(Collect(source="scheduler", t_ns=80, step=2))
    step(ReadRequested(source="scheduler", t_ns=90, request_id="r3", remote_request_id="p-r3", engine_id="P",
                       remote_tp=2, local_blocks=(4,), remote_blocks=(14,)))
    step(AbortRequested(source="scheduler", t_ns=100, request_id="r3"))
    step(HandleDone(source="xfer-0", t_ns=110, request_id="r3", pp_rank=0, tp_rank=0))
    step(HandleDone(source="xfer-0", t_ns=111, request_id="nobody", pp_rank=0, tp_rank=0))  # rejected
    step(BlocksHeld(source="scheduler", t_ns=120, request_id="x1", block_ids=(7, 8)))
    step(Heartbeat(source="listener", t_ns=130, request_id="x1", extend_ns=500, sender="D:0"))
    step(NotificationReceived(source="notify", t_ns=140, request_id="x1", part=0, of=1, sender="D:0"))
    step(BlocksHeld(source="scheduler", t_ns=150, request_id="x2", block_ids=(9,)))
    step(Tick(source="timer", t_ns=5_000))  # the lease of x2 expires
    step(BadMessage(source="listener", t_ns=5_010, channel="side", sender="10.0.0.9:40000",
                    error="not msgpack", size=17))
    step(SendFailed(source="notify", t_ns=5_020, engine_id="P", pp_rank=0, tp_rank=1, request_id="p-r1",
                    error="ConnectionResetError"))
    step(ReadRequested(source="scheduler", t_ns=5_030, request_id="r4", remote_request_id="p-r4", engine_id="Q",
                       local_blocks=(5,), remote_blocks=(15,)))
    step(HandshakeFailed(source="handshake", t_ns=5_040, engine_id="Q", pp_rank=0, attempt=1, error="timeout"))
    step(PeerDisconnected(source="transfer", t_ns=5_050, engine_id="P", pp_rank=0, detail="UCX EP closed"))
    step(EvictRequested(source="scheduler", t_ns=5_060, engine_id="P", pp_rank=0))
    def timer() -> None:  # another thread: the owner's own submissions are never refused
        for i in range(4):  # the inbox holds 2: two are refused and logged as Dropped
            log.submit(Tick(source=f"timer-{i}", t_ns=6_000 + i))

    thread = threading.Thread(target=timer)
    thread.start()
    thread.join()
    core.pump()
    step(Collect(source="scheduler", t_ns=7_000, step=3))
    log.close()
    return log.records()


def main() -> None:
    GOLDEN.mkdir(exist_ok=True)
    pdlog = GOLDEN / f"v{SCHEMA_VERSION}.pdlog"
    expected = GOLDEN / f"v{SCHEMA_VERSION}.json"
    if pdlog.exists() or expected.exists():
        sys.exit(f"{pdlog} exists: released golden files never change")
    rows = golden_rows()
    write_segment(pdlog, rows, salt=SALT, meta=META, wall_ns=WALL_NS, mono_ns=MONO_NS, batch_records=4)
    expected.write_bytes(msgspec.json.format(msgspec.json.encode(rows)) + b"\n")
    kinds = Counter(type(r.event).__name__ for r in rows)
    print(f"wrote {pdlog} ({pdlog.stat().st_size} bytes, {len(rows)} records): {dict(kinds)}")


if __name__ == "__main__":
    main()
