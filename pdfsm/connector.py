"""The scheduler-facing API, shaped like vLLM's ``KVConnectorBase_V1`` (docs/embedding.md).

A :class:`Connector` is one worker's adapter around a sans-IO :class:`~pdfsm.core.Core`:
it stamps events with its clock, hands them to the log, lets the core apply them,
carries out the commands the machines emit through a transport and a
handshaker, and, each scheduler step, gives back what finished:

- decode side: :meth:`load` (or :meth:`start_load_kv` with a step's metadata),
  :meth:`abort`, :meth:`heartbeat`;
- prefill side: :meth:`request_finished`, which holds the blocks under a lease
  and returns the ``kv_transfer_params`` for the router;
- every step: :meth:`get_finished` and :meth:`get_block_ids_with_load_errors`,
  which report each request exactly once, with its invalid blocks in the same
  step (vLLM's contract for asynchronous loads).

Arguments are validated before anything is submitted: bad input raises
:class:`~pdfsm.errors.InvalidInput` naming the field, and nothing already
accepted is touched.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Annotated, Any, Concatenate, Final, ParamSpec, TypeVar, get_args

import msgspec
import structlog

from pdfsm.commands import (
    AddPeer,
    CancelRead,
    Command,
    DropPeer,
    FinishedSending,
    HandOff,
    PostRead,
    SendNotification,
    StartHandshake,
)
from pdfsm.consumer import S as ConsumerStates
from pdfsm.consumer import awaits_minting_stage, cancel_pending, disagreement
from pdfsm.core import Core
from pdfsm.errors import ConnectorClosed, InvalidInput, OwnerError
from pdfsm.events import (
    CONSUMER,
    PRODUCER,
    AbortRequested,
    BlocksHeld,
    Collect,
    CoreConfig,
    Deadline,
    HandleFailed,
    HandleFailure,
    HandshakeFailed,
    PeerAdded,
    Policy,
    Promised,
    ReadRequested,
    SendFailed,
    Source,
    Tick,
)
from pdfsm.log import EventLog
from pdfsm.producer import S as ProducerStates
from pdfsm.topology import MAX_KV_HEADS, MAX_RANKS, ReadPlan, TopologyError, heads_problem
from pdfsm.wire import (
    MAX_BLOCK_SIZE,
    MAX_EXTEND_NS,
    MAX_HASH_CHARS,
    MAX_ID_CHARS,
    HeartbeatMessage,
    Notification,
    every_interface,
)
from transports.base import Clock, Handshaker, Transport

__all__ = ["Connector", "ConnectorMetadata", "KVTransferParams", "StepOutput"]

_log = structlog.get_logger("pdfsm.connector")


_Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_Size = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]  # a read plan is built rank by rank
_Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
MAX_DURATION_NS: Final = 1 << 62  # a lease or a timeout: now plus it stays in the log's 64 bits
_Duration = Annotated[int, msgspec.Meta(ge=0, le=MAX_DURATION_NS)]
_MAX_BLOCK_ID = (1 << 63) - 1  # what every codec and transport index can carry
_BlockIds = tuple[Annotated[int, msgspec.Meta(ge=0, le=_MAX_BLOCK_ID)], ...]
_Incarnation = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]


# One minting of params: the engine, its request id, when and by which process they were issued.
# A request id the producer reuses (after forgetting it) mints new params, loadable afresh.
_Minting = tuple[str, str, int, str]
_FORGOTTEN_NS: Final = 10_000_000  # the issue-time slot of params forgotten while their lease ran


# A load in these states may still read, or still owes its notices (a heartbeat's promise moves them).
_STILL_READING: Final = frozenset({ConsumerStates.HANDSHAKING, ConsumerStates.READING, ConsumerStates.FAILING,
                                   ConsumerStates.ABORTING})


def _minting(p: KVTransferParams) -> _Minting:
    return (p.remote_engine_id, p.remote_request_id, p.issued_wall_ns, p.remote_incarnation)


def _slot(minting: _Minting) -> tuple[str, int]:
    """The engine and issue-time slot forgotten params are marked by once not remembered exactly."""
    return minting[0], minting[2] // _FORGOTTEN_NS


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    """What the prefill side returns and the router hands to the decode side."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str = "127.0.0.1"
    remote_port: _Port = 0
    remote_block_ids: _BlockIds = ()
    remote_tp_size: _Size  # said, never defaulted: 1 for a TP>1 producer reads the wrong ranks (vLLM router PR 191)
    remote_pp_size: _Size = 1
    lease_ns: _Duration = 0  # how long the producer holds the blocks: required by parse (0 is refused)
    # When the producer handed the params out, on its wall clock (0: not known): the decode side
    # counts the time they spent on the way (router, queues) against the lease.
    issued_wall_ns: _Duration = 0
    # The minting producer rank's transport incarnation (""): a consumer refuses params that name
    # none of the engine's current ranks (a producer restarted under the same id, smg PR 2492).
    remote_incarnation: _Incarnation = ""
    remote_incarnation_pp: _Rank | None = None  # the minting rank's PP stage (None: not said, older producers)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @classmethod
    def parse(cls, params: KVTransferParams | Mapping[str, Any]) -> KVTransferParams:
        """Typed, checked params from a router's dict or an instance (whose constructor checks no
        types or bounds); InvalidInput names the first bad field. A dict must say
        ``remote_tp_size``: defaulted to 1, vLLM's own dict (``tp_size``) or a router's that
        lost it would plan reads for the wrong ranks (vLLM router PR 191). Keys pdfsm does not
        know are ignored: routers add their own."""
        if isinstance(params, KVTransferParams):
            params = msgspec.structs.asdict(params)
        elif not isinstance(params, Mapping):
            raise InvalidInput("kv_transfer_params", f"must be a mapping or KVTransferParams, got {params!r}")
        blocks = params.get("remote_block_ids", ())
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):  # msgspec would take a set
            raise InvalidInput("remote_block_ids", f"must be a sequence of block ids (its order pairs them with "
                                                   f"the local ones), got {blocks!r}")
        known = {k: v for k, v in params.items() if k in cls.__struct_fields__}  # a router's own keys stay out
        try:
            parsed = msgspec.convert(known, cls)
        except msgspec.ValidationError as exc:
            # msgspec names the path of a bad value, or the required field that is missing
            at = re.search(r"at `\$\.(\w+)|missing required field `(\w+)`", str(exc))
            field = next(g for g in at.groups() if g) if at else "kv_transfer_params"
            if field == "remote_tp_size" and "remote_tp_size" not in params:  # it plans every read: said
                hint = " (vLLM's tp_size is pdfsm's remote_tp_size)" if "tp_size" in params else ""
                raise InvalidInput(field, f"missing from kv_transfer_params: the producer's TP size{hint}") from None
            raise InvalidInput(field, str(exc)) from None
        except UnicodeEncodeError:  # a lone surrogate, as json.loads gives for "\ud800": no message could carry it
            bad = next((k for k, v in known.items() if isinstance(v, str) and not _encodes(v)), "kv_transfer_params")
            raise InvalidInput(bad, "must be valid Unicode (no lone surrogates)") from None
        if not parsed.lease_ns:  # a read would be trusted for the whole read timeout, past a shorter lease
            raise InvalidInput("lease_ns", "missing or 0 in kv_transfer_params: the producer's lease on the blocks "
                                           "bounds how long a read of them can be trusted")
        if not parsed.remote_block_ids:  # a producer holds no request without blocks (request_finished refuses one)
            raise InvalidInput("remote_block_ids", "names no block: with no remote blocks there is nothing to "
                                                   "read and no hold to release (vLLM PR 18590: no notification "
                                                   "for such a request)")
        _check_dialable("remote_host", _check_id("remote_host", parsed.remote_host))  # "" names no listener
        if not _encodes(parsed.remote_incarnation):  # every other string is checked as an id
            raise InvalidInput("remote_incarnation", "must be valid Unicode (no lone surrogates)")
        if parsed.remote_incarnation_pp is not None and parsed.remote_incarnation_pp >= parsed.remote_pp_size:
            raise InvalidInput("remote_incarnation_pp", f"{parsed.remote_incarnation_pp} names no stage of a producer "
                                                        f"with PP {parsed.remote_pp_size}")
        return parsed


