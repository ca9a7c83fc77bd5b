"""Support for the tests that run real NVIDIA Dynamo workers (tests/test_dynamo.py).

The processes are the harness's (`refit_grpc.testing.dynamo`), so the tests and
`make demo-dynamo` start Dynamo the same way. Added here: a skip with its stated condition when
Dynamo's virtual environment is missing, and a worker extension that only tests use.
"""

from __future__ import annotations

from refit_grpc.testing.dynamo import PYTHON_ENV, ROOT, dynamo_python

SKIP_REASON = (f"needs NVIDIA Dynamo's virtual environment ({ROOT / '.venv-dynamo'}, or "
               f"{PYTHON_ENV}): `make test` builds it through `make dynamo`")


def require_dynamo() -> None:
    """Skip the calling test module, with the reason, when Dynamo's venv is missing (never
    under `make test`, which builds it first)."""
    import pytest  # lazily: the Dynamo worker imports this package too (slow_join), without pytest

    if dynamo_python() is None:
        pytest.skip(SKIP_REASON, allow_module_level=True)
