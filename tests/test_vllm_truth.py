"""Does a refit vLLM compute what the trainer's model computes? Teacher-forced log-probabilities.

For a fixed 26-token sequence, vLLM's `prompt_logprobs` (the log-probability of each actual next
token) must equal transformers' `log_softmax` of the same weights' logits at every position,
after each of several refits through a real shim (`Fleet.refit`), and must have moved between
versions by far more than the tolerance (a refit that changed nothing would pass otherwise).
Greedy tokens are checked too, as the weaker check they are: with a stale output projection they
still matched in two of three versions.

Architectures, one vLLM server each, reused across its versions:
(a) tied embeddings, GQA, q/k/v biases (Qwen2-style), the trainer sending each tensor once
    (no `lm_head.weight`);
(b) the same model and server, the trainer sending transformers' whole state dict, which names
    the tied tensor twice; and a trainer sending two different tensors under the two names;
(c) the untied tiny Llama of the other vLLM tests;
(d) (a) served in bfloat16, its second and third versions staged: the flip installs the
    linear layers prepared in bf16 while the engine served.

At most two servers run at once: the servers of (a)/(b) and (c) boot together, (d)'s boots
while (c) runs.
"""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch

from vllm_support import require_vllm, tiny_model_dir
from vllm_support.servers import module_pool

require_vllm()

pytestmark = [pytest.mark.timeout(600), pytest.mark.engine]

from refit_grpc import EpochFailedError, InPlace, Staged  # noqa: E402
from refit_grpc.proto import pb  # noqa: E402

from vllm_support.truth import (  # noqa: E402
    BF16_TOL,
    FP32_TOL,
    build_tiny_qwen2,
    engine_logprobs,
    hf_logprobs,
    load_model,
    refit_versions,
    state_dict_to_send,
)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with module_pool(tmp_path_factory, "vllm-truth-logs") as pool:
        yield pool


@pytest.fixture(scope="module")
def rigs(pool, vllm_servers, tmp_path_factory):
    """The three servers, started in the order the tests use them, two at a time (the Llama one
    is the session's, serving its checkpoint)."""
    qwen2 = build_tiny_qwen2(tmp_path_factory.mktemp("qwen2") / "tied", tiny_model_dir())
    rigs = {"tied": pool.rig("tied", qwen2), "bf16": pool.rig("bf16", qwen2, dtype="bfloat16")}
    rigs["tied"].start()
    rigs["llama"] = pool.rig("llama", tiny_model_dir(),
                             server=vllm_servers.server(tiny_model_dir()))
    yield rigs
    survivors = [pid for r in rigs.values() for pid in r.close()]
    assert not survivors, f"vLLM processes outlived their rig: {survivors}"


@pytest.fixture(scope="module")
def tied_trainer(rigs):
    return {"model": load_model(rigs["tied"].model_dir), "version": 0,
            "gen": torch.Generator().manual_seed(0)}


def test_tied_embeddings_sent_once_refit_to_the_trainers_log_probabilities(rigs, tied_trainer):
    """(a) The trainer sends `model.embed_tokens.weight` only: the engine's tied output
    projection must follow it (without the fix it kept the old one: gap 0.16-0.21)."""
    rigs["tied"].ready()
    refit_versions(rigs["tied"], tied_trainer, with_lm_head=False)


def test_tied_embeddings_sent_under_both_names_refit_to_the_same_log_probabilities(
        rigs, tied_trainer):
    """(b) transformers' state dict names the tied tensor twice; the engine loads it once."""
    refit_versions(rigs["tied"].ready(), tied_trainer, with_lm_head=True)


def test_two_different_tensors_for_one_tied_parameter_fail_the_update_then_a_refit_recovers(
        rigs, tied_trainer):
    """A trainer whose `lm_head.weight` differs from its embedding (an untied model in front
    of a tied engine) cannot be served: the worker refuses the update instead of choosing one;
    the next whole update commits and the engine matches the trainer again."""
    rig, model = rigs["tied"].ready(), tied_trainer["model"]
    sent = state_dict_to_send(model, with_lm_head=True)
    sent["lm_head.weight"] = sent["lm_head.weight"] + 0.01
    with pytest.raises(EpochFailedError) as failed:
        rig.refit(sent, tied_trainer["version"] + 1)
    (failure,) = failed.value.failures
    assert "one tied parameter" in failure.message, failure
    (d,) = rig.fleet.describe()
    assert d.state == pb.SHIM_STATE_BROKEN, d  # layers before lm_head.weight took new values
    version = tied_trainer["version"] + 2
    rig.refit(state_dict_to_send(model, with_lm_head=False), version)
    tied_trainer["version"] = version
    gap = (engine_logprobs(rig.url) - hf_logprobs(model)).abs().max().item()
    assert gap <= FP32_TOL, gap
    (d,) = rig.fleet.describe()
    assert (d.state, d.weight_version) == (pb.SHIM_STATE_READY, version), d
    rigs["tied"].close()  # frees its memory and a core for the bf16 server
    rigs["bf16"].start()


