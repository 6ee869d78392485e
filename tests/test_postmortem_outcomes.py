"""`pdfsm replay` / `report` for an on-call engineer: outcome counts, time units, `--at` with
`--request`, logs of two runs merged, and a file that is not a log (review of the postmortem tooling).

Logs come from `pdfsm demo-sim --log-dir` (real FileSink logs) or from a core driven here."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from helpers import collect, ev, handshake, make_core, read, run_cli, run_cli_captured, write_worker_log

from pdfsm.commands import HandOff
from pdfsm.events import (
    AbortRequested,
    BlocksHeld,
    HandleDone,
    HandleFailed,
    HandleFailure,
    NotificationReceived,
    Tick,
)
from pdfsm.filelog import MAGIC, read_log, segment_name, segment_paths, write_segment
from pdfsm.log import MemorySink
from pdfsm.replay import duration, offsets, render, summarize, time_unit


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli_captured(capsys, *argv)


def _sim(root: Path, fault: str) -> Path:
    assert run_cli("demo-sim", "--log-dir", str(root), "--fault", fault, "--prefill-tp", "2", "--decode-tp", "2",
                   "--quiet") == 0
    return root


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """read-error and read-hang runs (req-3 fails on one decode rank, recomputed); a second
    read-error run, the same engine ids and ranks, for the two-runs case."""
    d = tmp_path_factory.mktemp("sims")
    return {name: _sim(d / name, fault) for name, fault in
            (("read-error", "read-error"), ("read-hang", "read-hang"), ("read-error-2", "read-error"))}


# --- 1. outcomes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["read-error", "read-hang"])
def test_a_failed_request_is_counted_in_text_json_and_report(sims: dict[str, Path], fault: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The demo says "1 failed (recomputed)"; replay said `consumer RELEASED 16`, `violations: 0`,
    `not terminal: 0` for every log, as for a clean run. Now each log says how its requests ended,
    and the counts add up to what the demo did: 31 received and 1 failed over the two decode ranks,
    32 released by notification over the two prefill ranks."""
    code, out, _ = _run(capsys, "replay", str(sims[fault]), "--timelines", "0")
    assert code == 0
    finished = re.findall(r"^  finished  consumer: received (\d+), failed (\d+) \(policy recompute\), aborted (\d+)$",
                          out, re.M)
    assert len(finished) == 2, out  # one line per decode log
    assert [sum(int(f[i]) for f in finished) for i in range(3)] == [31, 1, 0]
    assert re.findall(r"^  finished  producer: released by notification 16, expired 0$", out, re.M) == [
        "  finished  producer: released by notification 16, expired 0"] * 2
    code, out, _ = _run(capsys, "replay", str(sims[fault]), "--json")
    logs = json.loads(out)["logs"]
    decode = [log["outcomes"] for log in logs if log["name"].startswith("decode")]
    prefill = [log["outcomes"] for log in logs if log["name"].startswith("prefill")]
    assert sorted((o["received"], o["failed"], o["aborted"], o["notify_only"]) for o in decode) == [
        (15, 1, 0, 0), (16, 0, 0, 0)]
    assert all(o["failure_policy"] == "recompute" for o in decode + prefill)
    assert [(o["released"], o["expired"], o["discarded"]) for o in prefill] == [(16, 0, 0)] * 2
    assert run_cli("report", str(sims[fault]), "-o", str(tmp_path / "r.html")) == 0
    page = (tmp_path / "r.html").read_text()
    assert "<th>finished requests</th>" in page
    assert "consumer: received 15, failed 1 (policy recompute), aborted 0" in page


def _decode_life(sink: MemorySink) -> list[HandOff]:
    """One received, one failed, one aborted and one notify-only request; the hand-offs made."""
    d = make_core(strict=False, sink=sink, policy="fail")
    d.apply(read("ok", t=1_000))
    handshake(d, t=2_000)
    d.apply(read("bad", t=3_000))
    d.apply(read("gone", t=3_500))
    d.apply(read("hit", blocks=(), remote_blocks=(), t=3_600))  # nothing to read: a full prefix hit
    d.apply(ev(HandleDone, 4_000, request_id="ok", pp_rank=0, tp_rank=0))
    d.apply(ev(HandleFailed, 5_000, request_id="bad", pp_rank=0, tp_rank=0, why=HandleFailure.ERR))
    d.apply(ev(AbortRequested, 5_500, request_id="gone"))
    d.apply(ev(HandleDone, 6_000, request_id="gone", pp_rank=0, tp_rank=0))
    cmds = d.take_commands() + collect(d, 7_000)
    d.log.flush()
    return [c for c in cmds if isinstance(c, HandOff)]


