"""Adapter epochs in a vLLM worker: LoRA adapters held in memory and loaded by vLLM's own LoRA
manager (docs/adapters.md).

vLLM loads an adapter from a path: a request naming it, or POST /v1/load_lora_adapter, hands the
worker a `LoRARequest(name, int id, path)`, and the worker's `WorkerLoRAManager._load_adapter`
reads `adapter_config.json` and the safetensors there. An adapter epoch has no file: its tensors
land in the worker's staging copy like any staged epoch's (`staged.StagedReceive`). Its commit
(`commit`, the flip) moves them into this process's `AdapterStore` under the adapter's name and
version, and the shim then asks the API server to load the adapter in place from the path
`wire.vllm.adapter_path(name, version)`. `install_loader` wraps `_load_adapter` (once, class
level) so that such a path is built from the store (`LoRAModel.from_lora_tensors`, the same
constructor vLLM's file loader ends in) and any other path is loaded as before.

Why the API server's route: it owns the name -> id mapping requests are routed by, and its
in-place load runs between two engine steps, builds the new adapter before it removes the old
one (a failed build leaves the old one serving) and never pauses the engine. An adapter that
vLLM's LRU cache evicts is loaded again through the same path later: the store still holds that
version (`committed`), so a reload never goes back to an older one.

Thread safety: every function here runs on the worker's main thread (vLLM's RPCs, and its
engine step, which loads adapters); no lock is needed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from refit_grpc.plan import AdapterSpec, RefitPlan
from refit_grpc.reasons import Reason
from refit_grpc.vllm_plugin.faults import FailingAdapterBuild
from refit_grpc.wire.vllm import parse_adapter_path
from refit_grpc.wire.worker import StageStatus

if TYPE_CHECKING:
    from refit_grpc.vllm_plugin.staged import StagedReceive

log = logging.getLogger("vllm.refit_grpc")


@dataclass(frozen=True)
class HeldAdapter:
    """One version of an adapter, held by this worker: the tensors (PEFT names) and the config
    vLLM builds it with."""

    spec: AdapterSpec
    version: int
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class AdapterStore:
    """The adapters this worker received through adapter epochs: per name, the version its
    last commit made current (`committed`) and one waiting for the API server's load
    (`pending`). The loader takes the pending version when its path names it, and only then
    does it become the committed one: a load that failed leaves the old version current."""

    def __init__(self) -> None:
        self.pending: dict[str, HeldAdapter] = {}
        self.committed: dict[str, HeldAdapter] = {}
        # vLLM's adapter id -> the path its loaded adapter was built from (`install_loader`).
        self.loaded_paths: dict[int, str] = {}

    def put_pending(self, held: HeldAdapter) -> None:
        self.pending[held.spec.name] = held

    def get(self, name: str, version: int) -> HeldAdapter:
        """The held version a load asks for. Raises FileNotFoundError (vLLM answers it as an
        adapter not found) when this worker holds no such version."""
        for held in (self.pending.get(name), self.committed.get(name)):
            if held is not None and held.version == version:
                return held
        have = {n: h.version for n, h in self.committed.items()}
        raise FileNotFoundError(f"refit_grpc: no version {version} of adapter {name!r} is held "
                                f"in memory (held: {have})")

    def loaded(self, held: HeldAdapter) -> None:
        """vLLM built `held`: it is the adapter's current version from here."""
        if self.pending.get(held.spec.name) is held:
            del self.pending[held.spec.name]
        self.committed[held.spec.name] = held

    def versions(self) -> dict[str, int]:
        return {name: held.version for name, held in self.committed.items()}


STORE = AdapterStore()
_FAULTS = FailingAdapterBuild()
_installed = False


