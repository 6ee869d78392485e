"""Which remote ranks a consumer rank reads, and how many notifications a producer rank expects.

Terms, from the consumer's (decode side, D) point of view, with the producer
(prefill side, P):

- ``tp_ratio = D_TP / P_TP`` when ``D_TP >= P_TP``, else ``-(P_TP / D_TP)``.
- D larger (ratio ``r > 1``): D rank ``d`` reads slice ``d % r`` of ``r`` of
  every block of P rank ``d // r``; each P rank is read by ``r`` D ranks and
  so expects ``r`` notifications (parts ``0..r-1``).
- P larger (ratio ``-k``): D rank ``d`` covers P ranks ``d*k .. d*k+k-1`` and
  reads each one's whole block into slice ``j % k`` of its own block; each P
  rank expects one notification.
- MLA: the latent KV is replicated on every P rank, so D reads whole blocks
  from one P rank only and sends the other ranks it covers a plain
  notification carrying P's request id (vLLM PR 36958).
- Replicated KV heads: with more ranks than the model's KV heads (``kv_heads``),
  each rank holds one head and ``tp // kv_heads`` consecutive ranks hold the
  same one (vLLM's GQA split, :func:`heads_held`). D reads each head it needs
  once, from the first P rank it covers that holds it, and tells the P ranks
  holding a copy with a plain notification, as with MLA (which is one
  replicated head). Unsaid (0), every rank holds a distinct share.
- PP: every remote rank is ``(pp_rank, tp_rank)``. A consumer with PP size 1
  reads every producer PP rank; equal PP sizes read the matching rank.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Final, NamedTuple, final

__all__ = [
    "MAX_KV_HEADS",
    "MAX_RANKS",
    "Layout",
    "ReadPlan",
    "ReadSource",
    "TopologyError",
    "expected_notifications",
    "heads_agree",
    "heads_held",
    "heads_problem",
    "read_plan",
    "tp_ratio",
]


MAX_RANKS: Final = 1024
"""The most TP (or PP) ranks of one engine, and the bound of every rank number: what the side
channel carries, and what a router's params may name (a plan is built rank by rank)."""


MAX_KV_HEADS: Final = 1 << 16
"""The most KV heads a model may say it has (``CoreConfig.kv_heads``, and a handshake's)."""


class TopologyError(ValueError):
    """Two engines' parallel layouts cannot exchange KV blocks."""


class Layout(NamedTuple):
    """One side's parallel layout and this worker's place in it."""

    tp_size: int
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0


class ReadSource(NamedTuple):
    """One read: a remote rank, and which slice of the remote and local block it moves."""

    pp_rank: int
    tp_rank: int
    remote_slice: int = 0
    remote_slices: int = 1
    local_slice: int = 0
    local_slices: int = 1


@final
class ReadPlan:
    """Everything a consumer rank does for one request, independent of the request itself.

    A native class (this module is compiled, setup.py): the consumer's hot path reads its fields
    on every request, each a load at a fixed offset. One plan is shared by every request between
    the same two layouts (:func:`read_plan` caches it), so nothing may change it: its fields are
    ``Final``.
    """

    __slots__ = ("all_read", "notify_only", "of", "part", "position", "pp_ranks", "sources")

    def __init__(self, sources: tuple[ReadSource, ...], notify_only: tuple[tuple[int, int], ...], part: int, of: int,
                 pp_ranks: tuple[int, ...], position: dict[tuple[int, int], int], all_read: int) -> None:
        self.sources: Final = sources
        self.notify_only: Final = notify_only  # (pp, tp) ranks told without being read (copies: MLA)
        self.part: Final = part  # which notification part this consumer rank is, for each rank it notifies
        self.of: Final = of  # how many parts each notified producer rank expects
        self.pp_ranks: Final = pp_ranks  # the remote PP ranks involved, i.e. the engines waited for
        self.position: Final = position  # (pp_rank, tp_rank) -> index in sources
        self.all_read: Final = all_read  # the bit mask with one bit per source

    def __repr__(self) -> str:
        return (f"ReadPlan(sources={self.sources!r}, notify_only={self.notify_only!r}, part={self.part}, "
                f"of={self.of}, pp_ranks={self.pp_ranks!r})")


def tp_ratio(consumer_tp: int, producer_tp: int) -> int:
    """``D_TP / P_TP`` when the consumer's TP is larger or equal, else ``-(P_TP / D_TP)``."""
    if consumer_tp < 1 or producer_tp < 1:
        raise TopologyError(f"TP sizes must be positive: consumer {consumer_tp}, producer {producer_tp}")
    big, small = max(consumer_tp, producer_tp), min(consumer_tp, producer_tp)
    if big % small:
        raise TopologyError(
            f"TP sizes must divide one another: consumer {consumer_tp}, producer {producer_tp}"
        )
    return consumer_tp // producer_tp if consumer_tp >= producer_tp else -(producer_tp // consumer_tp)


def expected_notifications(producer_tp: int, consumer_tp: int) -> int:
    """How many distinct notifications each producer rank receives per request."""
    return max(1, tp_ratio(consumer_tp, producer_tp))


