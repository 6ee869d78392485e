"""Engine-id sync for multi-node TP (vLLM PR 39907, issue 27083), over a real 4-rank gloo group.

Four OS processes (tests/enginesync_rank.py) form one gloo world laid out as two nodes of
two ranks: one prefill engine with TP 4 over both nodes. Each starts with its node's own
random engine id, as every vLLM node did before PR 39907, and reports (as JSON, nothing
pickled) what each scenario left it with: no sync, sync over the TP group, over the world
group, per-node groups with ``src=1``, the longest id, and refusals.

This process then plays the rest of the deployment with those ids: one side-channel
listener per prefill node (real loopback TCP) answering with the id its ranks report and
the four ranks' metadata, the prefill ranks' memory (sim transport), and a decode engine
with TP 2 whose rank d reads prefill ranks 2d, 2d+1, i.e. handshakes with node d's
listener, naming the engine id the router took from prefill rank 0's kv_transfer_params.
Without the sync, decode rank 1 (the one talking to node 1) is refused by its engine
machine with a typed EngineIdMismatch; with it, both decode ranks read their blocks.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest
from enginesync_rank import LONGEST, Outcome
from helpers import child_env

from pdfsm.commands import HandOff
from pdfsm.connector import Connector, KVTransferParams
from pdfsm.engine import EngineState
from pdfsm.enginesync import (
    MAX_ID_BYTES,
    _digest,
    _layout_fingerprint,
    _unpack,
    engine_config,
    new_engine_id,
    sync_engine_id,
)
from pdfsm.errors import EngineIdMismatch, EngineSyncError, InvalidInput
from pdfsm.events import CoreConfig, HandshakeReply
from pdfsm.fsm import Fault
from pdfsm.log import Outcome as LogOutcome
from pdfsm.sidechannel import SideChannelHandshaker, SideChannelServer
from pdfsm.wire import MAX_ID_CHARS
from transports.sim import SimNetwork, SimTransport, pattern

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
WORLD = 4
NODES = ((0, 1), (2, 3))  # global ranks of node 0 and node 1
P_BLOCK, D_BLOCK = 32, 64  # bytes per block: a decode rank (TP 2) holds two prefill ranks' (TP 4) heads
REMOTE_BLOCKS, LOCAL_BLOCKS = (2, 3), (1, 5)

Reports = dict[int, dict[str, Outcome]]


# --- the gloo world -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node_ids() -> tuple[str, str]:
    """What each node drew for itself (both ran the same command: the same prefix)."""
    return new_engine_id("prefill"), new_engine_id("prefill")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, node_ids: tuple[str, str]) -> Reports:
    """Run the four ranks once for the module; every scenario's outcome, by rank."""
    work = tmp_path_factory.mktemp("enginesync")
    env = child_env()
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")  # loopback only; 2 cores shared by 4 ranks
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(WORLD):
        with (work / f"rank{rank}.stdout").open("wb") as out, (work / f"rank{rank}.stderr").open("wb") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(TESTS / "enginesync_rank.py"), str(work / "store"), str(rank), str(WORLD),
                 str(work / f"rank{rank}.json"), *node_ids],
                stdout=out, stderr=err, env=env, cwd=ROOT))
    deadline = time.monotonic() + 120
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = {r: p.returncode for r, p in enumerate(procs) if p.returncode != 0}
    if failed:
        tails = "\n".join(f"--- rank {r} (exit {failed[r]}):\n{(work / f'rank{r}.stderr').read_text()[-3000:]}"
                          for r in failed)
        pytest.fail(f"ranks failed or hung: {failed}\n{tails}")
    decoder = msgspec.json.Decoder(dict[str, Outcome])
    return {r: decoder.decode((work / f"rank{r}.json").read_bytes()) for r in range(WORLD)}


def ids_of(ranks: Reports, scenario: str) -> list[str]:
    outcomes = [ranks[r][scenario] for r in range(WORLD)]
    assert all(not o.error for o in outcomes), outcomes
    return [o.engine_id for o in outcomes]


