"""Helpers shared by the test modules: builders (weights, endpoints, a connected fleet), plans from
tensors, Describe over a fresh channel, a shim in this process, the trainer's end of a group, and a
fleet brought to the middle of an epoch.

Fixtures built on these live in conftest.py; test modules import helpers from here, never from
one another.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Mapping

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

from refit_grpc import Fleet, PauseMode, WorkerEndpoint
from refit_grpc.common import Deadline, GroupSpec
from refit_grpc.dataplane.group import Group
from refit_grpc.dataplane.rendezvous import bind_master_store
from refit_grpc.dataplane.transfer import Sender
from refit_grpc.driver.epoch import EpochHandle
from refit_grpc.driver.links import TrainerLink
from refit_grpc.plan import Packing, RefitPlan, weights_digest
from refit_grpc.proto import DTYPE_TO_PROTO, pb, pb_grpc
from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.server import ServerOptions, ShimServer
from refit_grpc.shim.service import ShimConfig
from refit_grpc.testing.ports import unused_port

__all__ = ["Epoch", "InProcessShim", "ReadyShim", "connected", "describe", "describe_or_none",
           "digest_of", "endpoint", "endpoints", "fleet_mid_epoch", "full_epoch", "info", "join",
           "join_trainer", "prepare_request", "start_ready_shim", "tensors_v", "unused_port",
           "weights", "weights_in_mib"]


# --- builders: weights, endpoints, a connected fleet --------------------------------------------


def weights(version: int, layers: int = 4, numel: int = 64 * 1024, *,
            shape: tuple[int, ...] | None = None, name: str = "layer.{i}"
            ) -> dict[str, torch.Tensor]:
    """`layers` float32 tensors named `name.format(i=i)`, each `numel` long (or of `shape`), whose
    values follow `version`: the same version gives the same bytes, in any module."""
    g = torch.Generator().manual_seed(version)
    size = shape if shape is not None else (numel,)
    return {name.format(i=i): torch.randn(*size, generator=g) for i in range(layers)}


def weights_in_mib(default_mib: int) -> Callable[..., dict[str, torch.Tensor]]:
    """A `weights(version, mib=default_mib)` builder: `mib` float32 tensors of 1 MiB each."""
    def build(version: int, mib: int = default_mib) -> dict[str, torch.Tensor]:
        return weights(version, mib, 256 * 1024)
    return build


def digest_of(tensors: Mapping[str, torch.Tensor]) -> str:
    """The weights digest of a state dict, in its order (what Describe reports once committed)."""
    return weights_digest(tensors.items())


def endpoint(name: str, shim) -> WorkerEndpoint:
    """`shim` (anything with an address) under the instance id `name`."""
    return WorkerEndpoint(name, shim.address)


def endpoints(shims, prefix: str | None = None) -> list[WorkerEndpoint]:
    """Endpoints of `shims`: under their own instance ids, or `f"{prefix}{i}"` when given."""
    return [WorkerEndpoint(s.instance_id if prefix is None else f"{prefix}{i}", s.address)
            for i, s in enumerate(shims)]


def connected(fleet: Fleet, tensors: Mapping[str, torch.Tensor], ip: str = "127.0.0.1",
              **connect) -> TrainerLink:
    """Prepare the plan of `tensors` on every shim, then form the group with this process as the
    trainer (rank 0, its store on `ip`; `connect` goes to `Fleet.connect`); returns the link."""
    fleet.prepare(info(tensors))
    return fleet.connect(ip, **connect)


# --- a shim's Prometheus endpoint -------------------------------------------------------------


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    """Every sample at http://ADDRESS/metrics, keyed by (name, labels)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# --- plans and Describe -----------------------------------------------------------------------


def info(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`{name: (shape, dtype)}` of a state dict, in its order: what `Fleet.prepare` takes."""
    return {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}


def describe(address: str, timeout_s: float = 3.0, token: str | None = None) -> pb.DescribeResponse:
    """Describe over a fresh channel: it measures the shim, not a driver connection that an
    outage left waiting out its reconnect backoff. Raises grpc.RpcError."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.RefitServiceStub(channel).Describe(pb.DescribeRequest(), timeout=timeout_s,
                                                          metadata=metadata)


def describe_or_none(address: str, timeout_s: float = 3.0) -> pb.DescribeResponse | None:
    """`describe`, or None where the shim does not answer (killed, frozen, restarting)."""
    try:
        return describe(address, timeout_s)
    except grpc.RpcError:
        return None


# --- a shim in this process -------------------------------------------------------------------


class InProcessShim:
    """A ShimServer in the test process (real gRPC on loopback) and a stub to it."""

    def __init__(self, engine: Engine | None = None, config: ShimConfig | None = None):
        self.engine = engine or ReferenceEngine()
        self.server = ShimServer(self.engine, config or ShimConfig(max_epoch_s=20),
                                 ServerOptions(address="127.0.0.1:0", grace_s=1)).start()
        self.address = self.server.address
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.RefitServiceStub(self.channel)

    def describe(self) -> pb.DescribeResponse:
        return self.stub.Describe(pb.DescribeRequest(), timeout=5)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(1)


