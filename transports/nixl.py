"""The NIXL transport: KV blocks move by NIXL READs (UCX backend), notifications ride on them.

One :class:`NixlTransport` is one worker's NIXL agent. It registers the worker's KV
cache, a list of tensors each shaped ``[num_blocks, ...]`` (block ``b`` of region
``k`` is ``kv_caches[k][b]``, contiguous), and publishes, in its
:class:`~pdfsm.events.RankInfo`, a *typed* metadata blob: msgspec MessagePack of
NIXL's agent metadata bytes and, per region, base address, block stride, block
count, device id and memory kind. NIXL's own descriptor-list serialisation
pickles; nothing here does, and nothing received is ever unpickled.

Reads. :meth:`post_read` turns a :class:`~pdfsm.commands.PostRead` into one NIXL
READ from the remote rank, honouring the TP slices of :class:`~pdfsm.topology.ReadSource`
(only one slice of each block moves when TP sizes differ), and passes the encoded
:class:`~pdfsm.wire.Notification` as the READ's ``notif_msg``: NIXL delivers it to
the producer only once the READ completed (NIXL PR 252), so the producer never
releases blocks that are still being read. Two ways to describe a read
(``xfer_mode``):

- ``"prepped"`` (default): per peer rank and slice geometry, every block of every
  region is prepared once (``prep_xfer_dlist``), and a read is
  ``make_prepped_xfer`` with region-major block indices; NIXL merges indices that
  are adjacent on both sides into one descriptor, the same runs
  :mod:`transports.coalesce` finds (checked: NIXL's telemetry counts one
  descriptor for a contiguous table of one region).
- ``"descs"``: the block table is coalesced in Python
  (:func:`transports.coalesce.read_descs`) and posted with
  ``get_xfer_descs`` + ``initialize_xfer``. Kept for comparison and for backends
  that cannot prepare lists.

  Setting a read up (``benchmarks/transport.py``, 16 regions of 4 KiB blocks, median):
  prepped 40-120 us for 16 to 1024 contiguous blocks and 60-780 us shuffled; descs
  140-500 us and 230-1850 us. Bandwidth is the same either way (both end up with the
  same merged descriptors), so ``"prepped"`` is the default.

Outcomes. :meth:`progress`, on the owner thread every step, polls each read in
flight with ``check_xfer_state``: ``DONE`` becomes
:class:`~pdfsm.events.HandleDone`, ``ERR`` ``HandleFailed(ERR)``, and a poll that
*raises* becomes ``HandleFailed(RAISED)``, or ``HandleFailed(DISCONNECTED)`` plus
one :class:`~pdfsm.events.PeerDisconnected` for the engine when NIXL says the peer
is gone: an exception never escapes (vLLM PR 28120). It also drains
``get_new_notifs`` and submits every message through
:func:`pdfsm.wire.notification_event` (undecodable bytes become a ``BadMessage``
attributed to the sender).

Cancel rule (``cancel_policy``). A cancelled read is reported
``HandleFailed(CANCELLED)`` only once no byte can still land in its local blocks:

- ``"wait"`` (default): the handle stays in flight and is polled until NIXL says
  it ended; ``DONE`` is then reported as ``HandleDone`` (the bytes are in place and
  the producer was notified), anything else as ``CANCELLED``. NIXL's release of an
  active handle is a best effort (its UCX backend cancels the UCX requests with a
  TODO that this "may not be enough"; an RDMA NIC can still be writing), so this
  policy never trusts it: correct by construction, at the price that a peer that
  hangs without an error (SIGSTOP) keeps the request, and its blocks, until it
  resumes or dies.
- ``"release"``: the handle is released at once (NIXL's documented way to cancel
  an active transfer); if NIXL accepts, the read is reported ``CANCELLED``
  immediately; if NIXL refuses (it raises), the read is polled as under ``"wait"``.
  This trusts NIXL's cancel to have stopped the data movement, which pdfsm cannot
  check: use it only where that is known to hold.

Drop rule. :meth:`drop_peer` forgets the engine at once (no new read or
notification can target it), but calls ``remove_remote_agent`` only once no read
of ours to that peer is alive; until then the peer is *draining* and removed by
:meth:`progress` after its last read ended (vLLM PR 54689: tearing a peer down
under a READ killed workers). Re-adding an agent that is still draining is refused
(the handshake fails and is retried).

Threading. NIXL's agent is not guaranteed thread-safe (SGLang PR 28897), so every
NIXL call happens on the owner thread: the thread that called :meth:`bind` (or
built the transport). Every method but :meth:`rank_info` and :meth:`bind` checks it
and raises
:class:`~transports.base.TransportError` from any other thread; :meth:`rank_info`
makes no NIXL call (the metadata is built once, at construction) so a handshake
listener thread may call it. No lock is taken. NIXL's progress thread (on by
default) only advances UCX inside the agent; it never calls into this object.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt
import structlog
import torch

from pdfsm.commands import PostRead
from pdfsm.events import (
    EngineKey,
    HandleDone,
    HandleFailed,
    HandleFailure,
    HandshakeReply,
    PeerDisconnected,
    RankInfo,
    Source,
)
from pdfsm.wire import NotifyMessage, notification_event, notify_codec
from transports.base import Capabilities, Clock, Submit, TransportError, new_incarnation, refuse_pp
from transports.coalesce import Region, SliceError, read_descs, read_indices, slice_span
from transports.layers import LayerError, LayerMap, check_layers

__all__ = [
    "MAX_METADATA_BYTES",
    "NixlRankMetadata",
    "NixlTransport",
    "RegionInfo",
    "decode_rank_metadata",
    "import_nixl",
    "nixl_available",
]

_log = structlog.get_logger("pdfsm.transports.nixl")

MAX_METADATA_BYTES = 1 << 20
"""Cap on one rank's metadata blob, checked before decoding."""

