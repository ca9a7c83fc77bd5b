"""The one way this project picks a free TCP port."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A port free on `host` (default: every address, since a TCPStore master listens on all of
    them). Racy by nature: the caller binds it soon after, and a test retries nothing on a clash."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
