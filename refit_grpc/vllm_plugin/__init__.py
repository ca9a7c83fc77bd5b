"""refit_grpc inside vLLM: a `gloo` weight-transfer backend for CPU engines.

vLLM loads `vllm.general_plugins` entry points in every process it starts (API server, EngineCore,
workers), before a worker builds its weight-transfer engine. `register()` (the entry point
`refit_grpc_gloo`, see pyproject.toml) adds the `gloo` backend to vLLM's factory by module path
only: the engine module, and with it torch.distributed and the rest of refit_grpc, is imported
only in a worker that vLLM started with `--weight-transfer-config '{"backend": "gloo"}'`.

`register()` is idempotent, never raises (a plugin that raises is logged by vLLM and skipped, but
there is no reason to make it try), and costs one dictionary lookup when vLLM is absent.

Only code that runs inside vLLM lives here. The trainer's side is the driver's (`Fleet.connect` and
`Fleet.refit`, with `refit_grpc.driver.nccl` for vLLM's own `nccl` backend); what the routes take is
`refit_grpc.wire.vllm`. Under NVIDIA Dynamo, `register()` also gives Dynamo's LoRA manager the
source of adapter epochs (`dynamo_lora`), and in vLLM's EngineCore process it wraps the loop's
`collective_rpc` for a staged flip in one turn of the loop (`engine_loop`).
"""

from __future__ import annotations

import logging
import sys

BACKEND = "gloo"
ENGINE_MODULE = "refit_grpc.vllm_plugin.engine"
ENGINE_CLASS = "RefitGlooWeightTransferEngine"

log = logging.getLogger("vllm.refit_grpc")  # under "vllm" so vLLM's log handlers print it


def register() -> None:
    """Register the `gloo` weight-transfer backend in vLLM's factory (entry point), and in
    Dynamo's worker the LoRA source of adapter epochs (`dynamo_lora`)."""
    if "vllm.v1.engine.core" in sys.modules:
        # The EngineCore process (vLLM loads plugins from EngineCore.__init__): a staged flip
        # in one turn of its loop (`engine_loop`).
        from refit_grpc.vllm_plugin.engine_loop import install

        install()
    if "dynamo.vllm" in sys.modules:  # Dynamo's worker process
        from refit_grpc.vllm_plugin.dynamo_lora import register_source

        register_source()
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as e:  # a vLLM without the native weight-transfer API (< 0.16)
        log.warning("refit_grpc: vLLM has no weight-transfer factory; %s not registered (%s)",
                    BACKEND, e)
        return
    if BACKEND in WeightTransferEngineFactory._registry:
        # Already ours (plugins load once per process, but a process may call this again), or a
        # future vLLM that ships its own "gloo": either way, keep what is there.
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError:  # lost a race with another registration of the same name
        pass
