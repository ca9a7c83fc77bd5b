"""`refit-grpc call`: drive a shim by hand with grpcurl's JSON mapping (protobuf JSON), for
operators on hosts without grpcurl. Strict parsing: malformed JSON and unknown fields are refused
client-side with a message naming the problem, before anything is sent. Also `refit-grpc health`:
grpc.health.v1's Check of one shim."""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf import json_format

from refit_grpc.cli.security import add_security_flags, security_from_args
from refit_grpc.driver.endpoint import ChannelSecurity, WorkerEndpoint
from refit_grpc.driver.failures import failure_from_rpc
from refit_grpc.proto import pb, pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["RefitService"]
STREAMING = {m.name for m in SERVICE.methods if m.server_streaming}


def call(address: str, method: str, body: str, *, security: ChannelSecurity,
         timeout_s: float, out=sys.stdout, err=sys.stderr) -> int:
    name = method.rsplit("/", 1)[-1].rsplit(".", 1)[-1]
    descriptor = SERVICE.methods_by_name.get(name)
    if descriptor is None:
        print(f"unknown method {method!r}; RefitService has: "
              f"{', '.join(m.name for m in SERVICE.methods)}", file=err)
        return 2
    request = getattr(pb, descriptor.input_type.name)()
    try:
        json_format.Parse(body or "{}", request)
    except json_format.ParseError as e:
        print(f"invalid request JSON for {name}: {e}", file=err)
        return 2
    with security.open(address) as channel:
        rpc = getattr(pb_grpc.RefitServiceStub(channel), name)
        try:
            replies = rpc(request, timeout=timeout_s, metadata=security.metadata())
            for reply in (replies if name in STREAMING else [replies]):
                print(json.dumps(json_format.MessageToDict(reply)), file=out, flush=True)
        except grpc.RpcError as e:
            f = failure_from_rpc(WorkerEndpoint("-", address), e)
            print(f"ERROR {f.code.name} {f.reason}: {f.message}", file=err)
            return 1
    return 0


def health(address: str, *, security: ChannelSecurity, timeout_s: float, out=sys.stdout,
           err=sys.stderr) -> int:
    """grpc.health.v1 Check of the whole server: exit 0 when SERVING, 1 otherwise (a container
    HEALTHCHECK, an exec probe, a script waiting for a shim). Health needs no token."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with security.open(address) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s).status
        except grpc.RpcError as e:
            print(f"ERROR {e.code().name}: {e.details()}", file=err)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(name, file=out)
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def add_call_arguments(rpc: argparse.ArgumentParser) -> None:
    """The arguments of `refit-grpc call`."""
    rpc.add_argument("address")
    rpc.add_argument("method", help="Describe, Prepare, InitCollective, UpdateWeights, ...")
    rpc.add_argument("json", nargs="?", default="{}")
    rpc.add_argument("--timeout-s", type=float, default=30.0)
    add_security_flags(rpc)


def run_call(args: argparse.Namespace) -> int:
    """`refit-grpc call`."""
    return call(args.address, args.method, args.json, security=security_from_args(args),
                timeout_s=args.timeout_s)


def add_health_arguments(check: argparse.ArgumentParser) -> None:
    """The arguments of `refit-grpc health`."""
    check.add_argument("address")
    check.add_argument("--timeout-s", type=float, default=2.0)
    add_security_flags(check)


def run_health(args: argparse.Namespace) -> int:
    """`refit-grpc health`."""
    return health(args.address, security=security_from_args(args), timeout_s=args.timeout_s)
