"""A user's-eye review of the race tester (docs/race-testing.md) and of the postmortem CLI
(docs/postmortem.md, docs/replay-json.md) on logs from ``pdfsm demo-sim``: the docs followed
literally, a bug planted the way they suggest, and every documented promise checked from outside."""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import collect, ev, handshake, make_core, read, replay_json_schema, run_cli
from hypothesis import settings

from pdfsm import consumer as C
from pdfsm.core import Tables
from pdfsm.events import BlocksHeld, HandleFailed, HandleFailure, NotificationReceived
from pdfsm.filelog import FORMAT_VERSION, read_log, segment_name, segment_paths, write_segment
from pdfsm.fsm import Go, TableError, on
from pdfsm.log import MemorySink, Record
from pdfsm.replay import machine_key
from pdfsm.testing import Scenario, Variant, World, hunt
from pdfsm.testing.explore import replay_choices
from pdfsm.testing.plugin import Race

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ("none", "read-error", "read-hang", "drop-notification", "duplicate-notification")
INITIAL = {"consumer": "NEW", "producer": "NEW", "engine": "UNKNOWN"}
EVIL = "<script>alert(\"x'y\")</script>"


# --- the race tester: a bug planted the way the docs suggest ---------------------------------------------


def _no_join() -> Variant:
    """My policy with a bug: a failed read ends the request although its sibling read still runs."""
    cells = on(C.S.READING, HandleFailed, C._not_in_flight_illegal, Go(C.S.FAILED, C._last_stopped))
    return Variant(id="no-join", summary="a failed read does not wait for its siblings",
                   tables=Tables(consumer=C.TABLE.patched("no-join", cells)))


NO_JOIN = Scenario(requests=1, producer_tp=2, faults=frozenset({"read-err"}))


def every_request_received(world: World) -> None:
    """The docs' own example invariant (stricter than pdfsm's)."""
    for (rank, rid), offs in world.hand_offs.items():
        if offs[0].outcome != "received":
            world.fail(f"D{rank}: {rid} was {offs[0].outcome}")


DOC_SCENARIO = Scenario(requests=2, faults=frozenset({"read-err"}))


def _printed_steps(message: str) -> list[str]:
    """The numbered lines right after "after N chosen steps (M in all):", up to the first that is not one."""
    lines = re.split(r" steps \(\d+ in all\):\n", message, maxsplit=1)[1].splitlines()
    steps = []
    for line in lines:
        m = re.match(r"\s*\d+\. (.+)$", line)
        if m is None:
            break
        steps.append(m[1])
    return steps


def test_race_testing_doc_snippets_run_as_written(tmp_path: Path) -> None:
    """Both python snippets of docs/race-testing.md run (the `{...}` placeholder filled with no cells)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "race-testing.md").read_text(), re.S)
    assert len(blocks) == 2
    first: dict[str, Any] = {}
    exec(blocks[0], first)
    settings(max_examples=5, derandomize=True, database=None, deadline=None)(first["test_two_requests_across_tp"])()
    second: dict[str, Any] = {}
    exec(blocks[1].replace("{...}", "{}"), second)
    with pytest.raises(pytest.fail.Exception) as failed:
        second["test_my_policy"](Race(tmp_path, 300))
    assert str(failed.value).startswith("D0: r0 was failed\nafter ")  # as the docs' sample failure reads
    assert (tmp_path / "counterexample" / "D0").is_dir()


def test_patched_tables_are_checked_and_keep_the_machine_name() -> None:
    """`Table.patched` returns a checked copy under the machine's own name, as the docs say."""
    table = _no_join().tables
    assert table is not None and table.consumer.name == "consumer" and table.consumer.variant == "no-join"
    with pytest.raises(TableError, match="unguarded"):
        C.TABLE.patched("bad", on(C.S.READING, HandleFailed, Go(C.S.FAILED, when=C._siblings_in_flight)))


