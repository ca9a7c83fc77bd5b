"""Catch-up from a peer: an engine that joins (new, restarted, or left behind) gets the fleet's
current version from a member's committed copy, not from the trainer (docs/protocol.md,
"Catch-up from a peer").

The peer hosts a two-rank rendezvous of its own (ServeCatchUp answers LISTENING with the port),
the engine catching up joins it (CatchUp), the peer broadcasts its committed copy bucket by
bucket, the newcomer stages it, checks the staged digest against the fleet's, and loads it as a
Flip does. The trainer only makes the two calls: none of the bytes pass through it, and its
data group is not involved, so it can keep training, and the rest of the fleet keeps serving.

Fencing: the fleet asks only a peer whose committed copy (Describe `committed_copy_version` /
`_digest`) is the version and staged digest of the fleet's last staged epoch; the peer refuses
any other (PEER_COPY_MISMATCH) and the newcomer refuses bytes with another digest
(STAGED_DIGEST_MISMATCH) before it loads anything.

`CatchUps` (what `Fleet.catch_up()` and `Fleet.catch_up_async()` use) chooses the peers, runs
each catch-up as a coroutine on the driver's I/O loop and applies the outcome to the fleet's
`Membership`;
`catch_up_from_peers` runs one catch-up against an ordered list of peers.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from refit_grpc.common import PauseMode
from refit_grpc.driver.calls import ShimCalls, WorkerLink
from refit_grpc.driver.failures import FleetError, WorkerFailure, failure_from_rpc
from refit_grpc.driver.membership import Membership, links
from refit_grpc.driver.plans import prepare_on
from refit_grpc.plan import RefitPlan
from refit_grpc.proto import PAUSE_MODE_TO_PROTO, pb
from refit_grpc.reasons import Reason

log = logging.getLogger(__name__)


class CatchUpError(FleetError):
    """An engine could not catch up from any peer (CATCH_UP_FAILED: each peer tried is named
    with its cause, root causes first) or no member holds the fleet's version
    (NO_CATCH_UP_PEER). The engine is as it was; the next epoch brings it to the fleet's
    version."""

    default_reason = Reason.CATCH_UP_FAILED


@dataclass(frozen=True)
class CatchUpReport:
    """One catch-up that succeeded.

    Args:
        instance_id: the engine that caught up.
        peer: the member whose committed copy it received.
        version: the version it serves now.
        bytes: bytes received.
        seconds: the whole catch-up as the driver saw it (peers that failed first included).
        transfer_seconds: the transfer as the engine catching up saw it (its request to every
            bucket staged and the digest checked: the rendezvous included, the load not).
        stall_seconds: how long the engine stopped generating for the load.
        failed_peers: peers tried before, each with why it could not serve.
    """

    instance_id: str
    peer: str
    version: int
    bytes: int
    seconds: float
    transfer_seconds: float
    stall_seconds: float
    failed_peers: tuple[WorkerFailure, ...] = ()


def listen_address(address: str) -> str:
    """The IP address of a shim's gRPC target ("host:port"), which its ServeCatchUp listens
    at: the address this driver reaches the peer by, so the newcomer, on the same network,
    reaches it there too."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)


