"""One rank of a 3-rank gloo world for tests/test_review_enginesync_more.py.

Usage: ``enginesync_votes_rank.py STORE RANK WORLD OUT SHORT_S``. Every rank runs the same
scenarios in the same order; each has its own group with a short timeout, and a world barrier
(long timeout) separates scenarios, so a rank that raised alone cannot pair its next collective
with a peer still stuck in the previous one. Outcomes go to OUT as JSON after each scenario
(nothing pickled), so a rank that dies still leaves what it saw. The last scenario kills rank 2
inside the sync, so it runs without the barrier and the ranks leave with os._exit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist

from pdfsm.enginesync import engine_config, sync_engine_id
from pdfsm.errors import InvalidInput

# 256 characters (MAX_ID_CHARS), 508 UTF-8 bytes, with NULs inside and at the end.
ODD_ID = "\0" + "é" * 252 + "\0x\0"
assert len(ODD_ID) == 256 and len(ODD_ID.encode()) == 508
SURROGATE_ID = "host-\udcff-engine"  # what os.fsdecode gives for a non-UTF-8 hostname byte
HUGE = 10**5000  # over Python's 4300-digit limit for str(int): a big hash folded into an int, say


class BadRepr:
    """A layout field whose repr() raises: it cannot be digested."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def main(store: str, rank: int, size: int, out: str, short_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=25))
    short = timedelta(seconds=short_s)
    names = ["odd_bytes_src2", "surrogate_on_rank1", "fp_mod_2_62", "fp_numpy", "engine_config_src1",
             "hpu_on_rank2", "meta_on_rank1", "fp_huge_on_rank1", "fp_huge_everywhere", "layout_huge_on_rank1",
             "layout_bad_repr_on_rank2", "numpy_src1", "after", "die_before_broadcast"]
    groups = {n: dist.new_group(list(range(size)), timeout=short) for n in names}
    own = f"review-engine-rank{rank}"
    results: dict[str, dict[str, Any]] = {}

    def attempt(name: str, call: Callable[[], Any], barrier: bool = True) -> None:
        start = time.monotonic()
        try:
            got = call()
            results[name] = {"id": got, "error": ""}
        except Exception as exc:  # noqa: BLE001 - the test inspects every kind
            results[name] = {"id": "", "error": type(exc).__name__, "invalid": isinstance(exc, InvalidInput),
                             "field": getattr(exc, "field", ""), "message": str(exc)[:400]}
        results[name]["seconds"] = time.monotonic() - start
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, out)
        if barrier:
            dist.barrier()  # world group, long timeout: every rank leaves the scenario before the next

    g = groups
    attempt("odd_bytes_src2", lambda: sync_engine_id(ODD_ID if rank == 2 else own, g["odd_bytes_src2"], src=2))
    attempt("surrogate_on_rank1",
            lambda: sync_engine_id(SURROGATE_ID if rank == 1 else own, g["surrogate_on_rank1"], src=2))
    # Different fingerprints: 0 on ranks 0, 1 and 2**62 on rank 2.
    attempt("fp_mod_2_62", lambda: sync_engine_id(own, g["fp_mod_2_62"], fingerprint=(1 << 62) if rank == 2 else 0))
    # Different fingerprints, as numpy integers (e.g. a hash computed with numpy): 7 on rank 0, 8 elsewhere.
    attempt("fp_numpy", lambda: sync_engine_id(own, g["fp_numpy"], fingerprint=np.int64(7 if rank == 0 else 8)))

    def config() -> list[Any]:
        cfg = engine_config(own, group=g["engine_config_src1"], src=1, tp_rank=rank, tp_size=size,
                            compat_hash="h", block_size=32)
        return [cfg.engine_id, cfg.tp_rank, cfg.tp_size, cfg.block_size]

    attempt("engine_config_src1", config)
    # A device that node lacks: Intel Gaudi ("hpu") without its plugin, and the meta device.
    attempt("hpu_on_rank2", lambda: sync_engine_id(own, g["hpu_on_rank2"], device="hpu" if rank == 2 else None))
    attempt("meta_on_rank1", lambda: sync_engine_id(own, g["meta_on_rank1"], device="meta" if rank == 1 else None))
    # Integers past 4300 digits (str() refuses them): as the fingerprint on one rank, on every rank,
    # and as engine_config's block_size on one rank; then a layout field whose repr() raises.
    attempt("fp_huge_on_rank1", lambda: sync_engine_id(own, g["fp_huge_on_rank1"],
                                                       fingerprint=HUGE if rank == 1 else 0))
    attempt("fp_huge_everywhere", lambda: sync_engine_id(own, g["fp_huge_everywhere"], fingerprint=HUGE))
    attempt("layout_huge_on_rank1", lambda: engine_config(own, group=g["layout_huge_on_rank1"], tp_rank=rank,
                                                          tp_size=size, block_size=HUGE if rank == 1 else 16).engine_id)
    attempt("layout_bad_repr_on_rank2", lambda: engine_config(own, group=g["layout_bad_repr_on_rank2"], tp_rank=rank,
                                                              compat_hash=BadRepr() if rank == 2 else "h").engine_id)
    attempt("numpy_src1", lambda: sync_engine_id(own, g["numpy_src1"], src=np.int64(1)))
    attempt("after", lambda: sync_engine_id(own, g["after"], src=1))

    # Last: rank 2 (not the source) dies after the vote, before the broadcast.
    real_broadcast = dist.broadcast

    def broadcast(*args: Any, **kwargs: Any) -> Any:
        if rank == 2:
            os._exit(0)
        return real_broadcast(*args, **kwargs)

    dist.broadcast = broadcast
    attempt("die_before_broadcast", lambda: sync_engine_id(own, g["die_before_broadcast"]), barrier=False)
    os._exit(0)  # no destroy_process_group: the world lost a rank


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), a[3], float(a[4]))
