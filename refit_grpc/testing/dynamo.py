"""Real NVIDIA Dynamo processes for tests, demos and measurements: vLLM workers (`dynamo.vllm`,
with the project's worker extension) and the frontend, on one machine, with file discovery and the
TCP request plane (no etcd, no NATS), every port on loopback.

Dynamo runs from its own virtual environment (`make dynamo` builds `.venv-dynamo`: Dynamo 1.6.1 on
vLLM's CPU build 0.31.0, see docker/install_dynamo.sh); the test process and the shims run from
the project's. `dynamo_python()` finds it (`REFIT_GRPC_DYNAMO_PYTHON` overrides).

Each process runs in its own session (process group), so `stop()` and `kill()` reach the worker's
EngineCore and vLLM worker too; `group_pids()` lists what is left. The launcher, readiness wait and
process-group handling are `refit_grpc.testing.vllm.VLLMServer`'s.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from refit_grpc.testing.ports import free_port
from refit_grpc.testing.vllm import SERVED_MODEL, VLLMServer, build_tiny_llama, http_json
from refit_grpc.wire import dynamo as dynamo_info

ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV = "REFIT_GRPC_DYNAMO_PYTHON"
# Dynamo's frontend refuses a model whose tokenizer_config.json has no chat template, even for
# /v1/completions; the tiny models' tokenizers have none.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
DYNAMO_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    # Loopback only: the request plane (TCP) and the event plane (ZMQ) otherwise bind the
    # machine's own address.
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
}


def free_system_port(host: str = "127.0.0.1") -> int:
    """A free port for a worker's system server: Dynamo 1.6.1 parses DYN_SYSTEM_PORT as an i16,
    so it must be below 32768, where the kernel's own picks (32768-60999) never fall."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


def dynamo_python() -> Path | None:
    """The Python of Dynamo's virtual environment, or None where it is not installed."""
    explicit = os.environ.get(PYTHON_ENV)
    path = Path(explicit) if explicit else ROOT / ".venv-dynamo" / "bin" / "python"
    return path if path.is_file() else None


def require_dynamo_python() -> Path:
    path = dynamo_python()
    if path is None:
        raise RuntimeError(f"Dynamo's virtual environment is missing (`make dynamo` builds "
                           f"{ROOT / '.venv-dynamo'}; {PYTHON_ENV} names another)")
    return path