# --- the rest of the deployment, in this process -------------------------------------------------


@dataclass
class DecodeRank:
    """What one decode rank saw of its request and of the prefill engine."""

    connector: Connector
    transport: SimTransport
    received: set[str] = field(default_factory=set)
    failed: list[HandOff] = field(default_factory=list)


def handshake_and_read(ids: list[str]) -> list[DecodeRank]:
    """Prefill ranks reporting ``ids`` behind one listener per node; decode ranks 0 and 1 each
    load one request from their node's listener, naming rank 0's id. Returns them when both
    have reported (then shut down)."""
    net = SimNetwork()
    prefill = [SimTransport(net, f"{ids[r]}/tp{r}", tp_rank=r, block_bytes=P_BLOCK) for r in range(WORLD)]
    for x in prefill:
        x.fill(REMOTE_BLOCKS)
    rank_infos = tuple(x.rank_info() for x in prefill)  # gathered by the caller (docs/side-channel.md)
    replies = []
    for node in NODES:
        (eid,) = {ids[r] for r in node}  # the ranks of one node agree with each other, synced or not
        replies.append(HandshakeReply(engine_id=eid, compat_hash="h", tp_size=WORLD, num_blocks=64,
                                      ranks=rank_infos))
    with SideChannelServer(lambda pp: replies[0]) as node0, SideChannelServer(lambda pp: replies[1]) as node1:
        decode = []
        for d, listener in enumerate((node0, node1)):
            xfer = SimTransport(net, f"D/tp{d}", tp_rank=d, block_bytes=D_BLOCK)
            conn = Connector(CoreConfig(engine_id="D", compat_hash="h", tp_rank=d, tp_size=2), xfer,
                             SideChannelHandshaker("D"))
            # The router's params come from prefill rank 0; this decode rank's listener is its node's.
            params = KVTransferParams(lease_ns=60_000_000_000,
                                      remote_engine_id=ids[0], remote_request_id="p1", remote_port=listener.port,
                                      remote_block_ids=REMOTE_BLOCKS, remote_tp_size=WORLD)
            conn.load("r1", LOCAL_BLOCKS, params)
            decode.append(DecodeRank(conn, xfer))
        try:
            deadline = time.monotonic() + 10
            while not all(r.received for r in decode) and time.monotonic() < deadline:
                for r in decode:
                    r.received |= r.connector.get_finished()[1]
                    r.failed += r.connector.last.failed
                time.sleep(0.002)
        finally:
            for r in decode:
                r.connector.shutdown()
    return decode


def assert_read_from(r: DecodeRank, ids: list[str], d: int) -> None:
    """Decode rank d's blocks hold the halves of prefill ranks 2d and 2d+1, in that order."""
    assert r.received == {"r1"} and not r.failed
    for local, remote in zip(LOCAL_BLOCKS, REMOTE_BLOCKS, strict=True):
        want = b"".join(pattern(f"{ids[t]}/tp{t}", remote, P_BLOCK) for t in NODES[d])
        assert r.transport.block(local) == want


# --- with and without the sync -------------------------------------------------------------------


@pytest.mark.slow
def test_without_sync_each_node_keeps_its_own_id(ranks: Reports, node_ids: tuple[str, str]) -> None:
    assert ids_of(ranks, "off") == [node_ids[0], node_ids[0], node_ids[1], node_ids[1]]
    assert node_ids[0] != node_ids[1]


