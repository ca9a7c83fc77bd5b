"""`make demo-vllm`: two real vLLM CPU engines, each behind a shim, refit after every training step.

    python -m refit_grpc.tools.demo_vllm [--engines 2] [--steps 3]

A tiny Llama and its tokenizer are built offline into a temporary directory (no hub). Each engine
is a vLLM OpenAI server started with the project's `gloo` weight-transfer backend
(`refit_grpc.vllm_plugin`); each shim is `refit-grpc shim --engine vllm`. The trainer (this
process) holds the same model in transformers, takes a few AdamW steps on a toy sequence, and
after each step `Fleet.refit` pushes the weights into both engines. Then every engine's greedy
tokens from /v1/completions must equal the trainer's own greedy decoding with the new weights,
and they must have changed since the step before. Exits non-zero on any mismatch.

The model builder, server launcher, completions and greedy decoding are
`refit_grpc.testing.vllm`'s, which the test suite uses too: the demo and the tests run vLLM the
same way.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from refit_grpc.testing.vllm import (
    PROMPT,
    VLLMServer,
    build_tiny_llama,
    complete,
    hf_greedy,
    load_hf_model,
    toy_batch,
)


def run_demo(engines: int = 2, steps: int = 3, train_steps: int = 5, gen_tokens: int = 12,
             buffer_size_bytes: int = 256 * 1024, out=sys.stdout) -> int:
    import torch

    from refit_grpc.driver import Fleet, WorkerEndpoint
    from refit_grpc.shim.process import ShimProcess, spawn_shim

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    torch.manual_seed(1234)
    servers: list[VLLMServer] = []
    shims: list[ShimProcess] = []
    fleet = link = None
    failures = 0
    with tempfile.TemporaryDirectory(prefix="refit-demo-vllm-") as tmp:
        try:
            t0 = time.monotonic()
            model_dir = build_tiny_llama(Path(tmp) / "tiny")
            say(f"built tiny Llama + tokenizer in {time.monotonic() - t0:.1f}s: {model_dir}")
            ncpu = os.cpu_count() or 1
            t0 = time.monotonic()
            servers = [VLLMServer(model_dir, log_path=Path(tmp) / f"vllm-{i}.log",
                                  cpu_bind=str(i % ncpu)).start() for i in range(engines)]
            for s in servers:
                s.wait_ready()
            say(f"started {engines} vLLM engines in {time.monotonic() - t0:.1f}s: "
                f"{', '.join(s.url for s in servers)}")
            shims = [spawn_shim("--engine", "vllm", "--engine-url", s.url, "--instance-id",
                                f"vllm-{i}", "--buffer-size-bytes", str(buffer_size_bytes),
                                "--num-buffers", "2") for i, s in enumerate(servers)]
            fleet = Fleet([WorkerEndpoint(p.instance_id, p.address) for p in shims],
                          control_timeout_s=30, join_timeout_s=60, epoch_timeout_s=120)
            model = load_hf_model(model_dir)
            plan = fleet.prepare({n: (t.shape, t.dtype) for n, t in model.state_dict().items()})
            link = fleet.connect("127.0.0.1")
            say(f"plan {plan.digest[:12]}: {len(plan.tensors)} tensors, {plan.total_bytes} bytes,"
                f" {len(plan.buckets)} buckets; group of {1 + engines} formed")
            before = [complete(s.url, PROMPT, gen_tokens)["token_ids"] for s in servers]
            expected = hf_greedy(model, PROMPT, gen_tokens)
            same = all(b == expected for b in before)
            failures += not same
            say(f"before training: engines {'==' if same else '!='} trainer: {expected}")
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(0)
            vocab = model.config.vocab_size
            last = expected
            for step in range(1, steps + 1):
                model.train()
                for _ in range(train_steps):
                    batch = toy_batch(vocab, 8, 32, gen)
                    loss = model(batch, labels=batch).loss
                    optim.zero_grad()
                    loss.backward()
                    optim.step()
                model.eval()
                report = fleet.refit(link, model.state_dict())
                expected = hf_greedy(model, PROMPT, gen_tokens)
                got = [complete(s.url, PROMPT, gen_tokens)["token_ids"] for s in servers]
                ok = all(g == expected for g in got)
                versions = [d.weight_version for d in fleet.describe()]
                changed = expected != last
                failures += (not ok) + (not changed)
                say(f"step {step}: loss={loss.item():.3f} refit v={report.version} "
                    f"{report.bytes} bytes in {report.seconds:.3f}s versions={versions} "
                    f"engines={'ok' if ok else 'MISMATCH ' + str(got)} "
                    f"{'changed' if changed else 'UNCHANGED'} tokens={expected}")
                last = expected
        except Exception as e:  # noqa: BLE001  (the demo reports and fails)
            failures += 1
            say(f"demo failed: {type(e).__name__}: {e}")
            for s in servers:
                if s.proc is not None and s.proc.poll() is not None:
                    say(f"--- {s.log_path} ---\n{s.log_tail()}")
        finally:
            if link is not None:
                link.close()
            if fleet is not None:
                fleet.close()
            for p in shims:
                p.stop()
            for s in servers:
                s.stop()
    say("demo-vllm OK" if failures == 0 else f"demo-vllm FAILED ({failures} problems)")
    return 0 if failures == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refit_grpc.tools.demo_vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=5, help="optimiser steps per refit")
    parser.add_argument("--buffer-size-bytes", type=int, default=256 * 1024)
    args = parser.parse_args(argv)
    return run_demo(engines=args.engines, steps=args.steps, train_steps=args.train_steps,
                    buffer_size_bytes=args.buffer_size_bytes)


if __name__ == "__main__":
    sys.exit(main())
