"""A staged flip in one turn of vLLM's engine loop: no pause, one round trip.

A staged epoch's flip used to be three sequential round trips to vLLM (pause, the workers' flip,
resume), and the engine stopped generating for all three: the pause waits for the step in
flight, the resume has to travel back. Yet vLLM's EngineCore already runs every utility call
(`/collective_rpc` among them) on its loop's own thread, between two steps: while one runs, no
step does. So a flip that resets the caches and sets the version label in the same call is as
atomic as pause-flip-resume, and the engine stops for that call only.

This module wraps `EngineCore.collective_rpc` in the EngineCore process (vLLM loads the
project's plugin there too). A `STAGE_OP_FLIP` that carries `wire.vllm.LOOP_FLIP_KWARG`:

    1. the running requests are preempted and the prefix cache (and a connector's) reset, as
       `/pause?clear_cache=true` does (they recompute with the new weights), unless the caches
       are kept; a multimodal model's encoder and multimodal caches too;
    2. the weight version label is set (the outputs' version spans change at this turn);
    3. the workers' flip (`RefitGlooWeightTransferEngine._flip`), the call without the key;
    4. the answer: `LoopFlipDone` (the turn's and the workers' seconds).

Any failure in the turn sets the label back and pauses the scheduler (keep): nothing is
served from weights that may be partly loaded; the shim takes the engine as BROKEN, paused, as after a
failed load in a pause. `STAGE_OP_INFO` answers gain `flip_in_loop`, so a shim uses the key only
on an engine whose loop takes it out (a worker would refuse the unknown keyword).

Only where a step is over when the loop takes a call: without vLLM's batch queue (async
scheduling or pipeline parallelism keep a step in flight across turns; vLLM CPU turns async
scheduling off). Elsewhere `flip_in_loop` stays False and the shim pauses as before.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from refit_grpc.wire.vllm import (
    LOOP_FLIP_KWARG,
    STAGE_OP_FLIP,
    STAGE_OP_INFO,
    STAGE_RPC_METHOD,
    LoopFlip,
    LoopFlipDone,
)

log = logging.getLogger("vllm.refit_grpc")

ENGINE_CORE_MODULE = "vllm.v1.engine.core"
_WRAPPED = "_refit_grpc_loop_flip"


def install() -> bool:
    """Wrap `EngineCore.collective_rpc` where vLLM's engine core module is already imported
    (the EngineCore process imports it before it loads plugins; elsewhere the wrap is never
    called). Idempotent; False where there is nothing to wrap."""
    module = sys.modules.get(ENGINE_CORE_MODULE)
    engine_core = getattr(module, "EngineCore", None)
    original = getattr(engine_core, "collective_rpc", None)
    if engine_core is None or original is None:
        return False
    if getattr(original, _WRAPPED, False):
        return True

    def collective_rpc(self: Any, method: Any, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None,
                       *more: Any, **named: Any) -> Any:
        # `more`, `named`: whatever a later vLLM adds to the signature, passed on untouched.
        if method == STAGE_RPC_METHOD and kwargs and not more and not named:
            if LOOP_FLIP_KWARG in kwargs:
                return _flip_in_loop(self, original, timeout, args, kwargs)
            if kwargs.get("op") == STAGE_OP_INFO:
                answers = original(self, method, timeout, args, kwargs)
                can = in_loop_possible(self)
                return [dict(a, flip_in_loop=can) if isinstance(a, dict) else a
                        for a in answers]
        return original(self, method, timeout, args, kwargs, *more, **named)

    setattr(collective_rpc, _WRAPPED, True)
    collective_rpc.__doc__ = original.__doc__
    engine_core.collective_rpc = collective_rpc
    return True


def in_loop_possible(core: Any) -> bool:
    """Whether every step is over when the loop runs a utility call: no batch queue (async
    scheduling, pipeline parallelism), and the calls this module makes exist."""
    return getattr(core, "batch_queue", None) is None and all(
        callable(getattr(core, name, None)) for name in
        ("reset_prefix_cache", "set_weight_version", "get_weight_version", "pause_scheduler"))


def _flip_in_loop(core: Any, original: Callable[..., Any], timeout: float | None,
                  args: tuple, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    kwargs = dict(kwargs)
    loop = LoopFlip.from_wire(str(kwargs.pop(LOOP_FLIP_KWARG)))
    label = core.get_weight_version()
    t0 = t_load = time.perf_counter()
    try:
        if kwargs.get("op") != STAGE_OP_FLIP:
            raise ValueError(f"refit_grpc: a loop flip is a {STAGE_OP_FLIP!r}, got "
                             f"{kwargs.get('op')!r}")
        if not in_loop_possible(core):
            raise RuntimeError("refit_grpc: this engine keeps a step in flight across turns "
                               "of its loop (a batch queue); flip it in a pause")
        if loop.reset_caches:
            # What /pause?clear_cache=true does inside its pause (EngineCore._reset_caches):
            # the running requests are preempted and recompute their KV with the new weights.
            if not core.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
                raise RuntimeError("refit_grpc: vLLM could not reset its KV connector's "
                                   "cache; nothing was loaded")
            if loop.multimodal:
                core.reset_mm_cache()
                core.reset_encoder_cache()
        core.set_weight_version(loop.weight_version)
        t_load = time.perf_counter()
        original(core, STAGE_RPC_METHOD, timeout, args, kwargs)
    except BaseException:
        core.set_weight_version(label)
        # Every failed turn leaves the engine as a failed load in a pause does, paused until
        # the shim's full update: nothing is served from weights that may be partly loaded,
        # and the shim, which takes the engine as paused after any failed flip, is right.
        core.pause_scheduler(mode="keep", clear_cache=False)
        log.error("refit_grpc: a flip in one turn of the loop failed; the engine is paused")
        raise
    done = time.perf_counter()
    log.info("refit_grpc: flip to version %s in one turn of the engine loop: %.1f ms "
             "(the workers %.1f ms)", loop.weight_version, (done - t0) * 1e3,
             (done - t_load) * 1e3)
    return [LoopFlipDone(stall_s=done - t0, load_s=done - t_load).to_wire()]


__all__ = ["install", "in_loop_possible"]
