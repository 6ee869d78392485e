"""Review of round 15: the engine address check, the Connector's per-block load tracking, and the
file log's chain-link rule for damage inside a claimed payload."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from filelog_writer import row
from helpers import collect, ev, make_core, read, reply
from test_field_regressions import World

from pdfsm.commands import DropPeer, HandOff, PostRead, SendNotification, StartHandshake
from pdfsm.connector import Connector, ConnectorMetadata, KVTransferParams
from pdfsm.core import Core
from pdfsm.errors import InvalidInput
from pdfsm.events import CoreConfig, HandleDone, HandshakeDone, HandshakeFailed, PeerAdded, PeerDisconnected
from pdfsm.filelog import CorruptLogError, LogReader, TornTailError, read_log, recover, segment_paths
from pdfsm.filesink import FileSink, FsyncPolicy
from transports.sim import ReadScript, SimHandshaker, SimTransport, pattern

# --- helpers -----------------------------------------------------------------------------------


def _hand_offs(core: Core, step: int = 1) -> dict[str, str]:
    return {c.request_id: c.outcome for c in collect(core, step=step) if isinstance(c, HandOff)}


def _pp_handshake(core: Core, pp: int, attempt: int, *, pp_size: int = 2) -> None:
    core.apply(ev(HandshakeDone, engine_id="P", pp_rank=pp, attempt=attempt,
                  reply=reply("P", pp_rank=pp, pp_size=pp_size)))
    core.apply(ev(PeerAdded, engine_id="P", pp_rank=pp, attempt=attempt))


def _connected_at(port: int, *, host: str = "h") -> Core:
    """A core whose engine P (PP 1) was handshaken at host:port by one completed request."""
    core = make_core(strict=False)
    core.apply(read("warm", host=host, port=port))
    _pp_handshake(core, 0, 1, pp_size=1)
    core.apply(ev(HandleDone, request_id="warm", pp_rank=0, tp_rank=0))
    assert _hand_offs(core, step=0) == {"warm": "received"}
    core.take_commands()
    return core


def _two_engines_sharing_id() -> tuple[World, KVTransferParams, KVTransferParams]:
    w = World()
    pa = w.producer("PA-0", "P", 9)
    pb = w.producer("PB-0", "P", 10)
    w.d.load("da", [5, 6], pa.request_finished("pa1", [1, 2]))
    w.run(3)
    assert w.received == ["da"] and w.d.core.engines[("P", 0)].port == 9
    return w, pa.request_finished("pa2", [3]), pb.request_finished("pb1", [2, 3])



# --- the address check: what a request naming another address may not do ----------------------------


def test_notify_only_params_naming_another_address_never_notify_the_engine_connected_elsewhere() -> None:
    """A full-prefix-hit request of the engine at port 10 must not notify the engine at port 9 that
    shares its id (decisions.md: it never notifies an engine of a request it does not hold)."""
    w, _, params_b = _two_engines_sharing_id()
    pa = w.producers["PA-0"][0]
    w.d.load("dn", [], params_b)
    w.run(3)
    assert "pb1" not in pa.core.producers, "the engine at port 9 was told about port 10's request"


def test_notify_only_request_joining_a_handshake_at_another_address_sends_it_nothing() -> None:
    """A notify-only request for port 10 that joins a handshake started at port 9 is not sent there."""
    core = make_core(strict=False)
    core.apply(read("a", host="h", port=9))
    core.apply(read("n", host="h", port=10, blocks=(), remote_blocks=()))
    core.take_commands()
    _pp_handshake(core, 0, 1, pp_size=1)
    notes = [c.notification.request_id for c in core.take_commands() if isinstance(c, SendNotification)]
    assert "p-n" not in notes


def test_heartbeat_for_params_naming_another_address_tells_no_rank() -> None:
    """heartbeat() counts the ranks told; the engine connected at port 9 is not the producer of params
    naming port 10, so telling it extends nobody's lease and must not be counted (nor sent)."""
    w, _, params_b = _two_engines_sharing_id()
    pa = w.producers["PA-0"][0]
    told = w.d.heartbeat(params_b, 10**9)
    w.run(2)
    assert told == 0, "a heartbeat to another engine was counted as extending this request's lease"
    assert "pb1" not in pa.core.producers


