"""Harnesses shared by the test suite, the demos and the benchmarks (never needed by a trainer or
a shim): free ports, real vLLM servers and the tiny models they serve."""
