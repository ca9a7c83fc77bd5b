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
from its own venv (`make dynamo`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from refit_grpc.testing.logprobs import SEQUENCE, hf_logprobs
from refit_grpc.testing.vllm import PROMPT, hf_greedy, load_hf_model, toy_batch

TOL = 2e-3


def run_demo(steps: int = 3, train_steps: int = 5, gen_tokens: int = 8,
             buffer_size_bytes: int = 256 * 1024, out=sys.stdout) -> int:
    import torch

    from refit_grpc.integrations.dynamo import DynamoDiscovery, ShimAddressing
    from refit_grpc.shim.process import ShimProcess, spawn_shim
    from refit_grpc.testing.dynamo import (
        DynamoFrontend,
        DynamoWorker,
        build_dynamo_model,
        frontend_greedy,
        frontend_logprobs,
    )

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    torch.manual_seed(1234)
    procs: list = []
    shims: list[ShimProcess] = []
    fleet = link = None
    failures = 0
    with tempfile.TemporaryDirectory(prefix="refit-demo-dynamo-") as tmp:
        try:
            t0 = time.monotonic()
            model_dir = build_dynamo_model(Path(tmp) / "tiny")
            say(f"built tiny Llama + tokenizer in {time.monotonic() - t0:.1f}s")
            discovery_dir = Path(tmp) / "discovery"
            discovery_dir.mkdir()
            ncpu = os.cpu_count() or 1
            t0 = time.monotonic()
            workers = [DynamoWorker(model_dir, discovery_dir, cpu_bind=str(i % ncpu),
                                    log_path=Path(tmp) / f"worker-{i}.log") for i in range(2)]
            frontend = DynamoFrontend(discovery_dir, log_path=Path(tmp) / "frontend.log")
            procs = [*workers, frontend]
            for p in procs:
                p.start()
            for w in workers:
                w.wait_ready()
            frontend.wait_ready(60)
            frontend.wait_for([w.url for w in workers])
            say(f"started 2 Dynamo workers and the frontend in {time.monotonic() - t0:.1f}s: "
                f"workers {', '.join(w.url for w in workers)}, frontend {frontend.url}")
            shims = [spawn_shim("--engine", "dynamo", "--engine-url", w.url, "--instance-id",
                                f"dynamo-{i}", "--buffer-size-bytes", str(buffer_size_bytes),
                                "--num-buffers", "2") for i, w in enumerate(workers)]
            # One machine: every worker's host is 127.0.0.1, so the operator's mapping (by
            # system_url) rather than the host + shim port convention.
            discovery = DynamoDiscovery(frontend.rl_url, ShimAddressing(
                overrides={w.url: s.address for w, s in zip(workers, shims)}))
            for r in discovery.records():
                say(f"discovery: worker {r['instance_id']} at {r['system_url']} "
                    f"-> shim {discovery.addressing.address(r)}")
            fleet = discovery.fleet(control_timeout_s=30, join_timeout_s=20, epoch_timeout_s=120)
            ids = [int(e.instance_id) for e in fleet.endpoints]
            model = load_hf_model(model_dir)
            plan = fleet.prepare({n: (t.shape, t.dtype) for n, t in model.state_dict().items()})
            link = fleet.connect("127.0.0.1")
            say(f"plan {plan.digest[:12]}: {len(plan.tensors)} tensors, {plan.total_bytes} bytes,"
                f" {len(plan.buckets)} buckets; group of 3 formed")
            truth = hf_logprobs(model)
            last = [frontend_logprobs(frontend.url, i, SEQUENCE) for i in ids]
            gaps = [(lp - truth).abs().max().item() for lp in last]
            failures += any(g > TOL for g in gaps)
            say(f"before training: max |Dynamo - transformers| = "
                f"{', '.join(f'{g:.1e}' for g in gaps)}")
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(0)
            vocab = model.config.vocab_size
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
                truth = hf_logprobs(model)
                expected = hf_greedy(model, PROMPT, gen_tokens)
                now = [frontend_logprobs(frontend.url, i, SEQUENCE) for i in ids]
                gaps = [(lp - truth).abs().max().item() for lp in now]
                moved = [(a - b).abs().max().item() for a, b in zip(now, last)]
                greedy = [frontend_greedy(frontend.url, i, PROMPT, gen_tokens) for i in ids]
                versions = [w.post("get_weight_version")[1].get("version") for w in workers]
                ok = all(g <= TOL for g in gaps) and all(g == expected for g in greedy)
                changed = all(m >= 0.01 for m in moved)
                committed = versions == [report.version] * len(workers)
                failures += (not ok) + (not changed) + (not committed)
                say(f"step {step}: loss={loss.item():.3f} refit v={report.version} "
                    f"{report.bytes} bytes in {report.seconds:.3f}s dynamo_versions={versions} "
                    f"logprob_gap={max(gaps):.1e} moved={min(moved):.3f} "
                    f"greedy={'ok' if ok else 'MISMATCH ' + str(greedy)} tokens={expected}")
                last = now
        except Exception as e:  # noqa: BLE001  (the demo reports and fails)
            failures += 1
            say(f"demo failed: {type(e).__name__}: {e}")
            for p in procs:
                if p.proc is not None and p.proc.poll() is not None:
                    say(f"--- {p.log_path} ---\n{p.log_tail()}")
        finally:
            if link is not None:
                link.close()
            if fleet is not None:
                fleet.close()
            for s in shims:
                s.stop()
            for p in procs:
                p.stop()
            left = [pid for p in procs for pid in p.group_pids()]
            if left:
                failures += 1
                say(f"processes left behind: {left}")
    say("demo-dynamo OK" if failures == 0 else f"demo-dynamo FAILED ({failures} problems)")
    return 0 if failures == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m refit_grpc.tools.demo_dynamo",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=5, help="optimiser steps per refit")
    parser.add_argument("--buffer-size-bytes", type=int, default=256 * 1024)
    args = parser.parse_args(argv)
    return run_demo(steps=args.steps, train_steps=args.train_steps,
                    buffer_size_bytes=args.buffer_size_bytes)


if __name__ == "__main__":
    sys.exit(main())