# --- the address check: refusals, holds, evictions -----------------------------------------------------


def test_other_address_while_a_read_holds_the_engine_fails_then_evicts_when_the_read_lets_go() -> None:
    """Held by a read: the request fails and nothing is evicted yet (the eviction is owed); when the
    read lets go the engine is evicted, and the next request handshakes at the new address; no
    reader count leaks. (Before the owed eviction, the first request after the read failed too.)"""
    core = _connected_at(9)
    core.apply(read("r1", host="h", port=9))
    assert [type(c) for c in core.take_commands()] == [PostRead]
    for rid in ("r2", "r3"):
        core.apply(read(rid, host="h", port=10))
        assert core.consumers[rid].state.name == "FAILED" and "h:10" in core.consumers[rid].error
        assert not [c for c in core.take_commands() if isinstance(c, DropPeer)]
    e = core.engines[("P", 0)]
    assert e.state.name == "CONNECTED" and e.readers == 1
    core.apply(ev(HandleDone, request_id="r1", pp_rank=0, tp_rank=0))
    assert e.readers == 0 and ("P", 0) not in core.engines
    assert [type(c) for c in core.take_commands() if isinstance(c, DropPeer)] == [DropPeer]
    assert _hand_offs(core) == {"r1": "received", "r2": "failed", "r3": "failed"}
    core.apply(read("r4", host="h", port=10))
    (start,) = core.take_commands()
    assert isinstance(start, StartHandshake) and (start.host, start.port) == ("h", 10)


def test_pp2_engines_handshaken_at_one_address_serve_requests_at_it() -> None:
    """Every PP rank is handshaken at the request's one address: later requests there read, others fail."""
    core = make_core(strict=False, supports_pp=True)
    core.apply(read("r1", host="h", port=9, remote_pp=2))
    starts = [(c.pp_rank, c.host, c.port) for c in core.take_commands() if isinstance(c, StartHandshake)]
    assert starts == [(0, "h", 9), (1, "h", 9)]
    _pp_handshake(core, 0, 1)
    _pp_handshake(core, 1, 1)
    core.apply(read("r2", host="h", port=9, remote_pp=2, blocks=(3, 4), remote_blocks=(3, 4)))
    core.apply(read("r3", host="h", port=10, remote_pp=2, blocks=(5, 6), remote_blocks=(5, 6)))
    assert core.consumers["r2"].state.name == "READING" and core.consumers["r3"].state.name == "FAILED"
    for rid in ("r1", "r2"):
        for pp in (0, 1):
            core.apply(ev(HandleDone, request_id=rid, pp_rank=pp, tp_rank=0))
    assert _hand_offs(core) == {"r1": "received", "r2": "received", "r3": "failed"}
    assert all(e.readers == 0 and e.state.name == "CONNECTED" for e in core.engines.values())


def test_pp2_ranks_left_at_two_addresses_fail_both_requests_then_heal_without_leaking_holds() -> None:
    """A request at port 10 re-handshakes a lost PP rank that a port-9 request then joins: both fail
    at ready, nothing stays held, and the next request at port 9 handshakes both ranks again there
    and reads (before the re-handshake of idle contradicted engines, it was refused too)."""
    core = make_core(strict=False, supports_pp=True)
    core.apply(read("w", host="h", port=9, remote_pp=2))
    _pp_handshake(core, 0, 1)
    _pp_handshake(core, 1, 1)
    for pp in (0, 1):
        core.apply(ev(HandleDone, request_id="w", pp_rank=pp, tp_rank=0))
    _hand_offs(core, step=0)
    core.take_commands()
    core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=1, attempt=1))
    core.apply(read("a", host="h", port=9, remote_pp=2))  # holds pp 0, waits for pp 1
    core.apply(ev(PeerDisconnected, engine_id="P", pp_rank=0, attempt=1))
    core.apply(read("b", host="h", port=10, remote_pp=2, blocks=(3, 4), remote_blocks=(3, 4)))
    _pp_handshake(core, 1, 2)
    _pp_handshake(core, 0, 2)
    assert _hand_offs(core, step=2) == {"a": "failed", "b": "failed"}
    assert all(e.readers == 0 and not e.waiters for e in core.engines.values())
    core.take_commands()
    core.apply(read("c", host="h", port=9, remote_pp=2, blocks=(5, 6), remote_blocks=(5, 6)))
    assert core.consumers["c"].state.name == "HANDSHAKING"
    core.apply(read("d", host="h", port=9, remote_pp=2, blocks=(7, 8), remote_blocks=(7, 8)))
    starts = [(c.pp_rank, c.port) for c in core.take_commands() if isinstance(c, StartHandshake)]
    assert starts == [(0, 9), (1, 9)]  # every connected stage of the plan, not the contradicted one only
    for pp in (0, 1):
        _pp_handshake(core, pp, core.engines[("P", pp)].attempt)
    assert core.consumers["c"].state.name == core.consumers["d"].state.name == "READING"


