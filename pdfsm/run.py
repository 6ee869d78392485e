"""A prefill engine and a decode engine in two OS processes over real NIXL, then their logs replayed.

This process plays the router and both schedulers: it asks the prefill engine
(:mod:`pdfsm.engines`) to prefill requests, hands each request's ``kv_transfer_params`` to
the decode engine, and collects what each reports. Each worker writes its event log; at
the end every log is read back, replayed (a divergence is an error) and summarized, and
the run checks that every request ended in a defined state, every byte read was the one
written, both block pools are whole again, failed requests came back with the failure policy
and their blocks reported invalid, and no illegal event was blamed on us (faults the machines
handled are the point of some runs: with ``--no-pp`` every request is refused as a local one).

Faults (``--fault``) show each failure path ending in a defined state:

- ``kill-prefill``: the prefill process is killed (SIGKILL) once it holds a request's KV and has
  handed the params on, before the decode side reads: the reads fail as the peer disconnected
  (a stop-then-kill sequence that aimed at reads already posted sometimes missed: UCX can
  finish a read from a stopped process's memory on its own, CMA needing nothing of the peer);
- ``drop-notification``: the notifications for request p-1 are lost (each prefill worker
  drops the first it gets), so its blocks are released by the lease (shortened for the run);
- ``forge-notification``: the producer gets a notification for a request it never had;
- ``wrong-engine-id``: the producer's listener answers with another engine id, as
  unsynced multi-node ids did (vLLM PR 39907);
- ``compat-hash``: the two engines run incompatible models.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from pdfsm.engine_messages import (
    HEADS,
    LEASE_MARGIN_S,
    MARK,
    NUM_BLOCKS,
    Finish,
    Forge,
    Load,
    Prefill,
    Result,
    read_lines,
)
from pdfsm.filelog import read_log
from pdfsm.log import Record
from pdfsm.postmortem import clear_demo_logs, worker_logs
from pdfsm.replay import render, replay, summarize
from pdfsm.topology import heads_problem

__all__ = ["Outcome", "UsageError", "add_arguments", "check_options", "check_sizes", "main", "run", "run_command"]

FAULTS = ("kill-prefill", "drop-notification", "forge-notification", "wrong-engine-id", "compat-hash")
LEASE_FAULTS = frozenset({"drop-notification", "forge-notification", "wrong-engine-id", "compat-hash"})
_decode_result = msgspec.json.Decoder(Result).decode
_encode = msgspec.json.Encoder().encode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=24, help="requests to hand off (24)")
    p.add_argument("--prefill-tp", type=int, default=2, help="prefill engine TP size (2)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode engine TP size (1)")
    p.add_argument("--prefill-pp", type=int, default=1, help="prefill engine PP size, one process per stage (1)")
    p.add_argument("--mla", action="store_true", help="replicated latent KV: a consumer rank reads one producer rank")
    p.add_argument("--kv-heads", type=int, default=None,
                   help=f"the model's KV heads (1 to {MAX_DEMO_HEADS}, default {HEADS}); a TP larger than them "
                        "holds copies, read once")
    p.add_argument("--no-pp", action="store_true", help="the decode transport cannot serve pp_rank > 0")
    p.add_argument("--max-blocks", type=int, default=6, help="blocks per request, at most (6)")
    p.add_argument("--in-flight", type=int, default=8, help="requests the driver keeps in flight at once (8)")
    p.add_argument("--fault", choices=FAULTS, action="append", default=[],
                   help="a failure to inject (repeatable; none by default): see the description above")
    p.add_argument("--abort", type=int, default=0, help="abort this many requests while their reads run (0)")
    p.add_argument("--lease-s", type=float, default=20.0,
                   help="seconds prefill holds a request's blocks unless told sooner (20)")
    p.add_argument("--seed", type=int, default=0,
                   help="the run's random seed: block counts, KV bytes, which requests abort (0)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="give up on the run after this long (120)")
    p.add_argument("--log-dir", help="each worker's event log goes in a subdirectory here")
    p.add_argument("--kv-device", default="cpu",
                   help="where both engines keep their KV caches: cpu (NIXL DRAM, default) or cuda[:N] (VRAM)")
    p.add_argument("--quiet", action="store_true", help="no per-request timelines at the end")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the replay")


class EngineError(RuntimeError):
    """An engine process died or went silent: the run cannot go on (its stderr is in the message)."""


class UsageError(ValueError):
    """Options the demo cannot run as asked (they are refused before any engine starts)."""


LAYERS = 4  # the demo model's layers, shared out over the prefill PP ranks
MAX_DEMO_HEADS = 64  # 64 heads on one rank: 16 MiB of KV per worker (NUM_BLOCKS x 4 layers x 256 B)
MAX_LEASE_S = 3600.0  # a demo lease of an hour is plenty; past it the engines' nanosecond config overflows


def check_sizes(args: argparse.Namespace, names: Iterable[str]) -> None:
    """Each option of ``names`` at least 1, and a TP pair the topology can plan (both demos)."""
    from pdfsm.topology import TopologyError, tp_ratio

    for name in names:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    try:
        tp_ratio(args.decode_tp, args.prefill_tp)
    except TopologyError as exc:
        raise UsageError(f"--prefill-tp {args.prefill_tp} --decode-tp {args.decode_tp}: {exc}") from None


def _kv_heads(args: argparse.Namespace) -> int:
    return HEADS if args.kv_heads is None else int(args.kv_heads)


def check_options(args: argparse.Namespace) -> None:
    """Refuse what could only fail or silently not do what was asked, naming the option."""
    check_sizes(args, ("requests", "prefill_tp", "decode_tp", "prefill_pp", "max_blocks", "in_flight"))
    if args.prefill_pp > LAYERS:
        raise UsageError(f"--prefill-pp {args.prefill_pp}: the demo model has {LAYERS} layers")
    if args.mla and args.kv_heads is not None:
        raise UsageError(f"--kv-heads {args.kv_heads} with --mla: MLA's latent is one head on every rank")
    heads = _kv_heads(args)
    if not 1 <= heads <= MAX_DEMO_HEADS:  # each engine allocates its KV pool for them up front
        raise UsageError(f"--kv-heads {heads}: 1 to {MAX_DEMO_HEADS} in the demo")
    for flag, tp in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        why = None if args.mla else heads_problem(tp, heads)  # (--mla: one latent head on every rank)
        if why is not None:
            raise UsageError(f"{flag} {tp} --kv-heads {heads}: {why} (or --mla)")
    if args.abort < 0:
        raise UsageError(f"--abort {args.abort}: a count of requests, at least 0")
    if not args.lease_s > LEASE_MARGIN_S:  # a read must end this long before the lease: none could
        raise UsageError(f"--lease-s {args.lease_s}: must be longer than the decode side's lease margin "
                         f"({LEASE_MARGIN_S:g} s)")
    if args.lease_s > MAX_LEASE_S:
        raise UsageError(f"--lease-s {args.lease_s}: at most {MAX_LEASE_S:g} s")
    held = {"compat-hash", "wrong-engine-id"} & set(args.fault)
    if held and args.requests * args.max_blocks > NUM_BLOCKS:  # nothing is read: every hold runs its lease
        raise UsageError(f"--fault {sorted(held)[0]}: every request's blocks stay held on the prefill side until "
                         f"its lease ends; --requests {args.requests} x --max-blocks {args.max_blocks} is more "
                         f"than the {NUM_BLOCKS} blocks of its KV pool")
    if "forge-notification" in args.fault and (held or (args.no_pp and args.prefill_pp > 1)):
        raise UsageError("--fault forge-notification needs a producer the decode side connects to; "
                         + (f"--fault {sorted(held)[0]}" if held else "--no-pp with --prefill-pp > 1") + " prevents it")
    if args.in_flight * args.max_blocks > NUM_BLOCKS:  # the router does not wait for free blocks
        raise UsageError(f"--in-flight {args.in_flight} x --max-blocks {args.max_blocks}: more than the "
                         f"{NUM_BLOCKS} blocks of each engine's KV pool")
    if args.log_dir is not None:
        _check_log_dir(Path(args.log_dir))
    # A fault needs requests to act on: kill-prefill strikes the third, the others the second;
    # --abort N aborts requests 1, 4, 7...
    least = max([3 if f == "kill-prefill" else 2 for f in args.fault] + [3 * args.abort - 1 if args.abort else 1])
    if args.requests < least:
        raise UsageError(f"--requests {args.requests}: {', '.join(args.fault) or '--abort'} needs at least {least}")


def _check_log_dir(path: Path) -> None:
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"--log-dir {path}: not a directory")
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"--log-dir {path}: not writable")
    except OSError as e:
        raise UsageError(f"--log-dir {path}: {e.strerror or e}") from None


class Engine:
    """A child engine process and the results it reports."""

    def __init__(self, role: str, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.role = role
        self.proc = subprocess.Popen([sys.executable, "-m", "pdfsm.engines", "--role", role, *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.results: queue.Queue[Result] = queue.Queue()
        self.stderr: deque[str] = deque(maxlen=20)  # its last words: a chatty engine fills no memory
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        self._stderr_done = threading.Thread(target=self._errors, args=(self.proc.stderr,), daemon=True)
        self._stderr_done.start()
        self.dead = False
        self.killed = False  # by the demo itself (--fault kill-prefill)
        self.ended_early = False  # exited on its own mid-run (already reported as a problem)

    def _read(self, out: IO[str]) -> None:
        mark = MARK.encode()
        for line in read_lines(out.buffer.read1):  # type: ignore[attr-defined]  # the text wrapper's bytes
            if line is not None and line.startswith(mark):
                try:
                    self.results.put(_decode_result(line[len(mark):]))
                # A broken result is the engine's error, not this thread's end (the run would wait for
                # results that no longer come): ValueError is msgspec's DecodeError and bad UTF-8 in a
                # string, RecursionError arrays nested too deep.
                except (ValueError, RecursionError) as exc:
                    self.results.put(Result(ev="error", reason=f"bad result line from the {self.role} engine: {exc}"))

    def _errors(self, err: IO[str]) -> None:
        for line in err:
            self.stderr.append(line.rstrip()[:4096])

    def send(self, op: Any) -> None:
        if self.dead or self.proc.poll() is not None:
            return
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(_encode(op).decode() + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.dead = True

    def wait_for(self, ev: str, timeout: float) -> Result:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = self.results.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if r.ev == ev:
                return r
        code = self.proc.poll()
        if code is not None:
            self._stderr_done.join(2.0)  # the reader may still hold the engine's last words
        tail = "\n".join(self.stderr)
        why = f"exited with code {code}" if code is not None else f"did not report {ev!r} in {timeout:.0f} s"
        raise EngineError(f"the {self.role} engine {why}:\n{tail}")

    def ended_by_itself(self) -> bool:
        """The process exited, and not because the run killed it."""
        return not self.killed and self.proc.poll() is not None

    def kill(self) -> None:
        self.dead = self.killed = True
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def exited(self) -> str:
        """How the engine ended, with the tail of what it said on stderr."""
        self._stderr_done.join(2.0)
        return f"the {self.role} engine exited with code {self.proc.returncode}:\n" + "\n".join(self.stderr)

    def reap(self, timeout: float) -> str | None:
        """Wait for the process to end (killed if it will not); what went wrong, if anything."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return f"the {self.role} engine did not exit within {timeout:.0f} s: killed"
        return None if code == 0 or self.killed or self.ended_early else self.exited()