@pytest.mark.slow
def test_without_sync_the_handshake_with_node_1_is_refused_naming_both_ids(ranks: Reports) -> None:
    ids = ids_of(ranks, "off")
    named, node1 = ids[0], ids[2]
    d0, d1 = handshake_and_read(ids)
    # Decode rank 0 talks to node 0, whose id is rank 0's: it works, which is why this bug hid.
    assert_read_from(d0, ids, 0)
    assert d0.connector.core.engines[(named, 0)].state is EngineState.CONNECTED
    # Decode rank 1 talks to node 1: its engine machine refuses the reply, typed, naming both ids.
    engine = d1.connector.core.engines[(named, 0)]
    assert engine.state is EngineState.FAILED
    assert isinstance(engine.error, EngineIdMismatch)
    assert (engine.error.expected, engine.error.got) == (named, node1)
    (refused,) = [rec for rec in d1.connector.core.log.records()
                  if rec.machine == "engine" and type(rec.event).__name__ == "HandshakeDone"]
    assert (refused.before, refused.state, refused.outcome, refused.fault) == (
        "HANDSHAKING", "FAILED", LogOutcome.APPLIED, Fault.REMOTE)
    assert refused.reason == str(engine.error) == (
        f"remote engine id mismatch: the request names {named!r}, the remote says {node1!r}")
    # The request is reported once, failed, with the recompute policy and its blocks invalid.
    assert d1.received == {"r1"}
    (handoff,) = d1.failed
    assert (handoff.request_id, handoff.outcome, handoff.policy) == ("r1", "failed", "recompute")
    assert set(handoff.invalid_blocks) == set(LOCAL_BLOCKS)
    assert named in handoff.reason and node1 in handoff.reason
    assert d1.transport.block(LOCAL_BLOCKS[0]) == bytes(D_BLOCK)  # nothing was read


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["tp", "world"])
def test_with_sync_every_rank_has_rank_0s_id_and_both_nodes_serve_reads(
    ranks: Reports, node_ids: tuple[str, str], scenario: str
) -> None:
    ids = ids_of(ranks, scenario)
    assert ids == [node_ids[0]] * WORLD
    for d, r in enumerate(handshake_and_read(ids)):
        assert_read_from(r, ids, d)
        engine = r.connector.core.engines[(ids[0], 0)]
        assert engine.state is EngineState.CONNECTED and engine.error is None


@pytest.mark.slow
def test_src_is_a_rank_of_the_group_and_each_group_gets_its_own_id(ranks: Reports, node_ids: tuple[str, str]) -> None:
    # Two TP-2 engines, one per node, each syncing over its own group from group rank 1.
    assert ids_of(ranks, "per_node_src1") == [f"{node_ids[0]}-rank1"] * 2 + [f"{node_ids[1]}-rank3"] * 2


@pytest.mark.slow
def test_the_longest_id_crosses_intact(ranks: Reports) -> None:
    assert ids_of(ranks, "longest") == [LONGEST] * WORLD  # 256 four-byte characters


# --- refusals: every rank raises, none is left waiting in a collective ---------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "culprit"), [("too_long_on_src", 0), ("too_long_on_rank3", 3)])
def test_a_too_long_id_on_one_rank_is_refused_on_every_rank(ranks: Reports, scenario: str, culprit: int) -> None:
    for r in range(WORLD):
        o = ranks[r][scenario]
        assert (o.error, o.field, o.engine_id) == ("InvalidInput", "engine_id", ""), o
        assert o.seconds < 10, "a rank waited on a collective"  # the group's timeout is 30 s
        if r == culprit:
            assert f"got {MAX_ID_CHARS + 1}" in o.message
        else:
            assert f"refused on group rank {culprit}" in o.message
    assert ids_of(ranks, "after") == [ids_of(ranks, "off")[0]] * WORLD  # still in step


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "says"), [("src_disagrees", "different sources"), ("src_outside", "0 to 3"),
                                                ("src_bool_tensor", "got tensor(True)")])
def test_bad_or_disagreeing_src_is_refused_on_every_rank(ranks: Reports, scenario: str, says: str) -> None:
    for r in range(WORLD):
        o = ranks[r][scenario]
        assert (o.error, o.field) == ("InvalidInput", "src") and says in o.message, o
        assert o.seconds < 10


# --- in this process: no torch.distributed --------------------------------------------------------


