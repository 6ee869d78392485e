"""The main job for real: a prefill and a decode engine in two OS processes over NIXL (UCX, host
memory), each worker writing its durable log, every log replayed at the end (pdfsm.run).

Every run checks, through :func:`pdfsm.run.run`: each request reached the decode scheduler
exactly once in a defined state, every received block holds the producer's bytes, both
block pools are whole again (blocks released exactly once: a double release would overfill
the pool, a leak leave it short), no illegal event was blamed on the local side, and every
log replays without divergence. The tests add what each case must show on top.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from transport_helpers import LOOPBACK, listening_addresses

from pdfsm import run as demo
from pdfsm.engine_messages import Load, Prefill
from pdfsm.events import AbortRequested
from pdfsm.filelog import read_log
from pdfsm.replay import replay
from transports.nixl import nixl_available

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]


def run(tmp_path: Path, *argv: str, requests: int = 6) -> demo.Outcome:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--requests", str(requests), "--log-dir", str(tmp_path), "--timeout-s", "90", *argv])
    out = demo.run(args, show=False)
    assert not out.problems, out.problems
    assert out.bad_bytes == 0
    return out


def test_tp2_into_tp1_with_two_aborts_landing_mid_read(tmp_path: Path) -> None:
    """Each consumer rank reads half of each block from both producer ranks; the aborted requests'
    machines were READING when the abort landed, and their producers still release at once by
    notification, not by lease."""
    out = run(tmp_path, "--prefill-tp", "2", "--decode-tp", "1", "--abort", "2")
    assert out.outcomes == {"received": 4, "aborted": 2}
    assert out.released == 6 and out.expired == 0
    records = read_log(tmp_path / "decode-pp0-tp0")
    aborted = [r for r in records if isinstance(r.event, AbortRequested)]
    assert len(aborted) == 2 and all(r.before == "READING" and r.state == "ABORTING" for r in aborted)
    assert {p.name for p in out.logs} == {"prefill-pp0-tp0", "prefill-pp0-tp1", "decode-pp0-tp0"}


@pytest.mark.parametrize("seed", [2, 6])
def test_tp1_into_tp2_aborts_wait_for_every_rank_to_read(tmp_path: Path, seed: int) -> None:
    """Found by review: the abort was applied once any decode rank read, so a rank still
    handshaking stopped unread and its producer rank waited out the lease for a notice (seeds 2
    and 6 released 2 of 8 by lease, with a remote violation in a run planting no fault). Every rank
    reads first now: every hold is released by notification. (A loaded machine may read a few
    blocks to the end before the abort lands: such a request is received, as the demo reports.)"""
    out = run(tmp_path, "--prefill-tp", "1", "--decode-tp", "2", "--abort", "2", "--lease-s", "3",
              "--seed", str(seed), requests=8)
    assert sum(out.outcomes.values()) == 8 and set(out.outcomes) <= {"received", "aborted"}
    assert out.released == 8 and out.expired == 0


def test_tp1_into_tp2(tmp_path: Path) -> None:
    """Both consumer ranks read their heads out of the one producer rank's blocks; the producer
    releases only when both have notified."""
    out = run(tmp_path, "--prefill-tp", "1", "--decode-tp", "2")
    assert out.outcomes == {"received": 6} and out.released == 6
    assert out.accounting["prefill"].remote_violations == 0


def test_mla_reads_one_producer_rank_and_notifies_the_other(tmp_path: Path) -> None:
    out = run(tmp_path, "--prefill-tp", "2", "--decode-tp", "1", "--mla")
    assert out.outcomes == {"received": 6} and out.released == 6 and out.expired == 0


@pytest.mark.parametrize("argv", [("--prefill-tp", "1", "--decode-tp", "4", "--kv-heads", "2"),
                                  ("--prefill-tp", "4", "--decode-tp", "2", "--kv-heads", "1", "--prefill-pp", "2")])
def test_a_tp_above_the_models_kv_heads_reads_each_head_once(tmp_path: Path, argv: tuple[str, ...]) -> None:
    """More ranks than KV heads (vLLM's replicated heads): decode ranks holding the same head each
    read it from the prefill rank holding it; prefill ranks holding copies of a head already read
    are told, not read. Every byte verified, every hold released by notification, no violation."""
    out = run(tmp_path, *argv)
    assert out.outcomes == {"received": 6} and out.released == 6 and out.expired == 0
    assert out.accounting["prefill"].remote_violations == 0 and out.accounting["decode"].remote_violations == 0


def test_a_producer_killed_mid_transfer(tmp_path: Path) -> None:
    """SIGKILL once the producer has handed a request's params on, before the decode side reads:
    that request fails with the recompute policy (its blocks reported invalid to the scheduler),
    the decode pool is whole, and the decode log replays. (Reads already posted when a peer dies
    are tests/test_nixl_transport.py's.)"""
    out = run(tmp_path, "--fault", "kill-prefill")
    assert out.outcomes["received"] >= 2 and out.outcomes["failed"] >= 1
    assert set(out.outcomes) <= {"received", "failed"}
    assert "prefill" not in out.accounting  # it was killed: no accounting, its logs end where it died
    failed = [rid for rid, reason in out.reasons.items() if "disconnect" in reason.lower()]
    assert failed, out.reasons
    # Write-ahead: every hold whose params reached the router is in the killed producer's logs.
    held = {getattr(r.event, "request_id", "") for name in ("prefill-pp0-tp0", "prefill-pp0-tp1")
            for r in read_log(tmp_path / name, on_torn_tail="stop") if r.machine == "producer"}
    assert {rid.replace("d-", "p-", 1) for rid in out.reasons} <= held, (sorted(out.reasons), sorted(held))


def test_a_lost_notification_releases_by_lease(tmp_path: Path) -> None:
    out = run(tmp_path, "--fault", "drop-notification")
    assert out.outcomes == {"received": 6}
    assert out.expired == 1 and out.released == 5


def test_a_forged_notification_is_a_remote_violation(tmp_path: Path) -> None:
    out = run(tmp_path, "--fault", "forge-notification")
    assert out.outcomes == {"received": 6} and out.released == 6
    assert out.accounting["prefill"].remote_violations >= 1
    assert out.accounting["prefill"].local_violations == 0


@pytest.mark.parametrize(("fault", "why"), [("wrong-engine-id", "engine id"), ("compat-hash", "compat")])
def test_a_refused_handshake_fails_every_request_and_the_producer_leases_run_out(
        tmp_path: Path, fault: str, why: str) -> None:
    out = run(tmp_path, "--fault", fault, requests=4)
    assert out.outcomes == {"failed": 4}
    assert all(why in reason for reason in out.reasons.values()), out.reasons
    assert out.expired == 4 and out.released == 0


def test_every_log_replays_again_from_disk(tmp_path: Path) -> None:
    """What the demo left is what `pdfsm replay` reads: each worker's log replays on its own."""
    run(tmp_path, "--prefill-tp", "2", "--decode-tp", "2", requests=4)
    logs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(logs) == 4
    for log in logs:
        replay(read_log(log))


def test_a_pp2_producer_is_read_layer_by_layer_by_a_pp1_consumer(tmp_path: Path) -> None:
    """Each producer PP rank holds its own layers; the consumer reads every layer from the rank
    that holds it (four agents on the prefill side) and verifies all of them."""
    out = run(tmp_path, "--prefill-pp", "2", "--prefill-tp", "2", requests=4)
    assert out.outcomes == {"received": 4} and out.released == 4
    assert len(out.logs) == 5


def test_a_consumer_without_pp_support_fails_at_once_and_reads_nothing(tmp_path: Path) -> None:
    out = run(tmp_path, "--prefill-pp", "2", "--no-pp", "--lease-s", "3", requests=4)
    assert out.outcomes == {"failed": 4}
    assert all("pipeline parallelism" in reason for reason in out.reasons.values()), out.reasons
    assert out.expired == 4  # the PP 1 ranks' leases: nothing could tell them
    decode = read_log(tmp_path / "decode-pp0-tp0")
    assert not any(type(r.event).__name__ in ("HandleDone", "HandleFailed") for r in decode)  # no read posted


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="no CUDA device: the VRAM path needs one")
def test_kv_caches_in_gpu_memory(tmp_path: Path) -> None:
    """Both engines keep their KV caches on the GPU: NIXL reads VRAM to VRAM, TP 2 into TP 1."""
    out = run(tmp_path, "--kv-device", "cuda", "--prefill-tp", "2", "--decode-tp", "1")
    assert out.outcomes == {"received": 6} and out.released == 6


@pytest.mark.skipif(_cuda(), reason="this machine has CUDA")
def test_kv_device_cuda_without_a_gpu_is_a_clear_error(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--requests", "1", "--log-dir", str(tmp_path), "--kv-device", "cuda", "--json"])
    with pytest.raises(demo.EngineError, match=r"exited with code 2:\n--kv-device cuda: not available here"):
        demo.run(args, show=False)


def test_a_hold_is_in_the_log_before_its_params_leave_the_prefill_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Write-ahead: when the engine reports "prefilled" (the params go to the router), every
    rank's log already holds the BlocksHeld on disk, so a SIGKILL right after loses nothing the
    decode side could go on to read (fsync is for machine crashes; this is a process crash)."""
    from pdfsm import engines
    from pdfsm.engine_messages import Finish, Prefill, Result

    on_disk: list[set[str]] = []

    def emit(result: Result) -> None:
        if result.ev == "prefilled":
            on_disk.append({getattr(r.event, "request_id", "") for name in ("prefill-pp0-tp0", "prefill-pp0-tp1")
                            for r in read_log(tmp_path / name, on_torn_tail="stop")})

    monkeypatch.setattr(engines, "emit", emit)
    args = engines.build_parser().parse_args(["--role", "prefill", "--engine-id", "prefill", "--tp", "2",
                                              "--log-dir", str(tmp_path)])
    engine = engines.Engine(args)
    try:
        for i in range(3):
            engine.prefill(Prefill(rid=f"p-{i}", blocks=2, seed=i))
    finally:
        engine.finish(Finish(grace_s=0.0))
    assert [sorted(ids & {"p-0", "p-1", "p-2"}) for ids in on_disk] == [["p-0"], ["p-0", "p-1"], ["p-0", "p-1", "p-2"]]


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs Linux /proc")
def test_the_engines_listen_on_the_configured_interface_only(tmp_path: Path) -> None:
    """The main job with its defaults: while a request moves, every socket either engine process
    listens on (the prefill side channel, UCX's) is on loopback, the configured interface; none
    binds every interface (0.0.0.0 or ::)."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--log-dir", str(tmp_path)])
    prefill, decode = (demo.Engine(role, demo._engine_args(args, role, tmp_path)) for role in ("prefill", "decode"))
    try:
        port = prefill.wait_for("ready", 60).port
        decode.wait_for("ready", 60)
        prefill.send(Prefill(rid="p-0", blocks=2, seed=7))
        params = prefill.wait_for("prefilled", 30).params
        assert params is not None and params.remote_host == "127.0.0.1" and params.remote_port == port
        decode.send(Load(rid="d-0", params=params, seed=7))
        assert decode.wait_for("done", 30).outcome == "received"
        opened = {e.role: set(listening_addresses(e.proc.pid).values()) for e in (prefill, decode)}
        assert opened["prefill"] and all(addrs <= LOOPBACK for addrs in opened.values()), opened
    finally:
        for e in (prefill, decode):
            e.kill()
