"""Cost of creating one frozen event value: msgspec Struct vs attrs vs dataclass, in this process.

    python benchmarks/events.py [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import timeit

import attrs
import msgspec


class MsgspecEvent(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag=True):
    source: str
    t_ns: int
    request_id: str
    pp_rank: int = 0
    tp_rank: int = 0


@attrs.frozen(slots=True, kw_only=True)
class AttrsEvent:
    source: str
    t_ns: int
    request_id: str
    pp_rank: int = 0
    tp_rank: int = 0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DataclassEvent:
    source: str
    t_ns: int
    request_id: str
    pp_rank: int = 0
    tp_rank: int = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    n, out = 200_000, {}
    for name, cls in (("msgspec", MsgspecEvent), ("attrs", AttrsEvent), ("dataclass", DataclassEvent)):
        best = min(timeit.repeat(lambda c=cls: c(source="xfer", t_ns=1, request_id="r", tp_rank=1),  # type: ignore[misc]
                                 number=n, repeat=5))
        out[f"{name}_ns"] = best / n * 1e9
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k[:-3]:10s} {v:8.0f} ns per frozen instance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
