"""Engine-id sync: every worker of one engine answers handshakes with one engine id.

A decode worker learns a prefill engine's id from the router (rank 0's
``kv_transfer_params``) and refuses any handshake reply that names another id
(:class:`~pdfsm.errors.EngineIdMismatch`). When each node of a multi-node TP
engine draws its own random id, every handshake with a rank on another node than
rank 0's fails that check (vLLM PR 39907; issue 27083 is the same check catching
a reply from the wrong listener). The cure is to make the id one per engine, not
one per node: before the transport starts, every rank adopts rank ``src``'s id.

::

    cfg = CoreConfig(engine_id=sync_engine_id(new_engine_id("prefill"), tp_group), ...)
    # or, equivalently:
    cfg = engine_config(group=tp_group, tp_rank=..., tp_size=..., compat_hash=...)

**Which group.** The group must be exactly the workers of one engine: those whose
metadata one handshake reply carries, i.e. the ranks that share one
``(engine_id, pp_rank)`` key space. Pass the engine's TP group (the default
advice: it is always one engine's); pass ``group=None`` (the default, i.e. world,
group) when the world is a single engine, which is also what a PP engine whose
stages sit on different nodes needs (every PP stage must report the same id, and
a TP group holds one stage only). Never a group spanning several engines (DP
replicas), which would merge their ids. ``src`` is a rank *within the group*.

**How.** Three collectives, all on every rank, whatever the arguments:

1. an ``all_reduce(MAX)`` of eight int64 values (the highest group rank whose id
   was refused, plus one; the same for ``src`` outside the group; ``src``;
   ``-src``; the same as the first for a ``device`` that rank cannot use; the
   ``fingerprint``'s digest and its negation; the same as the first for a
   fingerprint that is refused: no integer, or a layout that cannot be digested),
   so every rank learns whether any rank's id,
   ``src`` or device was refused or the ranks disagree on ``src`` or the
   fingerprint, and then *all* of them raise
   :class:`~pdfsm.errors.InvalidInput`, none waiting in a collective the others
   skipped;
2. a ``broadcast`` from ``src`` of a fixed-size ``uint8`` tensor: a big-endian
   u32 byte length, then the UTF-8 bytes, zero-padded to :data:`MAX_ID_BYTES`;
3. an ``all_gather`` of one int64 per rank (whether it could read the broadcast),
   the acknowledgement: no rank returns the id before every rank got through step 2,
   so a rank lost before step 3 fails every survivor. One lost inside step 3 can
   still leave some ranks returning and others raising: nothing can close that
   window, so an :class:`~pdfsm.errors.EngineSyncError` on any rank means the
   engine must be torn down.

Object collectives (``broadcast_object_list`` and friends) are never used: they
pickle, and nothing pdfsm receives is unpickled. torch is imported lazily, so
``pdfsm`` itself does not need it.
"""

from __future__ import annotations

import hashlib
import operator
import struct
import uuid
from typing import TYPE_CHECKING, Any, Final, SupportsIndex

import structlog

from pdfsm.errors import EngineSyncError, InvalidInput, PdfsmError
from pdfsm.events import CoreConfig
from pdfsm.wire import MAX_ID_CHARS

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["MAX_ID_BYTES", "engine_config", "new_engine_id", "sync_engine_id"]

MAX_ID_BYTES: Final = 4 * MAX_ID_CHARS
"""The payload of the broadcast: any id of at most ``MAX_ID_CHARS`` characters fits in UTF-8."""

_LENGTH: Final = struct.Struct("!I")
_BUFFER_BYTES: Final = _LENGTH.size + MAX_ID_BYTES

_log = structlog.get_logger("pdfsm.enginesync")


def new_engine_id(prefix: str = "engine") -> str:
    """A fresh random engine id, ``"<prefix>-<32 hex digits>"`` (uuid4); only ``src``'s survives a sync."""
    if not isinstance(prefix, str) or len(prefix) + 33 > MAX_ID_CHARS:
        raise InvalidInput("prefix", f"must be a string of at most {MAX_ID_CHARS - 33} characters, got {prefix!r}")
    hex_id = uuid.uuid4().hex
    return f"{prefix}-{hex_id}" if prefix else hex_id