def test_outcomes_are_the_hand_offs_the_core_made(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Commands are not logged: the counts are read off the records. They must agree with the
    HandOff commands the core emitted, and a request with nothing to read (released without a
    hand-off) is counted apart; the policy is the log's config's, here "fail"."""
    sink = MemorySink()
    offs = _decode_life(sink)
    got = summarize(sink.records).finished["consumer"]
    assert Counter({o.outcome: 1 for o in offs}) == Counter(received=1, failed=1, aborted=1)
    assert got == Counter(received=1, failed=1, aborted=1, notify_only=1)
    log = write_worker_log(tmp_path / "decode-tp0", sink.records)
    code, out, _ = _run(capsys, "replay", str(log), "--timelines", "0")
    assert code == 0
    assert "  finished  consumer: received 1, failed 1 (policy fail), aborted 1, notify-only 1\n" in out
    # --at cuts the counts as it cuts the states: before the Collect nothing was handed back
    collect_seq = next(r.seq for r in sink.records if type(r.event).__name__ == "Collect")
    code, out, _ = _run(capsys, "replay", str(log), "--at", str(collect_seq - 1), "--json")
    assert json.loads(out)["logs"][0]["outcomes"]["received"] == 0


def test_producer_outcomes_expired_and_discarded() -> None:
    """A lease that ran out is "expired"; a notification for a request never registered, dropped
    once staged a lease, is "discarded" (shown only when it happened)."""
    sink = MemorySink()
    p = make_core(strict=False, sink=sink, engine_id="P", lease_ns=1_000_000)
    p.apply(ev(BlocksHeld, 1_000, request_id="a", block_ids=(1,)))
    p.apply(ev(BlocksHeld, 2_000, request_id="b", block_ids=(2,)))
    p.apply(ev(NotificationReceived, 3_000, request_id="a", part=0, of=1))
    p.apply(ev(NotificationReceived, 4_000, request_id="stray", part=0, of=1))
    p.apply(ev(Tick, 5_000_000))
    p.apply(ev(Tick, 10_000_000))
    p.log.flush()
    s = summarize(sink.records)
    assert s.finished["producer"] == Counter(released=1, expired=1, discarded=1)
    assert "  finished  producer: released by notification 1, expired 1, discarded 1" in list(render(s))


# --- 2. time units ------------------------------------------------------------------------------------


def test_short_logs_print_times_in_a_unit_that_shows_them() -> None:
    """Logs whose t_ns are small printed every time as `+0.000 ms` and their span as `0.0 ms`."""
    assert time_unit(17_000_000) == ("ms", 1_000_000, 3)
    assert [offsets(5_000)(t) for t in (0, 4, 1_500)] == ["+   0.000 us", "+   0.004 us", "+   1.500 us"]
    assert [offsets(120)(t) for t in (0, 3, 120)] == ["+       0 ns", "+       3 ns", "+     120 ns"]
    assert offsets(3_000_369_079)(3_000_369_079) == "+3000.369 ms"  # long logs as before
    assert offsets(5_000, pad=False)(1_500) == "+1.500 us"
    # A log of hours: every offset as wide as the last, so a timeline's column still lines up.
    long = offsets(12_345_678_000_000)
    assert [long(t) for t in (0, 12_345_678_000_000)] == ["+       0.000 ms", "+12345678.000 ms"]
    assert [duration(n) for n in (110_500_000, 17_002, 120)] == ["110.5 ms", "17.0 us", "120 ns"]
    sink = MemorySink()
    p = make_core(strict=False, sink=sink, engine_id="P")
    p.apply(ev(BlocksHeld, 10, request_id="a", block_ids=(1,)))
    p.apply(ev(NotificationReceived, 13, request_id="a", part=0, of=1))
    p.log.flush()
    lines = list(render(summarize(sink.records)))
    assert lines[0].endswith(", 13 ns")
    steps = [line.split("#")[0].strip() for line in lines if re.match(r"\s+\+", line)]
    assert steps == ["+       0 ns", "+       3 ns"]


def test_a_request_timeline_of_a_short_run_shows_distinct_times(sims: dict[str, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "replay", str(sims["read-error"]), "--request", "req-3")
    assert code == 0
    lines = out.split("request 'req-3':", 1)[1].splitlines()[1:]
    times = [m.groups() for line in lines if (m := re.match(r"  \+ *([\d.]+) (\w+) ", line))]
    assert len(times) == len(lines) > 3
    assert {unit for _, unit in times} == {"us"}
    assert len({value for value, _ in times}) > 3  # not every one "+0.000 ms"


# --- 3 and 4. --at ------------------------------------------------------------------------------------


def test_at_cuts_the_request_timeline(sims: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """`--request req-3 --at 10` said "up to seq 10" for the machines but printed req-3's records
    past seq 10 (its failure at #12, its hand-off at #16)."""
    logs = sims["read-error"]
    code, out, _ = _run(capsys, "replay", str(logs), "--request", "req-3", "--at", "10")
    assert code == 0
    entries = out.split("request 'req-3':", 1)[1].splitlines()[1:]
    seqs = [int(m[1]) for line in entries if (m := re.search(r" #(\d+) ", line))]
    assert seqs and max(seqs) <= 10
    assert "HandleFailed" not in "\n".join(entries)
    assert re.search(r"^decode-tp0: replayed, no divergence: 11 records up to seq 10$", out, re.M)
    code, out, _ = _run(capsys, "replay", str(logs), "--request", "req-3", "--at", "decode-tp0:10", "--json")
    entries_json = json.loads(out)["request"]["entries"]
    assert all(e["seq"] <= 10 for e in entries_json if e["log"] == "decode-tp0")
    assert any(e["seq"] > 10 for e in entries_json if e["log"] == "decode-tp1")  # the others: to their end
    code, out, _ = _run(capsys, "replay", str(logs), "--request", "req-3", "--at", "2")
    assert code == 0  # it is in the logs, only later: not "in none of the logs" (exit 2)
    assert out.endswith("request 'req-3': producer 'req-3' in prefill-tp0, 'req-3' in prefill-tp1; consumer "
                        "'d-req-3' in decode-tp0, 'd-req-3' in decode-tp1\n"
                        "  (none of its records is at or before --at)\n")


def test_at_past_the_end_says_so_in_text_and_json(sims: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    logs = sims["read-error"]
    last = read_log(logs / "decode-tp0")[-1].seq
    code, out, _ = _run(capsys, "replay", str(logs / "decode-tp0"), "--at", "99999", "--request", "d-req-3")
    assert code == 0
    assert out.count(f"(--at 99999: the log ends at seq {last})") == 1
    code, out, _ = _run(capsys, "replay", str(logs / "decode-tp0"), "--at", "99999", "--json")
    log = json.loads(out)["logs"][0]
    assert code == 0 and log["at_note"] == f"--at 99999: the log ends at seq {last}" and log["last_seq"] == last
    code, out, _ = _run(capsys, "replay", str(logs / "decode-tp0"), "--at", "5", "--json")
    assert json.loads(out)["logs"][0]["at_note"] is None
    trimmed = tmp_path / "trimmed"
    trimmed.mkdir()
    records = read_log(logs / "prefill-tp0")
    write_segment(trimmed / segment_name(10), records[10:], salt=bytes(8), meta={},
                  wall_ns=0, mono_ns=0)
    code, out, _ = _run(capsys, "replay", str(trimmed), "--at", "3", "--json")
    log = json.loads(out)["logs"][0]
    assert code == 0 and log["at_note"].startswith("--at 3: the log starts at seq 10")
    assert log["outcomes"]["failure_policy"] is None  # its Started record is gone


# --- 5. two runs merged -----------------------------------------------------------------------------


def test_logs_of_two_runs_merged_into_one_request_are_warned_about(sims: dict[str, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs with the same engine ids: `--request req-3` merged both runs' records into one
    timeline without a word. One warning line now names the logs of each worker seen twice."""
    code, out, _ = _run(capsys, "replay", str(sims["read-error"]), str(sims["read-error-2"]), "--request", "req-3")
    assert code == 0
    warnings = [line for line in out.splitlines() if line.startswith("  warning: ")]
    assert len(warnings) == 1, warnings
    for worker in ("decode-tp0", "decode-tp1", "prefill-tp0", "prefill-tp1"):
        assert f"{worker}, {worker}#2 (engine " in warnings[0]
    assert out.splitlines().index(warnings[0]) == out.splitlines().index(
        next(line for line in out.splitlines() if line.startswith("request 'req-3':"))) + 1
    code, out, _ = _run(capsys, "replay", str(sims["read-error"]), str(sims["read-error-2"]), "--request", "req-3",
                        "--json")
    assert json.loads(out)["request"]["warnings"] == [warnings[0].removeprefix("  warning: ")]
    code, out, _ = _run(capsys, "replay", str(sims["read-error"]), "--request", "req-3")
    assert "warning" not in out
    code, out, _ = _run(capsys, "replay", str(sims["read-error"]), "--request", "req-3", "--json")
    assert json.loads(out)["request"]["warnings"] == []


@pytest.mark.parametrize(("issued_at", "warned"), [(60_000_000_000, True), (1_000_000, False)])
def test_a_decode_log_and_a_prefill_log_of_different_runs_are_warned_about(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], issued_at: int, warned: bool) -> None:
    """The decode log of one run and the prefill logs of another, named together: the ids recur
    from run to run, so `--request p-1` told one story of both (the consumer reading 32 s after
    the producer's hold expired; found by a helper's review). The params' issue time names the
    hold: one no followed prefill log made (beyond its hold_skew_ns, 5 s) is warned about; the
    same run's (a skew within it) is not."""
    base = 1_700_000_000_000_000_000
    sink = MemorySink()
    producer = make_core(sink=sink, engine_id="P")
    producer.apply(ev(BlocksHeld, request_id="p-1", block_ids=(1, 2), issued_wall_ns=base))
    producer.log.flush()
    write_worker_log(tmp_path / "prefill-tp0", sink.records)
    sink = MemorySink()
    consumer = make_core(sink=sink)
    consumer.apply(read("d-1", remote="p-1", issued_wall_ns=base + issued_at, lease_ns=120_000_000_000))
    consumer.log.flush()
    write_worker_log(tmp_path / "decode-tp0", sink.records)
    code, out, _ = _run(capsys, "replay", str(tmp_path / "prefill-tp0"), str(tmp_path / "decode-tp0"),
                        "--request", "p-1", "--json")
    warnings = json.loads(out)["request"]["warnings"]
    assert code == 0 and len(warnings) == int(warned), warnings
    if warned:
        assert "a hold that prefill-tp0 never made: logs of different runs named together?" in warnings[0]


def test_a_prefill_log_that_held_the_id_again_later_made_the_hold_all_the_same(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A producer that held p-1, released it and held the id again (reuse is supported): the
    params of the second hold are followed. No warning: one of the log's holds matches (found by
    review: any far hold warned)."""
    base = 1_700_000_000_000_000_000
    sink = MemorySink()
    producer = make_core(sink=sink, engine_id="P", tombstones=0)
    producer.apply(ev(BlocksHeld, request_id="p-1", block_ids=(1, 2), issued_wall_ns=base))
    producer.apply(ev(NotificationReceived, request_id="p-1", part=0, of=1, issued_wall_ns=base))
    producer.apply(ev(BlocksHeld, request_id="p-1", block_ids=(3, 4), issued_wall_ns=base + 600_000_000_000))
    producer.log.flush()
    write_worker_log(tmp_path / "prefill-tp0", sink.records)
    sink = MemorySink()
    consumer = make_core(sink=sink)
    consumer.apply(read("d-1", remote="p-1", issued_wall_ns=base + 600_000_000_000, lease_ns=120_000_000_000))
    consumer.log.flush()
    write_worker_log(tmp_path / "decode-tp0", sink.records)
    code, out, _ = _run(capsys, "replay", str(tmp_path / "prefill-tp0"), str(tmp_path / "decode-tp0"),
                        "--request", "p-1", "--json")
    assert code == 0 and json.loads(out)["request"]["warnings"] == [], out


# --- 6. a file that is not a log -------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"see prefill logs\n", b"meeting notes: " * 100, bytes(range(1, 256)) * 50])
def test_a_file_that_is_no_log_at_all_is_exit_6(content: bytes, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """docs/postmortem.md: 6 is "no log", 4 is damage to a log. A text file named by mistake was
    exit 4 "corrupt"; with no segment header and no frame in it, it is no log. trace agrees."""
    notes = tmp_path / "text.txt"
    notes.write_bytes(content)
    code, out, err = _run(capsys, "replay", str(notes))
    assert code == 6, out + err
    assert "NO LOG" in out and "not a pdfsm log" in err and "CORRUPT" not in out
    code, _, err = _run(capsys, "trace", str(notes), "-o", str(tmp_path / "t.json"))
    assert code == 6 and "(exit 6)" in err
    code, out, _ = _run(capsys, "replay", str(notes), "--json")
    assert json.loads(out)["logs"][0]["status"] == "no_log"
    assert notes.read_bytes() == content


def test_a_log_damaged_at_its_start_stays_corrupt(sims: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A segment whose magic was hit still holds good frames: a damaged log (4), not "no log"."""
    seg = segment_paths(sims["read-error"] / "decode-tp0")[0]
    data = bytearray(seg.read_bytes())
    assert data.startswith(MAGIC)
    data[0] ^= 0xFF
    damaged = tmp_path / "decode-tp0"
    damaged.mkdir()
    (damaged / seg.name).write_bytes(bytes(data))
    code, out, _ = _run(capsys, "replay", str(damaged))
    assert code == 4 and "CORRUPT" in out and "bad magic" in out
    frame_only = tmp_path / "frames.bin"  # the header cut off: frames alone, still a log's bytes
    frame_only.write_bytes(bytes(data[data.index(b"PDFB"):]))
    code, out, _ = _run(capsys, "replay", str(frame_only))
    assert code == 4, out