def join_trainer(world_size: int, group_id: str, timeout_s: float = 20.0):
    """Bind trainer rank 0's store on a port the kernel picks, then join on a thread; returns
    (port, thread, box) where box['group'] is the Group. The store listens before this returns,
    so the port can be handed to the other ranks at once."""
    store = bind_master_store("127.0.0.1", 0, world_size, timeout_s)
    port = store.port
    box: dict = {}

    def run() -> None:
        try:
            box["group"] = Group.join(GroupSpec("127.0.0.1", port, world_size, 0, "gloo",
                                                group_id), timeout_s, store=store)
        except Exception as e:  # noqa: BLE001  (the test asserts on it)
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return port, t, box


def tensors_v(version: int) -> dict[str, torch.Tensor]:
    """A small plan's tensors (float32 matrix and vector, a bool mask); values follow `version`."""
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g),
            "mask": torch.rand(100, generator=g) > 0.5}


def prepare_request(tensors: Mapping[str, torch.Tensor],
                    packing: Packing = Packing(4096, 2)) -> pb.PrepareRequest:
    return pb.PrepareRequest(
        tensors=[pb.TensorSpec(name=n, shape=t.shape, dtype=DTYPE_TO_PROTO[t.dtype])
                 for n, t in tensors.items()],
        packing=pb.Packing(buffer_size_bytes=packing.buffer_size_bytes,
                           num_buffers=packing.num_buffers))


def join(sh: InProcessShim, digest: str, group_id: str = "g1") -> Group:
    """Join the shim (rank 1) and this test as trainer rank 0; returns the trainer's Group."""
    port, t, box = join_trainer(2, group_id)
    phases = [m.phase for m in sh.stub.InitCollective(pb.InitCollectiveRequest(
        master_address="127.0.0.1", master_port=port, world_size=2, rank_offset=1,
        backend=pb.BACKEND_GLOO, group_id=group_id, plan_digest=digest), timeout=20)]
    t.join(20)
    assert phases == [pb.INIT_COLLECTIVE_PHASE_ACCEPTED, pb.INIT_COLLECTIVE_PHASE_JOINED]
    return box["group"]


class Epoch:
    """An UpdateWeights stream read on a thread (an in-place epoch paused `mode`; subclasses send
    other requests through `_open`)."""

    def __init__(self, sh: InProcessShim, version: int, digest: str, group_id: str = "g1",
                 mode=pb.PAUSE_MODE_KEEP):
        self._open(sh.stub, pb.UpdateWeightsRequest(
            version=version, plan_digest=digest, group_id=group_id, pause_mode=mode))

    def _open(self, stub, request: pb.UpdateWeightsRequest) -> None:
        self.messages: list[pb.UpdateWeightsResponse] = []
        self.error: grpc.RpcError | None = None
        self.accepted = threading.Event()
        self.call = stub.UpdateWeights(request, timeout=20)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for m in self.call:
                self.messages.append(m)
                if m.phase == pb.UPDATE_WEIGHTS_PHASE_ACCEPTED:
                    self.accepted.set()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.accepted.set()

    def join(self) -> Epoch:
        self.thread.join(20)
        assert not self.thread.is_alive()
        return self


def full_epoch(sh: InProcessShim, group: Group, plan: RefitPlan, tensors, version: int) -> Epoch:
    ep = Epoch(sh, version, plan.digest)
    assert ep.accepted.wait(10) and ep.error is None
    Sender(group, plan).send(tensors, Deadline(20))
    ep.join()
    assert ep.error is None, ep.error
    return ep


class ReadyShim:
    """An in-process shim in READY at version 1 of `tensors_v(1)`, flushed, with a live group."""

    def __init__(self, config: ShimConfig):
        self.shim = InProcessShim(ReferenceEngine(model=None), config)
        t1 = tensors_v(1)
        self.plan = RefitPlan.from_tensors(t1.items(), Packing(4096, 2))
        self.shim.stub.Prepare(prepare_request(t1), timeout=5)
        self.group = join(self.shim, self.plan.digest, "g1")
        full_epoch(self.shim, self.group, self.plan, t1, 1)
        self.shim.stub.Flush(pb.FlushRequest(), timeout=5)

    def close(self) -> None:
        self.group.close()
        self.shim.close()


def start_ready_shim(config: ShimConfig | None = None) -> ReadyShim:
    return ReadyShim(config or ShimConfig(max_epoch_s=20))


# --- a fleet mid-epoch ------------------------------------------------------------------------


def fleet_mid_epoch(fleet: Fleet, tensors: Mapping[str, torch.Tensor], version: int, *,
                    committed: Mapping[str, torch.Tensor] | None = None,
                    mode: PauseMode = PauseMode.KEEP) -> tuple[TrainerLink, EpochHandle]:
    """Prepare the plan of `tensors`, connect as trainer rank 0 (refitting `committed` as version
    `version - 1` first when given), then open epoch `version` and return once every shim said
    ACCEPTED: each is paused and about to receive, and no byte of the epoch has moved."""
    link = connected(fleet, tensors)
    if committed is not None:
        fleet.refit(link, committed, version=version - 1)
    handle = fleet.update_weights(version, mode)
    handle.wait_accepted()
    return link, handle
