"""Engines behind the shim, registered by name (the `--engine` flag).

Each engine registers its `EngineKind`: a frozen options class (`options.EngineOptions`, parsed
once from the `--engine-option KEY=VALUE` strings) and the factory that builds the engine from
it. The registry loads an engine's module only when that engine is asked for.

    base.py         `Engine`, the contract every engine keeps (tests/test_engine_contract.py runs
                    it against each), `EngineStatus`, `Capabilities`
    reference.py    weights in the shim's own process (every capability)
    http_engine.py  `HttpEngine`: every step of an engine reached over local HTTP admin routes,
                    as template methods; a subclass supplies the routes
    vllm/, dynamo/  the two `HttpEngine`s: routes only

What a new engine reached over HTTP (SGLang, say) must supply, and nothing more:

1. `refit_grpc/wire/sglang.py`: the bodies of its routes, pure (no SGLang, no gRPC), built by
   the shim and parsed by the code in its workers with the same classes. Its workers report a
   failed update's progress with `wire.worker.applied_marker` and a staged receive as
   `wire.worker.StageStatus`, which `HttpEngine` already reads.
2. `refit_grpc/shim/engines/sglang/adapter.py` with
   - `SGLangOptions(HttpEngineOptions)`: frozen, `kw_only`; its default `url` and its own
     options, checked in `__post_init__`;
   - `SGLangEngine(HttpEngine)` with the class attributes `kind = "sglang"`, `options_cls`,
     `engine_name`, `admin_routes`, `reached`, `teardown_route`, `update_route` (words for
     messages), and
     - what only the engine knows: `world_size`, `status(with_digest)`, `check_plan(plan)`
       (`_read_checkpoint` reads a checkpoint's names), `reset_cache`, `weight_version`,
       `capabilities` (`Capabilities()`, nothing beyond in place, unless it says more);
       `check_backend` where its workers, not the shim's process, decide the backend;
     - the routes: `_post_pause(mode, deadline)`, `_post_resume(deadline)`,
       `_post_join(spec, plan, deadline, timeout_s)`, `_post_update(call)` (the one blocking
       receive; with `call.staged_digest` set, a flip's load of the staged copy),
       `_post_finish(version, deadline)`, `_post_teardown(deadline, before_join=)`;
     - where its routes need them: `_error_for` (how it answers a failure), `_open_update`
       (a route that opens an update session, as vLLM's /start_weight_update), `_check_group`
       (a group its workers cannot join), and for staged epochs (`Capabilities(staging=True)`)
       `_start_stage(plan, deadline, timeout_s, delta, keep_previous)` (start every worker's
       staged receive, return their statuses and how to poll them) and
       `_post_drop_staged(deadline)`; for serving catch-ups `_start_serve`/`_cancel_serve`;
       for rollbacks (`Capabilities(rollback=True)`) `_post_restore_previous(deadline)`;
       with a canary (`Capabilities(canary=True)`), `canary_logprobs`;
   - `ENGINE = EngineKind(SGLangOptions, SGLangEngine.from_options)`.
   Pause, resume, init, receive, stage, flip, finish, drop, abort, the receiving/touched state,
   the abort key, the staged poll and the background teardown are `HttpEngine`'s: not written
   again.
3. Here: `register_engine("sglang", _sglang)`, `_sglang` importing the adapter's `ENGINE`.
4. Inside the engine's workers, the receiver its update route calls (for vLLM that is
   `refit_grpc.vllm_plugin`: the gloo receive, the layerwise load, the staged copy); engine
   code, run by the engine, not by the shim.
5. Tests and docs: a `Subject` for it in tests/test_engine_contract.py's `ENGINES` (marked
   `engine`), a fake-server test of its routes and errors as tests/test_vllm_adapter.py, and a
   route table in docs/ as docs/dynamo.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from refit_grpc.common import PauseMode
from refit_grpc.plan import Packing
from refit_grpc.shim.engines.base import Capabilities, Engine, EngineStatus
from refit_grpc.shim.engines.options import EngineKind, EngineOptions

_KINDS: dict[str, Callable[[], EngineKind]] = {}


def register_engine(name: str, load: Callable[[], EngineKind]) -> None:
    """Register engine `name`; `load` returns its EngineKind (importing its module then)."""
    if name in _KINDS:
        raise ValueError(f"engine {name!r} is already registered")
    _KINDS[name] = load


def engine_kind(name: str) -> EngineKind:
    if name not in _KINDS:
        raise ValueError(f"unknown engine {name!r}; known: {sorted(_KINDS)}")
    return _KINDS[name]()


def create_engine(name: str, packing: Packing = Packing(), *,
                  flags: Mapping[str, Any] | None = None, **options: Any) -> Engine:
    """Engine `name` with `options` (strings from `--engine-option`, or typed values), parsed
    by its options class. `flags` are the shim's own flags that name an engine option
    (`--engine-url` as `url`, `--model`, `--seed`): an engine whose options have that field
    takes it, the others ignore it; `options` override them."""
    kind = engine_kind(name)
    values = {k: v for k, v in (flags or {}).items() if kind.takes(k)}
    values.update(options)
    return kind.create(packing, values)


def engine_names() -> list[str]:
    return sorted(_KINDS)


def _reference() -> EngineKind:
    from refit_grpc.shim.engines.reference import ENGINE

    return ENGINE


def _vllm() -> EngineKind:
    from refit_grpc.shim.engines.vllm.adapter import ENGINE

    return ENGINE


def _dynamo() -> EngineKind:
    from refit_grpc.shim.engines.dynamo.adapter import ENGINE

    return ENGINE


register_engine("reference", _reference)
register_engine("vllm", _vllm)
register_engine("dynamo", _dynamo)

__all__ = ["Capabilities", "Engine", "EngineKind", "EngineOptions", "EngineStatus", "PauseMode",
           "create_engine", "engine_kind", "engine_names", "register_engine"]
