"""Engines of one shim process that share a receiving rank run an epoch over one UpdateEngines
stream and flip in one FlipEngines call (issue 21, docs/scale.md): the trainer makes one call per
process, not one per engine, and each engine's epoch (flip) is exactly its UpdateWeights (Flip),
its failures in-band and named; the stream's end (a trainer gone) ends every engine's epoch.

Real in-process shims on loopback, as `refit-grpc shim --engines K` builds them (reference engines
sharing one `SharedRank`, each its own gRPC server and Prometheus endpoint, every engine's servicer
given the others), a real gloo group; the calls are counted by the shims' own metrics.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from refit_grpc import Fleet, FleetError, Packing, Staged, WorkerEndpoint
from refit_grpc.common import Deadline, PauseMode
from refit_grpc.dataplane.shared_rank import SharedRank
from refit_grpc.driver.failures import failure_from_rpc, failure_from_status
from refit_grpc.errors import EngineUnavailableError
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.server import ServerOptions, ShimServer
from refit_grpc.shim.service import ShimConfig

from support import connected, scrape

ENGINES = 3
SERVICE = "refit_grpc.v1.RefitService"


class PauseFailsOnce(ReferenceEngine):
    """The reference engine whose next pause fails as an engine gone for a moment would."""

    fail_next_pause = False

    def pause(self, mode: PauseMode, deadline: Deadline, keep_cache: bool = False) -> None:
        if self.fail_next_pause:
            self.fail_next_pause = False
            raise EngineUnavailableError("engine did not answer its pause",
                                         reason=Reason.ENGINE_UNAVAILABLE)
        super().pause(mode, deadline, keep_cache)


@pytest.fixture
def process():
    """One shim process's engines: a shared rank, a server each, every servicer given the
    others (what `refit-grpc shim --engines 3` does)."""
    rank = SharedRank()
    engines = [ReferenceEngine(model=None, shared_rank=rank),
               ReferenceEngine(model=None, shared_rank=rank),
               PauseFailsOnce(model=None, shared_rank=rank)]
    servers = [ShimServer(e, ShimConfig(instance_id=f"e{k}", max_epoch_s=20),
                          ServerOptions(address="127.0.0.1:0", metrics_address="127.0.0.1:0"))
               for k, e in enumerate(engines)]
    peers = {s.servicer.config.instance_id: s.servicer for s in servers}
    for s in servers:
        s.servicer.share_stream_with(peers)
        s.start()
    yield engines, servers
    for s in servers:
        s.stop(0)


def calls(servers: list[ShimServer], method: str) -> float:
    """How many `method` calls the process's servers answered (any code)."""
    total = 0.0
    for s in servers:
        assert s.metrics is not None
        for (name, labels), value in scrape(s.metrics.address).items():
            if name == "refit_shim_rpcs_total" and dict(labels)["method"] == f"{SERVICE}/{method}":
                total += value
    return total


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(48, 32, generator=g) for i in range(4)}


def fleet_of(servers: list[ShimServer], **config) -> Fleet:
    return Fleet([WorkerEndpoint(s.servicer.config.instance_id, s.address) for s in servers],
                 packing=Packing(4096, 2), epoch_timeout_s=30, **config)


def versions(servers: list[ShimServer]) -> list[int]:
    return [s.servicer.weight_version for s in servers]


def test_one_stream_per_process_carries_every_engines_epoch(process):
    engines, servers = process
    with fleet_of(servers) as fleet:
        link = connected(fleet, weights(1))
        fleet.refit(link, weights(1), version=1)
        fleet.refit(link, weights(2), version=2, epoch=Staged())
        assert versions(servers) == [2] * ENGINES
        for e in engines:
            assert torch.equal(e.tensor("w3"), weights(2)["w3"]) and not e.is_paused()
        # Two epochs: one stream each for the whole process, none per engine; the staged one's
        # flips in one call.
        assert [calls(servers, m) for m in ("UpdateEngines", "UpdateWeights", "FlipEngines",
                                             "Flip")] == [2, 0, 1, 0]
        link.close()

    # The same fleet without it (for comparison: FleetConfig.stream_per_process): a call each.
    with fleet_of(servers, stream_per_process=False) as fleet:
        link = connected(fleet, weights(3))
        fleet.refit(link, weights(3), version=3, epoch=Staged())
        assert versions(servers) == [3] * ENGINES
        assert [calls(servers, m) for m in ("UpdateEngines", "UpdateWeights", "FlipEngines",
                                             "Flip")] == [2, ENGINES, 1, ENGINES]
        link.close()


