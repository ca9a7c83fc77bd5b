"""Start and stop real vLLM servers for the tests; nothing they started may outlive its owner.

`SharedServers` is the session's servers, one per configuration (model, dtype, flags, environment),
handed to every module that asks for that configuration, reset to its checkpoint between modules;
`ServerPool` is a module's own servers; `Rig` (`ServerPool.rig`) is the one way to get "a vLLM
server + a shim + a Fleet"; `module_pool` is the module fixture's body: the pool, then at teardown
every rig closed and every server it owns stopped, and the proof that no process of them survived.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from refit_grpc.driver import Checks, Fleet, WorkerEndpoint
from refit_grpc.shim.process import ShimProcess, spawn_shim
from refit_grpc.testing.vllm import VLLMServer


class SharedServers:
    """The session's vLLM servers, one per configuration: modules that ask for the same model,
    dtype, flags and environment share one server instead of each starting its own (30-70 s a
    start on 2 cores). The configuration is the key, so a module never gets a server started
    otherwise than it asked.

    A module gets the server in a known state: serving its checkpoint (sent back over a group of
    its own, then checked by generating against transformers), resumed, no weight-transfer group
    left, weight version "default" as at start. One that cannot be brought back (its process
    gone, /health failing, the reset refused, or a generation that is not the checkpoint's) is
    stopped and started again, so a module that leaves its server broken costs the next one a
    start, never its correctness. A module that replaces a server (kills it and starts another
    on its port) hands the new one over with `replace`."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self._servers: dict[tuple, VLLMServer] = {}
        self._stopped: list[VLLMServer] = []
        self.starts = self.resets = 0

    @staticmethod
    def key(model_dir: Path, dtype: str = "float32", extra_args: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> tuple:
        return (str(model_dir), dtype, tuple(extra_args), tuple(sorted((env or {}).items())))

    def server(self, model_dir: Path, *, dtype: str = "float32",
               extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
               ready_timeout_s: float = 300.0) -> VLLMServer:
        """The configuration's server, started on first use and reset to its checkpoint on each
        later one."""
        key = self.key(model_dir, dtype, extra_args, env)
        server = self._servers.pop(key, None)
        if server is not None and not self._reset(server, model_dir, dtype):
            server.stop()
            self._stopped.append(server)
            server = None
        if server is None:
            args = tuple(extra_args) + (() if dtype == "float32" else ("--dtype", dtype))
            log = self.log_dir / f"shared-{self.starts}.log"
            server = VLLMServer(model_dir, log_path=log, extra_args=args, env=env)
            server.start()
            server.wait_ready(ready_timeout_s)
            self.starts += 1
        self._servers[key] = server
        return server

    def replace(self, old: VLLMServer, new: VLLMServer) -> None:
        """`new` takes `old`'s place (its configuration's server from now on)."""
        for key, server in self._servers.items():
            if server is old:
                self._servers[key] = new
                self._stopped.append(old)
                return
        raise KeyError("not a shared server")

    def restart(self, old: VLLMServer, ready_timeout_s: float = 300.0) -> VLLMServer:
        """A new server of `old`'s configuration on `old`'s port, for a module that killed `old`
        (a crash test): it takes `old`'s place, so later modules get it, and the session stops it."""
        new = VLLMServer(old.model_dir, old.port, self.log_dir / f"shared-{self.starts}.log",
                         extra_args=old.extra_args, env=old.env)
        self.replace(old, new)  # before the start: stop_all reaches it even if the start fails
        new.start()
        new.wait_ready(ready_timeout_s)
        self.starts += 1
        return new

    def _reset(self, server: VLLMServer, model_dir: Path, dtype: str) -> bool:
        import torch

        from refit_grpc.plan import Packing, RefitPlan
        from refit_grpc.testing.vllm import (
            PROMPT,
            complete,
            direct_cycle,
            direct_group,
            hf_greedy,
            http_json,
            load_hf_model,
            release_group,
        )

        if server.proc is None or server.proc.poll() is not None:
            return False
        try:
            if http_json("GET", server.url, "/health", timeout_s=5.0)[0] != 200:
                return False
            model = load_hf_model(model_dir)
            tensors = {n: t.detach().to(getattr(torch, dtype)).contiguous()
                       for n, t in model.state_dict().items()}
            plan = RefitPlan.from_tensors(tensors.items(), Packing(256 * 1024, 2))
            group = direct_group(server.url, plan)
            try:
                # "default": the version vLLM declares before its first update.
                direct_cycle(server.url, group, plan, tensors, "default")  # type: ignore[arg-type]
            finally:
                group.close()
                release_group(server.url)
            if http_json("GET", server.url, "/weight_info")[1] != {"weight_version": "default"}:
                return False
            self.resets += 1
            return complete(server.url, PROMPT, 6)["token_ids"] == hf_greedy(model, PROMPT, 6)
        except Exception:  # noqa: BLE001  (any failure: start a fresh one)
            return False

    def stop_all(self) -> list[int]:
        """Stop every server; returns the pids of any process that survived (must be empty)."""
        everyone = [*self._servers.values(), *self._stopped]
        self._servers.clear()
        for server in everyone:
            server.stop()
        return sorted({pid for s in everyone for pid in s.group_pids() if _alive(pid)})


class ServerPool:
    """Every VLLMServer a test module started (alone, or in a `Rig`), stopped (and checked gone)
    at its teardown."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.started: list[VLLMServer] = []
        self.rigs: list[Rig] = []

    def start(self, model_dir: Path, port: int | None = None, *, cpu_bind: str | None = None,
              ready_timeout_s: float = 300.0) -> VLLMServer:
        n = len(self.started)
        server = VLLMServer(model_dir, port, self.log_dir / f"vllm-{n}.log", cpu_bind=cpu_bind)
        self.started.append(server)
        server.start()
        server.wait_ready(ready_timeout_s)
        return server

    def rig(self, name: str, model_dir: Path, **options) -> Rig:
        """A `Rig` of this pool (not started): closed by `stop_all`."""
        rig = Rig(self, name, model_dir, **options)
        self.rigs.append(rig)
        return rig

    def stop_all(self) -> list[int]:
        """Close every rig (fleet, shim, server), stop every server; returns the pids of any
        process that survived (must be empty)."""
        survivors = [pid for rig in self.rigs for pid in rig.close()]
        for server in self.started:
            server.stop()
        survivors += [pid for s in self.started for pid in s.group_pids()]
        return sorted({pid for pid in survivors if _alive(pid)})


@contextmanager
def module_pool(tmp_path_factory, name: str) -> Iterator[ServerPool]:
    """A test module's pool, logs in a temporary directory `name`; at the end, everything it
    started is stopped and none of its processes may have survived."""
    pool = ServerPool(tmp_path_factory.mktemp(name))
    try:
        yield pool
    finally:
        survivors = pool.stop_all()
        assert not survivors, f"vLLM processes outlived the module: {survivors}"


class Rig:
    """One vLLM server of one model and dtype, a real `refit-grpc shim --engine vllm` process in
    front of it and a one-worker `Fleet`: the one way a test module gets "a vLLM server + a shim
    + a Fleet" (`ServerPool.rig`). `start` only launches the server (so two can boot at once),
    `ready` waits for it and starts the shim; the server goes into `pool.started`, whose
    teardown (`ServerPool.stop_all`) closes the rig and proves no process of it survived."""

    def __init__(self, pool, name: str, model_dir: Path, dtype: str = "float32",
                 buffer_size_bytes: int = 256 * 1024, epoch_timeout_s: float = 60.0,
                 env: dict[str, str] | None = None, tensor_parallel: int = 1,
                 server: VLLMServer | None = None, extra_args: tuple[str, ...] = ()):
        self.pool, self.name, self.model_dir, self.dtype = pool, name, model_dir, dtype
        self.extra_args = tuple(extra_args)  # more vLLM flags (e.g. --quantization)
        # A server given here (a `SharedServers` one) is used, never stopped, by the rig.
        self.own_server = server is None
        self.env = dict(env or {})
        self.tensor_parallel = tensor_parallel
        if tensor_parallel > 1:
            # vLLM CPU binds each TP rank's OpenMP threads to its own cores: one core each here.
            self.env.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                                "|".join(str(r) for r in range(tensor_parallel)))
        self.buffer_size_bytes = buffer_size_bytes
        self.epoch_timeout_s = epoch_timeout_s
        self.server: VLLMServer | None = server
        self.shim: ShimProcess | None = None
        self.fleet: Fleet | None = None
        self._link = None
        self._link_info: list | None = None

    def start(self) -> Rig:
        if self.server is not None:  # given, or started already
            return self
        # vllm_command passes --dtype float32; vLLM's parser lets the later --dtype win.
        extra = () if self.dtype == "float32" else ("--dtype", self.dtype)
        if self.tensor_parallel > 1:
            extra += ("--tensor-parallel-size", str(self.tensor_parallel))
        extra += self.extra_args
        self.server = VLLMServer(self.model_dir, log_path=self.pool.log_dir / f"{self.name}.log",
                                 extra_args=extra, env=self.env)
        self.pool.started.append(self.server)
        self.server.start()
        return self

    def ready(self, timeout_s: float = 300.0) -> Rig:
        if self.server is None:
            self.start()
        assert self.server is not None
        if self.shim is None:
            self.server.wait_ready(timeout_s)
            self.shim = spawn_shim("--engine", "vllm", "--engine-url", self.server.url,
                                   "--instance-id", self.name, "--buffer-size-bytes",
                                   str(self.buffer_size_bytes), "--num-buffers", "2",
                                   "--max-epoch-s", str(self.epoch_timeout_s))
            self.fleet = self.new_fleet()
        return self

    def new_fleet(self) -> Fleet:
        """A one-worker `Fleet` on the shim with the rig's deadlines: `fleet` is the rig's own,
        a test that wants a fresh one calls this (and closes it)."""
        if self.shim is None:
            raise RuntimeError(f"rig {self.name} is not ready")
        return Fleet([WorkerEndpoint(self.shim.instance_id, self.shim.address)],
                     engine_world_size=self.tensor_parallel, control_timeout_s=30,
                     join_timeout_s=60, epoch_timeout_s=self.epoch_timeout_s)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def refit(self, tensors: dict, version: int, canary=None, epoch=None, adapter=None):
        """One `Fleet.refit` (`epoch`: in place with its Flush by default, staged for an
        `adapter` plan; the canary when given); a new plan, or a failed epoch, forms a new
        group first."""
        info = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()] + [adapter]
        if self._link is None or info != self._link_info:
            self._close_link()
            self.fleet.prepare({n: (shape, dtype) for n, shape, dtype in info[:-1]},
                               adapter=adapter)
            self._link, self._link_info = self.fleet.connect("127.0.0.1"), info
        try:
            return self.fleet.refit(self._link, tensors, version=version,
                                    checks=Checks(canary=canary),
                                    **({} if epoch is None else {"epoch": epoch}))
        except BaseException:
            self._close_link()
            raise

    def _close_link(self) -> None:
        link, self._link, self._link_info = self._link, None, None
        if link is not None:
            link.close()

    def close(self) -> list[int]:
        """Stop fleet, shim and server (again: a no-op); returns the pids of the server that
        survived."""
        self._close_link()
        fleet, shim, self.fleet, self.shim = self.fleet, self.shim, None, None
        if fleet is not None:
            fleet.close()
        if shim is not None:
            shim.stop()
        if self.server is None or not self.own_server:
            return []
        self.server.stop()
        return self.server.group_pids()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