def _encode(engine_id: object) -> bytes | str:
    """The id's UTF-8 bytes, or why it is refused."""
    if not isinstance(engine_id, str):
        return f"must be a string, got {type(engine_id).__name__}"
    if not 0 < len(engine_id) <= MAX_ID_CHARS:
        return f"must be 1 to {MAX_ID_CHARS} characters, got {len(engine_id)}"
    try:
        return engine_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not encodable as UTF-8: {exc.reason} at index {exc.start}"


def _pack(raw: bytes) -> bytes:
    return _LENGTH.pack(len(raw)) + raw + bytes(MAX_ID_BYTES - len(raw))


def _unpack(buffer: bytes, group_rank: int) -> str:
    """``src``'s id from the broadcast buffer; a garbled one means the group's collectives are out of step."""
    (n,) = _LENGTH.unpack_from(buffer)
    try:
        if not 0 < n <= MAX_ID_BYTES:
            raise PdfsmError(f"the engine-id broadcast carried a length of {n} bytes: "
                             "the group's collectives are out of step")
        return buffer[_LENGTH.size:_LENGTH.size + n].decode("utf-8")
    except (PdfsmError, UnicodeDecodeError) as exc:
        raise EngineSyncError("broadcast", group_rank, exc) from exc


_FINGERPRINTS: Final = 1 << 62  # fingerprint digests are below this: f and -f both fit an int64
_SHARED_FIELDS: Final = ("tp_size", "pp_size", "mla", "kv_heads", "block_size", "compat_hash")


def _as_int(value: Any) -> int | None:
    """``value`` as an int (numpy's and torch's too), or None. Never raises: this rank must still vote."""
    try:
        return operator.index(value)
    except Exception:  # noqa: BLE001 - not only TypeError: a user's __index__ may raise anything
        return None


