"""The EngineCore wrap behind a vLLM flip in one turn of the engine loop
(`refit_grpc.vllm_plugin.engine_loop`), as pure logic: what it does around the workers' call and
in which order, against a stand-in EngineCore that records its calls. That a real vLLM engine
flips this way, never paused and to the trainer's log-probabilities, is proven on a real server
(tests/test_vllm_staged.py (b''), tests/test_vllm_tp.py)."""

from __future__ import annotations

import json
import types

import pytest

from refit_grpc.vllm_plugin import engine_loop
from refit_grpc.wire.vllm import (
    LOOP_FLIP_KWARG,
    STAGE_RPC_METHOD,
    LoopFlip,
    LoopFlipDone,
    stage_rpc_body,
)


class Core:
    """vLLM's EngineCore as far as the wrap uses it; `collective_rpc` stands for the workers."""

    def __init__(self, fail: bool = False, batch_queue=None):
        self.calls: list[tuple] = []
        self.fail = fail
        self.batch_queue = batch_queue
        self.label = "4"

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("workers", method, dict(kwargs or {})))
        if self.fail:
            raise RuntimeError("refit_grpc[applied=0/3] load of the staged copy failed")
        if kwargs and kwargs.get("op") == "engine_info":
            return [{"quantization": "none"}, {"quantization": "none"}]
        return [{"state": "idle"}]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache", reset_running_requests, reset_connector))
        return True

    def reset_mm_cache(self):
        self.calls.append(("reset_mm_cache",))

    def reset_encoder_cache(self):
        self.calls.append(("reset_encoder_cache",))

    def get_weight_version(self):
        return self.label

    def set_weight_version(self, label):
        self.calls.append(("label", label))
        self.label = label

    def pause_scheduler(self, mode="abort", clear_cache=True):
        self.calls.append(("pause", mode, clear_cache))


@pytest.fixture
def wrapped(monkeypatch):
    """`Core` with the wrap installed, as in vLLM's EngineCore process."""
    cls = type("EngineCore", (Core,), {})
    monkeypatch.setitem(__import__("sys").modules, engine_loop.ENGINE_CORE_MODULE,
                        types.SimpleNamespace(EngineCore=cls))
    assert engine_loop.install() and engine_loop.install()  # idempotent
    return cls


def _flip_kwargs(loop: LoopFlip) -> dict:
    body = stage_rpc_body("flip", {"staged_digest": "d" * 64}, loop_flip=loop)
    assert body["method"] == STAGE_RPC_METHOD
    return body["kwargs"]


def test_the_turn_resets_then_labels_then_flips_and_the_workers_never_see_the_key(wrapped):
    core = wrapped()
    answer = core.collective_rpc(STAGE_RPC_METHOD, 5.0,
                                 kwargs=_flip_kwargs(LoopFlip(weight_version="5")))
    done = LoopFlipDone.from_wire(answer)
    assert 0 <= done.load_s <= done.stall_s
    assert [c[0] for c in core.calls] == ["reset_prefix_cache", "label", "workers"]
    assert core.calls[0] == ("reset_prefix_cache", True, True)
    assert LOOP_FLIP_KWARG not in core.calls[2][2] and core.calls[2][2]["op"] == "flip"
    assert core.label == "5"


def test_kept_caches_are_not_reset_and_a_multimodal_model_clears_its_encoder_caches(wrapped):
    core = wrapped()
    core.collective_rpc(STAGE_RPC_METHOD, None, kwargs=_flip_kwargs(
        LoopFlip(weight_version="5", reset_caches=False)))
    assert [c[0] for c in core.calls] == ["label", "workers"]
    core.calls.clear()
    core.collective_rpc(STAGE_RPC_METHOD, None, kwargs=_flip_kwargs(
        LoopFlip(weight_version="6", multimodal=True)))
    assert [c[0] for c in core.calls] == ["reset_prefix_cache", "reset_mm_cache",
                                          "reset_encoder_cache", "label", "workers"]


def test_a_failed_flip_sets_the_label_back_and_pauses_the_scheduler(wrapped):
    core = wrapped(fail=True)
    with pytest.raises(RuntimeError, match=r"applied=0/3"):
        core.collective_rpc(STAGE_RPC_METHOD, None, kwargs=_flip_kwargs(LoopFlip(weight_version="5")))
    assert core.label == "4"
    assert core.calls[-2:] == [("label", "4"), ("pause", "keep", False)]


def test_an_engine_with_a_step_in_flight_across_turns_says_so_and_refuses_the_key(wrapped):
    core = wrapped(batch_queue=[])  # async scheduling or pipeline parallelism
    infos = core.collective_rpc(STAGE_RPC_METHOD, None,
                                kwargs={"op": "engine_info", "payload": "{}"})
    assert [i["flip_in_loop"] for i in infos] == [False, False]
    with pytest.raises(RuntimeError, match="flip it in a pause"):
        core.collective_rpc(STAGE_RPC_METHOD, None, kwargs=_flip_kwargs(LoopFlip(weight_version="5")))
    # Nothing went on to the workers (only the info call did); paused, as after any failed turn.
    assert [c[0] for c in core.calls] == ["workers", "label", "pause"] and core.label == "4"


def test_a_cache_reset_that_fails_loads_nothing_and_pauses(wrapped):
    core = wrapped()
    core.reset_prefix_cache = lambda **_: False
    with pytest.raises(RuntimeError, match="nothing was loaded"):
        core.collective_rpc(STAGE_RPC_METHOD, None, kwargs=_flip_kwargs(LoopFlip(weight_version="5")))
    assert core.label == "4" and ("pause", "keep", False) in core.calls
    assert not any(c[0] == "workers" for c in core.calls)


def test_the_info_says_it_can_and_other_calls_pass_through_untouched(wrapped):
    core = wrapped()
    infos = core.collective_rpc(STAGE_RPC_METHOD, None,
                                kwargs={"op": "engine_info", "payload": "{}"})
    assert [i["flip_in_loop"] for i in infos] == [True, True]
    assert core.collective_rpc("reset_weights") == [{"state": "idle"}]
    assert core.calls[-1] == ("workers", "reset_weights", {})


def test_the_loop_flip_wire_round_trips_and_refuses_what_the_loop_could_not_use():
    loop = LoopFlip(weight_version="7", reset_caches=False, multimodal=True)
    assert LoopFlip.from_wire(loop.to_wire()) == loop
    for bad in ("[]", "{}", json.dumps({"weight_version": 7})):
        with pytest.raises(ValueError):
            LoopFlip.from_wire(bad)
    with pytest.raises(ValueError):
        stage_rpc_body("stage", {}, loop_flip=loop)
    assert LoopFlipDone.from_wire([LoopFlipDone(stall_s=0.003, load_s=0.002).to_wire()]) == \
        LoopFlipDone(stall_s=0.003, load_s=0.002)
    for bad in (None, [], [None], [{"loop_flip": {"stall_s": "x", "load_s": 1}}]):
        with pytest.raises(ValueError):
            LoopFlipDone.from_wire(bad)