def commit(plan: RefitPlan, tensors: list[tuple[Any, torch.Tensor]], version: int) -> HeldAdapter:
    """An adapter epoch's flip on this worker: the staged copy's bytes (`tensors`: (spec, raw
    uint8 slice) in plan order), copied out of the staging buffer (the next stage reuses it),
    become the adapter's pending version; the shim's load makes it current."""
    assert plan.adapter is not None
    held = HeldAdapter(plan.adapter, version, {
        spec.name: raw.clone().view(spec.dtype).view(spec.shape) for spec, raw in tensors})
    STORE.put_pending(held)
    log.info("refit_grpc gloo: adapter %r version %d held in memory (%d tensors, %d bytes)",
             plan.adapter.name, version, len(held.tensors), held.nbytes)
    return held


@dataclass(frozen=True)
class AdapterProblem:
    """Why this engine cannot serve an adapter plan: the message and the `Reason`."""

    message: str
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"problem": self.message, "reason": self.reason}


def check_plan(vllm_config: Any, model: torch.nn.Module, plan: RefitPlan) -> AdapterProblem:
    """Prepare of an adapter plan on this worker (`check`); an empty problem when it can serve
    it."""
    if plan.adapter is None:
        return AdapterProblem("the plan names no adapter", Reason.INVALID_ADAPTER)
    problem = check(vllm_config, model, plan.adapter, [s.name for s in plan.tensors])
    return problem or AdapterProblem("", "")


def commit_staged(staged: StagedReceive, staged_digest: str, version: int) -> StageStatus:
    """An adapter epoch's flip on this worker: the staged copy (exactly `staged_digest`)
    becomes the adapter's pending version (`commit`); the copy is spent, not a committed copy
    of the model. Returns the worker's status after it."""
    plan = staged.take(staged_digest)
    if plan.adapter is None:
        raise RuntimeError("refit_grpc gloo: the staged plan names no adapter")
    commit(plan, list(staged.copy.tensors()), version)
    staged.committed(None)
    return staged.status()


def check(vllm_config: Any, model: torch.nn.Module, spec: AdapterSpec,
          names: list[str]) -> AdapterProblem | None:
    """What vLLM would refuse when it builds the adapter, found at Prepare: LoRA not enabled,
    a config vLLM cannot serve (rank over `--max-lora-rank`, DoRA, bias, ...), or tensors for
    modules this model cannot adapt. None when it can serve it."""
    lora_config = getattr(vllm_config, "lora_config", None)
    manager = getattr(model, "lora_manager", None)
    if lora_config is None or manager is None:
        return AdapterProblem("vLLM serves no LoRA adapters: start it with --enable-lora "
                              "(and --max-lora-rank at least the adapter's rank)",
                              Reason.ADAPTER_UNSUPPORTED)
    from vllm.lora.peft_helper import PEFTHelper

    try:
        PEFTHelper.from_dict(spec.config).validate_legal(lora_config)
    except (ValueError, TypeError, KeyError) as e:
        return AdapterProblem(f"adapter {spec.name!r}: vLLM cannot serve it: {e}",
                              Reason.INVALID_ADAPTER)
    experts = sorted({n.split(".experts.")[0] for n in names if ".experts." in n})
    if experts:
        return AdapterProblem(
            f"adapter {spec.name!r} adapts MoE experts ({experts[:3]}): not verified by this "
            "project (docs/adapters.md)", Reason.INVALID_ADAPTER)
    unexpected = _unexpected_modules(manager, model, names)
    if unexpected:
        return AdapterProblem(
            f"adapter {spec.name!r} adapts modules this model's LoRA layers do not have: "
            f"{unexpected[:5]} (vLLM adapts {sorted(_expected_modules(manager))})",
            Reason.INVALID_ADAPTER)
    return None


def _expected_modules(manager: Any) -> set[str]:
    """The module names an adapter may target: vLLM's rule in `_load_adapter` (packed modules
    stand for their parts: qkv_proj for q_proj, k_proj, v_proj)."""
    expected: set[str] = set()
    for module in manager.supported_lora_modules:
        packed = manager.packed_modules_mapping.get(module)
        expected.update(packed if packed else [module])
        if module == "experts":
            expected.add(module)
    return expected


