"""An epoch's PROGRESS is coalesced (`shim.receive.EpochReceive.buckets`): the first bucket at
once, then at most one per interval, the newest applied, and a bucket held back is reported once
the interval has passed even when no other bucket lands. Pure logic: the buckets come from a
scripted receive on a real thread, timed as a slow trainer would send them."""

from __future__ import annotations

import time

import torch

from refit_grpc.common import Deadline
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.shim.receive import Epoch, EpochReceive


class ScriptedEngine:
    """Applies the plan's buckets at the given times (seconds after the receive starts)."""

    def __init__(self, at: list[float]):
        self.at = at

    def receive(self, plan, deadline, on_bucket) -> None:
        t0 = time.monotonic()
        for bucket, at in zip(plan.buckets, self.at):
            time.sleep(max(t0 + at - time.monotonic(), 0.0))
            on_bucket(bucket)

    def finish(self, version: int, deadline) -> str:
        return "digest"


def plan_of(n: int) -> RefitPlan:
    tensors = {f"t{i}": torch.zeros(512) for i in range(n)}  # 2 KiB each: a bucket each
    return RefitPlan.from_tensors(tensors.items(), Packing(1024, 2))


def reported(at: list[float], interval_s: float) -> list[tuple[int, float]]:
    plan = plan_of(len(at))
    assert len(plan.buckets) == len(at)
    receive = EpochReceive(ScriptedEngine(at), plan, Epoch(version=1, deadline=Deadline(30)),
                           progress_interval_s=interval_s)
    t0 = time.monotonic()
    receive.start()
    out = [(b.index, time.monotonic() - t0) for b in receive.buckets()]
    assert receive.result is not None and receive.result.digest == "digest"
    return out


def test_buckets_in_quick_succession_are_coalesced():
    # 40 buckets over 0.8 s: the first at once, then at most one per 0.2 s.
    out = reported([0.02 * i for i in range(40)], 0.2)
    indexes = [i for i, _ in out]
    assert indexes[0] == 0
    assert indexes == sorted(set(indexes))
    assert 2 <= len(out) <= 1 + 0.8 / 0.2 + 1, out
    gaps = [b - a for (_, a), (_, b) in zip(out, out[1:])]
    assert all(g >= 0.2 - 0.02 for g in gaps), gaps


def test_a_bucket_held_back_is_reported_when_the_interval_passes():
    # Bucket 1 lands 0.1 s after bucket 0 (held back); bucket 2 only 1.5 s later: bucket 1 is
    # reported at about 0.4 s, not with bucket 2. (The last bucket is followed at once by the
    # end, which says it: the stream's COMMITTED or STAGED.) The gaps are wide enough that a
    # loaded host's late wake-up (tens of ms) does not merge bucket 0 into bucket 1.
    out = reported([0.0, 0.1, 1.5], 0.4)
    assert [i for i, _ in out] == [0, 1], out
    assert 0.3 <= out[1][1] <= 1.2, out


def test_interval_zero_reports_every_bucket_a_slow_trainer_sends():
    # 0.2 s apart: a loaded host's late wake-up (tens of ms; at 50 ms apart one merged bucket 1
    # into bucket 2 in a `make check`) does not skip a bucket.
    out = reported([0.2 * i for i in range(6)], 0.0)
    assert [i for i, _ in out][:5] == list(range(5)), out
