"""The wire format, checked against vLLM's own code: bucket cuts and bytes equal `pack_tensors`'s
on hundreds of random plans; the plugin registers; what the shim posts parses into the worker's
dataclasses and rebuilds the sender's exact plan. No server needed."""

from __future__ import annotations

import random
import warnings
from importlib.metadata import entry_points

import pytest
import torch

from vllm_support import require_vllm

require_vllm()

from vllm.distributed.weight_transfer.packed_tensor import (  # noqa: E402
    pack_tensors,
    unpack_tensor,
)

from refit_grpc.common import GroupSpec  # noqa: E402
from refit_grpc.dataplane.packing import as_tensor, pack_into, unpack  # noqa: E402
from refit_grpc.plan import Packing, RefitPlan  # noqa: E402
from refit_grpc.wire.vllm import init_info_for, update_info_for  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64,
          torch.bool, torch.int32, torch.float64]


def random_tensors(rng: random.Random) -> list[tuple[str, torch.Tensor]]:
    """Sizes drawn from one of three regimes: many tiny tensors, tensors around a typical
    buffer size, or a mix with a few much larger ones."""
    regime = rng.choice(["tiny", "around", "mixed"])
    n = rng.randint(1, 60 if regime == "tiny" else 12)
    out = []
    for i in range(n):
        dtype = rng.choice(DTYPES)
        if regime == "tiny":
            numel = rng.randint(1, 7)
        elif regime == "around":
            numel = rng.randint(200, 600)
        else:
            numel = rng.choice([1, 3, rng.randint(10, 100), rng.randint(1000, 4000)])
        shape: tuple[int, ...] = (numel,)
        if numel == 1 and rng.random() < 0.5:
            shape = ()  # a 0-dim tensor
        elif numel % 2 == 0 and rng.random() < 0.5:
            shape = (2, numel // 2)
        t = (torch.randint(0, 2, shape, dtype=torch.int64).to(dtype) if dtype == torch.bool
             else (torch.randn(shape) * 100).to(dtype))
        if t.dim() == 2 and rng.random() < 0.3:
            t = t.t()  # non-contiguous: both sides must linearise it the same way
        out.append((f"layers.{i}.w", t))
    return out


def buffer_sizes(rng: random.Random, tensors) -> list[int]:
    sizes = [t.nbytes for _, t in tensors]
    k = rng.randint(1, len(sizes))
    return sorted({1, min(sizes), max(sizes), sum(sizes), sum(sizes) - 1, sum(sizes[:k]),
                   sum(sizes[:k]) + 1, max(1, sum(sizes[:k]) - 1), rng.randint(1, 2 * sum(sizes)),
                   1 << 30})


def vllm_chunks(tensors, buffer_size: int):
    it = iter(tensors)
    chunks = []
    with warnings.catch_warnings():  # "exceeds buffer_size_bytes": intended here
        warnings.simplefilter("ignore", UserWarning)
        while (chunk := pack_tensors(it, lambda item: item[1], buffer_size)) is not None:
            chunks.append(chunk)
    return chunks


def test_bucket_cuts_equal_vllm_pack_tensors_on_random_plans():
    rng = random.Random(20261202)
    checked = 0
    for _ in range(300):
        tensors = random_tensors(rng)
        for size in buffer_sizes(rng, tensors):
            plan = RefitPlan.from_tensors(tensors, Packing(size, 2))
            names = [[n for n, _ in tensors][b.start:b.stop] for b in plan.buckets]
            chunks = vllm_chunks(tensors, size)
            assert names == [c.names for c in chunks], (size, [t.nbytes for _, t in tensors])
            assert [b.nbytes for b in plan.buckets] == [c.packed_tensor.numel() for c in chunks]
            checked += 1
    assert checked > 1000


def test_packed_bytes_equal_vllm_and_unpack_both_ways():
    rng = random.Random(7)
    for _ in range(60):
        tensors = random_tensors(rng)
        by_name = dict(tensors)
        size = rng.choice(buffer_sizes(rng, tensors))
        plan = RefitPlan.from_tensors(tensors, Packing(size, 2))
        chunks = vllm_chunks(tensors, size)
        for bucket, chunk in zip(plan.buckets, chunks):
            specs = plan.tensors[bucket.start:bucket.stop]
            out = torch.empty(bucket.nbytes, dtype=torch.uint8)
            ours = pack_into(out, [by_name[s.name] for s in specs])
            assert torch.equal(ours, chunk.packed_tensor)
            # vLLM's consumer unpacks our bytes into the original tensors (it can only where every
            # tensor starts at a multiple of its element size: `unpack_tensor` views in place) ...
            if aligned(specs):
                for name, t in unpack_tensor(ours, chunk.names, chunk.shapes, chunk.dtypes,
                                             chunk.tensor_sizes):
                    assert torch.equal(t, by_name[name].contiguous()), name
            # ... and ours unpacks vLLM's, aligned or not.
            for spec, raw in unpack(chunk.packed_tensor, specs):
                assert torch.equal(as_tensor(spec, raw), by_name[spec.name].contiguous())


def aligned(specs) -> bool:
    offset = 0
    for s in specs:
        if offset % s.dtype.itemsize:
            return False
        offset += s.nbytes
    return True


def test_plugin_is_an_entry_point_and_registers_idempotently():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from refit_grpc.vllm_plugin import BACKEND, register
    from refit_grpc.vllm_plugin.engine import RefitGlooWeightTransferEngine

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("refit_grpc_gloo") == "refit_grpc.vllm_plugin:register", eps
    register()
    register()  # vLLM may load plugins more than once per process
    # vLLM's factory has no public lookup (only create_engine, which needs a whole VllmConfig).
    assert WeightTransferEngineFactory._registry[BACKEND]() is RefitGlooWeightTransferEngine


def test_what_the_shim_posts_parses_into_the_workers_dataclasses():
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferInitInfo,
        NCCLWeightTransferUpdateInfo,
    )

    from refit_grpc.vllm_plugin.engine import RefitGlooInitInfo, RefitGlooUpdateInfo

    tensors = random_tensors(random.Random(3))
    plan = RefitPlan.from_tensors(tensors, Packing(512, 3))
    spec = GroupSpec("127.0.0.1", 29500, 4, 2, "gloo", "refit-abc")
    init = RefitGlooInitInfo(**init_info_for(spec, plan, 12.5))
    assert (init.rank_offset, init.world_size, init.group_id) == (2, 4, "refit-abc")
    assert init.packing == plan.packing and init.timeout_s == 12.5
    update = RefitGlooUpdateInfo(**update_info_for(plan, "gloo", 9.0))
    rebuilt = update.plan(init.packing)
    assert rebuilt.digest == plan.digest and rebuilt.buckets == plan.buckets

    nccl_spec = GroupSpec("127.0.0.1", 29500, 4, 2, "gloo", "refit-abc")
    nccl_spec = GroupSpec(nccl_spec.master_address, nccl_spec.master_port, 4, 2, "nccl", "g")
    nccl = NCCLWeightTransferInitInfo(**init_info_for(nccl_spec, plan, 12.5))
    assert (nccl.packed, nccl.packed_buffer_size_bytes, nccl.packed_num_buffers) == (True, 512, 3)
    assert (nccl.rank_offset, nccl.world_size) == (2, 4)
    nccl_update = NCCLWeightTransferUpdateInfo(**update_info_for(plan, "nccl", 9.0))
    assert nccl_update.names == [s.name for s in plan.tensors]


def test_worker_refuses_a_plan_that_would_cut_differently():
    from refit_grpc.vllm_plugin.engine import RefitGlooInitInfo, RefitGlooUpdateInfo

    plan = RefitPlan.from_tensors(random_tensors(random.Random(5)), Packing(256, 2))
    update = RefitGlooUpdateInfo(**update_info_for(plan, "gloo", 5.0))
    with pytest.raises(ValueError, match="digest"):
        update.plan(Packing(257, 2))  # the worker was told another buffer size
    with pytest.raises(ValueError, match="packed"):
        RefitGlooInitInfo(master_address="127.0.0.1", master_port=1, rank_offset=1,
                          world_size=2, packed=False)
    with pytest.raises(ValueError, match="rank_offset"):
        RefitGlooInitInfo(master_address="127.0.0.1", master_port=1, rank_offset=0,
                          world_size=2)