def heads_held(tp_size: int, tp_rank: int, kv_heads: int) -> range:
    """The KV heads rank ``tp_rank`` of ``tp_size`` holds, of the model's ``kv_heads``: an equal
    share of consecutive heads while the ranks are no more than the heads, else one head, held by
    ``tp_size // kv_heads`` consecutive ranks (vLLM splits GQA's KV heads so)."""
    if not 1 <= kv_heads <= MAX_KV_HEADS:
        raise TopologyError(f"KV heads must be 1 to {MAX_KV_HEADS}, got {kv_heads}")
    if not 0 <= tp_rank < tp_size:
        raise TopologyError(f"TP rank {tp_rank} outside TP {tp_size}")
    if tp_size <= kv_heads:
        if kv_heads % tp_size:
            raise TopologyError(f"TP {tp_size} does not divide the model's {kv_heads} KV heads")
        n = kv_heads // tp_size
        return range(tp_rank * n, tp_rank * n + n)
    if tp_size % kv_heads:
        raise TopologyError(f"the model's {kv_heads} KV heads do not divide TP {tp_size}")
    head = tp_rank * kv_heads // tp_size
    return range(head, head + 1)


def heads_agree(a: int, b: int, tp_a: int, tp_b: int) -> bool:
    """Two engines' ``kv_heads`` (of TPs ``tp_a``, ``tp_b``) plan alike: equal, or one unsaid (0,
    planned as heads enough for the larger TP, :func:`read_plan`) and the other at least that, as
    when one engine is upgraded before its peers. Two different counts never agree."""
    return a == b or (not min(a, b) and max(a, b) >= max(tp_a, tp_b))


def heads_problem(tp_size: int, kv_heads: int) -> str | None:
    """Why ``tp_size`` ranks cannot share ``kv_heads`` KV heads (:func:`heads_held`), or None."""
    try:
        heads_held(tp_size, 0, kv_heads)
    except TopologyError as exc:
        return str(exc)
    return None


@lru_cache(maxsize=1024)
def read_plan(local: Layout, remote: Layout, mla: bool, kv_heads: int = 0) -> ReadPlan:
    """The reads and notifications of consumer rank ``local`` against producer ``remote``.

    ``kv_heads``: the model's KV heads (0: not said, as many as the larger TP, so no rank
    holds a copy of another's; MLA is one). Each read moves the heads it needs as a slice of
    the remote and of the local block, both a whole number of heads.
    Cached: every request between the same two layouts shares one plan.
    """
    if not 0 <= local.tp_rank < local.tp_size or not 0 <= local.pp_rank < local.pp_size:
        raise TopologyError(f"local rank ({local.pp_rank}, {local.tp_rank}) outside {local}")
    if remote.pp_size < 1:
        raise TopologyError(f"producer PP size must be positive, got {remote.pp_size}")
    if remote.tp_size * remote.pp_size > MAX_RANKS:  # a plan is built rank by rank, and kept
        raise TopologyError(f"the producer's TP {remote.tp_size} x PP {remote.pp_size} is "
                            f"{remote.tp_size * remote.pp_size} ranks, more than {MAX_RANKS}")
    if local.pp_size == 1:
        pp_ranks = tuple(range(remote.pp_size))
    elif local.pp_size == remote.pp_size:
        pp_ranks = (local.pp_rank,)
    else:
        raise TopologyError(
            f"PP sizes cannot be matched: consumer {local.pp_size}, producer {remote.pp_size}"
        )
    ratio = tp_ratio(local.tp_size, remote.tp_size)
    heads = 1 if mla else kv_heads or max(local.tp_size, remote.tp_size)
    d = local.tp_rank
    mine = heads_held(local.tp_size, d, heads)
    sources: list[ReadSource] = []
    extra: list[tuple[int, int]] = []
    for pp in pp_ranks:
        if ratio > 0:  # one P rank holds every head this rank needs: read them as a slice of its block
            t = d // ratio
            held = heads_held(remote.tp_size, t, heads)
            n = len(mine)
            sources.append(ReadSource(pp, t, remote_slice=(mine.start - held.start) // n,
                                      remote_slices=len(held) // n))
            continue
        read: set[int] = set()  # the covered P ranks hold this rank's heads between them, maybe twice
        for t in range(d * -ratio, (d + 1) * -ratio):
            held = heads_held(remote.tp_size, t, heads)
            if held.start in read:  # a copy of heads read from an earlier rank: told, not read
                extra.append((pp, t))
                continue
            read.add(held.start)
            n = len(held)
            sources.append(ReadSource(pp, t, local_slice=(held.start - mine.start) // n, local_slices=len(mine) // n))
    part, of = (d % ratio, ratio) if ratio > 0 else (0, 1)
    position = {(src.pp_rank, src.tp_rank): i for i, src in enumerate(sources)}
    return ReadPlan(tuple(sources), tuple(extra), part, of, pp_ranks, position, (1 << len(sources)) - 1)