MemKind = Literal["DRAM", "VRAM"]


def import_nixl() -> ModuleType:
    """NIXL's Python API module: ``nixl._api``, else ``nixl_cu12._api``, else ``nixl_cu13._api``."""
    errors: list[str] = []
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("NIXL is not installed (" + "; ".join(errors) + ")")


def nixl_available() -> bool:
    try:
        import_nixl()
    except ImportError:
        return False
    return True


# --- the typed metadata blob --------------------------------------------------------------------


class RegionInfo(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One registered KV region as the peer sees it. ``layer`` is its pairing key
    (:mod:`transports.layers`); ``None`` (and metadata ``"nixl/1"``, which has no layer ids)
    means its position in the rank's list."""

    base: int
    stride: int  # bytes per block
    num_blocks: int
    device: int
    kind: MemKind
    layer: int | None = None


class NixlRankMetadata(msgspec.Struct, frozen=True, tag="nixl/2", gc=False):
    """What a rank publishes: NIXL's agent metadata (opaque bytes for ``add_remote_agent``) and
    its KV regions as plain integers, each with its layer id.

    Tag ``"nixl/2"`` (``"nixl/1"`` had no layer ids). The tag changed with the schema because
    an array-like region with one more field decodes *silently* under the old schema (msgspec
    drops trailing array elements): an old reader would pair a PP rank's regions by position
    and read the wrong layers. It refuses the new tag instead. Old ``"nixl/1"`` blobs still
    decode here, with each region's layer its position."""

    agent_metadata: bytes
    regions: tuple[RegionInfo, ...]


class NixlRankMetadataV1(msgspec.Struct, frozen=True, tag="nixl/1", gc=False):
    """The metadata before layer ids (its regions' ``layer`` is never set); decoded, not written."""

    agent_metadata: bytes
    regions: tuple[RegionInfo, ...]


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(NixlRankMetadata | NixlRankMetadataV1)


def decode_rank_metadata(raw: bytes) -> NixlRankMetadata:
    """Decode and check one rank's blob (``"nixl/2"``, or ``"nixl/1"`` read as layers by
    position); the result has every region's layer set. :class:`TransportError` names what is
    wrong (:class:`~transports.layers.LayerError` for layer ids)."""
    if len(raw) > MAX_METADATA_BYTES:
        raise TransportError(f"rank metadata of {len(raw)} bytes exceeds the cap of {MAX_METADATA_BYTES}")
    try:
        decoded = _meta_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:  # a value nested too deeply to skip
        raise TransportError(f"bad rank metadata: {exc or 'nested too deeply'}") from None
    given = [r.layer for r in decoded.regions if r.layer is not None]
    if given and isinstance(decoded, NixlRankMetadataV1):
        raise TransportError('bad rank metadata: "nixl/1" regions carry no layer id')
    if given and len(given) != len(decoded.regions):
        raise LayerError("rank metadata gives a layer id to some regions only")
    layers = check_layers(given or None, len(decoded.regions), where="rank metadata")
    meta = NixlRankMetadata(decoded.agent_metadata, tuple(
        msgspec.structs.replace(r, layer=x) for r, x in zip(decoded.regions, layers, strict=True)))
    if not meta.agent_metadata:
        raise TransportError("rank metadata carries no NIXL agent metadata")
    if not meta.regions:
        raise TransportError("rank metadata lists no KV region")
    kinds = {r.kind for r in meta.regions}
    if len(kinds) != 1:
        raise TransportError(f"rank metadata mixes memory kinds {sorted(kinds)}")
    counts = {r.num_blocks for r in meta.regions}
    if len(counts) != 1:  # block ids index every region alike (and prepared lists assume it)
        raise TransportError(f"rank metadata regions hold different block counts {sorted(counts)}")
    for i, r in enumerate(meta.regions):
        if r.base <= 0 or r.stride <= 0 or r.num_blocks <= 0 or r.device < 0:
            raise TransportError(f"region {i} is malformed: {r}")
        if r.base + r.stride * r.num_blocks >= 1 << 64:
            raise TransportError(f"region {i} overflows the address space: {r}")
    return meta


# --- internal records ---------------------------------------------------------------------------


class _Peer:
    """One remote rank: its agent, regions (each paired with a local region by layer) and
    prepared descriptor lists."""

    __slots__ = ("agent", "attempt", "geometries", "key", "kind", "layers", "local_pos", "local_regions", "prepped",
                 "reads", "regions", "started_ns", "tp_rank")

    def __init__(self, key: EngineKey, tp_rank: int, agent: str, meta: NixlRankMetadata,
                 local_pos: tuple[int, ...], local_regions: tuple[Region, ...], attempt: int) -> None:
        self.key, self.tp_rank, self.agent = key, tp_rank, agent
        self.attempt = attempt  # the handshake attempt that added it: a PeerDisconnected about it carries it
        self.regions = tuple(Region(r.base, r.stride, r.num_blocks, r.device) for r in meta.regions)
        self.layers = _layers_of(meta)
        # Remote region k is read into local region local_pos[k] (the same layer), i.e. local_regions[k].
        self.local_pos, self.local_regions = local_pos, local_regions
        self.kind: MemKind = meta.regions[0].kind
        self.prepped: dict[tuple[int, int], Any] = {}  # (slices, slice) -> nixl_prepped_dlist_handle
        self.reads = 0  # reads of ours to this rank still alive
        self.geometries: set[tuple[int, int, int, int]] = set()  # slice geometries found consistent
        self.started_ns = 0  # when its process started (its RankInfo's wall clock; 0: not said)


class _Read:
    __slots__ = ("cancelled", "cmd", "handle", "held", "peer", "raised", "state")

    def __init__(self, cmd: PostRead, peer: _Peer, handle: Any, state: str) -> None:
        self.cmd, self.peer, self.handle, self.state = cmd, peer, handle, state
        self.cancelled = False
        self.held = False  # NIXL refused to release it as still active after a poll raised
        self.raised = ""  # its transfer() raised part-way: it fails whatever NIXL says at the end


def _tensor_kind(t: torch.Tensor) -> MemKind:
    return "VRAM" if t.is_cuda else "DRAM"


# --- the transport ------------------------------------------------------------------------------


class NixlTransport:
    """One worker's NIXL agent, registered KV cache, peers and reads in flight."""

    def __init__(
        self,
        agent_name: str,
        kv_caches: Sequence[torch.Tensor],
        *,
        layers: Sequence[int] | None = None,
        pp_rank: int = 0,
        tp_rank: int = 0,
        supports_pp: bool = True,
        xfer_mode: Literal["prepped", "descs"] = "prepped",
        cancel_policy: Literal["wait", "release"] = "wait",
        progress_thread: bool = True,
        progress_delay_us: int | None = 100,
        backends: Sequence[str] = ("UCX",),
        num_threads: int = 0,
        backend_params: Mapping[str, str] | None = None,
        ucx_devices: str = "lo",
    ) -> None:
        """``progress_delay_us``: how long NIXL's progress thread sleeps between rounds. NIXL's
        Python API starts it with no delay, a thread that spins on a core; on this 2-core
        machine that made a 1 KiB READ take 12 ms instead of 0.2 ms (the spinning threads
        starve everything else) and cost a whole core while idle, against ~3% at 100 us.
        ``None`` keeps NIXL's own setting.

        ``layers``: the layer id of each tensor, its pairing key (:mod:`transports.layers`);
        by default its position. A PP rank registers only its own layers, e.g. PP rank ``p`` of
        ``P`` over ``L`` layers ``layers=range(p*L//P, (p+1)*L//P)``; a consumer with PP size 1
        registers all of them. ``supports_pp=False``: this transport refuses every remote rank
        at ``pp_rank > 0`` (and cannot itself be one).

        ``ucx_devices``: the network devices UCX may open sockets on (``UCX_NET_DEVICES``; UCX's
        own default is every interface, each with a listening socket). Loopback by default, like
        the side channel; name the devices that reach the peers on a multi-host deployment. ``""``
        and ``"all"`` (every interface) are refused. A ``UCX_NET_DEVICES`` already in the
        environment wins, unless it is one of those (refused too). NIXL's listen thread, which
        would bind its metadata port on every interface, is never started. With CUDA tensors
        the backends are created with ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` unless the environment
        says otherwise: without it UCX reads VRAM over TCP on GPUs that have no NVLink.

        ``num_threads`` and ``backend_params`` go to each backend's initialisation. For UCX,
        ``num_threads > 0`` gives a pool of threads, each with its own UCX worker, and a READ
        of at least ``backend_params["split_batch_size"]`` descriptors (counted after merging;
        here ``num_threads`` unless given, NIXL's own default is 1024) is split across them.
        Between two processes on one host UCX copies in the thread that posts (CMA), and 4
        threads (vLLM's NixlConnector default) move a contiguous table at 1.3-1.6x the speed
        of one. The default is still 0, one worker and no pool: with the pool NIXL 1.5.1 aborts
        the process (a UCX assertion as the agent is destroyed) after a peer died or a read was
        aborted mid-flight, in four of pdfsm's fault tests (docs/transports.md). Opt in where
        bandwidth on one host matters more. ``cancel_policy="release"`` needs 0: NIXL
        releases a split READ while its threads still copy into the local blocks."""
        if xfer_mode not in ("prepped", "descs"):
            raise ValueError(f"xfer_mode must be 'prepped' or 'descs', got {xfer_mode!r}")
        if cancel_policy not in ("wait", "release"):
            raise ValueError(f"cancel_policy must be 'wait' or 'release', got {cancel_policy!r}")
        if type(num_threads) is not int or not 0 <= num_threads <= 64:
            raise ValueError(f"num_threads must be an int from 0 to 64, got {num_threads!r}")
        pool = str((backend_params or {}).get("num_threads", num_threads))  # asked for that way, it counts too
        if not pool.isdigit():
            raise ValueError(f"backend_params['num_threads'] must be a count, got {pool!r}")
        if cancel_policy == "release" and int(pool) > 0:
            # NIXL's composite handle (UCX thread pool) only marks itself released; the chunks
            # its threads posted keep writing into our blocks (ucx_backend.cpp, NIXL 1.4-1.5).
            raise ValueError(f"cancel_policy 'release' needs num_threads=0 (got {pool}): NIXL releases "
                             "a READ split over its UCX threads while they still write the local blocks")
        self._api = import_nixl()
        self._errors = _error_types(self._api)
        self.agent_name = agent_name
        self.incarnation, self.started_wall_ns = new_incarnation(), time.time_ns()
        self.pp_rank, self.tp_rank = pp_rank, tp_rank
        self.xfer_mode, self.cancel_policy = xfer_mode, cancel_policy
        if pp_rank > 0 and not supports_pp:
            raise ValueError(f"pp_rank {pp_rank} on a transport built with supports_pp=False")
        self.tensors = list(kv_caches)
        self.regions, self.kind = _regions(self.tensors)
        self.layer_map = LayerMap(layers, len(self.regions))
        self.layers = self.layer_map.layers
        kinds: frozenset[str] = frozenset({"DRAM", self.kind})
        self.capabilities = Capabilities(name="nixl", thread_bound=True, supports_pp=supports_pp,
                                         memory_kinds=kinds,
                                         num_blocks=self.regions[0].num_blocks if self.regions else 0)
        with _ucx_env(ucx_devices, self.kind):
            self.agent = _make_agent(self._api, agent_name, progress_thread=progress_thread,
                                     delay_us=progress_delay_us, backends=list(backends), num_threads=num_threads,
                                     params=dict(backend_params or {}))
        self._reg = self.agent.register_memory(self.tensors)
        region_infos = tuple(RegionInfo(r.base, r.stride, r.num_blocks, r.device, self.kind, x)
                             for r, x in zip(self.regions, self.layers, strict=True))
        self._metadata = _meta_encoder.encode(NixlRankMetadata(bytes(self.agent.get_agent_metadata()), region_infos))
        self._local_prepped: dict[tuple[int, int], Any] = {}
        self.peers: dict[EngineKey, dict[int, _Peer]] = {}
        self._agents: dict[str, _Peer] = {}  # remote agent name -> its rank, live or draining
        self._draining: list[_Peer] = []
        self.reads: dict[tuple[str, int, int], _Read] = {}
        self._disconnected: set[EngineKey] = set()
        self._submit: Submit | None = None
        self._clock: Clock = lambda: 0
        self._owner = threading.get_ident()
        self._closed = False

    # --- plumbing ---------------------------------------------------------------------------------

    def _check(self) -> None:
        if threading.get_ident() != self._owner:
            raise TransportError(
                f"NixlTransport {self.agent_name!r} called from thread {threading.get_ident()}, owner is "
                f"{self._owner}: NIXL's agent is not thread-safe (SGLang PR 28897)")
        if self._closed:
            raise TransportError(f"NixlTransport {self.agent_name!r} is closed")

    def _emit(self, ev: object) -> None:
        assert self._submit is not None, "bind() first"
        self._submit(ev)  # type: ignore[arg-type]

    def bind(self, submit: Submit, clock: Clock) -> None:
        self._submit, self._clock = submit, clock
        self._owner = threading.get_ident()

    def rank_info(self) -> RankInfo:
        """Thread-safe: no NIXL call (the blob was built at construction)."""
        return RankInfo(pp_rank=self.pp_rank, tp_rank=self.tp_rank, agent=self.agent_name, metadata=self._metadata,
                        incarnation=self.incarnation, started_wall_ns=self.started_wall_ns)

    # --- peers ----------------------------------------------------------------------------------

    def add_peer(self, key: EngineKey, reply: HandshakeReply, attempt: int = 0) -> None:
        """Add every rank of ``reply`` at ``key``'s pp_rank; all or nothing. Refused: a PP rank
        above 0 when this transport has no PP support, a remote layer this rank does not hold,
        TP ranks of one PP rank holding different layers."""
        self._check()
        self._check_pp(key[1])
        infos = [info for info in reply.ranks if info.pp_rank == key[1]]
        if not infos:
            raise TransportError(f"handshake reply for {key} lists no rank at pp_rank {key[1]}")
        decoded: list[tuple[RankInfo, NixlRankMetadata]] = []
        seen: set[int] = set()
        agents: set[str] = set()
        taken: list[_Peer] = []  # peers of another engine whose agent names a restarted process now
        for info in infos:
            if info.tp_rank in seen:
                raise TransportError(f"handshake reply lists tp_rank {info.tp_rank} twice")
            if info.agent in agents:  # dropping one rank would remove the agent under the other's reads
                raise TransportError(f"handshake reply names agent {info.agent!r} for two TP ranks")
            seen.add(info.tp_rank)
            agents.add(info.agent)
            if info.agent == self.agent_name:
                raise TransportError(f"remote agent {info.agent!r} has this transport's own name")
            old = self._agents.get(info.agent)
            if old is not None and (old.key != key or old in self._draining):
                if old in self._draining or not self._replaced(old, info):
                    why = "still draining reads" if old in self._draining else f"already serves {old.key}"
                    raise TransportError(f"remote agent {info.agent!r} {why}")
                taken.append(old)
            meta = decode_rank_metadata(info.metadata)
            # The reply's count bounds the block ids the consumer accepts; a rank claiming more would
            # have every read build a prepared list that large (gigabytes for a lying 2**24).
            odd = next((r.num_blocks for r in meta.regions if r.num_blocks != reply.num_blocks), None)
            if reply.num_blocks and odd is not None:
                raise TransportError(f"remote rank {info.agent!r} registers a region of {odd} blocks; its engine's "
                                     f"reply says {reply.num_blocks}")
            decoded.append((info, meta))
        pairing: list[tuple[tuple[int, ...], tuple[Region, ...]]] = []
        for info, meta in decoded:
            remote_layers = _layers_of(meta)
            if set(remote_layers) != set(_layers_of(decoded[0][1])):
                raise LayerError(f"{key} tp_rank {info.tp_rank} holds other layers than tp_rank "
                                 f"{decoded[0][0].tp_rank}: TP ranks of one PP rank hold the same layers")
            pos = self.layer_map.positions(
                remote_layers, remote=f"remote rank {info.agent!r} ({key[0]}, pp {key[1]}, tp {info.tp_rank})")
            pairing.append((pos, tuple(self.regions[i] for i in pos)))
        for old in taken:  # checked above: the engine they served has no reads of ours
            if old.key in self.peers:
                self._peer_lost(old, f"its agent {old.agent!r} now serves {key}, a process started since")
                self.drop_peer(old.key)
        if key in self.peers:  # a fresh reply for a connected engine replaces it
            # Checked before anything is dropped: an agent of the reply that still has reads of ours
            # would be left draining and could not be added again; other agents may drain.
            named = {info.agent for info, _ in decoded}
            busy = sorted(p.agent for p in self.peers[key].values() if p.reads and p.agent in named)
            if busy:
                raise TransportError(f"peer {key}: agents {busy} still have reads of ours: retry the handshake later")
            self.drop_peer(key)
        added: list[str] = []
        ranks: dict[int, _Peer] = {}
        try:
            for (info, meta), (pos, local_regions) in zip(decoded, pairing, strict=True):
                name = self.agent.add_remote_agent(meta.agent_metadata)
                name = name.decode() if isinstance(name, bytes) else str(name)
                if name in self._agents:  # a live peer's agent: refused, and not ours to remove
                    raise TransportError(f"NIXL metadata names agent {name!r}, which already serves "
                                         f"{self._agents[name].key}")
                added.append(name)
                if name != info.agent:
                    raise TransportError(f"NIXL metadata names agent {name!r}, the reply says {info.agent!r}")
                peer = ranks[info.tp_rank] = _Peer(key, info.tp_rank, name, meta, pos, local_regions, attempt)
                peer.started_ns = info.started_wall_ns
        except Exception as exc:
            for name in added:
                self._remove_agent(name)
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"cannot add remote agents of {key}: {type(exc).__name__}: {exc}") from exc
        self.peers[key] = ranks
        self.layer_map.changed(key[0])
        for peer in ranks.values():
            self._agents[peer.agent] = peer
        self._disconnected.discard(key)

    def _replaced(self, old: _Peer, info: RankInfo) -> bool:
        """``info``'s process started after the one ``old`` reached, and ``old``'s engine has no
        reads of ours: a producer restarted under a new engine id, keeping its agent name (often
        fixed per rank). Its old engine is let go, as NIXL knows one agent per name; without the
        start times, two live engines would claim one agent, and that stays refused."""
        later = bool(old.started_ns) and info.started_wall_ns > old.started_ns
        return later and not any(p.reads for p in self.peers.get(old.key, {}).values())

    def _check_pp(self, pp_rank: int) -> None:
        refuse_pp(self.capabilities, self.agent_name, pp_rank)

    def drop_peer(self, key: EngineKey) -> None:
        """Forget ``key`` now; remove its agents once none of our reads to them is alive. A no-op once
        closed: close() dropped every peer (an eviction owed until shutdown's last step lands here)."""
        if self._closed:
            return
        self._check()
        ranks = self.peers.pop(key, None)
        self._disconnected.discard(key)  # a later loss is of no peer (_peer_lost): nothing to report
        if ranks is None:
            return
        self.layer_map.changed(key[0])
        for peer in ranks.values():
            if peer.reads:
                self._draining.append(peer)
            else:
                self._forget(peer)

    def _forget(self, peer: _Peer) -> None:
        for handle in peer.prepped.values():
            _release(handle, "prepared list")
        peer.prepped.clear()
        self._remove_agent(peer.agent)
        if self._agents.get(peer.agent) is peer:
            del self._agents[peer.agent]

    def _remove_agent(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001 - a peer we cannot forget is logged, not fatal
            _log.warning("remove_remote_agent failed", agent=name, error=f"{type(exc).__name__}: {exc}")

    # --- reads ----------------------------------------------------------------------------------

    def post_read(self, cmd: PostRead) -> None:
        """Post one READ; raises (nothing was started) if it cannot be set up."""
        self._check()
        src = cmd.source
        peer = self.peers.get((cmd.engine_id, src.pp_rank), {}).get(src.tp_rank)
        if peer is None:
            self._check_pp(src.pp_rank)
            raise TransportError(f"no peer for ({cmd.engine_id}, pp {src.pp_rank}, tp {src.tp_rank})")
        key = (cmd.request_id, src.pp_rank, src.tp_rank)
        if key in self.reads:
            raise TransportError(f"read {key} is already in flight")
        if len(cmd.local_blocks) != len(cmd.remote_blocks):
            raise TransportError(f"{len(cmd.local_blocks)} local blocks for {len(cmd.remote_blocks)} remote blocks")
        note = notify_codec.encode(cmd.notification)
        if not cmd.local_blocks:  # nothing to move: the notification alone, as a completed read
            try:
                self.agent.send_notif(peer.agent, note)
            except self._errors["lost"] as exc:
                self._lost_at_post(cmd, peer, exc)
                return
            self.reads[key] = _Read(cmd, peer, None, "DONE")
            peer.reads += 1
            return
        why = self.layer_map.problem(cmd.engine_id, self.peers)
        if why is not None:
            raise LayerError(f"cannot read from {cmd.engine_id}: {why}")
        try:
            if self.xfer_mode == "prepped":
                handle = self._prepped_xfer(cmd, peer, note)
            else:
                handle = self._descs_xfer(cmd, peer, note)
        except SliceError as exc:
            raise TransportError(str(exc)) from None
        except self._errors["lost"] as exc:
            self._lost_at_post(cmd, peer, exc)
            return
        try:
            state = self.agent.transfer(handle)
        except Exception as exc:
            # UCX posts a READ's GETs one by one and may fail part-way: if NIXL refuses the release
            # as still active, some may still write into our blocks, so the read is accepted and
            # polled until NIXL lets it go (the cancel rule), never reported as not started.
            if not self._released(handle):
                read = self.reads[key] = _Read(cmd, peer, handle, "PROC")
                read.held = True
                read.raised = f"transfer() raised {type(exc).__name__}: {exc}"
                peer.reads += 1
                _log.warning("transfer raised and NIXL refused to release it: polling until it ends",
                             request_id=cmd.request_id, error=f"{type(exc).__name__}: {exc}")
                return
            if isinstance(exc, self._errors["lost"]):
                self._lost_at_post(cmd, peer, exc)
                return
            raise
        self.reads[key] = _Read(cmd, peer, handle, state)
        peer.reads += 1

    def _released(self, handle: Any) -> bool:
        """Release a transfer handle; False when NIXL refuses because the transfer still runs
        (REPOST_ACTIVE). Any other failure is logged: NIXL frees a leaked handle with the agent."""
        try:
            handle.release()
        except self._errors["active"]:
            return False
        except Exception as exc:  # noqa: BLE001
            _log.warning("releasing a transfer handle failed", error=f"{type(exc).__name__}: {exc}")
        return True

    def _lost_at_post(self, cmd: PostRead, peer: _Peer, exc: BaseException) -> None:
        """The peer went away before the read could start: the read is accepted and ends
        DISCONNECTED, as if it had gone a moment later (a remote fault, not a SETUP error)."""
        read = _Read(cmd, peer, None, "ERR")
        src = cmd.source
        self.reads[(cmd.request_id, src.pp_rank, src.tp_rank)] = read
        peer.reads += 1
        self._gone(read, f"{type(exc).__name__}: {exc}")

    def _prepped_xfer(self, cmd: PostRead, peer: _Peer, note: bytes) -> Any:
        src = cmd.source
        geometry = (src.local_slices, src.local_slice, src.remote_slices, src.remote_slice)
        if geometry not in peer.geometries:  # checked once per peer and slice geometry
            for lreg, rreg in zip(peer.local_regions, peer.regions, strict=True):
                llen = slice_span(lreg.stride, src.local_slices, src.local_slice)[1]
                rlen = slice_span(rreg.stride, src.remote_slices, src.remote_slice)[1]
                if llen != rlen:
                    raise SliceError(f"slice sizes differ: local {llen} bytes, remote {rlen} bytes")
            peer.geometries.add(geometry)
        local = self._local_list(src.local_slices, src.local_slice)
        remote = self._remote_list(peer, src.remote_slices, src.remote_slice)
        # Region-major indices; every region of a rank has the same block count. Remote region k
        # pairs with local region peer.local_pos[k] (the same layer).
        li, ri = read_indices(cmd.local_blocks, cmd.remote_blocks, self.regions[0].num_blocks,
                              peer.regions[0].num_blocks, peer.local_pos)
        return self.agent.make_prepped_xfer("READ", local, li, remote, ri, note)

    def _local_list(self, slices: int, index: int) -> Any:
        handle = self._local_prepped.get((slices, index))
        if handle is None:
            handle = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _all_blocks(self.regions, slices, index),
                                                self.kind)
            self._local_prepped[(slices, index)] = handle
        return handle

    def _remote_list(self, peer: _Peer, slices: int, index: int) -> Any:
        handle = peer.prepped.get((slices, index))
        if handle is None:
            handle = self.agent.prep_xfer_dlist(peer.agent, _all_blocks(peer.regions, slices, index), peer.kind)
            peer.prepped[(slices, index)] = handle
        return handle

    def _descs_xfer(self, cmd: PostRead, peer: _Peer, note: bytes) -> Any:
        src = cmd.source
        dl, dr = read_descs(cmd.local_blocks, cmd.remote_blocks, peer.local_regions, peer.regions,
                            local_slice=src.local_slice, local_slices=src.local_slices,
                            remote_slice=src.remote_slice, remote_slices=src.remote_slices)
        return self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(dl, self.kind),
                                          self.agent.get_xfer_descs(dr, peer.kind), peer.agent, note)

    def cancel_read(self, request_id: str, pp_rank: int, tp_rank: int) -> None:
        """Ask a read to stop; see the module's cancel rule for when it is reported."""
        self._check()
        read = self.reads.get((request_id, pp_rank, tp_rank))
        if read is None or read.cancelled:
            return
        read.cancelled = True
        if self.cancel_policy != "release" or read.state != "PROC" or read.handle is None:
            return
        try:
            read.state = self.agent.check_xfer_state(read.handle)
        except Exception:  # noqa: BLE001 - progress() polls again and reports it
            return
        if read.state != "PROC":
            return
        try:
            self.agent.release_xfer_handle(read.handle)
        except Exception as exc:  # noqa: BLE001 - NIXL could not stop it: keep polling until it ends
            _log.info("read could not be cancelled: polling until it ends", request_id=request_id, error=str(exc))
            return
        read.handle = None
        self._end(read, HandleFailure.CANCELLED, "released while in flight")

    def progress(self) -> None:
        """Poll every read in flight, then deliver notifications, then finish draining peers.
        A no-op once closed (the Connector steps once more after closing its transport)."""
        if self._closed:
            return
        self._check()
        now = self._clock()
        for read in list(self.reads.values()):
            if read.state == "PROC":
                try:
                    read.state = self.agent.check_xfer_state(read.handle)
                except Exception as exc:  # noqa: BLE001 - a raising poll fails the handle (vLLM PR 28120)
                    self._poll_raised(read, exc)
                    continue
            if read.state == "DONE" and not read.raised:
                self._release_read(read)
                src = read.cmd.source
                self._forget_read(read)
                self._emit(HandleDone(source=Source.TRANSFER, t_ns=now, request_id=read.cmd.request_id,
                                      pp_rank=src.pp_rank, tp_rank=src.tp_rank))
            elif read.state != "PROC":  # a read whose post raised may lack GETs even when DONE
                if not self._let_go(read, f"read ended {read.state}"):
                    continue
                self._end(read, HandleFailure.RAISED if read.raised else HandleFailure.ERR,
                          read.raised or f"transfer state {read.state}")
        self._drain_notifications(now)
        if self._draining:
            for peer in [p for p in self._draining if not p.reads]:
                self._draining.remove(peer)
                self._forget(peer)

    def _poll_raised(self, read: _Read, exc: Exception) -> None:
        detail = f"{type(exc).__name__}: {exc}"
        # NIXL 1.5.1 keeps the handle after a raising poll (NOT_FOUND included: checked), and an
        # unreleased one leaks UCX requests, so it is released; a release that raises is logged.
        # One NIXL refuses as still active (REPOST_ACTIVE) may still be writing into our blocks:
        # as for a cancel NIXL refuses, the read is polled again, never reported stopped before.
        if not self._let_go(read, f"poll raised {detail}"):
            return
        if isinstance(exc, self._errors["disconnect"]):
            self._gone(read, detail)
        else:
            self._end(read, HandleFailure.RAISED, detail)

    def _let_go(self, read: _Read, what: str) -> bool:
        """Release a read's handle; False, the read kept and polled again, while NIXL refuses as
        still active (GETs may still land in our blocks: the cancel rule), warned about once."""
        if read.handle is not None and not self._released(read.handle):
            if not read.held:
                read.held = True
                _log.warning("NIXL refused to release a read: kept until it does", request_id=read.cmd.request_id,
                             what=what)
            return False
        read.handle = None
        return True

    def _gone(self, read: _Read, detail: str) -> None:
        """End ``read`` DISCONNECTED and report its engine gone, once until it is added again."""
        self._end(read, HandleFailure.DISCONNECTED, detail)
        self._peer_lost(read.peer, detail)

    def _peer_lost(self, peer: _Peer, detail: str) -> None:
        key = peer.key
        if self.peers.get(key, {}).get(peer.tp_rank) is not peer:
            return  # an old connection, replaced since (draining): the engine's new one is not gone
        if key not in self._disconnected:
            self._disconnected.add(key)
            self._emit(PeerDisconnected(source=Source.TRANSFER, t_ns=self._clock(), engine_id=key[0],
                                        pp_rank=key[1], detail=f"{peer.agent}: {detail}", attempt=peer.attempt))

    def _release_read(self, read: _Read) -> None:
        if read.handle is not None:
            _release(read.handle, "transfer handle")
            read.handle = None

    def _forget_read(self, read: _Read) -> None:
        src = read.cmd.source
        del self.reads[(read.cmd.request_id, src.pp_rank, src.tp_rank)]
        read.peer.reads -= 1

    def _end(self, read: _Read, why: HandleFailure, detail: str) -> None:
        """Report a read that stopped without completing (a cancelled one as CANCELLED)."""
        if read.cancelled and why is not HandleFailure.CANCELLED:
            why, detail = HandleFailure.CANCELLED, f"cancelled; the transfer ended: {detail}"
        self._forget_read(read)
        src = read.cmd.source
        self._emit(HandleFailed(source=Source.TRANSFER, t_ns=self._clock(), request_id=read.cmd.request_id,
                                pp_rank=src.pp_rank, tp_rank=src.tp_rank, why=why, detail=detail))

    def _drain_notifications(self, now: int) -> None:
        try:
            notifs = self.agent.get_new_notifs()
        except Exception as exc:  # noqa: BLE001 - logged; the next step polls again
            _log.warning("get_new_notifs failed", error=f"{type(exc).__name__}: {exc}")
            return
        for sender, messages in notifs.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            for raw in messages:
                self._emit(notification_event(bytes(raw), sender=name, source=Source.NOTIFY, t_ns=now))

    # --- notifications --------------------------------------------------------------------------

    def send(self, key: EngineKey, tp_rank: int, message: NotifyMessage) -> None:
        """A plain notification or heartbeat to rank (key, tp_rank); raises if it cannot go."""
        self._check()
        peer = self.peers.get(key, {}).get(tp_rank)
        if peer is None:
            self._check_pp(key[1])
            raise TransportError(f"no peer for ({key[0]}, pp {key[1]}, tp {tp_rank})")
        try:
            self.agent.send_notif(peer.agent, notify_codec.encode(message))
        except self._errors["lost"] as exc:
            self._peer_lost(peer, f"{type(exc).__name__}: {exc}")
            raise

    # --- shutdown -------------------------------------------------------------------------------

    def stop_reads(self) -> None:
        """Poll once (a read found complete is reported done), then release what is still in
        flight and report it CANCELLED, whatever ``cancel_policy`` says: the agent is about to go,
        and its destruction would tear the transfers down anyway."""
        self.progress()
        self._stop_all("stopped: the transport is shutting down")

    def _stop_all(self, detail: str) -> None:
        for read in list(self.reads.values()):
            self._release_read(read)
            self._end(read, HandleFailure.CANCELLED, detail)

    def close(self) -> None:
        """Cancel what is in flight (NIXL's release), report it CANCELLED, forget every peer,
        deregister the memory. Idempotent."""
        if self._closed:
            return
        self._check()
        self._stop_all("transport closed")
        for key in list(self.peers):
            self.drop_peer(key)
        for peer in self._draining:
            self._forget(peer)
        self._draining.clear()
        for handle in self._local_prepped.values():
            _release(handle, "prepared list")
        self._local_prepped.clear()
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as exc:  # noqa: BLE001
            _log.warning("deregister_memory failed", error=f"{type(exc).__name__}: {exc}")
        self._closed = True
        # NIXL stops the agent's progress and UCX threads when the agent is destroyed: drop it here,
        # not when the transport object happens to be collected (a Connector keeps it after shutdown).
        self.agent = None