async def catch_up_from_peers(target: WorkerLink, peers: Sequence[WorkerLink], *, version: int,
                              staged_digest: str, plan: RefitPlan, target_world_size: int,
                              target_instance: str, timeout_s: float,
                              pause_mode: PauseMode = PauseMode.KEEP) -> CatchUpReport:
    """Catch `target` up to `version` from the first of `peers` that serves it (a coroutine
    on the driver's I/O loop, where the links' calls run).

    Args:
        target: the engine catching up (prepared with `plan`).
        peers: members holding `version` with `staged_digest` in their committed copy, in the
            order to try them.
        version, staged_digest: the fleet's version and its staged digest.
        plan: the fleet's plan.
        target_world_size: the target's ranks (Describe `engine_world_size`).
        target_instance: the target's instance id as Describe says it now (a restart since
            makes its CatchUp refuse: MEMBERSHIP_CHANGED).
        timeout_s: each attempt's deadline.
        pause_mode: how the target pauses its requests for the load.

    Returns:
        The report of the attempt that succeeded.

    Raises:
        CatchUpError: every peer failed (each named, with the target's own failure if it had
            one), or the target refused on its own (then no other peer is tried).
    """
    t0 = time.monotonic()
    failed: list[WorkerFailure] = []
    for peer in peers:
        try:
            answer = await _attempt(target, peer, version=version, staged_digest=staged_digest,
                                    plan=plan, world_size=1 + target_world_size,
                                    target_instance=target_instance, timeout_s=timeout_s,
                                    pause_mode=pause_mode)
        except _AttemptFailed as e:
            failed.extend(e.failures)
            if not e.peer_to_blame:
                break  # the target itself refused or failed: another peer would not help
            log.warning("catch-up of %s from %s failed (%s); %s", target.endpoint.instance_id,
                        peer.endpoint.instance_id, "; ".join(map(str, e.failures)),
                        "trying the next peer" if peer is not peers[-1] else "no peer left")
            continue
        log.info("%s caught up to version %d from %s: %d bytes, transfer %.3fs, stall %.3fs",
                 target.endpoint.instance_id, version, peer.endpoint.instance_id,
                 answer.bytes_received, answer.transfer_seconds, answer.stall_seconds)
        return CatchUpReport(target.endpoint.instance_id, peer.endpoint.instance_id, version,
                             answer.bytes_received, time.monotonic() - t0,
                             answer.transfer_seconds, answer.stall_seconds, tuple(failed))
    raise CatchUpError(f"{target.endpoint.instance_id} could not catch up to version {version} "
                       f"from {len(peers)} peer(s); it stays as it was, the next epoch brings it "
                       "to the fleet's version", failed)


class _AttemptFailed(Exception):
    def __init__(self, failures: list[WorkerFailure], peer_to_blame: bool):
        self.failures = failures
        self.peer_to_blame = peer_to_blame


async def _attempt(target: WorkerLink, peer: WorkerLink, *, version: int, staged_digest: str,
                   plan: RefitPlan, world_size: int, target_instance: str, timeout_s: float,
                   pause_mode: PauseMode) -> pb.CatchUpResponse:
    """One catch-up from one peer: its LISTENING, the target's CatchUp, the peer's SENT."""
    group_id = f"catchup-{uuid.uuid4().hex[:12]}"
    address = listen_address(peer.endpoint.address)
    serve, listening = await _serve(peer, pb.ServeCatchUpRequest(
        version=version, staged_digest=staged_digest, plan_digest=plan.digest,
        listen_address=address, group_id=group_id, target_instance_id=target_instance,
        world_size=world_size), timeout_s)
    # The target's CatchUp runs as a task of its own while the peer's stream is read here.
    target_call = asyncio.ensure_future(target.stub.CatchUp(pb.CatchUpRequest(
        version=version, staged_digest=staged_digest, plan_digest=plan.digest,
        master_address=address, master_port=listening.master_port, group_id=group_id,
        instance_id=target_instance, peer_instance_id=peer.endpoint.instance_id,
        pause_mode=PAUSE_MODE_TO_PROTO[pause_mode]), timeout=timeout_s,
        metadata=target.metadata))
    peer_failure: WorkerFailure | None = None
    target_failed = False

    def on_target_done(t: asyncio.Future) -> None:
        nonlocal target_failed
        if not t.cancelled() and t.exception() is not None:
            # The peer would otherwise wait for a newcomer that is not coming, up to its deadline.
            target_failed = True
            serve.cancel()

    target_call.add_done_callback(on_target_done)
    try:
        # read(), as `_serve` began: grpc.aio does not mix it with `async for` on one call.
        while await serve.read() is not grpc.aio.EOF:  # to SENT
            pass
    except grpc.RpcError as e:
        if not target_failed:
            # The target notices on its own, at once (its receive or rendezvous fails on the
            # dead peer's sockets), and says so with its reason: its answer is awaited below.
            peer_failure = failure_from_rpc(peer.endpoint, e)
    except asyncio.CancelledError:
        if not target_failed:
            target_call.cancel()
            raise  # this catch-up itself was cancelled (the fleet closed)
    try:
        answer = await target_call
    except grpc.RpcError as e:
        serve.cancel()
        if peer_failure is None:
            # The target may notice a dead peer (its sockets reset) before the peer's own
            # stream says so, and its failure cancels that stream: ask the peer directly.
            peer_failure = await _peer_gone(peer)
        await _await_serve_end(peer, timeout_s)
        mine = failure_from_rpc(target.endpoint, e)
        if peer_failure is not None:
            # The peer died or failed mid-transfer: the root cause, named first; the target's
            # own report (COLLECTIVE_FAILED, naming the peer) follows.
            raise _AttemptFailed([peer_failure, mine], True) from e
        # The transfer broke on the way, or other bytes arrived: another peer may do; any other
        # failure is the target's own, which no peer would change.
        raise _AttemptFailed([mine], mine.reason in _TRY_ANOTHER_PEER) from e
    if peer_failure is not None:
        # The target has it all and checked the digest; the peer's stream failed afterwards.
        log.warning("catch-up done, but the peer's stream ended with %s", peer_failure)
    return answer


