"""Adversarial review of pdfsm.enginesync as a deployment uses it: real gloo worlds over loopback.

Four worlds run at once (one module fixture, every rank its own OS process): A, 4 ranks, one
engine with TP 2 x PP 2 over two "nodes" (hostnames node0/node1.example), started in reverse
order with delays; B, 3 ranks (odd), with a rank that hangs and then a source that crashes
inside the sync; C, 2 ranks on the default backend, with a rank that crashes before the
sync; D, a world of one.
Each rank runs its world's scenarios in order and rewrites a JSON file of outcomes after each
one, so a rank that dies still leaves what it saw. Nothing is pickled.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import child_env

ROOT = Path(__file__).resolve().parent.parent
WORLDS = {"a": 4, "b": 3, "c": 2, "d": 1}
SHORT_S = 3  # the timeout of the groups a scenario is expected to break

RANK_SCRIPT = r'''
import json, os, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist

from pdfsm.connector import Connector
from pdfsm.enginesync import engine_config, sync_engine_id
from pdfsm.errors import InvalidInput
from pdfsm.sidechannel import SideChannelHandshaker
from transports.sim import SimNetwork, SimTransport

kind, store, rank, size, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
SHORT = timedelta(seconds=int(sys.argv[6]))
results = {}


def save():
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, out)


def attempt(name, call):
    start = time.monotonic()
    try:
        got = call()
        results[name] = {"id": got if isinstance(got, str) else json.dumps(got), "error": ""}
    except Exception as exc:
        results[name] = {"id": "", "error": type(exc).__name__, "invalid": isinstance(exc, InvalidInput),
                         "field": getattr(exc, "field", ""), "message": str(exc)[:600]}
    results[name]["seconds"] = time.monotonic() - start
    save()


# World C names no backend: on this NCCL-less, CPU-only build torch reports it as "undefined".
dist.init_process_group(None if kind == "c" else "gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                        timeout=timedelta(seconds=25))
own = f"{kind}-engine-rank{rank}"


def connector_facts(cfg, host, port):
    xfer = SimTransport(SimNetwork(), f"{cfg.engine_id}/pp{cfg.pp_rank}/tp{cfg.tp_rank}",
                        pp_rank=cfg.pp_rank, tp_rank=cfg.tp_rank)
    conn = Connector(cfg, xfer, SideChannelHandshaker(cfg.engine_id), host=host, port=port)
    try:
        p = conn.request_finished("p1", [1, 2])
        started = conn.core.log.records()[0].event.config.engine_id
        return {"params_id": p.remote_engine_id, "host": p.remote_host, "port": p.remote_port,
                "tp": p.remote_tp_size, "pp": p.remote_pp_size, "core_id": conn.core.config.engine_id,
                "logged_id": started, "compat": conn.config.compat_hash}
    finally:
        conn.shutdown()


if kind == "a":  # one engine, TP 2 x PP 2, over two nodes of two ranks
    node, tp, pp = rank // 2, rank % 2, rank // 2
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # non-contiguous groups
    singles = [dist.new_group([r]) for r in range(size)]
    short = dist.new_group(list(range(size)), timeout=SHORT)

    def config():
        cfg = engine_config(own, tp_rank=tp, tp_size=2, pp_rank=pp, pp_size=2, compat_hash="h")
        return connector_facts(cfg, f"node{node}.example", 5600 + node)

    attempt("config_world", config)

    def delayed():
        if rank == 3:
            time.sleep(1.5)
        return sync_engine_id(own)

    attempt("delayed_rank3", delayed)
    attempt("pairs_src1", lambda: sync_engine_id(own, pairs[rank % 2], src=1))
    attempt("not_a_member", lambda: sync_engine_id(own, pairs[1 - rank % 2]))
    attempt("singleton", lambda: sync_engine_id(own, singles[rank]))
    attempt("rotate_src", lambda: [sync_engine_id(own, src=s) for s in range(size)])

    def user_group():
        t = torch.tensor([rank + 1])
        dist.all_reduce(t)
        got = sync_engine_id(own, dist.group.WORLD, src=3)
        u = torch.tensor([rank + 1])
        dist.all_reduce(u)
        dist.barrier()
        return [int(t), got, int(u)]

    attempt("user_owned_group", user_group)

    def fields_differ():
        cfg = engine_config(own, tp_rank=tp, tp_size=2 + rank, pp_rank=pp, pp_size=2, compat_hash=f"h{rank}")
        return [cfg.engine_id, cfg.tp_size, cfg.compat_hash]

    attempt("fields_differ", fields_differ)
    # Last: it breaks the short group if one rank fails alone. "cuda" on a machine without CUDA
    # stands for a node whose GPU is missing (where there is one, gloo takes a CUDA tensor).
    attempt("bad_device_on_rank1", lambda: sync_engine_id(own, short, device="cuda" if rank == 1 else None))
    if rank == 1:
        time.sleep(SHORT.total_seconds() + 1)  # a worker that caught its error and lives on
elif kind == "b":  # 3 ranks: odd size, a hang, then a crash inside the sync
    hang = dist.new_group(list(range(size)), timeout=SHORT)
    attempt("odd_src2", lambda: sync_engine_id(own, src=2))
    attempt("empty_id_on_rank1", lambda: sync_engine_id("" if rank == 1 else own, src=2))
    if rank == 2:
        time.sleep(SHORT.total_seconds() + 0.5)  # never calls: a hung rank
    else:
        attempt("peer_hangs", lambda: sync_engine_id(own, hang))
    attempt("world_after_hang", lambda: sync_engine_id(own))
    if rank == 2:
        dist.broadcast = lambda *a, **k: os._exit(17)  # the source dies between the two collectives
    attempt("src_crashes_in_broadcast", lambda: sync_engine_id(own, src=2))
    os._exit(0)  # leave at once: a rank still alive must not keep a peer waiting on it
elif kind == "c":  # 2 ranks, default backend: one dies before the sync
    attempt("pair", lambda: [str(dist.get_backend()), sync_engine_id(own, src=1)])
    if rank == 1:
        os._exit(23)
    time.sleep(0.3)
    attempt("peer_died_before", lambda: sync_engine_id(own))
    os._exit(0)
else:  # a world of one
    attempt("alone", lambda: sync_engine_id(own))
    attempt("config_alone", lambda: connector_facts(engine_config(own, compat_hash="h"), "solo.example", 5700))
dist.destroy_process_group()
'''

Outcomes = dict[str, dict[str, Any]]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Outcomes]]:
    """Run every world once, concurrently; each rank's outcomes by world."""
    work = tmp_path_factory.mktemp("review_enginesync")
    script = work / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = child_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen[bytes]] = []
    # World A's ranks start last-first, with a delay between each: any start order must do.
    order = [("a", r) for r in (3, 2, 1, 0)] + [(k, r) for k, n in WORLDS.items() if k != "a" for r in range(n)]
    for kind, rank in order:
        with (work / f"{kind}{rank}.err").open("wb") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(script), kind, str(work / f"store-{kind}"), str(rank), str(WORLDS[kind]),
                 str(work / f"{kind}{rank}.json"), str(SHORT_S)],
                stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT))
        if kind == "a":
            time.sleep(0.2)
    deadline = time.monotonic() + 60
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    out: dict[str, list[Outcomes]] = {}
    for kind, n in WORLDS.items():
        out[kind] = []
        for r in range(n):
            f = work / f"{kind}{r}.json"
            got: Outcomes = json.loads(f.read_text()) if f.exists() else {}
            got["_stderr"] = {"tail": (work / f"{kind}{r}.err").read_text()[-1500:]}
            out[kind].append(got)
    return out


