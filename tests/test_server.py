"""The shim process as an operator meets it: health, reflection, SIGTERM."""

from __future__ import annotations

import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from refit_grpc.proto import pb, pb_grpc


def test_reflection_lists_every_service(shim):
    sh = shim()
    db = ProtoReflectionDescriptorDatabase(sh.channel)
    services = set(db.get_services())
    assert {"refit_grpc.v1.RefitService", "grpc.health.v1.Health",
            "refit_grpc.v1.ReferenceEngineService"} <= services
    # grpcurl needs the full descriptors, not only names.
    desc = db.FindFileContainingSymbol("refit_grpc.v1.RefitService")
    assert desc.package == "refit_grpc.v1"


def test_health_and_sigterm_exit_cleanly(shim_procs):
    p = shim_procs()
    with grpc.insecure_channel(p.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "refit_grpc.v1.RefitService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.RefitServiceStub(channel)
        assert stub.Describe(pb.DescribeRequest(), timeout=5).instance_id == p.instance_id
    t0 = time.monotonic()
    p.signal(signal.SIGTERM)
    assert p.proc.wait(15) == 0
    assert time.monotonic() - t0 < 10