async def _serve(peer: WorkerLink, request: pb.ServeCatchUpRequest, timeout_s: float
                 ) -> tuple[Any, pb.ServeCatchUpResponse]:
    """The peer's ServeCatchUp stream, and its first message (LISTENING, with the port)."""
    serve: Any = peer.stub.ServeCatchUp(request, timeout=timeout_s, metadata=peer.metadata)
    try:
        first = await serve.read()
    except grpc.RpcError as e:
        raise _AttemptFailed([failure_from_rpc(peer.endpoint, e)], True) from e
    if first is grpc.aio.EOF:
        raise _AttemptFailed([WorkerFailure(
            peer.endpoint.instance_id, peer.endpoint.address, grpc.StatusCode.INTERNAL,
            Reason.DRIVER_ERROR, "ServeCatchUp ended before LISTENING")], True)
    return serve, first


async def _peer_gone(peer: WorkerLink) -> WorkerFailure | None:
    """Why the peer does not answer (dead, frozen), or None when it does: one Describe, as
    bounded as an abort."""
    try:
        await peer.stub.Describe(pb.DescribeRequest(skip_weights_digest=True), timeout=1.0,
                                 metadata=peer.metadata)
    except grpc.RpcError as e:
        return failure_from_rpc(peer.endpoint, e)
    return None


async def _await_serve_end(peer: WorkerLink, timeout_s: float) -> None:
    """Until the peer's ServeCatchUp has ended on its side too (Describe), at most a few
    seconds: a cancelled stream ends at once here but its handler a moment later (it notices
    within 20 ms), and the peer refuses every epoch, join and Prepare until then (BUSY). A
    caller that goes on to the next epoch must not find it busy with a catch-up it gave up."""
    end = time.monotonic() + min(timeout_s, 5.0)
    while time.monotonic() < end:
        try:
            d = await peer.stub.Describe(pb.DescribeRequest(skip_weights_digest=True),
                                         timeout=1.0, metadata=peer.metadata)
        except grpc.RpcError:
            return  # gone or not answering: nothing to wait for
        if not d.serving_catch_up_to:
            return
        await asyncio.sleep(0.02)
    log.warning("%s still serves a catch-up %.0fs after it was cancelled",
                peer.endpoint.instance_id, min(timeout_s, 5.0))


