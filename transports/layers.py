"""Layer pairing: which local KV region a remote region is read into.

Every registered KV region carries a *layer id* (by default its position in the
rank's list of tensors). A read from remote rank ``(pp_rank, tp_rank)`` moves each
remote region into the local region with the same layer id, so ranks need not
register the same regions in the same order, nor the same number of them:

- pipeline parallelism: a producer PP rank ``p`` of ``P`` holds only its layers
  (e.g. ``[p*L/P, (p+1)*L/P)``); a consumer with PP size 1 holds all ``L``, and its
  read from PP rank ``p`` fills only the local regions of those layers;
- equal PP sizes: consumer PP rank ``p`` reads producer PP rank ``p``; both hold the
  same layers.

Layer ids are pairing keys, not necessarily model layer numbers: with K and V
registered as separate regions, number them ``2*layer`` and ``2*layer + 1`` (any
numbering both sides share). Within one rank they must be unique.

What is refused, with a :class:`LayerError` naming the layers:

- at construction, a layer id repeated, negative, or a count that is not one per region;
- when a remote rank is added, a remote layer the local side does not hold, or TP ranks
  of one PP rank that hold different layers;
- when a read is posted, remote PP ranks of one engine that hold the same layer (two
  reads would write one local region) or that together leave a local layer unread
  (the local copy of that layer would be stale): every local layer must come from
  exactly one connected PP rank of the engine the read comes from. This is checked
  over the engine's PP ranks this transport is connected to, which, when a read is
  posted, are the ones the request reads (the core posts reads only once every PP rank
  it needs is connected; a consumer whose PP size equals the producer's connects to
  one PP rank only).

Pure functions over integers, and :class:`LayerMap`, which keeps one rank's answers to
them: shared by the NIXL and torch transports.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from pdfsm.events import EngineKey
from transports.base import TransportError

__all__ = ["MAX_LAYER", "LayerError", "LayerMap", "check_layers", "coverage_problem", "local_positions"]

MAX_LAYER = (1 << 31) - 1
"""The largest layer id accepted (they travel in metadata: bounded like everything else)."""


class LayerError(TransportError, ValueError):
    """Layer ids that cannot pair: repeated, missing on the local side, overlapping or
    incomplete across PP ranks. A :class:`~transports.base.TransportError` (what the
    transport protocol raises) and a ``ValueError`` (what a constructor raises)."""


def _span(layers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    run: list[int] = []
    for x in sorted(set(layers)):
        if run and x == run[-1] + 1:
            run.append(x)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [x]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def check_layers(layers: Sequence[int] | None, regions: int, *, where: str = "layers") -> tuple[int, ...]:
    """One layer id per region (``None``: their positions), each an int in ``0..MAX_LAYER``,
    none repeated."""
    if layers is None:
        return tuple(range(regions))
    out = tuple(layers)
    if len(out) != regions:
        raise LayerError(f"{where}: {len(out)} layer ids for {regions} KV regions")
    for x in out:
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= MAX_LAYER:
            raise LayerError(f"{where}: layer ids must be ints in 0..{MAX_LAYER}, got {x!r}")
    if len(set(out)) != len(out):
        dup = [x for x, n in Counter(out).items() if n > 1]
        raise LayerError(f"{where}: layer ids repeat ({_span(dup)}); each region needs its own")
    return out


def local_positions(local: Mapping[int, int], remote_layers: Sequence[int], *, remote: str = "remote rank"
                    ) -> tuple[int, ...]:
    """For each remote region (in order), the position of the local region with its layer.
    ``local`` maps a local layer id to its region's position."""
    try:
        return tuple(local[x] for x in remote_layers)
    except KeyError:
        missing = [x for x in remote_layers if x not in local]
        raise LayerError(f"{remote} holds layers {_span(missing)} that this rank does not "
                         f"(this rank holds {_span(local)})") from None


def coverage_problem(local_layers: Iterable[int], served: Mapping[int, Iterable[int]]) -> str | None:
    """Why the layers ``served`` by each remote PP rank (pp_rank -> layer ids) do not fill
    ``local_layers`` exactly once, or ``None`` when they do."""
    owner: dict[int, int] = {}
    for pp in sorted(served):
        for x in served[pp]:
            if x in owner:
                return (f"layer {x} is held by remote PP ranks {owner[x]} and {pp}: each layer must come "
                        "from exactly one PP rank")
            owner[x] = pp
    want = set(local_layers)
    missing = want - owner.keys()
    if missing:
        return (f"no connected remote PP rank ({', '.join(map(str, sorted(served)))}) holds local layers "
                f"{_span(missing)}: they would not be read")
    extra = owner.keys() - want
    if extra:
        return f"remote PP ranks hold layers {_span(extra)} that this rank does not"
    return None


class _HoldsLayers(Protocol):
    @property
    def layers(self) -> tuple[int, ...]: ...


class LayerMap:
    """One rank's layers: where each local layer sits, and, per remote engine, whether the PP
    ranks of it the transport is connected to hold each local layer exactly once (cached until
    :meth:`changed` says a rank of that engine was added or dropped)."""

    __slots__ = ("_coverage", "_pos", "layers")

    def __init__(self, layers: Sequence[int] | None, regions: int) -> None:
        self.layers = check_layers(layers, regions)
        self._pos = {x: i for i, x in enumerate(self.layers)}
        self._coverage: dict[str, str | None] = {}  # engine id -> why its PP ranks do not fill ours

    def positions(self, remote_layers: Sequence[int], *, remote: str) -> tuple[int, ...]:
        """:func:`local_positions` for this rank."""
        return local_positions(self._pos, remote_layers, remote=remote)

    def changed(self, engine_id: str) -> None:
        self._coverage.pop(engine_id, None)

    def problem(self, engine_id: str, peers: Mapping[EngineKey, Mapping[int, _HoldsLayers]]) -> str | None:
        """:func:`coverage_problem` over ``engine_id``'s connected PP ranks (``peers``: engine
        key -> tp_rank -> a rank that knows its layers)."""
        try:
            return self._coverage[engine_id]
        except KeyError:
            pass
        served = {pp: next(iter(ranks.values())).layers for (eid, pp), ranks in peers.items()
                  if eid == engine_id and ranks}
        why = self._coverage[engine_id] = coverage_problem(self.layers, served)
        return why
