"""The Engine contract (`refit_grpc/shim/engines/base.py`), one set of tests run on every engine:
the reference engine in this process, the vLLM engine in front of a real vLLM CPU server, and the
Dynamo engine in front of a real NVIDIA Dynamo vLLM worker (with Dynamo's frontend).

Every test drives the engine directly, as the shim does, with real processes and real gloo groups:
the trainer is `Group.join` as rank 0 plus `Sender`. Adding an engine means adding one
`Subject` below; every contract item then runs on it. The vLLM server and the Dynamo worker are
the session's shared ones (tests/conftest.py), taken on the first case of each; where vLLM or
Dynamo's venv is not installed only those cases skip.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from refit_grpc.canary import FP32_TOLERANCE, teacher_forced_logprobs
from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.dataplane.delta import flat_copy, send_delta
from refit_grpc.dataplane.group import Group
from refit_grpc.dataplane.rendezvous import bind_master_store
from refit_grpc.dataplane.staging import StagedDigest
from refit_grpc.dataplane.transfer import Sender
from refit_grpc.errors import EpochAbortedError, RefitError, RefitTimeoutError
from refit_grpc.plan import Bucket, Packing, RefitPlan, weights_digest
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.engines.dynamo import DynamoEngine
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.engines.vllm import VLLMEngine

from dynamo_support import require_dynamo
from support import info, join_trainer
from vllm_support import require_vllm, tiny_model_dir

# The first vLLM case starts the module's server (about 40 s here, minutes on a loaded host).
pytestmark = pytest.mark.timeout(600)

ENGINES = ("reference", "reference-store", pytest.param("vllm", marks=pytest.mark.engine),
           pytest.param("dynamo", marks=pytest.mark.engine))
STEP_S = 30.0      # the deadline of a control call (pause, resume, join, ...)
EPOCH_S = 60.0     # the deadline of a transfer that is expected to succeed
GEN = 4            # tokens compared with the transformers forward (vLLM)
CANARY = [3, 17, 42, 5, 99, 1, 64, 7, 23, 8, 111, 2]  # in every engine's vocabulary here
_versions = iter(range(1, 1_000_000))  # one vLLM server for the module: versions only move forward


@dataclass
class Subject:
    """One engine under test and what only its kind knows: the tensors of its own model, and how
    to prove it now holds a given set of weights."""

    engine: Engine
    packing: Packing
    base: dict[str, torch.Tensor]
    holds: Callable[[RefitPlan, dict[str, torch.Tensor], int], None]
    settle_s: float = 0.3  # until a receive just started is blocked inside the engine
    # The trainer's log-probabilities of a canary under given weights; None for an engine that
    # computes no canary (it must say so: capabilities.canary False, CANARY_UNSUPPORTED).
    canary_truth: Callable[[dict[str, torch.Tensor], list[int]], list[float]] | None = None

    def plan(self) -> RefitPlan:
        return RefitPlan.from_state_dict_info(info(self.base), self.packing)


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: (t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype))
            if t.is_floating_point() else t.clone() for n, t in base.items()}


# --- the engines -------------------------------------------------------------------------------


def reference_subject() -> Subject:
    from refit_grpc.models.tiny_lm import TinyLM, TinyLMConfig

    engine = ReferenceEngine()
    names = list(TinyLM(TinyLMConfig()).state_dict())  # the engine's model: same config, same names
    base = {n: engine.tensor(n).clone() for n in names}

    def holds(plan: RefitPlan, weights: dict[str, torch.Tensor], version: int) -> None:
        holds_bytes(engine, plan, weights)

    def canary_truth(weights: dict[str, torch.Tensor], tokens: list[int]) -> list[float]:
        model = TinyLM(TinyLMConfig())
        model.load_state_dict(weights)
        with torch.no_grad():
            return teacher_forced_logprobs(model.eval()(torch.tensor([tokens]))[0], tokens)

    return Subject(engine, Packing(64 * 1024, 2), base, holds, canary_truth=canary_truth)


def reference_store_subject() -> Subject:
    """The reference engine in store mode (no model: it holds whatever the plan names, in one
    buffer in plan layout), the mode the fleet tests and benches run; its flip serves from the
    staged copy itself instead of copying it. Its tensors: the tiny LM's (float32) and a
    bfloat16 and an int64 one, each at an offset its dtype can be viewed at (else the engine
    copies), every byte checked."""
    from refit_grpc.models.tiny_lm import TinyLM, TinyLMConfig

    engine = ReferenceEngine(model=None)
    base = {n: t.clone() for n, t in TinyLM(TinyLMConfig()).state_dict().items()}
    base["extra.bf16"] = torch.randn(4, 4).to(torch.bfloat16)
    base["extra.int64"] = torch.arange(7, dtype=torch.int64)

    def holds(plan: RefitPlan, weights: dict[str, torch.Tensor], version: int) -> None:
        assert engine.receives_in_place  # one buffer in plan layout: what store mode is for
        holds_bytes(engine, plan, weights)

    return Subject(engine, Packing(64 * 1024, 2), base, holds)


def holds_bytes(engine: ReferenceEngine, plan: RefitPlan,
                weights: dict[str, torch.Tensor]) -> None:
    """A reference engine holds exactly `weights`: every tensor byte for byte, and its digest."""
    for s in plan.tensors:
        got = engine.tensor(s.name)
        assert (tuple(got.shape), got.dtype) == (s.shape, s.dtype), s.name
        assert torch.equal(got.reshape(-1).view(torch.uint8),
                           weights[s.name].contiguous().reshape(-1).view(torch.uint8)), s.name
    want = weights_digest((s.name, weights[s.name]) for s in plan.tensors)
    assert engine.status(with_digest=True).weights_digest == want


def vllm_subject(server, trainer: dict) -> Subject:
    from refit_grpc.testing.vllm import PROMPT, complete, hf_greedy, http_json

    model, before = trainer["model"], trainer["before"]
    engine = VLLMEngine(server.url, request_timeout_s=STEP_S, abort_grace_s=3.0)

    def holds(plan: RefitPlan, weights: dict[str, torch.Tensor], version: int) -> None:
        assert http_json("GET", server.url, "/weight_info")[1] == {"weight_version": str(version)}
        model.load_state_dict(weights)
        want = hf_greedy(model, PROMPT, GEN)
        assert want != before, "these weights cannot be told from the old ones by generating"
        engine.resume(Deadline(STEP_S))  # vLLM generates only once resumed
        assert complete(server.url, PROMPT, GEN)["token_ids"] == want

    def canary_truth(weights: dict[str, torch.Tensor], tokens: list[int]) -> list[float]:
        from refit_grpc.testing.logprobs import hf_logprobs

        model.load_state_dict(weights)
        return hf_logprobs(model, tokens).tolist()

    # vLLM needs a moment to reach /update_weights after the call was posted.
    return Subject(engine, Packing(256 * 1024, 2), trainer["base"], holds, settle_s=1.5,
                   canary_truth=canary_truth)


@pytest.fixture(scope="module")
def vllm_server(vllm_servers):
    """The session's tiny-Llama server (skips the vLLM cases only, with the stated reason, where
    vLLM is not installed), serving its checkpoint when this module gets it."""
    return vllm_servers.server(tiny_model_dir())


@pytest.fixture(scope="module")
def vllm_trainer(vllm_server) -> dict:
    """The served checkpoint as the trainer holds it (transformers), loaded once."""
    from refit_grpc.testing.vllm import PROMPT, hf_greedy, load_hf_model

    model = load_hf_model(tiny_model_dir())
    return {"model": model, "base": {n: t.detach().clone() for n, t in model.state_dict().items()},
            "before": hf_greedy(model, PROMPT, GEN)}


def dynamo_subject(rig: dict) -> Subject:
    from refit_grpc.testing.dynamo import frontend_greedy, frontend_logprobs
    from refit_grpc.testing.logprobs import SEQUENCE, hf_logprobs
    from refit_grpc.testing.vllm import PROMPT, hf_greedy

    worker, frontend, model = rig["worker"], rig["frontend"], rig["model"]
    engine = DynamoEngine(worker.url, request_timeout_s=STEP_S, abort_grace_s=3.0)

    def holds(plan: RefitPlan, weights: dict[str, torch.Tensor], version: int) -> None:
        assert worker.post("get_weight_version")[1]["version"] == version
        model.load_state_dict(weights)
        want = hf_greedy(model, PROMPT, GEN)
        assert want != rig["before"], "these weights cannot be told from the old ones"
        engine.resume(Deadline(STEP_S))
        assert frontend_greedy(frontend.url, None, PROMPT, GEN) == want
        gap = (frontend_logprobs(frontend.url, None, SEQUENCE) - hf_logprobs(model)).abs().max()
        assert gap <= 2e-3, gap

    return Subject(engine, Packing(256 * 1024, 2), rig["base"], holds, settle_s=1.5)


@pytest.fixture(scope="module")
def dynamo_rig(dynamo_deployment) -> dict:
    """The session's Dynamo worker and frontend (file discovery) for the module's Dynamo cases,
    whatever weights it serves (every case sends its own); the weights as the trainer holds them."""
    require_vllm()  # the trainer's transformers
    require_dynamo()  # skips the Dynamo cases only, with the stated reason
    from refit_grpc.testing.vllm import PROMPT, hf_greedy, load_hf_model

    deployment = dynamo_deployment.get(fresh=False, changed=True)
    model = load_hf_model(deployment["model_dir"])
    return {**deployment, "model": model,
            "base": {n: t.detach().clone() for n, t in model.state_dict().items()},
            "before": hf_greedy(model, PROMPT, GEN)}


@pytest.fixture(params=ENGINES)
def subject(request) -> Iterator[Subject]:
    if request.param == "reference":
        s = reference_subject()
    elif request.param == "reference-store":
        s = reference_store_subject()
    elif request.param == "dynamo":
        s = dynamo_subject(request.getfixturevalue("dynamo_rig"))
    else:
        s = vllm_subject(request.getfixturevalue("vllm_server"),
                         request.getfixturevalue("vllm_trainer"))
    yield s
    s.engine.abort_transfer()
    try:  # leave the engine serving for the next case (one vLLM server for the module)
        s.engine.resume(Deadline(STEP_S))
    finally:
        s.engine.close()


# --- the trainer's side ------------------------------------------------------------------------


@dataclass
class Joined:
    trainer: Group
    spec: GroupSpec


def form_group(engine: Engine, plan: RefitPlan) -> Joined:
    """The engine joins as rank 1 of a world of 2 (init_transfer), the trainer as rank 0 on a
    thread; returns once both are in."""
    group_id = f"contract-{uuid.uuid4().hex[:8]}"
    port, thread, box = join_trainer(2, group_id, timeout_s=STEP_S)
    spec = GroupSpec("127.0.0.1", port, 2, 1, "gloo", group_id)
    try:
        engine.init_transfer(spec, plan, Deadline(STEP_S))
    finally:
        thread.join(STEP_S)
    assert "group" in box, box.get("error")
    return Joined(box["group"], spec)


class Receive:
    """`engine.receive` on a thread: what it raised, the buckets it reported, when it ended."""

    def __init__(self, engine: Engine, plan: RefitPlan, deadline: Deadline):
        self.buckets: list[Bucket] = []
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.started_at = time.monotonic()

        def run() -> None:
            try:
                engine.receive(plan, deadline, self.buckets.append)
            except BaseException as e:  # noqa: BLE001  (the test asserts on it)
                self.error = e
            finally:
                self.ended_at = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True, name="contract-receive")
        self.thread.start()

    def join(self, timeout_s: float) -> float:
        """Seconds from the start to the end of the receive; fails if it is still running."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"receive still blocked after {timeout_s}s"
        return self.ended_at - self.started_at


