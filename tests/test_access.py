"""Access: bearer tokens, TLS with client certificates, and where a shim may listen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refit_grpc import ChannelSecurity, Fleet, Packing, WorkerEndpoint
from refit_grpc.driver.failures import failure_from_rpc
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.testing.pki import make_pki

from support import connected

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A test CA with a server and a client certificate, and a rogue CA with its own client."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def _security(pki: Path, client: str | None = "client", token: str | None = TOKEN):
    return ChannelSecurity(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / f"{client}.key").read_bytes() if client else None,
        certificate_chain=(pki / f"{client}.pem").read_bytes() if client else None,
        token=token)


def _describe(channel, metadata=()):
    return pb_grpc.RefitServiceStub(channel).Describe(pb.DescribeRequest(), timeout=5,
                                                      metadata=metadata)


@pytest.fixture
def secure_shim(shim_procs, pki, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    return shim_procs("--model", "none", "--tls-cert", str(pki / "server.pem"),
                      "--tls-key", str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem"),
                      "--token-file", str(tokens))


def test_mtls_and_token_let_the_driver_in(secure_shim, pki):
    with _security(pki).open(secure_shim.address) as ch:
        assert _describe(ch, _security(pki).metadata()).instance_id == secure_shim.instance_id


@pytest.mark.parametrize("token,reason", [(None, "MISSING_TOKEN"), ("wrong", "INVALID_TOKEN")])
def test_missing_or_wrong_token_is_unauthenticated(secure_shim, pki, token, reason):
    security = _security(pki, token=token)
    with security.open(secure_shim.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            _describe(ch, security.metadata())
        f = failure_from_rpc(WorkerEndpoint("x", "x"), e.value)
        assert (f.code, f.reason) == (grpc.StatusCode.UNAUTHENTICATED, reason)
        # Streaming calls are guarded too, and health stays open for probes.
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.RefitServiceStub(ch).UpdateWeights(
                pb.UpdateWeightsRequest(version=1), timeout=5, metadata=security.metadata()))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("client", ["rogue_client", None])
def test_wrong_or_missing_client_certificate_fails_the_handshake(secure_shim, pki, client):
    security = _security(pki, client=client)
    with security.open(secure_shim.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            _describe(ch, security.metadata())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_client_cannot_reach_a_tls_shim(secure_shim):
    with grpc.insecure_channel(secure_shim.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            _describe(ch, (("authorization", f"Bearer {TOKEN}"),))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_whole_epoch_over_mtls_and_token(secure_shim, pki):
    weights = {"w": torch.randn(1000), "b": torch.randn(10).to(torch.bfloat16)}
    with Fleet([WorkerEndpoint(secure_shim.instance_id, secure_shim.address)],
               packing=Packing(1024, 2), security=_security(pki)) as fleet:
        link = connected(fleet, weights)
        assert fleet.refit(link, weights, version=1).version == 1
        link.close()


def test_listening_beyond_loopback_needs_tls_a_token_or_an_explicit_flag(shim_procs):
    proc = subprocess.run([sys.executable, "-m", "refit_grpc.cli", "shim", "--model", "none",
                           "--address", "0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "refusing to listen on 0.0.0.0:0" in proc.stderr
    p = shim_procs("--model", "none", "--address", "0.0.0.0:0", "--insecure-listen")
    assert p.address.startswith("0.0.0.0:")
