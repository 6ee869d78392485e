"""The messages between the demo's orchestrators (pdfsm.run, pdfsm.soak) and an engine process
(pdfsm.engines): operations as JSON lines on the engine's stdin, results as JSON lines on its
stdout marked with :data:`MARK` (NIXL writes lines of its own there). Typed, each line at most
:data:`MAX_LINE_BYTES` (:func:`read_lines` checks it before decoding), never pickled; kept
apart from the engine so the orchestrators and the CLI do not import torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Final, Literal

import msgspec

from pdfsm.connector import KVTransferParams
from pdfsm.wire import RequestId

__all__ = ["MARK", "MAX_DELAY_S", "MAX_LINE_BYTES", "MAX_REASON_CHARS", "Abort", "Finish", "Forge", "Load", "Op",
           "OpType", "Prefill", "Result", "Tamper", "read_lines"]

MARK = "PDFSM "
MAX_LINE_BYTES: Final = 1 << 20  # an op or result line: params of a few thousand block ids fit many times
MAX_REASON_CHARS: Final = 4096  # a result's reason, cut to it: one quoting a long input still fits a line
# An op's age or delay, at most a day (far past any demo lease): in nanoseconds it stays an int.
MAX_DELAY_S: Final = 86_400.0
_Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_DELAY_S)]


NUM_BLOCKS: Final = 256  # each demo engine's KV pool, in blocks
HEADS: Final = 8  # the demo model's KV heads, shared out over TP ranks (topology.heads_held: a TP above holds copies)
LEASE_MARGIN_S: Final = 1.0  # the decode side stops trusting reads this long before a lease ends

class Op(msgspec.Struct, kw_only=True, tag_field="op", tag=str.lower):
    """Parent to engine."""


class Prefill(Op, kw_only=True):
    rid: RequestId
    blocks: Annotated[int, msgspec.Meta(ge=1)]
    seed: int


class Load(Op, kw_only=True):
    """``age_s``: how long the router held the params; the producer's lease started that long ago.
    ``abort``: abort it mid-read, in the same op (an Abort sent after the Load could arrive after a
    step that already read the request to the end)."""

    rid: RequestId
    params: KVTransferParams
    seed: int
    age_s: _Seconds = 0.0
    abort: bool = False


class Abort(Op, kw_only=True):
    """``stage``: ``now`` (as the op arrives), ``reading`` (once a rank's reads are posted, so it
    lands mid-read)."""

    rid: RequestId
    stage: Literal["now", "reading"] = "reading"


class Tamper(Op, kw_only=True):
    """A fault on the wire for ``rid``, applied where the transport hands events to the log: the
    first notification for it lost, delivered twice or ``delay_s`` late (prefill side), or its
    first completed read reported failed (decode side)."""

    rid: RequestId
    kind: Literal["drop-notification", "duplicate-notification", "delay-notification", "fail-read"]
    delay_s: _Seconds = 0.0


class Forge(Op, kw_only=True):
    """Send the producer a notification for a request it never had (a remote fault)."""


class Finish(Op, kw_only=True):
    """Drain what is in flight (up to ``grace_s``), flush the logs, report the accounting, exit."""

    grace_s: float = 30.0


OpType = Prefill | Load | Abort | Tamper | Forge | Finish


class Result(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Engine to parent."""

    ev: Literal["ready", "prefilled", "released", "done", "accounting", "stats", "error"]
    rid: str = ""
    port: int = 0
    params: KVTransferParams | None = None
    outcome: str = ""
    expired: bool = False
    verified: bool = False
    reason: str = ""
    # error: the op ended there, nothing held or loaded: "pool" (too few free blocks), "op" (refused)
    refused: Literal["", "pool", "op"] = ""
    free: int = 0
    total: int = 0
    in_flight: int = 0
    local_violations: int = 0
    remote_violations: int = 0
    logs: list[str] = []
    t_ns: int = 0
    rss: int = 0  # stats: resident bytes of the engine process
    live: int = 0  # stats: requests holding blocks
    early_frees: int = 0  # accounting: blocks freed while the transport still had a read into them
    double_frees: int = 0  # accounting: blocks in the free pool more than once (``free`` counts distinct ones)
    sizes: dict[str, int] = {}  # stats: how many entries each per-request table holds, summed over workers


def read_lines(read: Callable[[int], bytes]) -> Iterator[bytes | None]:
    """Each line ``read`` yields (without its newline) until it returns b"", or None for one longer
    than :data:`MAX_LINE_BYTES`, whose bytes are dropped as they come, never held whole. ``read(n)``
    returns at most ``n`` bytes, blocking until there is one (``os.read`` on a descriptor: no
    buffered reader's lock held by a thread still blocked there when the process exits)."""
    buf = bytearray()
    too_long = False
    while chunk := read(1 << 16):
        buf += chunk
        end = buf.find(b"\n", len(buf) - len(chunk))  # only the new bytes: the rest had no newline
        while end != -1:
            line, buf = bytes(buf[:end]), buf[end + 1:]
            yield None if too_long or len(line) > MAX_LINE_BYTES else line
            too_long = False
            end = buf.find(b"\n")
        if len(buf) > MAX_LINE_BYTES:  # this line is too long already: keep none of it
            buf.clear()
            too_long = True
    if buf or too_long:
        yield None if too_long or len(buf) > MAX_LINE_BYTES else bytes(buf)