# --- the contract ------------------------------------------------------------------------------


def test_status_is_healthy_and_pause_and_resume_are_idempotent(subject):
    engine, d = subject.engine, lambda: Deadline(STEP_S)
    status = engine.status()
    assert status.healthy and not status.paused, status
    engine.pause(PauseMode.KEEP, d())
    assert engine.status().paused
    engine.pause(PauseMode.KEEP, d())  # a no-op
    engine.pause(PauseMode.WAIT, d())  # nothing left to drain: returns at once
    status = engine.status()
    assert status.healthy and status.paused, status
    engine.resume(d())
    assert not engine.status().paused
    engine.resume(d())  # a no-op
    status = engine.status()
    assert status.healthy and not status.paused, status


def test_world_size_and_partial_on_failure_of_a_fresh_engine(subject):
    engine = subject.engine
    assert type(engine.world_size) is int and engine.world_size >= 1
    assert engine.partial_on_failure is False


def test_reset_cache_while_paused(subject):
    engine = subject.engine
    engine.pause(PauseMode.WAIT, Deadline(STEP_S))
    assert engine.reset_cache(Deadline(STEP_S)) is True
    engine.resume(Deadline(STEP_S))


def transfer(engine: Engine, plan: RefitPlan, weights: dict[str, torch.Tensor],
             version: int) -> None:
    """Join, pause, receive every bucket (once each, in order) of `weights`, and commit
    `version`; the engine is left paused, as the shim leaves it until Flush."""
    joined = form_group(engine, plan)
    try:
        engine.pause(PauseMode.KEEP, Deadline(STEP_S))
        receive = Receive(engine, plan, Deadline(EPOCH_S))
        Sender(joined.trainer, plan).send(weights, Deadline(EPOCH_S))
        receive.join(EPOCH_S)
        assert receive.error is None, receive.error
        assert receive.buckets == list(plan.buckets)  # once per bucket, in order
        engine.finish(version, Deadline(STEP_S))
    finally:
        joined.trainer.close()


