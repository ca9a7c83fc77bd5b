"""Shim processes forked from a server that has already imported torch and the shim, for tests
that need many short-lived shims (each one killed): a fresh interpreter spends 2-3 s importing
torch on a 2-core host, a fork milliseconds.

Each shim is its own process running `refit-grpc shim`'s entry point (`shim.command.main`),
with its own gRPC server and gloo sockets, killed by real signals; only its start differs from
`shim.process.spawn_shim`. The fork server is multiprocessing's: it forks from a single thread
that has never started gRPC, and it exits with the process that started it (so do its shims:
each asks the kernel for SIGTERM when its parent, the fork server, goes).
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
from dataclasses import dataclass

from refit_grpc.shim.process import METRICS_PREFIX, READY_PREFIX, ShimProcess, die_with_parent

_PRELOAD = ["refit_grpc.shim.command", "refit_grpc.dataplane.transfer", "refit_grpc.shim.server",
            "refit_grpc.shim.service", "refit_grpc.shim.engines.reference"]


class _Lines(io.TextIOBase):
    """The child's stdout: every write goes to the parent over a pipe."""

    def __init__(self, conn: multiprocessing.connection.Connection):
        self._conn = conn

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        try:
            self._conn.send(text)
        except OSError:  # the parent stopped listening: nothing else reads this
            pass
        return len(text)


def _run_shim(argv: list[str], conn: multiprocessing.connection.Connection) -> None:
    die_with_parent(os.getppid())  # the fork server, which ends with the process that started it
    sys.stdout = _Lines(conn)
    from refit_grpc.shim.command import main

    sys.exit(main(argv[1:]))  # argv[0] is the command's name, "shim"


class _PopenOf:
    """A forked process seen through the part of `subprocess.Popen` that `ShimProcess` and its
    users call (poll, wait, send_signal, kill, terminate, pid, returncode)."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process

    @property
    def pid(self) -> int:
        pid = self._process.pid
        if pid is None:
            raise RuntimeError("the process was never started")
        return pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"forked shim {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        # As `Popen.send_signal` does (bpo-40550): the exit code comes from the fork server, so
        # the process may already be gone (reaped there) while `exitcode` still says None.
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self._process.kill()

    def terminate(self) -> None:
        self._process.terminate()


@dataclass
class ForkedShim:
    process: multiprocessing.process.BaseProcess
    address: str
    instance_id: str
    metrics_address: str | None = None  # HOST:PORT of its metrics endpoint, when it serves one

    def as_shim_process(self) -> ShimProcess:
        """The same process as a `ShimProcess` (what `spawn_shim` returns): `proc` answers the
        Popen calls tests make (poll, wait, send_signal, kill)."""
        return ShimProcess(_PopenOf(self.process), self.address,  # type: ignore[arg-type]
                           self.instance_id, self.metrics_address)

    @property
    def pid(self) -> int:
        pid = self.process.pid
        if pid is None:
            raise RuntimeError(f"shim {self.instance_id}: its process was never started")
        return pid

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self, timeout_s: float) -> int | None:
        """The exit code (negative: killed by that signal), or None if still running."""
        self.process.join(timeout_s)
        return self.process.exitcode

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.process.exitcode is None:
            self.process.terminate()
            if self.wait(timeout_s) is None:
                self.process.kill()
                self.wait(5)
        return self.process.exitcode


class ShimForkServer:
    """Starts shims (`start(*args)`, the arguments of `refit-grpc shim`); `close()` stops every
    one still running."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(_PRELOAD)
        self.started: list[ForkedShim] = []

    def start(self, *args: str, timeout_s: float = 60.0) -> ForkedShim:
        return self.start_engines(1, *args, timeout_s=timeout_s)[0]

    def start_engines(self, engines: int, *args: str, timeout_s: float = 60.0
                      ) -> list[ForkedShim]:
        """One process serving `engines` engines (`refit-grpc shim --engines`, which share one
        receiving rank when more than one): a `ForkedShim` per engine, the same process."""
        argv = ["shim", *args]
        if "--address" not in args:
            argv += ["--address", "127.0.0.1:0"]
        if engines != 1:
            argv += ["--engines", str(engines)]
        receive, send = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(target=_run_shim, args=(argv, send), daemon=True)
        process.start()
        send.close()
        metrics_address = None
        shims: list[ForkedShim] = []
        try:
            while receive.poll(timeout_s):
                # One write may carry several lines (stdout is not line-buffered here).
                for text in receive.recv().splitlines():
                    if text.startswith(METRICS_PREFIX):
                        url = text[len(METRICS_PREFIX):].strip()
                        metrics_address = url.removeprefix("http://").removesuffix("/metrics")
                    if text.startswith(READY_PREFIX):
                        address, instance_id = text[len(READY_PREFIX):].split()
                        shims.append(ForkedShim(process, address, instance_id, metrics_address))
                if len(shims) == engines:
                    self.started += shims
                    return shims
        except EOFError:
            pass
        finally:
            receive.close()
        process.kill()
        process.join(5)
        raise RuntimeError(f"forked shim {argv} did not serve within {timeout_s}s "
                           f"(exit code {process.exitcode})")

    def close(self) -> None:
        stopped: set[int] = set()
        for shim in self.started:
            if id(shim.process) not in stopped:  # the engines of one process stop together
                stopped.add(id(shim.process))
                shim.stop()

    def __enter__(self) -> ShimForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
