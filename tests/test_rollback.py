"""Reversible epochs (docs/protocol.md, "Rollback"), on real shim processes (reference engines
with a tiny LM) and a real gloo group: a staged epoch whose canary fails after the flip puts the
fleet back on the last good version and resumes it; an operator takes the fleet back one version
(`Fleet.rollback()`, `refit-grpc fleet rollback`); every refusal is typed and moves nothing.

What proves the engines are back: the canary's teacher-forced log-probabilities of the good
version (computed by the engines, compared with the trainer's), the weights digest equal to the
one the good version had, and Describe (version, committed copy, not paused)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import pytest
import torch

from refit_grpc import Canary, CanaryMismatchError, Checks, Fleet, FleetError, Staged
from refit_grpc.canary import FP32_TOLERANCE, teacher_forced_logprobs
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.failures import failure_from_rpc
from refit_grpc.driver.rollback import RollbackError
from refit_grpc.models.tiny_lm import TinyLM, TinyLMConfig
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.reference import ReferenceEngine

from support import connected, endpoints

SEQUENCE = [3, 17, 42, 5, 99, 1, 64, 7, 23, 8, 111, 2]


def canary_of(model: TinyLM) -> Canary:
    with torch.no_grad():
        logits = model(torch.tensor([SEQUENCE]))[0]
    return Canary(tuple(SEQUENCE), tuple(teacher_forced_logprobs(logits, SEQUENCE)),
                  FP32_TOLERANCE)


def trained(model: TinyLM, seed: int) -> dict[str, torch.Tensor]:
    """A stand-in for an optimiser step: every weight moves; the new state dict."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def corrupted(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bytes that arrive whole but compute otherwise (what a wrong load looks like outside)."""
    wrong = {n: t.clone() for n, t in tensors.items()}
    name = "blocks.0.mlp.0.weight"
    wrong[name] += 0.05 * torch.randn(wrong[name].shape, generator=torch.Generator().manual_seed(1))
    return wrong


@pytest.fixture
def shims(shim_procs):
    return [shim_procs("--instance-id", f"rb{i}") for i in range(3)]


def serving(fleet: Fleet) -> list[pb.DescribeResponse]:
    return fleet.describe(weights_digest=True)


def test_a_failed_canary_after_the_flip_rolls_the_fleet_back_and_resumes_it(shims):
    torch.manual_seed(11)
    model = TinyLM(TinyLMConfig()).eval()
    with Fleet(endpoints(shims), epoch_timeout_s=60) as fleet:
        v1 = trained(model, 1)
        link = connected(fleet, v1)
        first = fleet.refit(link, v1, version=1, epoch=Staged(),
                            checks=Checks(canary=canary_of(model)))
        assert all(w.canary_gap <= FP32_TOLERANCE for w in first.workers)
        # The first staged epoch had no committed copy before it: nothing to keep.
        assert {d.previous_copy_version for d in serving(fleet)} == {0}
        v2 = trained(model, 2)
        good = canary_of(model)
        fleet.refit(link, v2, version=2, epoch=Staged(), checks=Checks(canary=good))
        at_v2 = serving(fleet)
        assert {(d.weight_version, d.previous_copy_version) for d in at_v2} == {(2, 1)}, at_v2
        assert all(d.staging_bytes == 2 * first.bytes for d in at_v2), \
            [d.staging_bytes for d in at_v2]  # the cost: a second host copy of the plan

        with pytest.raises(CanaryMismatchError) as caught:
            fleet.refit(link, corrupted(trained(model, 3)), version=3, epoch=Staged(),
                        checks=Checks(canary=canary_of(model)))
        err = caught.value
        assert err.reason == Reason.CANARY_MISMATCH
        assert sorted(err.workers) == ["rb0", "rb1", "rb2"], err  # who differed, each named
        rollback = err.rollback
        assert rollback is not None and rollback.complete, rollback
        assert (rollback.version, rollback.rolled_back_from) == (2, 3), rollback
        assert sorted(rollback.workers) == ["rb0", "rb1", "rb2"], rollback
        print(f"rolled back 3 -> 2 on {len(rollback.workers)} engines, longest stall "
              f"{rollback.stall_seconds * 1e3:.1f} ms")

        after = serving(fleet)
        for d, before in zip(after, at_v2):
            assert d.weight_version == 2 and not d.paused, d  # resumed, on the good version
            assert d.state == pb.SHIM_STATE_READY, d
            assert d.weights_digest == before.weights_digest, d  # the v2 bytes, exactly
            assert d.committed_copy_version == 2 and d.previous_copy_version == 0, d
        # Version 3 was rolled back from: never reused for other weights. (Every engine
        # refused, so the staged epoch left each behind: readmitted, the group formed again.)
        with pytest.raises(FleetError) as stale:
            fleet.refit(link, v2, version=3, epoch=Staged(), checks=Checks(canary=good))
        assert stale.value.reasons == {Reason.STALE_VERSION}, stale.value
        for s in shims:
            fleet.readmit(s.instance_id)
        link.close()
        link = fleet.connect("127.0.0.1")
        v4 = trained(model, 4)
        report = fleet.refit(link, v4, epoch=Staged(), checks=Checks(canary=canary_of(model)))
        assert report.version == 4 and all(w.canary_gap <= FP32_TOLERANCE for w in report.workers)
        link.close()


