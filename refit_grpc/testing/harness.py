"""One run/report/teardown skeleton for the demos, the cycle measurements and the benchmark: start
engine(s), a shim in front of each and a `Fleet` on them, run and report refit cycles, then tear
everything down in reverse and prove no engine process survived.

What differs per engine is an arm (`VLLM`, `DYNAMO`): the shim's `--engine`, how its servers
start, and the direct baseline a shim's cycle is measured against (one cycle posted straight to
the engine's own routes). The servers and direct cycles themselves are `refit_grpc.testing.vllm`'s
and `refit_grpc.testing.dynamo`'s, imported where used, so importing this module costs nothing
where vLLM or Dynamo are not installed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Run:
    """What one demo or measurement started (engine servers, shims, a fleet and its link), and
    its report: `say` prints a line, `check` counts a problem, `teardown` stops everything in
    reverse order and counts any engine process left behind as a problem."""

    def __init__(self, name: str, workdir: Path | None, out=sys.stdout):
        self.name = name
        self._workdir = workdir
        self.out = out
        self.failures = 0
        self.servers: list[Any] = []  # VLLMServer and its Dynamo subclasses
        self.shims: list[Any] = []  # ShimProcess
        self.fleet: Any = None
        self.link: Any = None

    @property
    def workdir(self) -> Path:
        """Where the run's files go (models, logs); a run made without one writes none."""
        if self._workdir is None:
            raise RuntimeError(f"{self.name} has no working directory")
        return self._workdir

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def check(self, ok: bool) -> bool:
        """Count a problem where `ok` is false; returns `ok`."""
        self.failures += not ok
        return ok

    def spawn_shims(self, shim_args: Sequence[Sequence[str]], buffer_size_bytes: int,
                    num_buffers: int = 2) -> list[Any]:
        """One `refit-grpc shim` per entry of `shim_args` (its own arguments), with the packing,
        all started before any is waited for."""
        from refit_grpc.shim.process import spawn_shims

        self.shims.extend(spawn_shims([(*args, "--buffer-size-bytes", str(buffer_size_bytes),
                                        "--num-buffers", str(num_buffers))
                                       for args in shim_args]))
        return self.shims

    def engine_shims(self, engine: str, urls: Sequence[str], prefix: str,
                     buffer_size_bytes: int) -> list[Any]:
        """A shim `--engine engine` in front of each engine URL, named `prefix-<i>`."""
        return self.spawn_shims([("--engine", engine, "--engine-url", url, "--instance-id",
                                  f"{prefix}-{i}") for i, url in enumerate(urls)],
                                buffer_size_bytes)

    def fleet_of_shims(self, **options: Any) -> Any:
        from refit_grpc.driver import Fleet, WorkerEndpoint

        self.fleet = Fleet([WorkerEndpoint(s.instance_id, s.address) for s in self.shims],
                           **options)
        return self.fleet

    def prepare_and_connect(self, model) -> Any:
        """Prepare the fleet for `model`'s state dict and form the group; says the plan."""
        plan = self.fleet.prepare({n: (t.shape, t.dtype) for n, t in model.state_dict().items()})
        self.link = self.fleet.connect("127.0.0.1")
        self.say(f"plan {plan.digest[:12]}: {len(plan.tensors)} tensors, {plan.total_bytes} "
                 f"bytes, {len(plan.buckets)} buckets; group of {1 + len(self.fleet.endpoints)} "
                 "formed")
        return plan

    def build_model(self, builder: Callable[[Path], Path], *, say_path: bool = False) -> Path:
        """The trainer's seed set, then `builder(<workdir>/tiny)`; says how long it took."""
        import torch

        torch.manual_seed(1234)
        t0 = time.monotonic()
        model_dir = builder(self.workdir / "tiny")
        self.say(f"built tiny Llama + tokenizer in {time.monotonic() - t0:.1f}s"
                 + (f": {model_dir}" if say_path else ""))
        return model_dir

    def train_and_refit(self, model, steps: int, train_steps: int) -> Iterator[tuple[str, Any]]:
        """`steps` times: `train_steps` AdamW steps of `model` on the toy pattern, then
        `Fleet.refit` of its state dict on the run's link. Yields the step's report line so
        far (step, loss, version, bytes, seconds) and the refit's report."""
        import torch

        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(0)
        for step in range(1, steps + 1):
            loss = train(model, optim, gen, train_steps)
            report = self.fleet.refit(self.link, model.state_dict())
            yield (f"step {step}: loss={loss:.3f} refit v={report.version} {report.bytes} bytes "
                   f"in {report.seconds:.3f}s"), report

    def failed(self, e: BaseException) -> None:
        """The run stopped on `e`: say so, with the log of every engine server that exited."""
        self.failures += 1
        self.say(f"{self.name} failed: {type(e).__name__}: {e}")
        for s in self.servers:
            if s.proc is not None and s.proc.poll() is not None:
                self.say(f"--- {s.log_path} ---\n{s.log_tail()}")

    def teardown(self) -> list[int]:
        """Link, fleet, shims, then servers; returns (and counts as a problem) the pids of any
        server process left behind."""
        link, fleet, self.link, self.fleet = self.link, self.fleet, None, None
        if link is not None:
            link.close()
        if fleet is not None:
            fleet.close()
        for shim in self.shims:
            shim.stop()
        for server in self.servers:
            server.stop()
        left = [pid for server in self.servers for pid in server.group_pids()]
        if left:
            self.failures += 1
            self.say(f"processes left behind: {left}")
        return left

    def verdict(self) -> int:
        """Says `<name> OK` or `<name> FAILED (n problems)`; returns the exit status."""
        self.say(f"{self.name} OK" if self.failures == 0
                 else f"{self.name} FAILED ({self.failures} problems)")
        return 0 if self.failures == 0 else 1


