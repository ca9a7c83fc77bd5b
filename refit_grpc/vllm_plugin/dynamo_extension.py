"""The worker side of a refit inside NVIDIA Dynamo: a vLLM worker extension.

    python -m dynamo.vllm --model DIR --enable-rl \\
        --worker-extension-cls refit_grpc.vllm_plugin.dynamo_extension.RefitGlooWorkerExtension

Dynamo's `{system_url}/engine/*` RL routes forward the weight-transfer calls to vLLM worker methods
named by `engine_rpc` (`collective_rpc(engine_rpc, kwargs=<the request body less Dynamo's own
keys>)`), with these defaults, which vLLM's workers do not have; this class provides them:

    init_weights_update_group       -> init_broadcaster(**init_info)       join the gloo group
    update_weights_from_distributed -> update_weights_from_path(**update)  start, receive, finish
    destroy_weights_update_group    -> destroy_broadcaster()               drop the group

and, for a staged epoch (docs/dynamo.md, Staged epochs), through update_weights_from_distributed
with `allow_unpaused` (the engine keeps serving):

    refit_grpc_stage(status_key, **update)  start the staged receive beside the engine loop
                                            (`layerwise.LayerwiseReceiver.stage`, the vLLM
                                            backend's own), answer at once
    refit_grpc_drop_staged()                forget a pending copy, end a staged receive in
                                            flight (a committed copy stays)

and, for a catch-up served from this engine (docs/protocol.md, Catch-up from a peer):

    refit_grpc_serve(status_key, **serve)   the engine's rank-0 worker broadcasts its committed
                                            copy (the copy the last flip loaded) to the
                                            newcomer's group, on a thread of its own; the
                                            status goes to the catch-up's rendezvous store
    refit_grpc_cancel_serve()               end a serve in flight

and for a rollback (docs/protocol.md, Rollback):

    refit_grpc_restore_previous()           the previous copy (kept by a reversible epoch)
                                            becomes the staged copy; the flip then loads it

and for Describe:

    refit_grpc_engine_info(master_address, master_port, info_key)
                                            the worker's `wire.worker.WorkerInfo` (its
                                            quantization), published in the shim's store

Dynamo discards what a forwarded call returns, so a staged receive's progress, digest or error
(`wire.worker.StageStatus`) is published by a thread of this worker to the trainer's TCPStore
(the store the abort key already goes through), under `wire.dynamo.stage_status_key`. The flip
is an ordinary `update_weights_from_path` whose update_info says `source: "staged"`.

The bodies are what the vLLM shim sends vLLM's own routes (`refit_grpc.wire.vllm.init_info_for`,
`update_info_for`, parsed here as `GlooInitInfo` / `GlooUpdateInfo`), and the work is the
project's gloo backend's: `layerwise.LayerwiseReceiver` (the group from
`refit_grpc.dataplane.group.Group.join`, the packed buckets of `refit_grpc.plan`, the receive loop
`refit_grpc.dataplane.transfer.receive`, vLLM's layerwise reload with rollback on failure,
a tied output projection re-processed after the reload, and the abort key in the trainer's
TCPStore, polled during a receive). One update is one call here (Dynamo has no start and finish
routes), so a failure ends with the rollback and the `refit_grpc[applied=A/B]` marker in the
error, which Dynamo returns as `{"status": "error", "message": ...}`.

Deadlines: Dynamo shuts the whole worker down (`os._exit(1)`) when `init_weights_update_group`
outlives `DYN_RL_INIT_WEIGHTS_TIMEOUT_S` (30 s by default), so the join here is bounded below that
limit whatever the caller asked: it fails with a rendezvous timeout, and the worker lives on. An
update is bounded by its own `timeout_s` (the shim passes its epoch's deadline).

GPU engines: this extension speaks gloo (CPU tensors). On GPUs, vLLM 0.31's own NCCL path is
Dynamo's (`engine_rpc` naming vLLM's weight-transfer methods); see docs/dynamo.md.

Runs inside vLLM 0.31 in Dynamo's environment: imports only the project's pure layers (common,
plan, dataplane and wire), never gRPC or the shim.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from refit_grpc.wire.dynamo import (
    INIT_TIMEOUT_DEFAULT_S,
    INIT_TIMEOUT_ENV,
    LORA_ENABLED_ENV,
    LORA_HOTSWAP_ENV,
    engine_info_key,
    join_limit_s,
    serve_status_key,
    stage_status_key,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    import torch.distributed as dist

    from refit_grpc.vllm_plugin.adapters import AdapterProblem
    from refit_grpc.vllm_plugin.staged import StagedReceive
    from refit_grpc.wire.worker import StageStatus

log = logging.getLogger("vllm.refit_grpc")

# How often the publisher looks at the staged receive: PROGRESS at this granularity.
PUBLISH_POLL_S = 0.05
# A connect to the trainer's store, inside the start call (the engine loop waits for it).
STORE_CONNECT_S = 2.0


def dynamo_init_limit_s() -> float:
    """Dynamo's limit on `init_weights_update_group`, read as Dynamo reads it (the worker
    processes inherit the environment of the Dynamo process that started them)."""
    try:
        return float(os.environ.get(INIT_TIMEOUT_ENV, INIT_TIMEOUT_DEFAULT_S))
    except ValueError:
        return INIT_TIMEOUT_DEFAULT_S


class RefitGlooWorkerExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls`: every name here must be new to
    that class (vLLM checks), hence the prefixes on the helpers."""

    if TYPE_CHECKING:  # the vLLM worker's own attributes, which these methods use
        parallel_config: Any
        vllm_config: Any
        model_config: Any
        model_runner: Any

    def init_broadcaster(self, **init_info: Any) -> dict[str, Any]:
        from refit_grpc.vllm_plugin.layerwise import worker_rank
        from refit_grpc.wire.vllm import GlooInitInfo

        info = GlooInitInfo(**init_info)
        limit = join_limit_s(dynamo_init_limit_s())
        if info.timeout_s > limit:
            log.info("refit_grpc: join bounded at %.1fs (asked %.1fs) to end before %s",
                     limit, info.timeout_s, INIT_TIMEOUT_ENV)
        join_info = GlooInitInfo(**{**init_info, "timeout_s": min(info.timeout_s, limit)})
        receiver = self._refit_grpc_receiver()
        receiver.close()  # a new group replaces any old one (the shim re-forms after a failure)
        try:
            receiver.join(join_info, worker_rank(self.parallel_config, info.rank_offset))
        except TimeoutError as e:
            raise TimeoutError(f"{e} (the join is bounded at {limit:.1f}s, inside Dynamo's "
                               f"{INIT_TIMEOUT_ENV}={dynamo_init_limit_s():g}s)") from e
        # Later updates without their own timeout_s use the one the caller asked for.
        receiver.info = info
        return {"rank": receiver.rank, "world_size": info.world_size}

    def update_weights_from_path(self, **update_info: Any) -> dict[str, Any]:
        from vllm.config import set_current_vllm_config

        from refit_grpc.wire.vllm import SOURCE_STAGED, GlooUpdateInfo

        update = GlooUpdateInfo(**update_info)
        receiver = self._refit_grpc_receiver()
        # A staged epoch's flip reads the staged copy, not the group: a trainer gone after
        # STAGED (its group with it) does not stop it.
        if not receiver.joined and update.source != SOURCE_STAGED:
            raise RuntimeError("refit_grpc: no weight-update group; call "
                               "init_weights_update_group first")
        with set_current_vllm_config(self.vllm_config):
            receiver.model = self.model_runner.get_model()
            receiver.run_update(update)  # rolled back, the applied marker, on failure
        return dict(receiver.last_stats)

    def destroy_broadcaster(self, **_: Any) -> dict[str, Any]:
        receiver = getattr(self, "_refit_grpc_state", None)
        if receiver is not None:
            receiver.close()
        return {"destroyed": True}

    def refit_grpc_stage(self, status_key: str, **update_info: Any) -> dict[str, Any]:
        """Start the staged receive of a staged epoch; returns at once (the worker goes back to
        its engine loop while the bytes land in the staged copy). Its status is published under
        `stage_status_key(status_key, rank)` in the trainer's TCPStore until it ends."""
        from refit_grpc.wire.vllm import GlooUpdateInfo

        update = GlooUpdateInfo(**update_info)
        receiver = self._refit_grpc_receiver()
        if not receiver.joined or receiver.info is None:
            raise RuntimeError("refit_grpc: no weight-update group; call "
                               "init_weights_update_group first")
        # Connected before the receive starts: a store that cannot be reached fails this call
        # (the shim sees why) instead of a receive whose status nobody can read.
        store = _store_client(receiver.info.master_address, receiver.info.master_port)
        status = receiver.stage(update)
        _StatusPublisher(store, stage_status_key(status_key, status.rank), receiver.staged,
                         _stage_ended)
        return status.to_wire()

    def refit_grpc_serve(self, status_key: str, **serve_info: Any) -> dict[str, Any]:
        """Serve a catch-up from the committed copy (the engine's rank-0 worker; the others
        only answer); returns at once, the serve's status is published under
        `serve_status_key(status_key)` in the catch-up's rendezvous store until it ends."""
        from refit_grpc.vllm_plugin.layerwise import worker_rank
        from refit_grpc.wire.worker import ServeInfo

        info = ServeInfo(**serve_info)
        receiver = self._refit_grpc_receiver()
        if worker_rank(self.parallel_config, 0) != 0:
            return receiver.staged.status().to_wire()
        store = _store_client(info.master_address, info.master_port)
        status = receiver.serve(info, 0)
        _StatusPublisher(store, serve_status_key(status_key), receiver.staged, _serve_ended)
        return status.to_wire()

    def refit_grpc_cancel_serve(self, **_: Any) -> dict[str, Any]:
        receiver = getattr(self, "_refit_grpc_state", None)
        if receiver is None:
            return {"state": "idle"}
        return receiver.staged.cancel_serve().to_wire()

    def refit_grpc_engine_info(self, master_address: str, master_port: int, info_key: str,
                               **_: Any) -> dict[str, Any]:
        """What this worker says of its engine (`WorkerInfo`: vLLM's quantization method, as
        the vLLM backend's `engine_info` answers, and the adapters it built), published under
        `engine_info_key(info_key, rank)` in the store at `master_address:master_port` (the
        shim's: Dynamo discards what this returns)."""
        from refit_grpc.vllm_plugin.adapters import STORE
        from refit_grpc.vllm_plugin.layerwise import worker_rank
        from refit_grpc.wire.worker import NO_QUANTIZATION, WorkerInfo

        info = WorkerInfo(quantization=self.model_config.quantization or NO_QUANTIZATION,
                          multimodal=bool(self.model_config.is_multimodal_model),
                          adapters=STORE.versions())
        store = _store_client(master_address, int(master_port))
        store.set(engine_info_key(info_key, worker_rank(self.parallel_config, 0)),
                  json.dumps(info.to_wire()))
        return info.to_wire()

    def refit_grpc_check_adapter(self, master_address: str, master_port: int, info_key: str,
                                 **update_info: Any) -> dict[str, Any]:
        """Prepare of an adapter plan (docs/adapters.md, Dynamo): what vLLM would refuse when
        it builds the adapter (`adapters.check_plan`, as the vLLM backend's `check_adapter`),
        then what Dynamo's LoRA route needs (`dynamo_lora_problem`), published as an
        `AdapterProblem` under `engine_info_key(info_key, rank)` in the shim's store (an empty
        problem: it can serve it). Nothing is loaded."""
        from refit_grpc.plan import Packing
        from refit_grpc.vllm_plugin import adapters
        from refit_grpc.vllm_plugin.layerwise import worker_rank
        from refit_grpc.wire.vllm import GlooUpdateInfo

        plan = GlooUpdateInfo(**update_info).plan(Packing())
        problem = adapters.check_plan(self.vllm_config, self.model_runner.get_model(), plan)
        if not problem.message:
            problem = dynamo_lora_problem(os.environ) or problem
        answer = problem.to_wire()
        store = _store_client(master_address, int(master_port))
        store.set(engine_info_key(info_key, worker_rank(self.parallel_config, 0)),
                  json.dumps(answer))
        return answer

    def refit_grpc_commit_adapter(self, staged_digest: str, version: int,
                                  **_: Any) -> dict[str, Any]:
        """An adapter epoch's flip on this worker (`adapters.commit_staged`): the staged copy
        becomes the adapter's pending version in memory, which the LoRA route's load then
        builds through the project's loader (installed here, once per process). Answered when
        done; a failure is Dynamo's error answer."""
        from refit_grpc.vllm_plugin import adapters

        adapters.install_loader()
        return adapters.commit_staged(self._refit_grpc_receiver().staged, str(staged_digest),
                                      int(version)).to_wire()

    def refit_grpc_restore_previous(self, **_: Any) -> dict[str, Any]:
        """A rollback's first step (`staged.StagedReceive.restore_previous`); raises where no
        previous copy is kept, which Dynamo answers as an error."""
        return self._refit_grpc_receiver().staged.restore_previous().to_wire()

    def refit_grpc_drop_staged(self, **_: Any) -> dict[str, Any]:
        """Forget the staged copy and end a staged receive in flight (its publisher reports
        the receive idle, or failed if it was cancelled midway)."""
        receiver = getattr(self, "_refit_grpc_state", None)
        if receiver is None:
            return {"state": "idle"}
        return receiver.drop_staged().to_wire()

    def _refit_grpc_receiver(self):
        from refit_grpc.vllm_plugin.layerwise import LayerwiseReceiver

        receiver = getattr(self, "_refit_grpc_state", None)
        if receiver is None:
            receiver = LayerwiseReceiver(self.model_runner.get_model(), self.model_config)
            self._refit_grpc_state = receiver
        return receiver