def test_failed_handshake_retried_at_a_new_address_is_checked_against_the_new_one() -> None:
    """After a failed handshake at port 9, the retry at port 10 connects there: port 10 reads, 9 fails."""
    core = make_core(strict=False, handshake_retry_ns=0)
    core.apply(read("r1", host="h", port=9))
    core.take_commands()
    core.apply(ev(HandshakeFailed, engine_id="P", pp_rank=0, attempt=1, error="refused"))
    core.apply(read("r2", host="h", port=10, t=1))
    (start,) = [c for c in core.take_commands() if isinstance(c, StartHandshake)]
    assert start.port == 10
    _pp_handshake(core, 0, start.attempt, pp_size=1)
    core.apply(read("r3", host="h", port=10, blocks=(3,), remote_blocks=(3,)))
    core.apply(read("r4", host="h", port=9, blocks=(4,), remote_blocks=(4,)))
    assert core.consumers["r3"].state.name == "READING" and core.consumers["r4"].state.name == "FAILED"


def test_producer_that_moved_is_read_at_its_new_address_end_to_end() -> None:
    """Two live engines named P (ports 9 and 10): a switch while no read holds the connection costs
    one handshake (before: one refused request as well), and every request reported received
    holds the bytes of the engine its params named."""
    w, params_a2, params_b = _two_engines_sharing_id()
    pb = w.producers["PB-0"][0]
    w.d.load("db", [7, 8], params_b)
    w.run(3)
    w.d.load("dc", [9, 10], pb.request_finished("pb2", [3, 4]))
    w.run(4)
    assert w.received == ["da", "db", "dc"] and not w.failed
    assert w.cons.block(9) == pattern("PB-0", 3, 64) and w.cons.block(10) == pattern("PB-0", 4, 64)
    w.d.load("dd", [11], params_a2)
    w.run(4)
    assert w.received[-1] == "dd" and not w.failed and w.d.core.engines[("P", 0)].port == 9


# --- the Connector's per-block load tracking ----------------------------------------------------------


def test_blocks_of_every_kind_of_finished_load_are_loadable_again_once_reported() -> None:
    """Refused (address), failed (no such engine), aborted mid-read and received: once get_finished
    reported each, a load into the same blocks is accepted; before that it is refused."""
    w, params_a2, params_b = _two_engines_sharing_id()
    pa = w.producers["PA-0"][0]
    w.net.script("hung", 0, 0, ReadScript(end="hang"))
    w.d.load("hung", [23], params_a2)
    w.run(1)
    w.d.load("refused", [20, 21], params_b)  # the hung read holds the connection to PA: refused
    w.d.load("nobody", [22], {"lease_ns": 60_000_000_000,
                              "remote_engine_id": "X", "remote_request_id": "x1", "remote_host": "h",
                              "remote_port": 77, "remote_block_ids": [1], "remote_tp_size": 1})
    w.run(2)
    with pytest.raises(InvalidInput, match="local_block_ids"):
        w.d.load("early", [23], pa.request_finished("pa-early", [4]))
    w.d.abort("hung")
    w.run(4)
    assert {"refused", "nobody"} <= set(w.failed)
    assert "hung" not in w.d.core.consumers or w.d.core.consumers["hung"].state.name == "RELEASED"
    for i, block in enumerate((20, 21, 22, 23, 5, 6)):
        w.d.load(f"again{i}", [block], pa.request_finished(f"pa-again{i}", [i]))
    w.run(4)
    assert {f"again{i}" for i in range(6)} <= set(w.received)