def test_an_operator_rolls_the_fleet_back_one_version_with_the_api_and_the_cli(shims):
    torch.manual_seed(12)
    model = TinyLM(TinyLMConfig()).eval()
    workers = [a for s in shims for a in ("--worker", f"{s.instance_id}={s.address}")]
    with Fleet(endpoints(shims), epoch_timeout_s=60) as fleet:
        link = connected(fleet, trained(model, 1))
        digests = {}
        for version in (1, 2, 3):
            tensors = trained(model, version)
            canary = canary_of(model)
            report = fleet.refit(link, tensors, version=version, epoch=Staged(delta=True),
                                 checks=Checks(canary=canary))
            digests[version] = serving(fleet)[0].weights_digest
            print(f"v{version}: delta {report.delta}, {report.wire_bytes} bytes on the wire")
        assert report.delta  # the reversible epoch applied its delta beside the kept copy

        back = fleet.rollback()
        assert (back.version, back.rolled_back_from) == (2, 3) and back.complete, back
        assert all(d.weight_version == 2 and not d.paused and d.weights_digest == digests[2]
                   for d in serving(fleet))
        # One version only: nothing kept before 2 now, so a second rollback moves nothing.
        with pytest.raises(RollbackError) as refused:
            fleet.rollback()
        assert refused.value.reasons == {Reason.NO_PREVIOUS_COPY}, refused.value
        assert sorted(refused.value.workers) == ["rb0", "rb1", "rb2"], refused.value
        assert all(d.weight_version == 2 for d in serving(fleet))

        # After a rollback the next delta goes full (the base was the rejected version's).
        v4 = trained(model, 4)
        report = fleet.refit(link, v4, epoch=Staged(delta=True))
        assert report.version == 4 and not report.delta, report

        # The operator's CLI (a real process): back to 2 again, every row says so.
        out = subprocess.run([sys.executable, "-m", "refit_grpc.cli", "fleet", "rollback",
                              "--json", "--timeout-s", "30", *workers],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr + out.stdout
        rows = json.loads(out.stdout)["workers"]
        assert all(r["ok"] and r["detail"] == "rolled back 4 -> 2" for r in rows), rows
        assert all(d.weight_version == 2 and d.weights_digest == digests[2]
                   for d in serving(fleet))
        status = subprocess.run([sys.executable, "-m", "refit_grpc.cli", "fleet", "status",
                                 *workers], capture_output=True, text=True, timeout=120).stdout
        assert "back to" not in status, status  # nothing kept before 2
        link.close()


def refusal_of(shim, request: pb.RollbackRequest) -> str:
    """The reason the shim attaches to its refusal of `request` (the one decoder)."""
    stub = pb_grpc.RefitServiceStub(grpc.insecure_channel(shim.address))
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rollback(request, timeout=10)
    return failure_from_rpc(WorkerEndpoint(shim.instance_id, shim.address), caught.value).reason


def test_a_rollback_that_does_not_apply_is_refused_typed_and_moves_nothing(shims):
    """The shim's own refusals (Rollback through the proto, as grpcurl sends it), and an epoch
    that was not reversible: a failed check leaves its engines paused, and says so."""
    torch.manual_seed(13)
    model = TinyLM(TinyLMConfig()).eval()
    assert refusal_of(shims[0], pb.RollbackRequest(version=1)) == Reason.WRONG_STATE  # EMPTY
    with Fleet(endpoints(shims), epoch_timeout_s=60) as fleet:
        link = connected(fleet, trained(model, 1))
        fleet.refit(link, trained(model, 1), version=1, epoch=Staged())
        fleet.refit(link, trained(model, 2), version=2, epoch=Staged())
        def facts() -> list[tuple]:
            return [(d.weight_version, d.previous_copy_version, d.committed_copy_version,
                     d.weights_digest, d.paused, d.state) for d in serving(fleet)]

        before = facts()
        for request, reason in [
                (pb.RollbackRequest(version=3), Reason.ROLLBACK_VERSION_MISMATCH),
                (pb.RollbackRequest(version=2, to_version=5), Reason.ROLLBACK_VERSION_MISMATCH),
                (pb.RollbackRequest(version=0), Reason.INVALID_VERSION),
                (pb.RollbackRequest(version=2, instance_id="someone-else"),
                 Reason.MEMBERSHIP_CHANGED)]:
            assert refusal_of(shims[0], request) == reason, request
        assert facts() == before  # nothing moved

        # Not reversible: a failed check leaves the engines paused at the version, and no
        # engine holds a copy to go back to.
        with pytest.raises(CanaryMismatchError) as caught:
            fleet.refit(link, corrupted(trained(model, 3)), version=3,
                        epoch=Staged(reversible=False), checks=Checks(canary=canary_of(model)))
        assert caught.value.rollback is None
        assert all(d.weight_version == 3 and d.paused for d in serving(fleet))
        with pytest.raises(RollbackError) as refused:
            fleet.rollback()
        assert refused.value.reasons == {Reason.NO_PREVIOUS_COPY}
        assert sorted(refused.value.workers) == ["rb0", "rb1", "rb2"]
        link.close()


class _KillBeforeTheChecks(Checks):
    """The epoch's checks, after `victim` (a shim process) is killed with SIGKILL: it died
    after its flip, before the rollback reaches it."""

    def __init__(self, canary: Canary, victim) -> None:
        super().__init__(canary=canary)
        object.__setattr__(self, "victim", victim)

    def run(self, version, committed, links) -> None:
        self.victim.signal(signal.SIGKILL)
        self.victim.stop()  # reaps it
        super().run(version, committed, links)


def test_an_engine_killed_after_its_flip_is_left_behind_while_the_others_roll_back(shims):
    """Issue 23's fault: the canary rejects version 3 after the flip, and one engine died
    meanwhile. The survivors are back on 2 and resumed; the dead one is named in the rollback
    report and left behind; the next epoch goes on with the survivors."""
    torch.manual_seed(14)
    model = TinyLM(TinyLMConfig()).eval()
    with Fleet(endpoints(shims), epoch_timeout_s=60) as fleet:
        link = connected(fleet, trained(model, 1))
        for version in (1, 2):
            fleet.refit(link, trained(model, version), version=version, epoch=Staged())
        at_v2 = {d.instance_id: d.weights_digest for d in serving(fleet)}
        with pytest.raises(CanaryMismatchError) as caught:
            fleet.refit(link, corrupted(trained(model, 3)), version=3, epoch=Staged(),
                        checks=_KillBeforeTheChecks(canary_of(model), shims[2]))
        rollback = caught.value.rollback
        assert rollback is not None and not rollback.complete, rollback
        assert sorted(rollback.workers) == ["rb0", "rb1"], rollback
        assert [f.instance_id for f in rollback.failed] == ["rb2"], rollback
        assert rollback.failed[0].code in (grpc.StatusCode.UNAVAILABLE,
                                           grpc.StatusCode.DEADLINE_EXCEEDED), rollback.failed
        assert "rb2" in str(caught.value), caught.value  # the note names the one not rolled back
        assert set(fleet.left_behind) == {"rb2"}, fleet.left_behind
        for d in fleet.describe_each(weights_digest=True)[:2]:
            assert isinstance(d, pb.DescribeResponse), d
            assert (d.weight_version, d.paused, d.weights_digest) == \
                (2, False, at_v2[d.instance_id]), d

        v4 = trained(model, 4)
        report = fleet.refit(link, v4, version=4, epoch=Staged(),
                             checks=Checks(canary=canary_of(model)))
        assert sorted(w.instance_id for w in report.workers) == ["rb0", "rb1"], report
        assert all(w.canary_gap <= FP32_TOLERANCE for w in report.workers), report
        link.close()


class _MisloadingEngine(ReferenceEngine):
    """A reference engine whose loader is wrong at one version: the bytes staged are the
    trainer's (the staged digest matches), the weights it serves after the flip are not."""

    def __init__(self, bad_version: int) -> None:
        super().__init__()
        self.bad_version = bad_version

    def flip(self, version: int, deadline) -> str:
        digest = super().flip(version, deadline)
        if version == self.bad_version:
            with torch.no_grad():  # noise, not a shift (a LayerNorm would remove a shift)
                weight = dict(self._model.named_parameters())["blocks.0.mlp.0.weight"]
                weight.add_(0.05 * torch.randn(weight.shape))
        return digest


def test_one_engine_of_three_failing_the_canary_with_a_quorum_met_goes_back_alone(shim):
    """Issue 23's fault: `Staged(min_engines=2)`, and one engine's load of version 3 is wrong.
    Two engines passed the canary, so the version is right: the fleet serves 3 on those two,
    the one that failed is rolled back to 2, resumed there and left behind, and the epoch's
    report says so. The whole fleet goes back only when fewer than `min_engines` pass."""
    torch.manual_seed(15)
    model = TinyLM(TinyLMConfig()).eval()
    shims = [shim(), shim(), shim(_MisloadingEngine(bad_version=3))]
    names = [WorkerEndpoint(f"q{i}", s.address) for i, s in enumerate(shims)]
    with Fleet(names, epoch_timeout_s=60) as fleet:
        link = connected(fleet, trained(model, 1))
        for version in (1, 2):
            fleet.refit(link, trained(model, version), version=version, epoch=Staged())
        v2_digest = serving(fleet)[2].weights_digest
        v3 = trained(model, 3)
        report = fleet.refit(link, v3, version=3, epoch=Staged(min_engines=2),
                             checks=Checks(canary=canary_of(model)))
        assert sorted(w.instance_id for w in report.workers) == ["q0", "q1"], report
        assert all(w.canary_gap <= FP32_TOLERANCE for w in report.workers), report
        assert [(f.instance_id, f.reason) for f in report.left_behind] == \
            [("q2", Reason.CANARY_MISMATCH)], report.left_behind
        assert report.rollback is not None and report.rollback.workers == ("q2",), report
        assert (report.rollback.version, report.rollback.rolled_back_from) == (2, 3)
        described = serving(fleet)
        assert [(d.weight_version, d.paused) for d in described] == \
            [(3, False), (3, False), (2, False)], described
        assert described[2].weights_digest == v2_digest  # back on the good version's bytes
        assert described[0].weights_digest == described[1].weights_digest  # the v3 bytes
        assert set(fleet.left_behind) == {"q2"}

        # Its fault was at 3 only: readmitted, it takes part in the next epoch (a full one
        # for it) and passes the canary with the others.
        fleet.readmit("q2")
        report = fleet.refit(link, trained(model, 4), version=4, epoch=Staged(min_engines=2),
                             checks=Checks(canary=canary_of(model)))
        assert sorted(w.instance_id for w in report.workers) == ["q0", "q1", "q2"], report
        assert report.rollback is None and not report.left_behind, report
        link.close()
