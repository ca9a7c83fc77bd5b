"""Mixture-of-experts layers through a layerwise reload: the experts' own post-load step.

vLLM processes an unquantized fused-MoE layer after loading in two steps: the quant method's
`process_weights_after_loading` (`UnquantizedFusedMoEMethod._setup_kernel`: the kernel format,
then the kernel itself), and, on the first load only, the kernel's experts'
`fused_experts.process_weights_after_loading(layer)`. On CPU that second step is what makes the
weights servable: it zero-pads the expert width to a multiple of 32 and prepacks `w13_weight` and
`w2_weight` into the grouped GEMM's layout. On a weight update vLLM skips it ("the kernel already
exists"), and the layerwise reload then copies the plain, unpadded tensors into the prepacked
kernel tensors:

- width already a multiple of 32 (e.g. 64): same element count, wrong layout; the engine serves
  scrambled experts (log-probabilities off by 0.02-0.1, even for a refit of identical weights),
  and every engine holds the same wrong bytes, so no digest comparison can see it;
- width to pad (e.g. 80 -> 96): the copy fails with a size mismatch and the update fails.

`ExpertsReprocessing` puts the second step back for the duration of one layerwise session: each
unquantized fused-MoE method's `process_weights_after_loading` is wrapped (on the instance, not
the class) so that, once a layer's new weights are in, the experts' step runs before vLLM's
copy-back. The tensors copied back then have the kernel tensors' shape and layout, exactly as
after the first load. The wrapper is removed when the session ends (`restore`).

Quantized MoE methods run their own processing and are left alone: on a reload vLLM re-runs it
from the new weights (`_layerwise_process` clears the "already processed" flag), which
re-quantizes. vLLM 0.32's online int8 (`Int8OnlineMoEMethod`) is proven so by
tests/test_vllm_quantized.py; any other is logged once per session as not verified by this
project (docs/vllm.md, Quantized engines). The stale-scale fault those tests use is
`faults.StaleScales`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("vllm.refit_grpc")

_UNQUANTIZED = "UnquantizedFusedMoEMethod"  # vLLM 0.31 and 0.32 name it the same
# Set to 0 in an engine's environment to turn the fix off: vLLM's own behaviour, wrong experts
# after a refit. For diagnosis and for the test that proves the logprob canary catches it
# (tests/test_vllm_families.py); never in production.
DISABLE_ENV = "REFIT_GRPC_MOE_REPROCESS"
# The quantized MoE methods whose reload this project's tests prove (vLLM 0.32's names).
_VERIFIED_QUANTIZED = {"Int8OnlineMoEMethod"}


class ExpertsReprocessing:
    """Wraps every unquantized fused-MoE quant method of `model` for one layerwise session."""

    def __init__(self, model: torch.nn.Module):
        self._wrapped: list[Any] = []  # the quant methods whose instance attribute we set
        if os.environ.get(DISABLE_ENV, "1") == "0":
            log.warning("refit_grpc gloo: %s=0: MoE experts are NOT re-processed after a "
                        "refit (vLLM's own behaviour: wrong outputs)", DISABLE_ENV)
            return
        seen: set[int] = set()
        others: set[str] = set()
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is None or id(method) in seen or not hasattr(method, "moe_kernel"):
                continue
            seen.add(id(method))
            if type(method).__name__ != _UNQUANTIZED:
                if type(method).__name__ not in _VERIFIED_QUANTIZED:
                    others.add(type(method).__name__)
                continue
            method.process_weights_after_loading = _with_experts_step(
                method, type(method).process_weights_after_loading.__get__(method))
            self._wrapped.append(method)
        if others:
            log.warning("refit_grpc gloo: MoE layers quantized with %s are reloaded by vLLM's "
                        "own processing, which this project has not verified", sorted(others))

    @property
    def layers(self) -> int:
        return len(self._wrapped)

    def restore(self) -> None:
        """Remove the wrappers: the class's own method is what the next first load sees."""
        for method in self._wrapped:
            method.__dict__.pop("process_weights_after_loading", None)
        self._wrapped = []


def _with_experts_step(method: Any, original: Callable[[torch.nn.Module], None]
                       ) -> Callable[[torch.nn.Module], None]:
    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        reloading = method.moe_kernel is not None  # vLLM skips the experts' step exactly then
        original(layer)
        experts = getattr(method.moe_kernel, "fused_experts", None)
        if reloading and experts is not None:
            experts.process_weights_after_loading(layer)

    return process_weights_after_loading
