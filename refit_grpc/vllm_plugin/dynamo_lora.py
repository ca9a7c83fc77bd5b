"""Adapter epochs under NVIDIA Dynamo: the LoRA source that lets Dynamo's LoRA route load an
adapter the workers hold in memory (docs/adapters.md, Dynamo).

Dynamo's `load_lora` route (`{system_url}/engine/load_lora`, with `--enable-lora` and
DYN_LORA_ENABLED) takes a source URI, which its LoRA manager resolves to a local path before it
hands vLLM a `LoRARequest` with that path (`dynamo.common.lora.LoRAManager.download_lora`):
`file://`, `s3://` and `hf://` are downloaded into its cache, and a scheme registered with
`register_custom_source` is resolved by that source. `HeldAdapterSource` resolves the project's
scheme (`wire.vllm.adapter_path`: `refit-grpc-adapter://<version>/<name>`) to that same path,
with no file behind it: the workers' loader (`vllm_plugin.adapters.install_loader`) builds the
adapter from the tensors an adapter epoch's commit left there. Nothing is written or read.

`register_source()` runs from the plugin's entry point (`vllm_plugin.register`), which vLLM
calls in Dynamo's worker process while it builds the engine's config, before any route serves;
it does nothing outside Dynamo or when DYN_LORA_ENABLED is not set (no LoRA manager then).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from refit_grpc.wire.dynamo import LORA_ENABLED_ENV
from refit_grpc.wire.vllm import ADAPTER_SCHEME, parse_adapter_path

log = logging.getLogger("vllm.refit_grpc")


class HeldAdapterSource:
    """A Dynamo LoRA source (`dynamo.common.lora.LoRASourceProtocol`) for adapters held in the
    workers' memory: a URI of the project's scheme is its own local path."""

    async def exists(self, lora_uri: str) -> bool:
        return parse_adapter_path(lora_uri) is not None

    async def download(self, lora_uri: str, dest_path: Path) -> Path:
        if parse_adapter_path(lora_uri) is None:
            raise ValueError(f"{lora_uri!r} is not an adapter URI of refit_grpc "
                             f"({ADAPTER_SCHEME}://<version>/<name>)")
        # Path() makes "scheme:/version/name" of it; the loader parses that form too.
        return Path(lora_uri)


def register_source() -> bool:
    """Register `HeldAdapterSource` for the project's scheme with Dynamo's LoRA manager, in
    Dynamo's worker process (where `dynamo.vllm` runs) with DYN_LORA_ENABLED set; True if it
    did. Never raises: a manager that cannot start is Dynamo's to report at its first LoRA
    call."""
    if "dynamo.vllm" not in sys.modules or not os.environ.get(LORA_ENABLED_ENV):
        return False
    try:
        from dynamo.common.lora import get_lora_manager

        manager = get_lora_manager()
        if manager is None:
            return False
        manager.register_custom_source(ADAPTER_SCHEME, HeldAdapterSource())
    except Exception as e:  # noqa: BLE001  (a plugin must not stop Dynamo's start)
        log.warning("refit_grpc: Dynamo's LoRA source for %s:// not registered (%s: %s)",
                    ADAPTER_SCHEME, type(e).__name__, e)
        return False
    log.info("refit_grpc: Dynamo's LoRA manager resolves %s:// from the workers' memory",
             ADAPTER_SCHEME)
    return True
