"""`refit-grpc fleet status | flush | abort` as an operator runs it: real shim processes refit over a
real gloo group, one of them killed; the command is a real process and its exit status counts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from refit_grpc import Fleet, Packing, cli
from refit_grpc.testing.pki import make_pki
from refit_grpc.testing.ports import unused_port

from support import endpoints

TOKEN = "fleet-cli-token"


def fleet_cli(*args: str, token: str | None = None, timeout_s: float = 120):
    env = {k: v for k, v in os.environ.items() if k != "REFIT_GRPC_TOKEN"}
    if token:
        env["REFIT_GRPC_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "refit_grpc.cli", "fleet", *args],
                          capture_output=True, text=True, timeout=timeout_s, env=env)


def rows(table: str) -> dict[str, list[str]]:
    """Table lines by their first column (the instance)."""
    return {line.split()[0]: line.split() for line in table.splitlines()[1:]
            if line and not line[0].isdigit() and not line.startswith("#")}


@pytest.fixture
def fleet_of_three(shim_procs, tmp_path):
    """w0 and w1 refit to version 1 over gloo; w2 idle; a workers file naming w2."""
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}") for i in range(3)]
    weights = {"w": torch.randn(256), "b": torch.randn(8).to(torch.bfloat16)}
    with Fleet(endpoints(shims[:2]),
               packing=Packing(512, 2)) as fleet:
        plan = fleet.prepare({n: (t.shape, t.dtype) for n, t in weights.items()})
        link = fleet.connect("127.0.0.1")
        fleet.refit(link, weights, version=1)
        link.close()
    workers_file = tmp_path / "workers"
    workers_file.write_text(f"# the idle one\nw2 {shims[2].address}\n\n")
    flags = ["--worker", f"w0={shims[0].address}", "--worker", f"w1={shims[1].address}",
             "--workers-file", str(workers_file)]
    return shims, flags, plan


def test_status_flush_abort_with_a_killed_worker(fleet_of_three):
    shims, flags, plan = fleet_of_three
    ok = fleet_cli("status", *flags)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    table = rows(ok.stdout)
    # The file's workers come first, then the flags, in order.
    assert list(table) == ["w2", "w0", "w1"], ok.stdout
    assert table["w0"][2:7] == ["READY", "1", plan.digest[:12], table["w0"][5], "yes"]
    assert table["w0"][5].startswith("refit-") and table["w0"][5] == table["w1"][5]
    assert table["w2"][2:5] == ["EMPTY", "0", "-"]
    assert "3 workers: 3 ok, 0 failing" in ok.stdout

    shims[2].proc.kill()
    shims[2].proc.wait(10)
    # Its port stays refused for the rest of the test: a shim of another test running beside
    # this one once bound it, and w2 answered again.
    with unused_port(port=int(shims[2].address.rsplit(":", 1)[1])):
        _the_killed_worker_is_named(shims, flags, plan)


def _the_killed_worker_is_named(shims, flags, plan) -> None:
    down = fleet_cli("status", *flags)
    print(f"\n$ refit-grpc fleet status ...  (exit {down.returncode})\n{down.stdout}")
    assert down.returncode == 1, down.stdout + down.stderr
    table = rows(down.stdout)
    assert table["w2"][2:10] == ["-"] * 8 and table["w2"][10] == "UNAVAILABLE:"
    assert table["w0"][2] == table["w1"][2] == "READY"
    assert "3 workers: 2 ok, 1 failing (w2)" in down.stdout

    as_json = fleet_cli("status", "--json", *flags)
    assert as_json.returncode == 1
    doc = json.loads(as_json.stdout)
    by_id = {w["instance"]: w for w in doc["workers"]}
    assert doc["ok"] is False and by_id["w2"]["ok"] is False
    assert by_id["w2"]["error"].startswith("UNAVAILABLE")
    assert by_id["w0"]["ok"] is True and by_id["w0"]["error"] == ""
    assert (by_id["w0"]["state"], by_id["w0"]["version"], by_id["w0"]["plan_digest"]) == \
        ("READY", 1, plan.digest)

    flushed = fleet_cli("flush", *flags)
    assert flushed.returncode == 1, flushed.stdout + flushed.stderr
    table = rows(flushed.stdout)
    assert table["w0"][2:4] == table["w1"][2:4] == ["flushed", "and"]
    assert table["w2"][2] == "FAILED" and "UNAVAILABLE" in flushed.stdout

    aborted = fleet_cli("abort", "--reason", "drill", *flags)
    assert aborted.returncode == 1, aborted.stdout + aborted.stderr
    table = rows(aborted.stdout)
    assert table["w0"][2:6] == ["no", "epoch", "running", "PREPARED"], aborted.stdout
    assert table["w2"][2] == "FAILED"

    after = json.loads(fleet_cli("status", "--json", *flags).stdout)
    w0 = next(w for w in after["workers"] if w["instance"] == "w0")
    assert (w0["state"], w0["group"], w0["last_error"]) == ("PREPARED", "", "aborted: drill")


def test_watch_repeats_until_interrupted(shim_procs, closed_port):
    shim = shim_procs("--model", "none")
    # Nothing listens on the first address: a worker that is gone.
    flags = ["--worker", f"gone=127.0.0.1:{closed_port}", "--worker", f"up={shim.address}"]
    proc = subprocess.Popen([sys.executable, "-m", "refit_grpc.cli", "fleet", "status", "--json",
                             "--watch", "0.2", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        rounds = [json.loads(proc.stdout.readline()) for _ in range(3)]
        assert all(r["ok"] is False for r in rounds)
        assert [w["ok"] for w in rounds[-1]["workers"]] == [False, True]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 1  # the last round's status
        assert "Traceback" not in proc.stderr.read()  # a clean stop, not a KeyboardInterrupt
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_watch_follows_the_workers_file_and_shows_a_catch_up(shim_procs, tmp_path):
    """An operator edits the workers file while `status --watch` runs: the next round follows
    it. A catch-up under way shows in the VERSION column (the Describe fields behind it)."""
    a, b = (shim_procs("--model", "none", "--instance-id", name) for name in ("a", "b"))
    workers_file = tmp_path / "workers"
    workers_file.write_text(f"a {a.address}\n")
    proc = subprocess.Popen([sys.executable, "-m", "refit_grpc.cli", "fleet", "status", "--json",
                             "--watch", "0.2", "--workers-file", str(workers_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        assert [w["instance"] for w in first["workers"]] == ["a"] and "membership" not in first
        workers_file.write_text(f"b {b.address}\n")  # a went away, b appeared
        for _ in range(20):
            doc = json.loads(proc.stdout.readline())
            if "membership" in doc:
                break
        assert doc["membership"] == "+b -a", doc
        assert [w["instance"] for w in doc["workers"]] == ["b"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    from refit_grpc.driver.status import StatusRow, render_status

    table = render_status([
        StatusRow("x", "h:1", True, "CATCHING_UP", 0, catching_up_from="p0",
                  catch_up_fraction=0.5),
        StatusRow("p0", "h:2", True, "READY", 7, serving_catch_up_to="x"),
        StatusRow("l0", "h:3", True, "READY", 5, quantization="none",
                  adapters={"tenant-a": 5})])
    assert "0 (catching up 50% from p0)" in table and "7 (serving x)" in table, table
    assert "5 (adapter tenant-a v5)" in table, table


@pytest.mark.parametrize("args,needle", [
    (["--worker", "w0"], "expected INSTANCE_ID=ADDRESS"),
    ([], "no workers"),
    (["--worker", "a=127.0.0.1:1", "--worker", "a=127.0.0.1:2"], "listed twice"),
])
def test_usage_errors_exit_2(args, needle, capsys):
    assert cli.main(["fleet", "status", *args]) == 2
    assert needle in capsys.readouterr().err


def test_tls_and_token_flags(shim_procs, tmp_path):
    pki = make_pki(tmp_path)
    (tmp_path / "tokens").write_text(f"{TOKEN}\n")
    shim = shim_procs("--model", "none", "--instance-id", "s0",
                      "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
                      "--tls-client-ca", str(pki / "ca.pem"),
                      "--token-file", str(tmp_path / "tokens"))
    flags = ["--worker", f"s0={shim.address}", "--ca", str(pki / "ca.pem"),
             "--cert", str(pki / "client.pem"), "--key", str(pki / "client.key"), "--json"]
    ok = fleet_cli("status", *flags, token=TOKEN)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    [row] = json.loads(ok.stdout)["workers"]
    assert (row["state"], row["shim_instance_id"]) == ("EMPTY", "s0")

    no_token = fleet_cli("status", *flags)
    assert no_token.returncode == 1
    [row] = json.loads(no_token.stdout)["workers"]
    assert row["error"].startswith("UNAUTHENTICATED MISSING_TOKEN"), row