def test_new_engine_ids_are_random_and_bounded() -> None:
    a, b = new_engine_id(), new_engine_id("prefill")
    assert a != new_engine_id() and a.startswith("engine-") and b.startswith("prefill-")
    assert len(new_engine_id("p" * (MAX_ID_CHARS - 33))) == MAX_ID_CHARS
    with pytest.raises(InvalidInput, match="prefix"):
        new_engine_id("p" * (MAX_ID_CHARS - 32))


def test_sync_needs_an_initialized_process_group() -> None:
    with pytest.raises(InvalidInput, match="not initialized") as info:
        sync_engine_id("engine-1")
    assert info.value.field == "group"


def test_engine_config_without_sync() -> None:
    cfg = engine_config(sync=False, tp_size=4, compat_hash="h")
    assert cfg.engine_id.startswith("engine-") and (cfg.tp_size, cfg.compat_hash) == (4, "h")
    assert engine_config("P", sync=False).engine_id == "P"
    with pytest.raises(InvalidInput, match="engine_id"):
        engine_config("x" * (MAX_ID_CHARS + 1), sync=False)
    with pytest.raises(InvalidInput, match="fields"):
        engine_config("P", sync=False, no_such_field=1)


def test_importing_pdfsm_does_not_import_torch() -> None:
    code = "import sys, pdfsm.enginesync, pdfsm.connector; assert 'torch' not in sys.modules, 'torch imported'"
    env = child_env()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


HUGE = 10**5000  # str() refuses integers over 4300 digits


def test_integers_of_any_size_are_digested_by_value() -> None:
    """Scenario: fingerprints over Python's 4300-digit str() limit. Expected: a digest, which tells
    n, n + 1 and -n apart. Before: str(n) raised ValueError, before the vote, on that rank only."""
    digests = {_digest(HUGE), _digest(HUGE + 1), _digest(-HUGE), _digest(0), _digest(-1), _digest(1 << 62)}
    assert len(digests) == 6 and all(0 <= d < 1 << 62 for d in digests)


def test_the_layout_digest_takes_integers_by_value_and_says_why_it_cannot_be_taken() -> None:
    """Scenario: layout fields with an integer over 4300 digits, a numpy integer, a repr() that
    raises. Expected: a digest for the first two (numpy's 16 counts as 16), and for the last the
    reason naming the field (voted as refused, never raised). Before: ValueError from repr() of
    the huge one and the RuntimeError of the bad repr, before the vote; np.int64(16) != 16."""

    class BadRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    base = _layout_fingerprint({"block_size": 16})
    assert isinstance(base, int) and base == _layout_fingerprint({})
    assert _layout_fingerprint({"block_size": np.int64(16)}) == base
    huge = _layout_fingerprint({"block_size": HUGE})
    assert isinstance(huge, int) and huge not in {base, _layout_fingerprint({"block_size": HUGE + 1})}
    assert _layout_fingerprint({"compat_hash": "16"}) != _layout_fingerprint({"compat_hash": 16})
    why = _layout_fingerprint({"compat_hash": BadRepr()})
    assert isinstance(why, str) and "compat_hash cannot be compared" in why and "no repr" in why


@pytest.mark.parametrize(("buffer", "says"), [
    (bytes(4 + MAX_ID_BYTES), "length of 0 bytes"),
    (struct.pack("!I", MAX_ID_BYTES + 1) + bytes(MAX_ID_BYTES), f"length of {MAX_ID_BYTES + 1} bytes"),
    (struct.pack("!I", 2) + b"\xff\xfe" + bytes(MAX_ID_BYTES - 2), "UnicodeDecodeError"),
])
def test_a_garbled_broadcast_buffer_is_an_engine_sync_error(buffer: bytes, says: str) -> None:
    """Scenario: the broadcast buffer a rank reads carries a length out of range or bad UTF-8
    (collectives out of step). Expected: EngineSyncError naming the broadcast and the group rank.
    Before: a bare PdfsmError, or a UnicodeDecodeError."""
    with pytest.raises(EngineSyncError, match=says) as info:
        _unpack(buffer, 2)
    assert (info.value.step, info.value.group_rank) == ("broadcast", 2)
