"""``pdfsm soak``: the demo's two engine processes under a steady load with faults at random.

Requests arrive at ``--rate`` per second for ``--duration`` seconds with random block tables.
Each request is hit, with probability ``--fault-rate``, by one fault drawn from :data:`KINDS`:
aborts at every stage (at the router before the decode side hears of it, as the load arrives,
while its reads run, after it finished), a notification lost, delivered twice or late, a
read reported failed, a load that comes after the producer's lease. Every ``--restart-s``
seconds on average (when faults are on) the prefill process is killed (SIGKILL, reads in
flight) and started again under a new engine id, as a crashed engine comes back.

A request an engine refuses (its pool full, under a load the options asked for) ends
``refused``. Options that could only hang or fail the run are refused before any engine starts
(exit 2). At the end the run checks: every request reached a terminal state; both block pools are
whole (``leaked_blocks``) and no block was freed while the transport still had a read into it
(``early_frees``); every received byte was the producer's; every log replays without
divergence; and every violation in the logs is explained by an injected fault
(``unexpected_violations`` counts the rest). Memory: each engine reports its resident set
every second; ``rss_growth_after_warmup`` is the largest growth of any engine, killed and
restarted prefill engines included, from the end of its own warm-up (a fifth of the run, or
40 % of the engine's life if shorter) to its last sample (``rss_growth_by_engine`` has each).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdfsm.connector import KVTransferParams
from pdfsm.engine_messages import HEADS, Abort, Finish, Load, Prefill, Result, Tamper
from pdfsm.fsm import Fault
from pdfsm.log import Record
from pdfsm.postmortem import clear_demo_logs, worker_logs
from pdfsm.run import Engine, EngineError, UsageError, _check_log_dir, _drain, check_sizes, replayed
from pdfsm.topology import heads_problem

__all__ = ["KINDS", "SoakResult", "add_arguments", "run", "soak_command"]

KINDS = ("abort-before-load", "abort-now", "abort-reading", "abort-late", "drop-notification",
         "duplicate-notification", "delay-notification", "fail-read", "late-load")
NOTIFICATION_FAULTS = frozenset({"drop-notification", "duplicate-notification", "delay-notification"})
LEASE_S = 6.0
POOL_BLOCKS = 2048  # each soak engine's KV pool (the demo's is smaller: its load is not sustained)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (60)")
    p.add_argument("--rate", type=float, default=40.0, help="requests per second (40)")
    p.add_argument("--fault-rate", type=float, default=0.05, help="probability a request is hit by a fault (0.05)")
    p.add_argument("--restart-s", type=float, default=120.0,
                   help="mean seconds between prefill kills and restarts while faults are on; 0: never (120)")
    p.add_argument("--prefill-tp", type=int, default=2, help="prefill engine TP size (2)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode engine TP size (1)")
    p.add_argument("--max-blocks", type=int, default=8, help="blocks per request, at most (8)")
    p.add_argument("--seed", type=int, default=0, help="the run's random seed (0)")
    p.add_argument("--log-dir", help="each worker's event log goes in a subdirectory here")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


def check_soak_options(args: argparse.Namespace) -> None:
    """Refuse, naming the option, what could only hang, crash or fail the run before any engine starts."""
    check_sizes(args, ("prefill_tp", "decode_tp", "max_blocks"))
    for flag, tp in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        why = heads_problem(tp, HEADS)
        if why is not None:
            raise UsageError(f"{flag} {tp}: {why}")
    if args.max_blocks > POOL_BLOCKS:  # one request could never be prefilled
        raise UsageError(f"--max-blocks {args.max_blocks}: more than the {POOL_BLOCKS} blocks of each engine's KV pool")
    if not (math.isfinite(args.duration) and args.duration > 0):
        raise UsageError(f"--duration {args.duration}: a number of seconds above 0")
    if not (math.isfinite(args.rate) and args.rate > 0):  # the arrivals step by 1 / rate
        raise UsageError(f"--rate {args.rate}: requests per second above 0")
    if not 0 <= args.fault_rate <= 1:
        raise UsageError(f"--fault-rate {args.fault_rate}: a probability, 0 to 1")
    if not (math.isfinite(args.restart_s) and args.restart_s >= 0):
        raise UsageError(f"--restart-s {args.restart_s}: mean seconds between restarts, 0 (never) or more")
    if args.log_dir is not None:
        _check_log_dir(Path(args.log_dir))


@dataclass
class _Req:
    i: int
    engine: str  # the prefill engine id that got it
    fault: str
    seed: int
    sent: bool = False  # its Prefill went to ``engine``
    params: KVTransferParams | None = None  # once prefilled
    t0: float = 0.0  # when its Load was sent, for the transfer latency
    load_at: float = 0.0  # late-load: when the router will send the Load
    prefilled_at: float = 0.0


@dataclass
class SoakResult:
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    not_received_by_fault: Counter[str] = field(default_factory=Counter)  # the fault that hit each, or "none"
    faults: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    bad_bytes: int = 0
    leaked_blocks: int = 0
    early_frees: int = 0
    double_frees: int = 0
    not_terminal: int = 0
    violations: int = 0
    unexpected: list[str] = field(default_factory=list)
    divergent: list[str] = field(default_factory=list)
    rss_growth: int = 0
    rss_growth_by_engine: dict[str, int] = field(default_factory=dict)
    rss_samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    sizes: dict[str, dict[str, int]] = field(default_factory=dict)  # the last table sizes per engine
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        done = sum(self.outcomes.values())
        return {
            "requests": self.requests, "requests_per_s": round(done / self.seconds, 2) if self.seconds else 0.0,
            "outcomes": dict(self.outcomes), "not_received_by_fault": dict(self.not_received_by_fault),
            "faults": dict(self.faults), "restarts": self.restarts,
            "p50_ms": round(_pct(lat, 0.50), 2), "p99_ms": round(_pct(lat, 0.99), 2),
            "leaked_blocks": self.leaked_blocks, "double_frees": self.double_frees, "early_frees": self.early_frees,
            "bad_bytes": self.bad_bytes, "not_terminal": self.not_terminal, "violations": self.violations,
            "unexpected_violations": len(self.unexpected), "divergent": bool(self.divergent),
            "rss_growth_after_warmup": self.rss_growth, "rss_growth_by_engine": self.rss_growth_by_engine,
            "seconds": round(self.seconds, 1),
            "rss_mib": {eid: [round(s[0][1] / 2**20, 1), round(s[-1][1] / 2**20, 1)]
                        for eid, s in self.rss_samples.items() if s},
            "table_sizes": self.sizes,
            "problems": self.problems,
        }


MIN_MEASURED_S = 20.0  # an engine's RSS is judged only over at least this long after its warm-up


def _growth_after_warmup(samples: list[tuple[float, int]], warm_s: float) -> int | None:
    """RSS growth of one engine from the end of its own warm-up to its last sample: the run's
    warm-up length, or 40 % of the engine's life if it lived shorter (a prefill engine that
    was restarted, or killed); None if too little is left to judge."""
    if not samples:
        return None
    start, end = samples[0][0], samples[-1][0]
    warm_end = start + min(warm_s, 0.4 * (end - start))
    if end - warm_end < MIN_MEASURED_S:
        return None
    return samples[-1][1] - next(rss for t, rss in samples if t >= warm_end)


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


class _Soak:
    def __init__(self, args: argparse.Namespace, log_dir: Path, show: bool) -> None:
        self.args, self.log_dir, self.show = args, log_dir, show
        self.rng = random.Random(args.seed)  # per request, in arrival order: the same draws every run
        self.restart_rng = random.Random(args.seed + 1)  # drawn at moments that depend on timing
        self.out = SoakResult()
        self.reqs: dict[int, _Req] = {}  # not yet terminal
        self.hit: set[int] = set()  # requests a fault or a kill was aimed at: their violations are expected
        self.killed: set[str] = set()
        self.incarnation = 0
        self.prefill = self._start_prefill()
        self.prefill_ready = False
        self.restarts_on = False
        self.next_restart = float("inf")  # drawn when an engine is ready: each one lives a while
        self.backlog: list[tuple[int, Prefill]] = []
        self.decode = Engine("decode", self._argv("decode", args.decode_tp))
        self.late: list[_Req] = []

    def _argv(self, engine_id: str, tp: int) -> list[str]:
        return ["--engine-id", engine_id, "--tp", str(tp), "--layers", "4", "--num-blocks", str(POOL_BLOCKS),
                "--lease-s", str(LEASE_S), "--lease-margin-s", "0.5", "--read-timeout-s", "3",
                "--log-dir", str(self.log_dir)]

    def _start_prefill(self) -> Engine:
        eid = "prefill" if not self.incarnation else f"prefill-r{self.incarnation}"
        self.engine_id = eid
        return Engine("prefill", self._argv(eid, self.args.prefill_tp))

    # --- the run --------------------------------------------------------------------------------

    def run(self) -> SoakResult:
        a, out = self.args, self.out
        self.decode.wait_for("ready", 60)
        start = time.monotonic()
        end = start + a.duration
        next_arrival = start
        self.restarts_on = a.fault_rate > 0 and a.restart_s > 0
        last_show = 0.0
        while True:
            now = time.monotonic()
            while now >= next_arrival and now < end:
                self._arrive()
                next_arrival += 1 / a.rate
            if now >= self.next_restart and now < end - LEASE_S:
                self._restart()
            self._from_prefill()
            self._from_decode()
            for r in [r for r in self.late if r.load_at <= now]:
                self.late.remove(r)
                self._load(r)
            if self.show and now - last_show > (0.5 if sys.stdout.isatty() else 10.0):
                last_show = now
                self._progress(now - start)
            if now >= end and not self.reqs:
                break
            died = [eng for eng in (self.prefill, self.decode) if eng.ended_by_itself()]
            if died:  # an engine that ended on its own: nothing it had will finish, so stop now
                out.problems += [eng.exited() for eng in died]
                break
            if now > end + 3 * LEASE_S + 30:
                out.problems.append(f"{len(self.reqs)} requests still open {now - end:.0f} s after the last arrival")
                break
            time.sleep(0.001)
        out.seconds = time.monotonic() - start
        out.not_terminal = len(self.reqs)
        if self.show:
            self._progress(out.seconds)
            print()
        self._finish(0.2 * a.duration)
        return out

    def _arrive(self) -> None:
        a, out = self.args, self.out
        i = out.requests
        out.requests += 1
        fault = self.rng.choice(KINDS) if self.rng.random() < a.fault_rate else ""
        out.faults[fault or "none"] += 1
        if fault:
            self.hit.add(i)
        r = self.reqs[i] = _Req(i, self.engine_id, fault, self.rng.randrange(1 << 30))
        op = Prefill(rid=f"p-{i}", blocks=self.rng.randint(1, a.max_blocks), seed=r.seed)
        self.backlog.append((i, op))
        self._send_backlog()

    def _send_backlog(self) -> None:
        if not self.prefill_ready:
            return
        for i, op in self.backlog:
            r = self.reqs[i]
            r.engine, r.sent = self.engine_id, True
            if r.fault in NOTIFICATION_FAULTS:
                kind: Any = r.fault  # one of NOTIFICATION_FAULTS
                self.prefill.send(Tamper(rid=op.rid, kind=kind, delay_s=self.rng.uniform(0.05, 1.0)))
            self.prefill.send(op)
        self.backlog.clear()

    def _restart(self) -> None:
        """Kill the prefill process with reads in flight; what it had not prefilled is lost with it."""
        self.prefill.kill()
        self.killed.add(self.engine_id)
        self.out.restarts += 1
        for r in list(self.reqs.values()):
            if r.engine != self.engine_id or not r.sent:
                continue  # still in the backlog: the next engine gets it
            self.hit.add(r.i)
            if r.params is None:
                self._terminal(r, "lost-with-prefill")  # never prefilled: nothing to hand on
        self.incarnation += 1
        self.prefill = self._start_prefill()
        self.prefill_ready, self.next_restart = False, float("inf")

    def _from_prefill(self) -> None:
        for res in _drain(self.prefill):
            if res.ev == "ready":
                self.prefill_ready = True
                if self.restarts_on:
                    self.next_restart = time.monotonic() + self.restart_rng.expovariate(1 / self.args.restart_s)
                self._send_backlog()
            elif res.ev == "prefilled" and res.params is not None:
                r = self.reqs.get(int(res.rid[2:]))
                if r is None:
                    continue
                r.prefilled_at = time.monotonic()
                if r.fault == "abort-before-load":
                    self._terminal(r, "aborted-at-router")  # the producer's lease releases its blocks
                elif r.fault == "late-load":
                    r.params, r.load_at = res.params, time.monotonic() + LEASE_S + 0.5
                    self.late.append(r)
                else:
                    r.params = res.params
                    self._load(r)
            elif res.ev == "stats":
                self.out.rss_samples.setdefault(self.engine_id, []).append((time.monotonic(), res.rss))
                self.out.sizes[self.engine_id] = res.sizes
            elif res.ev == "error":
                self._error("prefill", res)

    def _load(self, r: _Req) -> None:
        rid = f"d-{r.i}"
        if r.fault == "fail-read":
            self.decode.send(Tamper(rid=rid, kind="fail-read"))
        r.t0 = time.monotonic()
        assert r.params is not None
        self.decode.send(Load(rid=rid, params=r.params, seed=r.seed, age_s=r.t0 - r.prefilled_at))
        if r.fault in ("abort-now", "abort-reading"):
            self.decode.send(Abort(rid=rid, stage="now" if r.fault == "abort-now" else "reading"))

    def _from_decode(self) -> None:
        for res in _drain(self.decode):
            if res.ev == "done":
                r = self.reqs.get(int(res.rid[2:]))
                if r is None:
                    self.out.problems.append(f"decode reported {res.rid} twice")
                    continue
                self.out.bad_bytes += res.outcome == "received" and not res.verified
                if res.outcome == "received":
                    self.out.latencies_ms.append((time.monotonic() - r.t0) * 1e3)
                if r.fault == "abort-late":
                    self.decode.send(Abort(rid=res.rid, stage="now"))  # after it finished: ignored
                self._terminal(r, res.outcome)
            elif res.ev == "stats":
                self.out.rss_samples.setdefault("decode", []).append((time.monotonic(), res.rss))
                self.out.sizes["decode"] = res.sizes
            elif res.ev == "error":
                self._error("decode", res)

    def _error(self, role: str, res: Result) -> None:
        """A refused op ends its request, ``refused`` (a full pool under overload is not a fault of
        pdfsm's: the run's own checks still judge the blocks); any other error is a problem."""
        r = self.reqs.get(int(res.rid[2:])) if res.refused and res.rid[2:].isdigit() else None
        if r is not None:
            self._terminal(r, "refused")
        if res.refused != "pool":
            self.out.problems.append(f"{role}: {res.rid}: {res.reason}")

    def _terminal(self, r: _Req, outcome: str) -> None:
        del self.reqs[r.i]
        self.out.outcomes[outcome] += 1
        if outcome != "received":
            self.out.not_received_by_fault[r.fault or "none"] += 1

    def _progress(self, elapsed: float) -> None:
        o = self.out
        done = sum(o.outcomes.values())
        bad = {k: v for k, v in o.outcomes.items() if k != "received"}
        line = (f"  {elapsed:6.1f} s  {done / max(elapsed, 1e-9):6.1f} req/s  in flight {len(self.reqs):4d}  "
                f"done {done}  not received {bad or '{}'}  by fault {dict(o.not_received_by_fault) or '{}'}  "
                f"restarts {o.restarts}")
        print(("\r" + line + "   ") if sys.stdout.isatty() else line, end="" if sys.stdout.isatty() else "\n",
              flush=True)

    # --- the checks -------------------------------------------------------------------------------

    def _finish(self, warm_s: float) -> None:
        out = self.out
        accounting: dict[str, Result] = {}
        for eng in (self.prefill, self.decode):
            eng.send(Finish(grace_s=LEASE_S + 10))
        for name, eng in (("prefill", self.prefill), ("decode", self.decode)):
            try:
                accounting[name] = eng.wait_for("accounting", LEASE_S + 30)
            except RuntimeError as exc:
                out.problems.append(str(exc))
            eng.proc.wait(timeout=30)
        for name, acc in accounting.items():
            out.leaked_blocks += acc.total - acc.free
            out.double_frees += acc.double_frees
            out.early_frees += acc.early_frees
            if acc.in_flight:
                out.problems.append(f"{name}: {acc.in_flight} requests still holding blocks")
        self._check_logs()
        for eid, samples in out.rss_samples.items():
            grew = _growth_after_warmup(samples, warm_s)
            if grew is not None:
                out.rss_growth_by_engine[eid] = grew
        out.rss_growth = max(out.rss_growth_by_engine.values(), default=0)
        if out.leaked_blocks:
            out.problems.append(f"{out.leaked_blocks} blocks never returned to their pool")
        if out.double_frees:
            out.problems.append(f"{out.double_frees} blocks returned to their pool twice")
        if out.early_frees:
            out.problems.append(f"{out.early_frees} requests freed blocks a read could still write")
        if out.bad_bytes:
            out.problems.append(f"{out.bad_bytes} requests received bytes the producer did not write")
        if out.not_terminal:
            out.problems.append(f"{out.not_terminal} requests never reached a terminal state")
        out.problems += [f"replay: {d}" for d in out.divergent]
        out.problems += [f"unexpected violation: {u}" for u in out.unexpected[:20]]

    def _check_logs(self) -> None:
        for log, records, error in replayed(worker_logs(self.log_dir)):
            if error:
                self.out.divergent.append(error)
                continue
            for rec in records:
                if rec.violation:
                    self.out.violations += 1
                    if not self._explained(rec):
                        self.out.unexpected.append(f"{log.name} seq {rec.seq}: {rec.machine} "
                                                   f"{type(rec.event).__name__}: {rec.reason}")

    def _explained(self, rec: Record) -> bool:
        """A violation the run caused on purpose: a remote fault on a request it hit, or anything
        that touches a prefill engine it killed. Local faults are never explained."""
        if rec.fault is Fault.LOCAL:
            return False
        ev = rec.event
        if getattr(ev, "engine_id", None) in self.killed:
            return True
        rid = getattr(ev, "request_id", "")
        return isinstance(rid, str) and rid[:2] in ("d-", "p-") and rid[2:].isdigit() and int(rid[2:]) in self.hit


def run(args: argparse.Namespace, *, show: bool = True) -> SoakResult:
    """The soak; raises UsageError for options it cannot run (before any engine starts) and
    EngineError when the decode engine does not come up."""
    check_soak_options(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdfsm-soak-"))
    refused = clear_demo_logs(log_dir)
    if refused:
        return SoakResult(problems=[refused])
    soak = _Soak(args, log_dir, show)
    try:
        return soak.run()
    finally:
        for eng in (soak.prefill, soak.decode):
            if eng.proc.poll() is None:
                eng.kill()


def soak_command(args: argparse.Namespace) -> int:
    """``pdfsm soak``: exit 0 when every check held, 1 when one did not, 2 for options it cannot run."""
    try:
        out = run(args, show=not args.json)
    except (EngineError, UsageError) as e:
        print(f"pdfsm soak: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out.as_json()))
    else:
        print(json.dumps(out.as_json(), indent=1))
    return 0 if not out.problems else 1
