"""Delta epochs (refit_grpc.dataplane.delta): the codec's round trip, then real gRPC shims and real gloo
groups (reference engines in store mode): a delta epoch moves only what changed, leaves every
engine byte-identical to a full epoch, and is sent only onto a committed copy whose version and
digest are the trainer's base (docs/protocol.md, invariant 11)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from refit_grpc import Checks, Fleet, Packing, Staged
from refit_grpc.dataplane.delta import _CHUNK_BLOCKS, Encoding, apply, encode
from refit_grpc.driver.endpoint import WorkerEndpoint as Endpoint
from refit_grpc.driver.failures import failure_from_rpc
from refit_grpc.plan import RefitPlan, weights_digest
from refit_grpc.proto import pb
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.service import ShimConfig

from support import InProcessShim, connected, endpoints


@pytest.mark.parametrize("nbytes", [(1 << 20) + 2, (3 << 20) + 6, 8 << 20])
def test_a_large_bucket_compared_in_parts_finds_exactly_the_changed_words(nbytes):
    # Parts meet on 8-byte blocks, each part compared in chunks of _CHUNK_BLOCKS blocks;
    # changes at the first word, the last word, the cuts and the chunks' edges.
    g = torch.Generator().manual_seed(nbytes)
    base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    new = base.clone()
    words = new.view(torch.int16)
    cut = (nbytes // 2 & ~7) // 2  # the first word of the second part
    chunk = 4 * _CHUNK_BLOCKS  # words per chunk
    edges = [0, words.numel() - 1, cut - 1, cut]
    edges += [w for w in (chunk - 1, chunk, cut + chunk - 1, cut + chunk) if w < words.numel()]
    picked = torch.cat([torch.tensor(edges),
                        torch.randint(0, words.numel(), (nbytes // 500,), generator=g)])
    words[picked] += 1
    want = torch.unique(picked).numpy()
    encoding, payload, k = encode(new, base, torch.empty_like(new))
    assert (encoding, k) == (Encoding.SPARSE, want.size)
    assert np.array_equal(payload[:4 * k].numpy().view(np.int32), want)  # the changed words
    target = base.clone()
    apply(encoding, payload, target)
    assert torch.equal(target, new)


@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.01, 0.1, 0.5])
def test_a_bucket_compared_where_its_tensors_lie_encodes_as_its_packed_bytes(fraction):
    """encode_tensors (the sender's path, no pack for a sparse bucket) gives exactly what encode
    gives for the packed bucket: bf16, fp32 and a 1-element tensor, a bucket over _SPLIT_BYTES so
    a tensor straddles the two parts, changes at every tensor's edges; raw past the break-even."""
    from refit_grpc.dataplane.delta import encode_tensors
    from refit_grpc.dataplane.packing import pack_into

    g = torch.Generator().manual_seed(int(fraction * 1000))
    old = [torch.randn(n, generator=g).to(dtype) for n, dtype in
           ((300_001, torch.bfloat16), (1, torch.float32), (250_003, torch.float32),
            (7, torch.bfloat16), (64, torch.float32))]
    new = [t.clone() for t in old]
    for t in new:
        words = t.view(-1).view(torch.int16)
        picked = torch.randint(0, words.numel(), (int(fraction * words.numel()),), generator=g)
        words[torch.cat([picked, torch.tensor([0, words.numel() - 1])])] += 1
    base = pack_into(torch.empty(sum(t.nbytes for t in old), dtype=torch.uint8), old)
    assert base.numel() >= 1 << 20  # compared in two parts
    want = encode(pack_into(torch.empty_like(base), new), base, torch.empty_like(base))
    got = encode_tensors(new, base, torch.empty_like(base), torch.empty_like(base))
    assert (got[0], got[2]) == (want[0], want[2])
    assert torch.equal(got[1], want[1])
    target = base.clone()
    apply(got[0], got[1], target)
    assert torch.equal(target, pack_into(torch.empty_like(base), new))
    if fraction >= 0.5:
        assert got[0] is Encoding.RAW
    elif fraction <= 0.01:
        assert got[0] is Encoding.SPARSE
    # Tensors it cannot compare in place (one of an odd number of bytes, one not contiguous)
    # are packed first, and encode the same.
    odd = [torch.ones(3, dtype=torch.bool), new[0].view(-1)[::2]]
    base_odd = pack_into(torch.empty(3 + odd[1].nbytes, dtype=torch.uint8),
                         [torch.zeros(3, dtype=torch.bool), old[0].view(-1)[::2]])
    want = encode(pack_into(torch.empty_like(base_odd), odd), base_odd, torch.empty_like(base_odd))
    got = encode_tensors(odd, base_odd, torch.empty_like(base_odd), torch.empty_like(base_odd))
    assert (got[0], got[2]) == (want[0], want[2]) and torch.equal(got[1], want[1])


def test_the_codec_round_trips_and_falls_back_to_raw():
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    scratch = torch.empty_like(base)
    for fraction in (0.0, 0.001, 0.01, 0.1, 0.2):
        new = base.clone()
        words = new.view(torch.int16)
        idx = torch.randperm(words.numel(), generator=g)[:int(fraction * words.numel())]
        words[idx] += 1
        encoding, payload, changed = encode(new, base, scratch)
        assert (encoding, changed) == (Encoding.SPARSE, idx.numel())
        assert payload.numel() == 6 * idx.numel()
        target = base.clone()
        apply(encoding, payload, target)
        assert torch.equal(target, new)
        # A bucket at an odd byte of the committed copy (after a bool tensor of odd size).
        copy = torch.empty(base.numel() + 1, dtype=torch.uint8)
        copy[1:].copy_(base)
        encoding, payload, _ = encode(new, copy[1:], scratch)
        apply(encoding, payload, copy[1:])
        assert torch.equal(copy[1:], new)
    everything = base ^ 0xFF
    encoding, payload, _ = encode(everything, base, scratch)
    assert encoding is Encoding.RAW and payload.data_ptr() == everything.data_ptr()
    odd = torch.zeros(7, dtype=torch.uint8)
    assert encode(odd, odd.clone(), scratch)[0] is Encoding.RAW


def mixed(version: int, changed: float = 1.0, base: dict | None = None) -> dict:
    """bf16, fp32 and bool tensors; `changed` of the bf16/fp32 elements differ from `base`."""
    g = torch.Generator().manual_seed(version)
    fresh = {"embed": torch.randn(512, 256, generator=g).to(torch.bfloat16),
             "layer.w": torch.randn(256, 256, generator=g),
             "layer.b": torch.randn(256, generator=g).to(torch.bfloat16),
             "mask": torch.rand(1000, generator=g) > 0.5}
    if base is None:
        return fresh
    out = {}
    for name, t in base.items():
        if t.dtype == torch.bool:
            out[name] = t.clone()
            continue
        keep = torch.rand(t.shape, generator=g) >= changed
        out[name] = torch.where(keep, t, fresh[name])
    return out


def as_views(tensors: dict) -> dict:
    """The same tensors as views into one flat buffer in plan order (Megatron-style)."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
    out, offset = {}, 0
    for name, t in tensors.items():
        out[name] = flat[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        offset += t.nbytes
    return out


@pytest.fixture
def fleet_of_two():
    shims = [InProcessShim(ReferenceEngine(model=None), ShimConfig(max_epoch_s=20))
             for _ in range(2)]
    fleet = Fleet(endpoints(shims, "s"),
                  packing=Packing(1 << 16, 2), epoch_timeout_s=20)
    yield fleet, shims
    fleet.close()
    for s in shims:
        s.close()


def test_delta_epochs_move_what_changed_and_equal_full_epochs(fleet_of_two):
    fleet, shims = fleet_of_two
    v1 = mixed(1)
    link = connected(fleet, v1)
    first = fleet.refit(link, v1, epoch=Staged(delta=True))
    assert not first.delta and first.wire_bytes == fleet.plan.total_bytes  # no base yet: full
    assert fleet.delta_base_bytes == fleet.plan.total_bytes  # the trainer's one copy
    current, rows = v1, []
    for version, changed in [(2, 0.01), (3, 0.001), (4, 0.1), (5, 1.0)]:
        current = mixed(version, changed, base=current)
        tensors = as_views(current) if version % 2 else current  # views or separate tensors
        report = fleet.refit(link, tensors, epoch=Staged(delta=True),
                             checks=Checks(verify=True))
        assert report.delta
        want = weights_digest((s.name, current[s.name]) for s in fleet.plan.tensors)
        assert {w.weights_digest for w in report.workers} == {want}
        for s in shims:
            d = s.describe()
            assert (d.weight_version, d.committed_copy_version) == (version, version)
        rows.append((changed, report.wire_bytes / fleet.plan.total_bytes))
    by_change = dict(rows)
    assert by_change[0.001] < by_change[0.01] < by_change[0.1] < 0.6
    assert by_change[1.0] <= 1.01  # every bucket fell back to raw
    print("\nDELTA wire bytes / plan bytes by changed fraction: "
          + ", ".join(f"{c:g}: {r:.4f}" for c, r in rows))


def test_a_delta_goes_only_onto_the_trainers_base(fleet_of_two):
    fleet, shims = fleet_of_two
    v1 = mixed(1)
    link = connected(fleet, v1)
    fleet.refit(link, v1, epoch=Staged(delta=True))
    # An in-place epoch changes the live weights without the committed copies: no base left.
    v2 = mixed(2, 0.01, base=v1)
    fleet.refit(link, v2, version=2)
    assert all(s.describe().committed_copy_version == 0 for s in shims)
    v3 = mixed(3, 0.01, base=v2)
    report = fleet.refit(link, v3, epoch=Staged(delta=True), checks=Checks(verify=True))
    assert not report.delta  # a full epoch instead
    assert {w.weights_digest for w in report.workers} == \
        {weights_digest((s.name, v3[s.name]) for s in fleet.plan.tensors)}
    # The shim fences it too: a base that is not its committed copy is refused before ACCEPTED.
    d = shims[0].describe()
    for fields, reason in [
            (dict(mode=pb.EPOCH_MODE_STAGED, delta_base_version=3,
                  delta_base_digest="0" * 64), "DELTA_BASE_MISMATCH"),
            (dict(mode=pb.EPOCH_MODE_STAGED, delta_base_version=2,
                  delta_base_digest=d.committed_copy_digest), "DELTA_BASE_MISMATCH"),
            (dict(delta_base_version=3, delta_base_digest=d.committed_copy_digest),
             "INVALID_DELTA")]:
        request = pb.UpdateWeightsRequest(version=4, plan_digest=fleet.plan.digest,
                                          group_id=d.group_id, **fields)
        with pytest.raises(grpc.RpcError) as e:
            list(shims[0].stub.UpdateWeights(request, timeout=5))
        assert failure_from_rpc(Endpoint("s0", "x"), e.value).reason == reason
    assert shims[0].describe().state == pb.SHIM_STATE_READY
    # The new shape cannot say it (`InPlace` has no `delta`); the deprecated keyword is refused.
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="staged"):
        fleet.refit(link, v3, delta=True)


def test_the_committed_copy_wire_round_trips_and_refuses_what_a_worker_could_not_use():
    """What the shim sends a vLLM or Dynamo worker for a delta stage, a flip that keeps its copy
    and a catch-up serve (refit_grpc.wire.vllm), parsed as the worker parses it."""
    from refit_grpc.common import GroupSpec
    from refit_grpc.wire.vllm import GlooUpdateInfo, flip_info_for, update_info_for
    from refit_grpc.wire.worker import SERVE_RUNNING, ServeInfo, StageStatus

    plan = RefitPlan.from_state_dict_info({"w": ((4, 4), torch.bfloat16)}, Packing(64, 2))
    flip = GlooUpdateInfo(**flip_info_for(plan, 5.0, "d" * 64, version=7))
    assert (flip.version, flip.source, flip.delta) == (7, "staged", None)
    staged = GlooUpdateInfo(**{**update_info_for(plan, "gloo", 5.0), "delta": True})
    assert staged.delta and staged.plan(plan.packing).digest == plan.digest
    with pytest.raises(ValueError, match="delta is received"):
        GlooUpdateInfo(**{**flip_info_for(plan, 5.0, "d" * 64), "delta": True})
    with pytest.raises(ValueError, match="staged flip"):
        GlooUpdateInfo(**{**update_info_for(plan, "gloo", 5.0), "version": 3})
    serve = ServeInfo.for_group(GroupSpec("127.0.0.1", 4242, 3, 0, "gloo", "cu-1"), 9.0)
    assert ServeInfo(**serve.to_wire()).spec() == GroupSpec("127.0.0.1", 4242, 3, 0, "gloo",
                                                             "cu-1")
    for bad in ({"world_size": 1}, {"master_port": 0}, {"timeout_s": 0}):
        with pytest.raises(ValueError):
            ServeInfo(**{**serve.to_wire(), **bad})
    status = StageStatus(rank=0, state="idle", committed_version=7, committed_digest="d" * 64,
                         serve_state=SERVE_RUNNING, served=3)
    assert StageStatus.from_wire(status.to_wire()) == status
    with pytest.raises(ValueError, match="serve state"):
        StageStatus.from_wire({**status.to_wire(), "serve_state": "dancing"})