def test_a_full_transfer_leaves_the_trainers_weights(subject):
    engine, plan = subject.engine, subject.plan()
    assert len(plan.buckets) > 1
    engine.check_plan(plan)
    version = next(_versions)
    weights = perturbed(subject.base, seed=1)
    t0 = time.monotonic()
    transfer(engine, plan, weights, version)
    assert engine.status().paused  # the shim resumes, not the engine
    assert engine.reset_cache(Deadline(STEP_S))
    subject.holds(plan, weights, version)
    print(f"\n{engine.kind}: {plan.total_bytes} bytes in {len(plan.buckets)} buckets, join to "
          f"verified in {time.monotonic() - t0:.2f}s")


def test_a_staged_epoch_serves_the_old_weights_until_the_flip(subject):
    """An engine that stages receives the whole epoch while serving (never paused) and keeps
    the old weights until `flip`, which loads exactly what was staged; its staged digest is the
    trainer's. Twice in a row, so an engine that serves from the copy it flipped to (the
    reference engine in store mode) is seen to land the next epoch beside it, not in it. One
    that cannot stage says so (STAGING_UNSUPPORTED) without touching anything."""
    engine, plan = subject.engine, subject.plan()
    if not engine.capabilities.staging:
        with pytest.raises(RefitError) as e:
            engine.stage(plan, Deadline(STEP_S), lambda b: None)
        assert e.value.reason == Reason.STAGING_UNSUPPORTED
        return
    old, old_version = perturbed(subject.base, seed=5), next(_versions)
    transfer(engine, plan, old, old_version)
    engine.resume(Deadline(STEP_S))
    joined = form_group(engine, plan)
    try:
        for seed in (6, 7):
            new = perturbed(subject.base, seed=seed)
            landed: list[Bucket] = []
            box: dict = {}

            def stage(box: dict = box, landed: list[Bucket] = landed) -> None:
                try:
                    box["digest"] = engine.stage(plan, Deadline(EPOCH_S), landed.append)
                except BaseException as e:  # noqa: BLE001  (asserted below)
                    box["error"] = e

            thread = threading.Thread(target=stage, daemon=True, name="contract-stage")
            thread.start()
            checksums = StagedDigest(plan)
            Sender(joined.trainer, plan).send(new, Deadline(EPOCH_S), checksums=checksums)
            thread.join(EPOCH_S)
            assert not thread.is_alive() and "error" not in box, box.get("error")
            assert box["digest"] == checksums.hexdigest()
            assert sorted(b.index for b in landed) == [b.index for b in plan.buckets]
            assert not engine.status().paused  # staging never pauses
            subject.holds(plan, old, old_version)  # it serves the old weights: they did not move
            engine.pause(PauseMode.KEEP, Deadline(STEP_S))
            new_version = next(_versions)
            engine.flip(new_version, Deadline(EPOCH_S))
            assert engine.reset_cache(Deadline(STEP_S))
            subject.holds(plan, new, new_version)
            engine.resume(Deadline(STEP_S))  # serving, as the next stage() needs
            old, old_version = new, new_version
    finally:
        joined.trainer.close()


