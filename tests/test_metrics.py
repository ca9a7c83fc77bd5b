"""The shim's Prometheus endpoint, scraped over HTTP: a real shim process, real gloo epochs driven by
`Fleet`, and the numbers checked before, during and after an epoch, and after a refusal."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
import torch

from refit_grpc import EpochRefusedError, Fleet, Packing, WorkerEndpoint
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.shim.auth import TokenAuthInterceptor
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.server import ServerOptions, ShimServer
from refit_grpc.shim.service import ShimConfig

from support import scrape

BUFFER = 4096
UPDATE = "refit_grpc.v1.RefitService/UpdateWeights"


def value(samples, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def tensors(version: int) -> dict[str, torch.Tensor]:
    """Twenty 1200-byte tensors and a bf16 one: several buckets of BUFFER bytes."""
    g = torch.Generator().manual_seed(version)
    out = {f"t{i}": torch.randn(300, generator=g) for i in range(20)}
    out["e"] = torch.randn(17, 33, generator=g).to(torch.bfloat16)
    return out


def state_of(samples) -> str:
    [on] = [dict(k[1])["state"] for k, v in samples.items() if k[0] == "refit_shim_state" and v]
    return on


def test_an_epoch_moves_the_numbers_while_it_runs_and_after(shim_procs):
    shim = shim_procs("--model", "none", "--instance-id", "m0",
                      "--metrics-address", "127.0.0.1:0")
    metrics = shim.metrics_address
    assert metrics and metrics.startswith("127.0.0.1:") and not metrics.endswith(":0"), metrics
    before = scrape(metrics)
    assert state_of(before) == "EMPTY"
    assert value(before, "refit_shim_weight_version") == 0
    assert value(before, "refit_shim_received_bytes_total") == 0
    assert value(before, "refit_shim_info", instance_id="m0", engine="reference") == 1
    for outcome in ("committed", "failed", "refused"):
        assert value(before, "refit_shim_epochs_total", outcome=outcome) == 0

    t1, t2 = tensors(1), tensors(2)
    with Fleet([WorkerEndpoint("m0", shim.address)], packing=Packing(BUFFER, 2),
               epoch_timeout_s=60) as fleet:
        plan = fleet.prepare({n: (t.shape, t.dtype) for n, t in t1.items()})
        assert len(plan.buckets) >= 4
        link = fleet.connect("127.0.0.1")
        assert state_of(scrape(metrics)) == "READY"
        fleet.refit(link, t1, version=1)

        after1 = scrape(metrics)
        assert value(after1, "refit_shim_weight_version") == 1
        assert value(after1, "refit_shim_received_bytes_total") == plan.total_bytes
        assert value(after1, "refit_shim_epochs_total", outcome="committed") == 1
        for phase in ("accept", "receive", "commit"):
            assert value(after1, "refit_shim_epoch_phase_seconds_count", phase=phase) == 1
        assert value(after1, "refit_shim_epoch_seconds_count", outcome="committed") == 1
        assert value(after1, "refit_shim_rpcs_total", method=UPDATE, code="OK") == 1
        assert value(after1, "refit_shim_rpc_seconds_count", method=UPDATE) == 1

        # During epoch 2: accepted (paused, RECEIVING) and then stopped after its first bucket.
        handle = fleet.update_weights(2)
        handle.wait_accepted()
        accepted = scrape(metrics)
        assert state_of(accepted) == "RECEIVING"
        assert value(accepted, "refit_shim_epoch_phase_seconds_count", phase="accept") == 2
        assert value(accepted, "refit_shim_epochs_total", outcome="committed") == 1
        assert value(accepted, "refit_shim_weight_version") == 1
        mid: list[float] = []

        def after_first_bucket(bucket) -> None:
            # The sender waits here, so at most the buckets already posted can have arrived.
            if bucket.index == 0:
                deadline = handle.send_deadline()
                while deadline.remaining() > 0:
                    now = value(scrape(metrics), "refit_shim_received_bytes_total")
                    if now > plan.total_bytes:
                        mid.append(now)
                        return
                raise AssertionError("no bytes counted during the epoch")

        link.sender.send(t2, handle.send_deadline(), on_bucket=after_first_bucket)
        handle.result()
        assert plan.total_bytes < mid[0] < 2 * plan.total_bytes, (mid, plan.total_bytes)
        print(f"\nMETRICS: mid-epoch bytes {mid[0] - plan.total_bytes:.0f} of {plan.total_bytes}")
        fleet.flush_cache()

        after2 = scrape(metrics)
        assert state_of(after2) == "READY"
        assert value(after2, "refit_shim_weight_version") == 2
        assert value(after2, "refit_shim_received_bytes_total") == 2 * plan.total_bytes
        assert value(after2, "refit_shim_epochs_total", outcome="committed") == 2

        # A stale version is refused before any byte: the refusal and its reason are counted.
        with pytest.raises(EpochRefusedError) as e:
            fleet.refit(link, t1, version=1)
        assert e.value.reasons == {"STALE_VERSION"}
        refused = scrape(metrics)
        assert value(refused, "refit_shim_epochs_total", outcome="refused") == 1
        assert value(refused, "refit_shim_errors_total", reason="STALE_VERSION") == 1
        assert value(refused, "refit_shim_rpcs_total", method=UPDATE,
                     code="FAILED_PRECONDITION") == 1
        assert value(refused, "refit_shim_epochs_total", outcome="committed") == 2
        assert value(refused, "refit_shim_epoch_phase_seconds_count", phase="accept") == 2
        assert value(refused, "refit_shim_weight_version") == 2
        assert value(refused, "refit_shim_received_bytes_total") == 2 * plan.total_bytes
        assert state_of(refused) == "PREPARED"  # the refused epoch's group is torn down


def test_two_shims_in_one_process_keep_their_own_numbers_and_count_refused_tokens():
    servers = [ShimServer(ReferenceEngine(model=None), ShimConfig(),
                          ServerOptions(address="127.0.0.1:0", metrics_address="127.0.0.1:0"),
                          interceptors=(TokenAuthInterceptor(["t"]),)).start()
               for _ in range(2)]
    try:
        with grpc.insecure_channel(servers[0].address) as channel:
            stub = pb_grpc.RefitServiceStub(channel)
            stub.Describe(pb.DescribeRequest(), timeout=5, metadata=[("authorization", "Bearer t")])
            with pytest.raises(grpc.RpcError) as e:
                stub.Describe(pb.DescribeRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        first, second = (scrape(s.metrics.address) for s in servers)
        describe = "refit_grpc.v1.RefitService/Describe"
        assert value(first, "refit_shim_rpcs_total", method=describe, code="OK") == 1
        assert value(first, "refit_shim_rpcs_total", method=describe, code="UNAUTHENTICATED") == 1
        assert value(first, "refit_shim_errors_total", reason="MISSING_TOKEN") == 1
        assert ("refit_shim_rpcs_total", frozenset({"method": describe, "code": "OK"}.items())) \
            not in second
        assert value(second, "refit_shim_errors_total", reason="MISSING_TOKEN") == 0
    finally:
        for s in servers:
            s.stop(0)
    with pytest.raises(OSError):  # stopping the shim stops its endpoint
        scrape(servers[0].metrics.address)


def test_metrics_address_policy(shim_procs):
    cmd = [sys.executable, "-m", "refit_grpc.cli", "shim", "--model", "none",
           "--address", "127.0.0.1:0"]
    refused = subprocess.run([*cmd, "--metrics-address", "0.0.0.0:0"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0
    assert "refusing to serve metrics on 0.0.0.0" in refused.stderr, refused.stderr
    bad = subprocess.run([*cmd, "--metrics-address", "localhost:http"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "expected HOST:PORT or PORT" in bad.stderr, bad.stderr

    alone = shim_procs("--model", "none", "--metrics-address", "0")  # a port alone: loopback
    assert alone.metrics_address and alone.metrics_address.startswith("127.0.0.1:")
    assert state_of(scrape(alone.metrics_address)) == "EMPTY"
