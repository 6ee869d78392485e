"""The torch transport: KV blocks copied between torch tensors inside one process, by worker threads.

The "network" is a :class:`TorchNetwork`, a registry shared by the transports of one
process: each :class:`TorchTransport` is an agent in it, owning a worker's KV
tensors (each shaped ``[num_blocks, ...]``, contiguous, like the NIXL transport's).

Regions pair by layer, like NIXL's (:mod:`transports.layers`): each tensor has a
layer id (``layers``, by default its position) and a read from a remote rank fills
the local regions of the layers that rank holds, so PP ranks holding some layers
each can be read into a consumer holding all of them.

Reads are coalesced like NIXL's (:mod:`transports.coalesce`, so slices when TP
sizes differ) and carried out by a small thread pool. A read waits its configured
``latency_s``, then copies descriptor by descriptor (long descriptors in chunks of
``chunk_bytes``) with ``Tensor.copy_``, which releases the GIL. **The worker
thread that ran the read submits its outcome** (``HandleDone`` or ``HandleFailed``)
straight into the owning core's log: this transport exists to exercise real
multi-thread event ingestion, unlike NIXL's, whose outcomes are polled on the owner
thread.

Completion order. Only after the last byte is in place does the worker put the
read's notification in the producer's inbox (the NIXL PR 252 rule), and only then
submit ``HandleDone``. Inboxes are drained, and their notifications submitted, by
the *receiving* side's :meth:`TorchTransport.progress`.

Cancel rule: the same as NIXL's, but here it can be kept exactly. A cancel sets a
flag the worker checks before the copy starts and between chunks; the worker
reports ``HandleFailed(CANCELLED)`` itself once it has stopped touching the local
blocks, so the report is never early. A read whose copy had already finished is
reported ``HandleDone``.

Drop rule: :meth:`TorchTransport.drop_peer` forgets the peer at once for new reads
and sends; reads already running keep their reference to the peer's tensors and
finish (there is nothing to tear down under them).

Faults: :meth:`TorchNetwork.kill` makes an agent unreachable: reads from it end
``DISCONNECTED`` (checked before the copy, between chunks, and when delivering the
notification) and sends to it raise.

Threading: every method is called on the owner thread (the Connector's), except
that outcomes are submitted by workers; the registry and the read table are guarded
by locks, inboxes are deques (atomic append/popleft).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import msgspec
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
from transports.coalesce import Region, SliceError, read_descs
from transports.layers import LayerError, LayerMap, check_layers

__all__ = ["TorchNetwork", "TorchRankMetadata", "TorchRankMetadataV1", "TorchTransport", "decode_torch_metadata"]


class TorchRankMetadata(msgspec.Struct, frozen=True, tag="torch/2", gc=False):
    """What a rank publishes: per region, (block stride in bytes, block count, layer id).
    ``"torch/1"`` had no layer id; it still decodes, layers by position."""

    regions: tuple[tuple[int, int, int], ...]


class TorchRankMetadataV1(msgspec.Struct, frozen=True, tag="torch/1", gc=False):
    """Before layer ids: per region, (block stride in bytes, block count)."""

    regions: tuple[tuple[int, int], ...]


_meta_decoder = msgspec.msgpack.Decoder(TorchRankMetadata | TorchRankMetadataV1)


def decode_torch_metadata(raw: bytes) -> TorchRankMetadata:
    """Either version, as ``"torch/2"`` (``"torch/1"`` regions get their positions as layers)."""
    meta: TorchRankMetadata | TorchRankMetadataV1 = _meta_decoder.decode(raw)
    if isinstance(meta, TorchRankMetadataV1):
        return TorchRankMetadata(tuple((stride, n, i) for i, (stride, n) in enumerate(meta.regions)))
    return meta


class _Remote(NamedTuple):
    """A remote rank: its agent, and for each of its regions (in order) the local region with
    the same layer."""

    agent: str
    layers: tuple[int, ...]
    local_pos: tuple[int, ...]
    attempt: int  # the handshake attempt that added it: a PeerDisconnected about it carries it
    # The process added: an agent restarted under the same name is another peer, not this one.
    incarnation: str


class TorchNetwork:
    """The agents of one process, and which of them are dead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.agents: dict[str, TorchTransport] = {}
        self.dead: set[str] = set()

    def join(self, agent: TorchTransport) -> None:
        with self._lock:
            if agent.agent_name in self.agents:
                raise ValueError(f"agent {agent.agent_name!r} already exists")
            self.agents[agent.agent_name] = agent

    def leave(self, name: str) -> None:
        with self._lock:
            self.agents.pop(name, None)

    def kill(self, name: str) -> None:
        with self._lock:
            self.dead.add(name)

    def revive(self, name: str) -> None:
        with self._lock:
            self.dead.discard(name)

    def reachable(self, name: str, incarnation: str | None = None) -> TorchTransport | None:
        """The live agent ``name``; with ``incarnation``, only while it is still that process."""
        with self._lock:
            agent = None if name in self.dead else self.agents.get(name)
        return agent if agent is None or incarnation in (None, agent.incarnation) else None

    def deliver(self, sender: str, receiver: str, raw: bytes, incarnation: str | None = None) -> None:
        """Put notification bytes in the receiver's inbox; raise if it is unreachable."""
        target = self.reachable(receiver, incarnation)
        if target is None:
            raise TransportError(f"{receiver}: peer unreachable")
        target.inbox.append((sender, raw))