def test_a_step_refused_whole_for_a_shared_block_leaves_every_block_free() -> None:
    """start_load_kv refusing a step (two loads into one block) records no block as being written."""
    w, params_a2, params_b = _two_engines_sharing_id()
    pa = w.producers["PA-0"][0]
    meta = ConnectorMetadata(reqs_to_recv={"e1": ((31,), params_a2), "e2": ((30, 31), params_b)})
    with pytest.raises(InvalidInput):
        w.d.start_load_kv(meta)
    w.d.load("e1", [31], params_a2)
    w.run(3)
    assert "e1" in w.received
    w.d.load("e3", [31], pa.request_finished("pa3", [3]))


def test_one_block_reused_by_many_requests_in_turn_is_never_refused() -> None:
    """Two blocks handed from request to request right after each is reported, 300 times."""
    w, _, _ = _two_engines_sharing_id()
    pa = w.producers["PA-0"][0]
    for i in range(300):
        w.d.load(f"r{i}", [40, 41], pa.request_finished(f"p{i}", [1, 2]))
        for _ in range(4):
            if f"r{i}" in w.d.get_finished()[1]:
                break
        else:
            raise AssertionError(f"r{i} never reported")
        pa.get_finished()


def test_shutdown_reports_a_hung_load_with_its_block_invalid() -> None:
    """shutdown() aborts a hung read and reports it once, its block invalid."""
    w, params_a2, _ = _two_engines_sharing_id()
    w.net.script("hung", 0, 0, ReadScript(end="hang"))
    w.d.load("hung", [50], params_a2)
    w.run(2)
    out = w.d.shutdown()
    assert "hung" in out.finished_recving and 50 in out.invalid_block_ids


# --- the file log: the chain-link rule -----------------------------------------------------------------


def _one_segment_log(directory: Path) -> tuple[Path, bytes, int, int]:
    with FileSink(directory, batch_records=4, fsync=FsyncPolicy.never()) as sink:
        for i in range(20):
            sink.write([row(s) for s in range(4 * i, 4 * i + 4)])
    (seg,) = segment_paths(directory)
    frames = [fr for _, fr in LogReader(seg).frames()]
    return seg, seg.read_bytes(), frames[10].offset, frames[10].end


def _flip(data: bytes, *bits: tuple[int, int]) -> bytes:
    out = bytearray(data)
    for byte, bit in bits:
        out[byte] ^= 1 << bit
    return bytes(out)


@pytest.mark.parametrize("fields", [
    "crc", "length low bit", "length high bit", "prev_crc", "crc and length low bit", "length zeroed",
])
def test_damage_to_one_header_field_of_a_middle_frame_of_the_last_segment_is_corruption(
        tmp_path: Path, fields: str) -> None:
    """Valid, chained frames follow the damage: CorruptLogError, and recovery changes nothing."""
    seg, data, o, _ = _one_segment_log(tmp_path / "log")
    damaged = {
        "crc": _flip(data, (o + 4, 0)),
        "length low bit": _flip(data, (o + 8, 0)),
        "length high bit": _flip(data, (o + 11, 7)),
        "prev_crc": _flip(data, (o + 16, 0)),
        "crc and length low bit": _flip(data, (o + 4, 0), (o + 8, 0)),
        "length zeroed": data[:o + 8] + bytes(4) + data[o + 12:],
    }[fields]
    seg.write_bytes(damaged)
    with pytest.raises(CorruptLogError):
        read_log(tmp_path / "log")
    with pytest.raises(CorruptLogError):
        recover(tmp_path / "log")
    assert seg.read_bytes() == damaged