def committed_peer(plan: RefitPlan, weights: dict[str, torch.Tensor]) -> ReferenceEngine:
    """A reference engine (store mode) whose committed copy holds `weights`: staged from a
    trainer and flipped, as a fleet member after a staged epoch."""
    peer = ReferenceEngine(model=None)
    joined = form_group(peer, plan)
    box: dict = {}
    try:
        thread = threading.Thread(target=lambda: box.setdefault(
            "digest", peer.stage(plan, Deadline(EPOCH_S), lambda b: None)), daemon=True)
        thread.start()
        Sender(joined.trainer, plan).send(weights, Deadline(EPOCH_S))
        thread.join(EPOCH_S)
    finally:
        joined.trainer.close()
    peer.abort_transfer()
    peer.pause(PauseMode.KEEP, Deadline(STEP_S))
    peer.flip(1, Deadline(STEP_S))
    peer.resume(Deadline(STEP_S))
    assert peer.committed_copy == (1, box["digest"])
    return peer


def test_a_catch_up_lands_a_peers_committed_copy_and_the_flip_loads_it(subject):
    """Catch-up from a peer (docs/protocol.md): the engine joins a group whose rank 0 is a peer
    serving its committed copy (`serve_copy`, on the peer's own rendezvous store), stages it
    (the staged digest is the peer copy's), and `flip` loads exactly those weights. The trainer
    is in none of it. An engine that cannot stage cannot catch up either."""
    engine, plan = subject.engine, subject.plan()
    if not engine.capabilities.staging:
        pytest.skip(f"the {engine.kind} engine cannot stage (STAGING_UNSUPPORTED, checked above)")
    weights = perturbed(subject.base, seed=8)
    peer = committed_peer(plan, weights)
    try:
        _, copy_digest = peer.committed_copy
        world = 1 + engine.world_size
        group_id = f"catch-up-{uuid.uuid4().hex[:8]}"
        store = bind_master_store("127.0.0.1", 0, world, STEP_S)
        box: dict = {}

        def serve() -> None:
            try:
                peer.serve_copy(GroupSpec("127.0.0.1", store.port, world, 0, "gloo", group_id),
                                store, Deadline(EPOCH_S))
            except BaseException as e:  # noqa: BLE001  (asserted below)
                box["error"] = e

        server = threading.Thread(target=serve, daemon=True, name="contract-peer")
        server.start()
        engine.init_transfer(GroupSpec("127.0.0.1", store.port, world, 1, "gloo", group_id),
                             plan, Deadline(STEP_S))
        landed: list[Bucket] = []
        assert engine.stage(plan, Deadline(EPOCH_S), landed.append) == copy_digest
        server.join(EPOCH_S)
        assert not server.is_alive() and "error" not in box, box.get("error")
        assert sorted(b.index for b in landed) == [b.index for b in plan.buckets]
        assert not engine.status().paused
        engine.abort_transfer()
        engine.pause(PauseMode.KEEP, Deadline(STEP_S))
        version = next(_versions)
        engine.flip(version, Deadline(EPOCH_S))
        assert engine.reset_cache(Deadline(STEP_S))
        subject.holds(plan, weights, version)
        assert peer.committed_copy == (1, copy_digest)  # serving only read it
    finally:
        peer.close()