def test_planted_bug_is_found_shrunk_written_and_replay_names_the_planted_cell(
        race: Race, capsys: pytest.CaptureFixture[str]) -> None:
    """The race fixture fails with shrunk steps and a log path; `pdfsm replay` on it exits 3 at the
    record the planted cell decided and lists the violation it caused."""
    variant = _no_join()
    found = race.hunt(NO_JOIN, variant, max_examples=60)
    assert found.found and found.world is not None
    assert len(found.world.chosen) <= 5, found.world.chosen
    with pytest.raises(pytest.fail.Exception) as failed:
        race.check(NO_JOIN, variant, max_examples=60)
    message = str(failed.value)
    assert message.split("\n\ncounterexample logs", 1)[0] == found.message  # same search, same counterexample
    logs = Path(message.rsplit("counterexample logs (pdfsm replay them): ", 1)[1].strip())
    assert logs == race.directory / "counterexample"
    assert sorted(p.name for p in logs.iterdir()) == ["D0", "P0.0", "P0.1"]
    capsys.readouterr()
    assert run_cli("replay", str(logs), "--timelines", "0") == 3
    out, err = capsys.readouterr()
    seq = int(re.search(r"D0: DIVERGENCE.*\n.*\n  error: divergence at seq (\d+): state differs", out)[1])  # type: ignore[index]
    planted = next(r for r in read_log(logs / "D0") if r.seq == seq)
    assert (planted.machine, planted.before, type(planted.event)) == ("consumer", "READING", HandleFailed)
    assert "[local] consumer 'r0': HandleDone rejected: completion for a read that is not in flight" in out
    assert out.count("replayed, no divergence") == 2 and "D0: divergence at seq" in err


def test_minimized_counterexample_cannot_lose_any_chosen_step() -> None:
    """'minimize removes steps by name until no single step can go': each chosen step is needed."""
    for scenario, variant, invariants in ((NO_JOIN, _no_join(), []), (DOC_SCENARIO, None, [every_request_received])):
        found = hunt(scenario, variant, invariants, max_examples=60)
        assert found.found and found.world is not None
        chosen = found.world.chosen
        assert replay_choices(chosen, scenario, variant, invariants)[1]
        for i in range(len(chosen)):
            assert not replay_choices(chosen[:i] + chosen[i + 1:], scenario, variant, invariants)[1], chosen[i]


def test_every_step_of_the_printed_counterexample_is_needed() -> None:
    """The failure message is 'the shrunk steps'; dropping any one printed step must make it pass (or
    the message must tell the chosen steps from those the world took while settling)."""
    found = hunt(NO_JOIN, _no_join(), max_examples=60)
    assert found.found and found.world is not None
    printed = _printed_steps(found.message)
    assert printed[:len(found.world.chosen)] == found.world.chosen
    needless = [step for i, step in enumerate(printed)
                if replay_choices(printed[:i] + printed[i + 1:], NO_JOIN, _no_join())[1]]
    assert not needless, f"printed as part of the counterexample, yet not needed: {needless}"


def test_same_search_gives_the_same_counterexample_byte_for_byte(tmp_path: Path) -> None:
    """Derandomized: two hunts print the same steps and dump identical log files."""
    runs = [hunt(NO_JOIN, _no_join(), max_examples=60) for _ in range(2)]
    assert all(r.world is not None for r in runs)
    assert runs[0].message == runs[1].message and runs[0].examples == runs[1].examples
    dirs = [tmp_path / "a", tmp_path / "b"]
    for run, d in zip(runs, dirs, strict=True):
        assert run.world is not None
        run.world.dump(d)
    files = sorted(p.relative_to(dirs[0]) for p in dirs[0].rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(dirs[1]) for p in dirs[1].rglob("*") if p.is_file())
    assert all((dirs[0] / f).read_bytes() == (dirs[1] / f).read_bytes() for f in files)


def test_ci_hypothesis_profile_is_derandomized_with_a_fixed_budget() -> None:
    """tests/conftest.py's `ci` profile: fixed seed, 200 examples, no database; loaded unless told otherwise."""
    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.max_examples == 200 and ci.database is None and ci.deadline is None
    assert "HYPOTHESIS_PROFILE" not in (ROOT / ".ci" / "run").read_text()  # CI gets the default: ci
    if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci":
        now = settings()
        assert (now.derandomize, now.max_examples, now.database) == (True, 200, None)


