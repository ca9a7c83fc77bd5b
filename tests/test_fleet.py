"""A fleet of shim processes refit over a real gloo group: byte-exact, two-phase, membership."""

from __future__ import annotations

import time

import pytest
import torch

from refit_grpc import (
    EpochRefusedError,
    Fleet,
    MembershipChangedError,
    Packing,
    WorkerEndpoint,
)
from refit_grpc.plan import weights_digest
from refit_grpc.proto import pb
from refit_grpc.shim.engines.reference import ReferenceEngine

from support import connected, describe, endpoints, fleet_mid_epoch, info, tensors_v

BUFFER = 8 * 1024


def mixed_tensors(version: int) -> dict[str, torch.Tensor]:
    """Every dtype the tests promise, 0-dim and odd shapes, non-contiguous sources, one tensor
    larger than a bucket, and a tail of thousands of tiny tensors."""
    g = torch.Generator().manual_seed(version)
    t = {
        "f32": torch.randn(33, 17, generator=g),
        "bf16": torch.randn(5, 7, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(129, generator=g).to(torch.float16),
        "i8": torch.randint(-128, 127, (77,), generator=g, dtype=torch.int8),
        "bool": torch.rand(3, 11, generator=g) > 0.5,
        "scalar": torch.tensor(float(version)),
        "scalar_i64": torch.tensor(version * 1000003, dtype=torch.int64),
        "transposed": torch.randn(40, 24, generator=g).t(),  # non-contiguous
        "strided": torch.randn(300, generator=g)[::3],        # non-contiguous
        "huge": torch.randn(BUFFER // 2 + 123, generator=g),  # ~2 buckets of bytes (float32)
    }
    for i in range(2000):
        t[f"tiny.{i}"] = torch.randn(1 + i % 3, generator=g).to(
            (torch.float32, torch.bfloat16, torch.int8)[i % 3]
            if i % 3 != 2 else torch.float32)
    return t


@pytest.mark.slow
def test_fleet_of_four_refits_three_versions_byte_exact(shim_procs):
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}") for i in range(4)]
    with Fleet(endpoints(shims),
               packing=Packing(BUFFER, 2), epoch_timeout_s=60) as fleet:
        assert fleet.inference_world_size == 4
        plan = fleet.prepare(info(mixed_tensors(1)))
        assert len(plan.tensors) == 2010 and len(plan.buckets) >= 3
        assert any(b.nbytes > BUFFER for b in plan.buckets)
        link = fleet.connect("127.0.0.1")
        for version in (1, 2, 3):
            tensors = mixed_tensors(version)
            report = fleet.refit(link, tensors, version=version)
            want = weights_digest((s.name, tensors[s.name]) for s in plan.tensors)
            assert report.version == version and report.bytes == plan.total_bytes
            assert [w.bytes for w in report.workers] == [plan.total_bytes] * 4
            described = fleet.describe()
            assert all(d.weights_digest == want and d.weight_version == version
                       and d.state == pb.SHIM_STATE_READY and not d.paused for d in described)
        link.close()


@pytest.mark.slow
def test_one_refusal_aborts_the_epoch_before_any_byte(shim_procs):
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}") for i in range(3)]
    endpoints = [WorkerEndpoint(s.instance_id, s.address) for s in shims]
    t1, t2 = mixed_tensors(1), mixed_tensors(2)
    with Fleet(endpoints, packing=Packing(BUFFER, 2), epoch_timeout_s=30) as fleet, \
            Fleet(endpoints[:1], packing=Packing(BUFFER, 2), epoch_timeout_s=30) as solo:
        link = connected(fleet, t1)
        fleet.refit(link, t1, version=1)
        link.close()
        # Worker 0 alone moves to version 10, so it will call version 2 stale.
        solo_link = connected(solo, t1)
        solo.refit(solo_link, t2, version=10)
        solo_link.close()

        link = fleet.connect("127.0.0.1")
        before = [d.weights_digest for d in fleet.describe()]
        t0 = time.monotonic()
        with pytest.raises(EpochRefusedError) as e:
            fleet.refit(link, t2, version=2)
        elapsed = time.monotonic() - t0
        # Typically 0.1-0.5 s on a quiet machine; the bound leaves room for a loaded CI host.
        assert elapsed < 5.0, elapsed
        print(f"\nREFUSAL: EpochRefusedError after {elapsed:.2f}s")
        assert e.value.workers == ["w0"] and e.value.reasons == {"STALE_VERSION"}
        assert "STALE_VERSION" in str(e.value) and "w0" in str(e.value)
        described = fleet.describe()
        # Nobody is left receiving or broken; the others still hold (and serve) version 1.
        assert [d.state for d in described] == [pb.SHIM_STATE_PREPARED] * 3
        assert [d.weights_digest for d in described] == before
        assert not any(d.paused for d in described)
        assert [d.weight_version for d in described] == [10, 1, 1]

        # The whole epoch re-runs with a version everyone accepts.
        link = fleet.connect("127.0.0.1")
        report = fleet.refit(link, t2, version=11)
        assert report.version == 11
        assert len({d.weights_digest for d in fleet.describe()}) == 1
        link.close()