def stage_and_flip(engine: Engine, plan: RefitPlan, weights: dict[str, torch.Tensor],
                   version: int, base: torch.Tensor | None = None,
                   keep_previous: bool = False) -> str:
    """A staged epoch of `weights` into `engine` (a delta against `base`, the sender's last
    version in plan layout, when given; updated in place), flipped at `version` and resumed;
    returns the staged digest, which is the trainer's."""
    joined = form_group(engine, plan)
    box: dict = {}
    try:
        def stage() -> None:
            try:
                box["digest"] = engine.stage(plan, Deadline(EPOCH_S), lambda b: None,
                                             delta=base is not None,
                                             keep_previous=keep_previous)
            except BaseException as e:  # noqa: BLE001  (asserted below)
                box["error"] = e

        thread = threading.Thread(target=stage, daemon=True, name="contract-stage")
        thread.start()
        checksums = StagedDigest(plan)
        if base is None:
            Sender(joined.trainer, plan).send(weights, Deadline(EPOCH_S), checksums=checksums)
        else:
            box["stats"] = send_delta(joined.trainer, plan, weights, base, Deadline(EPOCH_S),
                                      checksums.add)
        thread.join(EPOCH_S)
        assert not thread.is_alive() and "error" not in box, box.get("error")
        assert box["digest"] == checksums.hexdigest()
    finally:
        joined.trainer.close()
    engine.abort_transfer()
    engine.pause(PauseMode.KEEP, Deadline(STEP_S))
    engine.flip(version, Deadline(EPOCH_S))
    assert engine.reset_cache(Deadline(STEP_S))
    engine.resume(Deadline(STEP_S))
    if "stats" in box:
        stats = box["stats"]
        print(f"\n{engine.kind}: delta epoch, {stats.sparse_buckets}/{stats.buckets} buckets "
              f"sparse, {stats.wire_bytes} of {stats.bytes} bytes on the wire")
    return box["digest"]


