"""Fixtures: real gRPC servers on loopback, real shim processes, real gloo groups."""

from __future__ import annotations

import threading

import grpc
import pytest

from refit_grpc.collective import Group
from refit_grpc.common import GroupSpec
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.process import ShimProcess, spawn_shim
from refit_grpc.shim.server import ServerOptions, ShimServer
from refit_grpc.shim.service import ShimConfig


def free_port() -> int:
    from refit_grpc.testing.ports import free_port as _free_port

    return _free_port()


class InProcessShim:
    """A ShimServer in the test process (real gRPC on loopback) and a stub to it."""

    def __init__(self, engine=None, config: ShimConfig | None = None):
        self.engine = engine or ReferenceEngine()
        self.server = ShimServer(self.engine, config or ShimConfig(max_epoch_s=20),
                                 ServerOptions(address="127.0.0.1:0", grace_s=1)).start()
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.RefitServiceStub(self.channel)

    def describe(self) -> pb.DescribeResponse:
        return self.stub.Describe(pb.DescribeRequest(), timeout=5)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(1)


@pytest.fixture
def shim():
    made: list[InProcessShim] = []

    def make(engine=None, config: ShimConfig | None = None) -> InProcessShim:
        s = InProcessShim(engine, config)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def shim_procs():
    """Start shim processes; on teardown every one must have exited."""
    procs: list[ShimProcess] = []

    def start(*args: str) -> ShimProcess:
        p = spawn_shim(*args)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()
    assert all(p.proc.poll() is not None for p in procs), "a shim process outlived its test"


def join_trainer(port: int, world_size: int, group_id: str, timeout_s: float = 20.0):
    """Join as trainer rank 0 on a thread; returns (thread, box) where box['group'] is the Group."""
    box: dict = {}

    def run() -> None:
        try:
            box["group"] = Group.join(GroupSpec("127.0.0.1", port, world_size, 0, "gloo",
                                                group_id), timeout_s)
        except Exception as e:  # noqa: BLE001  (the test asserts on it)
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box
