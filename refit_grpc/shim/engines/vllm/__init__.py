"""The vLLM engine behind a shim: `adapter.py` (the Engine, vLLM's admin routes), `http.py` (the
cancellable HTTP client), `checkpoint.py` (the names vLLM loads, from its checkpoint)."""

from refit_grpc.shim.engines.vllm.adapter import VLLMEngine

__all__ = ["VLLMEngine"]