def test_an_engine_that_fails_inside_the_shared_stream_is_the_one_named(process):
    engines, servers = process
    with fleet_of(servers) as fleet:
        link = connected(fleet, weights(1))
        fleet.refit(link, weights(1), version=1)
        engines[2].fail_next_pause = True
        with pytest.raises(FleetError) as failed:
            fleet.refit(link, weights(2), version=2)
        first = failed.value.failures[0]
        assert (first.instance_id, first.reason) == ("e2", Reason.ENGINE_UNAVAILABLE), \
            failed.value.failures
        assert "did not answer its pause" in first.message
        # Nothing committed; the next epoch (the group formed again) commits everywhere.
        assert versions(servers) == [1] * ENGINES
        link.close()
        link = fleet.connect("127.0.0.1")
        fleet.refit(link, weights(3), version=3)
        assert versions(servers) == [3] * ENGINES
        link.close()


def test_update_engines_refuses_names_it_does_not_serve_and_decodes_each_engines_end(process):
    _, servers = process
    states = [s.servicer.state() for s in servers]
    good = [pb.UpdateWeightsRequest(version=1, plan_digest="0" * 64, group_id="g",
                                    instance_id=f"e{k}") for k in range(ENGINES)]
    with grpc.insecure_channel(servers[0].address) as channel:
        stub = pb_grpc.RefitServiceStub(channel)
        # Refused whole, before any engine's epoch starts: nothing changes anywhere.
        for engines, needle in [([], "names no engine"),
                                ([good[0], pb.UpdateWeightsRequest(version=1)], "required"),
                                ([good[0], good[0]], "named twice"),
                                ([good[1], pb.UpdateWeightsRequest(version=1, instance_id="x")],
                                 "serves no engine 'x'")]:
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.UpdateEngines(pb.UpdateEnginesRequest(engines=engines), timeout=10))
            f = failure_from_rpc(WorkerEndpoint("e0", servers[0].address), refused.value)
            assert (f.code, f.reason) == (grpc.StatusCode.INVALID_ARGUMENT,
                                          Reason.INVALID_INSTANCE_ID), f
            assert needle in f.message, f
        assert [s.servicer.state() for s in servers] == states

        # Each engine (no plan yet) refuses its own epoch, in-band: decoded as its
        # UpdateWeights' status would be, the call itself ends OK.
        ends = {u.instance_id: u for m in stub.UpdateEngines(
            pb.UpdateEnginesRequest(engines=good[1:]), timeout=10) for u in m.updates}
        assert sorted(ends) == ["e1", "e2"] and all(u.ended and u.status for u in ends.values())
        for name, u in ends.items():
            k, alone = int(name[1]), None
            try:
                with grpc.insecure_channel(servers[k].address) as own:
                    list(pb_grpc.RefitServiceStub(own).UpdateWeights(good[k], timeout=10))
            except grpc.RpcError as e:
                alone = failure_from_rpc(WorkerEndpoint(name, "-"), e)
            within = failure_from_status(WorkerEndpoint(name, "-"), u.status)
            assert alone is not None and within == alone, (within, alone)
    assert [s.servicer.state() for s in servers] == states