# Per layer: (local region, remote region, [(local offset, remote offset, length)]).
_Plan = list[tuple[int, int, list[tuple[int, int, int]]]]


class _Read:
    __slots__ = ("cancel", "cmd", "ended", "gone", "key", "plan", "remote", "started")

    def __init__(self, cmd: PostRead, remote: _Remote, plan: _Plan, *, gone: bool) -> None:
        self.cmd, self.remote, self.plan = cmd, remote, plan
        self.key = (cmd.request_id, cmd.source.pp_rank, cmd.source.tp_rank)  # in TorchTransport.reads
        self.gone = gone  # the peer was gone when posted: nothing planned, it ends DISCONNECTED
        self.cancel = threading.Event()
        self.ended = threading.Event()  # its worker has reported it
        # Claimed under the reads lock by its worker as it starts; post_read gives a read up (the
        # pool queued it, then could not start a thread) by taking it out of the table, unless
        # a worker claimed it first: only one of them wins.
        self.started = False


class TorchTransport:
    """One in-process agent: a worker's KV tensors, a thread pool of copiers, an inbox."""

    def __init__(
        self,
        network: TorchNetwork,
        agent_name: str,
        kv_caches: Sequence[torch.Tensor],
        *,
        layers: Sequence[int] | None = None,
        pp_rank: int = 0,
        tp_rank: int = 0,
        supports_pp: bool = True,
        latency_s: float = 0.0,
        workers: int = 2,
        chunk_bytes: int = 4 << 20,
    ) -> None:
        if latency_s < 0 or workers < 1 or chunk_bytes < 1:
            raise ValueError("latency_s must be >= 0, workers and chunk_bytes >= 1")
        if pp_rank > 0 and not supports_pp:
            raise ValueError(f"pp_rank {pp_rank} on a transport built with supports_pp=False")
        self.network, self.agent_name = network, agent_name
        self.incarnation, self.started_wall_ns = new_incarnation(), time.time_ns()
        self.pp_rank, self.tp_rank = pp_rank, tp_rank
        self.latency_s, self.chunk_bytes = latency_s, chunk_bytes
        self.tensors = list(kv_caches)
        if not self.tensors:
            raise ValueError("kv_caches: at least one tensor is needed")
        nums = {int(t.shape[0]) if t.dim() else 0 for t in self.tensors}
        if len(nums) != 1 or 0 in nums:
            raise ValueError(f"kv_caches: every tensor must be [num_blocks, ...] with one num_blocks, got {nums}")
        self.flat: list[torch.Tensor] = []
        self.regions: list[Region] = []
        for i, t in enumerate(self.tensors):
            if not t.is_contiguous():
                raise ValueError(f"kv_caches[{i}] is not contiguous")
            flat = t.view(-1).view(torch.uint8)
            if not flat.numel():  # as the NIXL transport: a read of it would move nothing, reported done
                raise ValueError(f"kv_caches[{i}]: {tuple(t.shape)} holds 0 bytes per block")
            self.flat.append(flat)
            self.regions.append(Region(0, flat.numel() // int(t.shape[0]), int(t.shape[0])))
        self.layer_map = LayerMap(layers, len(self.regions))
        self.layers = self.layer_map.layers
        kinds = {"VRAM" if t.is_cuda else "DRAM" for t in self.tensors}
        self.devices = {t.device for t in self.tensors if t.is_cuda}  # what a read must wait for
        self.capabilities = Capabilities(name="torch", supports_pp=supports_pp,
                                         memory_kinds=frozenset({"DRAM", *kinds}),
                                         num_blocks=self.regions[0].num_blocks if self.regions else 0)
        self.peers: dict[EngineKey, dict[int, _Remote]] = {}
        self.reads: dict[tuple[str, int, int], _Read] = {}
        self._reads_lock = threading.Lock()  # also guards _disconnected (worker threads report)
        self._disconnected: set[EngineKey] = set()  # engines already reported gone, until re-added
        self.inbox: deque[tuple[str, bytes]] = deque()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"torch-xfer-{agent_name}")
        self._submit: Submit | None = None
        self._clock: Clock = lambda: 0
        self._closed = False
        network.join(self)

    def bind(self, submit: Submit, clock: Clock) -> None:
        self._submit, self._clock = submit, clock

    def _emit(self, ev: object) -> None:
        assert self._submit is not None, "bind() first"
        self._submit(ev)  # type: ignore[arg-type]

    def rank_info(self) -> RankInfo:
        meta = msgspec.msgpack.encode(TorchRankMetadata(tuple(
            (r.stride, r.num_blocks, x) for r, x in zip(self.regions, self.layers, strict=True))))
        return RankInfo(pp_rank=self.pp_rank, tp_rank=self.tp_rank, agent=self.agent_name, metadata=meta,
                        incarnation=self.incarnation, started_wall_ns=self.started_wall_ns)

    # --- peers ------------------------------------------------------------------------------------

    def _check_pp(self, pp_rank: int) -> None:
        refuse_pp(self.capabilities, self.agent_name, pp_rank)

    def add_peer(self, key: EngineKey, reply: HandshakeReply, attempt: int = 0) -> None:
        """Refused like NIXL's: pp_rank > 0 without PP support, a remote layer this rank does
        not hold, TP ranks of one PP rank holding different layers; and metadata that does not
        describe the peer's memory."""
        self._check_pp(key[1])
        ranks: dict[int, _Remote] = {}
        for info in reply.ranks:
            if info.pp_rank != key[1]:
                continue
            # The process the reply describes: one restarted under the same name since (between the
            # handshake and this call) has other memory, and reading it returned its blocks.
            peer = self.network.reachable(info.agent, info.incarnation or None)
            if peer is None:
                raise TransportError(f"cannot add remote agent {info.agent!r}: unreachable, or restarted "
                                     "since its handshake reply")
            try:
                meta = decode_torch_metadata(info.metadata)
            except (msgspec.DecodeError, RecursionError) as exc:  # a value nested too deeply to skip
                raise TransportError(f"bad rank metadata from {info.agent!r}: {exc or 'nested too deeply'}") from None
            layers = tuple(x for _, _, x in meta.regions)
            check_layers(layers, len(layers), where=f"rank metadata of {info.agent!r}")
            if list(meta.regions) != [(r.stride, r.num_blocks, x) for r, x in zip(peer.regions, peer.layers,
                                                                                   strict=True)]:
                raise TransportError(f"rank metadata of {info.agent!r} does not describe its memory")
            if ranks and set(layers) != set(next(iter(ranks.values())).layers):
                raise LayerError(f"{key} tp_rank {info.tp_rank} holds other layers than tp_rank "
                                 f"{next(iter(ranks))}: TP ranks of one PP rank hold the same layers")
            pos = self.layer_map.positions(
                layers, remote=f"remote rank {info.agent!r} ({key[0]}, pp {key[1]}, tp {info.tp_rank})")
            ranks[info.tp_rank] = _Remote(info.agent, layers, pos, attempt, peer.incarnation)
        if not ranks:
            raise TransportError(f"handshake reply for {key} lists no rank at pp_rank {key[1]}")
        with self._reads_lock:  # with _lost's check: a loss of the old connection cannot mask the new one
            self.peers[key] = ranks
            self._disconnected.discard(key)
        self.layer_map.changed(key[0])

    def drop_peer(self, key: EngineKey) -> None:
        with self._reads_lock:
            dropped = self.peers.pop(key, None)
            self._disconnected.discard(key)  # a later loss is of no peer: nothing to report
        if dropped is not None:
            self.layer_map.changed(key[0])

    # --- reads ----------------------------------------------------------------------------------

    def post_read(self, cmd: PostRead) -> None:
        if self._closed:
            raise TransportError(f"TorchTransport {self.agent_name!r} is closed")
        src = cmd.source
        remote = self.peers.get((cmd.engine_id, src.pp_rank), {}).get(src.tp_rank)
        if remote is None:
            self._check_pp(src.pp_rank)
            raise TransportError(f"no peer for ({cmd.engine_id}, pp {src.pp_rank}, tp {src.tp_rank})")
        name = remote.agent
        peer = self.network.reachable(name, remote.incarnation)
        # A peer gone since the handshake (dead, or restarted: another process under its name):
        # the read is accepted with nothing to copy and ends DISCONNECTED (_copy), as had it gone
        # a moment later, even if it is back by then; the engine is reported gone once.
        plan = self._plan(cmd, remote, peer) if peer is not None else []
        read = _Read(cmd, remote, plan, gone=peer is None)
        key = read.key
        with self._reads_lock:
            if key in self.reads:
                raise TransportError(f"read {key} is already in flight")
            self.reads[key] = read
        try:
            self._pool.submit(self._run, read)
        except RuntimeError as exc:  # the pool is shut down, or queued it and could not start a thread
            with self._reads_lock:
                if read.started:  # a worker took it all the same: it reports it
                    return
                del self.reads[key]  # a worker that takes it later drops it (found by a helper's hunt)
            raise TransportError(f"cannot start the read: {exc}") from None

    def _plan(self, cmd: PostRead, remote: _Remote, peer: TorchTransport) -> _Plan:
        """What the read copies, layer by layer; raises if it cannot be set up."""
        src = cmd.source
        if cmd.local_blocks:
            why = self.layer_map.problem(cmd.engine_id, self.peers)
            if why is not None:
                raise LayerError(f"cannot read from {cmd.engine_id}: {why}")
        plan: _Plan = []
        try:
            for rk, lk in enumerate(remote.local_pos):  # remote region rk into local region lk: one layer
                dl, dr = read_descs(cmd.local_blocks, cmd.remote_blocks, [self.regions[lk]], [peer.regions[rk]],
                                    local_slice=src.local_slice, local_slices=src.local_slices,
                                    remote_slice=src.remote_slice, remote_slices=src.remote_slices)
                plan.append((lk, rk, [(int(a), int(b), int(n)) for (a, n, _), (b, _, _)
                                      in zip(dl.tolist(), dr.tolist(), strict=True)]))
        except SliceError as exc:
            raise TransportError(str(exc)) from None
        return plan

    def cancel_read(self, request_id: str, pp_rank: int, tp_rank: int) -> None:
        with self._reads_lock:
            read = self.reads.get((request_id, pp_rank, tp_rank))
        if read is not None:
            read.cancel.set()

    def _run(self, read: _Read) -> None:
        """Worker thread: wait, copy, notify, then report, exactly once (unless ``post_read`` gave
        the read up, reported as SETUP)."""
        with self._reads_lock:
            if self.reads.get(read.key) is not read:  # given up by post_read
                return
            read.started = True
        try:
            self._copy_and_report(read)
        finally:
            read.ended.set()  # whatever happened: stop_reads and close wait for it

    def _copy_and_report(self, read: _Read) -> None:
        why: HandleFailure | None = None
        detail = ""
        try:
            why, detail = self._copy(read)
        except Exception as exc:  # noqa: BLE001 - a failing copy fails the handle, never the worker
            why, detail = HandleFailure.RAISED, f"{type(exc).__name__}: {exc}"
        try:  # the copy's end, read before the notification goes: a clock that raises sends none
            t_ns = self._clock()
        except Exception as exc:  # noqa: BLE001 - the outcome must still go; untimed, it cannot be trusted
            t_ns = 0
            if why is None:  # the notification stays unsent: the consumer's own release notice is the one
                why, detail = HandleFailure.RAISED, f"the clock raised: {type(exc).__name__}: {exc}"
        if why is None:
            try:
                self.network.deliver(self.agent_name, read.remote.agent, notify_codec.encode(read.cmd.notification),
                                     read.remote.incarnation)
            except TransportError as exc:
                why, detail = HandleFailure.DISCONNECTED, f"notification not delivered: {exc}"
            except Exception as exc:  # noqa: BLE001
                why, detail = HandleFailure.RAISED, f"{type(exc).__name__}: {exc}"
        src = read.cmd.source
        engine = (read.cmd.engine_id, src.pp_rank)
        with self._reads_lock:
            self.reads.pop(read.key, None)
        common = {"source": Source.TRANSFER, "t_ns": t_ns, "request_id": read.cmd.request_id,
                  "pp_rank": src.pp_rank, "tp_rank": src.tp_rank}
        if why is None:
            self._emit(HandleDone(**common))  # type: ignore[arg-type]
        else:
            self._emit(HandleFailed(**common, why=why, detail=detail))  # type: ignore[arg-type]
        if why is HandleFailure.DISCONNECTED:
            self._lost(engine, read.remote, detail, tp_rank=src.tp_rank)

    def _lost(self, engine: EngineKey, remote: _Remote, detail: str, *, tp_rank: int | None = None) -> None:
        """Report ``engine``'s connection ``remote`` gone, once until it is added again (as NIXL
        does); with ``tp_rank``, only while ``remote`` is still that rank's current connection (a
        worker's read of a connection replaced since says nothing of the new one)."""
        with self._reads_lock:
            if tp_rank is not None and self.peers.get(engine, {}).get(tp_rank) is not remote:
                return
            first = engine not in self._disconnected
            self._disconnected.add(engine)
        if first:
            self._emit(PeerDisconnected(source=Source.TRANSFER, t_ns=self._clock(), engine_id=engine[0],
                                        pp_rank=engine[1], detail=detail, attempt=remote.attempt))

    def _copy(self, read: _Read) -> tuple[HandleFailure | None, str]:
        if self.latency_s and read.cancel.wait(self.latency_s):
            return HandleFailure.CANCELLED, "cancelled before the copy started"
        peer = None if read.gone else self.network.reachable(read.remote.agent, read.remote.incarnation)
        if peer is None:
            return HandleFailure.DISCONNECTED, f"{read.remote.agent} went away"
        try:
            return self._copy_chunks(read)
        finally:
            # A copy_ touching GPU memory only enqueues it: a read ends (done, and the producer told
            # it may free the blocks; or cancelled or lost, and its local blocks reused) only once
            # every chunk enqueued has landed.
            for device in self.devices | peer.devices:
                torch.cuda.synchronize(device)

    def _copy_chunks(self, read: _Read) -> tuple[HandleFailure | None, str]:
        chunk = self.chunk_bytes
        for lk, rk, descs in read.plan:
            dst = self.flat[lk]
            for loff, roff, length in descs:
                for start in range(0, length, chunk):
                    if read.cancel.is_set():
                        return HandleFailure.CANCELLED, "cancelled; the copy stopped"
                    peer = self.network.reachable(read.remote.agent, read.remote.incarnation)
                    if peer is None:
                        return HandleFailure.DISCONNECTED, f"{read.remote.agent} went away"
                    n = min(chunk, length - start)
                    dst[loff + start:loff + start + n].copy_(peer.flat[rk][roff + start:roff + start + n])
        return None, ""

    # --- notifications --------------------------------------------------------------------------

    def send(self, key: EngineKey, tp_rank: int, message: NotifyMessage) -> None:
        remote = self.peers.get(key, {}).get(tp_rank)
        if remote is None:
            self._check_pp(key[1])
            raise TransportError(f"no peer for ({key[0]}, pp {key[1]}, tp {tp_rank})")
        try:
            self.network.deliver(self.agent_name, remote.agent, notify_codec.encode(message), remote.incarnation)
        except TransportError as exc:
            self._lost(key, remote, f"notification not delivered: {exc}")
            raise

    def progress(self) -> None:
        """Submit the notifications that arrived in this agent's inbox (reads report themselves)."""
        if not self.inbox:
            return
        now = self._clock()
        for _ in range(len(self.inbox)):
            sender, raw = self.inbox.popleft()
            self._emit(notification_event(raw, sender=sender, source=Source.NOTIFY, t_ns=now))

    def stop_reads(self) -> None:
        """Cancel every read and wait until its worker has reported it (a copy stops between
        chunks). On the owner thread with a blocking inbox, call it inside ``log.owner_waiting()``,
        as :meth:`close`."""
        with self._reads_lock:
            reads = list(self.reads.values())
        for read in reads:
            read.cancel.set()
        for read in reads:
            read.ended.wait()

    def close(self) -> None:
        """Cancel every read and wait for the workers, which report them; leave the network.

        On the owner thread with a blocking inbox, call it inside ``log.owner_waiting()`` (the
        Connector's shutdown does): a worker waiting for room the owner cannot make would wait
        for ever, and the owner for it."""
        if self._closed:
            return
        self._closed = True
        self.stop_reads()
        self._pool.shutdown(wait=True)
        self.network.leave(self.agent_name)