def outcome(worlds: dict[str, list[Outcomes]], kind: str, rank: int, scenario: str) -> dict[str, Any]:
    ranks = worlds[kind]
    assert scenario in ranks[rank], f"{kind}{rank} never reported {scenario}: {ranks[rank]['_stderr']['tail']}"
    return ranks[rank][scenario]


def _needs_no_cuda(premise: str) -> None:
    """Skip where torch sees CUDA: the scenario's premise holds only on a machine without it (a lent
    H200 ran the suite: "cuda" was a good device there, and world C's ranks met NCCL on one GPU)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip(f"premise: a machine without CUDA ({premise})")


def adopted(worlds: dict[str, list[Outcomes]], kind: str, scenario: str, ranks: range | None = None) -> list[Any]:
    """What each rank adopted (decoded when it is not a plain id); fails on any error."""
    got = []
    for r in ranks if ranks is not None else range(WORLDS[kind]):
        o = outcome(worlds, kind, r, scenario)
        assert not o["error"], (kind, r, o)
        got.append(json.loads(o["id"]) if o["id"][:1] in "[{" else o["id"])
    return got


def own(kind: str, rank: int) -> str:
    return f"{kind}-engine-rank{rank}"


# --- world A: one TP 2 x PP 2 engine over two nodes ------------------------------------------------


@pytest.mark.slow
def test_engine_config_over_world_puts_rank0_id_in_every_ranks_params_core_and_log(
    worlds: dict[str, list[Outcomes]],
) -> None:
    """Every rank's Connector advertises rank 0's id in KVTransferParams, its core config and Started."""
    facts = adopted(worlds, "a", "config_world")
    for r, f in enumerate(facts):
        assert (f["params_id"], f["core_id"], f["logged_id"]) == (own("a", 0),) * 3
        assert (f["host"], f["port"], f["tp"], f["pp"]) == (f"node{r // 2}.example", 5600 + r // 2, 2, 2)


@pytest.mark.slow
def test_late_rank_is_waited_for_and_every_rank_gets_rank0s_id(worlds: dict[str, list[Outcomes]]) -> None:
    """Reverse start order plus a rank calling 1.5 s late still gives every rank rank 0's id."""
    assert adopted(worlds, "a", "delayed_rank3") == [own("a", 0)] * 4
    assert outcome(worlds, "a", 0, "delayed_rank3")["seconds"] >= 1.0  # it really waited


