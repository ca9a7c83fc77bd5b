"""Every `make bench*` target runs to its end: each target's own command lines (`make -n`), with
`BENCH_FLAGS=--quick` (a small plan, one rep) and `BENCH_WORLDS=2`, so a bench that cannot
finish fails here rather than on a user's machine. Nothing is timed or compared: the benches
report and assert nothing. Plus the memory check each bench makes before it starts, on made-up
MemAvailable figures, and the per-process peaks the table prints."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.tools.bench import ARMS, estimate_memory, realistic_specs
from refit_grpc.tools.bench_catch_up import catch_up_need
from refit_grpc.tools.bench_delta import delta_need
from refit_grpc.tools.bench_memory import (
    FIT_SHARE,
    DoesNotFit,
    Need,
    Peaks,
    fit_total_mb,
    mem_available,
    peak_rss,
    reset_peak,
)

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def bench_lines(target: str) -> list[str]:
    """The refit-grpc command lines `make TARGET` runs, quick, at world 2, with this venv."""
    venv = Path(sys.executable).parent.parent
    dry = subprocess.run(["make", "-n", "-s", target, "BENCH_FLAGS=--quick", "BENCH_WORLDS=2",
                          f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = [ln for ln in dry.stdout.splitlines() if "/bin/refit-grpc bench" in ln]
    assert lines and all(ln.endswith("--quick") for ln in lines), dry.stdout
    return lines


def run_target(target: str, timeout_s: float) -> str:
    out = []
    for line in bench_lines(target):
        proc = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        out.append(proc.stdout)
    return "\n".join(out)


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@needs_make
@pytest.mark.timeout(240)
def test_make_bench_runs_every_arm_and_prints_peak_memory():
    out = run_target("bench", 180)
    assert "world 2 (1 receivers)" in out, out
    header = next(ln for ln in out.splitlines() if ln.startswith("arm "))
    assert "sender peak MB" in header and "receiver peak MB" in header
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()
            if ln.split() and ln.split()[0] in ARMS}
    assert set(rows) == set(ARMS), out
    for arm, row in rows.items():
        # sender peak and receiver peak (MB) sit right after the ratio to the floor
        sender, receiver = float(row[5]), float(row[6])
        assert sender > 0 and receiver > 0, (arm, row)
    # the staged arm's receivers hold the staged copy on top of the live weights
    assert float(rows["staged"][6]) > float(rows["refit_grpc"][6])
    assert "staged/in place" in out


@needs_make
@pytest.mark.timeout(120)
def test_make_bench_delta_runs():
    out = run_target("bench-delta", 100)
    assert "delta cpu s/GiB" in out and "1.0000%" in out, out


@needs_make
@pytest.mark.timeout(120)
def test_make_bench_catch_up_runs():
    out = run_target("bench-catch-up", 100)
    assert "newcomer from a peer (Fleet.catch_up)" in out, out


@needs_make
@pytest.mark.timeout(120)
def test_make_bench_scale_runs_and_draws_its_figure():
    lines = bench_lines("bench-scale")
    out = run_target("bench-scale", 100)
    rows = [ln.split() for ln in out.splitlines()
            if ln.split()[:1] in (["processes"], ["simulated"], ["sim/engine"], ["staged"],
                                  ["staged/eng"])
            and ln.split()[1].isdigit()]
    simulated = ("simulated", "sim/engine", "staged", "staged/eng")
    assert [(r[0], int(r[1])) for r in rows] == [("processes", 2), ("processes", 4)] + [
        (series, n) for n in (3, 8) for series in simulated], out
    assert "a SIMULATION" in out and "at 8 engines (simulated): `fleet status`" in out, out
    # Faults at the widest simulated width: the killed engine named first, the quorum flipped.
    assert "naming the 1 first: yes" in out, out
    assert "quorum 6: 6 flipped, left behind by name: the killed ones" in out, out
    for row in rows:
        cpu_per_engine, threads, egress = float(row[7]), int(row[8]), float(row[10])
        # Each is measured, not a placeholder: some CPU, a trainer with threads, bytes sent.
        assert cpu_per_engine > 0 and threads > 1 and egress >= 1, row
    assert "figure: build/bench-scale.png" in out and (ROOT / "build/bench-scale.png").exists()
    assert all("bench-scale" in ln for ln in lines)


@needs_make
@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(600)
def test_make_bench_stall_runs_on_a_real_vllm():
    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_support import require_vllm

    require_vllm()
    out = run_target("bench-stall", 540)
    assert "staged stall / in-place stall (engine's own)" in out, out
    # The loader arm ran beside the prepared flip (the workers' `configure` switched it).
    assert "| staged_loader | 1 |" in out, out
    assert "staged, every layer loaded at the flip: stall / in-place stall" in out, out
    # The delta arm went as a delta (the bench fails when one went whole), the floor measured.
    assert "| delta | 1 |" in out and "delta stall / in-place stall" in out, out
    assert "staged stall / (a plain copy of the model's bytes" in out, out
    assert "bench-stall OK" in out, out
    # Its Dynamo part (the target builds Dynamo's environment first).
    assert "Dynamo: staged stall / in-place stall (engine's own)" in out, out
    assert "bench-stall-dynamo OK" in out, out
    assert "world 2 (1 receivers)" in out, out  # its reference-engine part


@needs_make
@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(600)
def test_make_bench_lora_quant_runs_on_real_vllm_engines():
    sys.path.insert(0, str(ROOT / "tests"))
    from vllm_support import require_vllm

    require_vllm()
    out = run_target("bench-lora-quant", 540)
    assert "adapter / full staged: bytes" in out, out
    assert "staged flip stall: bf16" in out, out
    assert "bench-lora-quant OK" in out, out


# --- the memory check before a bench starts ---------------------------------------------------


def test_the_default_bench_fits_one_arm_at_a_time_where_all_at_once_did_not():
    plan = RefitPlan(tuple(realistic_specs(1 << 30)), Packing(64 << 20, 2))
    need = estimate_memory(plan, 4, ARMS)  # world 5
    assert need.worst == "shims"  # the staged copy doubles what each shim holds
    assert need.peak < FIT_SHARE * 20 * GiB  # fits a 24 GiB host with others on it
    # every receiver set alive at once (before) needed more than such a host has
    together = sum(need.phases.values())
    assert together > 24 * GiB


def test_a_default_that_does_not_fit_is_halved_until_it_does():
    said: list[str] = []

    def need(mb: float) -> Need:
        return Need({"all": int(mb * 10 * (1 << 20))})

    assert fit_total_mb(need, None, 1024, "bench", available=int(4000 * (1 << 20)),
                        say=said.append) == 256
    assert "running 256 MB instead" in said[-1] and "MemAvailable" in said[-1]
    assert fit_total_mb(need, None, 1024, "bench", available=20 * GiB, say=said.append) == 1024
    assert said[-1].endswith("fits")


def test_an_asked_size_that_does_not_fit_is_refused_with_what_to_do():
    def need(mb: float) -> Need:
        return Need({"shims": int(mb * 10 * (1 << 20))})

    with pytest.raises(DoesNotFit, match="Pass a smaller --total-mb"):
        fit_total_mb(need, 1024, 1024, "bench", available=4 * GiB, say=lambda s: None)
    with pytest.raises(DoesNotFit, match="not even"):
        fit_total_mb(need, None, 1024, "bench", available=GiB // 10, say=lambda s: None)


def test_unknown_available_memory_runs_what_was_asked(monkeypatch):
    monkeypatch.setattr("refit_grpc.tools.bench_memory.mem_available", lambda: None)
    assert fit_total_mb(lambda mb: Need({"x": 1 << 60}), None, 1024, "bench") == 1024


def test_the_cli_refuses_a_bench_that_cannot_fit_before_starting(monkeypatch, capsys):
    from refit_grpc.cli import main

    monkeypatch.setattr("refit_grpc.tools.bench_memory.mem_available", lambda: GiB)
    assert main(["bench", "--world", "5", "--total-mb", "1024"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["bench-delta", "--total-mb", "1024"]) == 2
    assert main(["bench-catch-up", "--total-mb", "1024"]) == 2


def test_the_delta_and_catch_up_defaults_fit_a_24_gib_host():
    for need in (delta_need(1024, 1, 64 << 20), catch_up_need(1024, 2, 64 << 20)):
        assert 4 * GiB < need.peak < FIT_SHARE * 20 * GiB


def test_mem_available_and_peaks_are_read_from_proc():
    assert (mem_available() or 0) > 0
    me = os.getpid()
    assert reset_peak(me)
    before = peak_rss(me)
    block = b"\x01" * (64 << 20)  # written: 64 MB resident
    assert peak_rss(me) >= before + (60 << 20)
    del block
    probe = Peaks()
    probe.start([me])
    assert probe.reset_ok
    assert Peaks.read([me]) == (peak_rss(me), 0)
