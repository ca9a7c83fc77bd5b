"""The main job, end to end: a trainer trains a tiny LM and refits a fleet of shims every step.

Each shim is its own process with the reference engine. After every epoch the demo proves that
every worker holds exactly the trainer's weights (digest) and behaves like them (greedy tokens).
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc
import torch

from refit_grpc.driver import Fleet, WorkerEndpoint
from refit_grpc.models.tiny_lm import TinyLM, TinyLMConfig
from refit_grpc.plan import Packing, weights_digest
from refit_grpc.proto import ref_pb, ref_pb_grpc
from refit_grpc.shim.process import ShimProcess, spawn_shim

PROMPT = [5, 17, 42, 9]


def toy_batch(cfg: TinyLMConfig, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Sequences that follow t[i+1] = (3 * t[i] + 1) mod vocab: learnable in a few steps."""
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
    seq = [start]
    for _ in range(length - 1):
        seq.append((3 * seq[-1] + 1) % cfg.vocab_size)
    return torch.cat(seq, dim=1)


def generate_on(address: str, prompt: list[int], n: int) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = ref_pb_grpc.ReferenceEngineServiceStub(channel)
        reply = stub.Generate(ref_pb.GenerateRequest(prompt=prompt, max_new_tokens=n), timeout=30)
    return list(reply.tokens)


def run_demo(workers: int = 3, steps: int = 5, buffer_size_bytes: int = 256 * 1024,
             out=sys.stdout) -> int:
    torch.manual_seed(1234)
    cfg = TinyLMConfig()
    model = TinyLM(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    shims: list[ShimProcess] = []
    failures = 0
    try:
        t0 = time.monotonic()
        # Different seeds: every worker starts with weights unlike the trainer's.
        shims = [spawn_shim("--seed", str(100 + i), "--instance-id", f"worker-{i}")
                 for i in range(workers)]
        print(f"started {workers} shims in {time.monotonic() - t0:.1f}s: "
              f"{', '.join(s.address for s in shims)}", file=out, flush=True)
        fleet = Fleet([WorkerEndpoint(s.instance_id, s.address) for s in shims],
                      packing=Packing(buffer_size_bytes, 2), control_timeout_s=30,
                      epoch_timeout_s=60)
        plan = fleet.prepare({n: (t.shape, t.dtype) for n, t in model.named_weights()})
        link = fleet.connect("127.0.0.1")
        print(f"plan {plan.digest[:12]}: {len(plan.tensors)} tensors, {plan.total_bytes} bytes, "
              f"{len(plan.buckets)} buckets; group of {1 + workers} formed", file=out, flush=True)
        for step in range(1, steps + 1):
            model.train()
            for _ in range(10):
                batch = toy_batch(cfg, 16, 24, gen)
                logits = model(batch[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, cfg.vocab_size), batch[:, 1:].reshape(-1))
                optim.zero_grad()
                loss.backward()
                optim.step()
            model.eval()
            weights = dict(model.named_weights())
            report = fleet.refit(link, weights, version=step)
            want_digest = weights_digest((s.name, weights[s.name]) for s in plan.tensors)
            want_tokens = model.generate(PROMPT, 8)
            digests_ok = all(d.weights_digest == want_digest for d in fleet.describe())
            tokens = [generate_on(s.address, PROMPT, 8) for s in shims]
            tokens_ok = all(t == want_tokens for t in tokens)
            ok = digests_ok and tokens_ok
            failures += not ok
            print(f"epoch v={report.version} loss={loss.item():.3f} bytes={report.bytes} "
                  f"seconds={report.seconds:.3f} GB/s={report.gbps:.3f} "
                  f"digest={'ok' if digests_ok else 'MISMATCH'}:{want_digest[:12]} "
                  f"generate={'ok' if tokens_ok else 'MISMATCH'} tokens={want_tokens}",
                  file=out, flush=True)
        link.close()
        fleet.close()
    finally:
        codes = [s.stop() for s in shims]
    if any(codes):
        print(f"shims exited with {codes}", file=out)
        failures += 1
    print("demo OK" if not failures else f"demo FAILED ({failures} bad epochs)", file=out)
    return 0 if not failures else 1


def add_arguments(demo: argparse.ArgumentParser) -> None:
    """The flags of `refit-grpc demo`."""
    demo.add_argument("--workers", type=int, default=3)
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--buffer-size-bytes", type=int, default=256 * 1024)


def run(args: argparse.Namespace) -> int:
    """`refit-grpc demo`."""
    return run_demo(workers=args.workers, steps=args.steps, buffer_size_bytes=args.buffer_size_bytes)
