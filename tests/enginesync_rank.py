"""One rank of a 4-rank gloo world laid out as two nodes of two ranks (tests/test_enginesync.py).

Usage: ``enginesync_rank.py STORE RANK WORLD OUT NODE0_ID NODE1_ID``. Ranks 0,1 are node 0
and ranks 2,3 node 1; the four form one prefill engine with TP 4. Each rank starts with
its node's random engine id (what every node drew for itself before vLLM PR 39907) and
runs the scenarios below, in the same order on every rank (collectives must match), then
writes what each scenario left it with to ``OUT`` as JSON: an id, or the error it raised.
Nothing is pickled: arguments come on the command line, results go back in a JSON file.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from pdfsm.enginesync import MAX_ID_BYTES, sync_engine_id
from pdfsm.errors import InvalidInput
from pdfsm.wire import MAX_ID_CHARS

LONGEST = "\U0001f680" * MAX_ID_CHARS  # the most UTF-8 bytes an id may have
assert len(LONGEST.encode()) == MAX_ID_BYTES
TOO_LONG = "x" * (MAX_ID_CHARS + 1)


class Outcome(msgspec.Struct, frozen=True):
    engine_id: str = ""
    error: str = ""  # the exception's type name; empty when an id was adopted
    field: str = ""
    message: str = ""
    seconds: float = 0.0


def attempt(call: Callable[[], str]) -> Outcome:
    start = time.monotonic()
    try:
        adopted = call()
    except InvalidInput as exc:
        return Outcome(error=type(exc).__name__, field=exc.field, message=str(exc),
                       seconds=time.monotonic() - start)
    return Outcome(engine_id=adopted, seconds=time.monotonic() - start)


def main(store: str, rank: int, world: int, out: Path, node_ids: list[str]) -> None:
    # A gloo timeout shorter than the parent's, so a hang surfaces as an error in the rank.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    node = rank // 2
    own = node_ids[node]
    # Every rank creates every group, in the same order (torch requires it).
    tp = dist.new_group([0, 1, 2, 3])  # the engine's TP group: TP 4 over the two nodes
    per_node = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # two TP-2 engines, one per node
    results: dict[str, Outcome] = {}
    results["off"] = Outcome(engine_id=own)  # no sync: each node keeps the id it drew
    results["tp"] = attempt(lambda: sync_engine_id(own, tp))
    results["world"] = attempt(lambda: sync_engine_id(own))  # group=None: the default (world) group
    # Two engines of TP 2: each syncs over its own TP group, from group rank 1 (global rank 1 or 3).
    results["per_node_src1"] = attempt(lambda: sync_engine_id(f"{own}-rank{rank}", per_node[node], src=1))
    results["longest"] = attempt(lambda: sync_engine_id(LONGEST if rank == 0 else own, tp))
    # Refusals: every rank must raise InvalidInput, and none may be left in a collective.
    results["too_long_on_src"] = attempt(lambda: sync_engine_id(TOO_LONG if rank == 0 else own, tp))
    results["too_long_on_rank3"] = attempt(lambda: sync_engine_id(TOO_LONG if rank == 3 else own, tp))
    results["src_disagrees"] = attempt(lambda: sync_engine_id(own, tp, src=1 if rank == 2 else 0))
    results["src_outside"] = attempt(lambda: sync_engine_id(own, tp, src=7 if rank == 1 else 0))
    # A torch bool tensor passes operator.index as 1: it was adopted as rank 1 (review); True is no rank.
    results["src_bool_tensor"] = attempt(lambda: sync_engine_id(own, tp, src=torch.tensor(True)))
    # The group is still in step after every refusal.
    results["after"] = attempt(lambda: sync_engine_id(own, tp))
    dist.destroy_process_group()
    out.write_bytes(msgspec.json.encode(results))


if __name__ == "__main__":
    store_arg, rank_arg, world_arg, out_arg, *ids = sys.argv[1:]
    main(store_arg, int(rank_arg), int(world_arg), Path(out_arg), ids)
