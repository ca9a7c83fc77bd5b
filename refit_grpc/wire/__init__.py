"""What crosses into an engine: the typed bodies both ends build and parse, importable without
vLLM (`vllm.py`: vLLM's weight-transfer routes, the gloo backend's infos, vLLM's rank rule;
`dynamo.py`: Dynamo's RL routes; `worker.py`: what any engine's workers report back, a staged
receive's status and a failed update's applied marker). The shim's adapters, the driver, the
baselines and the code inside vLLM's workers all use these, so the two sides cannot drift
apart."""
