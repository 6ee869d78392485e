"""Prefill and decode on one machine, each in its own OS process, moving KV blocks over real NIXL.

This is ``pdfsm demo``: two engine processes (``python -m pdfsm.engines``), a handshake over
the TCP side channel on loopback, NIXL READs of paged torch KV caches (host memory here,
GPU memory where the tensors are CUDA), notifications, release on both sides, and at the end
the replay of every worker's event log. Any ``pdfsm demo`` flag works here, for example::

    python examples/pd_loopback.py --prefill-tp 1 --decode-tp 2 --log-dir logs
    python examples/pd_loopback.py --fault kill-prefill
    python examples/pd_loopback.py --prefill-pp 2 --no-pp --lease-s 3

It exits 0 when every request ended in a defined state, every byte read was verified and
nothing leaked (with ``--no-pp`` every request fails as a local refusal, and the producer,
never told, keeps the blocks until ``--lease-s``: docs/transports.md). The engine side (what
a serving engine embeds) is in pdfsm/engines.py; the router and schedulers this process plays
are in pdfsm/run.py.
"""

import sys

from pdfsm.run import main

if __name__ == "__main__":
    sys.exit(main())
