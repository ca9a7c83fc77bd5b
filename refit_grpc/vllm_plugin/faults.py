"""Deliberate faults for the engine tests, never in production: refits that leave the old
quantization scales (docs/vllm.md, Quantized engines), and an adapter build that fails
(`FailingAdapterBuild`, docs/adapters.md).

With `STALE_SCALES_ENV=1` in an engine's environment, every layerwise session (a refit's load)
quantizes the new weights as usual and then puts back the scales each quantized layer had when
the session began: the new int8 or fp8 weights under the old scales. Every byte arrives, every
digest of the bytes agrees, and the engine computes something else: the bug the logprob canary
must catch (tests/test_vllm_quantized.py, tests/test_vllm_quantized_dense.py). Never in
production.

Covered: vLLM 0.32's online int8 experts (`Int8OnlineMoEMethod`, its `_quantize_weights`) and
fp8 per-channel linear layers (`Fp8PtpcOnlineLinearMethod`, its
`process_weights_after_loading`). The wrappers are set on the method instances for one session
and removed by `restore`, as `moe.ExpertsReprocessing` does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("vllm.refit_grpc")

STALE_SCALES_ENV = "REFIT_GRPC_TEST_STALE_SCALES"
# "NAME:N": the N-th build of adapter NAME in this worker process fails (tests/test_vllm_adapters.py).
FAIL_ADAPTER_BUILD_ENV = "REFIT_GRPC_TEST_FAIL_ADAPTER_BUILD"
# The quantize step each method runs on a reload, and the scales it writes.
_TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Int8OnlineMoEMethod": ("_quantize_weights", ("w13_scale", "w2_scale")),
    "Fp8PtpcOnlineLinearMethod": ("process_weights_after_loading", ("weight_scale",)),
}


class StaleScales:
    """The fault for one layerwise session (module docstring); nothing unless the environment
    asks for it."""

    def __init__(self, model: torch.nn.Module):
        self._wrapped: list[tuple[Any, str]] = []
        if os.environ.get(STALE_SCALES_ENV) != "1":
            return
        # Per method instance (vLLM may share one between layers): each layer's scales as the
        # session began, taken now, while its tensors are still real.
        old: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        methods: dict[int, tuple[Any, str]] = {}
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            target = _TARGETS.get(type(method).__name__)
            if method is None or target is None:
                continue
            step, names = target
            old.setdefault(id(method), {})[id(module)] = {
                n: getattr(module, n).detach().clone() for n in names}
            methods[id(method)] = (method, step)
        for key, (method, step) in methods.items():
            setattr(method, step, _keeping_scales(getattr(type(method), step).__get__(method),
                                                  old[key]))
            self._wrapped.append((method, step))
        if self._wrapped:
            log.warning("refit_grpc gloo: %s=1: %d quantized layers keep their old scales after "
                        "this refit (a deliberate fault, for tests)", STALE_SCALES_ENV,
                        sum(len(v) for v in old.values()))

    def restore(self) -> None:
        for method, step in self._wrapped:
            method.__dict__.pop(step, None)
        self._wrapped = []


def _keeping_scales(original: Callable[[torch.nn.Module], None],
                    old: dict[int, dict[str, torch.Tensor]]) -> Callable[[torch.nn.Module], None]:
    def step(layer: torch.nn.Module) -> None:
        original(layer)
        for name, scales in old.get(id(layer), {}).items():
            getattr(layer, name).data.copy_(scales.view_as(getattr(layer, name)))

    return step


class FailingAdapterBuild:
    """With `FAIL_ADAPTER_BUILD_ENV=NAME:N` in an engine's environment, the N-th build of the
    adapter NAME in a worker process raises (each version is built once, so it is the N-th
    version flipped there): the failed adapter flip a test drives, every byte having arrived
    and the copy committed to the worker's store. Nothing unless the environment asks."""

    def __init__(self) -> None:
        name, _, count = os.environ.get(FAIL_ADAPTER_BUILD_ENV, "").partition(":")
        self._name = name
        self._nth = int(count) if count.isdigit() else 0
        self._builds = 0

    def check(self, name: str) -> None:
        """Called before each build of adapter `name`; raises the fault on the one asked for."""
        if not self._nth or name != self._name:
            return
        self._builds += 1
        if self._builds == self._nth:
            log.warning("refit_grpc gloo: %s: the build of adapter %r fails (a deliberate "
                        "fault, for tests)", FAIL_ADAPTER_BUILD_ENV, name)
            raise RuntimeError(f"refit_grpc: a deliberate fault ({FAIL_ADAPTER_BUILD_ENV}): "
                               f"build {self._builds} of adapter {name!r} fails")
