"""What an adapter that misbehaves does to the Connector: a cancel or a progress that raises, a
call from a thread a transport is not bound to, params naming no usable listener (found by an
embedding review: each used to hang a request, crash the scheduler, or be accepted)."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
from helpers import SimPair

from pdfsm.errors import InvalidInput, OwnerError
from transports.sim import ReadScript, SimTransport


class FlakyCancel(SimTransport):
    """The first cancel raises (NIXL's cancel_read does, off its thread or closing)."""

    fails = 1

    def cancel_read(self, request_id: str, pp_rank: int, tp_rank: int) -> None:
        if self.fails:
            self.fails -= 1
            raise RuntimeError("transient: the cancel could not be posted")
        super().cancel_read(request_id, pp_rank, tp_rank)


@pytest.mark.parametrize("how", ["abort", "deadline"])
def test_a_cancel_that_raises_is_retried_so_a_hung_read_still_ends_and_is_reported_once(how: str) -> None:
    """A hung read's one cancel raised and was only logged: the request stayed ABORTING/FAILING
    for ever, never reported, its blocks never freed, and a second abort sent nothing."""
    pair = SimPair(d_config={"read_timeout_ns": 20_000}, d_transport=FlakyCancel)
    params = pair.p.request_finished("p1", [1, 2])
    pair.net.script("d1", 0, 0, ReadScript(end="hang"))
    pair.d.load("d1", [5, 6], params)
    recv, _, _ = pair.run(3)
    if how == "abort":
        pair.d.abort("d1")
    recv += pair.run(40)[0]
    assert recv == ["d1"] and pair.invalid["d1"] == {5, 6}
    assert not pair.d._recancel and not pair.cons.reads


class FlakyProgress(SimTransport):
    fails = 1

    def progress(self) -> None:
        if self.fails:
            self.fails -= 1
            raise RuntimeError("transient poll failure")
        super().progress()


def test_a_progress_that_raises_is_logged_not_raised_into_the_scheduler_and_nothing_is_lost() -> None:
    pair = SimPair(d_transport=FlakyProgress)
    pair.d.load("d1", [5, 6], pair.p.request_finished("p1", [1, 2]))
    recv, sent, failed = pair.run(6)  # used to raise RuntimeError out of get_finished
    assert recv == ["d1"] and sent == ["p1"] and not failed


class Bound(SimTransport):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capabilities = msgspec.structs.replace(self.capabilities, thread_bound=True)
        self.calls: list[int] = []

    def post_read(self, cmd: Any) -> None:
        self.calls.append(threading.get_ident())
        super().post_read(cmd)


def test_a_thread_bound_transport_is_never_reached_from_another_thread() -> None:
    """NIXL takes calls only from the thread that bound it: a get_finished from another thread
    posted a queued read there (NIXL refused it: the request failed) and raised TransportError.
    Now the call is refused whole with OwnerError, and the owner thread goes on as before."""
    pair = SimPair(d_transport=Bound)
    assert isinstance(pair.cons, Bound)
    pair.d.load("d1", [5, 6], pair.p.request_finished("p1", [1, 2]))
    errors: list[BaseException] = []

    def foreign() -> None:
        for call in (pair.d.get_finished, lambda: pair.d.load("d2", [7], pair.p.request_finished("p2", [3])),
                     pair.d.shutdown):
            try:
                call()
            except OwnerError as exc:
                errors.append(exc)

    t = threading.Thread(target=foreign)
    t.start()
    t.join()
    assert len(errors) == 3 and "takes calls only from thread" in str(errors[0])
    assert "d2" not in pair.d.core.consumers and not pair.cons.calls  # nothing reached the transport
    recv, _, failed = pair.run(6)
    assert recv == ["d1"] and not failed and set(pair.cons.calls) == {threading.get_ident()}


@pytest.mark.parametrize(("host", "why"), [("", "non-empty"), ("\ud800", "Unicode"), ("h" * 100_000, "at most")])
def test_params_naming_no_usable_listener_are_refused_by_name(host: str, why: str) -> None:
    """An empty host failed every handshake later ("connection refused by :9"); a lone surrogate
    (a JSON router's "\\ud800") could not be written to the durable log, so the request vanished
    from replay; 100,000 characters were carried along. Refused where they enter, nothing accepted."""
    pair = SimPair()
    params = pair.p.request_finished("p1", [1, 2])
    with pytest.raises(InvalidInput, match=why) as exc:
        pair.d.load("d1", [5, 6], {**params.to_dict(), "remote_host": host})
    assert exc.value.field == "remote_host" and "d1" not in pair.d.core.consumers
    pair.d.load("d1", [5, 6], params)  # the same id and params still load
    assert pair.run(6)[0] == ["d1"]


def test_a_consumer_only_connector_mints_no_params() -> None:
    """Built with host="" (allowed: a decode-only worker), request_finished minted params with
    remote_host="" that every decode then failed to handshake with."""
    pair = SimPair()
    from pdfsm.connector import Connector
    from pdfsm.events import CoreConfig
    from transports.sim import SimHandshaker
    quiet = Connector(CoreConfig(engine_id="Q", compat_hash="h"), SimTransport(pair.net, "Q-0"),
                      SimHandshaker(pair.net), clock=pair.clock, host="")
    with pytest.raises(InvalidInput, match="consumer-only") as exc:
        quiet.request_finished("p1", [1, 2])
    assert exc.value.field == "host" and not quiet.core.producers


@pytest.mark.parametrize("rounds", [0, -1, "x", 1.5, 1 << 21])
def test_step_rounds_out_of_range_is_refused_by_name(rounds: Any) -> None:
    pair = SimPair()
    with pytest.raises(InvalidInput) as exc:
        pair.d.step(rounds)
    assert exc.value.field == "rounds"


class DeafCancel(SimTransport):
    """Every cancel raises (a transport that lost its thread, say)."""

    tries = 0

    def cancel_read(self, request_id: str, pp_rank: int, tp_rank: int) -> None:
        self.tries += 1
        raise RuntimeError("cancel refused")


def test_a_cancel_that_keeps_failing_backs_off_instead_of_flooding_the_transport_and_the_log() -> None:
    """Retried every round, a cancel that always raised was tried 1,000 times in 1,000 steps
    (twice in the first), each with an error and its traceback (found by review)."""
    pair = SimPair(d_transport=DeafCancel)
    pair.net.script("d1", 0, 0, ReadScript(end="hang"))
    pair.d.load("d1", [5, 6], pair.p.request_finished("p1", [1, 2]))
    pair.run(3)
    pair.d.abort("d1")
    pair.run(1000)
    assert isinstance(pair.cons, DeafCancel) and 8 <= pair.cons.tries <= 12
    assert pair.d.core.consumers["d1"].state.name == "ABORTING"  # still stopping: its read never ended


@pytest.mark.parametrize("which", ["clock", "wall_clock"])
@pytest.mark.parametrize("bad", ["x", time.monotonic, time.time])
def test_a_clock_that_is_not_int_nanoseconds_is_refused_when_the_connector_is_built(which: str, bad: Any) -> None:
    """``clock=time.monotonic`` (float seconds) was accepted: request_finished returned params,
    then the next step raised TypeError inside the core and the hold was gone, its blocks never
    released; a float wall clock minted params every consumer refused (found by review)."""
    from pdfsm.connector import Connector
    from pdfsm.events import CoreConfig
    from transports.sim import SimHandshaker, SimNetwork
    net = SimNetwork()
    with pytest.raises(InvalidInput) as exc:
        Connector(CoreConfig(engine_id="P"), SimTransport(net, "P-0"), SimHandshaker(net), **{which: bad})
    assert exc.value.field == which