def _unexpected_modules(manager: Any, model: torch.nn.Module, names: list[str]) -> list[str]:
    from vllm.lora.utils import parse_fine_tuned_lora_name

    expected = _expected_modules(manager)
    mapper = _rename_mapper(model)
    unexpected: list[str] = []
    for name in names:
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        if module.rsplit(".", 1)[-1] not in expected and module not in unexpected:
            unexpected.append(module)
    return unexpected


def _rename_mapper(model: torch.nn.Module) -> Any:
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return mapper.get_rename_mapper() if mapper is not None else None


def install_loader() -> None:
    """Wrap vLLM's LoRA manager (class level, once per process):

    - `WorkerLoRAManager._load_adapter`: a path made by `wire.vllm.adapter_path` is built from
      `STORE`; any other path is vLLM's.
    - `LRUCacheWorkerLoRAManager.add_adapter`: vLLM 0.32's API server keeps the request of an
      in-place load, `load_inplace` set, as the adapter's request, so every engine step that
      serves the adapter would load it again (measured: a rebuild per step). One of our paths
      names one version, so an adapter already built from that very path is not built again
      (vLLM still re-activates it); a new version comes with a new path."""
    global _installed
    if _installed:
        return
    import msgspec
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    load, add = WorkerLoRAManager._load_adapter, LRUCacheWorkerLoRAManager.add_adapter

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        parsed = parse_adapter_path(lora_request.lora_path or "")
        if parsed is None:
            return load(self, lora_request)
        name, version = parsed
        held = STORE.get(name, version)
        lora = _build(self, lora_request, held)
        STORE.loaded(held)
        return lora

    def add_adapter(self: Any, lora_request: Any) -> bool:
        path, adapter_id = lora_request.lora_path or "", lora_request.lora_int_id
        if parse_adapter_path(path) is None:
            return add(self, lora_request)
        if lora_request.load_inplace and STORE.loaded_paths.get(adapter_id) == path \
                and adapter_id in self.list_adapters():
            lora_request = msgspec.structs.replace(lora_request, load_inplace=False)
        loaded = add(self, lora_request)
        STORE.loaded_paths[adapter_id] = path
        return loaded

    WorkerLoRAManager._load_adapter = _load_adapter
    LRUCacheWorkerLoRAManager.add_adapter = add_adapter
    _installed = True


def _build(worker_manager: Any, lora_request: Any, held: HeldAdapter) -> Any:
    """vLLM's `_load_adapter` from memory: the same config check and the same constructor
    (`LoRAModel.from_lora_tensors`, which `from_local_checkpoint` ends in). vLLM's checks of
    MoE adapter layouts, classifier heads and token classification are not repeated: `check`
    refuses adapters on experts at Prepare, and PEFT's modules_to_save is vLLM's config check."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    _FAULTS.check(held.spec.name)  # nothing unless a test's environment asks
    manager = worker_manager._adapter_manager
    model = manager.model
    peft_helper = PEFTHelper.from_dict(json.loads(held.spec.peft_config))
    peft_helper.validate_legal(worker_manager.lora_config)
    unexpected = _unexpected_modules(manager, model, list(held.tensors))
    if unexpected:
        raise ValueError(f"adapter {held.spec.name!r}: modules {unexpected[:5]} are not "
                         f"among {sorted(_expected_modules(manager))}")
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id,
        # Copies: vLLM may keep these tensors (pinned, cast); the held ones stay as received.
        tensors={name: t.clone() for name, t in held.tensors.items()},
        peft_helper=peft_helper, device="cpu", dtype=worker_manager.lora_config.lora_dtype,
        model_vocab_size=worker_manager.vocab_size, weights_mapper=_rename_mapper(model),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
    log.info("refit_grpc gloo: adapter %r version %d built from memory (id %d)",
             held.spec.name, held.version, lora_request.lora_int_id)
    return lora


__all__ = ["STORE", "AdapterProblem", "AdapterStore", "HeldAdapter", "check", "check_plan",
           "commit", "commit_staged", "install_loader"]