def build_dynamo_model(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """The tiny Llama of the vLLM tests, with a chat template Dynamo's frontend insists on."""
    out = build_tiny_llama(out_dir, seed)
    add_chat_template(out)
    return out


def add_chat_template(model_dir: str | os.PathLike) -> None:
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.setdefault("chat_template", CHAT_TEMPLATE)
    path.write_text(json.dumps(config, indent=1))


class DynamoWorker(VLLMServer):
    """`python -m dynamo.vllm` (through `refit_grpc.testing.dynamo_worker`, see there) serving
    one model with the RL routes on its system server (`url`, the `system_url`) and the
    project's worker extension. `init_timeout_s` sets DYN_RL_INIT_WEIGHTS_TIMEOUT_S."""

    def __init__(self, model_dir: str | os.PathLike, discovery_dir: str | os.PathLike, *,
                 system_port: int | None = None, log_path: str | os.PathLike | None = None,
                 cpu_bind: str | None = None, init_timeout_s: float | None = None,
                 extension: str | None = dynamo_info.WORKER_EXTENSION,
                 extra_args: Sequence[str] = (), extra_env: dict[str, str] | None = None):
        super().__init__(model_dir, system_port or free_system_port(),
                         log_path or Path(tempfile.mkstemp(
            prefix="dynamo-worker-", suffix=".log")[1]), cpu_bind=cpu_bind,
            extra_args=extra_args)
        self.own_port = system_port is None
        self.discovery_dir = str(discovery_dir)
        self.init_timeout_s = init_timeout_s
        self.extension = extension
        self.extra_env = dict(extra_env or {})

    def command(self) -> list[str]:
        args = [str(require_dynamo_python()), "-m", "refit_grpc.testing.dynamo_worker",
                "--model", self.model_dir, "--served-model-name", SERVED_MODEL,
                "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
                "--enable-rl", "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                "--max-num-seqs", "4"]
        if self.extension:
            args += ["--worker-extension-cls", self.extension]
        return [*args, *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **DYNAMO_ENV, "DYN_SYSTEM_HOST": "127.0.0.1",
               "DYN_SYSTEM_PORT": str(self.port), "DYN_FILE_KV": self.discovery_dir,
               **self.extra_env}
        env.pop("VIRTUAL_ENV", None)
        if self.init_timeout_s is not None:
            env[dynamo_info.INIT_TIMEOUT_ENV] = f"{self.init_timeout_s:g}"
        if self.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        return env

    @staticmethod
    def pick_port() -> int:
        return free_system_port()

    def start(self) -> DynamoWorker:
        _spawn(self, self.command(), self.environment())
        return self

    def post(self, route: str, body: Any = None, timeout_s: float = 60.0) -> tuple[int, Any]:
        """POST {system_url}/engine/<route>, as an operator would."""
        return http_json("POST", self.url, f"/engine/{route}", {} if body is None else body,
                         timeout_s)


class DynamoFrontend(VLLMServer):
    """`python -m dynamo.frontend`: the OpenAI API on `url` (`port`) and, with the RL routes
    enabled, the RL discovery listener on `rl_port` (`DYN_RL_PORT`, 8001 by default)."""

    def __init__(self, discovery_dir: str | os.PathLike, *, port: int | None = None,
                 rl_port: int | None = None, log_path: str | os.PathLike | None = None):
        super().__init__("-", port, log_path or Path(tempfile.mkstemp(
            prefix="dynamo-frontend-", suffix=".log")[1]))
        self.discovery_dir = str(discovery_dir)
        self.own_rl_port = rl_port is None
        self.rl_port = rl_port or free_port()

    def repick_ports(self) -> bool:
        picked = super().repick_ports()
        if self.own_rl_port:
            self.rl_port = free_port()
            picked = True
        return picked

    @property
    def rl_url(self) -> str:
        return f"http://127.0.0.1:{self.rl_port}"

    def start(self) -> DynamoFrontend:
        cmd = [str(require_dynamo_python()), "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
               "--http-port", str(self.port), "--discovery-backend", "file",
               "--request-plane", "tcp", "--event-plane", "zmq"]
        env = {**os.environ, **DYNAMO_ENV, "DYN_FILE_KV": self.discovery_dir,
               "DYN_ENABLE_RL": "true", "DYN_RL_PORT": str(self.rl_port)}
        env.pop("VIRTUAL_ENV", None)
        _spawn(self, cmd, env)
        return self

    def workers(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """GET /v1/rl/workers on the RL listener."""
        status, body = http_json("GET", self.rl_url, dynamo_info.DISCOVERY_PATH,
                                 timeout_s=timeout_s)
        if status != 200:
            raise RuntimeError(f"{dynamo_info.DISCOVERY_PATH}: HTTP {status}: {body}")
        return body

    def wait_for(self, system_urls: Sequence[str], timeout_s: float = 120.0) -> None:
        """Until discovery lists exactly these workers as reachable (a killed one may linger
        with an `error`) and the model serves completions."""
        end = time.monotonic() + timeout_s
        want, seen = sorted(system_urls), None
        while time.monotonic() < end:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"Dynamo frontend exited:\n{self.log_tail()}")
            try:
                seen = sorted(w["system_url"] for w in self.workers()["workers"]
                              if w.get("system_url") and not w.get("error"))
                if seen == want:
                    status, body = http_json("GET", self.url, "/v1/models", timeout_s=5)
                    if status == 200 and any(m.get("id") == SERVED_MODEL
                                             for m in body.get("data", [])):
                        return
            except (OSError, RuntimeError, KeyError, TypeError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"Dynamo discovery listed {seen}, wanted {want}, or the model was "
                           f"not served within {timeout_s:.0f}s:\n{self.log_tail()}")


def _spawn(server: VLLMServer, cmd: list[str], env: dict[str, str]) -> None:
    server.mark_log()
    log = open(server.log_path, "ab")
    try:
        server.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    finally:
        log.close()
    server.started_at = time.monotonic()


# --- one refit cycle posted straight to Dynamo's routes (the baseline the shim is measured
# against, by `refit_grpc.testing.harness.DYNAMO.measure_refit_cycles`) ---------------------------


def direct_group(system_url: str, plan, init_timeout_s: float = 20.0):
    """Form a gloo group with one worker by posting init_weights_update_group directly."""
    from refit_grpc.common import GroupSpec
    from refit_grpc.dataplane.group import Group
    from refit_grpc.dataplane.rendezvous import bind_master_store

    store = bind_master_store("127.0.0.1", 0, 2, init_timeout_s)  # listening before it is used
    port = store.port
    spec = GroupSpec("127.0.0.1", port, 2, 1, "gloo", f"direct-{port}")
    _post(system_url, dynamo_info.DESTROY_GROUP, dynamo_info.destroy_body())
    box: dict[str, Any] = {}
    init = threading.Thread(target=lambda: box.update(r=_post(
        system_url, dynamo_info.INIT_GROUP, dynamo_info.init_body(spec, plan, init_timeout_s),
        check=False)))
    init.start()
    group = Group.join(GroupSpec("127.0.0.1", port, 2, 0, "gloo", spec.group_id),
                       init_timeout_s, store=store)
    init.join(init_timeout_s + 5)
    if (box.get("r") or {}).get("status") != "ok":
        group.close()
        raise RuntimeError(f"{dynamo_info.INIT_GROUP}: {box.get('r')}")
    return group


def direct_cycle(system_url: str, group, plan, tensors, version: int,
                 timeout_s: float = 60.0) -> float:
    """The cycle the shim runs, posted straight to Dynamo's routes by the trainer (the ad-hoc
    HTTP way): pause(keep), update while broadcasting (Dynamo resets the prefix cache after
    it), set the version, then the flush: pause(wait), flush_cache, resume. Returns its wall
    time."""
    from refit_grpc.common import Deadline
    from refit_grpc.dataplane.transfer import Sender

    t0 = time.monotonic()
    _post(system_url, dynamo_info.PAUSE, {"mode": "keep", "clear_cache": True})
    box: dict[str, Any] = {}
    update = threading.Thread(target=lambda: box.update(r=_post(
        system_url, dynamo_info.UPDATE_DISTRIBUTED,
        dynamo_info.update_body(plan, timeout_s, None), timeout_s=timeout_s + 5)))
    update.start()
    Sender(group, plan).send(tensors, Deadline(timeout_s))
    update.join(timeout_s + 5)
    if "r" not in box:
        raise RuntimeError(f"{dynamo_info.UPDATE_DISTRIBUTED} did not succeed")
    _post(system_url, dynamo_info.SET_VERSION, {"weight_version": version})
    _post(system_url, dynamo_info.PAUSE, {"mode": "wait", "clear_cache": True})
    _post(system_url, dynamo_info.FLUSH_CACHE, {})
    _post(system_url, dynamo_info.RESUME, {})
    return time.monotonic() - t0


def release_group(system_url: str) -> None:
    """Tear down the worker's side of a group formed by `direct_group` (an error is ignored)."""
    _post(system_url, dynamo_info.DESTROY_GROUP, dynamo_info.destroy_body(), check=False)


def _post(system_url: str, route: str, body: Any, *, check: bool = True,
          timeout_s: float = 60.0) -> Any:
    status, reply = http_json("POST", system_url, f"/engine/{route}", body, timeout_s)
    if check and (status != 200 or not isinstance(reply, dict) or reply.get("status") != "ok"):
        raise RuntimeError(f"POST /engine/{route}: HTTP {status}: {reply}")
    return reply


# --- completions through the frontend, from one chosen worker ---------------------------------


def frontend_completion(frontend_url: str, instance_id: int | None, body: dict[str, Any],
                        extra_fields: Sequence[str] = (), timeout_s: float = 60.0,
                        model: str = SERVED_MODEL) -> dict[str, Any]:
    """POST /v1/completions through Dynamo's frontend, routed to the worker `instance_id` (its
    discovery record's `instance_id`; `nvext.backend_instance_id`), asking for `nvext`'s
    `extra_fields` too (`worker_id` always: the answer proves which worker served it).
    `model`: the base model, or a LoRA adapter the worker published."""
    nvext: dict[str, Any] = {"extra_fields": sorted({"worker_id", *extra_fields})}
    if instance_id is not None:
        nvext["backend_instance_id"] = int(instance_id)
    status, reply = http_json("POST", frontend_url, "/v1/completions",
                              {"model": model, **body, "nvext": nvext}, timeout_s)
    if status != 200:
        raise RuntimeError(f"/v1/completions on {frontend_url}: HTTP {status}: {reply}")
    served = (reply.get("nvext") or {}).get("worker_id") or {}
    if instance_id is not None and served.get("decode_worker_id") != int(instance_id):
        raise RuntimeError(f"asked for worker {instance_id}, served by {served}")
    return reply


def frontend_logprobs(frontend_url: str, instance_id: int | None, sequence: Sequence[int],
                      timeout_s: float = 60.0, model: str = SERVED_MODEL):
    """Teacher-forced log-probabilities from one worker through the frontend: log p(sequence[i]
    | sequence[:i]) for i = 1 .. n-1, as float64. Dynamo's frontend has no top-level
    `prompt_logprobs` in its answer (nor `echo`); it returns vLLM's under
    `nvext.prompt_logprobs` when `nvext.extra_fields` asks for them."""
    import torch

    reply = frontend_completion(frontend_url, instance_id, {
        "prompt": list(sequence), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1},
        ("prompt_logprobs",), timeout_s, model)
    entries = reply["nvext"]["prompt_logprobs"]
    if len(entries) != len(sequence) or entries[0] is not None:
        raise RuntimeError(f"prompt_logprobs: {len(entries)} entries for {len(sequence)} "
                           f"tokens, first {entries[0]!r}")
    return torch.tensor([float(entry[str(tok)]["logprob"])
                         for entry, tok in zip(entries[1:], sequence[1:])], dtype=torch.float64)


def frontend_greedy(frontend_url: str, instance_id: int | None, prompt: Sequence[int],
                    max_tokens: int, timeout_s: float = 60.0) -> list[int]:
    """Greedy token ids from one worker through the frontend (`nvext.completion_token_ids`:
    the frontend refuses vLLM's `return_token_ids`)."""
    reply = frontend_completion(frontend_url, instance_id, {
        "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True}, ("completion_token_ids",), timeout_s)
    ids = (reply.get("nvext") or {}).get("completion_token_ids")
    if ids is None:
        raise RuntimeError(f"no completion_token_ids in the frontend's answer: {reply}")
    return list(ids)


__all__ = ["DynamoFrontend", "DynamoWorker", "add_chat_template", "build_dynamo_model",
           "direct_cycle", "direct_group", "dynamo_python", "free_system_port",
           "frontend_completion", "frontend_greedy", "frontend_logprobs", "release_group",
           "require_dynamo_python"]
