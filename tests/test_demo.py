"""The demo is the main job: it must run green in the suite, as a newcomer runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_refits_every_step_and_verifies_each_worker():
    proc = subprocess.run([sys.executable, "-m", "refit_grpc.cli", "demo", "--workers", "3",
                           "--steps", "3"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    epochs = re.findall(r"^epoch v=(\d+) .* digest=ok:([0-9a-f]{12}) generate=ok", proc.stdout,
                        re.M)
    assert [v for v, _ in epochs] == ["1", "2", "3"], proc.stdout
    # Every step changed the weights, so each epoch moved (and verified) a different version.
    assert len({d for _, d in epochs}) == 3, proc.stdout
    assert proc.stdout.rstrip().endswith("demo OK")