@dataclass
class Outcome:
    """What a run did, for the summary, the tests and the soak's JSON."""

    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    bad_bytes: int = 0
    reasons: dict[str, str] = field(default_factory=dict)  # why each failed request failed
    released: int = 0
    expired: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    accounting: dict[str, Result] = field(default_factory=dict)
    logs: list[Path] = field(default_factory=list)
    records: dict[Path, list[Record]] = field(default_factory=dict)  # each log's, as read once
    divergent: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _engine_args(args: argparse.Namespace, role: str, log_dir: Path) -> list[str]:
    faults = set(args.fault)
    prefill = role == "prefill"
    lease = 3.0 if faults & LEASE_FAULTS else args.lease_s  # the run ends once the leases have
    tp = args.prefill_tp if prefill else args.decode_tp
    argv = ["--engine-id", "prefill" if prefill else "decode", "--tp", str(tp),
            "--pp", str(args.prefill_pp if prefill else 1), "--remote-pp", str(1 if prefill else args.prefill_pp),
            "--layers", str(LAYERS), "--lease-s", str(lease), "--log-dir", str(log_dir), "--kv-device", args.kv_device]
    argv += ["--mla"] if args.mla else ["--heads", str(_kv_heads(args))]
    if prefill:
        if "wrong-engine-id" in faults:
            argv += ["--reply-engine-id", "prefill-node1"]
        if "compat-hash" in faults:
            argv += ["--compat-hash", "another-model-v7"]
        if "drop-notification" in faults:
            argv += ["--drop-notification", "p-1"]
    elif args.no_pp:
        argv.append("--no-pp")
    return argv


