"""Start and stop real vLLM servers for a test module; nothing they started may outlive it."""

from __future__ import annotations

import os
from pathlib import Path

from refit_grpc.testing.vllm import VLLMServer


class ServerPool:
    """Every VLLMServer a test module started, stopped (and checked gone) at its teardown."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.started: list[VLLMServer] = []

    def start(self, model_dir: Path, port: int | None = None, *, cpu_bind: str | None = None,
              ready_timeout_s: float = 300.0) -> VLLMServer:
        n = len(self.started)
        server = VLLMServer(model_dir, port, self.log_dir / f"vllm-{n}.log", cpu_bind=cpu_bind)
        self.started.append(server)
        server.start()
        server.wait_ready(ready_timeout_s)
        return server

    def stop_all(self) -> list[int]:
        """Stop every server; returns the pids of any process that survived (must be empty)."""
        for server in self.started:
            server.stop()
        survivors = [pid for s in self.started for pid in s.group_pids()]
        return [pid for pid in survivors if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