def test_untied_llama_refit_to_the_trainers_log_probabilities(rigs):
    """(c) The tiny Llama of the other vLLM tests: untied, `lm_head.weight` is its own tensor."""
    rig = rigs["llama"].ready()
    trainer = {"model": load_model(rig.model_dir), "version": 0,
               "gen": torch.Generator().manual_seed(1)}
    refit_versions(rig, trainer, with_lm_head=True)
    rig.close()


def test_tied_embeddings_in_bfloat16_refit_to_the_trainers_log_probabilities(rigs):
    """(d) The tied model served with --dtype bfloat16 (vLLM CPU serves it here; AVX-512), the
    trainer sending bf16 tensors once each; the truth is transformers in bf16 on the same bf16
    weights. Greedy tokens are not compared: near-ties flip under bf16 rounding. Versions 2
    and 3 are staged: each flip installs the linear layers prepared in bf16 beside the engine
    (vllm_plugin/prepared.py) and loads the tied embedding and the norms through the session."""
    for other in ("tied", "llama"):  # no-ops when the tests before closed them
        rigs[other].close()
    t0 = time.monotonic()
    rig = rigs["bf16"].ready()
    print(f"bf16 server ready {time.monotonic() - t0:.1f}s after the last test needed it")
    trainer = {"model": load_model(rig.model_dir), "version": 0,
               "gen": torch.Generator().manual_seed(2)}

    def bf16(model):
        return copy.deepcopy(model).to(torch.bfloat16)

    def noise(model):
        """transformers in bf16 next to transformers in fp32, both on the same bf16 weights."""
        rounded = bf16(model).to(torch.float32)
        return (hf_logprobs(bf16(model)) - hf_logprobs(rounded)).abs().max().item()

    refit_versions(rig, trainer, with_lm_head=False, send_dtype=torch.bfloat16, tol=BF16_TOL,
                   reference=bf16, greedy=False, noise=noise,
                   epochs=(InPlace(), Staged(), Staged()))
    # Per decoder layer qkv_proj, o_proj, gate_up_proj, down_proj; the head is tied: not prepared.
    installed = re.findall(r"the flip installed (\d+) prepared layers",
                           rig.server.log_path.read_text(errors="replace"))
    assert installed == ["8", "8"], installed


# --- the worker's routing of the two names of a tied parameter, without a server ---------------


def _routes(plan_names):
    from refit_grpc.vllm_plugin.engine import TiedRoutes

    tie = type("Tie", (), {"head_name": "lm_head.weight",
                           "embedding_name": "model.embed_tokens.weight"})()
    return TiedRoutes([tie], set(plan_names))


def test_routes_load_the_embedding_and_check_the_head_against_it():
    both = ["model.embed_tokens.weight", "x", "lm_head.weight"]
    emb = torch.randn(4, 3)
    r = _routes(both)
    assert r.load_as("model.embed_tokens.weight", emb) == "model.embed_tokens.weight"
    assert r.load_as("x", torch.zeros(1)) == "x"
    assert r.load_as("lm_head.weight", emb.clone()) is None
    r = _routes(both)  # the head first: still not loaded, still checked
    assert r.load_as("lm_head.weight", emb.clone()) is None
    assert r.load_as("model.embed_tokens.weight", emb) == "model.embed_tokens.weight"
    r = _routes(both)
    r.load_as("model.embed_tokens.weight", emb)
    with pytest.raises(ValueError, match="one tied parameter"):
        r.load_as("lm_head.weight", emb + 1e-3)


def test_routes_load_a_head_sent_alone_as_the_embedding():
    r = _routes(["lm_head.weight", "x"])
    assert r.load_as("lm_head.weight", torch.zeros(2)) == "model.embed_tokens.weight"
    r = _routes(["model.embed_tokens.weight"])
    assert r.load_as("model.embed_tokens.weight", torch.zeros(2)) == "model.embed_tokens.weight"


def test_update_info_keeps_both_names_of_a_tied_parameter_for_either_backend():
    """The shim never drops `lm_head.weight` from a plan: the receiver cuts the broadcast bytes
    by these names and shapes (vLLM's nccl consumer too), and the gloo worker decides which of
    the two names it loads (docs/vllm.md, Tied embeddings)."""
    from refit_grpc.plan import Packing, RefitPlan
    from refit_grpc.wire.vllm import update_info_for

    plan = RefitPlan.from_state_dict_info({"model.embed_tokens.weight": ((8, 4), torch.float32),
                                           "lm_head.weight": ((8, 4), torch.float32)},
                                          Packing(64, 2))
    for backend in ("gloo", "nccl"):
        info = update_info_for(plan, backend, 10.0)
        assert info["names"] == ["model.embed_tokens.weight", "lm_head.weight"], backend
        assert info["shapes"] == [[8, 4], [8, 4]]
