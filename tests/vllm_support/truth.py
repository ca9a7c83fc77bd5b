"""Teacher-forced truth for a real vLLM: what the engine computes for every position of a fixed
sequence, next to what transformers computes with the same weights.

Greedy tokens only compare argmaxes: a wrong output projection, a stale copy of one matrix or a
half-applied refit can leave them unchanged. The log-probability of each actual next token of a
sequence (vLLM's `prompt_logprobs`, transformers' `log_softmax` of the logits) is a number per
position that moves with every weight, so comparing those is the check here.

The Llama model and its tokenizer, the server launcher and the completions helpers are the
harness's (`refit_grpc.testing.vllm`), the server + shim + Fleet of one engine is
`vllm_support.servers.Rig`; this adds a tied-embedding Qwen2-style model (GQA, q/k/v biases)
next to it, the two sides' log-probabilities, and the trainer's plain SGD step.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from refit_grpc.integrations.hf import canary_from_model
from refit_grpc.proto import pb
from refit_grpc.testing.logprobs import SEQUENCE, hf_logprobs  # noqa: F401  (re-exported)
from refit_grpc.testing.vllm import (
    PROMPT,
    SERVED_MODEL,
    complete,
    hf_greedy,
    http_json,
    toy_batch,
)

from vllm_support.servers import Rig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# Every tiny model: 2 layers, hidden 128, 4 query heads of 32 (vLLM's CPU attention supports head
# sizes 32, 64, 80, ...), 2 key/value heads, vocabulary 512 (the harness's tokenizer).
_COMMON = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0,
               eos_token_id=1, torch_dtype="float32")


def tiny_config(family: str):
    """The transformers config of one architecture family the refit is proven on:

    - `qwen2`: tied embeddings, GQA, biases on q/k/v;
    - `phi3`: fused names in the checkpoint itself (`qkv_proj`, `gate_up_proj`), which vLLM
      loads as they are (no split/merge on either side);
    - `qwen2_moe`: 4 routed experts 64 wide (a multiple of 32: vLLM CPU prepacks, no padding),
      top-2, plus a gated shared expert;
    - `mixtral`: 4 experts 80 wide, which vLLM CPU pads to 96 for its grouped GEMM (the width
      whose reload failed with a size mismatch);
    - `qwen3_moe`: 4 experts 64 wide, q/k norms, no shared expert.
    """
    import transformers as tf

    if family == "qwen2":
        return tf.Qwen2Config(**_COMMON, intermediate_size=256, tie_word_embeddings=True,
                              use_sliding_window=False)
    if family == "phi3":
        return tf.Phi3Config(**_COMMON, intermediate_size=256, pad_token_id=2,
                             tie_word_embeddings=False)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**_COMMON, intermediate_size=256, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=128, num_experts=4,
                                 num_experts_per_tok=2, tie_word_embeddings=False,
                                 use_sliding_window=False)
    if family == "mixtral":
        return tf.MixtralConfig(**_COMMON, intermediate_size=80, num_local_experts=4,
                                num_experts_per_tok=2, head_dim=32, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_COMMON, intermediate_size=256, moe_intermediate_size=64,
                                 num_experts=4, num_experts_per_tok=2, head_dim=32,
                                 tie_word_embeddings=False, use_sliding_window=False)
    raise ValueError(f"no tiny model of family {family!r}")


def build_tiny(family: str, out_dir: str | Path, tokenizer_dir: str | Path,
               seed: int = 0, **overrides) -> Path:
    """A random tiny model of `family` (`tiny_config`, with `overrides` set on it, e.g.
    `tie_word_embeddings=True`) saved as safetensors in checkpoint format, next to a copy of
    `tokenizer_dir`'s tokenizer. A tied model's checkpoint has no `lm_head.weight`
    (transformers saves a tied tensor once), so vLLM ties."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            shutil.copy(src, out / name)
    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_qwen2(out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0) -> Path:
    return build_tiny("qwen2", out_dir, tokenizer_dir, seed)


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def engine_logprobs(url: str, sequence: Sequence[int] = SEQUENCE,
                    timeout_s: float = 60.0, model: str = SERVED_MODEL) -> torch.Tensor:
    """The same numbers from vLLM: /v1/completions with `prompt_logprobs`. vLLM answers one entry
    per prompt position (None for the first), each a dict token id -> {"logprob", ...} of the
    top-k tokens plus the prompt's own token, which is always included. `model`: the base model
    by default, or the name of a LoRA adapter the engine serves."""
    status, body = http_json("POST", url, "/v1/completions", {
        "model": model, "prompt": list(sequence), "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 1}, timeout_s)
    if status != 200:
        raise RuntimeError(f"/v1/completions on {url}: HTTP {status}: {body}")
    entries = body["choices"][0]["prompt_logprobs"]
    if len(entries) != len(sequence) or entries[0] is not None:
        raise RuntimeError(f"prompt_logprobs: {len(entries)} entries for {len(sequence)} "
                           f"tokens, first {entries[0]!r}")
    return torch.tensor([float(entry[str(tok)]["logprob"])
                         for entry, tok in zip(entries[1:], sequence[1:])], dtype=torch.float64)


def sgd_step(model, lr: float, gen: torch.Generator, batch: int = 8, length: int = 32) -> float:
    """One plain SGD step of the trainer on the toy pattern; every parameter moves, the tied
    embedding included. Returns the loss."""
    model.train()
    seqs = toy_batch(model.config.vocab_size, batch, length, gen)
    loss = model(seqs, labels=seqs).loss
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    model.eval()
    return loss.item()


def state_dict_to_send(model, with_lm_head: bool, dtype: torch.dtype | None = None) -> dict:
    """What a trainer sends: transformers' state dict names a tied output projection twice
    (`lm_head.weight` and `model.embed_tokens.weight`, one tensor); `with_lm_head=False` drops
    the alias, as a trainer that sends each tensor once does."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and not with_lm_head:
            continue
        t = t.detach()
        out[name] = (t.to(dtype) if dtype is not None else t).contiguous().clone()
    return out


FP32_TOL = 2e-3  # measured: <= 7e-7 before and after every refit (tied and untied)
# bfloat16 keeps 8 bits of mantissa: a log-probability near -6 is rounded by up to ~0.016 in one
# step, and two bf16 forwards of the same bf16 weights differ by their rounding order only.
# Measured here: vLLM bf16 vs transformers bf16 <= 0.004, transformers bf16 vs transformers fp32
# of the same bf16 weights <= 0.0035. 0.02 is five times that, ten times below the error of the
# stale output projection (about 0.2) and thirty times below one version's movement.
BF16_TOL = 2e-2
MIN_MOVE = 0.05  # each version moves some log-probability by at least this (SGD, lr 0.5)
LR = 0.5
VERSIONS = 3
GREEDY = 8


def refit_versions(rig: Rig, trainer: dict, *, with_lm_head: bool = True,
                   send_dtype: torch.dtype | None = None, tol: float = FP32_TOL,
                   reference=lambda model: model, greedy: bool = True,
                   noise=None, send=None, epochs=None) -> list[float]:
    """VERSIONS trained versions into `rig`: after each, teacher-forced log-probabilities equal
    the trainer's (within `tol`) and moved since the version before. `send(model)` is what the
    trainer sends (default: its state dict, `state_dict_to_send`); `reference` turns the
    trainer's model into the one the engine must match (a bf16 copy for a bf16 engine);
    `noise(model)`, printed only, is what rounding alone does to the reference; `epochs`, one
    per version, what each is (`InPlace()`, `Staged()`; default: in place). Returns the
    gaps."""
    model = trainer["model"]
    engine = engine_logprobs(rig.url)
    gap = (engine - hf_logprobs(reference(model))).abs().max().item()
    assert gap <= tol, f"{rig.name} v{trainer['version']}: gap {gap:.2e} before this refit"
    gaps = []
    for i in range(VERSIONS):
        epoch = epochs[i] if epochs else None
        loss = sgd_step(model, LR, trainer["gen"])
        version = trainer["version"] + 1
        tensors = (send(model) if send is not None
                   else state_dict_to_send(model, with_lm_head, send_dtype))
        # The runtime proof rides on every version: the canary computed from the reference.
        canary = canary_from_model(reference(model), SEQUENCE, tol)
        report = rig.refit(tensors, version, canary=canary, epoch=epoch)
        (worker,) = report.workers
        assert worker.canary_gap is not None and worker.canary_gap <= tol, worker
        assert report.version == version
        trainer["version"] = version
        before, engine = engine, engine_logprobs(rig.url)
        truth = hf_logprobs(reference(model))
        gap = (engine - truth).abs().max().item()
        moved = (engine - before).abs().max().item()
        gaps.append(gap)
        kind = "in place" if epoch is None else type(epoch).__name__
        print(f"{rig.name} v{version} {kind} ({len(tensors)} tensors, loss {loss:.3f}): "
              f"max |vLLM - transformers| = {gap:.2e}, moved {moved:.3f}, canary gap "
              f"{worker.canary_gap:.1e} in {worker.canary_seconds * 1e3:.0f} ms of a "
              f"{report.seconds * 1e3:.0f} ms epoch"
              + (f", rounding noise of the reference {noise(model):.2e}" if noise else ""))
        assert gap <= tol, (f"{rig.name} v{version}: vLLM's log-probabilities differ from "
                            f"transformers' by {gap:.4f} (tolerance {tol}): {engine - truth}")
        assert moved >= max(MIN_MOVE, 10 * tol), \
            f"{rig.name} v{version}: log-probabilities moved by {moved:.4f} only"
        if greedy:
            assert complete(rig.url, PROMPT, GREEDY)["token_ids"] == \
                hf_greedy(reference(model), PROMPT, GREEDY), f"{rig.name} v{version}"
        (d,) = rig.fleet.describe()
        assert (d.state, d.weight_version) == (pb.SHIM_STATE_READY, version), d
        assert http_json("GET", rig.url, "/weight_info")[1] == {"weight_version": str(version)}
    return gaps