@pytest.mark.parametrize("fields", ["crc bit and length high bit", "crc bit and length bit 20", "crc and length 0xff"])
def test_damage_to_crc_and_length_of_a_middle_frame_is_corruption_not_a_torn_tail(tmp_path: Path,
                                                                                   fields: str) -> None:
    """Nine intact, chained frames follow the damaged one: recovery must not cut them off as a torn tail."""
    seg, data, o, _ = _one_segment_log(tmp_path / "log")
    damaged = {
        "crc bit and length high bit": _flip(data, (o + 4, 0), (o + 11, 7)),
        "crc bit and length bit 20": _flip(data, (o + 4, 0), (o + 10, 4)),
        "crc and length 0xff": data[:o + 4] + b"\xff" * 8 + data[o + 12:],
    }[fields]
    seg.write_bytes(damaged)
    kind = "corrupt"
    try:
        read_log(tmp_path / "log")
    except TornTailError:
        kind = "torn tail"
    except CorruptLogError:
        pass
    assert kind == "corrupt", "damage followed by 9 valid frames (36 records) read as a torn tail"


def test_bytes_lost_inside_a_frame_with_later_frames_intact_is_corruption(tmp_path: Path) -> None:
    """A hole inside one frame's payload (later frames shifted) is corruption: they chain to it."""
    seg, data, o, end = _one_segment_log(tmp_path / "log")
    seg.write_bytes(data[:o + 60] + data[end:])
    with pytest.raises(CorruptLogError):
        read_log(tmp_path / "log")


# --- the file log: reopening --------------------------------------------------------------------------


def test_reopening_with_read_only_segments_and_a_torn_copy_appends_contiguously(tmp_path: Path) -> None:
    """The reopen fsync opens segments read-only: read-only files and a .torn backup do not stop it."""
    directory = tmp_path / "log"
    with FileSink(directory, batch_records=4, fsync=FsyncPolicy.never()) as sink:
        sink.write([row(s) for s in range(10)])
    (seg,) = segment_paths(directory)
    seg.write_bytes(seg.read_bytes()[:-5])
    again = FileSink(directory)
    assert again.recovery.repairs and any(p.name.endswith(".torn.0") for p in directory.iterdir())
    n = again.recovery.next_seq
    again.write([row(s) for s in range(n, 12)])
    again.close()
    for path in segment_paths(directory):
        os.chmod(path, 0o444)
    with FileSink(directory, fsync=FsyncPolicy.always()) as third:
        third.write([row(s) for s in range(12, 15)])
    assert read_log(directory) == [row(s) for s in range(15)]


# --- input the Connector refuses by name (review of its entry points) -----------------------------


def test_a_hold_naming_one_block_twice_is_held_and_read_as_its_table_says() -> None:
    """A review took ``request_finished("p1", [5, 5])`` for a scheduler's bug (two local blocks get
    block 5's bytes). It is not: vLLM's block tables repeat its null block (block 0, for positions a
    sliding window or a hybrid model skips), and tests/test_layout_bytes.py moves such tables byte
    for byte. A repeated remote id is read into each local position that pairs with it; repeated
    *local* ids stay refused (two reads would race to write one block)."""
    w = World()
    p = w.producer("P-0", "P", 9)
    params = p.request_finished("p1", [5, 5, 6])
    w.d.load("d1", [10, 11, 12], params)
    w.run()
    assert "d1" in w.received and w.released == ["p1"]
    assert all(w.cons.block(lb) == pattern("P-0", rb, 64) for lb, rb in zip([10, 11, 12], [5, 5, 6], strict=True))
    with pytest.raises(InvalidInput, match="local_block_ids: a block id is repeated"):
        w.d.load("d2", [13, 13], p.request_finished("p2", [7, 8]))


def test_strings_no_log_record_could_carry_are_refused_by_name() -> None:
    """A lone surrogate in ``compat_hash`` was accepted, and the log lost its first record (the
    config replay starts from): the log could not be replayed at all; in ``remote_incarnation`` the
    load's record was lost (found by review). Both are refused before anything is accepted, as every
    id already was."""
    w = World()
    with pytest.raises(InvalidInput, match="compat_hash: must be valid Unicode"):
        Connector(CoreConfig(engine_id="X", compat_hash="model-\udc80"), SimTransport(w.net, "X-0"),
                  SimHandshaker(w.net))
    p = w.producer("P-0", "P", 9)
    params = p.request_finished("p1", [5]).to_dict() | {"remote_incarnation": "inc-\udc80"}
    with pytest.raises(InvalidInput, match="remote_incarnation: must be valid Unicode"):
        w.d.load("d1", [10], params)
    assert not w.d.core.consumers and not w.d.core.log.inbox


