"""`make demo-vllm` runs green in the suite: two real vLLM CPU engines, each behind a shim, a
trainer refitting them after real optimisation steps; completions checked against the trainer."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from vllm_support import require_vllm

require_vllm()


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(720)
def test_demo_vllm_refits_two_engines_and_they_generate_like_the_trainer():
    proc = subprocess.run([sys.executable, "-m", "refit_grpc.tools.demo_vllm", "--engines", "2",
                           "--steps", "2"], capture_output=True, text=True, timeout=660)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    assert "before training: engines == trainer" in proc.stdout, proc.stdout
    steps = re.findall(r"^step (\d+): .* versions=\[(\d+), (\d+)\] engines=ok changed",
                       proc.stdout, re.M)
    assert steps == [("1", "1", "1"), ("2", "2", "2")], proc.stdout
    assert proc.stdout.rstrip().endswith("demo-vllm OK")
