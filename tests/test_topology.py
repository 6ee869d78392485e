"""Topology: tp_ratio both ways, which ranks a consumer reads, what a producer expects, MLA, PP,
KV heads replicated over more ranks than heads."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdfsm.topology import (
    MAX_KV_HEADS,
    Layout,
    TopologyError,
    expected_notifications,
    heads_held,
    heads_problem,
    read_plan,
    tp_ratio,
)


def test_tp_ratio_both_directions() -> None:
    assert tp_ratio(4, 2) == 2
    assert tp_ratio(2, 8) == -4
    assert tp_ratio(3, 3) == 1
    with pytest.raises(TopologyError, match="divide"):
        tp_ratio(3, 2)
    with pytest.raises(TopologyError, match="positive"):
        tp_ratio(0, 2)


def test_consumer_larger_reads_a_slice_of_one_rank() -> None:
    plan = read_plan(Layout(4, 1, 3), Layout(2), False)
    (src,) = plan.sources
    assert (src.tp_rank, src.remote_slice, src.remote_slices) == (1, 1, 2)
    assert (plan.part, plan.of) == (1, 2)


def test_producer_larger_reads_every_covered_rank_into_local_slices() -> None:
    plan = read_plan(Layout(2, 1, 1), Layout(8), False)
    assert [(s.tp_rank, s.local_slice, s.local_slices) for s in plan.sources] == [
        (4, 0, 4), (5, 1, 4), (6, 2, 4), (7, 3, 4)]
    assert (plan.part, plan.of) == (0, 1)


def test_mla_reads_one_rank_and_notifies_the_rest() -> None:
    plan = read_plan(Layout(1, 1, 0), Layout(4), True)
    assert [s.tp_rank for s in plan.sources] == [0]
    assert plan.notify_only == ((0, 1), (0, 2), (0, 3))


def test_pp_ranks_are_all_read_by_a_consumer_without_pp() -> None:
    plan = read_plan(Layout(1), Layout(2, 3), False)
    assert plan.pp_ranks == (0, 1, 2)
    assert [(s.pp_rank, s.tp_rank) for s in plan.sources] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    with pytest.raises(TopologyError, match="PP sizes"):
        read_plan(Layout(1, 2), Layout(1, 3), False)


@given(d_exp=st.integers(0, 3), p_exp=st.integers(0, 3), mla=st.booleans())
def test_every_producer_rank_hears_exactly_the_count_it_expects(d_exp: int, p_exp: int, mla: bool) -> None:
    d_tp, p_tp = 2**d_exp, 2**p_exp
    heard: Counter[int] = Counter()
    for d in range(d_tp):
        plan = read_plan(Layout(d_tp, 1, d), Layout(p_tp), mla)
        told = [s.tp_rank for s in plan.sources] + [tp for _, tp in plan.notify_only]
        assert len(set(told)) == len(told)
        for tp in told:
            heard[tp] += 1
            assert plan.of == expected_notifications(p_tp, d_tp)
    assert set(heard) == set(range(p_tp))
    assert all(n == expected_notifications(p_tp, d_tp) for n in heard.values())


# --- KV heads replicated over ranks (a TP larger than the model's KV heads) -----------------------


def test_heads_held_shares_heads_out_then_gives_consecutive_ranks_the_same_head() -> None:
    assert [heads_held(2, r, 8) for r in range(2)] == [range(4), range(4, 8)]
    assert [heads_held(8, r, 2) for r in range(8)] == [range(1)] * 4 + [range(1, 2)] * 4  # vLLM's GQA split
    assert heads_held(4, 3, 4) == range(3, 4)
    for tp, heads, why in ((3, 8, "TP 3 does not divide the model's 8 KV heads"),
                           (8, 3, "the model's 3 KV heads do not divide TP 8"),
                           (2, 0, "KV heads must be 1"), (2, MAX_KV_HEADS + 1, "KV heads must be 1")):
        problem = heads_problem(tp, heads)
        assert problem is not None and problem.startswith(why)
    assert heads_problem(8, 2) is None
    for tp, rank in ((0, 0), (-2, 0), (2, 5), (4, -1)):  # typed, never a ZeroDivisionError or heads not there
        with pytest.raises(TopologyError, match="outside"):
            heads_held(tp, rank, 8)
    assert heads_problem(0, 8) == "TP rank 0 outside TP 0"
    with pytest.raises(TopologyError, match="TP 3 does not divide the model's 8 KV heads"):
        read_plan(Layout(3), Layout(1), False, 8)
    with pytest.raises(TopologyError, match="the model's 3 KV heads do not divide TP 8"):
        read_plan(Layout(1), Layout(8), False, 3)  # the producer's TP is checked too


def test_a_decode_tp_above_the_heads_reads_its_one_head_out_of_the_producer_block() -> None:
    """2 heads, P TP 1 (both heads), D TP 4: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1. Not
    told, the plan would cut P's block in 4 (half heads: the transports refuse the read)."""
    got = [read_plan(Layout(4, 1, d), Layout(1), False, 2) for d in range(4)]
    assert [(p.sources[0].remote_slice, p.sources[0].remote_slices) for p in got] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [(p.part, p.of) for p in got] == [(0, 4), (1, 4), (2, 4), (3, 4)]  # P still hears all four
    assert read_plan(Layout(4, 1, 3), Layout(1), False).sources[0].remote_slices == 4


