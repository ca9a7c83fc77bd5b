"""The Dynamo engine behind a shim: one NVIDIA Dynamo vLLM worker, driven through its
`{system_url}/engine/*` RL routes (`adapter.py`, on the shared
`refit_grpc.shim.engines.http_engine.HttpEngine`); the bodies are `refit_grpc.wire.dynamo`'s."""

from refit_grpc.shim.engines.dynamo.adapter import DynamoEngine, DynamoOptions, dynamo_error

__all__ = ["DynamoEngine", "DynamoOptions", "dynamo_error"]