@pytest.mark.slow
def test_non_contiguous_groups_map_src_to_the_right_global_rank(worlds: dict[str, list[Outcomes]]) -> None:
    """Groups [0,2] and [1,3] with src=1 adopt global ranks 2 and 3's ids respectively."""
    assert adopted(worlds, "a", "pairs_src1") == [own("a", 2), own("a", 3), own("a", 2), own("a", 3)]


@pytest.mark.slow
def test_a_non_member_is_refused_alone_at_once(worlds: dict[str, list[Outcomes]]) -> None:
    """Calling the sync on a group this rank is not in raises InvalidInput(group) immediately."""
    for r in range(4):
        o = outcome(worlds, "a", r, "not_a_member")
        assert (o["invalid"], o["field"]) == (True, "group") and o["seconds"] < 1, o


@pytest.mark.slow
def test_singleton_groups_keep_their_own_id(worlds: dict[str, list[Outcomes]]) -> None:
    """A group of one (TP 1 inside a bigger world) returns the rank's own id."""
    assert adopted(worlds, "a", "singleton") == [own("a", r) for r in range(4)]


@pytest.mark.slow
def test_repeated_syncs_in_one_group_stay_in_step(worlds: dict[str, list[Outcomes]]) -> None:
    """Four back-to-back syncs with src 0..3 each yield that source's id on every rank."""
    assert adopted(worlds, "a", "rotate_src") == [[own("a", s) for s in range(4)]] * 4


@pytest.mark.slow
def test_sync_leaves_a_user_owned_group_usable(worlds: dict[str, list[Outcomes]]) -> None:
    """The user's own collectives before and after the sync on the world group still pair up."""
    assert adopted(worlds, "a", "user_owned_group") == [[10, own("a", 3), 10]] * 4


@pytest.mark.slow
def test_ranks_of_one_engine_that_disagree_on_its_layout_are_refused_on_every_rank(
    worlds: dict[str, list[Outcomes]],
) -> None:
    """engine_config: ranks differing in tp_size/compat_hash all raise InvalidInput (fingerprint)."""
    for r in range(4):
        o = outcome(worlds, "a", r, "fields_differ")
        assert o["error"] == "InvalidInput" and o["field"] == "fingerprint", o