def run_reported(name: str, body: Callable[[Run], None], out=sys.stdout) -> int:
    """`body(run)` in a temporary directory (`run.workdir`); an exception is reported as a
    failure, everything `run` holds is torn down whatever happened, and the verdict said.
    Returns the exit status (0: no problem)."""
    with tempfile.TemporaryDirectory(prefix=f"refit-{name}-") as tmp:
        run = Run(name, Path(tmp), out)
        try:
            body(run)
        except Exception as e:  # noqa: BLE001  (the run reports and fails)
            run.failed(e)
        finally:
            run.teardown()
    return run.verdict()


def demo_cli(prog: str, doc: str | None, run_demo: Callable[..., int],
             argv: list[str] | None, engines: int | None = None) -> int:
    """A demo's command line (`--steps`, `--train-steps`, `--buffer-size-bytes`, and `--engines`
    where it has a default): parses `argv` and returns `run_demo(**options)`."""
    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if engines is not None:
        parser.add_argument("--engines", type=int, default=engines)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=5, help="optimiser steps per refit")
    parser.add_argument("--buffer-size-bytes", type=int, default=256 * 1024)
    return run_demo(**vars(parser.parse_args(argv)))


@contextmanager
def timed(run: Run, what: Callable[[float], str]) -> Iterator[None]:
    """Says `what(seconds)` once the block is done."""
    t0 = time.monotonic()
    yield
    run.say(what(time.monotonic() - t0))


def train(model, optim, gen, steps: int, batch: int = 8, length: int = 32) -> float:
    """`steps` optimiser steps of the trainer on the toy pattern (`toy_batch`); returns the last
    loss, the model left in eval mode."""
    from refit_grpc.testing.vllm import toy_batch

    model.train()
    vocab = model.config.vocab_size
    for _ in range(steps):
        seqs = toy_batch(vocab, batch, length, gen)
        loss = model(seqs, labels=seqs).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval()
    return loss.item()


def cpu_bind(i: int) -> str:
    """The core engine `i` of a demo binds its threads to."""
    return str(i % (os.cpu_count() or 1))