def test_a_passing_race_check_writes_nothing(race: Race) -> None:
    """No counterexample, no files under the test's tmp_path."""
    race.check(Scenario(requests=1, producer_tp=2, faults=frozenset({"read-err"})), max_examples=30)
    assert list(race.directory.iterdir()) == []


def test_pdfsm_race_examples_sets_the_fixture_budget(monkeypatch: pytest.MonkeyPatch,
                                                     request: pytest.FixtureRequest) -> None:
    """`PDFSM_RACE_EXAMPLES=N` sets the `race` fixture's budget."""
    monkeypatch.setenv("PDFSM_RACE_EXAMPLES", "7")
    race = request.getfixturevalue("race")
    assert isinstance(race, Race) and race.examples == 7


def test_a_prefix_step_that_is_never_enabled_is_refused() -> None:
    """A misspelled step in `Scenario.prefix` (a written-down interleaving) should be an error, not
    silently skipped, which turns a deep search into a search from the root."""
    typo = Scenario(requests=1, faults=frozenset(), prefix=("prefill: p0 finishes prefil",))
    with pytest.raises(ValueError, match="not enabled"):
        hunt(typo, max_examples=3)


# --- the postmortem CLI on demo-sim logs -----------------------------------------------------------------


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """demo-sim logs for each planted fault (and none)."""
    out = {}
    for fault in FAULTS:
        d = tmp_path_factory.mktemp(fault)
        extra = () if fault == "none" else ("--fault", fault)
        assert run_cli("demo-sim", "--requests", "4", "--log-dir", str(d), "--quiet", *extra) == 0
        out[fault] = d
    return out


def _write(records: list[Record], dest: Path) -> Path:
    dest.mkdir(parents=True)
    write_segment(dest / segment_name(records[0].seq), records, salt=bytes(8),
                  meta={"worker": dest.name}, wall_ns=0, mono_ns=0, batch_records=4)
    return dest


