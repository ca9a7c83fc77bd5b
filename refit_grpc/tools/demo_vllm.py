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
same way. The run/report/teardown skeleton is `refit_grpc.testing.harness`'s, shared with
`make demo-dynamo`: the teardown proves no vLLM process survived.
"""

from __future__ import annotations

import argparse
import sys

from refit_grpc.testing.harness import VLLM, Run, run_reported, timed, train
from refit_grpc.testing.vllm import PROMPT, build_tiny_llama, complete, hf_greedy, load_hf_model


def run_demo(engines: int = 2, steps: int = 3, train_steps: int = 5, gen_tokens: int = 12,
             buffer_size_bytes: int = 256 * 1024, out=sys.stdout) -> int:
    import torch

    def demo(run: Run) -> None:
        torch.manual_seed(1234)
        with timed(run, lambda sec: f"built tiny Llama + tokenizer in {sec:.1f}s: {model_dir}"):
            model_dir = build_tiny_llama(run.workdir / "tiny")
        with timed(run, lambda sec: f"started {engines} vLLM engines in {sec:.1f}s: "
                                    f"{', '.join(s.url for s in servers)}"):
            servers = VLLM.start_servers(run, model_dir, engines)
        run.engine_shims(VLLM.engine, [s.url for s in servers], "vllm", buffer_size_bytes)
        fleet = run.fleet_of_shims(control_timeout_s=30, join_timeout_s=60, epoch_timeout_s=120)
        model = load_hf_model(model_dir)
        run.prepare_and_connect(model)
        before = [complete(s.url, PROMPT, gen_tokens)["token_ids"] for s in servers]
        expected = hf_greedy(model, PROMPT, gen_tokens)
        same = run.check(all(b == expected for b in before))
        run.say(f"before training: engines {'==' if same else '!='} trainer: {expected}")
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(0)
        last = expected
        for step in range(1, steps + 1):
            loss = train(model, optim, gen, train_steps)
            report = fleet.refit(run.link, model.state_dict())
            expected = hf_greedy(model, PROMPT, gen_tokens)
            got = [complete(s.url, PROMPT, gen_tokens)["token_ids"] for s in servers]
            ok = run.check(all(g == expected for g in got))
            versions = [d.weight_version for d in fleet.describe()]
            changed = run.check(expected != last)
            run.say(f"step {step}: loss={loss:.3f} refit v={report.version} "
                    f"{report.bytes} bytes in {report.seconds:.3f}s versions={versions} "
                    f"engines={'ok' if ok else 'MISMATCH ' + str(got)} "
                    f"{'changed' if changed else 'UNCHANGED'} tokens={expected}")
            last = expected

    return run_reported("demo-vllm", demo, out)


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
