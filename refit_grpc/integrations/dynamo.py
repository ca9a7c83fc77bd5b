"""NVIDIA Dynamo worker fleets: find the workers through Dynamo's RL discovery, map each to the
shim next to it, and re-read discovery before every epoch (NeMo RL's channel's membership check).

    discovery = DynamoDiscovery("http://frontend:8001", ShimAddressing(port=50051))
    fleet = discovery.fleet(engine_world_size=1, epoch_timeout_s=600)
    # == Fleet(discovery.endpoints(), validate_workers=discovery.validate_workers, ...)

Discovery: Dynamo's frontend, started with `DYN_ENABLE_RL=true`, answers
`GET {rl_url}/v1/rl/workers` on its RL listener (port `DYN_RL_PORT`, 8001 by default) with
`{"protocol_version": 1, "namespace", "workers": [{"instance_id": <u64>, "system_url",
"model", "routes", "world_size", "transport", ...}]}`; a worker restarted is a new `instance_id`.

Which shim serves which worker (decided here, docs/dynamo.md): a shim runs next to each worker
(`refit-grpc shim --engine dynamo --engine-url <system_url>`, the system_url on loopback), so a
record maps to
  1. the address the operator gave for it (`ShimAddressing.overrides`, keyed by the record's
     `instance_id` or its `system_url`), else
  2. the convention: the `system_url`'s host at the shim port (`ShimAddressing.port`, the shim's
     default 50051), i.e. one shim per worker host and port.
The endpoint's `instance_id` is Dynamo's (as a string), so the fleet's errors name the worker as
Dynamo does. The mapping also covers raw records: `WorkerEndpoint.from_metadata(record,
shim_port=...)` applies the convention.

Membership: `validate_workers` (the `Fleet` hook, called before every epoch) re-reads discovery
and returns the current workers in the fleet's order; a worker gone, restarted (a new
instance_id) or added makes it differ, and the fleet refuses the epoch (MEMBERSHIP_CHANGED)
before any byte moves. A worker that discovery still lists but cannot reach (Dynamo then gives
its record an `error` and no `system_url`) counts as changed; so does a discovery that cannot be
read (the fleet cannot tell).

Standard library HTTP only; every call has a timeout.
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from refit_grpc.driver.endpoint import DEFAULT_SHIM_PORT, WorkerEndpoint, shim_address_on_host
from refit_grpc.errors import (
    EngineUnavailableError,
    FailedPreconditionError,
    MembershipChangedError,
    RefitError,
)
from refit_grpc.reasons import Reason
from refit_grpc.wire.dynamo import DISCOVERY_PATH, DISCOVERY_PROTOCOL_VERSION

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShimAddressing:
    """How a Dynamo worker's discovery record maps to its shim's gRPC address."""

    port: int = DEFAULT_SHIM_PORT
    # The operator's mapping: a record's instance_id (as a string) or system_url -> address.
    overrides: Mapping[str, str] = field(default_factory=dict)

    def address(self, record: Mapping[str, Any]) -> str:
        for key in (str(record.get("instance_id")), str(record.get("system_url", ""))):
            if key in self.overrides:
                return self.overrides[key]
        system_url = record.get("system_url")
        if not system_url:
            raise ValueError(f"Dynamo worker record has no system_url: {dict(record)!r}")
        return shim_address_on_host(str(system_url), self.port)

    def metadata(self, record: Mapping[str, Any]) -> dict[str, str]:
        """What the fleet compares between epochs: the worker and its shim."""
        return {"instance_id": str(record["instance_id"]), "address": self.address(record)}


def read_workers(rl_url: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """`GET {rl_url}/v1/rl/workers`: the worker records, in discovery's order. Raises
    EngineUnavailableError when discovery does not answer, FailedPreconditionError when it
    answers something else than protocol version 1."""
    parts = urllib.parse.urlsplit(rl_url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"discovery url must be http://host:port, got {rl_url!r}")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    try:
        conn.request("GET", parts.path.rstrip("/") + DISCOVERY_PATH,
                     headers={"Accept": "application/json", "Connection": "close"})
        resp = conn.getresponse()
        raw = resp.read()
    except (OSError, http.client.HTTPException) as e:
        raise EngineUnavailableError(f"Dynamo discovery at {rl_url} unreachable: "
                                     f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()
    if resp.status != 200:
        raise EngineUnavailableError(f"Dynamo discovery at {rl_url} answered HTTP {resp.status}: "
                                     f"{raw[:300]!r}")
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise FailedPreconditionError(f"Dynamo discovery at {rl_url}: not JSON: {raw[:300]!r}",
                                      reason=Reason.ENGINE_ERROR) from e
    version = body.get("protocol_version") if isinstance(body, dict) else None
    if version != DISCOVERY_PROTOCOL_VERSION or not isinstance(body.get("workers"), list):
        raise FailedPreconditionError(
            f"Dynamo discovery at {rl_url}: protocol_version {version!r}, this client reads "
            f"{DISCOVERY_PROTOCOL_VERSION}", reason=Reason.ENGINE_ERROR)
    records = body["workers"]
    for r in records:
        if not isinstance(r, dict) or r.get("instance_id") is None or \
                not (r.get("system_url") or r.get("error")):
            raise FailedPreconditionError(f"Dynamo discovery at {rl_url}: a worker record "
                                          f"without instance_id or system_url: {r!r}",
                                          reason=Reason.ENGINE_ERROR)
    return records


def reachable(record: Mapping[str, Any]) -> bool:
    """Whether discovery could reach the worker: a worker still registered but not answering
    (killed, frozen) is listed with an `error` ("Unavailable: TCP connection ... failed"), no
    `system_url` and no routes (measured with Dynamo 1.6.1 after a SIGKILL)."""
    return bool(record.get("system_url")) and not record.get("error")


class DynamoDiscovery:
    """Dynamo's RL discovery as the fleet's source of workers and its membership check."""

    def __init__(self, rl_url: str, addressing: ShimAddressing = ShimAddressing(), *,
                 timeout_s: float = 5.0,
                 select: Callable[[Mapping[str, Any]], bool] | None = None):
        self.rl_url = rl_url.rstrip("/")
        self.addressing = addressing
        self.timeout_s = timeout_s
        self.select = select  # e.g. one model: lambda r: r.get("model") == "policy"

    def records(self) -> list[dict[str, Any]]:
        records = read_workers(self.rl_url, self.timeout_s)
        return [r for r in records if self.select is None or self.select(r)]

    def endpoints(self) -> list[WorkerEndpoint]:
        """The shims of the workers discovery can reach now; a worker listed as unreachable is
        left out (and logged): it can neither join nor receive."""
        out = []
        for r in self.records():
            if not reachable(r):
                log.warning("Dynamo worker %s left out: %s", r.get("instance_id"),
                            r.get("error", "no system_url"))
                continue
            out.append(WorkerEndpoint.from_metadata(self.addressing.metadata(r)))
        return out

    def validate_workers(self, metadata: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The `Fleet` hook: the current workers, in the order of `metadata` (the fleet's), then
        any worker discovery lists that the fleet lacks. Equal to `metadata` exactly when the
        fleet is unchanged."""
        try:
            records = self.records()
        except RefitError as e:
            raise MembershipChangedError(f"membership unknown: {e.message}") from e
        current = {str(r["instance_id"]): self.addressing.metadata(r) if reachable(r) else
                   {"instance_id": str(r["instance_id"]), "address": None,
                    "gone": str(r.get("error", "no system_url"))} for r in records}
        out: list[dict[str, Any]] = []
        for m in metadata:
            now = current.pop(str(m.get("instance_id")), None)
            out.append(now if now is not None else
                       {"instance_id": str(m.get("instance_id")), "address": None,
                        "gone": "not in Dynamo's discovery"})
        return out + list(current.values())

    def fleet(self, **fleet_options: Any):
        """A `Fleet` of the workers discovery lists now, re-checked before every epoch."""
        from refit_grpc.driver import Fleet

        return Fleet(self.endpoints(), validate_workers=self.validate_workers, **fleet_options)


__all__ = ["DynamoDiscovery", "ShimAddressing", "read_workers", "reachable"]
