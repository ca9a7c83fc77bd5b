"""The sender toward vLLM's own `nccl` backend, checked against vLLM's code.

On CPU: the init info parses into vLLM's dataclass, the ranks are vLLM's, the rendezvous is vLLM's
StatelessProcessGroup (real TCPStore, the unique-id key exchanged), and the bytes and cuts equal
vLLM's packed NCCL producer and consumer (run on CPU with their CUDA streams stubbed out). The
end-to-end NCCL test needs two GPUs: it runs wherever they exist.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest
import torch

from vllm_support import require_vllm

require_vllm()

from vllm.distributed.weight_transfer import nccl_common, packed_tensor  # noqa: E402
from vllm.distributed.weight_transfer.nccl_engine import (  # noqa: E402
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

from refit_grpc.common import Deadline  # noqa: E402
from refit_grpc.driver import Fleet, WorkerEndpoint  # noqa: E402
from refit_grpc.driver.nccl import (  # noqa: E402
    UNIQUE_ID_KEY,
    NcclSender,
    listen,
    open_rendezvous,
)
from refit_grpc.errors import InvalidArgumentError  # noqa: E402
from refit_grpc.plan import Packing, RefitPlan  # noqa: E402
from refit_grpc.wire.vllm import nccl_init_info, update_info_for, worker_ranks  # noqa: E402


def model_like_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Aligned like a real checkpoint (vLLM's consumer views tensors in place, so a tensor must
    start at a multiple of its element size), mixed float32/bfloat16, some non-contiguous."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(6):
        out[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(64, 32, generator=g)
        out[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(32, 64, generator=g).t()
        out[f"model.layers.{i}.norm.weight"] = torch.randn(32, generator=g).to(torch.bfloat16)
    return out


class Recorder:
    """A stand-in communicator on CPU: records what is broadcast, or plays recorded buffers
    back to a receiver. Only the transport is stood in; every byte and cut is vLLM's or ours."""

    def __init__(self, playback: list[torch.Tensor] | None = None):
        self.sent: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.playback = list(playback or [])
        self.device = torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        assert src == 0
        self.sizes.append(tensor.numel())
        if self.playback:
            tensor.copy_(self.playback.pop(0))
        else:
            self.sent.append(tensor.clone())

    def destroy(self) -> None:
        pass


@pytest.fixture
def cpu_streams(monkeypatch):
    """vLLM's packed producer/consumer use CUDA streams only for overlap: stub them on CPU."""
    stream = SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(packed_tensor, "_get_streams", lambda idx, n: (stream,) * n)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)


def test_init_and_update_info_are_vllms():
    plan = RefitPlan.from_tensors(model_like_tensors().items(), Packing(20_000, 3))
    payload = nccl_init_info("10.0.0.1", 29500, 9, 5, plan.packing)
    info = NCCLWeightTransferInitInfo(**payload)
    assert nccl_common.worker_init_payload(info) == payload
    assert (info.packed, info.packed_buffer_size_bytes, info.packed_num_buffers) == \
        (True, 20_000, 3)
    update = NCCLWeightTransferUpdateInfo(**update_info_for(plan, "nccl"))
    assert update.names == [s.name for s in plan.tensors]
    assert update.dtype_names[2] == "bfloat16"


@pytest.mark.parametrize("tp_pp,dp,engines", [(1, 1, 3), (2, 1, 2), (4, 2, 2)])
def test_engine_ranks_are_vllms_and_fill_the_group(monkeypatch, tp_pp, dp, engines):
    seen = []
    monkeypatch.setattr(nccl_common, "stateless_init_process_group",
                        lambda addr, port, rank, world, device: seen.append((addr, port, rank,
                                                                             world)))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    engine_world = tp_pp * dp
    world = 1 + engines * engine_world
    ours = []
    for i in range(engines):
        offset = 1 + i * engine_world  # what Fleet.init_collective gives engine i
        info = NCCLWeightTransferInitInfo(**nccl_init_info("127.0.0.1", 29500, world, offset,
                                                             Packing()))
        for d in range(dp):
            for r in range(tp_pp):
                nccl_common.worker_init_process_group(
                    info, SimpleNamespace(data_parallel_index=d, world_size=tp_pp, rank=r))
        ours += worker_ranks(offset, tp_pp, dp)
    assert [rank for _, _, rank, _ in seen] == ours
    assert sorted(ours) == list(range(1, world))  # with the trainer's 0: every rank once
    assert {(a, p, w) for a, p, _, w in seen} == {("127.0.0.1", 29500, world)}


