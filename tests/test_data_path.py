"""The fast data paths are byte-exact: bucket buffers reused across epochs, lone tensors and runs
of views into one flat buffer sent in place, buckets received straight into the engine's storage,
and a refit right after an aborted one (no stale bytes reused). Real gloo groups, real shims (in
this process and as processes)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from refit_grpc import EpochFailedError, Fleet, Packing, PauseMode, RefitError
from refit_grpc.common import Deadline, GroupSpec
from refit_grpc.dataplane.group import Group
from refit_grpc.dataplane.rendezvous import bind_master_store
from refit_grpc.dataplane.transfer import Sender, receive
from refit_grpc.plan import RefitPlan, weights_digest
from refit_grpc.proto import pb
from refit_grpc.shim.engines.reference import ReferenceEngine

from support import endpoints, fleet_mid_epoch, info, join_trainer

BUCKET = 16 * 1024


def aligned_tensors(version: int) -> dict[str, torch.Tensor]:
    """Aligned like a real checkpoint (larger element sizes first, so the store can hold them in
    one buffer): mixed dtypes, 0-dim tensors, a lone tensor larger than a bucket, non-contiguous
    sources, and thousands of tiny tensors."""
    g = torch.Generator().manual_seed(version)
    t = {
        "embed": torch.randn(3 * BUCKET // 4 + 6, generator=g),  # alone: > a bucket, in place
        "i64": torch.randint(-1 << 40, 1 << 40, (17,), generator=g, dtype=torch.int64),
        "scalar_f64": torch.tensor(version / 3, dtype=torch.float64),
        "f32": torch.randn(33, 17, generator=g),
        "transposed": torch.randn(40, 24, generator=g).t(),  # non-contiguous: packed
        "strided": torch.randn(300, generator=g)[::3],        # non-contiguous: packed
        "scalar_f32": torch.tensor(float(version)),
    }
    for i in range(2000):
        t[f"tiny.{i}"] = torch.randn(1 + i % 3, generator=g)
    t["bf16"] = torch.randn(5, 7, 3, generator=g).to(torch.bfloat16)
    t["f16"] = torch.randn(129, generator=g).to(torch.float16)
    t["i8"] = torch.randint(-128, 127, (77,), generator=g, dtype=torch.int8)
    t["bool"] = torch.rand(3, 11, generator=g) > 0.5
    return t


def _transfer(engine: ReferenceEngine, tensors: dict[str, torch.Tensor], plan: RefitPlan,
              trainer: Group, sender: Sender) -> list[int]:
    """One receive on the engine (its own thread) while the trainer sends; the buckets seen."""
    seen: list[int] = []
    box: dict = {}

    def run() -> None:
        try:
            engine.receive(plan, Deadline(30), lambda b: seen.append(b.index))
        except Exception as e:  # noqa: BLE001  (asserted below)
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    sender.send(tensors, Deadline(30))
    t.join(30)
    assert "error" not in box, box
    return seen


def _joined_pair(plan: RefitPlan, engine: ReferenceEngine) -> Group:
    store = bind_master_store("127.0.0.1", 0, 2, 20)
    port = store.port
    box: dict = {}
    joiner = threading.Thread(target=lambda: box.update(g=Group.join(
        GroupSpec("127.0.0.1", port, 2, 0, "gloo", "dp"), 20, store=store)))
    joiner.start()
    engine.init_transfer(GroupSpec("127.0.0.1", port, 2, 1, "gloo", "dp"), plan, Deadline(20))
    joiner.join(20)
    return box["g"]


def test_in_place_send_and_receive_are_byte_exact_over_versions():
    engine = ReferenceEngine(model=None)
    plan = RefitPlan.from_state_dict_info(info(aligned_tensors(1)), Packing(BUCKET, 2))
    assert any(b.stop - b.start == 1 and b.nbytes > BUCKET for b in plan.buckets)
    trainer = _joined_pair(plan, engine)
    sender = Sender(trainer, plan)
    engine.pause(PauseMode.KEEP, Deadline(5))
    try:
        for version in (1, 2, 3):
            tensors = aligned_tensors(version)
            seen = _transfer(engine, tensors, plan, trainer, sender)
            assert seen == list(range(len(plan.buckets)))
            assert engine.receives_in_place
            assert weights_digest((s.name, engine.tensor(s.name)) for s in plan.tensors) == \
                weights_digest((s.name, tensors[s.name]) for s in plan.tensors)
        # The lone oversized tensor went in place: the sender's buffers are smaller than it.
        assert sender.buffer_bytes < 2 * (3 * BUCKET // 4 + 6) * 4
    finally:
        trainer.close()
        engine.close()


def _flat_views(source: dict[str, torch.Tensor], plan: RefitPlan) -> dict[str, torch.Tensor]:
    """The same values held the Megatron way: views into one flat buffer, in plan order."""
    flat = torch.empty(plan.total_bytes, dtype=torch.uint8)
    views, offset = {}, 0
    for s in plan.tensors:
        view = flat[offset:offset + s.nbytes].view(s.dtype).view(s.shape)
        view.copy_(source[s.name])
        views[s.name] = view
        offset += s.nbytes
    return views


def test_views_of_one_flat_buffer_are_sent_in_place_and_stay_exact():
    engine = ReferenceEngine(model=None)
    plan = RefitPlan.from_state_dict_info(info(aligned_tensors(1)), Packing(BUCKET, 2))
    trainer = _joined_pair(plan, engine)
    sender = Sender(trainer, plan)
    engine.pause(PauseMode.KEEP, Deadline(5))
    try:
        for version in (1, 2):
            tensors = _flat_views(aligned_tensors(version), plan)
            _transfer(engine, tensors, plan, trainer, sender)
            assert weights_digest((s.name, engine.tensor(s.name)) for s in plan.tensors) == \
                weights_digest((s.name, tensors[s.name]) for s in plan.tensors)
        assert sender.buffer_bytes == 0  # no bucket was packed: no buffer was ever allocated
        # One tensor held apart breaks its bucket's run: that bucket alone is packed.
        tensors = _flat_views(aligned_tensors(3), plan)
        tensors["tiny.1000"] = tensors["tiny.1000"].clone()
        _transfer(engine, tensors, plan, trainer, sender)
        assert weights_digest((s.name, engine.tensor(s.name)) for s in plan.tensors) == \
            weights_digest((s.name, tensors[s.name]) for s in plan.tensors)
        assert sender.buffer_bytes > 0
    finally:
        trainer.close()
        engine.close()


def test_a_misaligned_plan_falls_back_to_copies_and_stays_exact():
    engine = ReferenceEngine(model=None)
    g = torch.Generator().manual_seed(0)
    tensors = {"odd_i8": torch.randint(0, 9, (3,), generator=g, dtype=torch.int8),
               "f32": torch.randn(5000, generator=g), "f16": torch.randn(7, generator=g).half()}
    plan = RefitPlan.from_state_dict_info(info(tensors), Packing(BUCKET, 2))
    trainer = _joined_pair(plan, engine)
    engine.pause(PauseMode.KEEP, Deadline(5))
    try:
        _transfer(engine, tensors, plan, trainer, Sender(trainer, plan))
        assert not engine.receives_in_place
        for name, t in tensors.items():
            assert torch.equal(engine.tensor(name), t)
    finally:
        trainer.close()
        engine.close()


def test_receive_buffers_are_reused_per_group_and_sized_by_the_largest_bucket():
    plan = RefitPlan.from_state_dict_info(info(aligned_tensors(1)), Packing(BUCKET, 2))
    store = bind_master_store("127.0.0.1", 0, 2, 20)
    port = store.port
    box: dict = {}
    joiner = threading.Thread(target=lambda: box.update(g=Group.join(
        GroupSpec("127.0.0.1", port, 2, 0, "gloo", "bufs"), 20, store=store)))
    joiner.start()
    group = Group.join(GroupSpec("127.0.0.1", port, 2, 1, "gloo", "bufs"), 20)
    joiner.join(20)
    try:
        first = group.receive_buffers(plan)
        again = group.receive_buffers(plan)
        assert len(first) == 2
        assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first, again))
        assert first[0].numel() == max(b.nbytes for b in plan.buckets)
    finally:
        group.close()
        box["g"].close()


def test_no_op_apply_sees_every_byte_when_nothing_lands_in_place():
    """The plain receive loop (no `land`) hands every bucket's exact bytes to `apply`."""
    tensors = aligned_tensors(4)
    plan = RefitPlan.from_state_dict_info(info(tensors), Packing(BUCKET, 2))
    store = bind_master_store("127.0.0.1", 0, 2, 20)
    port = store.port
    box: dict = {}
    joiner = threading.Thread(target=lambda: box.update(g=Group.join(
        GroupSpec("127.0.0.1", port, 2, 0, "gloo", "plain"), 20, store=store)))
    joiner.start()
    group = Group.join(GroupSpec("127.0.0.1", port, 2, 1, "gloo", "plain"), 20)
    joiner.join(20)
    got: dict[str, bytes] = {}

    def apply(bucket, items) -> None:
        for spec, raw in items:
            got[spec.name] = bytes(raw.numpy().tobytes())

    try:
        t = threading.Thread(target=lambda: receive(group, plan, Deadline(30), apply))
        t.start()
        Sender(box["g"], plan).send(tensors, Deadline(30))
        t.join(30)
        for s in plan.tensors:
            want = tensors[s.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert got[s.name] == want, s.name
    finally:
        group.close()
        box["g"].close()


@pytest.mark.slow
def test_refit_right_after_an_aborted_one_is_byte_exact(shim_procs):
    """Abort mid-broadcast, after buckets were received straight into the store, then a new
    group and a full epoch: every byte is the new version's, none left from the aborted one."""
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}") for i in range(2)]
    with Fleet(endpoints(shims),
               packing=Packing(BUCKET // 8, 2), epoch_timeout_s=30) as fleet:
        link, handle = fleet_mid_epoch(fleet, aligned_tensors(2), 2,
                                       committed=aligned_tensors(1))
        plan = fleet.plan
        assert len(plan.buckets) > 4

        def abort_after_in_place_buckets(bucket) -> None:
            if bucket.index == 4:
                # Buckets 2 and up are posted after bucket 0 was applied: they land in place.
                end = time.monotonic() + 20
                while min(handle.buckets_applied) < 3 and time.monotonic() < end:
                    time.sleep(0.005)
                assert min(handle.buckets_applied) >= 3
                fleet.abort("test: mid-broadcast")

        with pytest.raises(RefitError):
            link.sender.send(aligned_tensors(2), Deadline(30), on_bucket=abort_after_in_place_buckets)
        link.close()
        with pytest.raises(EpochFailedError):
            handle.result(timeout_s=10)
        assert {d.state for d in fleet.describe()} == {pb.SHIM_STATE_BROKEN}
        link = fleet.connect("127.0.0.1")
        final = aligned_tensors(3)
        fleet.refit(link, final, version=3)
        want = weights_digest((s.name, final[s.name]) for s in plan.tensors)
        assert [d.weights_digest for d in fleet.describe()] == [want, want]
        assert [d.weight_version for d in fleet.describe()] == [3, 3]
        link.close()


def test_a_closed_group_is_freed_without_a_full_collection_and_its_peer_fails_at_once(
        monkeypatch):
    """Group.close's reaper drops the last references; a full `gc.collect()` (0.4 s holding the
    GIL in a vLLM worker's heap, every thread of it frozen) only when something else still holds
    the group. The peer's pending receive fails at once either way."""
    import gc as gc_module

    from refit_grpc.dataplane import reapers

    collected: list[tuple] = []
    real = gc_module.collect
    monkeypatch.setattr(reapers.gc, "collect",
                        lambda *a: (collected.append(a), real(*a))[1])
    port, thread, box = join_trainer(2, "reap-test")
    engine = Group.join(GroupSpec("127.0.0.1", port, 2, 1, "gloo", "reap-test"), 20.0)
    thread.join(20)
    trainer = box["group"]
    pending = engine.broadcast_async(torch.empty(1 << 20, dtype=torch.uint8), Deadline(30))
    t0 = time.monotonic()
    trainer.close()
    reapers.join_reapers()
    assert collected == [], "a group nothing else held went through a full collection"
    with pytest.raises(RefitError):
        pending.wait(Deadline(30), "the receive")
    assert time.monotonic() - t0 < 10
    held = engine._pg  # held elsewhere: only a collection can be sure to free it now
    engine.close()
    reapers.join_reapers()
    assert collected, "a group held elsewhere was not collected"
    del held
