"""An in-place epoch without checks resumes each engine at its own commit (`resume_on_commit`):
no Flush call follows, the caches are cleared as a Flush would, and an engine whose resume failed
is flushed by the driver. With checks, every engine stays paused until the trainer has compared
them, then one Flush each, as before (docs/protocol.md, UpdateWeights). Real in-process shims on
loopback with their Prometheus endpoints, a real gloo group, the reference engine's tiny LM."""

from __future__ import annotations

import grpc
import pytest
import torch

from refit_grpc import Checks, Fleet, InPlace, Packing, WorkerEndpoint
from refit_grpc.common import Deadline
from refit_grpc.driver.failures import failure_from_rpc
from refit_grpc.errors import EngineUnavailableError
from refit_grpc.models.tiny_lm import TinyLM, TinyLMConfig
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.server import ServerOptions, ShimServer
from refit_grpc.shim.service import ShimConfig

from support import connected, scrape

FLUSH = "refit_grpc.v1.RefitService/Flush"
PROMPT = [3, 14, 15, 9, 26]


class ResumeFailsOnce(ReferenceEngine):
    """The reference engine whose next resume fails as an engine gone for a moment would: the
    fault the driver's fallback (a Flush) is for."""

    fail_next_resume = False

    def resume(self, deadline: Deadline) -> None:
        if self.fail_next_resume:
            self.fail_next_resume = False
            raise EngineUnavailableError("engine did not answer its resume",
                                         reason=Reason.ENGINE_UNAVAILABLE)
        super().resume(deadline)


@pytest.fixture
def engines():
    made = [ReferenceEngine(), ResumeFailsOnce()]
    servers = [ShimServer(e, ShimConfig(max_epoch_s=20),
                          ServerOptions(address="127.0.0.1:0",
                                        metrics_address="127.0.0.1:0")).start() for e in made]
    yield list(zip(made, servers))
    for s in servers:
        s.stop(0)


def flushes(server: ShimServer) -> float:
    return scrape(server.metrics.address).get(
        ("refit_shim_rpcs_total", frozenset({"method": FLUSH, "code": "OK"}.items())), 0.0)


def weights(engine: ReferenceEngine, seed: int) -> dict[str, torch.Tensor]:
    """The engine's own tensors, perturbed: a version its tiny LM generates with."""
    g = torch.Generator().manual_seed(seed)
    names = list(TinyLM(TinyLMConfig()).state_dict())  # the engine's model: the same names
    return {n: engine.tensor(n) + 0.05 * torch.randn(engine.tensor(n).shape, generator=g)
            for n in names}


def version_of(server: ShimServer) -> int:
    with grpc.insecure_channel(server.address) as channel:
        return pb_grpc.RefitServiceStub(channel).Describe(
            pb.DescribeRequest(skip_weights_digest=True), timeout=5).weight_version


def test_an_epoch_without_checks_resumes_each_engine_at_its_commit_and_sends_no_flush(engines):
    (first, s0), (second, s1) = engines
    with Fleet([WorkerEndpoint(f"r{i}", s.address) for i, (_, s) in enumerate(engines)],
               packing=Packing(1 << 16, 2), epoch_timeout_s=30) as fleet:
        link = connected(fleet, weights(first, 1))
        fleet.refit(link, weights(first, 1), version=1)
        # A prompt the prefix cache holds: the commit's resume must clear it, as Flush does.
        first.generate(PROMPT, 2, Deadline(10))
        assert first.generate(PROMPT, 2, Deadline(10))[1], "the prompt is not in the cache"
        before = [flushes(s0), flushes(s1)]

        report = fleet.refit(link, weights(first, 2), version=2, epoch=InPlace())
        assert [flushes(s0), flushes(s1)] == before, "a Flush was sent after the epoch"
        for engine, server in engines:
            assert not engine.is_paused() and version_of(server) == 2
        _, cached = first.generate(PROMPT, 2, Deadline(10))
        assert not cached, "the committed version served a prefix the old one computed"
        assert report.version == 2

        # One engine's resume fails at its commit: it stays paused, says so in COMMITTED, and
        # the driver flushes that engine only.
        second.fail_next_resume = True
        fleet.refit(link, weights(first, 3), version=3, epoch=InPlace())
        assert [flushes(s0), flushes(s1)] == [before[0], before[1] + 1]
        assert not first.is_paused() and not second.is_paused()

        # Checks: nothing serves before the trainer compared the digests, then one Flush each.
        fleet.refit(link, weights(first, 4), version=4, epoch=InPlace(),
                    checks=Checks(verify=True))
        assert [flushes(s0), flushes(s1)] == [before[0] + 1, before[1] + 2]
        assert not first.is_paused() and not second.is_paused()
        link.close()


def test_resume_on_commit_is_refused_on_a_staged_epoch_and_with_a_canary(ready_shim):
    """Refused on the request's own fields (INVALID_ARGUMENT), before anything else: the shim
    stays READY at version 1, serving."""
    base = dict(version=2, plan_digest=ready_shim.plan.digest, group_id="g1",
                resume_on_commit=True)
    for extra in ({"mode": pb.EPOCH_MODE_STAGED},
                  {"canary": pb.Canary(token_ids=[1, 2, 3])}):
        with pytest.raises(grpc.RpcError) as e:
            list(ready_shim.shim.stub.UpdateWeights(pb.UpdateWeightsRequest(**base, **extra),
                                                    timeout=5))
        failure = failure_from_rpc(WorkerEndpoint("x", ready_shim.shim.address), e.value)
        assert (failure.code, failure.reason) == \
            (grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_RESUME_ON_COMMIT), failure
    d = ready_shim.shim.describe()
    assert (d.weight_version, d.paused, d.state) == (1, False, pb.SHIM_STATE_READY), d
