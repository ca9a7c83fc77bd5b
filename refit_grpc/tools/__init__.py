"""Runnable tools built on the core package, never imported by it: `refit-grpc demo`,
`refit-grpc bench` (with its HTTP-JSON baseline) and `make demo-vllm`."""