def test_flip_engines_refuses_names_it_does_not_serve_and_answers_each_engines_refusal(process):
    _, servers = process
    states = [s.servicer.state() for s in servers]
    flips = [pb.FlipRequest(version=1, staged_digest="0" * 64, instance_id=f"e{k}")
             for k in range(ENGINES)]
    with grpc.insecure_channel(servers[2].address) as channel:
        stub = pb_grpc.RefitServiceStub(channel)
        for engines, needle in [([], "names no engine"), ([flips[0], flips[0]], "named twice"),
                                ([pb.FlipRequest(version=1, instance_id="x")], "serves no")]:
            with pytest.raises(grpc.RpcError) as refused:
                stub.FlipEngines(pb.FlipEnginesRequest(engines=engines), timeout=10)
            f = failure_from_rpc(WorkerEndpoint("e2", servers[2].address), refused.value)
            assert (f.reason, needle in f.message) == (Reason.INVALID_INSTANCE_ID, True), f
        # Nothing is staged: each engine's Flip refuses, answered per engine, in order.
        answer = stub.FlipEngines(pb.FlipEnginesRequest(engines=flips[:2]), timeout=10)
        assert [e.instance_id for e in answer.engines] == ["e0", "e1"]
        for k, e in enumerate(answer.engines):
            with grpc.insecure_channel(servers[k].address) as own:
                with pytest.raises(grpc.RpcError) as alone:
                    pb_grpc.RefitServiceStub(own).Flip(flips[k], timeout=10)
            endpoint = WorkerEndpoint(f"e{k}", "-")
            within, direct = (failure_from_status(endpoint, e.status),
                              failure_from_rpc(endpoint, alone.value))
            # (The direct Flip's message adds the engine's last error: the refusal just made.)
            assert (within.code, within.reason) == (direct.code, direct.reason), (within, direct)
            assert within.reason == Reason.NOT_STAGED and direct.message.startswith(
                within.message), (within, direct)
    assert [s.servicer.state() for s in servers] == states


def test_a_trainer_that_goes_away_mid_stream_ends_every_engines_epoch_at_once(process):
    """The stream's end is every engine's: its caller cancelled after every engine ACCEPTED (a
    trainer gone mid-broadcast), each engine's receive ends within seconds (not at its 20 s
    epoch limit), nothing applied, and the next epoch commits."""
    engines, servers = process
    with fleet_of(servers) as fleet:
        link = connected(fleet, weights(1))
        fleet.refit(link, weights(1), version=1)
        d = fleet.describe()[0]
        requests = [pb.UpdateWeightsRequest(version=2, plan_digest=d.plan_digest,
                                            group_id=d.group_id, instance_id=f"e{k}",
                                            pause_mode=pb.PAUSE_MODE_KEEP)
                    for k in range(ENGINES)]
        with grpc.insecure_channel(servers[1].address) as channel:
            call = pb_grpc.RefitServiceStub(channel).UpdateEngines(
                pb.UpdateEnginesRequest(engines=requests), timeout=30)
            accepted: set[str] = set()
            for message in call:
                accepted |= {u.instance_id for u in message.updates
                             if u.update.phase == pb.UPDATE_WEIGHTS_PHASE_ACCEPTED}
                if len(accepted) == ENGINES:
                    break
            assert all(s.servicer.state() == pb.SHIM_STATE_RECEIVING for s in servers)
            t0 = time.monotonic()
            call.cancel()
        while time.monotonic() - t0 < 10 and any(
                s.servicer.state() == pb.SHIM_STATE_RECEIVING for s in servers):
            time.sleep(0.05)
        ended_s = time.monotonic() - t0
        states = [pb.ShimState.Name(s.servicer.state()) for s in servers]
        assert ended_s < 10 and "SHIM_STATE_RECEIVING" not in states, (ended_s, states)
        assert versions(servers) == [1] * ENGINES
        for e in engines:
            assert torch.equal(e.tensor("w3"), weights(1)["w3"])
        print(f"\nthe stream cancelled: every engine's receive ended in {ended_s:.2f} s, {states}")
        link.close()
        link = fleet.connect("127.0.0.1")
        fleet.refit(link, weights(3), version=3)
        assert versions(servers) == [3] * ENGINES
        link.close()