@pytest.mark.slow
def test_restarted_worker_is_refused_by_membership_check(shim_procs):
    shims = [shim_procs("--model", "none") for _ in range(2)]
    endpoints = [WorkerEndpoint(f"w{i}", s.address) for i, s in enumerate(shims)]
    t1 = mixed_tensors(1)
    with Fleet(endpoints, packing=Packing(BUFFER, 2), epoch_timeout_s=30) as fleet:
        link = connected(fleet, t1)
        fleet.refit(link, t1, version=1)
        shims[1].stop()
        replacement = shim_procs("--model", "none", "--address", shims[1].address)
        assert replacement.instance_id != shims[1].instance_id
        # The replacement refuses the epoch opened for the instance that joined, before any
        # byte moves; the survivor is resumed on version 1.
        with pytest.raises(MembershipChangedError) as e:
            fleet.refit(link, mixed_tensors(2), version=2)
        assert isinstance(e.value, EpochRefusedError)
        assert e.value.workers == ["w1"] and e.value.reasons == {"MEMBERSHIP_CHANGED"}
        survivor = describe(shims[0].address)
        assert survivor.weight_version == 1 and not survivor.paused
        link.close()


def test_validate_workers_hook_is_consulted(shim, closed_port):
    calls = []

    def validate(md):
        calls.append(md)
        return [dict(m, instance_id=m["instance_id"] + "-restarted") for m in md]

    sh = shim(ReferenceEngine(model=None))
    with Fleet([WorkerEndpoint("a", sh.address)], validate_workers=validate,
               packing=Packing(1024, 2)) as fleet:
        fleet.prepare(info(tensors_v(1)))  # a real plan on a real shim: past prepare()
        assert not calls  # the hook guards the group, not the plan
        with pytest.raises(MembershipChangedError):
            fleet.init_collective("127.0.0.1", closed_port, 2, train_world_size=1)
        assert calls == [[{"instance_id": "a", "address": sh.address}]]
        assert sh.describe().state == pb.SHIM_STATE_PREPARED  # refused before any shim joined


def test_fleet_surface_mirrors_the_seed(shim):
    import pickle

    fleet = Fleet([{"instance_id": "a", "address": "127.0.0.1:1"},
                   WorkerEndpoint("b", "127.0.0.1:2")], engine_world_size=2,
                  packing=Packing(1024, 2), validate_workers=lambda m: m)
    assert fleet.inference_world_size == 4
    assert fleet.sender_spec == Packing(1024, 2)
    copy = pickle.loads(pickle.dumps(fleet.client_copy()))
    assert copy.endpoints == fleet.endpoints and copy.validate_workers is None
    with pytest.raises(ValueError):
        Fleet([])
    with pytest.raises(RuntimeError):
        fleet.update_weights()
    with pytest.raises(ValueError):
        fleet.prepare(None)
    fleet.close()
    copy.close()
    # Once prepared, init_collective checks the world: 1 trainer + 1 shim x 2 engine ranks.
    sh = shim(ReferenceEngine(model=None))
    with Fleet([WorkerEndpoint("a", sh.address)], engine_world_size=2,
               packing=Packing(1024, 2)) as prepared:
        prepared.prepare(info(tensors_v(1)))
        with pytest.raises(ValueError):
            prepared.init_collective("127.0.0.1", 1, 4, train_world_size=1)
    assert sh.describe().state == pb.SHIM_STATE_PREPARED


@pytest.mark.slow
def test_worker_killed_mid_epoch_fails_fast_naming_it(shim_procs):
    import signal

    from refit_grpc import EpochFailedError
    from refit_grpc.common import Deadline
    from refit_grpc.errors import RefitError

    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}") for i in range(3)]
    big = {f"t{i}": torch.randn(256 * 1024) for i in range(16)}  # 16 MiB in 1 MiB buckets
    with Fleet(endpoints(shims),
               packing=Packing(1 << 20, 2), epoch_timeout_s=20) as fleet:
        link, handle = fleet_mid_epoch(fleet, big, 1)
        shims[1].signal(signal.SIGKILL)
        t0 = time.monotonic()
        # The sender trips over the dead peer (a closed pair) or over the handle's failure flag,
        # whichever comes first on this host; the epoch handle names the worker.
        with pytest.raises(RefitError):
            link.sender.send(big, Deadline(20, cancel=handle.failed))
        link.close()
        with pytest.raises(EpochFailedError) as e:
            handle.result()
        assert time.monotonic() - t0 < 10, "survivors must not wait out the 20 s deadline"
        assert e.value.workers[0] == "w1", str(e.value)
        assert e.value.failures[0].code.name == "UNAVAILABLE"
        for survivor in (shims[0], shims[2]):
            d = describe(survivor.address, timeout_s=5)
            # Nobody is left receiving; whoever got bytes is BROKEN and paused.
            assert d.state in (pb.SHIM_STATE_BROKEN, pb.SHIM_STATE_PREPARED)
            assert d.paused == (d.state == pb.SHIM_STATE_BROKEN)