@pytest.fixture(scope="module")
def damaged(sim: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Copies of a decode log: torn, divergent, corrupt, unsupported, trimmed; and a missing one."""
    base = tmp_path_factory.mktemp("damaged")
    records = read_log(sim["read-error"] / "decode-tp0")
    out = {"missing": base / "missing"}
    for name in ("torn", "torn-repair", "corrupt", "unsupported"):
        out[name] = _write(records, base / name)
    for name in ("torn", "torn-repair"):
        seg = segment_paths(out[name])[0]
        with open(seg, "r+b") as f:
            f.truncate(seg.stat().st_size - 5)
    i = next(i for i, r in enumerate(records) if r.state == "NOTIFIED")
    out["divergent"] = _write([*records[:i], msgspec.structs.replace(records[i], state="READING"),
                               *records[i + 1:]], base / "divergent")
    seg = segment_paths(out["corrupt"])[0]
    data = bytearray(seg.read_bytes())
    data[[m.start() for m in re.finditer(b"PDFB", data)][1] + 60] ^= 0xFF
    seg.write_bytes(data)
    seg = segment_paths(out["unsupported"])[0]
    data = bytearray(seg.read_bytes())
    struct.pack_into("<H", data, 8, FORMAT_VERSION + 1)
    seg.write_bytes(data)
    out["trimmed"] = _write(records[6:], base / "trimmed")
    return out


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run_cli(*argv)
    out, err = capsys.readouterr()
    return code, out, err


def _key(rec: Record) -> str:
    key = machine_key(rec)
    return json.dumps(list(key) if isinstance(key, tuple) else key)


def test_at_every_seq_shows_each_machine_as_the_records_left_it(sim: dict[str, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`--at LOG:SEQ` for every seq (first, last, derived records): each machine's state and the
    record that put it there, computed independently from the records; the summary is cut there."""
    logs = sim["drop-notification"]
    derived = 0
    for name in ("decode-tp0", "prefill-tp0"):
        records = read_log(logs / name)
        mine: dict[tuple[str, str], tuple[str, int | None]] = {}
        for rec in records:
            derived += rec.cause is not None
            if rec.machine != "core":
                k = (rec.machine, _key(rec))
                state, since = mine.get(k, (INITIAL[rec.machine], None))
                mine[k] = (rec.state, since if rec.state == state else rec.seq)
            code, out, _ = _run(capsys, "replay", str(logs), "--json", "--at", f"{name}:{rec.seq}", "--timelines", "50")
            assert code == 0
            log = next(entry for entry in json.loads(out)["logs"] if entry["name"] == name)
            assert log["at"] == rec.seq and log["last_seq"] == rec.seq
            got = {(m["machine"], json.dumps(m["key"])): (m["state"], m["since_seq"]) for m in log["machines"]}
            assert got == mine, (name, rec.seq)
            assert all(v["seq"] <= rec.seq for v in log["violations"])
            assert all(s["seq"] <= rec.seq for t in log["timelines"] for s in t["steps"])
            assert {(s["machine"], json.dumps(s["key"])) for s in log["stuck"]} == {
                k for k, (state, _) in mine.items() if k[0] != "engine" and state not in ("RELEASED", "EXPIRED",
                                                                                           "DISCARDED")}
    assert derived >= 1  # a LeaseExpired derived from a Tick was among the seqs


def test_at_out_of_range_and_malformed(sim: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Past the end: the end is shown and said; a malformed or unknown --at is exit 2 with nothing on stdout."""
    logs = sim["read-error"]
    code, out, _ = _run(capsys, "replay", str(logs), "--json")
    end = {log["name"]: log for log in json.loads(out)["logs"]}
    code, out, _ = _run(capsys, "replay", str(logs), "--json", "--at", "100000")
    assert code == 0
    for log in json.loads(out)["logs"]:
        assert log["at"] == 100000 and log["last_seq"] == end[log["name"]]["last_seq"]
        assert log["states"] == end[log["name"]]["states"] and log["machines"]
    code, out, _ = _run(capsys, "replay", str(logs), "--at", "decode-tp0:100000", "--timelines", "0")
    last = end["decode-tp0"]["last_seq"]
    assert code == 0 and f"(--at 100000: the log ends at seq {last})" in out and f"machines at seq {last}" in out
    for bad in ("-1", "x", "decode-tp0:", "decode-tp0:abc", "nosuch:1", "decode-tp0:1.5", "\u00b2"):
        code, out, err = _run(capsys, "replay", str(logs), f"--at={bad}")
        assert code == 2 and out == "" and err.startswith("pdfsm replay: --at"), bad


def test_of_several_at_the_last_one_counts(sim: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """'of several bare SEQs, or several for one log, the last one counts'."""
    code, out, _ = _run(capsys, "replay", str(sim["none"]), "--json", "--at", "3", "--at", "decode-tp0:9",
                        "--at", "5", "--at", "decode-tp0:7")
    assert code == 0
    assert {log["name"]: log["at"] for log in json.loads(out)["logs"]} == {
        "decode-tp0": 7, "prefill-tp0": 5, "prefill-tp1": 5}


ENUMS: dict[str, set[str | None]] = {"status": {"ok", "torn_tail", "divergence", "corrupt", "unsupported", "no_log"},
         "outcome": {"applied", "ignored", "rejected"}, "fault": {"local", "remote", None}}


def _type_errors(value: Any, kind: str, where: str, schema: dict[str, dict[str, str]]) -> Iterator[str]:
    if kind.endswith(" or null"):
        if value is None:
            return
        kind = kind.removesuffix(" or null")
    if kind.startswith("array of "):
        if not isinstance(value, list):
            yield f"{where}: not an array: {value!r}"
            return
        inner, with_log = kind.removeprefix("array of ").removesuffix(" (with `log`)"), kind.endswith("(with `log`)")
        for i, item in enumerate(value):
            entry = item
            if with_log and isinstance(item, dict):
                entry = dict(item)
                if not isinstance(entry.pop("log", None), str):
                    yield f"{where}[{i}].log: not a string"
            yield from _type_errors(entry, inner, f"{where}[{i}]", schema)
        return
    simple: dict[str, type] = {"int": int, "string": str, "bool": bool, "object": dict}
    if kind in simple:
        cls = simple[kind]
        if not isinstance(value, cls) or (cls is int and isinstance(value, bool)):
            yield f"{where}: {value!r} is not {kind}"
    elif kind == "key":
        if not (value is None or isinstance(value, str) or (isinstance(value, list) and len(value) == 2
                                                             and isinstance(value[0], str) and type(value[1]) is int)):
            yield f"{where}: {value!r} is not a key"
    elif kind in schema:
        if not isinstance(value, dict) or list(value) != list(schema[kind]):
            yield f"{where}: fields {list(value) if isinstance(value, dict) else value!r} != {list(schema[kind])}"
            return
        for name, t in schema[kind].items():
            if name in ENUMS and value[name] not in ENUMS[name]:
                yield f"{where}.{name}: {value[name]!r} not documented"
            yield from _type_errors(value[name], t, f"{where}.{name}", schema)
    else:
        yield f"{where}: the docs name an unknown type {kind!r}"


def test_json_fields_have_the_documented_types_in_every_status(sim: dict[str, Path], damaged: dict[str, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Every object has exactly its documented fields with the documented types (docs/replay-json.md),
    for each status, with --request, --at, --repair; exit codes agree with the process's."""
    schema = replay_json_schema()
    cases: list[tuple[int, list[str]]] = [
        (0, [str(sim["drop-notification"]), "--request", "d-req-3", "--at", "4", "--timelines", "20"]),
        (0, [str(sim["duplicate-notification"]), "--request", "req-3", "--at", "prefill-tp0:7"]),
        (0, [str(sim["read-hang"]), str(sim["read-error"])]),
        (0, [str(damaged["torn"])]), (0, [str(damaged["torn-repair"]), "--repair"]),
        (0, [str(damaged["trimmed"]), "--at", "2"]),
        (3, [str(damaged["divergent"])]), (4, [str(damaged["corrupt"])]), (5, [str(damaged["unsupported"])]),
        (6, [str(damaged["missing"])]), (2, [str(sim["none"]), "--request", "no-such-request"]),
        (4, [str(damaged["corrupt"]), str(damaged["divergent"])]),
    ]
    per_status = {"ok": 0, "torn_tail": 0, "divergence": 3, "corrupt": 4, "unsupported": 5, "no_log": 6}
    seen = set()
    for expected, argv in cases:
        code, out, _ = _run(capsys, "replay", *argv, "--json")
        doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
        assert code == expected == doc["exit_code"], argv
        assert doc["schema"] == 1 and doc["tool"] == "pdfsm replay"
        errors = list(_type_errors(doc, "Document", "doc", schema))
        assert not errors, (argv, errors[:5])
        for log in doc["logs"]:
            seen.add(log["status"])
            assert log["exit_code"] == per_status[log["status"]]
            assert (log["error"] is None) == (log["status"] in ("ok", "torn_tail"))
            assert all(isinstance(v, (str, int, float, bool)) for v in log["meta"].values())
    assert seen == set(per_status)


def test_json_mode_prints_a_document_for_a_usage_error(sim: dict[str, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`--json` 'prints one JSON document on stdout' with `exit_code` 2 among its values: an unknown
    --request gets one; an unknown --at log should too, not an empty stdout."""
    code, out, _ = _run(capsys, "replay", str(sim["none"]), "--json", "--request", "nope")
    assert code == 2 and json.loads(out)["exit_code"] == 2
    code, out, _ = _run(capsys, "replay", str(sim["none"]), "--json", "--at", "nosuch:1")
    assert code == 2
    assert out.strip(), "nothing on stdout: a script's json.loads fails"
    assert json.loads(out)["exit_code"] == 2


def test_json_lists_every_violation_whatever_the_limit(sim: dict[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """--limit cuts the text listing only; `violations` in --json is every record with a fault."""
    code, text, _ = _run(capsys, "replay", str(sim["drop-notification"]), "--limit", "0", "--timelines", "0")
    assert code == 0 and "[remote]" not in text
    code, out, _ = _run(capsys, "replay", str(sim["drop-notification"]), "--limit", "0", "--json")
    (violation,) = [v for log in json.loads(out)["logs"] for v in log["violations"]]
    assert violation["event"] == "LeaseExpired" and violation["fault"] == "remote" and violation["cause"] is not None


def test_trace_is_valid_chrome_trace_json_for_every_planted_fault(sim: dict[str, Path], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Strict JSON; well-formed events; slices on one track never overlap; timestamps are the records'
    t_ns in microseconds; open slices are exactly the last, non-terminal ones; the summary counts them."""
    for fault, logs in sim.items():
        path = tmp_path / f"{fault}.json"
        code, out, _ = _run(capsys, "trace", str(logs), "-o", str(path))
        assert code == 0
        doc = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
        events = doc["traceEvents"]
        assert doc["displayTimeUnit"] in ("ms", "ns")
        records = {pid: {r.seq: r for r in read_log(logs / name)}
                   for pid, name in enumerate(doc["otherData"]["logs"], start=1)}
        slices: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for e in events:
            assert type(e["pid"]) is int and type(e["tid"]) is int and isinstance(e["name"], str)
            assert isinstance(e.get("args", {}), dict)
            if e["ph"] == "M":
                assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
                continue
            assert e["ph"] in ("X", "i") and isinstance(e["ts"], (int, float))
            if e["ph"] == "i":
                assert e["s"] in ("t", "p", "g")
                assert e["ts"] == records[e["pid"]][e["args"]["seq"]].event.t_ns / 1000
                continue
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            args = e["args"]
            assert e["ts"] == pytest.approx(records[e["pid"]][args["from_seq"]].event.t_ns / 1000)
            if args["to_seq"] is not None:
                assert e["ts"] + e["dur"] == pytest.approx(records[e["pid"]][args["to_seq"]].event.t_ns / 1000)
            slices.setdefault((e["pid"], e["tid"]), []).append(e)
        for track in slices.values():
            track.sort(key=lambda e: e["ts"])
            for a, b in itertools.pairwise(track):
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, (a, b)
                assert not a["args"]["open"]
        n_x, n_i = sum(e["ph"] == "X" for e in events), sum(e["ph"] == "i" for e in events)
        assert f"{len(records)} logs, {n_x} state slices, {n_i} instants" in out


def test_trace_and_report_exit_codes_as_documented(damaged: dict[str, Path], sim: dict[str, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """trace: only 4, 5, 6 (it does not replay); report: replay's code, the page written anyway, but
    for no log read at all (nothing to draw: neither writes a file); both 2 when -o cannot be
    written."""
    expect = {"divergent": (0, 3), "corrupt": (4, 4), "unsupported": (5, 5), "missing": (6, 6), "torn": (0, 0)}
    for name, (trace_code, report_code) in expect.items():
        trace, page = tmp_path / f"{name}.json", tmp_path / f"{name}.html"
        assert _run(capsys, "trace", str(damaged[name]), "-o", str(trace))[0] == trace_code, name
        assert _run(capsys, "report", str(damaged[name]), "-o", str(page))[0] == report_code, name
        if name == "missing":
            assert not trace.exists() and not page.exists()
        else:
            assert json.loads(trace.read_text())["traceEvents"] and "</html>" in page.read_text()
    nowhere = tmp_path / "no-such-dir"
    for tool in ("trace", "report"):
        code, _, err = _run(capsys, tool, str(sim["none"]), "-o", str(nowhere / "out"))
        assert code == 2 and f"pdfsm {tool}: cannot write" in err


def test_replay_first_failing_log_in_command_line_order_decides(damaged: dict[str, Path], sim: dict[str, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """'With several logs, the first failing log (in command-line order) decides'; a torn tail is no failure."""
    for order, code in ((("corrupt", "divergent"), 4), (("divergent", "corrupt"), 3), (("torn", "divergent"), 3),
                        (("missing", "unsupported"), 6), (("unsupported", "missing"), 5)):
        assert _run(capsys, "replay", *(str(damaged[n]) for n in order), "--timelines", "0")[0] == code, order
    assert _run(capsys, "replay", str(sim["none"]), str(damaged["torn"]), "--timelines", "0")[0] == 0


class _Page(HTMLParser):
    """Every tag, attribute, style text and text node of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attrs: list[tuple[str, str]] = []
        self.styles: list[str] = []
        self.text: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self._in_style = tag == "style"
        self.attrs += [(name, value or "") for name, value in attrs]

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        (self.styles if self._in_style else self.text).append(data)


def _self_contained(page: str) -> _Page:
    parsed = _Page()
    parsed.feed(page)
    parsed.close()
    fetching = {"script", "link", "img", "iframe", "object", "embed", "image", "use", "audio", "video", "source",
                "base", "form", "foreignobject", "feimage"}
    assert not parsed.tags & fetching, parsed.tags & fetching
    names = {name for name, _ in parsed.attrs}
    assert not {n for n in names if n in ("href", "src", "srcset", "xlink:href", "action", "background")
                or n.startswith("on")}, names
    for css in [*parsed.styles, *(v for _, v in parsed.attrs)]:
        assert "@import" not in css and not re.search(r"url\(\s*(?!#)", css), css
    assert not re.search(r"https?:|//[a-z0-9]", page.replace("</", ""), re.I)
    return parsed


def test_report_is_self_contained_for_every_planted_fault(sim: dict[str, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """No element or attribute that loads anything, no external URL, in any demo-sim report."""
    for fault, logs in sim.items():
        page = tmp_path / f"{fault}.html"
        assert _run(capsys, "report", str(logs), "-o", str(page))[0] == 0
        _self_contained(page.read_text(encoding="utf-8"))


def test_report_draws_flagged_rows_first_when_rows_are_limited(sim: dict[str, Path], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """'rows with a violation or left non-terminal are drawn first' when there are more than --rows."""
    page = tmp_path / "report.html"
    assert _run(capsys, "report", str(sim["drop-notification"]), "-o", str(page), "--rows", "1")[0] == 0
    timeline = page.read_text(encoding="utf-8").split('<svg id="timeline"', 1)[1].split("</svg>", 1)[0]
    labels = re.findall(r'<text x="4" [^>]*>([^<]*)</text>', timeline)
    assert labels == ["prefill-tp0 producer req-3"]
    assert "more rows not drawn (--rows)" in page.read_text(encoding="utf-8")


def _hostile_log(directory: Path) -> Path:
    """A log whose request ids, engine id, read error detail and notification sender hold markup and quotes."""
    sink = MemorySink()
    core = make_core(strict=False, sink=sink)
    engine = 'E"<i>'
    core.apply(read(EVIL, t=1_000, remote='p"' + EVIL, engine=engine))
    handshake(core, engine, t=2_000)
    core.apply(ev(HandleFailed, 5_000, request_id=EVIL, pp_rank=0, tp_rank=0, why=HandleFailure.ERR, detail=EVIL))
    collect(core, 6_000)
    core.apply(ev(BlocksHeld, 7_000, request_id=EVIL, block_ids=(1,)))
    for t in (8_000, 9_000):  # the second: a remote violation
        core.apply(ev(NotificationReceived, t, request_id=EVIL, part=0, of=1, sender=EVIL))
    core.apply(ev(BlocksHeld, 9_500, request_id="stuck'\"<b>", block_ids=(2,)))
    core.log.flush()
    return _write(sink.records, directory / ("w" + EVIL.replace("/", "|")))


def test_report_escapes_hostile_request_ids_and_log_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ids with <script> and quotes come out as text, never as markup or broken attributes; trace and
    replay --json carry them verbatim in valid JSON."""
    log = _hostile_log(tmp_path / "logs")
    page = tmp_path / "report.html"
    assert _run(capsys, "report", str(tmp_path / "logs"), "-o", str(page))[0] == 0
    parsed = _self_contained(page.read_text(encoding="utf-8"))
    text = "".join(parsed.text)
    assert EVIL in text and log.name in text and "stuck'\"<b>" in text
    trace = tmp_path / "trace.json"
    assert _run(capsys, "trace", str(log), "-o", str(trace))[0] == 0
    names = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["name"] == "thread_name"}
    assert f"producer {EVIL}" in names
    code, out, _ = _run(capsys, "replay", str(log), "--json", "--request", EVIL)
    doc = json.loads(out)
    assert code == 0 and doc["logs"][0]["name"] == log.name and doc["request"]["producer_ids"] == ['p"' + EVIL]