def test_a_prefill_tp_above_the_heads_is_read_once_per_head_and_the_copies_told() -> None:
    """2 heads, P TP 4 (ranks 0, 1 hold head 0; 2, 3 head 1), D TP 1: read ranks 0 and 2 into the
    two head slices, tell ranks 1 and 3 (as MLA tells the ranks it does not read)."""
    plan = read_plan(Layout(1), Layout(4), False, 2)
    assert [(s.tp_rank, s.local_slice, s.local_slices) for s in plan.sources] == [(0, 0, 2), (2, 1, 2)]
    assert plan.notify_only == ((0, 1), (0, 3))
    both = read_plan(Layout(4, 1, 1), Layout(8), False, 2)  # both sides replicated: D rank 1 holds head 0
    assert [s.tp_rank for s in both.sources] == [2] and both.notify_only == ((0, 3),)


def test_heads_said_as_the_larger_tp_or_unsaid_plan_alike_and_mla_is_one_head() -> None:
    for d_tp, p_tp in ((1, 4), (4, 1), (2, 8), (8, 2), (4, 4)):
        for d in range(d_tp):
            unsaid = read_plan(Layout(d_tp, 1, d), Layout(p_tp, 2), False)
            said = read_plan(Layout(d_tp, 1, d), Layout(p_tp, 2), False, max(d_tp, p_tp))
            assert (unsaid.sources, unsaid.notify_only) == (said.sources, said.notify_only)
            mla = read_plan(Layout(d_tp, 1, d), Layout(p_tp, 2), True)
            one = read_plan(Layout(d_tp, 1, d), Layout(p_tp, 2), False, 1)
            assert (mla.sources, mla.notify_only) == (one.sources, one.notify_only)


@given(heads=st.sampled_from([1, 2, 3, 4, 6, 8, 16]), d_tp=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]),
       p_tp=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]))
def test_every_consumer_rank_reads_each_of_its_heads_once_and_every_producer_rank_hears_its_count(
        heads: int, d_tp: int, p_tp: int) -> None:
    """Head by head: the slices a consumer rank reads put exactly its heads in place, each once,
    and each producer rank is read or told ``expected_notifications`` times over all consumer ranks."""
    try:
        plans = [read_plan(Layout(d_tp, 1, d), Layout(p_tp), False, heads) for d in range(d_tp)]
    except TopologyError:
        assert heads_problem(d_tp, heads) or heads_problem(p_tp, heads) or max(d_tp, p_tp) % min(d_tp, p_tp)
        return
    heard: Counter[int] = Counter()
    for d, plan in enumerate(plans):
        mine = heads_held(d_tp, d, heads)
        got: list[int | None] = [None] * len(mine)
        for s in plan.sources:
            held = heads_held(p_tp, s.tp_rank, heads)
            width = len(held) // s.remote_slices
            assert width * s.local_slices == len(mine)  # the slices are the same size on both sides
            for i, h in enumerate(held[s.remote_slice * width:(s.remote_slice + 1) * width]):
                assert got[s.local_slice * width + i] is None
                got[s.local_slice * width + i] = h
        assert got == list(mine)
        heard.update([s.tp_rank for s in plan.sources] + [t for _, t in plan.notify_only])
    assert heard == dict.fromkeys(range(p_tp), expected_notifications(p_tp, d_tp))
