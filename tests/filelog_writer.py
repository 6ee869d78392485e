"""A real writer process for the kill -9 test: appends forever under fsync=always.

    python tests/filelog_writer.py DIR [SEED]

Opens (and so recovers) the log in DIR, prints ``start <seq>``, then writes
batches of rows continuing the sequence and prints every acknowledged seq
(``ack <seq>``, from the writer thread, after the fsync) until it is killed.
Row ``s`` is always :func:`row` ``(s)``, so the reader can check every byte.
"""

from __future__ import annotations

import random
import sys

from pdfsm.events import Deadline, HandleDone, ReadRequested
from pdfsm.filesink import FileSink, FsyncPolicy
from pdfsm.log import Outcome, Record


def row(seq: int) -> Record:
    """The record with sequence number ``seq`` (deterministic, two event kinds)."""
    if seq % 2:
        ev: HandleDone | ReadRequested = HandleDone(source="xfer-0", t_ns=seq, request_id=f"r{seq // 2}",
                                                    pp_rank=0, tp_rank=seq % 4)
        return Record(seq, ev, "consumer", "READING", "NOTIFIED", Outcome.APPLIED)
    ev = ReadRequested(source="scheduler", t_ns=seq, request_id=f"r{seq // 2}", remote_request_id=f"p{seq}",
                       engine_id="P", local_blocks=tuple(range(seq % 7)), remote_blocks=tuple(range(seq % 7)),
                       deadline=Deadline("monotonic", seq + 1000))
    return Record(seq, ev, "consumer", "NEW", "READING", Outcome.APPLIED,
                  cause=seq - 1 if seq % 3 == 0 and seq else None)


def _ack(seq: int) -> None:
    print(f"ack {seq}", flush=True)


def main() -> None:
    directory = sys.argv[1]
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    sink = FileSink(directory, fsync=FsyncPolicy.always(), segment_bytes=32 << 10, queue_rows=256, on_ack=_ack)
    seq = sink.recovery.next_seq
    print(f"start {seq}", flush=True)
    while True:
        n = rng.randint(1, 40)
        sink.write([row(s) for s in range(seq, seq + n)])
        seq += n


if __name__ == "__main__":
    main()
