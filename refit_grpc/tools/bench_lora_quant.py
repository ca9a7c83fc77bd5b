"""What people serve, measured side by side in one run on real vLLM CPU engines (docs/bench.md,
"Adapters and quantized engines"):

1. An adapter epoch against a full epoch of the same model: one vLLM with LoRA enabled, the
   same shim; full epochs in place and staged, then LoRA adapter epochs (rank 16 on all seven
   projections): bytes, epoch time, stall.
2. A quantized engine's refit against the same model unquantized: the same Llama served in bf16,
   then in bf16 with `--quantization fp8_per_channel`; in-place epochs (time) and staged epochs
   (the flip's stall, and its load): fp8 re-derives its weights and scales at every load.

Each engine runs alone (the others are stopped), with the bench-stall model (a random Llama);
the versions are the checkpoint plus noise, made up front. Medians over the counted epochs,
after one warm-up each. `--quick` (that the bench runs, for CI) boots the three servers at once,
up front, instead of each after the last one stopped: its timings then share the cores with the
boots and mean nothing, as its one epoch of each kind already does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from refit_grpc.driver.options import InPlace, Staged
from refit_grpc.integrations.quantization import FP8_DENSE
from refit_grpc.testing.harness import Run, run_reported
from refit_grpc.tools.bench_stall import build_model, versions

RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def run_bench_lora_quant(epochs: int = 5, hidden: int = 512, layers: int = 6,
                         buffer_size_bytes: int = 4 << 20, boot_together: bool = False,
                         out=sys.stdout) -> int:
    """Runs the bench (module docstring) and prints its table; returns the exit status.

    Args:
        epochs: epochs of each kind counted (after one warm-up of each).
        hidden: the Llama's width.
        layers: its layers.
        buffer_size_bytes: the shim's bucket size.
        boot_together: start every server up front (`--quick`), not each when it is needed.
        out: where the report goes.
    """
    rows: list[str] = []

    def body(run: Run) -> None:
        model_dir = run.build_model(lambda d: build_model(d, hidden, layers))
        servers = _Servers(run, model_dir)
        if boot_together:
            for name in SERVERS:
                servers.start(name)
        rows.extend(_adapters(run, servers, epochs, buffer_size_bytes))
        rows.extend(_quantized(run, servers, epochs, buffer_size_bytes))

    status = run_reported("bench-lora-quant", body, out)
    for line in rows:
        print(line, file=out)
    return status


# The bench's servers: name -> (vLLM flags, environment).
SERVERS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "lora": (("--enable-lora", "--max-lora-rank", str(RANK)), LORA_ENV),
    "bf16": (("--dtype", "bfloat16"), {}),
    FP8_DENSE: (("--dtype", "bfloat16", "--quantization", FP8_DENSE), {}),
}


class _Servers:
    """The bench's vLLM servers (`SERVERS`), each started on first use or up front."""

    def __init__(self, run: Run, model_dir):
        self.run, self.model_dir = run, model_dir
        self._started: dict[str, Any] = {}

    def start(self, name: str) -> Any:
        from refit_grpc.testing.vllm import VLLMServer

        if name not in self._started:
            extra_args, env = SERVERS[name]
            server = VLLMServer(self.model_dir, log_path=self.run.workdir / f"{name}.log",
                                extra_args=extra_args, env=env, own_session=False)
            self.run.servers.append(server)
            self._started[name] = server.start()
        return self._started[name]


class _Engine:
    """One vLLM server with one shim and a one-engine Fleet, stopped by `close`."""

    def __init__(self, run: Run, servers: _Servers, name: str, buffer_size_bytes: int):
        from refit_grpc.driver import Fleet, WorkerEndpoint
        from refit_grpc.shim.process import spawn_shim

        self.server = servers.start(name).wait_ready()
        run.say(f"{name}: vLLM ready in {self.server.ready_seconds:.0f}s")
        self.shim = spawn_shim("--engine", "vllm", "--engine-url", self.server.url,
                               "--instance-id", name, "--buffer-size-bytes",
                               str(buffer_size_bytes), "--num-buffers", "2")
        run.shims.append(self.shim)
        self.fleet = Fleet([WorkerEndpoint(name, self.shim.address)], control_timeout_s=30,
                           join_timeout_s=60, epoch_timeout_s=300)
        self.link: Any = None

    def prepare(self, tensors: dict, **options: Any) -> Any:
        if self.link is not None:
            self.link.close()
        plan = self.fleet.prepare({n: (t.shape, t.dtype) for n, t in tensors.items()},
                                  **options)
        self.link = self.fleet.connect("127.0.0.1")
        return plan

    def epochs(self, weights: list[dict], epoch_of: Callable[[], Any], first_version: int,
               run: Run, label: str) -> tuple[list[float], list[float], list[float]]:
        """One epoch per entry of `weights` (the first a warm-up, not counted): their seconds,
        stalls and flip loads."""
        seconds, stalls, loads = [], [], []
        for i, tensors in enumerate(weights):
            start = time.monotonic()
            report = self.fleet.refit(self.link, tensors, version=first_version + i,
                                      epoch=epoch_of())
            took = time.monotonic() - start
            (worker,) = report.workers
            stall = took if isinstance(epoch_of(), InPlace) else (report.stall_seconds or 0.0)
            run.say(f"{label} {'warm-up' if i == 0 else i}: {took * 1e3:.0f} ms, stall "
                    f"{stall * 1e3:.0f} ms")
            if i:
                seconds.append(took)
                stalls.append(stall)
                loads.append(worker.load_seconds or 0.0)
        return seconds, stalls, loads

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.fleet.close()
        self.shim.stop()
        self.server.stop()


