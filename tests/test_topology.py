"""Topology: tp_ratio both ways, which ranks a consumer reads, what a producer expects, MLA, PP."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdfsm.topology import Layout, TopologyError, expected_notifications, read_plan, tp_ratio


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
