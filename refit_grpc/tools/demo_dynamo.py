"""`make demo-dynamo`: two NVIDIA Dynamo vLLM workers, each behind a shim, found through Dynamo's RL
discovery; a trainer refits them after every optimisation step.

    python -m refit_grpc.tools.demo_dynamo [--steps 3]

A tiny Llama and its tokenizer are built offline into a temporary directory (no hub). Two Dynamo
1.6.1 vLLM workers serve it (CPU, `--enable-rl`, the project's worker extension
`refit_grpc.vllm_plugin.dynamo_extension`), with Dynamo's frontend (file discovery, TCP request
plane, no etcd or NATS). Each worker gets a shim, `refit-grpc shim --engine dynamo --engine-url
<system_url>`. The trainer (this process) reads Dynamo's RL discovery (`/v1/rl/workers`), maps
each worker to its shim (`refit_grpc.integrations.dynamo`) and builds a `Fleet` that re-reads
discovery before every epoch. It takes a few AdamW steps on a toy sequence and refits both
workers after each step. Then, through Dynamo's frontend (`/v1/completions`, routed to each worker
by its instance id), every worker's teacher-forced log-probabilities must equal transformers' on
the trainer's weights (fp32, within 2e-3) and its greedy tokens must equal the trainer's; the
log-probabilities must have moved since the step before, and each worker's Dynamo weight version
must be the one committed. Exits non-zero on any mismatch.

The processes are started by `refit_grpc.testing.dynamo`, as in tests/test_dynamo.py; Dynamo runs
from its own venv (`make dynamo`). The run/report/teardown skeleton is
`refit_grpc.testing.harness`'s, shared with `make demo-vllm`: the teardown proves no Dynamo
process survived.
"""

from __future__ import annotations

import sys

from refit_grpc.testing.harness import DYNAMO, Run, demo_cli, run_reported, timed
from refit_grpc.testing.logprobs import SEQUENCE, hf_logprobs
from refit_grpc.testing.vllm import PROMPT, hf_greedy, load_hf_model

TOL = 2e-3


def run_demo(steps: int = 3, train_steps: int = 5, gen_tokens: int = 8,
             buffer_size_bytes: int = 256 * 1024, out=sys.stdout) -> int:
    from refit_grpc.integrations.dynamo import DynamoDiscovery, ShimAddressing
    from refit_grpc.testing.dynamo import build_dynamo_model, frontend_greedy, frontend_logprobs

    def demo(run: Run) -> None:
        model_dir = run.build_model(build_dynamo_model)
        with timed(run, lambda sec: f"started 2 Dynamo workers and the frontend in {sec:.1f}s: "
                                    f"workers {', '.join(w.url for w in workers)}, "
                                    f"frontend {frontend.url}"):
            workers, frontend = DYNAMO.start_workers(run, model_dir, 2)
        shims = run.engine_shims(DYNAMO.engine, [w.url for w in workers], "dynamo",
                                 buffer_size_bytes)
        # One machine: every worker's host is 127.0.0.1, so the operator's mapping (by
        # system_url) rather than the host + shim port convention.
        discovery = DynamoDiscovery(frontend.rl_url, ShimAddressing(
            overrides={w.url: s.address for w, s in zip(workers, shims)}))
        for r in discovery.records():
            run.say(f"discovery: worker {r['instance_id']} at {r['system_url']} "
                    f"-> shim {discovery.addressing.address(r)}")
        fleet = run.fleet = discovery.fleet(control_timeout_s=30, join_timeout_s=20,
                                            epoch_timeout_s=120)
        ids = [int(e.instance_id) for e in fleet.endpoints]
        model = load_hf_model(model_dir)
        run.prepare_and_connect(model)
        truth = hf_logprobs(model)
        last = [frontend_logprobs(frontend.url, i, SEQUENCE) for i in ids]
        gaps = [(lp - truth).abs().max().item() for lp in last]
        run.check(all(g <= TOL for g in gaps))
        run.say(f"before training: max |Dynamo - transformers| = "
                f"{', '.join(f'{g:.1e}' for g in gaps)}")
        for line, report in run.train_and_refit(model, steps, train_steps):
            truth = hf_logprobs(model)
            expected = hf_greedy(model, PROMPT, gen_tokens)
            now = [frontend_logprobs(frontend.url, i, SEQUENCE) for i in ids]
            gaps = [(lp - truth).abs().max().item() for lp in now]
            moved = [(a - b).abs().max().item() for a, b in zip(now, last)]
            greedy = [frontend_greedy(frontend.url, i, PROMPT, gen_tokens) for i in ids]
            versions = [w.post("get_weight_version")[1].get("version") for w in workers]
            ok = run.check(all(g <= TOL for g in gaps) and all(g == expected for g in greedy))
            run.check(all(m >= 0.01 for m in moved))
            run.check(versions == [report.version] * len(workers))
            run.say(f"{line} dynamo_versions={versions} "
                    f"logprob_gap={max(gaps):.1e} moved={min(moved):.3f} "
                    f"greedy={'ok' if ok else 'MISMATCH ' + str(greedy)} tokens={expected}")
            last = now

    return run_reported("demo-dynamo", demo, out)


def main(argv: list[str] | None = None) -> int:
    return demo_cli("python -m refit_grpc.tools.demo_dynamo", __doc__, run_demo, argv)


if __name__ == "__main__":
    sys.exit(main())