class ConnectorMetadata(msgspec.Struct, kw_only=True):
    """One scheduler step's instructions to a worker (vLLM's ``KVConnectorMetadata``)."""

    reqs_to_recv: dict[str, tuple[tuple[int, ...], KVTransferParams]] = {}
    reqs_to_send: dict[str, tuple[int, ...]] = {}
    aborted: tuple[str, ...] = ()
    # How long before this metadata was built each request of reqs_to_recv got its params (ns,
    # measured on the scheduler's own clock): a duration, so a worker on another node (another
    # CLOCK_MONOTONIC) still counts the lease right. The worker passes ``now - age`` as ``load``'s
    # ``lease_start_ns``; missing means now.
    lease_ages: dict[str, int] = {}
    # How many leading prompt blocks each request of reqs_to_recv holds locally (a prefix hit):
    # its local blocks pair with the remote ones from there. Missing: no prefix hit (``load``).
    computed_blocks: dict[str, int] = {}
    # When the scheduler decided each hold of reqs_to_send, on its wall clock (ns): one stamp that
    # every rank's hold and the params share, so notifications name their hold exactly whatever
    # the ranks' clocks say. Missing: each worker stamps its own (within CoreConfig.hold_skew_ns).
    hold_issued: dict[str, int] = {}


class StepOutput(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one :meth:`Connector.get_finished` reports; each request appears once."""

    step: int
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()  # received, failed and aborted alike
    invalid_block_ids: frozenset[int] = frozenset()
    failed: tuple[HandOff, ...] = ()  # with their policy and reason
    aborted: frozenset[str] = frozenset()
    expired: frozenset[str] = frozenset()  # producer requests released by their lease


def _requested(p: KVTransferParams, request_id: str, t_ns: int, **rest: Any) -> ReadRequested:
    """The load of ``p`` as the core sees it: what the params say, and ``rest`` (blocks, lease)."""
    return ReadRequested(source=Source.SCHEDULER, t_ns=t_ns, request_id=request_id,
                         remote_request_id=p.remote_request_id, engine_id=p.remote_engine_id, host=p.remote_host,
                         port=p.remote_port, remote_tp=p.remote_tp_size, remote_pp=p.remote_pp_size,
                         incarnation=p.remote_incarnation, incarnation_pp=p.remote_incarnation_pp,
                         issued_wall_ns=p.issued_wall_ns, **rest)


def _paired(local: tuple[int, ...], remote: tuple[int, ...], computed: int | None) -> tuple[int, ...]:
    """The remote blocks the local ones receive, position by position (vLLM PR 50558)."""
    if computed is not None:
        _check_int("computed_blocks", computed, low=0, high=_MAX_BLOCK_ID)
    if not local:  # notify-only
        return ()
    if computed is None:
        if len(local) < len(remote):
            raise InvalidInput("computed_blocks", f"{len(local)} local blocks for {len(remote)} remote ones and "
                                                  "no computed_blocks: say how many leading prompt blocks are a "
                                                  "local prefix hit, so blocks pair by position")
        computed = 0
    if computed + len(local) > len(remote):
        raise InvalidInput("local_block_ids", f"{len(local)} local blocks for {len(remote)} remote ones after "
                                              f"{computed} computed: they reach past the producer's blocks, "
                                              "positions it never computed; compute those locally")
    return remote[computed:computed + len(local)]


@contextmanager
def _naming(batch: str, rid: object) -> Iterator[None]:
    """An entry of a step refused: say which request's (the embedder fails that one and can
    resubmit the others), e.g. ``reqs_to_recv['r7'].local_block_ids``."""
    try:
        yield
    except InvalidInput as exc:
        rid_ok = rid if isinstance(rid, str) else None
        raise InvalidInput(f"{batch}[{rid!r}].{exc.field}", exc.problem, request_id=rid_ok) from None


def _owned(exc: InvalidInput, request_id: object) -> InvalidInput:
    """The error of a call about one request names it, as a step's entry does (``_naming``)."""
    if exc.request_id is None and isinstance(request_id, str):
        exc.request_id = request_id
    return exc