# --- the arms: what differs per engine --------------------------------------------------------


class EngineArm:
    """One engine kind: the shim's `--engine`, and the module (`refit_grpc.testing.<engine>`)
    whose `direct_group`, `direct_cycle` and `release_group` are the direct baseline of a
    refit cycle: a group formed, cycles posted, the group released, straight to the engine's
    own routes."""

    engine = ""
    module = ""

    def _direct(self) -> Any:
        return importlib.import_module(self.module)

    def measure_refit_cycles(self, url: str, fleet, plan, make_weights, first_version: int,
                             reps: int = 5) -> dict[str, list[float]]:
        """Interleaved blocks (shim, direct, shim) of `reps` full cycles each, on one engine.
        The shim arm is `Fleet.refit` (UpdateWeights + Flush, membership check included); the
        direct arm is the module's `direct_cycle`. Group formation is outside the timings on
        both sides. Returns seconds per arm; the engine ends on the shim arm's last version,
        `first_version + 2 * reps - 1`."""
        direct = self._direct()
        times: dict[str, list[float]] = {"shim": [], "direct": []}
        version = first_version
        for arm in ("shim", "direct", "shim"):
            if arm == "shim":
                link = fleet.connect("127.0.0.1")
                try:
                    for _ in range(reps):
                        weights = make_weights(version)
                        t0 = time.monotonic()
                        fleet.refit(link, weights, version=version)
                        times["shim"].append(time.monotonic() - t0)
                        version += 1
                finally:
                    link.close()
                continue
            group = direct.direct_group(url, plan)
            try:
                for i in range(reps):
                    times["direct"].append(direct.direct_cycle(
                        url, group, plan, make_weights(10_000 + i), 10_000 + i))
            finally:
                group.close()
                direct.release_group(url)
        return times


class VLLMArm(EngineArm):
    """A vLLM OpenAI server (`refit_grpc.testing.vllm.VLLMServer`) behind `--engine vllm`."""

    engine = "vllm"
    module = "refit_grpc.testing.vllm"

    def start_servers(self, run: Run, model_dir: Path, count: int) -> list[Any]:
        """`count` servers of `model_dir`, each on its own core, ready; logs in the workdir."""
        from refit_grpc.testing.vllm import VLLMServer

        servers = [VLLMServer(model_dir, log_path=run.workdir / f"vllm-{i}.log",
                              cpu_bind=cpu_bind(i)) for i in range(count)]
        run.servers += servers
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        return servers


class DynamoArm(EngineArm):
    """Dynamo vLLM workers and their frontend (`refit_grpc.testing.dynamo`) behind
    `--engine dynamo`; a worker's URL is its system URL."""

    engine = "dynamo"
    module = "refit_grpc.testing.dynamo"

    def start_workers(self, run: Run, model_dir: Path, count: int) -> tuple[list[Any], Any]:
        """`count` workers of `model_dir` on their own cores and the frontend, on one file
        discovery directory in the workdir; returns once discovery lists every worker and the
        model serves."""
        from refit_grpc.testing.dynamo import DynamoFrontend, DynamoWorker

        discovery_dir = run.workdir / "discovery"
        discovery_dir.mkdir()
        workers = [DynamoWorker(model_dir, discovery_dir, cpu_bind=cpu_bind(i),
                                log_path=run.workdir / f"worker-{i}.log") for i in range(count)]
        frontend = DynamoFrontend(discovery_dir, log_path=run.workdir / "frontend.log")
        run.servers += [*workers, frontend]
        for p in run.servers:
            p.start()
        for w in workers:
            w.wait_ready()
        frontend.wait_ready(60)
        frontend.wait_for([w.url for w in workers])
        return workers, frontend


VLLM = VLLMArm()
DYNAMO = DynamoArm()

__all__ = ["DYNAMO", "VLLM", "DynamoArm", "EngineArm", "Run", "VLLMArm", "cpu_bind", "demo_cli",
           "run_reported", "timed", "train"]