def test_a_delta_epoch_applies_onto_the_committed_copy(subject):
    """The copy a flip loaded stays as the engine's committed copy (`committed_copy`: the
    flip's version and staged digest). A delta epoch (`stage(..., delta=True)`, only what
    changed on the wire) applies onto it: its staged digest is a full epoch's of the new
    weights, the engine serves the old ones until the flip, and the flip loads the new ones.
    An engine that keeps no committed copy says so (DELTA_BASE_MISMATCH, nothing staged)."""
    engine, plan = subject.engine, subject.plan()
    if not engine.capabilities.staging:
        pytest.skip(f"the {engine.kind} engine cannot stage (STAGING_UNSUPPORTED, checked above)")
    assert engine.capabilities.delta
    joined = form_group(engine, plan)
    try:  # a fresh engine (as the shim constructs one) holds no committed copy yet
        with pytest.raises(RefitError) as refused:
            engine.stage(plan, Deadline(STEP_S), lambda b: None, delta=True)
        assert refused.value.reason == Reason.DELTA_BASE_MISMATCH, refused.value
    finally:
        joined.trainer.close()
    engine.abort_transfer()
    old = perturbed(subject.base, seed=11)
    old_version = next(_versions)
    old_digest = stage_and_flip(engine, plan, old, old_version)
    assert engine.committed_copy == (old_version, old_digest)
    subject.holds(plan, old, old_version)
    # A small step: one element in 97 of every floating tensor moves (most words unchanged).
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        if t.is_floating_point():
            t.view(-1)[::97] += 0.25
    base = flat_copy(plan, old)
    new_version = next(_versions)
    new_digest = stage_and_flip(engine, plan, new, new_version, base=base)
    assert new_digest != old_digest
    assert engine.committed_copy == (new_version, new_digest)
    subject.holds(plan, new, new_version)