def _check_id(field: str, value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise InvalidInput(field, f"must be a non-empty string of at most {MAX_ID_CHARS} characters, got {value!r}")
    if not _encodes(value):  # a lone surrogate: no message or log record could carry it
        raise InvalidInput(field, f"must be valid Unicode (no lone surrogates), got {value!r}")
    return value


def _check_host(value: object) -> str:
    return "" if value == "" else _check_id("host", value)


def _check_dialable(field: str, host: str) -> None:
    """Refuse an address params name that no consumer can dial: a wildcard names every interface
    and no listener (a consumer dialling 0.0.0.0 reaches its own host, another engine's listener
    there), and a bracketed IPv6 literal no host at all (SGLang PR 10389). Checked where params
    are minted and loaded, not by every consumer's handshake."""
    if host.startswith("[") and host.endswith("]"):
        raise InvalidInput(field, f"{host!r}: write an IPv6 address without brackets ({host[1:-1]!r})")
    if every_interface(host):
        raise InvalidInput(field, f"{host!r} names every interface, not one a consumer can reach: name this "
                                  "engine's address (the side channel's host)")


def _encodes(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _check_int(field: str, value: object, *, low: int, high: int = MAX_DURATION_NS) -> int:
    if type(value) is not int or not low <= value <= high:
        raise InvalidInput(field, f"must be an int in {low}..{high}, got {value!r}")
    return value


def _index(held: dict[int, set[str]], rid: str, blocks: tuple[int, ...]) -> None:
    for block in blocks:
        holds = held.get(block)
        if holds is None:
            held[block] = {rid}
        else:
            holds.add(rid)


def _check_config(cfg: CoreConfig, transport: Transport) -> CoreConfig:
    """The config a core will run, checked now: a bad one would otherwise surface later, blamed on
    a peer's params (a rank outside our own TP size), or be copied into every report (a policy)."""
    if not isinstance(cfg, CoreConfig):
        raise InvalidInput("config", f"must be a CoreConfig, got {type(cfg).__name__}")
    _check_id("engine_id", cfg.engine_id)
    _check_id("clock", cfg.clock)
    if not isinstance(cfg.compat_hash, str) or len(cfg.compat_hash) > MAX_HASH_CHARS:  # what a handshake carries
        raise InvalidInput("compat_hash", f"must be a string of at most {MAX_HASH_CHARS} characters, "
                                          f"got {cfg.compat_hash!r:.80}")
    if not _encodes(cfg.compat_hash):  # the log's first record (Started) carries it: replay starts from it
        raise InvalidInput("compat_hash", "must be valid Unicode (no lone surrogates)")
    for name in ("tp_size", "pp_size"):
        _check_int(name, getattr(cfg, name), low=1, high=MAX_RANKS)
    _check_int("tp_rank", cfg.tp_rank, low=0, high=cfg.tp_size - 1)
    _check_int("pp_rank", cfg.pp_rank, low=0, high=cfg.pp_size - 1)
    _check_int("block_size", cfg.block_size, low=1, high=MAX_BLOCK_SIZE)
    if _check_int("kv_heads", cfg.kv_heads, low=0, high=MAX_KV_HEADS):
        if cfg.mla:  # MLA's latent is one head on every rank: a head count would say otherwise
            raise InvalidInput("kv_heads", f"must be 0 with mla (one latent head on every rank), got {cfg.kv_heads}")
        why = heads_problem(cfg.tp_size, cfg.kv_heads)
        if why is not None:
            raise InvalidInput("kv_heads", why)
    for name in ("read_timeout_ns", "lease_ns"):
        _check_int(name, getattr(cfg, name), low=1)
    for name in ("lease_margin_ns", "max_staged", "handshake_retry_ns", "handshake_timeout_ns", "tombstones",
                 "tombstone_ns", "idle_engine_ns", "hold_skew_ns", "cancel_grace_ns"):
        _check_int(name, getattr(cfg, name), low=0)
    for name in ("mla", "supports_pp", "strict"):
        if type(getattr(cfg, name)) is not bool:
            raise InvalidInput(name, f"must be a bool, got {getattr(cfg, name)!r}")
    if cfg.policy not in get_args(Policy):
        raise InvalidInput("policy", f"must be one of {get_args(Policy)}, got {cfg.policy!r}")
    if cfg.pp_rank > 0 and not transport.capabilities.supports_pp:
        raise InvalidInput("pp_rank", f"pp_rank {cfg.pp_rank} over the {transport.capabilities.name} transport, "
                                      "which has no PP support")
    _check_int("transport.capabilities.num_blocks", transport.capabilities.num_blocks, low=0)
    info = transport.rank_info()
    for name, mine, its in (("tp_rank", cfg.tp_rank, info.tp_rank), ("pp_rank", cfg.pp_rank, info.pp_rank)):
        if mine != its:
            raise InvalidInput(name, f"{mine}, but the transport serves {name} {its}")
    if cfg.supports_pp and not transport.capabilities.supports_pp:
        cfg = msgspec.structs.replace(cfg, supports_pp=False)
    return cfg


@functools.lru_cache(maxsize=16)
def _ids_below(num_blocks: int) -> Any:
    """The type of a table of ids below ``num_blocks``: msgspec checks the range in its one pass."""
    return tuple[Annotated[int, msgspec.Meta(ge=0, le=min(num_blocks - 1, _MAX_BLOCK_ID))], ...]


def _check_blocks(field: str, blocks: Sequence[int], num_blocks: int = 0) -> tuple[int, ...]:
    """The ids as a tuple, each an int in range (below ``num_blocks``, this worker's cache size,
    when it is known: an id past it would only fail a read later, or name another's memory)."""
    if num_blocks and (type(blocks) is tuple or type(blocks) is list):
        try:  # type and range in one pass, in C; a bad table is named by the checks below
            return msgspec.convert(blocks, _ids_below(num_blocks))  # type: ignore[no-any-return]
        except msgspec.ValidationError:
            pass
    out = _block_ids(field, blocks)
    if num_blocks and out and (top := max(out)) >= num_blocks:
        raise InvalidInput(field, f"block {top} is out of range: this worker's KV cache has {num_blocks} blocks "
                                  f"(ids 0..{num_blocks - 1})")
    return out


def _block_ids(field: str, blocks: Sequence[int]) -> tuple[int, ...]:
    # Fast path, in C: msgspec checks every id is exactly an int (no bool, no NumPy int) and
    # non-negative, in one pass (~18 us for 1024 ids here, against ~46 us for the type set and
    # min() it replaced, and ~115 ns per id for the loop below, which stays the reference and
    # names the first bad id).
    if type(blocks) is tuple or type(blocks) is list:
        try:
            return msgspec.convert(blocks, _BlockIds)
        except msgspec.ValidationError:
            pass
    # A sequence: its order pairs local blocks with remote ones (a set or a dict's keys has none).
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
        raise InvalidInput(field, f"must be a sequence of block ids, got {blocks!r}")
    out = tuple(blocks)
    for b in out:
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b <= _MAX_BLOCK_ID:
            raise InvalidInput(field, f"block ids must be ints in 0..2**63-1, got {b!r}")
    return out


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _one_caller(method: Callable[Concatenate[Connector, _P], _R]) -> Callable[Concatenate[Connector, _P], _R]:
    """A public method: one thread at a time, which becomes the core's owner (as in pump()). Its
    own submissions then go in over a full inbox, never waited for nor dropped as an adapter
    thread's would be (a Connector built on one thread and stepped on another). A call while
    another thread is inside one raises OwnerError and changes nothing: ownership cannot move
    in the middle of a call, where a submission would then be taken for a foreign thread's."""

    @functools.wraps(method)
    def call(conn: Connector, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        me = threading.get_ident()
        if conn._bound_to not in (None, me):  # before anything runs: the transport would refuse it part-way
            raise OwnerError(f"Connector called from thread {me}: its {conn.transport.capabilities.name} "
                             f"transport takes calls only from thread {conn._bound_to}, which built it")
        if not conn._calls.acquire(blocking=False):  # reentrant: a method may call another
            raise OwnerError(f"Connector called from thread {me} while another thread is "
                             "inside a call: one thread at a time (docs/embedding.md)")
        try:
            conn.core.log.owner = me
            return method(conn, *args, **kwargs)
        finally:
            conn._calls.release()

    return call


class Connector:
    """One worker's KV connector: the vLLM-shaped API over a core, a transport and a handshaker."""

    def __init__(
        self,
        config: CoreConfig,
        transport: Transport,
        handshaker: Handshaker,
        *,
        log: EventLog | None = None,
        clock: Clock = time.monotonic_ns,
        wall_clock: Clock = time.time_ns,
        host: str = "127.0.0.1",
        port: int = 0,
        predecessor: Connector | None = None,
    ) -> None:
        """``predecessor``: the Connector this one replaces in the same process (shut down first):
        the params it loaded stay single-use here. Without it, params the old one loaded and
        aborted (its notice let the producer release and reuse the blocks) loaded again read the
        reused blocks and were reported received."""
        config = _check_config(config, transport)
        if predecessor is not None and not predecessor._closed:
            raise InvalidInput("predecessor", "must be shut down first: its loads still run")
        for field, read in (("clock", clock), ("wall_clock", wall_clock)):
            # A float clock (time.monotonic) passed every check and raised inside the core later,
            # losing a hold already accepted; a float wall clock minted params consumers refuse.
            if not callable(read) or type(read()) is not int:
                raise InvalidInput(field, f"must be a callable returning int nanoseconds (time.monotonic_ns, "
                                          f"time.time_ns), got {read!r}")
        self.config = config
        # What the params this side mints name: checked now, not refused later by every consumer
        # ("" is allowed: a consumer-only worker mints none).
        self.host, self.port = _check_host(host), _check_int("port", port, low=0, high=65535)
        self.transport, self.handshaker = transport, handshaker
        self._clock, self._wall_clock = clock, wall_clock
        self._incarnation = transport.rank_info().incarnation  # what the params this side mints carry
        self._calls = threading.RLock()  # held by the thread inside a public method (_one_caller)
        self._bound_to = threading.get_ident() if transport.capabilities.thread_bound else None
        self.core = Core(config, log, t_ns=clock())
        transport.bind(self.core.submit, clock)
        handshaker.bind(self.core.submit, clock)
        self._step = 0
        # Cancels the transport raised on: handle -> (failures, the round to retry it in).
        self._recancel: dict[tuple[str, int, int], tuple[int, int]] = {}
        self._round = 0
        # Invalid blocks of reports get_block_ids_with_load_errors has not handed out yet (vLLM's
        # _invalid_block_ids: kept until read).
        self._invalid_unread: set[int] = set()
        self._out: list[Command] = []
        self._queued: dict[int, set[str]] = {CONSUMER: set(), PRODUCER: set()}  # submitted, not yet applied
        # Params already loaded, their minting -> (local id, their lease's end on the producer's
        # wall clock, 0: not said), the newest tombstones-many: a second read of them could copy
        # blocks the producer released after the first. A load still live when the count pushes it
        # out moves to _live_loads (never forgotten while live).
        self._loaded: OrderedDict[_Minting, tuple[str, int]] = OrderedDict()
        self._live_loads: dict[_Minting, tuple[str, int]] = {}
        self._live_swept = 0  # _live_loads' size after its last sweep
        # Params no longer remembered while their lease may still run (vLLM issue 52234: read
        # again, they read blocks the producer released and reused): the newest tombstones-many
        # exactly (minting -> lease end), older ones by producer engine and issue time to
        # _FORGOTTEN_NS (slot -> the latest lease end), refused until those leases are over. Memory
        # stays bounded: a slot mark may also refuse never-loaded params issued in the same slot.
        self._forgotten_exact: OrderedDict[_Minting, int] = OrderedDict()
        self._forgotten: dict[tuple[str, int], int] = {}
        self._forgotten_swept = 0  # its size after its last sweep
        # Params this worker heartbeated, minting -> until when (this clock) it asked the producer
        # to hold their blocks: a load of them that stops past their own lease still owes the
        # producer its notice until then (ReadRequested.promised_ns). The newest tombstones-many.
        self._promised: OrderedDict[_Minting, int] = OrderedDict()
        # Local blocks a load may still write, until its request is handed back (and id -> blocks):
        # a block handed to a second load before then could be written by both (SGLang PR 35049).
        # A set, not block -> id: a load adds and its hand-off removes its blocks in one C call
        # each; the writer is looked up only to name it in an error.
        self._writing: set[int] = set()
        self._writes: dict[str, tuple[int, ...]] = {}
        # Local blocks held for remote consumers, until their hold is reported finished sending
        # (id -> blocks). A worker both loads and holds (kv_both): no load may write a held block
        # (a consumer may be reading it), and no hold may offer a block a load may still write
        # (vLLM issue 46240). The index block -> holds (several where prefixes share blocks) is
        # built at the first load that meets a hold: a prefill-only worker never pays for it.
        self._holds: dict[str, tuple[int, ...]] = {}
        self._held: dict[int, set[str]] | None = None
        if predecessor is not None:  # its params stay single-use here, and blocks it may still write stay taken
            self._loaded.update(predecessor._loaded)
            self._loaded.update(predecessor._live_loads)
            self._forgotten_exact.update(predecessor._forgotten_exact)
            self._forgotten.update(predecessor._forgotten)
            self._promised.update(predecessor._promised)
            self._writing.update(predecessor._writing)
            self._writes.update(predecessor._writes)
        self.last = StepOutput(step=0)
        self._closed: bool = False

    def _open(self) -> None:
        if self._closed:
            raise ConnectorClosed("the Connector was shut down: nothing is accepted after shutdown()")

    # --- prefill side ---------------------------------------------------------------------------

    @_one_caller
    def request_finished(
        self, request_id: str, block_ids: Sequence[int], *, lease_ns: int | None = None,
        issued_wall_ns: int | None = None,
    ) -> KVTransferParams:
        """The request finished prefill: hold its blocks for the consumer, under a lease.

        Returns the ``kv_transfer_params`` the router passes to the decode side. The
        blocks come back in :attr:`StepOutput.finished_sending` once every consumer
        rank has read them, or once the lease expired. An id already held (or held and
        finished, while remembered) is refused: one hold per request, and so is a hold of no
        blocks (vLLM frees such a request at once and never waits for it to be sent).

        ``issued_wall_ns``: when the hold was decided, on a wall clock, the same value on every
        rank (the scheduler's stamp, say); notifications name the hold by it. The default, this
        host's wall clock now, ties the ranks' holds together only within
        ``CoreConfig.hold_skew_ns``, so ranks on hosts whose clocks differ by more should share one;
        a self-stamped hold of a producer with several ranks is held that much past its lease.
        ``lease_ns`` must be the same on every rank: the params carry the minting rank's.
        """
        self._open()
        try:
            if issued_wall_ns is not None:  # 0 would say "not said": the hold would match any notice
                _check_int("issued_wall_ns", issued_wall_ns, low=1)
            held = self._blocks_held(request_id, block_ids, lease_ns, issued_wall_ns)
        except InvalidInput as exc:
            raise _owned(exc, request_id) from None
        self._submit_hold(held)
        cfg = self.config
        return KVTransferParams(remote_engine_id=cfg.engine_id, remote_request_id=held.request_id,
                                remote_host=self.host, remote_port=self.port, remote_block_ids=held.block_ids,
                                remote_tp_size=cfg.tp_size, remote_pp_size=cfg.pp_size,
                                lease_ns=lease_ns or cfg.lease_ns, issued_wall_ns=held.issued_wall_ns,
                                remote_incarnation=self._incarnation, remote_incarnation_pp=cfg.pp_rank)

    def _blocks_held(self, request_id: str, block_ids: Sequence[int], lease_ns: int | None,
                     issued_wall_ns: int | None) -> BlocksHeld:
        rid = _check_id("request_id", request_id)
        blocks = _check_blocks("block_ids", block_ids, self.transport.capabilities.num_blocks)
        if not blocks:  # vLLM frees such a request at once; a hold of nothing would be reported as sent
            raise InvalidInput("block_ids", "no blocks to hold: a request with none is freed now, not delayed, "
                                            "and has no params to give")
        if self._writing and not self._writing.isdisjoint(blocks):  # its consumer would read bytes a read
            block = next(b for b in blocks if b in self._writing)  # still writes
            raise InvalidInput("block_ids", f"block {block} is still loaded into by {self._writer(block)!r}: "
                                            "hold it once that request is reported finished")
        if not self.host:
            raise InvalidInput("host", "this Connector was built with host='' (consumer-only): params it "
                                       "minted would name no listener to handshake with")
        _check_dialable("host", self.host)  # a consumer-only worker may be built with its bind address
        if lease_ns is not None:
            _check_int("lease_ns", lease_ns, low=1)
        self._check_fresh(rid, PRODUCER)
        now, cfg = self._clock(), self.config
        lease = cfg.lease_ns if lease_ns is None else lease_ns
        if issued_wall_ns is None and cfg.tp_size * cfg.pp_size > 1:
            if not cfg.hold_skew_ns:  # nothing bounds how much earlier this rank held than the minting one
                raise InvalidInput("issued_wall_ns", "required from every rank of a producer with several ranks "
                                                     "when CoreConfig.hold_skew_ns is 0: one stamp for the hold")
            # Self-stamped: the params a consumer counts the lease from may be another rank's,
            # minted up to hold_skew_ns after this call. Held that much longer, this rank's blocks
            # outlive every read the consumer still trusts (found by review: a rank that held
            # 3 s before the minting one released blocks a read then copied, reported received).
            lease += cfg.hold_skew_ns
        deadline = None if lease == cfg.lease_ns else Deadline(cfg.clock, now + lease)
        issued = max(self._wall_clock(), 0) if issued_wall_ns is None else issued_wall_ns
        return BlocksHeld(source=Source.SCHEDULER, t_ns=now, request_id=rid, block_ids=blocks, deadline=deadline,
                          issued_wall_ns=issued)

    # --- decode side ----------------------------------------------------------------------------

    @_one_caller
    def load(
        self,
        request_id: str,
        local_block_ids: Sequence[int],
        params: KVTransferParams | Mapping[str, Any],
        *,
        lease_start_ns: int | None = None,
        computed_blocks: int | None = None,
    ) -> None:
        """Pull a request's KV blocks from the producer named in ``params``.

        Blocks pair by prompt position: local block ``i`` receives remote block
        ``computed_blocks + i``, where ``computed_blocks`` is how many leading prompt blocks
        this side already holds (a local prefix hit). Local blocks reaching past the remote
        ones are refused (the producer never computed them). ``None`` says there was no
        prefix hit and needs as many local blocks as remote ones: a shorter list is refused,
        not guessed at (reading the last remote blocks was wrong whenever the producer held a
        block past its prompt or the decode prompt ran longer). Empty means notify-only: nothing
        is read, the producer is told it may release, and the request is not reported.
        A request id is loaded once: an id in use, queued or remembered is refused.

        ``lease_start_ns``: on this connector's clock, and not after now, the time from which
        the producer's lease of the params' ``lease_ns`` is known to run: the params'
        arrival. Reads must complete ``lease_margin_ns`` before that lease can have run
        out, or the request fails. The default, now, is right only when ``load`` runs as
        the params arrive: a request that waited in a queue first must pass its arrival
        time, or a read could be trusted after the producer already reused the blocks.
        Params that say when the producer issued them (``issued_wall_ns``) start the lease no
        later than that, their time on the way measured on this host's wall clock. A
        :meth:`heartbeat` does not move the start: nothing confirms the producer got it.
        """
        self._open()
        try:
            requested = self._read_requested(request_id, local_block_ids, params, lease_start_ns, computed_blocks)
        except InvalidInput as exc:
            raise _owned(exc, request_id) from None
        self._submit_load(*requested)

    def _read_requested(self, request_id: str, local_block_ids: Sequence[int],
                        params: KVTransferParams | Mapping[str, Any],
                        lease_start_ns: int | None, computed_blocks: int | None) -> tuple[ReadRequested, _Minting]:
        rid = _check_id("request_id", request_id)
        p = KVTransferParams.parse(params)
        _check_id("remote_request_id", p.remote_request_id)
        _check_id("remote_engine_id", p.remote_engine_id)
        local = _check_blocks("local_block_ids", local_block_ids, self.transport.capabilities.num_blocks)
        if local and p.lease_ns <= self.config.lease_margin_ns:  # failed at once, "lease may have run out"
            raise InvalidInput("lease_ns", f"{p.lease_ns} ns in the params, not longer than this worker's "
                                           f"lease_margin_ns ({self.config.lease_margin_ns} ns): a read must end "
                                           "that long before the lease, so none of them could be trusted")
        if len(set(local)) != len(local):  # two reads would race to write one block
            raise InvalidInput("local_block_ids", "a block id is repeated")
        if self._writing and not self._writing.isdisjoint(local):
            block = next(b for b in local if b in self._writing)
            raise InvalidInput("local_block_ids", f"block {block} is still loaded into by {self._writer(block)!r}: "
                                                  "it is free again once that request is reported finished")
        held = self._held_index() if self._holds else {}
        if held and not held.keys().isdisjoint(local):  # a consumer may be reading it
            block = next(b for b in local if b in held)
            raise InvalidInput("local_block_ids", f"block {block} is held for {min(held[block])!r}, whose consumer "
                                                  "may still read it: it is free again once that request is "
                                                  "reported finished sending")
        now = self._clock()
        if lease_start_ns is not None:  # before the clock's zero is a real start (a process-relative clock)
            _check_int("lease_start_ns", lease_start_ns, low=-MAX_DURATION_NS)
            if lease_start_ns > now:  # another clock's time (wall clock): it would stretch the lease
                raise InvalidInput("lease_start_ns", f"{lease_start_ns} is after now ({now}) on this connector's clock")
        if p.issued_wall_ns and p.lease_ns:
            # The params' time on the way, on the two hosts' wall clocks: a lease counted from
            # their arrival alone would run past the producer's (vLLM issue 21570). A decode clock
            # behind the producer's shortens it, by no more than the margin, which covers that skew.
            transit = self._wall_clock() - p.issued_wall_ns
            if transit > 0:
                lease_start_ns = min(now if lease_start_ns is None else lease_start_ns, now - transit)
        remote = _paired(local, p.remote_block_ids, computed_blocks)
        self._check_layout(p)
        self._check_fresh(rid, CONSUMER)
        minting = _minting(p)
        first = self._loader(minting)
        if first is not None:
            raise InvalidInput("kv_transfer_params", f"already loaded by {first!r}: params are single-use (the "
                                                     "producer may have released those blocks since)")
        if p.issued_wall_ns and (self._forgotten_exact or self._forgotten) and self._maybe_forgotten(minting):
            raise InvalidInput("kv_transfer_params", f"issued at {p.issued_wall_ns}, within {_FORGOTTEN_NS} ns of "
                                                     f"params of {p.remote_engine_id!r} forgotten while their lease "
                                                     f"still ran (more than tombstones={self.config.tombstones} "
                                                     "loads since): they may be those, already read")
        return _requested(p, rid, now, local_blocks=local, remote_blocks=remote, lease_ns=p.lease_ns,
                          lease_start_ns=lease_start_ns, promised_ns=self._promised.get(minting, 0)), minting

    @_one_caller
    def abort(self, request_id: str) -> None:
        """The scheduler aborted the request; blocks still being read stay held until the reads stop."""
        self._open()
        rid = _check_id("request_id", request_id)
        self.core.submit(AbortRequested(source=Source.SCHEDULER, t_ns=self._clock(), request_id=rid))

    @_one_caller
    def heartbeat(self, params: KVTransferParams | Mapping[str, Any], extend_ns: int) -> int:
        """Tell the producer a queued request will still be read: extend its lease by ``extend_ns``.

        Sent only to producer engines already connected, at the params' address; returns how many
        ranks were told. It keeps the producer's blocks from being reused under a read already
        running; what this side trusts still ends with the lease the params gave (a heartbeat
        lost on the way would otherwise extend a lease the producer ended, UCCL issue 1015).
        Params whose load has ended are not heartbeated (0): the producer was told, or released.
        """
        self._open()
        p = KVTransferParams.parse(params)
        _check_id("remote_request_id", p.remote_request_id)
        _check_id("remote_engine_id", p.remote_engine_id)
        _check_int("extend_ns", extend_ns, low=1, high=MAX_EXTEND_NS)  # the wire's bound: more is refused there
        plan = self._check_layout(p)
        minting = _minting(p)
        reader = self._loader(minting)
        if reader is not None and not self._reading(reader, minting):
            return 0
        # Params a connection contradicts: a load would be refused, or first handshake again (a
        # producer restarted while idle here); the connection reaches a process they may not name.
        req = _requested(p, "heartbeat", 0)
        if disagreement(req, self.core) is not None:
            return 0
        msg = HeartbeatMessage(p.remote_request_id, extend_ns, p.issued_wall_ns)
        ranks = [(s.pp_rank, s.tp_rank) for s in plan.sources] + list(plan.notify_only)
        told = tried = 0
        sent_at = self._clock()
        for pp, tp in ranks:
            # A stage told only once the one that minted the params has vouched for them, as notices are.
            if (self.core.engine_connected((p.remote_engine_id, pp), p.remote_host, p.remote_port)
                    and awaits_minting_stage(req, pp, self.core) is None):
                tried += 1
                try:
                    self.transport.send((p.remote_engine_id, pp), tp, msg)
                    told += 1
                except Exception as exc:  # noqa: BLE001 - any transport failure is reported, not raised
                    self._send_failed(p.remote_engine_id, pp, tp, p.remote_request_id, exc)
        # The promise counts once every rank was tried: one not connected (a PP stage still
        # handshaking) was asked by nobody and may release at its own lease. A send that raised
        # counts as tried, as a heartbeat lost on the way does: with decode TP above prefill TP a
        # sibling worker's heartbeat may have extended that very rank, which then waits for this
        # worker's part (found by a helper's hunt); a late notice there is a release it ignores.
        if tried == len(ranks):
            if reader is None:
                self._promise(minting, sent_at + extend_ns)
            else:  # loaded: the request carries it from here (found by a helper's hunt)
                self.core.submit(Promised(source=Source.SCHEDULER, t_ns=sent_at, request_id=reader,
                                          promised_ns=sent_at + extend_ns, engine_id=p.remote_engine_id,
                                          remote_request_id=p.remote_request_id,
                                          issued_wall_ns=p.issued_wall_ns))
        return told

    def _promise(self, minting: _Minting, until: int) -> None:
        """Remember that heartbeats asked the producer to hold these params' blocks until ``until``."""
        promised = self._promised
        promised[minting] = max(promised.pop(minting, 0), until)  # the newest heartbeat goes last
        while len(promised) > self.config.tombstones:  # a predecessor's may be more
            promised.popitem(last=False)  # lost: a stop past the lease leaves that hold to its extension

    @_one_caller
    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Everything one scheduler step asks of this worker, then one :meth:`step`.

        Every entry is checked before any is submitted: a bad one raises InvalidInput
        naming it, and the step is refused whole."""
        self._open()
        if not isinstance(metadata, ConnectorMetadata):
            raise InvalidInput("metadata", f"must be a ConnectorMetadata, got {type(metadata).__name__}")
        for name, kinds in (("reqs_to_recv", Mapping), ("reqs_to_send", Mapping), ("aborted", (tuple, list)),
                            ("lease_ages", Mapping), ("computed_blocks", Mapping),
                            ("hold_issued", Mapping)):
            value = getattr(metadata, name)
            if not isinstance(value, kinds):
                raise InvalidInput(name, f"must be a {'mapping' if kinds is Mapping else 'sequence of ids'}, "
                                         f"got {type(value).__name__}")
        loads: list[tuple[ReadRequested, _Minting]] = []
        for extra, of in (("lease_ages", "reqs_to_recv"), ("computed_blocks", "reqs_to_recv"),
                          ("hold_issued", "reqs_to_send")):
            stray = sorted(set(getattr(metadata, extra)) - set(getattr(metadata, of)), key=str)
            if stray:
                raise InvalidInput(extra, f"{stray!r} not in {of}")
        now = self._clock()
        for rid, entry in metadata.reqs_to_recv.items():
            age = metadata.lease_ages.get(rid)
            if age is not None:
                with _naming("lease_ages", rid):
                    _check_int("age", age, low=0)
            start = None if age is None else now - age  # may be before the clock's zero
            with _naming("reqs_to_recv", rid):
                if not isinstance(entry, tuple) or len(entry) != 2:
                    raise InvalidInput("entry", f"must be (local_block_ids, params), got {entry!r}")
                loads.append(self._read_requested(rid, entry[0], entry[1], start, metadata.computed_blocks.get(rid)))
        holds: list[BlocksHeld] = []
        for rid, blocks in metadata.reqs_to_send.items():
            issued = metadata.hold_issued.get(rid)
            if issued is not None:
                with _naming("hold_issued", rid):
                    _check_int("issued_wall_ns", issued, low=1)
            with _naming("reqs_to_send", rid):
                holds.append(self._blocks_held(rid, blocks, None, issued))
        aborted = [_check_id("aborted", rid) for rid in metadata.aborted]
        params: dict[_Minting, str] = {}
        writers: dict[int, str] = {}
        for ev, minting in loads:
            first = params.setdefault(minting, ev.request_id)
            if first != ev.request_id:
                raise InvalidInput(f"reqs_to_recv[{ev.request_id!r}]", f"loads the params {first!r} loads too: "
                                   "params are single-use", request_id=ev.request_id)
            for b in ev.local_blocks:
                first = writers.setdefault(b, ev.request_id)
                if first != ev.request_id:
                    raise InvalidInput(f"reqs_to_recv[{ev.request_id!r}]", f"loads into local block {b}, "
                                       f"which {first!r} loads into too", request_id=ev.request_id)
        for held in holds if writers else ():  # a load of this step into a block held in it (the checks
            block = next((b for b in held.block_ids if b in writers), None)  # above see earlier ones)
            if block is not None:
                raise InvalidInput(f"reqs_to_send[{held.request_id!r}].block_ids", f"holds local block {block}, "
                                   f"which {writers[block]!r} loads into in the same step", request_id=held.request_id)
        for ev, minting in loads:
            self._submit_load(ev, minting)
        for held in holds:
            self._submit_hold(held)
        for rid in aborted:
            self.abort(rid)
        self.step()

    def _check_layout(self, p: KVTransferParams) -> ReadPlan:
        try:
            return self.core.plan(p.remote_tp_size, p.remote_pp_size)
        except TopologyError as exc:
            raise InvalidInput("remote_pp_size" if "PP" in str(exc) else "remote_tp_size", str(exc)) from None

    def _check_fresh(self, rid: str, target: int) -> None:
        """One request per id and side: refused while the id is live, queued for the core, not
        reported finished yet, or remembered as finished (late news about it is still expected).
        A producer request that exists only because its notifications came early is waiting for
        exactly this hold."""
        core = self.core
        live: Any = (core.consumers if target == CONSUMER else core.producers).get(rid)
        if live is not None and target == PRODUCER and live.state is ProducerStates.STAGED:
            live = None
        was = core.remembered(target, rid)
        if live is not None or rid in self._queued[target]:
            raise InvalidInput("request_id", f"{rid!r} is already in use on this side "
                                             f"({live.state if live is not None else 'accepted, not stepped yet'})")
        # Its blocks are still guarded here, by id, until get_finished hands its report out (a
        # released hold; a load a predecessor left writing): a new request under the id would
        # take them over, and the report would free the new one's (found by review).
        if rid in (self._writes if target == CONSUMER else self._holds):
            raise InvalidInput("request_id", f"{rid!r} is already in use on this side (its "
                                             f"{'load' if target == CONSUMER else 'hold'} is not reported "
                                             "finished yet: its blocks are still guarded)")
        if was is not None:  # vLLM keeps an id across preemption: say why, and until when
            raise InvalidInput("request_id", f"{rid!r} finished here ({was}) and is remembered, so that late "
                                             "news of it is told from a new request's; use a new id (an id is "
                                             "free again once forgotten: CoreConfig.tombstones, tombstone_ns)")

    def _live(self, rid: str) -> bool:
        return rid in self.core.consumers or rid in self._queued[CONSUMER]

    def _reading(self, rid: str, minting: _Minting) -> bool:
        """The load ``rid`` of these params may still read, or still owes its notices: queued
        (its Promised names the params, and a later load under the id ignores it), or handshaking,
        reading or stopping. One whose reads have all stopped settled its notices then."""
        m = self.core.consumers.get(rid)
        if m is None:
            return rid in self._queued[CONSUMER]
        if m.req is not None and m.req.hold != minting[:3]:
            return False  # a later load under the id: these params' load ended
        return m.state in _STILL_READING

    def _loader(self, minting: _Minting) -> str | None:
        """The request that loaded these params, as remembered (it may have ended since)."""
        loaded = self._loaded.get(minting)
        return loaded[0] if loaded is not None else self._live_load(minting)

    def _live_load(self, minting: _Minting) -> str | None:
        """The live load of these params that the remembered count already pushed out, if any."""
        entry = self._live_loads.get(minting)
        if entry is None:
            return None
        if not self._live(entry[0]):
            del self._live_loads[minting]
            self._forget(minting, entry[1])
            return None
        return entry[0]

    def _ended_before(self) -> int:
        """Leases that ended before this (this wall clock less the margin that allows for skew
        from the producer's) are over: blocks they held may be reused, and reading them again
        reads nothing of theirs."""
        return self._wall_clock() - self.config.lease_margin_ns

    def _forget(self, minting: _Minting, end: int) -> None:
        """Params no longer remembered as loaded: if their lease may still run, remember them as
        forgotten, exactly while there is room, then by their issue-time slot."""
        over = self._ended_before()
        if not end or end < over:  # 0: the params did not say
            return
        exact = self._forgotten_exact
        exact[minting] = end
        if len(exact) <= self.config.tombstones:
            return
        minting, end = exact.popitem(last=False)
        if end < over:
            return
        slot = _slot(minting)
        self._forgotten[slot] = max(self._forgotten.get(slot, 0), end)
        if len(self._forgotten) > 2 * self._forgotten_swept + 8:  # slots whose leases ended: amortized
            self._forgotten = {k: e for k, e in self._forgotten.items() if e >= over}
            self._forgotten_swept = len(self._forgotten)

    def _maybe_forgotten(self, minting: _Minting) -> bool:
        """The params are forgotten ones, or were issued in a slot of their engine's forgotten
        params, and one of those leases may still run."""
        over = self._ended_before()
        end = self._forgotten_exact.get(minting)
        if end is not None:
            if end >= over:
                return True
            del self._forgotten_exact[minting]  # its lease is over: a reload reads nothing
        slot = _slot(minting)
        end = self._forgotten.get(slot)
        if end is None:
            return False
        if end < over:
            del self._forgotten[slot]  # every one of those leases is over: a reload reads nothing
            return False
        return True

    def _submit_load(self, ev: ReadRequested, minting: _Minting) -> None:
        self._queued[CONSUMER].add(ev.request_id)
        self._promised.pop(minting, None)  # the request carries it from here (params are single-use)
        issued = minting[2]
        self._loaded[minting] = (ev.request_id, issued + ev.lease_ns if issued else 0)
        while len(self._loaded) > self.config.tombstones:  # one at a time, but a predecessor's may be more
            key, (rid, end) = self._loaded.popitem(last=False)
            if not self._live(rid):
                self._forget(key, end)
                continue
            self._live_loads[key] = (rid, end)  # still reading: remembered exactly, marked once it ends
            if len(self._live_loads) > 2 * self._live_swept:  # amortized: bounded by the live ones
                for k, (r, e) in list(self._live_loads.items()):
                    if not self._live(r):
                        del self._live_loads[k]
                        self._forget(k, e)
                self._live_swept = len(self._live_loads)
        if ev.local_blocks:
            self._writing.update(ev.local_blocks)
            self._writes[ev.request_id] = ev.local_blocks
        self.core.submit(ev)

    def _submit_hold(self, ev: BlocksHeld) -> None:
        self._queued[PRODUCER].add(ev.request_id)
        self._holds[ev.request_id] = ev.block_ids
        if self._held is not None:
            _index(self._held, ev.request_id, ev.block_ids)
        self.core.submit(ev)

    def _writer(self, block: int) -> str:
        """The load that may still write ``block`` (one of ``_writing``), for an error's message."""
        return next((rid for rid, blocks in self._writes.items() if block in blocks), "an earlier load")

    def _held_index(self) -> dict[int, set[str]]:
        """Block -> the holds of it, built when first asked (a hold submitted here always ends
        reported finished sending: its id was checked fresh, so the core never refuses it)."""
        if self._held is None:
            self._held = {}
            for rid, blocks in self._holds.items():
                _index(self._held, rid, blocks)
        return self._held

    def _unhold(self, rid: str) -> None:
        blocks = self._holds.pop(rid, ())
        if self._held is None:
            return
        for block in blocks:  # a hold may name a block twice (vLLM's null block): gone at the first
            holds = self._held.get(block)
            if holds is not None:
                holds.discard(rid)
                if not holds:
                    del self._held[block]

    # --- every step -----------------------------------------------------------------------------

    @_one_caller
    def step(self, rounds: int = 16) -> None:
        """Apply what is queued, carry out the commands, poll the transport, fire due timers.

        Owner thread only. Repeats while events keep arriving, at most ``rounds`` times.
        """
        self._open()
        _check_int("rounds", rounds, low=1, high=1 << 20)
        core = self.core
        for _ in range(rounds):
            self._round += 1
            core.pump()
            for queued in self._queued.values():  # applied: live or remembered from now on
                queued.clear()
            self._execute(core.take_commands())
            if self._recancel:
                self._retry_cancels()
            for part in (self.transport, self.handshaker):
                try:
                    part.progress()
                except Exception:  # noqa: BLE001 - as in _execute: logged; what it owed is polled next round
                    _log.exception("progress failed", part=type(part).__name__)
            due = core.next_deadline()
            if due is not None:
                now = self._clock()
                if due <= now:
                    core.submit(Tick(source=Source.TIMER, t_ns=now))
            if not core.log.inbox:
                break

    @_one_caller
    def get_finished(self, finished_req_ids: Iterable[str] = ()) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) since the last call: each request once.

        Failed and aborted consumer requests are among those finished receiving;
        :meth:`get_block_ids_with_load_errors` has the failed ones' blocks for this
        same step, and :attr:`last` the details. ``finished_req_ids`` is vLLM's argument,
        accepted and not used: pdfsm knows which requests finished (``request_finished``,
        ``abort``) from the calls that said so.
        """
        self._open()
        self.step()
        self._step += 1
        if self.core.pending_hand_offs:  # a collect with nothing to hand back would only fill the log
            self.core.submit(Collect(source=Source.SCHEDULER, t_ns=self._clock(), step=self._step))
            self.step()
        out, self._out = self._out, []
        sending, expired, recving, aborted = set(), set(), set(), set()
        failed: list[HandOff] = []
        invalid: set[int] = set()
        for cmd in out:
            # A report frees its blocks (for load's checks, and held()) as it is handed out, not as
            # the step queued it: the scheduler frees them only once it sees it (a helper's hunt).
            if isinstance(cmd, FinishedSending):
                self._unhold(cmd.request_id)
                sending.add(cmd.request_id)
                if cmd.expired:
                    expired.add(cmd.request_id)
            elif isinstance(cmd, HandOff):
                self._writing.difference_update(self._writes.pop(cmd.request_id, ()))
                recving.add(cmd.request_id)
                invalid.update(cmd.invalid_blocks)
                if cmd.outcome == "failed":
                    failed.append(cmd)
                elif cmd.outcome == "aborted":
                    aborted.add(cmd.request_id)
        self.last = StepOutput(step=self._step, finished_sending=frozenset(sending),
                               finished_recving=frozenset(recving), invalid_block_ids=frozenset(invalid),
                               failed=tuple(failed), aborted=frozenset(aborted), expired=frozenset(expired))
        self._invalid_unread |= invalid
        return sending, recving

    def held(self) -> dict[str, tuple[int, ...]]:
        """This worker's producer holds not yet reported finished sending (released or expired):
        request id -> its blocks (a copy; a hold leaves it as :meth:`get_finished` reports it). After
        :meth:`shutdown`, the holds it left, whose blocks the scheduler frees itself."""
        return dict(self._holds)

    @_one_caller
    def busy(self) -> bool:
        """Work only this worker's steps move is left: a consumer request not reported yet (or a
        notify-only one still telling its producer), a producer hold not released or expired yet,
        events, hand-offs or cancels not carried out yet, reports not handed out yet. Keep calling
        :meth:`get_finished` while it is true, also when the scheduler tracks no request: a
        notify-only load's handshake and its notices move only inside a step, and its producer
        would hold the blocks until its lease (found by a helper's hunt). False once shut down."""
        core = self.core
        return not self._closed and bool(core.consumers or core.producers or core.pending_hand_offs or self._out
                                         or core.log.inbox or self._recancel or any(self._queued.values()))

    @_one_caller
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks of the requests :meth:`get_finished` reported failed, and of those it
        reported aborted whose reads did not all complete in time, not handed out yet: each block
        once, then empty until a report has more, as vLLM's connectors keep their set until read.
        Ask after :meth:`get_finished`, in the same step (vLLM's worker does): asked before it, the
        answer is the earlier reports', and a failed request just reported is not in it yet
        (:attr:`last` has each report's own). A second :meth:`get_finished` before asking loses
        nothing (found by a helper's hunt: it overwrote the first report's blocks). It still
        answers after :meth:`shutdown`, the same way: the last report's blocks once (handed out
        again, they marked a restarted successor's blocks invalid)."""
        out, self._invalid_unread = self._invalid_unread, set()
        return out

    @_one_caller
    def shutdown(self) -> StepOutput:
        """Stop, and report every consumer request not reported yet, one last time: those still
        handshaking or reading are aborted (their reads cancelled, their blocks invalid unless
        every read completed). Returns that last report (also in :attr:`last`); nothing is
        reported after it, and the log is flushed and closed. Producer requests still held
        are not reported: the scheduler frees their blocks as it stops. Every later call
        raises :class:`~pdfsm.errors.ConnectorClosed` but this one, which returns the same."""
        if self._closed:
            return self.last
        try:
            try:
                self._wind_down()
            finally:  # whatever happened (a full disk): no read writes blocks the embedder is about to free
                self._close_parts()
            self.get_finished()
        except BaseException:
            # Nothing can be reported: closed all the same, the log too (it was left open, and
            # later calls accepted), and no earlier report is handed out again as this one's
            # (its invalid blocks went back to the scheduler already). Found by review.
            self._closed = True
            self.last = StepOutput(step=self.last.step + 1)
            try:
                self.core.log.close()
            except Exception as exc:  # noqa: BLE001 - the first error is the one raised
                _log.warning("log close failed", error=f"{type(exc).__name__}: {exc}")
            raise
        self._closed = True
        self.core.log.close()
        return self.last

    def _wind_down(self) -> None:
        """Shutdown's steps: abort what still handshakes or reads, then end the reads a cancel did
        not stop (NIXL's "wait" policy) while the transport can still send, so the requests they
        held tell their producers at the next step; otherwise each producer waits out a lease and
        blames us (found by review)."""
        self.step()  # requests loaded this step are applied first: they are aborted like the rest
        waiting = (ConsumerStates.HANDSHAKING, ConsumerStates.READING)
        for rid in [rid for rid, m in self.core.consumers.items() if m.state in waiting]:
            self.abort(rid)
        self.step()
        stop_reads = getattr(self.transport, "stop_reads", None)  # one written before it: close() does
        with self.core.log.owner_waiting():
            try:
                if stop_reads is not None:
                    stop_reads()
            except Exception:  # noqa: BLE001 - close() still stops them; the error is logged
                _log.exception("stop_reads failed", part=type(self.transport).__name__)
        self.step()

    def _close_parts(self) -> None:
        with self.core.log.owner_waiting():  # their threads report as they stop: never wait for room
            for part in (self.handshaker, self.transport):
                try:
                    part.close()
                except Exception:  # noqa: BLE001 - the last report matters more; the error is logged
                    _log.exception("close failed", part=type(part).__name__)

    # --- carrying out commands ------------------------------------------------------------------

    def _execute(self, cmds: list[Command]) -> None:
        submit, now = self.core.submit, self._clock
        for cmd in cmds:
            try:
                if isinstance(cmd, PostRead):
                    try:
                        self.transport.post_read(cmd)
                    except Exception as exc:  # noqa: BLE001 - a read that cannot start is a SETUP failure
                        src = cmd.source
                        submit(HandleFailed(source=Source.TRANSFER, t_ns=now(), request_id=cmd.request_id,
                                            pp_rank=src.pp_rank, tp_rank=src.tp_rank, why=HandleFailure.SETUP,
                                            detail=f"{type(exc).__name__}: {exc}"))
                elif isinstance(cmd, (HandOff, FinishedSending)):
                    self._out.append(cmd)  # its blocks stay guarded until get_finished hands it out
                elif isinstance(cmd, SendNotification):
                    self._send(cmd.engine_id, cmd.pp_rank, cmd.tp_rank, cmd.notification)
                elif isinstance(cmd, CancelRead):
                    self._cancel((cmd.request_id, cmd.pp_rank, cmd.tp_rank))
                elif isinstance(cmd, StartHandshake):
                    try:
                        self.handshaker.start(cmd)
                    except Exception as exc:  # noqa: BLE001 - a handshake that cannot start has failed
                        submit(HandshakeFailed(source=Source.HANDSHAKE, t_ns=now(), engine_id=cmd.engine_id,
                                               pp_rank=cmd.pp_rank, attempt=cmd.attempt,
                                               error=f"handshake could not start: {type(exc).__name__}: {exc}"))
                elif isinstance(cmd, AddPeer):
                    try:
                        self.transport.add_peer((cmd.engine_id, cmd.pp_rank), cmd.reply, cmd.attempt)
                    except Exception as exc:  # noqa: BLE001 - the transport refused the peer
                        submit(HandshakeFailed(source=Source.HANDSHAKE, t_ns=now(), engine_id=cmd.engine_id,
                                               pp_rank=cmd.pp_rank, attempt=cmd.attempt,
                                               error=f"transport refused the peer: {exc}"))
                    else:
                        submit(PeerAdded(source=Source.HANDSHAKE, t_ns=now(), engine_id=cmd.engine_id,
                                         pp_rank=cmd.pp_rank, attempt=cmd.attempt))
                elif isinstance(cmd, DropPeer):
                    self.transport.drop_peer((cmd.engine_id, cmd.pp_rank))
            except Exception:  # noqa: BLE001 - a transport bug must not take the engine down; it is logged
                _log.exception("command failed", command=type(cmd).__name__)

    def _cancel(self, handle: tuple[str, int, int]) -> None:
        """A cancel that raises is retried while its read is still in flight, after 2, 4, ... 1024
        rounds: one lost cancel would otherwise leave a hung read, and its request, stopping for
        ever. Logged at its 1st, 2nd, 4th, ... failure, not every round."""
        try:
            self.transport.cancel_read(*handle)
        except Exception:  # noqa: BLE001 - logged, kept for a later round
            failures = self._recancel.get(handle, (0, 0))[0] + 1
            self._recancel[handle] = (failures, self._round + min(2 ** failures, 1024))
            if not failures & (failures - 1):
                _log.exception("cancel failed", request_id=handle[0], pp_rank=handle[1], tp_rank=handle[2],
                               failures=failures)
        else:
            self._recancel.pop(handle, None)

    def _retry_cancels(self) -> None:
        for handle, (_, due) in list(self._recancel.items()):
            m = self.core.consumers.get(handle[0])
            if m is None or not cancel_pending(m, handle[1], handle[2]):
                del self._recancel[handle]
            elif due <= self._round:
                self._cancel(handle)

    def _send(self, engine_id: str, pp_rank: int, tp_rank: int, note: Notification) -> None:
        try:
            self.transport.send((engine_id, pp_rank), tp_rank, note)
        except Exception as exc:  # noqa: BLE001 - the producer's lease will release it
            self._send_failed(engine_id, pp_rank, tp_rank, note.request_id, exc)

    def _send_failed(self, engine_id: str, pp_rank: int, tp_rank: int, request_id: str, exc: Exception) -> None:
        self.core.submit(SendFailed(source=Source.NOTIFY, t_ns=self._clock(), engine_id=engine_id, pp_rank=pp_rank,
                                    tp_rank=tp_rank, request_id=request_id, error=f"{type(exc).__name__}: {exc}"))