def _int_bytes(n: int) -> bytes:
    """Any integer's two's-complement bytes: str() refuses one over 4300 digits (ValueError)."""
    return n.to_bytes((n.bit_length() + 8) // 8, "big", signed=True)


def _show(value: object) -> str:
    """repr() for an error message, which must not fail itself (an int over 4300 digits, a bad __repr__)."""
    try:
        return repr(value)
    except Exception as exc:  # noqa: BLE001
        return f"a {type(value).__name__} that repr() refuses ({type(exc).__name__})"


def _layout_fingerprint(fields: dict[str, Any]) -> int | str:
    """A number every rank of one engine computes alike from the layout fields it must share (its
    peers read every rank with one plan), whatever the rank: a rank that differs is caught in the
    sync's first collective, on every rank, instead of by a peer's reads going wrong. Or why this
    rank's layout cannot be compared: it is refused in that collective too, never raised before it."""
    defaults = CoreConfig(engine_id="x")
    digest = hashlib.blake2b(digest_size=8)
    for name in _SHARED_FIELDS:
        value = fields.get(name, getattr(defaults, name))
        n = _as_int(value)  # integers by value, whatever their size or type (16 == numpy's 16)
        try:
            part = b"i" + _int_bytes(n) if n is not None else b"r" + repr(value).encode("utf-8", "backslashreplace")
        except Exception as exc:  # noqa: BLE001 - a bad __repr__ on one rank must not split the group
            return f"layout field {name} cannot be compared: {type(exc).__name__}: {exc}"
        digest.update(_LENGTH.pack(len(part)) + part)  # length-prefixed: no two layouts run together alike
    return int.from_bytes(digest.digest()) % _FINGERPRINTS


def _digest(n: int) -> int:
    """A 62-bit digest of any integer: two that differ (by 2**62 too) differ here but by chance."""
    return int.from_bytes(hashlib.blake2b(_int_bytes(n), digest_size=8).digest()) % _FINGERPRINTS


def _default_device(dist: Any, group: ProcessGroup | None) -> torch.device:
    import torch

    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def sync_engine_id(
    engine_id: str,
    group: ProcessGroup | None = None,
    *,
    src: SupportsIndex = 0,
    device: str | torch.device | None = None,
    fingerprint: SupportsIndex = 0,
) -> str:
    """Every rank of ``group`` adopts group rank ``src``'s engine id, which is returned on every rank.

    Call it on every rank of the group, before the transport starts and before the
    id is used anywhere (a ``CoreConfig``, a side-channel listener, the params a
    router sees). ``group`` is the engine's TP group, or ``None`` for the default
    (world) group when the world is one engine (module docstring). ``device`` is
    where the small tensors live; by default the CPU for gloo (and MPI) groups, the
    current CUDA device otherwise (NCCL). With vLLM, prefer a CPU group
    (``get_tp_group().cpu_group``).

    Raises :class:`~pdfsm.errors.InvalidInput` on *every* rank of the group, and
    none adopts an id, when any rank's ``engine_id`` is not 1 to ``MAX_ID_CHARS``
    characters of UTF-8-encodable text (a non-source rank's too: it is a
    misconfiguration even though its id would be replaced), when any rank's ``src``
    is not a rank of the group (any integer type: numpy's and torch's too), or when
    the ranks name different ``src``: the ranks agree on that in a first collective,
    so none is left waiting in the broadcast. The same holds when any rank's
    ``device`` cannot be used there (a GPU that node lacks: it votes from its default
    device instead, which a gloo group accepts), and when the ranks pass different
    ``fingerprint`` values (any integer, of any size, that must be the same on every
    rank: :func:`engine_config` passes its layout's). Only this rank raises, before
    any collective, when torch.distributed is not initialized or this rank is not in
    ``group`` (it takes no part in the group's collectives then).

    A rank that never calls it, or dies in it, leaves the others raising
    :class:`~pdfsm.errors.EngineSyncError` (naming the collective) at the group's
    timeout or when the backend notices. A final acknowledgement makes every survivor
    raise when a rank is lost before it, but a rank lost *inside* it can leave some
    ranks with the id returned and others raising (no protocol closes that window):
    an ``EngineSyncError`` on any rank means the whole engine must be torn down.
    """
    n = _as_int(fingerprint)
    why = f"must be an integer: got {_show(fingerprint)}"
    return _sync(engine_id, group, src, device, _digest(n) if n is not None else why)


def _sync(
    engine_id: str,
    group: ProcessGroup | None,
    src: SupportsIndex,
    device: str | torch.device | None,
    fingerprint: int | str,
) -> str:
    """:func:`sync_engine_id`, ``fingerprint`` being a 62-bit digest or why this rank's is refused."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("sync_engine_id needs torch with torch.distributed (pdfsm[torch])") from exc
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInput("group", "torch.distributed is not initialized: call init_process_group first")
    me, size = dist.get_rank(group), dist.get_world_size(group)
    if me < 0:
        raise InvalidInput("group", "this rank is not a member of the group")
    bad_device = ""
    try:
        dev = torch.device(device) if device is not None else _default_device(dist, group)
        if dev.type == "meta":  # takes part in no collective: the others would wait for it
            raise ValueError("the meta device holds no data")
        torch.empty(1, device=dev)
    except Exception as exc:  # noqa: BLE001 - a CUDA device this node lacks, a backend not installed (hpu)
        dev, bad_device = _default_device(dist, group), f"{type(exc).__name__}: {exc}"

    # 1. Agree, so that every rank raises or none does (no rank left waiting in step 2).
    encoded = _encode(engine_id)
    # numpy's and torch's integers too; True is no rank, nor a torch bool tensor (which __index__ takes)
    boolean = isinstance(src, bool) or getattr(src, "dtype", None) is torch.bool
    index = None if boolean else _as_int(src)
    bad_src = index is None or not 0 <= index < size
    s = 0 if index is None or bad_src else index
    bad_fingerprint = isinstance(fingerprint, str)
    f = 0 if isinstance(fingerprint, str) else fingerprint  # below 2**62: f and -f both fit an int64
    verdict = torch.tensor([me + 1 if isinstance(encoded, str) else 0, me + 1 if bad_src else 0, s, -s,
                            me + 1 if bad_device else 0, f, -f, me + 1 if bad_fingerprint else 0],
                           dtype=torch.int64, device=dev)
    try:
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as exc:  # torch's timeout and broken-peer errors (DistBackendError is one)
        raise EngineSyncError("agreement (all_reduce)", me, exc) from exc
    id_rank, src_rank, high, low, dev_rank, f_high, f_low, f_rank = (int(v) for v in verdict.tolist())
    if dev_rank:
        why = f"{bad_device} (group rank {me})" if bad_device else f"refused on group rank {dev_rank - 1}"
        raise InvalidInput("device", f"{why}; no rank adopted an id")
    if src_rank:
        why = f"got {_show(src)}" if bad_src else f"group rank {src_rank - 1} named one outside it"
        raise InvalidInput("src", f"must be a rank of the group, 0 to {size - 1}: {why}; no rank adopted an id")
    if high != -low:
        raise InvalidInput("src", f"the ranks of the group name different sources ({-low} to {high}); "
                                  "no rank adopted an id")
    if f_rank:
        why = f"{fingerprint} (group rank {me})" if bad_fingerprint else f"refused on group rank {f_rank - 1}"
        raise InvalidInput("fingerprint", f"{why}; no rank adopted an id")
    if f_high != -f_low:
        raise InvalidInput("fingerprint", "the ranks of the group differ (one engine's ranks must share its "
                                          "layout: tp_size, pp_size, mla, kv_heads, block_size, "
                                          "compat_hash); no rank adopted an id")
    if id_rank:
        if isinstance(encoded, str):
            raise InvalidInput("engine_id", f"{encoded} (group rank {me}); no rank adopted an id")
        raise InvalidInput("engine_id", f"refused on group rank {id_rank - 1} (see its error); "
                                        "no rank adopted an id")
    assert isinstance(encoded, bytes)

    # 2. Broadcast src's id: a fixed-size, length-prefixed UTF-8 byte tensor (never pickled).
    payload = _pack(encoded) if me == s else bytes(_BUFFER_BYTES)
    buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
    try:
        dist.broadcast(buffer, src=s if group is None else dist.get_global_rank(group, s), group=group)
    except RuntimeError as exc:
        raise EngineSyncError("broadcast", me, exc) from exc
    try:
        adopted, unread = _unpack(bytes(buffer.cpu().tolist()), me), None
    except EngineSyncError as exc:
        adopted, unread = "", exc

    # 3. Acknowledge: no rank completes this without every rank's part, so none returns before every
    # rank got through the broadcast and read it, and a rank lost before this point fails every
    # survivor, never only some (one lost inside it still can split them: the docstring says so).
    mine = torch.tensor([me + 1 if unread else 0], dtype=torch.int64, device=dev)
    parts = [torch.zeros_like(mine) for _ in range(size)]
    try:
        dist.all_gather(parts, mine, group=group)
    except RuntimeError as exc:
        raise EngineSyncError("acknowledgement (all_gather)", me, exc) from exc
    if unread:
        raise unread
    if failed := max(int(p) for p in parts):
        cause = PdfsmError(f"group rank {failed - 1} could not read the broadcast id")
        raise EngineSyncError("acknowledgement (all_gather)", me, cause)
    _log.info("engine id synced", engine_id=adopted, own=engine_id, group_rank=me, group_size=size, src=s)
    return adopted


def engine_config(
    engine_id: str | None = None,
    *,
    group: ProcessGroup | None = None,
    sync: bool = True,
    src: SupportsIndex = 0,
    device: str | torch.device | None = None,
    **fields: Any,
) -> CoreConfig:
    """A :class:`~pdfsm.events.CoreConfig` whose engine id is one per engine.

    ``engine_id`` defaults to :func:`new_engine_id`; with ``sync`` (the default) it
    goes through :func:`sync_engine_id` over ``group`` first, so call this on every
    rank of the group. ``fields`` are the other ``CoreConfig`` fields; the config is
    built after the collectives, so a bad field on one rank cannot leave the
    others waiting in them.
    """
    eid = new_engine_id() if engine_id is None else engine_id
    if sync:
        eid = _sync(eid, group, src, device, _layout_fingerprint(fields))
    elif isinstance(problem := _encode(eid), str):
        raise InvalidInput("engine_id", problem)
    try:
        return CoreConfig(engine_id=eid, **fields)
    except TypeError as exc:
        raise InvalidInput("fields", str(exc)) from None
