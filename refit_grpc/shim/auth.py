"""Who may talk to a shim: bearer tokens, TLS with client certificates, and where it may listen.

The engine's own admin routes (vLLM's) are unauthenticated; the shim is the front door, so a shim
that listens beyond loopback with neither TLS nor a token is refused unless explicitly allowed.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from refit_grpc.errors import UnauthenticatedError
from refit_grpc.reasons import Reason
from refit_grpc.shim.status import status_for

log = logging.getLogger(__name__)

# Orchestrators probe health without credentials; everything else needs them.
UNAUTHENTICATED_PREFIXES = ("/grpc.health.v1.Health/",)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Checks `authorization: Bearer <token>` on every call but health, in constant time."""

    def __init__(self, tokens: Sequence[str]):
        if not tokens or any(not t for t in tokens):
            raise ValueError("token auth needs non-empty tokens")
        self._tokens = [t.encode() for t in tokens]

    def _refusal(self, metadata) -> Reason | None:
        """None when the metadata carries one of the tokens, else why the call is refused."""
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if header is None:
            return Reason.MISSING_TOKEN
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return Reason.MALFORMED_TOKEN
        ok = False
        for t in self._tokens:  # compare against all, so timing reveals nothing
            ok |= hmac.compare_digest(t, token.encode())
        return None if ok else Reason.INVALID_TOKEN

    def intercept_service(self, continuation: Callable, handler_call_details):
        if handler_call_details.method.startswith(UNAUTHENTICATED_PREFIXES):
            return continuation(handler_call_details)
        reason = self._refusal(handler_call_details.invocation_metadata)
        if reason is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _denying(handler, reason)


def _denying(handler: grpc.RpcMethodHandler, reason: Reason) -> grpc.RpcMethodHandler:
    status = status_for(UnauthenticatedError(
        "missing or invalid bearer token (metadata 'authorization: Bearer <token>')",
        reason=reason))

    def deny(request_or_iterator, context):
        context.abort_with_status(status)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None  # set: clients must present a certificate signed by it (mTLS)

    def credentials(self) -> grpc.ServerCredentials:
        ca = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())], root_certificates=ca,
            require_client_auth=ca is not None)


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or wildcard: assume reachable from outside


class ExposureError(RuntimeError):
    pass


def check_exposure(address: str, *, tls: bool, token: bool, allow_insecure: bool) -> None:
    """Refuse to serve beyond loopback in plaintext without a token, unless told to."""
    if is_loopback(address) or tls or token:
        return
    if not allow_insecure:
        raise ExposureError(
            f"refusing to listen on {address} without TLS or a token: the shim can pause the "
            "engine and replace its weights. Pass --tls-cert/--tls-key and/or --token-file, or "
            "--insecure-listen to accept the risk.")
    log.warning("listening on %s WITHOUT TLS or token (--insecure-listen): anyone who reaches "
                "this port controls the engine's weights", address)
