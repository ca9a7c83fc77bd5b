"""Keeping the caches across a staged flip (`Staged(keep_cache=True)`, FlipRequest.keep_cache),
on in-process shims of the reference engine (real gRPC on loopback, a real gloo group): the
prefix cache survives a flip that keeps it and is cleared by one that does not; every refusal is
typed and comes before anything changes. vLLM's side (a streamed completion that crosses the
flip, with its version spans) is tests/test_vllm_staged.py's."""

from __future__ import annotations

import grpc
import pytest

from refit_grpc import Fleet, Packing, Staged, WorkerEndpoint
from refit_grpc.common import PauseMode
from refit_grpc.driver.failures import QuorumError, failure_from_rpc
from refit_grpc.errors import InvalidArgumentError
from refit_grpc.models.tiny_lm import TinyLM, TinyLMConfig
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Capabilities
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.v1 import reference_engine_pb2 as ref_pb
from refit_grpc.v1 import reference_engine_pb2_grpc as ref_pb_grpc

from support import connected

PROMPT = [5, 9, 2, 7]


def state_of(seed: int) -> dict:
    import torch

    torch.manual_seed(seed)
    return {n: t.detach().clone() for n, t in TinyLM(TinyLMConfig()).state_dict().items()}


def generate(shim) -> ref_pb.GenerateResponse:
    stub = ref_pb_grpc.ReferenceEngineServiceStub(shim.channel)
    return stub.Generate(ref_pb.GenerateRequest(prompt=PROMPT, max_new_tokens=2), timeout=30)


def flip_refusal(shim, request: pb.FlipRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        shim.stub.Flip(request, timeout=10)
    failure = failure_from_rpc(WorkerEndpoint("x", shim.address), caught.value)
    return failure.code, failure.reason


class _NoKeepCache(ReferenceEngine):
    """An engine that cannot keep its caches across a flip (as the Dynamo adapter today)."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(canary=True, staging=True, delta=True, serving_copy=True,
                            rollback=True, keep_cache=False)


def test_a_flip_that_keeps_the_cache_keeps_the_prefix_cache_and_one_that_does_not_clears_it(
        shim):
    sh = shim()
    with Fleet([WorkerEndpoint("k0", sh.address)], packing=Packing(1 << 16, 2),
               epoch_timeout_s=30) as fleet:
        link = connected(fleet, state_of(1))
        fleet.refit(link, state_of(1), version=1, epoch=Staged())
        generate(sh)
        assert generate(sh).prefix_cache_hit  # cached at version 1

        report = fleet.refit(link, state_of(2), version=2, epoch=Staged(keep_cache=True))
        assert report.version == 2
        kept = generate(sh)
        assert kept.weight_version == 2 and kept.prefix_cache_hit  # computed by version 1

        fleet.refit(link, state_of(3), version=3, epoch=Staged())
        cleared = generate(sh)
        assert cleared.weight_version == 3 and not cleared.prefix_cache_hit
        link.close()


def test_keep_cache_is_refused_typed_before_anything_changes(shim):
    sh, other = shim(), shim(_NoKeepCache())
    # The driver: a pause mode that parks nothing has no cache to keep.
    with Fleet([WorkerEndpoint("k0", sh.address)], packing=Packing(1 << 16, 2),
               epoch_timeout_s=30) as fleet:
        link = connected(fleet, state_of(1))
        fleet.refit(link, state_of(1), version=1, epoch=Staged())
        with pytest.raises(InvalidArgumentError) as refused:
            fleet.refit(link, state_of(2), version=2, epoch=Staged(keep_cache=True),
                        pause_mode=PauseMode.WAIT)
        assert refused.value.reason == Reason.INVALID_KEEP_CACHE
        assert sh.describe().weight_version == 1 and sh.describe().staged_version == 0

        # The shim, as grpcurl would ask: refused on the field before anything else is looked
        # at (here, before NOT_STAGED: nothing is staged).
        for mode in (pb.PAUSE_MODE_WAIT, pb.PAUSE_MODE_ABORT):
            assert flip_refusal(sh, pb.FlipRequest(version=2, keep_cache=True, pause_mode=mode)) \
                == (grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_KEEP_CACHE)
        assert flip_refusal(other, pb.FlipRequest(version=2, keep_cache=True)) == \
            (grpc.StatusCode.FAILED_PRECONDITION, Reason.KEEP_CACHE_UNSUPPORTED)
        d = sh.describe()
        assert (d.weight_version, d.paused, d.state) == (1, False, pb.SHIM_STATE_READY), d
        link.close()

    # An engine that cannot keep them: the flip is refused, the engine left behind, serving 1.
    with Fleet([WorkerEndpoint("n0", other.address)], packing=Packing(1 << 16, 2),
               epoch_timeout_s=30) as fleet:
        link = connected(fleet, state_of(1))
        fleet.refit(link, state_of(1), version=1, epoch=Staged())
        with pytest.raises(QuorumError) as quorum:
            fleet.refit(link, state_of(2), version=2, epoch=Staged(keep_cache=True))
        assert quorum.value.reasons == {Reason.KEEP_CACHE_UNSUPPORTED}, quorum.value
        d = other.describe()
        assert (d.weight_version, d.paused) == (1, False), d
        link.close()