def _ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def _adapters(run: Run, servers: _Servers, epochs: int, buffer_size_bytes: int) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from refit_grpc.plan import AdapterSpec
    from refit_grpc.testing.vllm import load_hf_model

    hf = load_hf_model(servers.model_dir)
    base = {n: t.detach().clone().contiguous() for n, t in hf.state_dict().items()}
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=TARGETS)
    names = get_peft_model_state_dict(get_peft_model(hf, config))
    gen = torch.Generator().manual_seed(0)
    adapter_versions = [{n: (0.01 * torch.randn(t.shape, generator=gen)).contiguous()
                         for n, t in names.items()} for _ in range(epochs + 1)]
    engine = _Engine(run, servers, "lora", buffer_size_bytes)
    try:
        full = versions(base, 2 * (epochs + 1), 1e-3)
        plan = engine.prepare(base)
        in_place = engine.epochs(full[:epochs + 1], InPlace, 1, run, "full in place")
        staged = engine.epochs(full[epochs + 1:], Staged, epochs + 2, run, "full staged")
        adapter_plan = engine.prepare(adapter_versions[0],
                                      adapter=AdapterSpec.of("bench", config.to_dict()))
        adapter = engine.epochs(adapter_versions, Staged, 2 * (epochs + 1) + 1, run, "adapter")
    finally:
        engine.close()
    full_mb, adapter_mb = plan.total_bytes / 1e6, adapter_plan.total_bytes / 1e6
    return [
        f"adapter epochs against full epochs, one vLLM CPU engine (LoRA enabled), medians of "
        f"{epochs}:",
        f"  full, in place:  {full_mb:8.2f} MB  epoch {_ms(in_place[0]):7.0f} ms  stall "
        f"{_ms(in_place[1]):6.0f} ms",
        f"  full, staged:    {full_mb:8.2f} MB  epoch {_ms(staged[0]):7.0f} ms  stall "
        f"{_ms(staged[1]):6.0f} ms",
        f"  adapter (r={RANK}):  {adapter_mb:8.2f} MB  epoch {_ms(adapter[0]):7.0f} ms  stall "
        f"{_ms(adapter[1]):6.0f} ms",
        f"  adapter / full staged: bytes {adapter_mb / full_mb:.3f}x, epoch "
        f"{_ms(adapter[0]) / _ms(staged[0]):.2f}x",
    ]


def _quantized(run: Run, servers: _Servers, epochs: int, buffer_size_bytes: int) -> list[str]:
    import torch

    from refit_grpc.testing.vllm import load_hf_model

    base = {n: t.detach().to(torch.bfloat16).contiguous()
            for n, t in load_hf_model(servers.model_dir).state_dict().items()}
    weights = versions(base, 2 * (epochs + 1), 1e-3)
    results = {}
    for label in ("bf16", FP8_DENSE):
        engine = _Engine(run, servers, label, buffer_size_bytes)
        try:
            plan = engine.prepare(base)
            in_place = engine.epochs(weights[:epochs + 1], InPlace, 1, run, f"{label} in place")
            staged = engine.epochs(weights[epochs + 1:], Staged, epochs + 2, run,
                                   f"{label} staged")
        finally:
            engine.close()
        results[label] = (in_place, staged)
    (bf_in, bf_st), (q_in, q_st) = results["bf16"], results[FP8_DENSE]
    return [
        f"a quantized engine against the same model unquantized ({plan.total_bytes / 1e6:.1f} "
        f"MB bf16 sent), medians of {epochs}:",
        f"  in-place epoch:    bf16 {_ms(bf_in[0]):7.0f} ms   {FP8_DENSE} {_ms(q_in[0]):7.0f} ms"
        f"   ({_ms(q_in[0]) / _ms(bf_in[0]):.2f}x)",
        f"  staged flip stall: bf16 {_ms(bf_st[1]):7.0f} ms   {FP8_DENSE} {_ms(q_st[1]):7.0f} ms"
        f"   ({_ms(q_st[1]) / _ms(bf_st[1]):.2f}x)",
        f"  staged flip load:  bf16 {_ms(bf_st[2]):7.0f} ms   {FP8_DENSE} {_ms(q_st[2]):7.0f} ms"
        f"   ({_ms(q_st[2]) / _ms(bf_st[2]):.2f}x)",
    ]


def add_arguments(lq: argparse.ArgumentParser) -> None:
    """The flags of `refit-grpc bench-lora-quant`."""
    lq.add_argument("--epochs", type=int, default=5,
                    help="epochs of each kind counted, after a warm-up of each")
    lq.add_argument("--hidden", type=int, default=512, help="the Llama's width")
    lq.add_argument("--layers", type=int, default=6, help="the Llama's layers")
    lq.add_argument("--buffer-size-bytes", type=int, default=4 << 20)
    lq.add_argument("--quick", action="store_true",
                    help="a 2-layer Llama of width 128, one epoch of each kind counted: that it "
                         "runs (vLLM's starts are most of it)")


def run(args: argparse.Namespace) -> int:
    """`refit-grpc bench-lora-quant`."""
    if args.quick:  # a 2-layer Llama of width 128, one epoch of each kind counted, the servers
        # booted together
        args.epochs, args.hidden, args.layers, args.buffer_size_bytes = 1, 128, 2, 1 << 20
    return run_bench_lora_quant(epochs=args.epochs, hidden=args.hidden, layers=args.layers,
                                buffer_size_bytes=args.buffer_size_bytes,
                                boot_together=args.quick)
