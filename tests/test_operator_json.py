"""What an operator types by hand: JSON requests (grpcurl's mapping) via `refit-grpc call`."""

from __future__ import annotations

import json
import subprocess
import sys


def call(address: str, method: str, body: str | None = None):
    args = [sys.executable, "-m", "refit_grpc.cli", "call", address, method]
    if body is not None:
        args.append(body)
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def test_operator_calls(shim_procs):
    shim = shim_procs("--model", "none", "--instance-id", "op-0")
    described = call(shim.address, "Describe")
    assert described.returncode == 0, described.stderr
    reply = json.loads(described.stdout)
    assert reply["instanceId"] == "op-0" and reply["state"] == "SHIM_STATE_EMPTY"

    flushed = call(shim.address, "refit_grpc.v1.RefitService/Flush", '{"mode": "PAUSE_MODE_WAIT"}')
    assert flushed.returncode == 0, flushed.stderr
    assert json.loads(flushed.stdout)["resumed"] is True

    prepared = call(shim.address, "Prepare", json.dumps(
        {"tensors": [{"name": "w", "shape": ["4", "4"], "dtype": "D_TYPE_BFLOAT16"}],
         "packing": {"bufferSizeBytes": "1024", "numBuffers": 2}}))
    assert prepared.returncode == 0, prepared.stderr
    assert json.loads(prepared.stdout)["totalBytes"] == "32"

    for body, needle in [('{"mode": ', "invalid request JSON"),
                         ('{"mode": "PAUSE_MODE_NOPE"}', "PAUSE_MODE_NOPE"),
                         ('{"moed": "PAUSE_MODE_WAIT"}', "moed"),
                         ('[1, 2]', "invalid request JSON")]:
        bad = call(shim.address, "Flush", body)
        assert bad.returncode == 2 and needle in bad.stderr, (body, bad.stderr)

    refused = call(shim.address, "UpdateWeights", '{"version": "1"}')
    assert refused.returncode == 1
    assert "FAILED_PRECONDITION WRONG_STATE" in refused.stderr
    unknown = call(shim.address, "Explode")
    assert unknown.returncode == 2 and "unknown method" in unknown.stderr
