"""RefitService: the shim's gRPC servicer around one engine. It translates each request into
calls and each result back into proto, and nothing more:

    core       `ShimCore`: the facts under one lock, the derived state, the one admission and
               release path (`shim/admission.py`'s table), a staged version's timer, Abort
    fields     what each request field may hold, proto to plan; `groups`: the groups a request
               asks the engine to join
    epoch      UpdateWeights: the epoch asked for, its checks, its run (`receive`: the thread)
    bundle     UpdateEngines, FlipEngines: several engines' UpdateWeights (one stream) or Flip
               (one call), for engines of this process sharing its rank
    flip       a staged version's load (Flip, and CatchUp once the peer's copy landed)
    catch_up   both ends of a peer's rendezvous; `canary`: checking and scoring a canary
    status     a `RefitError` as a gRPC status

Every handler is admitted through `ShimCore.admit_locked` (the state table in docs/protocol.md
is checked against `ADMISSIONS` by tests/test_state_machine.py), and one that runs a long
operation holds it with `ShimCore.hold_locked`, whose release ends it whatever happens. The
invariants this upholds are listed, numbered, in docs/protocol.md.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Iterator

from refit_grpc.common import MAX_REASON_CHARS, Deadline, PauseMode
from refit_grpc.dataplane.staging import STAGED_CHECKSUM
from refit_grpc.errors import FailedPreconditionError
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.reasons import Reason
from refit_grpc.shim import bundle, catch_up, epoch, flip, groups
from refit_grpc.shim.admission import Busy
from refit_grpc.shim.config import ShimConfig
from refit_grpc.shim.core import ShimCore, StagedVersion, State
from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.fields import (
    check_digest_shape,
    check_instance_id,
    check_version,
    packing_pb,
    pause_mode,
    plan_from_request,
    printable,
)
from refit_grpc.shim.status import status_on_error

log = logging.getLogger(__name__)


class RefitServicer(pb_grpc.RefitServiceServicer):
    def __init__(self, engine: Engine, config: ShimConfig | None = None):
        self.engine = engine
        self.config = config or ShimConfig()
        self._core = ShimCore(engine, self.config)
        self._networks = [ipaddress.ip_network(n) for n in self.config.allowed_master_networks]
        # The shim's own listening ports (gRPC, metrics), never a rendezvous (set by ShimServer).
        self.own_ports: frozenset[int] = frozenset()
        # The engines of this process that share its receiving rank, by instance id, itself
        # included: those an UpdateEngines stream may name (`share_stream_with`).
        self.rank_peers: dict[str, RefitServicer] = {self.config.instance_id: self}

    def share_stream_with(self, peers: dict[str, RefitServicer]) -> None:
        """The engines of this process that share its receiving rank (`refit-grpc shim
        --engines K` gives every engine the same map, before any server starts): an
        UpdateEngines stream to any of them may run any of their epochs."""
        self.rank_peers = peers

    # --- what the server and the metrics read ------------------------------------------------

    def state(self) -> State:
        return self._core.state()

    def drain(self, grace_s: float) -> bool:
        """Refuse new work; wait up to `grace_s` for a running epoch or join. True if idle."""
        return self._core.drain(grace_s)

    def abort_all(self, reason: str) -> None:
        self._core.abort(reason)

    @property
    def weight_version(self) -> int:
        return self._core.version

    @property
    def last_canary(self) -> tuple[int, float]:
        """(version, max_abs_gap) of the last canary; (0, -1.0) when none ran."""
        with self._core.lock:
            return self._core.last_canary

    @property
    def staging(self) -> tuple[int, float]:
        """(the version staged and waiting for its flip, 0 when none; the last flip's stall in
        seconds, 0.0 before any)."""
        core = self._core
        with core.lock:
            return (core.staged.version if core.staged else 0), core.last_stall_s

    # --- RPCs ------------------------------------------------------------------------------

    def Describe(self, request, context):
        with status_on_error(context):
            status = self.engine.status(with_digest=not request.skip_weights_digest)
            copy, core = self.engine.committed_copy, self._core
            previous = self.engine.previous_copy
            with core.lock:
                core.admit_locked("Describe")
                peer = core.catch_up
                catching_up = peer if peer and not peer.serving else None
                return pb.DescribeResponse(
                    instance_id=self.config.instance_id, engine_kind=self.engine.kind,
                    engine_world_size=self.engine.world_size, state=core.state_locked(),
                    weight_version=core.version,
                    plan_digest=core.plan.digest if core.plan else "",
                    group_id=core.group.group_id if core.group else "",
                    packing=packing_pb(self.engine.offered_packing),
                    last_error=core.last_error, weights_digest=status.weights_digest,
                    paused=status.paused, engine_healthy=status.healthy,
                    rank_offset=core.group.rank if core.group else -1,
                    last_canary_version=core.last_canary[0],
                    last_canary_gap=core.last_canary[1],
                    staged_version=core.staged.version if core.staged else 0,
                    staged_digest=core.staged.digest if core.staged else "",
                    staging_bytes=self.engine.staging_bytes,
                    last_stall_seconds=core.last_stall_s,
                    committed_copy_version=copy[0] if copy else 0,
                    committed_copy_digest=copy[1] if copy else "",
                    serving_catch_up_to=peer.other if peer and peer.serving else "",
                    catching_up_from=catching_up.other if catching_up else "",
                    catch_up_bytes_received=catching_up.bytes_received if catching_up else 0,
                    previous_copy_version=previous[0] if previous else 0,
                    previous_copy_digest=previous[1] if previous else "",
                    quantization=self.engine.quantization,
                    shared_rank=self.engine.shared_rank,
                    staged_checksum=STAGED_CHECKSUM,
                    adapters=[pb.AdapterVersion(name=name, version=version)
                              for name, version in sorted(self.engine.adapters.items())])

    def Prepare(self, request, context):
        with status_on_error(context):
            plan = plan_from_request(request, self.config.max_plan_tensors)
            plan.validate(self.config.max_plan_bytes, self.config.max_plan_tensors)
            if plan.adapter is not None and not self.engine.capabilities.adapters:
                raise FailedPreconditionError(
                    f"the {self.engine.kind} engine serves no LoRA adapters: adapter "
                    f"{plan.adapter.name!r} refused", reason=Reason.ADAPTER_UNSUPPORTED)
            self.engine.check_plan(plan)
            core = self._core
            with core.lock:
                core.admit_locked("Prepare")
                if core.staged is not None and core.plan is not None \
                        and core.plan.digest != plan.digest:
                    raise FailedPreconditionError(
                        f"Prepare of another plan refused: version {core.staged.version} is "
                        "staged under the current one (Flip it, or Abort to drop it)",
                        reason=Reason.WRONG_STATE)
                if core.plan is None or core.plan.digest != plan.digest:
                    # A new plan invalidates the group, which was formed against the old digest.
                    core.drop_group_locked()
                    core.plan = plan
            log.info("prepared plan %s: %d tensors, %d bytes, %d buckets", plan.digest[:12],
                     len(plan.tensors), plan.total_bytes, len(plan.buckets))
            return pb.PrepareResponse(plan_digest=plan.digest, total_bytes=plan.total_bytes,
                                      bucket_count=len(plan.buckets),
                                      packing=packing_pb(plan.packing))

    def InitCollective(self, request, context) -> Iterator:
        t0 = time.monotonic()
        with status_on_error(context):
            deadline = self._deadline(context, self.config.max_join_s)
            spec = groups.data_group(request, self.engine, self._networks, self.own_ports)
            core = self._core
            with core.lock:
                core.admit_locked("InitCollective")
                plan = core.check_digest_locked(request.plan_digest)
                core.drop_group_locked()
                core.join_deadline = deadline
                joining = core.hold_locked("InitCollective")
            context.add_callback(deadline.cancel.set)  # a caller that goes away cancels the join
            with joining:
                try:
                    yield pb.InitCollectiveResponse(phase=pb.INIT_COLLECTIVE_PHASE_ACCEPTED,
                                                    seconds=time.monotonic() - t0)
                    self.engine.init_transfer(spec, plan, deadline)
                    with core.lock:
                        deadline.check("InitCollective")  # an Abort during the join wins
                        core.group = spec
                    log.info("joined group %s as rank %d/%d", spec.group_id, spec.rank,
                             spec.world_size)
                except BaseException:
                    self.engine.abort_transfer()
                    raise
            yield pb.InitCollectiveResponse(phase=pb.INIT_COLLECTIVE_PHASE_JOINED,
                                            seconds=time.monotonic() - t0)

    def UpdateWeights(self, request, context) -> Iterator:
        t0 = time.monotonic()
        core = self._core
        with status_on_error(context, core.record_error):
            deadline = self._deadline(context, self.config.max_epoch_s)
            asked, mode = epoch.epoch_from_request(core, request, deadline)
            with core.lock:
                core.admit_locked("UpdateWeights", request.instance_id, request.version)
                plan = epoch.check_epoch_locked(core, request, asked)
                core.epoch = asked
                receiving = core.hold_locked("UpdateWeights")
            # A caller that goes away (trainer crash) cancels the receive; the deadline is the
            # watchdog that ends it even when no cancellation ever arrives.
            context.add_callback(asked.deadline.cancel.set)
            yield from epoch.run_epoch(core, asked, plan, mode, receiving, t0)

    def UpdateEngines(self, request, context) -> Iterator:
        # Every engine named is checked before any epoch starts: a bad name changes nothing.
        with status_on_error(context):
            with self._core.lock:
                self._core.admit_locked("UpdateEngines")
            asked = bundle.engines_asked("UpdateEngines", request.engines, self.rank_peers)
        yield from bundle.run_engines(asked, context)

    def FlipEngines(self, request, context):
        # As UpdateEngines: every engine named is checked before any flips.
        with status_on_error(context):
            with self._core.lock:
                self._core.admit_locked("FlipEngines")
            asked = bundle.engines_asked("FlipEngines", request.engines, self.rank_peers)
            return bundle.flip_engines(asked, context)

    def Flip(self, request, context):
        """Switch a STAGED engine to its staged version: pause, load the staged copy, (canary,)
        clear the caches unless asked to keep them, resume (`flip`). Refusals change nothing,
        but a digest other than the staged one drops the copy: those bytes are not what the
        trainer sent."""
        core = self._core
        with status_on_error(context, core.record_error):
            deadline = self._deadline(context, self.config.max_epoch_s)
            check_version(request.version, "version")
            check_digest_shape(request.staged_digest, "staged_digest")
            check_instance_id(request.instance_id, "instance_id")
            mode = pause_mode(request.pause_mode, PauseMode.KEEP)
            flip.check_keep_cache(core.engine, request.keep_cache, mode)
            with core.lock:
                core.admit_locked("Flip", request.instance_id)
                staged, matches = flip.take_staged_locked(core, request)
                if matches:
                    flipping = core.hold_locked("Flip")
            if not matches:
                raise flip.refuse_mismatch(core, staged, request.staged_digest)
            with flipping:
                done = flip.load(core, staged, mode, request.stay_paused, deadline,
                                 keep_cache=request.keep_cache)
            done.state = core.state()
            return done

    def Rollback(self, request, context):
        """Put the engine back on its previous copy's version (`flip.roll_back`): refusals
        change nothing."""
        core = self._core
        with status_on_error(context, core.record_error):
            deadline = self._deadline(context, self.config.max_epoch_s)
            check_version(request.version, "version")
            if request.to_version:
                check_version(request.to_version, "to_version")
            check_instance_id(request.instance_id, "instance_id")
            mode = pause_mode(request.pause_mode, PauseMode.KEEP)
            with core.lock:
                core.admit_locked("Rollback", request.instance_id)
                flip.check_rollback_locked(core, request)
                rolling = core.hold_locked("Rollback")
            with rolling:
                done = flip.roll_back(core, request, mode, deadline)
            done.state = core.state()
            return done

    # --- catch-up from a peer (docs/protocol.md, "Catch-up from a peer") ----------------------

    def ServeCatchUp(self, request, context) -> Iterator:
        """Send this engine's committed copy to one engine catching up: host a two-rank
        rendezvous, say where (LISTENING), broadcast the copy, end with SENT. The engine keeps
        serving; no epoch, join or flip runs meanwhile (BUSY), so the copy cannot change."""
        t0 = time.monotonic()
        core = self._core
        with status_on_error(context, core.record_error):
            deadline = self._deadline(context, self.config.max_epoch_s)
            world = groups.serve_world(request, self.engine, self._networks)
            target = request.target_instance_id or "an engine catching up"
            with core.lock:
                core.admit_locked("ServeCatchUp", request.instance_id)
                plan = core.check_digest_locked(request.plan_digest)
                held = self.engine.committed_copy
                if held != (request.version, request.staged_digest):
                    have = f"version {held[0]} ({held[1][:16]})" if held else "none"
                    raise FailedPreconditionError(
                        f"asked to serve version {request.version} "
                        f"({request.staged_digest[:16]}); this engine's committed copy: {have}",
                        reason=Reason.PEER_COPY_MISMATCH)
                core.catch_up = catch_up.CatchUp(deadline, serving=True, other=target)
                serving = core.hold_locked("ServeCatchUp")
            context.add_callback(deadline.cancel.set)  # the driver going away ends the serve
            with serving:
                server = catch_up.CopyServer(self.engine, request.listen_address, world,
                                             request.group_id, deadline)
                log.info("serving version %d to %s: rendezvous at %s:%d", request.version,
                         target, request.listen_address, server.port)
                yield pb.ServeCatchUpResponse(phase=pb.SERVE_CATCH_UP_PHASE_LISTENING,
                                              master_port=server.port,
                                              seconds=time.monotonic() - t0)
                server.serve()
                del server  # closes the rendezvous: the newcomer has every byte
                log.info("served version %d to %s: %d bytes, %.3fs", request.version, target,
                         plan.total_bytes, time.monotonic() - t0)
                yield pb.ServeCatchUpResponse(phase=pb.SERVE_CATCH_UP_PHASE_SENT,
                                              bytes_sent=plan.total_bytes,
                                              seconds=time.monotonic() - t0)

    def CatchUp(self, request, context):
        """Receive a peer's committed copy into the staging copy (the peer's group, not the
        fleet's: this engine leaves its data group), check the staged digest, load it as a Flip
        does. Before the load nothing changes: a dead peer, a wrong digest or an Abort leave the
        engine as it was (serving what it had; a BROKEN one stays paused)."""
        t0 = time.monotonic()
        core = self._core
        with status_on_error(context, core.record_error):
            deadline = self._deadline(context, self.config.max_epoch_s)
            spec, mode = groups.catch_up_group(request, self.engine, self._networks,
                                               self.own_ports)
            peer = request.peer_instance_id or f"{request.master_address}:{request.master_port}"
            with core.lock:
                core.admit_locked("CatchUp", request.instance_id, request.version)
                plan = core.check_digest_locked(request.plan_digest)
                broken = not core.weights_intact
                # The fleet forms its group again with this engine once it caught up.
                core.drop_group_locked()
                record = core.catch_up = catch_up.CatchUp(deadline, serving=False, other=peer)
                catching_up = core.hold_locked("CatchUp")
            context.add_callback(deadline.cancel.set)
            with catching_up:
                digest, transfer_s = self._fetch_copy(request, spec, plan, record, peer, t0)
                # Once loading, nothing cancels it (a caller gone, an Abort): a load cut short
                # would leave partial weights. It has its deadline's time, and at least 10 s.
                done = flip.load(core, StagedVersion(request.version, digest, False, None, None),
                                 mode, False, Deadline(max(deadline.remaining(), 10.0)),
                                 resume_paused=broken)
            log.info("caught up to version %d from %s: %d bytes, transfer %.3fs, stall %.3fs",
                     request.version, peer, record.bytes_received, transfer_s,
                     done.stall_seconds)
            return pb.CatchUpResponse(
                version=request.version, state=core.state(),
                bytes_received=record.bytes_received, seconds=time.monotonic() - t0,
                transfer_seconds=transfer_s, stall_seconds=done.stall_seconds,
                load_seconds=done.load_seconds, weights_digest=done.weights_digest)

    def _fetch_copy(self, request, spec, plan, record, peer: str,
                    t0: float) -> tuple[str, float]:
        """The peer's copy staged and its digest checked (dropped on any failure); the staged
        digest and the transfer's seconds."""
        try:
            digest = catch_up.fetch_copy(self.engine, spec, plan, record, peer)
            transfer_s = time.monotonic() - t0
            if digest != request.staged_digest:
                raise FailedPreconditionError(
                    f"catch-up from peer {peer}: staged digest {digest[:16]} != the peer "
                    f"copy's {request.staged_digest[:16]}; nothing loaded",
                    reason=Reason.STAGED_DIGEST_MISMATCH)
        except BaseException:
            self.engine.drop_staged()
            raise
        return digest, transfer_s

    def Flush(self, request, context):
        core = self._core
        with status_on_error(context, core.record_error):
            deadline = self._deadline(context, self.config.max_control_s)
            mode = pause_mode(request.mode, PauseMode.WAIT)
            with core.lock:
                core.admit_locked("Flush")
            self.engine.pause(mode, deadline)
            cleared = epoch.clear_caches(self.engine, deadline)
            with core.lock:
                # Re-check: an epoch may have failed meanwhile; never resume partial weights.
                resume = core.weights_intact and core.epoch is None
            if resume:
                self.engine.resume(deadline)
            return pb.FlushResponse(cache_cleared=cleared, resumed=resume, state=core.state())

    def Abort(self, request, context):
        """Never refused: any reason is taken, the first MAX_REASON_CHARS characters kept
        (control characters escaped) for last_error and the log."""
        core = self._core
        with status_on_error(context):
            with core.lock:
                core.admit_locked("Abort")
            reason = printable(request.reason[:MAX_REASON_CHARS])
            if len(request.reason) > MAX_REASON_CHARS:
                reason += f"...({len(request.reason)} chars)"
            aborted = core.abort(reason or "Abort called", keep_staged=request.keep_staged)
            # The epoch's own handler finishes the transition; wait briefly so the answer is
            # final.
            end = time.monotonic() + 5.0
            while core.state() == pb.SHIM_STATE_RECEIVING and time.monotonic() < end:
                time.sleep(0.01)
            return pb.AbortResponse(state=core.state(), epoch_aborted=aborted is not None)

    def _deadline(self, context, cap_s: float) -> Deadline:
        remaining = context.time_remaining()
        seconds = cap_s if remaining is None else min(remaining, cap_s)
        return Deadline(seconds)


__all__ = ["Busy", "RefitServicer", "ShimConfig"]
