"""Interleavings found by review around the read timeout vs the lease-derived trust bound, and
the apply loop under strict mode. Each test asserts the correct behaviour and failed before its fix.
"""

from __future__ import annotations

from helpers import connected, make_core, read

from pdfsm.commands import PostRead
from pdfsm.events import Deadline


def test_fast_path_refuses_a_read_whose_explicit_deadline_already_passed_like_the_slow_path() -> None:
    """Sequence: engine P connected (one warm-up request run to the end, so the read plan is
    cached); then ReadRequested(r1, t=1000, deadline=Deadline(monotonic, 500), lease_ns=0).

    What happens: the common-case guard ``_can_read_now`` (consumer.py) checks that the deadline
    has not passed only when ``lease_ns`` is known, so r1 goes NEW -> READING and a PostRead is
    emitted although the deadline (which, without a lease, is also the trust bound) is 500 ns in
    the past. On the slow path (no connected engine, or first request of a layout) the very same
    event is refused by ``_lease_over`` (NEW -> FAILED, nothing posted). The table's decision
    (docs/decisions.md, "the common case first") is that the first option implies none of the
    later ones hold: here ``_lease_over`` holds too, so the fast path changes the semantics (an
    RDMA read posted for a request that can only fail; its completion is then untrusted).

    Must: the same decision on both paths: r1 FAILED at once, no read posted."""
    slow = make_core(strict=False)
    slow.apply(read("r1", t=1000, deadline=Deadline("monotonic", 500)))
    assert slow.consumers["r1"].state.name == "FAILED"
    assert not [c for c in slow.take_commands() if isinstance(c, PostRead)]

    fast = connected(make_core(strict=False))
    fast.apply(read("r1", t=1000, deadline=Deadline("monotonic", 500)))
    posted = [c for c in fast.take_commands() if isinstance(c, PostRead)]
    assert fast.consumers["r1"].state.name == "FAILED", f"fast path: {fast.consumers['r1'].state}, posted {posted}"
    assert not posted


def test_strict_mode_never_reuses_the_seqs_of_a_rejected_derived_event() -> None:
    """Strict mode raises when a derived event is illegal; the records the cascade made (the root's
    and the derived ones up to the rejection) keep their seqs. The apply loop's outer frame used to
    write back the seq from before the cascade, so the next record reused a seq already in the log."""
    import pytest

    from pdfsm.errors import ProtocolError
    from pdfsm.events import Collect

    core = make_core(strict=True)
    core.apply(read("r1"))  # handshaking: its hand-off is not due
    core.ready_ids["r1"] = None  # a core bug makes a Collect derive an illegal Reported
    with pytest.raises(ProtocolError):
        core.apply(Collect(source="scheduler", t_ns=10, step=1))
    seqs = [r.seq for r in core.log.records()]
    assert seqs == list(range(len(seqs))) and core.log.next_seq == len(seqs), seqs