# --- addresses and leases no read could use (found by a helper's hunt, 2026-11-28) -----------------


def _consumer(**cfg: object) -> tuple[Connector, KVTransferParams]:
    from transports.sim import SimNetwork

    net = SimNetwork()
    producer = Connector(CoreConfig(engine_id="P", compat_hash="h"), SimTransport(net, "P-0"), SimHandshaker(net),
                         port=9)
    consumer = Connector(CoreConfig(engine_id="D", compat_hash="h", **cfg), SimTransport(net, "D-0"),  # type: ignore[arg-type]
                         SimHandshaker(net))
    return consumer, producer.request_finished("p-1", [1, 2])


@pytest.mark.parametrize(("host", "why"), [("0.0.0.0", "names every interface"), ("::", "names every interface"),
                                           ("0", "names every interface"), ("0x0", "names every interface"),
                                           ("::ffff:0.0.0.0", "names every interface"),
                                           ("[::1]", "without brackets")])
def test_params_naming_no_reachable_listener_are_refused_where_they_are_minted_and_loaded(host: str, why: str) -> None:
    """Dynamo issue 4855 / SGLang PR 10389: a wildcard address names no listener (a consumer
    dialling 0.0.0.0 reaches its own host: another engine's listener there answered, and the
    request failed as an engine-id mismatch), and a bracketed IPv6 literal no host ("Name or
    service not known"). Refused where params are minted (``request_finished``, naming ``host``:
    a consumer-only worker may still be built with its bind address) and by ``load`` (a router's
    params, naming ``remote_host``); the old IPv4 spellings of 0.0.0.0 too. A plain IPv6 literal
    and a host name are fine."""
    from transports.sim import SimNetwork

    net = SimNetwork()
    worker = Connector(CoreConfig(engine_id="P", compat_hash="h"), SimTransport(net, "P-0"), SimHandshaker(net),
                       host=host, port=9)  # built: it may only ever load
    with pytest.raises(InvalidInput, match=why) as err:
        worker.request_finished("p-1", [1, 2])
    assert err.value.field == "host" and "p-1" not in worker.core.producers
    consumer, params = _consumer()
    with pytest.raises(InvalidInput, match=why) as err:
        consumer.load("r", [3, 4], {**params.to_dict(), "remote_host": host})
    assert err.value.field == "remote_host"
    for blocks, fine in (([3, 4], "::1"), ([5, 6], "prefill-0.cluster.local")):
        consumer.load(f"r-{fine}", blocks, {**params.to_dict(), "remote_host": fine, "remote_request_id": f"p-{fine}"})


def test_a_load_whose_lease_is_not_longer_than_the_margin_is_refused_naming_lease_ns() -> None:
    """SGLang issues 10110/10204 (mis-scaled timeouts failed every request with an opaque
    message): params whose lease is not longer than this worker's ``lease_margin_ns`` can never
    be trusted (a read must end that long before the lease), so every such request failed at once
    with "the producer's lease may already have run out". Refused at the load instead, naming
    ``lease_ns`` and both figures; a notify-only load of them (nothing to trust) still tells."""
    consumer, params = _consumer(lease_margin_ns=2_000_000_000)
    short = {**params.to_dict(), "lease_ns": 2_000_000_000}
    with pytest.raises(InvalidInput, match=r"2000000000 ns in the params, not longer than .*lease_margin_ns") as err:
        consumer.load("r", [3, 4], short)
    assert err.value.field == "lease_ns" and "r" not in consumer.core.consumers
    consumer.load("r", [], short)  # notify-only
    consumer.load("r2", [3, 4], {**short, "lease_ns": 2_000_000_001, "remote_request_id": "p-2"})
