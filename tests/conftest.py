"""Fixtures: real gRPC servers on loopback, real shim processes, real gloo groups. The helpers they
are built on, and the ones tests use directly, are in support.py."""

from __future__ import annotations

import signal

import pytest

from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.process import ShimProcess
from refit_grpc.shim.service import ShimConfig

from support import InProcessShim, ReadyShim, start_ready_shim, unused_port


@pytest.fixture
def shim():
    made: list[InProcessShim] = []

    def make(engine: Engine | None = None, config: ShimConfig | None = None) -> InProcessShim:
        s = InProcessShim(engine, config)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def store_shims(shim):
    """In-process shims of the reference engine in store mode (any layout a plan gives), with a
    20 s epoch cap, made on demand: `store_shims()`."""
    return lambda: shim(ReferenceEngine(model=None), ShimConfig(max_epoch_s=20))


@pytest.fixture
def closed_port():
    """A loopback port where nothing listens, held for the test: connects are refused, and no
    other process can take it meanwhile (a port picked free could be bound by anyone)."""
    with unused_port() as port:
        yield port


@pytest.fixture(scope="module")
def ready_shim():
    """A store-mode shim in READY at version 1 with a live group, for the whole module; its limits
    admit any plan of up to 1 GiB and 10,000 tensors."""
    ready: ReadyShim = start_ready_shim(ShimConfig(max_epoch_s=20, max_plan_bytes=1 << 30,
                                                   max_plan_tensors=10_000))
    yield ready
    ready.close()


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory):
    """The session's shared vLLM servers (`vllm_support.servers.SharedServers`): a module asks
    `vllm_servers.server(model_dir, ...)` and gets the one server of that configuration, reset to
    its checkpoint; at the session's end every one is stopped and none of their processes may
    survive. Skips, with the reason, where vLLM is not installed."""
    from vllm_support import require_vllm
    from vllm_support.servers import SharedServers

    require_vllm()
    shared = SharedServers(tmp_path_factory.mktemp("vllm-shared"))
    yield shared
    survivors = shared.stop_all()
    print(f"\nshared vLLM servers: {shared.starts} started, {shared.resets} reset for a module")
    assert not survivors, f"shared vLLM processes outlived the session: {survivors}"


@pytest.fixture(scope="session")
def dynamo_deployment(tmp_path_factory):
    """The session's shared Dynamo worker and frontend (`dynamo_support.SharedDynamo`), started
    by the first module that asks; at the session's end none of their processes may survive."""
    from dynamo_support import SharedDynamo

    shared = SharedDynamo(tmp_path_factory.mktemp("dynamo-shared"))
    yield shared
    survivors = shared.stop_all()
    print(f"\nshared Dynamo deployments: {shared.starts} started")
    assert not survivors, f"shared Dynamo processes outlived the session: {survivors}"


@pytest.fixture(scope="session")
def shim_forks():
    """The session's fork server for shim processes (`refit_grpc.testing.forked_shims`): it has
    imported torch and the shim once, so a shim starts in milliseconds, not the 2-3 s (10-20 s on
    a loaded host) a fresh interpreter spends importing torch."""
    from refit_grpc.testing.forked_shims import ShimForkServer

    with ShimForkServer() as server:
        yield server


@pytest.fixture
def shim_procs(shim_forks):
    """Start shim processes: each a real process of its own running `refit-grpc shim`'s entry
    point with these arguments (its own gRPC server, gloo sockets, signals), forked from the
    session's fork server; on teardown every one must have exited. Starting `refit-grpc shim`
    from a fresh interpreter (`spawn_shim`) is test_spawn.py's, the demo's and the CLI tests'."""
    procs: list[ShimProcess] = []

    def start(*args: str) -> ShimProcess:
        p = shim_forks.start(*args).as_shim_process()
        procs.append(p)
        return p

    yield start
    # SIGTERM to all first: each takes about a second to stop gracefully, and they do it at once.
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop()
    assert all(p.proc.poll() is not None for p in procs), "a shim process outlived its test"
