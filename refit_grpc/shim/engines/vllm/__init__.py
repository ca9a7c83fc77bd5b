"""The vLLM engine behind a shim: `adapter.py` (the Engine: vLLM's admin routes, on the shared
`refit_grpc.shim.engines.http_engine.HttpEngine`)."""

from refit_grpc.shim.engines.vllm.adapter import VLLMEngine, VLLMOptions

__all__ = ["VLLMEngine", "VLLMOptions"]