# --- helpers ------------------------------------------------------------------------------------


def _regions(tensors: Sequence[torch.Tensor]) -> tuple[tuple[Region, ...], MemKind]:
    if not tensors:
        raise ValueError("kv_caches: at least one tensor is needed")
    kinds = {_tensor_kind(t) for t in tensors}
    if len(kinds) != 1:
        raise ValueError(f"kv_caches mixes memory kinds {sorted(kinds)}")
    nums = {int(t.shape[0]) if t.dim() else 0 for t in tensors}
    if len(nums) != 1 or 0 in nums:
        raise ValueError(f"kv_caches: every tensor must be [num_blocks, ...] with one num_blocks, got {sorted(nums)}")
    regions: list[Region] = []
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(f"kv_caches[{i}] is not contiguous")
        num = int(t.shape[0])
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or nbytes % num:
            raise ValueError(f"kv_caches[{i}]: {nbytes} bytes do not split into {num} blocks")
        regions.append(Region(t.data_ptr(), nbytes // num, num, max(t.get_device(), 0)))
    return tuple(regions), kinds.pop()


def _layers_of(meta: NixlRankMetadata) -> tuple[int, ...]:
    """The layer id of each region (set by :func:`decode_rank_metadata`; else the position)."""
    return tuple(i if r.layer is None else r.layer for i, r in enumerate(meta.regions))


def _all_blocks(regions: Sequence[Region], slices: int, index: int) -> npt.NDArray[np.uint64]:
    """Every block's slice of every region, region-major: the list a prepared handle indexes."""
    parts = []
    for reg in regions:
        off, length = slice_span(reg.stride, slices, index)
        part = np.empty((reg.num_blocks, 3), dtype=np.uint64)
        part[:, 0] = np.arange(reg.num_blocks, dtype=np.uint64) * np.uint64(reg.stride) + np.uint64(reg.base + off)
        part[:, 1] = length
        part[:, 2] = reg.device
        parts.append(part)
    return np.concatenate(parts)


def _release(handle: Any, what: str) -> None:
    try:
        handle.release()
    except Exception as exc:  # noqa: BLE001 - NIXL keeps a leaked handle and frees it with the agent
        _log.warning("releasing failed", what=what, error=f"{type(exc).__name__}: {exc}")


def _error_types(api: ModuleType) -> dict[str, tuple[type[BaseException], ...]]:
    """NIXL's exceptions pdfsm tells apart. ``disconnect``: its connection broke, from any
    call. ``lost``: that, or, from a post or a notification, ``NOT_FOUND``: NIXL no longer knows the
    peer's agent (it dropped the metadata or the connection itself, as after a UCX disconnect it
    saw first, wtdcode/vllm-backport issue 33); every later read would fail the same way until a
    new handshake loads the peer again. A poll's ``NOT_FOUND`` fails that handle only: the next
    post tells whether the peer is gone. ``active``: a release refused because the transfer
    still runs."""
    bindings = getattr(api, "nixlBind", None)

    def get(name: str) -> type[BaseException]:
        found = getattr(bindings, name, None)
        return found if isinstance(found, type) and issubclass(found, BaseException) else _Never

    disconnect = get("nixlRemoteDisconnectError")
    return {"disconnect": (disconnect,), "lost": (disconnect, get("nixlNotFoundError")),
            "active": (get("nixlRepostActiveError"),)}


class _Never(Exception):
    """Stands in for an exception type this NIXL build does not have."""


_ENV_LOCK: Final = threading.Lock()


def _every_interface(devices: str) -> bool:
    """``UCX_NET_DEVICES`` values that make UCX listen on every interface (0.0.0.0)."""
    names = [d.strip().lower() for d in devices.split(",")]
    return not any(names) or "all" in names  # "lo,all" is every interface too


@contextmanager
def _ucx_env(devices: str, kind: MemKind) -> Iterator[None]:
    """UCX's settings for the backends created inside (UCX reads its environment when a backend
    creates its context); a variable the environment already sets wins.

    - ``UCX_NET_DEVICES``: the devices UCX may open sockets on. NIXL's own ``ucx_devices``
      parameter left UCX listening on every interface here; every interface is refused.
    - ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` for VRAM: UCX turns reads over CUDA IPC off on GPUs
      without NVLink, and a READ between two processes on one H100 then went by software
      emulation over TCP on loopback at 0.5 GiB/s, against 320 GiB/s with it on (NIXL's UCX
      plugin turns it on itself from its PR 2208; docs/transports.md)."""
    if _every_interface(devices):
        raise ValueError("ucx_devices must name the devices UCX may listen on (default 'lo'), not every one")
    wanted = {"UCX_NET_DEVICES": devices}
    if kind == "VRAM":
        wanted["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    with _ENV_LOCK:  # the variables are process-wide: transports built on two threads take turns
        inherited = os.environ.get("UCX_NET_DEVICES")
        if inherited is not None and _every_interface(inherited):
            raise ValueError(f"UCX_NET_DEVICES={inherited!r} in the environment would make UCX listen on "
                             "every interface: name the devices (unset it for loopback)")
        ours = [name for name in wanted if name not in os.environ]
        for name in ours:
            os.environ[name] = wanted[name]
        try:
            yield
        finally:
            for name in ours:
                os.environ.pop(name, None)


def _make_agent(api: ModuleType, name: str, *, progress_thread: bool, delay_us: int | None,
                backends: list[str], num_threads: int, params: dict[str, str]) -> Any:
    """A ``nixl_agent`` with the given backends; with ``delay_us`` set, its progress thread
    sleeps that long between rounds. NIXL's Python API hardcodes no delay, so in that case the
    binding-level agent is created with our configuration and the backends are created on it
    through the public ``create_backend``. A NIXL whose Python API is laid out differently gets
    its own default agent, with a warning."""
    init = {"num_threads": str(num_threads), "split_batch_size": str(num_threads)} if num_threads > 0 else {}
    init.update(params)
    if delay_us is None or not progress_thread:
        agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[],
                                                           enable_listen_thread=False))
        for backend in backends:
            agent.create_backend(backend, init)
        return agent
    # NIXL's listen thread (off by default) binds its metadata port on every interface: never on.
    conf = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=backends, num_threads=num_threads,
                                 enable_listen_thread=False)
    bindings = getattr(api, "nixlBind", None)
    if bindings is None or not hasattr(bindings, "nixlAgentConfig") or not hasattr(api.nixl_agent, "create_backend"):
        _log.warning("this NIXL's Python API cannot set the progress thread's delay; using NIXL's default")
        return api.nixl_agent(name, conf)
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                                       enable_listen_thread=False))
    cfg = bindings.nixlAgentConfig()
    cfg.useProgThread = True
    cfg.useListenThread = False
    cfg.syncMode = bindings.NIXL_THREAD_SYNC_NONE
    cfg.pthrDelay = int(delay_us)
    cfg.lthrDelay = 100000
    cfg.captureTelemetry = False
    agent.agent = bindings.nixlAgent(name, cfg)  # the agent without backends is dropped
    for backend in backends:
        agent.create_backend(backend, init)
    return agent
