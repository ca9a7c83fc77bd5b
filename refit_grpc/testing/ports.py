"""Ports for tests, demos and benchmarks, without a window between picking a port and binding it.

- A server of this project binds port 0 and reports the port it got: the shim
  (`--address 127.0.0.1:0`, its READY line; `--metrics-address 127.0.0.1:0`, its metrics line),
  the trainer's rendezvous store (`Fleet.connect(ip)`,
  `dataplane.rendezvous.bind_master_store(ip, 0, ...)`).
- An address where nothing answers: `unused_port()` holds a port bound but not listening, so
  a connect is refused and no other process can take the port while it is held.
- `free_port()` is left for servers that cannot bind 0 and report (vLLM, Dynamo): the port is
  free when picked, another process may take it before the server binds it, and their
  harnesses (`testing.vllm.VLLMServer`) start again on a new port when that happened.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


def free_port(host: str = "") -> int:
    """A port free on `host` (default: every address) when this returns. Racy by nature: the
    caller binds it later, and another process may have taken it by then (EADDRINUSE). Only for
    servers that cannot bind port 0 themselves and report the port they got."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def unused_port(host: str = "127.0.0.1", port: int = 0) -> Iterator[int]:
    """A port on `host` where nothing listens, held for the block: bound, never listening, so a
    connect to it is refused, and no other process can bind it until the block ends. `port`:
    that one, once what listened there is gone (a killed server's address stays refused for
    the block, instead of being free for the next server that binds port 0: tests that start
    shims in parallel did take one over)."""
    with socket.socket() as s:
        if port:
            # What listened there may have left its connections in TIME_WAIT.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        yield s.getsockname()[1]