def dynamo_lora_problem(environ: Mapping[str, str]) -> AdapterProblem | None:
    """What Dynamo's worker lacks for adapter epochs, from its environment (the worker's
    processes inherit it from the Dynamo process that serves the LoRA route): URI-based LoRA
    loading, through which the flip's load goes, and hot swap, without which Dynamo answers a
    later version "already loaded" and keeps serving the first."""
    from refit_grpc.reasons import Reason
    from refit_grpc.vllm_plugin.adapters import AdapterProblem

    for env, why in ((LORA_ENABLED_ENV, "its LoRA manager, through which the flip's load goes"),
                     (LORA_HOTSWAP_ENV, "hot swap: without it Dynamo keeps the first version "
                                        "of an adapter and answers the next ones 'already "
                                        "loaded'")):
        if environ.get(env, "").lower() not in ("1", "true", "yes"):  # Dynamo's env_bool
            return AdapterProblem(f"the Dynamo worker was not started with {env}=true: adapter "
                                  f"epochs need {why}", Reason.ADAPTER_UNSUPPORTED)
    return None


def _store_client(host: str, port: int) -> dist.Store:
    """A client of the trainer's TCPStore (the rendezvous master), bounded."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=STORE_CONNECT_S))


def _stage_ended(staged: StagedReceive, status: StageStatus) -> bool:
    """A staged receive ended (staged, failed or dropped)."""
    from refit_grpc.wire.worker import STAGE_RECEIVING

    return not staged.running and status.state != STAGE_RECEIVING


def _serve_ended(staged: StagedReceive, status: StageStatus) -> bool:
    """A serve of the committed copy ended (sent or failed)."""
    from refit_grpc.wire.worker import SERVE_RUNNING

    return status.serve_state != SERVE_RUNNING


class _StatusPublisher:
    """Publishes a worker's status (a staged receive's, or a serve's) to a store whenever it
    changes, until `ended` says it is final: the only way its progress reaches the shim
    through Dynamo, whose routes return fixed bodies."""

    def __init__(self, store: dist.Store, key: str, staged: StagedReceive,
                 ended: Callable[[StagedReceive, StageStatus], bool]):
        self._thread = threading.Thread(target=self._run, args=(store, key, staged, ended),
                                        daemon=True, name="refit-stage-status")
        self._thread.start()

    @staticmethod
    def _run(store: dist.Store, key: str, staged: StagedReceive,
             ended: Callable[[StagedReceive, StageStatus], bool]) -> None:
        import torch.distributed as dist

        last = None
        while True:
            status = staged.status()
            if status != last:
                try:
                    store.set(key, json.dumps(status.to_wire()))
                except (RuntimeError, dist.DistError) as e:
                    # The trainer (and its store) is gone: so is the sender, the receive fails
                    # by itself, and nobody is left to read the status.
                    log.warning("refit_grpc: staged status not published (%s)", e)
                    return
                last = status
            if ended(staged, status):  # what was just published is final
                return
            time.sleep(PUBLISH_POLL_S)