# The target's failures after which another peer may succeed: the transfer broke (the peer's
# end went away, timed out) or the bytes that landed were not the copy's.
_TRY_ANOTHER_PEER = {Reason.COLLECTIVE_FAILED, Reason.GROUP_CLOSED, Reason.RENDEZVOUS_FAILED,
                     Reason.RENDEZVOUS_TIMEOUT, Reason.RECEIVE_FAILED, Reason.DEADLINE_EXCEEDED,
                     Reason.STAGED_DIGEST_MISMATCH}



class CatchUps:
    """The fleet's catch-ups: run on the driver's I/O loop, applied to the membership when
    settled (`settle()`, which every epoch runs first: a peer cannot take the next version into
    its copy while it serves this one).

    Args:
        calls: the calls to the shims.
        membership: the shims; a catch-up that succeeded changes it.
    """

    def __init__(self, calls: ShimCalls, membership: Membership):
        self.calls = calls
        self.membership = membership
        self._pending: list[Future[CatchUpReport]] = []

    def start(self, instance_id: str, plan: RefitPlan, committed: tuple[int, str] | None, *,
              latest: int, timeout_s: float, pause_mode: PauseMode) -> Future[CatchUpReport]:
        """Start catching `instance_id` up to `committed` (the fleet's version and staged
        digest, as its members' committed copies hold it; None: none does): prepare it,
        choose the members that hold that copy and are idle, and run `catch_up_from_peers`
        on the pool (`Fleet.catch_up_async()` documents it).

        Raises:
            CatchUpError: NO_CATCH_UP_PEER, at once.
        """
        target = self.membership.find(instance_id)
        if committed is None:
            raise CatchUpError(f"no member holds the fleet's version {latest} in a committed "
                               "copy (the last epoch was in place, or none flipped yet); the "
                               "next epoch brings the worker to it", [],
                               reason=Reason.NO_CATCH_UP_PEER)
        version, digest = committed
        prepare_on(self.calls, plan, [target.link])
        quick = pb.DescribeRequest(skip_weights_digest=True)
        (about,) = self.calls.all("Describe", [target.link], lambda w: quick,
                                  "Describe of the worker catching up failed")
        candidates = [m for m in self.membership.members if m is not target]
        answers = self.calls.each("Describe", links(candidates), lambda w: quick)
        peers = [m.link for m, a in zip(candidates, answers)
                 if isinstance(a, pb.DescribeResponse)
                 and (a.committed_copy_version, a.committed_copy_digest) == (version, digest)
                 and a.state in (pb.SHIM_STATE_READY, pb.SHIM_STATE_PREPARED)
                 and not a.serving_catch_up_to]
        if not peers:
            raise CatchUpError(f"no member holds version {version} ({digest[:16]}) in its "
                               "committed copy, or every one that does is busy; the next epoch "
                               "brings the worker to it", [], reason=Reason.NO_CATCH_UP_PEER)
        future = self.calls.submit(catch_up_from_peers(
            target.link, peers, version=version, staged_digest=digest,
            plan=plan, target_world_size=max(about.engine_world_size, 1),
            target_instance=about.instance_id, timeout_s=timeout_s, pause_mode=pause_mode))
        self._pending.append(future)
        return future

    def settle(self) -> None:
        """Wait for the catch-ups under way; each that succeeded changes the membership
        (`Membership.caught_up`). A failed one is the caller's news (its future's error)."""
        pending, self._pending = self._pending, []
        for future in pending:
            try:
                report = future.result()
            except CatchUpError as e:
                log.warning("a catch-up failed, the next epoch brings its worker up: %s", e)
                continue
            self.membership.caught_up(report.instance_id)

    def close(self) -> None:
        """Cancel the catch-ups under way (the fleet is closing); their shims see the caller
        go away."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.cancel()


__all__ = ["CatchUpError", "CatchUpReport", "CatchUps", "catch_up_from_peers", "listen_address"]