def test_a_flip_rolls_back_to_the_previous_copy(subject):
    """A reversible stage (`keep_previous=True`) keeps the committed copy as the previous copy
    (`previous_copy`); `restore_previous` makes it the staged copy and a flip loads it at its
    version: the engine serves the old weights again, its committed copy is the old one, and
    no copy is kept before it (one step back). A drop between the two gives both copies back.
    A delta epoch applies beside the kept copy, not onto it."""
    engine, plan = subject.engine, subject.plan()
    if not engine.capabilities.staging:
        pytest.skip(f"the {engine.kind} engine cannot stage (STAGING_UNSUPPORTED, checked above)")
    assert engine.capabilities.rollback
    old = perturbed(subject.base, seed=13)
    old_version = next(_versions)
    old_digest = stage_and_flip(engine, plan, old, old_version)
    assert engine.previous_copy is None  # not reversible: nothing kept
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        if t.is_floating_point():
            t.view(-1)[::89] -= 0.25
    new_version = next(_versions)
    new_digest = stage_and_flip(engine, plan, new, new_version, base=flat_copy(plan, old),
                                keep_previous=True)
    assert engine.committed_copy == (new_version, new_digest)
    assert engine.previous_copy == (old_version, old_digest)
    subject.holds(plan, new, new_version)

    assert engine.restore_previous(Deadline(STEP_S)) == (old_version, old_digest)
    engine.drop_staged()  # the rollback never flips: both copies are back
    assert engine.committed_copy == (new_version, new_digest)
    assert engine.previous_copy == (old_version, old_digest)

    assert engine.restore_previous(Deadline(STEP_S)) == (old_version, old_digest)
    engine.pause(PauseMode.KEEP, Deadline(STEP_S))
    engine.flip(old_version, Deadline(EPOCH_S))
    assert engine.reset_cache(Deadline(STEP_S))
    engine.resume(Deadline(STEP_S))
    assert engine.committed_copy == (old_version, old_digest)
    assert engine.previous_copy is None
    subject.holds(plan, old, old_version)
    with pytest.raises(RefitError) as refused:
        engine.restore_previous(Deadline(STEP_S))
    assert refused.value.reason == Reason.NO_PREVIOUS_COPY, refused.value


def test_the_committed_copy_serves_a_catch_up(subject):
    """Catch-up from this engine (docs/protocol.md): after a staged epoch it serves its
    committed copy (`serve_copy`, rank 0 of a group whose rendezvous the caller hosts) to a
    newcomer while it keeps serving; the newcomer stages exactly those bytes (the staged
    digest is the copy's) and the engine's own copy and weights are untouched."""
    engine, plan = subject.engine, subject.plan()
    if not engine.capabilities.staging:
        pytest.skip(f"the {engine.kind} engine cannot stage (STAGING_UNSUPPORTED, checked above)")
    assert engine.capabilities.serving_copy
    weights = perturbed(subject.base, seed=12)
    version = next(_versions)
    digest = stage_and_flip(engine, plan, weights, version)
    newcomer = ReferenceEngine(model=None)
    try:
        group_id = f"catch-up-{uuid.uuid4().hex[:8]}"
        store = bind_master_store("127.0.0.1", 0, 2, STEP_S)
        box: dict = {}
        sent: list[Bucket] = []

        def serve() -> None:
            try:
                engine.serve_copy(GroupSpec("127.0.0.1", store.port, 2, 0, "gloo", group_id),
                                  store, Deadline(EPOCH_S), sent.append)
            except BaseException as e:  # noqa: BLE001  (asserted below)
                box["error"] = e

        server = threading.Thread(target=serve, daemon=True, name="contract-serve")
        server.start()
        newcomer.init_transfer(GroupSpec("127.0.0.1", store.port, 2, 1, "gloo", group_id),
                               plan, Deadline(STEP_S))
        assert not engine.status().paused  # serving a copy never pauses the engine
        assert newcomer.stage(plan, Deadline(EPOCH_S), lambda b: None) == digest
        server.join(EPOCH_S)
        assert not server.is_alive() and "error" not in box, box.get("error")
        assert sorted(b.index for b in sent) == [b.index for b in plan.buckets]
        newcomer.abort_transfer()
        newcomer.pause(PauseMode.KEEP, Deadline(STEP_S))
        newcomer.flip(1, Deadline(STEP_S))
        for spec in plan.tensors:
            assert torch.equal(newcomer.tensor(spec.name), weights[spec.name]), spec.name
        assert engine.committed_copy == (version, digest)  # serving only read it
        subject.holds(plan, weights, version)
    finally:
        newcomer.close()


