"""Engines of one process sharing one receiving rank (`refit_grpc.dataplane.shared_rank`): a real
gloo group (the trainer's rank 0 and the shared rank 1, on threads of this process), real
receives."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.dataplane.group import Group
from refit_grpc.dataplane.rendezvous import bind_master_store
from refit_grpc.dataplane.shared_rank import SharedRank
from refit_grpc.dataplane.transfer import Sender
from refit_grpc.errors import CollectiveError, RefitError
from refit_grpc.plan import Packing, RefitPlan, weights_digest
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.reference import ReferenceEngine

from support import info

ENGINES = 3


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    t = {f"w{i}": torch.randn(40 + i, 24, generator=g) for i in range(6)}
    t["half"] = torch.randn(33, generator=g).to(torch.bfloat16)
    return t


def _on_threads(calls: list, timeout_s: float = 30.0) -> list:
    """Run each call on a thread of its own; what each returned, or the exception it raised."""
    out: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as e:  # noqa: BLE001  (returned to the test, which asserts on it)
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a call outlived the test's bound"
    return out


def _form(plan: RefitPlan, engines: list[ReferenceEngine], group_id: str) -> Group:
    """The trainer (rank 0) and every engine (all rank 1, one shared rank): world 2."""
    store = bind_master_store("127.0.0.1", 0, 2, 20)
    spec = GroupSpec("127.0.0.1", store.port, 2, 1, "gloo", group_id)
    joined = _on_threads(
        [lambda: Group.join(GroupSpec("127.0.0.1", store.port, 2, 0, "gloo", group_id), 20,
                            store=store)]
        + [lambda e=e: e.init_transfer(spec, plan, Deadline(20)) for e in engines])
    assert not any(isinstance(j, Exception) for j in joined), joined
    return joined[0]


def _digest(engine: ReferenceEngine, plan: RefitPlan) -> str:
    return weights_digest((s.name, engine.tensor(s.name)) for s in plan.tensors)


def test_engines_sharing_a_rank_each_receive_every_byte_of_one_broadcast():
    rank = SharedRank()
    engines = [ReferenceEngine(model=None, shared_rank=rank) for _ in range(ENGINES)]
    assert {e.shared_rank for e in engines} == {rank.key}
    plan = RefitPlan.from_state_dict_info(info(_weights(1)), Packing(4096, 2))
    assert len(plan.buckets) > 4
    trainer = _form(plan, engines, "shared")
    assert rank.groups() == 1
    sender = Sender(trainer, plan)
    try:
        for e in engines:
            e.pause(PauseMode.KEEP, Deadline(5))
        for version in (1, 2, 3):
            w = _weights(version)
            out = _on_threads([lambda e=e: e.receive(plan, Deadline(30), lambda b: None)
                               for e in engines] + [lambda w=w: sender.send(w, Deadline(30))])
            assert not any(isinstance(o, Exception) for o in out), out
            want = weights_digest((s.name, w[s.name]) for s in plan.tensors)
            assert [_digest(e, plan) for e in engines] == [want] * ENGINES, version
        # A staged receive through the shared rank: every engine's copy has the same digest.
        w = _weights(4)
        staged = _on_threads([lambda e=e: e.stage(plan, Deadline(30), lambda b: None)
                              for e in engines] + [lambda: sender.send(w, Deadline(30))])
        assert len(set(staged[:ENGINES])) == 1 and isinstance(staged[0], str), staged
    finally:
        trainer.close()
        for e in engines:
            e.close()


def test_one_engines_abort_ends_the_broadcast_for_every_engine_of_the_rank_at_once():
    rank = SharedRank()
    engines = [ReferenceEngine(model=None, shared_rank=rank) for _ in range(ENGINES)]
    plan = RefitPlan.from_state_dict_info(info(_weights(1)), Packing(4096, 2))
    trainer = _form(plan, engines, "abort")
    try:
        for e in engines:
            e.pause(PauseMode.KEEP, Deadline(5))
        # The receives wait for a sender that never sends; one engine aborts.
        threading.Timer(0.5, engines[1].abort_transfer).start()
        t0 = time.monotonic()
        out = _on_threads([lambda e=e: e.receive(plan, Deadline(60), lambda b: None)
                           for e in engines])
        assert time.monotonic() - t0 < 10
        assert all(isinstance(o, RefitError) for o in out), out
        # The errors' tracebacks hold the receives' pending work, which keeps the engines' end
        # of the gloo pairs open; the shim drops them once it has encoded the status.
        del out
        gc.collect()
        # The trainer's end of the group is broken too: its send fails on the closed pair, not
        # at its deadline.
        with pytest.raises(CollectiveError, match="peer failed"):
            Sender(trainer, plan).send(_weights(2), Deadline(30))
        assert rank.groups() == 0
    finally:
        trainer.close()
        for e in engines:
            e.close()


def test_an_engine_waiting_for_its_ranks_join_leaves_on_its_own_cancel_or_deadline():
    rank = SharedRank()
    store = bind_master_store("127.0.0.1", 0, 2, 20)  # nobody joins as rank 0: the join waits
    spec = GroupSpec("127.0.0.1", store.port, 2, 1, "gloo", "waits")
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    # The leader waits 6 s: at 3 s a CI run loaded by other modules once had the other engine
    # reach its join only after the leader had given up, and it took the leader's error.
    out = _on_threads([lambda: rank.join(spec, 6.0),
                       lambda: (time.sleep(0.1), rank.join(spec, 30.0, cancel=cancel))])
    assert isinstance(out[1], RefitError) and out[1].reason == Reason.EPOCH_ABORTED, out
    # The leader's own failure (no rank 0 in time) reaches it with its reason.
    assert isinstance(out[0], RefitError) and out[0].reason == Reason.RENDEZVOUS_TIMEOUT, out
    assert store.port  # the master's store lived through both joins


def test_an_engine_cannot_share_a_rank_at_another_rendezvous_under_the_same_group_name():
    rank = SharedRank()
    store = bind_master_store("127.0.0.1", 0, 2, 20)
    spec = GroupSpec("127.0.0.1", store.port, 2, 1, "gloo", "g")
    out = _on_threads([lambda: rank.join(spec, 2.0),
                       lambda: (time.sleep(0.2), rank.join(
                           GroupSpec("127.0.0.1", store.port, 3, 1, "gloo", "g"), 2.0))])
    assert isinstance(out[1], RefitError) and out[1].reason == Reason.INVALID_RANK, out
    assert store.port  # the master's store lived through both joins
