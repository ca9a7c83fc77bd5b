"""Support for the tests that run real NVIDIA Dynamo workers (tests/test_dynamo*.py, the engine
contract).

The processes are the harness's (`refit_grpc.testing.dynamo`), so the tests and
`make demo-dynamo` start Dynamo the same way. Added here: a skip with its stated condition when
Dynamo's virtual environment is missing, the session's shared deployment (`SharedDynamo`), and a
worker extension that only tests use.
"""

from __future__ import annotations

from refit_grpc.testing.dynamo import PYTHON_ENV, ROOT, dynamo_python

SKIP_REASON = (f"needs NVIDIA Dynamo's virtual environment ({ROOT / '.venv-dynamo'}, or "
               f"{PYTHON_ENV}): `make test` builds it through `make dynamo`")


def require_dynamo() -> None:
    """Skip the calling test module, with the reason, when Dynamo's venv is missing (never
    under `make test`, which builds it first)."""
    import pytest  # lazily: the Dynamo worker imports this package too (slow_join), without pytest

    if dynamo_python() is None:
        pytest.skip(SKIP_REASON, allow_module_level=True)


class SharedDynamo:
    """The session's one Dynamo worker (the tiny Llama, its OpenMP threads on core 0) and the
    frontend, file discovery, for the modules that need one worker and do not kill it
    (test_dynamo_staged, the engine contract): a Dynamo start costs 35-50 s on 2 cores.

    `get(fresh=...)` hands it out. A module that needs it serving its checkpoint asks
    `fresh=True`: it gets a new deployment if an earlier module changed the weights (each taker
    says so with `changed=True`), so the modules are right in any order and cheapest in the
    file order (the staged module first). A worker or frontend that died is started again."""

    def __init__(self, logs):
        self.logs = logs
        self.starts = 0
        self._current: dict | None = None
        self._changed = False
        self._stopped: list = []

    def get(self, *, fresh: bool, changed: bool) -> dict:
        """{"worker", "frontend", "model_dir", "discovery_dir"}; skips (stated) without Dynamo."""
        require_dynamo()
        current = self._current
        if current is not None and (
                (fresh and self._changed)
                or any(p.proc is None or p.proc.poll() is not None
                       for p in (current["worker"], current["frontend"]))):
            self._stop(current)
            current = None
        if current is None:
            current = self._start()
            self._changed = False
        self._current = current
        self._changed = self._changed or changed
        return current

    def _start(self) -> dict:
        from refit_grpc.testing.dynamo import DynamoFrontend, DynamoWorker, build_dynamo_model

        logs = self.logs / f"deployment-{self.starts}"
        logs.mkdir()
        model_dir = build_dynamo_model(logs / "tiny")
        discovery = logs / "discovery"
        discovery.mkdir()
        worker = DynamoWorker(model_dir, discovery, log_path=logs / "worker.log", cpu_bind="0")
        frontend = DynamoFrontend(discovery, log_path=logs / "frontend.log")
        deployment = {"worker": worker, "frontend": frontend, "model_dir": model_dir,
                      "discovery_dir": discovery}
        self._stopped.append(deployment)  # stop_all reaches it even if the start fails
        self.starts += 1
        worker.start()
        frontend.start()
        worker.wait_ready(300)
        frontend.wait_ready(60)
        frontend.wait_for([worker.url])
        self._stopped.remove(deployment)
        return deployment

    def _stop(self, deployment: dict) -> None:
        for p in (deployment["frontend"], deployment["worker"]):
            p.stop()
        self._stopped.append(deployment)

    def stop_all(self) -> list[int]:
        """Stop everything; the pids of any process that survived (must be empty)."""
        if self._current is not None:
            self._stop(self._current)
            self._current = None
        everyone = [p for d in self._stopped for p in (d["frontend"], d["worker"])]
        for p in everyone:
            p.stop()
        return sorted({pid for p in everyone for pid in p.group_pids()})
