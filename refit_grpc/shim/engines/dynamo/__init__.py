"""The Dynamo engine behind a shim: one NVIDIA Dynamo vLLM worker, driven through its
`{system_url}/engine/*` RL routes (`adapter.py`); the bodies are `refit_grpc.dynamo_info`'s, the
HTTP client is the vLLM engine's (`refit_grpc.shim.engines.vllm.http`)."""

from refit_grpc.shim.engines.dynamo.adapter import DynamoEngine, dynamo_error

__all__ = ["DynamoEngine", "dynamo_error"]