def test_rendezvous_is_vllms_stateless_process_group():
    from vllm.distributed.utils import StatelessProcessGroup

    listener = listen("127.0.0.1")  # bound before any worker is told the port
    port, world = listener.getsockname()[1], 3
    got: dict[int, object] = {}

    def worker(rank: int) -> None:  # what each vLLM worker's PyNcclCommunicator does first
        pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world, store_timeout=20)
        got[rank] = pg.broadcast_obj(None, src=0)

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in (1, 2)]
    for t in threads:
        t.start()
    trainer = open_rendezvous("127.0.0.1", port, world, timeout_s=20, listen_socket=listener)
    trainer.broadcast_obj(b"unique-id-bytes", src=0)  # PyNcclCommunicator's ncclUniqueId
    for t in threads:
        t.join(20)
    assert got == {1: b"unique-id-bytes", 2: b"unique-id-bytes"}
    assert trainer.store.check([UNIQUE_ID_KEY])


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_sender_bytes_and_cuts_equal_vllms_producer_and_consumer(cpu_streams):
    tensors = model_like_tensors(1)
    for size in (1, 5_000, 20_000, 1 << 30):
        plan = RefitPlan.from_tensors(tensors.items(), Packing(size, 2))
        ours = Recorder()
        NcclSender(ours, plan).send(tensors, Deadline(10))
        assert ours.sizes == [b.nbytes for b in plan.buckets]

        theirs = Recorder()
        packed_tensor.packed_nccl_broadcast_producer(
            iter(tensors.items()), theirs, 0, lambda item: item[1], size, 2)
        assert len(theirs.sent) == len(ours.sent)
        assert all(torch.equal(a, b) for a, b in zip(theirs.sent, ours.sent)), size

        received: dict[str, torch.Tensor] = {}
        player = Recorder(playback=ours.sent)
        packed_tensor.packed_nccl_broadcast_consumer(
            ((s.name, (list(s.shape), s.dtype)) for s in plan.tensors), player, 0,
            lambda pairs, into=received: into.update((n, t.clone()) for n, t in pairs), size, 2,
            device="cpu")
        assert player.sizes == [b.nbytes for b in plan.buckets]  # vLLM's consumer cuts the same
        assert received.keys() == tensors.keys()
        for name, t in tensors.items():
            assert torch.equal(received[name], t.contiguous()), name


def test_sender_refuses_mismatched_tensors_before_any_byte():
    tensors = model_like_tensors()
    plan = RefitPlan.from_tensors(tensors.items(), Packing(5_000, 2))
    rec = Recorder()
    wrong = dict(tensors)
    wrong["model.layers.0.norm.weight"] = torch.zeros(33, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="model.layers.0.norm.weight"):
        NcclSender(rec, plan).send(wrong, Deadline(10))
    assert rec.sizes == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a trainer without CUDA")
def test_connect_refuses_nccl_without_cuda_before_any_rpc():
    # No shim listens at this address: a refusal that came from an RPC would be a FleetError.
    fleet = Fleet([WorkerEndpoint("w", "127.0.0.1:1")], backend="nccl")
    try:
        with pytest.raises(InvalidArgumentError) as e:
            fleet.connect("127.0.0.1")
        assert e.value.reason == "BACKEND_UNAVAILABLE"
    finally:
        fleet.close()


WORKER = textwrap.dedent("""
    import sys, torch
    from types import SimpleNamespace
    from vllm.distributed.weight_transfer.nccl_common import worker_init_process_group
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer
    from refit_grpc.plan import Packing, RefitPlan
    port, out = int(sys.argv[1]), sys.argv[2]
    torch.cuda.set_device(1)
    spec = torch.load(out + ".plan")
    plan = RefitPlan.from_state_dict_info(spec["info"], Packing(*spec["packing"]))
    info = NCCLWeightTransferInitInfo(**nccl_init_info("127.0.0.1", port, 2, 1, plan.packing))
    comm = worker_init_process_group(info, SimpleNamespace(data_parallel_index=0, world_size=1,
                                                           rank=0))
    got = {}
    packed_nccl_broadcast_consumer(
        ((s.name, (list(s.shape), s.dtype)) for s in plan.tensors), comm, 0,
        lambda pairs: got.update((n, t.cpu().clone()) for n, t in pairs),
        plan.packing.buffer_size_bytes, plan.packing.num_buffers, device=torch.device("cuda", 1))
    torch.save(got, out)
""")


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs: vLLM's NCCL receiver on one, the sender on the other")
def test_nccl_sender_feeds_vllms_own_receiver_on_two_gpus(tmp_path):
    tensors = model_like_tensors(2)
    plan = RefitPlan.from_tensors(tensors.items(), Packing(20_000, 2))
    out = str(tmp_path / "received.pt")
    torch.save({"info": plan.state_dict_info(), "packing": (20_000, 2)}, out + ".plan")
    listener = listen("127.0.0.1")  # bound before the worker is told the port
    port = listener.getsockname()[1]
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(port), out])
    try:
        sender = NcclSender.connect("127.0.0.1", port, 2, plan, timeout_s=120, device=0,
                                    listen_socket=listener)
        stats = sender.send({n: t.cuda(0) for n, t in tensors.items()}, Deadline(60))
        assert stats.buckets == len(plan.buckets)
        assert worker.wait(120) == 0
        sender.close()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
    received = torch.load(out)
    for name, t in tensors.items():
        assert torch.equal(received[name], t.contiguous()), name
