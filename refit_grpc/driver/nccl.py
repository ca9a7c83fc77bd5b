"""Trainer rank 0 for vLLM's own `nccl` weight-transfer backend (GPU engines).

vLLM's NCCL receiver (`vllm.distributed.weight_transfer.nccl_engine`) does not form a torch
process group: each worker calls `StatelessProcessGroup.create(master_address, master_port, rank,
world_size)` (a bare TCPStore, no prefix; rank 0 hosts it) and builds a `PyNcclCommunicator` on it,
which takes the `ncclUniqueId` that rank 0 publishes under the store key `broadcast_from/0/0`, runs
`ncclCommInitRank` and a one-element warm-up all_reduce. A `ProcessGroupNCCL` (what
`refit_grpc.dataplane.group.Group` builds) cannot join that, so this module is the trainer's side of
vLLM's rendezvous, done with vLLM's own classes (imported lazily: the trainer needs vLLM installed
for this path only):

    rendezvous   StatelessProcessGroup.create(ip, port, rank=0, world_size) + PyNcclCommunicator
    wire         the plan's buckets (`RefitPlan.buckets`, vLLM's packing rule), packed by
                 `dataplane.packing.pack_into`, one ncclBroadcast from rank 0 per bucket, in plan order
    worker side  /init_weight_transfer_engine with `wire.vllm.init_info_for(...)`: packed=true
                 and the plan's buffer size and count, so vLLM's consumer cuts the same buckets

With a `Fleet(backend="nccl")` of shims in front of vLLM engines started with
`--weight-transfer-config '{"backend": "nccl"}'`, `Fleet.connect` joins through this module:

    link = fleet.connect(my_ip)                  # shims join (InitCollective), trainer joins
    fleet.refit(link, model.state_dict())        # same epochs, deadlines and aborts as gloo

Every wait is bounded: the rendezvous runs on a helper thread joined with the join deadline, and
the broadcast's completion is polled through CUDA events against the epoch deadline; on expiry the
communicator is aborted (`ncclCommAbort`), which fails the peers' pending collectives.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refit_grpc.common import Deadline
from refit_grpc.dataplane.packing import pack_into
from refit_grpc.dataplane.staging import StagedDigest
from refit_grpc.dataplane.transfer import TransferStats
from refit_grpc.errors import (
    CollectiveError,
    InvalidArgumentError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import Bucket, RefitPlan
from refit_grpc.reasons import Reason

# The one key vLLM's PyNcclCommunicator exchanges through a StatelessProcessGroup: rank 0's
# first broadcast_obj (the pickled ncclUniqueId). No prefix: the store is the group.
UNIQUE_ID_KEY = "broadcast_from/0/0"
_POLL_S = 0.002


def listen(master_address: str, port: int = 0) -> socket.socket:
    """Rank 0's store listener, bound before any worker is told the port: with 0 the kernel
    picks a free one as it binds (`getsockname()[1]`), so no other process can take it between
    a pick and the bind. Bound as vLLM's `StatelessProcessGroup.create` binds its own, and
    handed to it (`open_rendezvous(..., listen_socket=)`), whose store takes it over."""
    if not 0 <= port < 65536:
        raise InvalidArgumentError(f"master_port {port} out of range",
                                   reason=Reason.INVALID_MASTER_PORT)
    sock = socket.socket(socket.AF_INET6 if ":" in master_address else socket.AF_INET,
                         socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((master_address, port))
        sock.listen()
    except OSError as e:
        sock.close()
        raise CollectiveError(f"NCCL rendezvous store at {master_address}:{port} could not "
                              f"listen: {e}", reason=Reason.RENDEZVOUS_FAILED) from e
    return sock


def open_rendezvous(master_address: str, master_port: int, world_size: int, timeout_s: float,
                    listen_socket: socket.socket | None = None):
    """Rank 0's `StatelessProcessGroup` (hosts the TCPStore; returns once every rank connected,
    or raises after `timeout_s`). vLLM's own class, so keys and framing are vLLM's. With
    `listen_socket` (from `listen`), the store serves on it instead of binding `master_port`."""
    from vllm.distributed.utils import StatelessProcessGroup

    extra = {"listen_socket": listen_socket} if listen_socket is not None else {}
    return StatelessProcessGroup.create(host=master_address, port=master_port, rank=0,
                                        world_size=world_size,
                                        store_timeout=max(1, int(round(timeout_s))), **extra)


class NcclSender:
    """Packs the plan's buckets and broadcasts them from rank 0 over a PyNcclCommunicator.

    `comm` needs `broadcast(tensor, src, stream)` and `destroy()`; `device` is where buckets are
    packed (the communicator's GPU). At most `num_buffers` packed buckets are alive at once.
    """

    def __init__(self, comm, plan: RefitPlan, device: torch.device | str | None = None):
        self.comm = comm
        self.plan = plan
        self.device = torch.device(device) if device is not None else torch.device(
            getattr(comm, "device", "cpu"))
        self.join_seconds = 0.0

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse, before any byte moves, tensors that do not match the plan."""
        self.plan.check_tensors(tensors)

    @classmethod
    def connect(cls, master_address: str, master_port: int, world_size: int, plan: RefitPlan,
                timeout_s: float, device: torch.device | int | None = None, *,
                listen_socket: socket.socket | None = None) -> NcclSender:
        """Join vLLM's NCCL rendezvous as rank 0; returns once the communicator is formed.
        `listen_socket`: the store's listener, already bound on `master_port` (`listen`)."""
        if not torch.cuda.is_available():
            raise InvalidArgumentError("vLLM's nccl backend needs CUDA in the trainer",
                                       reason=Reason.BACKEND_UNAVAILABLE)
        dev = _cuda_device(device)
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
                from vllm.utils.nccl import unpinned_nccl_env

                torch.cuda.set_device(dev)
                pg = open_rendezvous(master_address, master_port, world_size, timeout_s,
                                     listen_socket)
                with unpinned_nccl_env():  # as vLLM's stateless_init_process_group does
                    box["comm"] = PyNcclCommunicator(pg, device=dev)
            except BaseException as e:  # noqa: BLE001  (re-raised typed on the caller's thread)
                box["error"] = e

        t0 = time.monotonic()
        thread = threading.Thread(target=run, daemon=True, name="nccl-rendezvous")
        thread.start()
        thread.join(timeout_s)
        where = f"{master_address}:{master_port}"
        if thread.is_alive():
            # ncclCommInitRank has no timeout of its own; the thread is left to the peers'
            # failure (their shims abort on the same deadline) and dies with the process.
            raise RefitTimeoutError(f"NCCL rendezvous at {where} did not complete within "
                                    f"{timeout_s:.1f}s", reason=Reason.RENDEZVOUS_TIMEOUT)
        if "error" in box:
            if listen_socket is not None:
                listen_socket.close()  # a no-op once vLLM's store took it over
            e = box["error"]
            text = str(e)
            if "timeout" in text.lower() or "timed out" in text.lower():
                raise RefitTimeoutError(f"NCCL rendezvous at {where}: {text[:300]}",
                                        reason=Reason.RENDEZVOUS_TIMEOUT) from e
            raise CollectiveError(f"NCCL rendezvous at {where} failed: {text[:300]}",
                                  reason=Reason.RENDEZVOUS_FAILED) from e
        comm = box["comm"]
        if getattr(comm, "disabled", False):
            raise CollectiveError("PyNcclCommunicator is disabled in this process (no NCCL "
                                  "library, or VLLM_DISABLE_PYNCCL)", reason=Reason.BACKEND_UNAVAILABLE)
        sender = cls(comm, plan, dev)
        sender.join_seconds = time.monotonic() - t0
        return sender

    def send(self, tensors: Mapping[str, torch.Tensor], deadline: Deadline,
             on_bucket: Callable[[Bucket], None] | None = None, *,
             checksums: StagedDigest | None = None) -> TransferStats:
        self.check_tensors(tensors)
        plan, device = self.plan, self.device
        cuda = device.type == "cuda"
        stream = torch.cuda.current_stream(device) if cuda else None
        biggest = max(b.nbytes for b in plan.buckets)
        n = min(plan.packing.num_buffers, len(plan.buckets))
        slots = [torch.empty(biggest, dtype=torch.uint8, device=device) for _ in range(n)]
        done: list[Any] = [None] * n  # CUDA event per slot: its last broadcast has completed
        t0 = time.monotonic()
        try:
            for bucket in plan.buckets:
                k = bucket.index % n
                if done[k] is not None:
                    self._wait(done[k], deadline, f"broadcast of bucket {bucket.index - n}")
                specs = plan.tensors[bucket.start:bucket.stop]
                deadline.check(f"broadcast of bucket {bucket.index}")
                buf = pack_into(slots[k], [tensors[s.name].to(device) for s in specs])
                self.comm.broadcast(buf, src=0, stream=stream)
                if checksums is not None:  # a device-to-host copy of the bucket: staged only
                    checksums.add(bucket, buf)
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    done[k] = ev
                if on_bucket:
                    on_bucket(bucket)
            for ev in done:
                if ev is not None:
                    self._wait(ev, deadline, "final broadcast")
        except RefitError:
            self.close()  # abort: peers blocked in the same collective fail instead of hanging
            raise
        return TransferStats(len(plan.buckets), plan.total_bytes, time.monotonic() - t0)

    def _wait(self, event, deadline: Deadline, what: str) -> None:
        while not event.query():
            deadline.check(what)
            time.sleep(_POLL_S)

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.destroy()  # ncclCommAbort on a daemon thread, joined for at most 5 s


def _cuda_device(device: torch.device | int | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


@dataclass
class NcclLink:
    """What `Fleet.refit` broadcasts through for vLLM's nccl backend (a `TrainerLink`)."""

    sender: NcclSender
    port: int = 0  # the port the rendezvous store listened on

    @property
    def plan(self) -> RefitPlan:
        return self.sender.plan

    def close(self) -> None:
        self.sender.close()