def run(args: argparse.Namespace, *, show: bool = True) -> Outcome:
    """Run the two engines; returns what happened (``show`` prints progress and the replay)."""
    check_options(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdfsm-demo-"))
    out = Outcome()
    refused = clear_demo_logs(log_dir)
    if refused:
        out.problems.append(refused)
        if show:
            print(f"pdfsm demo: {refused}")
        return out
    start = time.monotonic()
    prefill = Engine("prefill", _engine_args(args, "prefill", log_dir))
    decode = Engine("decode", _engine_args(args, "decode", log_dir))
    try:
        prefill.wait_for("ready", 60)
        decode.wait_for("ready", 60)
        _drive(args, prefill, decode, out, show)
    finally:
        for eng in (prefill, decode):
            if eng.proc.poll() is None:  # after a failure nothing in flight will finish: no grace
                eng.send(Finish(grace_s=1.0 if out.problems else 10.0))
        for eng in (prefill, decode):
            try:
                if not eng.dead:
                    try:
                        out.accounting[eng.role] = eng.wait_for("accounting", 30)
                    except RuntimeError as exc:
                        out.problems.append(str(exc))
            finally:
                problem = eng.reap(30)
                if problem is not None:
                    out.problems.append(problem)
    out.seconds = time.monotonic() - start
    out.logs = worker_logs(log_dir)
    _check(args, out, prefill.dead)
    if show:
        _report(args, out)
    return out


class _Progress:
    """One line of progress: rewritten in place on a terminal, a line every 5 s otherwise."""

    def __init__(self, show: bool) -> None:
        self.show, self.tty = show, show and sys.stdout.isatty()
        self.last = 0.0
        self.line = ""
        self.in_flight = 0

    def update(self, line: str, *, now: bool = False) -> None:
        if not self.show or (not now and time.monotonic() - self.last < (0.5 if self.tty else 5.0)):
            return
        self.last, self.line = time.monotonic(), line
        print(f"\r{line}   " if self.tty else line, end="" if self.tty else "\n", flush=True)

    def end(self, line: str) -> None:
        """The final state, and on a terminal the newline that ends the line, however the run ended."""
        if self.tty and self.line:
            self.update(line, now=True)
            print()


def _drive(args: argparse.Namespace, prefill: Engine, decode: Engine, out: Outcome, show: bool) -> None:
    progress = _Progress(show)
    try:
        _drive_requests(args, prefill, decode, out, progress)
    finally:
        progress.end(_progress_line(args, out, progress.in_flight))


def _progress_line(args: argparse.Namespace, out: Outcome, in_flight: int) -> str:
    done = sum(out.outcomes.values())
    return (f"  requests {done}/{args.requests} done, {in_flight} in flight, {dict(out.outcomes)}, "
            f"producer released {out.released} (+{out.expired} by lease)")


def _drive_requests(args: argparse.Namespace, prefill: Engine, decode: Engine, out: Outcome,
                    progress: _Progress) -> None:
    rng = random.Random(args.seed)
    faults = set(args.fault)
    started = done = 0
    loaded: set[str] = set()
    in_flight: dict[str, float] = {}
    to_abort = args.abort
    deadline = time.monotonic() + args.timeout_s
    releases_due = args.requests
    while done < started or started < args.requests or out.released + out.expired < min(started, releases_due):
        if time.monotonic() > deadline:
            out.problems.append(f"timed out after {args.timeout_s:.0f} s with {len(in_flight)} requests in flight")
            out.requests = done
            return
        # Until the kill, one request at a time: the kill then lands on a read that is in flight.
        window = 1 if "kill-prefill" in faults and not prefill.dead else args.in_flight
        while started < args.requests and len(in_flight) < window and not prefill.dead:
            i = started
            started += 1
            in_flight[f"d-{i}"] = time.monotonic()
            prefill.send(Prefill(rid=f"p-{i}", blocks=rng.randint(1, args.max_blocks), seed=rng.randrange(1 << 30)))
        for r in _drain(prefill):
            if r.ev == "prefilled" and r.params is not None:
                i = int(r.rid.split("-")[1])
                kill = "kill-prefill" in faults and not prefill.dead and done >= 2
                abort = bool(to_abort) and i % 3 == 1
                to_abort -= abort
                if kill:  # its KV handed on and held, its reader not yet told: the reads meet a dead peer
                    prefill.kill()
                    releases_due = 0
                decode.send(Load(rid=f"d-{i}", params=r.params, seed=_seed_of(args, i), abort=abort))
                loaded.add(f"d-{i}")
            elif r.ev == "released":
                out.expired += r.expired
                out.released += not r.expired
            elif r.ev == "error":
                out.problems.append(f"prefill: {r.rid}: {r.reason}")
                if in_flight.pop(f"d-{r.rid.split('-')[-1]}", None) is not None:  # never prefilled: ends here
                    done += 1
                    out.outcomes["refused"] += 1
                    releases_due -= 1  # nothing held: nothing to release
        for r in _drain(decode):
            if r.ev == "done":
                done += 1
                out.outcomes[r.outcome] += 1
                out.bad_bytes += r.outcome == "received" and not r.verified
                if r.reason:
                    out.reasons[r.rid] = r.reason
                t0 = in_flight.pop(r.rid, None)
                if t0 is not None:
                    out.latencies_ms.append((time.monotonic() - t0) * 1e3)
            elif r.ev == "error":
                out.problems.append(f"decode: {r.rid}: {r.reason}")
        if prefill.dead and (started < args.requests or set(in_flight) - loaded):
            for rid in set(in_flight) - loaded:  # prefilled on a dead engine: never handed on
                del in_flight[rid]
            started = done + len(in_flight)
        # As soon as the decode side is connected (a request done): forged late, with every request
        # released, it could reach the producer after the run had told it to finish.
        if "forge-notification" in faults and done >= 1:
            decode.send(Forge())
            faults.discard("forge-notification")
        progress.in_flight = len(in_flight)
        progress.update(_progress_line(args, out, len(in_flight)))
        if prefill.dead and done >= started:
            break
        for eng in (prefill, decode):  # an engine that ended on its own: stop now, not at the timeout
            if eng.ended_by_itself():
                eng.dead = eng.ended_early = True
                out.problems.append(eng.exited())
                out.requests = done
                return
        time.sleep(0.002)
    out.requests = done


def _seed_of(args: argparse.Namespace, i: int) -> int:
    """The prefill seed of request i (the same draw sequence as _drive's)."""
    rng = random.Random(args.seed)
    seed = 0
    for _ in range(i + 1):
        rng.randint(1, args.max_blocks)
        seed = rng.randrange(1 << 30)
    return seed


def _drain(engine: Engine) -> list[Result]:
    out = []
    while True:
        try:
            out.append(engine.results.get_nowait())
        except queue.Empty:
            return out


def _check(args: argparse.Namespace, out: Outcome, prefill_killed: bool) -> None:
    if out.bad_bytes:
        out.problems.append(f"{out.bad_bytes} requests received with bytes that differ from the producer's")
    for role, acc in out.accounting.items():
        if acc.free != acc.total or acc.in_flight or acc.double_frees:
            out.problems.append(f"{role}: {acc.total - acc.free} blocks not returned, {acc.double_frees} returned "
                                f"twice, {acc.in_flight} requests open")
        if acc.local_violations:
            out.problems.append(f"{role}: {acc.local_violations} illegal events blamed on us")
        if acc.early_frees:  # as the soak checks: a block freed while a read could still write it
            out.problems.append(f"{role}: {acc.early_frees} requests freed blocks a read could still write")
    for log, records, error in replayed(out.logs):
        out.records[log] = records
        if error:
            out.divergent.append(error)
    out.problems += [f"replay: {d}" for d in out.divergent]


def replayed(logs: Iterable[Path]) -> Iterator[tuple[Path, list[Record], str]]:
    """Each worker log read (a torn tail ends it: the engine may have been killed) and replayed:
    (log, its records, "" or what failed). The demo and the soak check their logs with it."""
    for log in logs:
        records: list[Record] = []
        try:
            records = read_log(log, on_torn_tail="stop")
            if records:  # an engine killed before its first flush leaves only a header
                replay(records)
        except Exception as exc:  # noqa: BLE001 - any failure to read or replay is reported
            yield log, records, f"{log.name}: {exc}"
        else:
            yield log, records, ""


def _report(args: argparse.Namespace, out: Outcome) -> None:
    lat = sorted(out.latencies_ms)
    p50 = lat[len(lat) // 2] if lat else 0.0
    print(f"pdfsm demo: {out.requests} requests from prefill (TP {args.prefill_tp}, PP {args.prefill_pp}) to decode "
          f"(TP {args.decode_tp}){' with MLA' if args.mla else ''} over NIXL in two processes, "
          f"{out.seconds:.1f} s; faults: {', '.join(args.fault) or 'none'}")
    print(f"  decode outcomes {dict(out.outcomes)}, bytes verified for every received request: "
          f"{'yes' if not out.bad_bytes else 'NO'}, p50 latency {p50:.1f} ms")
    policies = Counter(reason.partition(":")[0] for reason in out.reasons.values())
    if policies:
        print("  failed requests handed back with their blocks reported invalid, policy "
              + ", ".join(f"{policy} x{n}" for policy, n in sorted(policies.items())))
    print(f"  prefill released {out.released} by notification, {out.expired} by lease")
    for log in out.logs:
        summary = summarize(out.records.get(log, []))
        diverged = any(log.name in d for d in out.divergent)
        title = f"{log.name} (replayed{': DIVERGED' if diverged else ', no divergence'})"
        for line in render(summary, title=title, timelines=0 if args.quiet else 1):
            print(line)
    print(f"logs: {out.logs[0].parent if out.logs else '-'}")
    print("result: " + ("every request ended in a defined state, nothing leaked" if not out.problems
                        else "PROBLEMS:\n  " + "\n  ".join(out.problems)))


def run_command(args: argparse.Namespace) -> int:
    """``pdfsm demo``: exit 0 when every request ended in a defined state and nothing leaked."""
    try:
        out = run(args, show=not args.json)
    except (EngineError, UsageError) as e:
        print(f"pdfsm demo: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"requests": out.requests, "outcomes": dict(out.outcomes), "bad_bytes": out.bad_bytes,
                          "problems": out.problems, "seconds": round(out.seconds, 2)}))
    return 0 if not out.problems else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m pdfsm.run`` is ``pdfsm demo``."""
    from pdfsm.cli import main as cli

    return cli(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