def test_the_canary_is_computed_with_the_new_weights_before_the_engine_serves(subject):
    """After `finish`, still paused: the engine's teacher-forced log-probabilities of the canary
    equal the trainer's under the weights just sent, and the engine is paused again afterwards
    (the shim resumes only at Flush). An engine without a canary says so, typed."""
    engine, plan = subject.engine, subject.plan()
    if subject.canary_truth is None:
        assert not engine.capabilities.canary
        with pytest.raises(RefitError) as refused:
            engine.canary_logprobs(CANARY, Deadline(STEP_S))
        assert refused.value.reason == Reason.CANARY_UNSUPPORTED
        return
    assert engine.capabilities.canary
    version = next(_versions)
    weights = perturbed(subject.base, seed=2)
    transfer(engine, plan, weights, version)
    t0 = time.monotonic()
    got = engine.canary_logprobs(CANARY, Deadline(STEP_S))
    seconds = time.monotonic() - t0
    want = subject.canary_truth(weights, CANARY)
    gap = max(abs(a - b) for a, b in zip(got, want, strict=True))
    before = subject.canary_truth(subject.base, CANARY)
    moved = max(abs(a - b) for a, b in zip(want, before))
    print(f"\n{engine.kind}: canary gap {gap:.1e} (the weights moved it {moved:.3f}) in "
          f"{seconds * 1e3:.0f} ms")
    assert gap <= FP32_TOLERANCE < moved
    assert engine.status().paused


def test_abort_transfer_fails_a_blocked_receive_promptly_and_never_blocks(subject, request):
    engine, plan = subject.engine, subject.plan()
    joined = form_group(engine, plan)  # the trainer joined and never sends
    try:
        engine.pause(PauseMode.KEEP, Deadline(STEP_S))
        receive = Receive(engine, plan, Deadline(EPOCH_S))
        time.sleep(subject.settle_s)
        assert receive.thread.is_alive(), receive.error
        t0 = time.monotonic()
        engine.abort_transfer()
        abort_s = time.monotonic() - t0
        assert abort_s < 1.0, f"abort_transfer blocked {abort_s:.2f}s"
        receive.join(5.0)  # promptly: well inside the receive's own deadline
        failed_s = receive.ended_at - t0
    finally:
        joined.trainer.close()  # (this alone would fail the receive: the trainer's end closed)
    assert isinstance(receive.error, RefitError), receive.error
    assert receive.buckets == []
    print(f"\n{engine.kind}: abort_transfer returned in {abort_s * 1e3:.0f} ms, the receive "
          f"failed {failed_s:.2f}s later: {type(receive.error).__name__}: {receive.error}")


def test_a_receive_without_a_sender_ends_at_its_deadline(subject):
    engine, plan = subject.engine, subject.plan()
    deadline_s = 3.0
    joined = form_group(engine, plan)  # the trainer joined and never sends
    try:
        engine.pause(PauseMode.KEEP, Deadline(STEP_S))
        receive = Receive(engine, plan, Deadline(deadline_s))
        took = receive.join(deadline_s + 10.0)
    finally:
        joined.trainer.close()
    assert isinstance(receive.error, (RefitTimeoutError, EpochAbortedError)), receive.error
    assert 1.0 <= took < deadline_s + 10.0, took
    assert receive.buckets == []
    print(f"\n{engine.kind}: deadline {deadline_s:.0f}s, the receive ended after {took:.2f}s: "
          f"{type(receive.error).__name__}: {receive.error}")
