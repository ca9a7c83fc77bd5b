"""The worker side of a refit inside NVIDIA Dynamo: a vLLM worker extension.

    python -m dynamo.vllm --model DIR --enable-rl \\
        --worker-extension-cls refit_grpc.vllm_plugin.dynamo_extension.RefitGlooWorkerExtension

Dynamo's `{system_url}/engine/*` RL routes forward the weight-transfer calls to vLLM worker methods
named by `engine_rpc` (`collective_rpc(engine_rpc, kwargs=<the request body less Dynamo's own
keys>)`), with these defaults, which vLLM's workers do not have; this class provides them:

    init_weights_update_group       -> init_broadcaster(**init_info)       join the gloo group
    update_weights_from_distributed -> update_weights_from_path(**update)  start, receive, finish
    destroy_weights_update_group    -> destroy_broadcaster()               drop the group

The bodies are what the vLLM shim sends vLLM's own routes (`refit_grpc.wire.vllm.init_info_for`,
`update_info_for`, parsed here as `GlooInitInfo` / `GlooUpdateInfo`), and the work is the
project's gloo backend's: `layerwise.LayerwiseReceiver` (the group from
`refit_grpc.collective.Group.join`, the packed buckets of `refit_grpc.plan`, the receive loop
`refit_grpc.collective.receive`, vLLM's layerwise reload with rollback on failure,
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
plan, collective and wire), never gRPC or the shim.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from refit_grpc.wire.dynamo import INIT_TIMEOUT_DEFAULT_S, INIT_TIMEOUT_ENV, join_limit_s

log = logging.getLogger("vllm.refit_grpc")


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

        from refit_grpc.wire.vllm import GlooUpdateInfo, applied_marker

        update = GlooUpdateInfo(**update_info)
        receiver = self._refit_grpc_receiver()
        if not receiver.joined:
            raise RuntimeError("refit_grpc: no weight-update group; call "
                               "init_weights_update_group first")
        with set_current_vllm_config(self.vllm_config):
            receiver.model = self.model_runner.get_model()
            receiver.start()
            receiver.update(update)  # rolls back and raises with the applied marker on failure
            try:
                receiver.finish()
            except Exception as e:
                raise RuntimeError(f"{applied_marker(receiver.total, receiver.total)} the "
                                   f"reload failed to finalize ({type(e).__name__}: {e})") from e
        return dict(receiver.last_stats)

    def destroy_broadcaster(self, **_: Any) -> dict[str, Any]:
        receiver = getattr(self, "_refit_grpc_state", None)
        if receiver is not None:
            receiver.close()
        return {"destroyed": True}

    def _refit_grpc_receiver(self):
        from refit_grpc.vllm_plugin.layerwise import LayerwiseReceiver

        receiver = getattr(self, "_refit_grpc_state", None)
        if receiver is None:
            receiver = LayerwiseReceiver(self.model_runner.get_model(), self.model_config)
            self._refit_grpc_state = receiver
        return receiver