@pytest.mark.slow
def test_a_bad_device_on_one_rank_is_refused_on_every_rank_before_the_timeout(
    worlds: dict[str, list[Outcomes]],
) -> None:
    """Docs: only not-initialized/non-member raise alone; a bad device must not strand the others."""
    _needs_no_cuda("'cuda' is a device the node lacks")
    for r in range(4):
        o = outcome(worlds, "a", r, "bad_device_on_rank1")
        assert o["error"], o
        assert o["seconds"] < SHORT_S - 0.5, f"rank {r} waited out the group timeout: {o}"


# --- world B: 3 ranks, a hung rank, a source that crashes mid-sync ---------------------------------


@pytest.mark.slow
def test_odd_world_adopts_the_last_ranks_id(worlds: dict[str, list[Outcomes]]) -> None:
    """World of 3 with src=2: every rank adopts global rank 2's id."""
    assert adopted(worlds, "b", "odd_src2") == [own("b", 2)] * 3


@pytest.mark.slow
def test_an_empty_id_on_a_middle_rank_is_refused_on_every_rank_naming_it(worlds: dict[str, list[Outcomes]]) -> None:
    """World of 3: an empty id on rank 1 makes all three raise InvalidInput(engine_id), naming rank 1."""
    for r in range(3):
        o = outcome(worlds, "b", r, "empty_id_on_rank1")
        assert (o["invalid"], o["field"], o["id"]) == (True, "engine_id", ""), o
        assert ("got 0" if r == 1 else "refused on group rank 1") in o["message"] and o["seconds"] < 2, o


@pytest.mark.slow
def test_a_hung_rank_makes_the_others_fail_at_the_group_timeout_not_hang(worlds: dict[str, list[Outcomes]]) -> None:
    """A rank that never calls leaves the others raising near the group's timeout, never forever."""
    for r in (0, 1):
        o = outcome(worlds, "b", r, "peer_hangs")
        assert o["error"] == "EngineSyncError" and "all_reduce" in o["message"] and not o["id"], o
        assert SHORT_S - 0.5 <= o["seconds"] < SHORT_S + 4, o
    assert adopted(worlds, "b", "world_after_hang") == [own("b", 0)] * 3  # other groups still work


@pytest.mark.slow
def test_a_source_crashing_inside_the_sync_fails_every_survivor_promptly(worlds: dict[str, list[Outcomes]]) -> None:
    """The src dies between all_reduce and broadcast: survivors raise (no id adopted), well before 25 s."""
    for r in (0, 1):
        o = outcome(worlds, "b", r, "src_crashes_in_broadcast")
        assert o["error"] == "EngineSyncError" and "broadcast" in o["message"] and not o["id"], o
        assert o["seconds"] < 10, o
    assert "src_crashes_in_broadcast" not in worlds["b"][2]


# --- world C: 2 ranks, a rank dies before the sync; world D: one rank --------------------------------


@pytest.mark.slow
def test_a_peer_dead_before_the_sync_fails_the_survivor_promptly(worlds: dict[str, list[Outcomes]]) -> None:
    """A 2-rank sync on the default (no NCCL) backend works; then rank 1 exits and rank 0's next sync raises fast."""
    _needs_no_cuda("world C's default backend has no NCCL, which would want a GPU per rank")
    assert adopted(worlds, "c", "pair") == [["undefined", own("c", 1)]] * 2  # NCCL-less default backend
    o = outcome(worlds, "c", 0, "peer_died_before")
    assert o["error"] == "EngineSyncError" and not o["id"] and o["seconds"] < 10, o


@pytest.mark.slow
def test_a_world_of_one_keeps_its_id_and_advertises_it(worlds: dict[str, list[Outcomes]]) -> None:
    """World size 1: the sync returns the rank's own id and the Connector advertises it."""
    assert adopted(worlds, "d", "alone") == [own("d", 0)]
    (f,) = adopted(worlds, "d", "config_alone")
    assert (f["params_id"], f["core_id"], f["host"], f["tp"], f["pp"]) == (own("d", 0),) * 2 + ("solo.example", 1, 1)
