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

import sys

from refit_grpc.testing.harness import VLLM, Run, demo_cli, run_reported, timed
from refit_grpc.testing.vllm import PROMPT, build_tiny_llama, complete, hf_greedy, load_hf_model


def run_demo(engines: int = 2, steps: int = 3, train_steps: int = 5, gen_tokens: int = 12,
             buffer_size_bytes: int = 256 * 1024, out=sys.stdout) -> int:
    def demo(run: Run) -> None:
        model_dir = run.build_model(build_tiny_llama, say_path=True)
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
        last = expected
        for line, _ in run.train_and_refit(model, steps, train_steps):
            expected = hf_greedy(model, PROMPT, gen_tokens)
            got = [complete(s.url, PROMPT, gen_tokens)["token_ids"] for s in servers]
            ok = run.check(all(g == expected for g in got))
            versions = [d.weight_version for d in fleet.describe()]
            changed = run.check(expected != last)
            verdict = "ok" if ok else f"MISMATCH {got}"
            run.say(f"{line} versions={versions} engines={verdict} "
                    f"{'changed' if changed else 'UNCHANGED'} tokens={expected}")
            last = expected

    return run_reported("demo-vllm", demo, out)


def main(argv: list[str] | None = None) -> int:
    return demo_cli("python -m refit_grpc.tools.demo_vllm", __doc__, run_demo, argv, engines=2)


if __name__ == "__main__":
    sys.exit(main())
