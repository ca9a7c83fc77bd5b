"""Where a worker's shim is, and the gRPC channel to it."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from refit_grpc.common import MAX_MESSAGE_BYTES

# The shim's default listening port (`refit-grpc shim --address`, 127.0.0.1:50051).
DEFAULT_SHIM_PORT = 50051


@dataclass(frozen=True)
class WorkerEndpoint:
    """One engine's shim. Mirrors NeMo RL's `DynamoWorkerEndpoint(instance_id, system_url)`.

    Args:
        instance_id: the engine's name in failures and reports; unique in a fleet.
        address: the shim's gRPC target, e.g. "10.0.0.7:50051".
    """

    instance_id: str
    address: str  # gRPC target of the shim, e.g. "10.0.0.7:50051"

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *,
                      shim_port: int = DEFAULT_SHIM_PORT) -> WorkerEndpoint:
        """An endpoint from a worker's metadata: `instance_id` and `address` (or
        `grpc_address`); other keys are ignored.

        A record of Dynamo's RL discovery (`GET /v1/rl/workers`: `instance_id`, `system_url`,
        no address) names the worker, not its shim. It maps to the shim next to that worker:
        `shim_address` where the record carries one (an operator's mapping, as
        `refit_grpc.integrations.dynamo.ShimAddressing` adds), else the `system_url`'s host at
        `shim_port`.

        Args:
            metadata: the worker's record.
            shim_port: the shims' port on a `system_url`'s host (the shim's default, 50051,
                unless told otherwise).

        Returns:
            The endpoint of the worker's shim.

        Raises:
            ValueError: no instance_id, or no address and no usable `system_url`.
        """
        instance_id = metadata.get("instance_id")
        address = metadata.get("address") or metadata.get("grpc_address") \
            or metadata.get("shim_address")
        if not address and metadata.get("system_url"):
            address = shim_address_on_host(str(metadata["system_url"]), shim_port)
        if instance_id is None or str(instance_id) == "" or not address:
            raise ValueError("worker metadata needs instance_id and address (or a Dynamo "
                             f"system_url): {dict(metadata)!r}")
        return cls(str(instance_id), str(address))


def shim_address_on_host(system_url: str, shim_port: int) -> str:
    """`host:port` of a shim listening on the host of `system_url` (a Dynamo worker's)."""
    host = urllib.parse.urlsplit(system_url).hostname
    if not host:
        raise ValueError(f"system_url has no host: {system_url!r}")
    if not 0 < int(shim_port) < 65536:
        raise ValueError(f"shim port out of range: {shim_port}")
    return f"[{host}]:{int(shim_port)}" if ":" in host else f"{host}:{int(shim_port)}"


@dataclass(frozen=True)
class ChannelSecurity:
    """How the driver reaches shims: plaintext, TLS (optionally mutual) and/or a bearer token.

    Args:
        root_certificates: the CA (PEM) that shims' certificates chain to; set, TLS is used.
        private_key: the client key (PEM), for mutual TLS.
        certificate_chain: the client certificate chain (PEM), for mutual TLS.
        token: a bearer token sent with every call (the shims' `--token-file`).
        server_name: the TLS server name to check, when certificates name "shim" not an IP.
    """

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    token: str | None = None
    # Overrides the TLS server name to check, e.g. when certificates name "shim" not an IP.
    server_name: str | None = None

    @property
    def tls(self) -> bool:
        """TLS is used (a CA is set)."""
        return self.root_certificates is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata: the bearer token's `authorization` header, if any."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def _channel_options(self) -> list[tuple[str, int | str]]:
        """The project's message limits, reconnect backoff and keepalive (and the TLS name)."""
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Fail fast on a dead shim instead of waiting out the whole deadline.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            # Keepalive pings find a dead or partitioned peer in about 2 s, and after a
            # link comes back they replace the stalled TCP connection (whose own
            # retransmit backoff grows to minutes) instead of waiting on it.
            ("grpc.keepalive_time_ms", 1000),
            ("grpc.keepalive_timeout_ms", 1000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]
        if self.tls and self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key,
                                            self.certificate_chain)

    def open(self, address: str) -> grpc.Channel:
        """Open a blocking channel to a shim (the CLI's), with the project's message limits,
        reconnect backoff and keepalive.

        Args:
            address: the shim's gRPC target.

        Returns:
            A plaintext or TLS channel, as configured.
        """
        if not self.tls:
            return grpc.insecure_channel(address, options=self._channel_options())
        return grpc.secure_channel(address, self._credentials(), options=self._channel_options())

    def open_aio(self, address: str) -> grpc.aio.Channel:
        """Open an asyncio channel to a shim (the driver's), configured as `open()`'s. Call it
        on the event loop that will use the channel.

        Args:
            address: the shim's gRPC target.

        Returns:
            A plaintext or TLS grpc.aio channel.
        """
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=self._channel_options())
        return grpc.aio.secure_channel(address, self._credentials(),
                                       options=self._channel_options())
