"""The package exports what the README and docs/trainer.md document: every name their Python
examples import from `refit_grpc` and every error they name are in `refit_grpc.__all__` and
resolve, lazily."""

from __future__ import annotations

import ast
import builtins
import re
import subprocess
import sys
from pathlib import Path

import refit_grpc

ROOT = Path(__file__).resolve().parent.parent
# The pages a trainer's author reads: the README's example, then the trainer's API in full.
PAGES = [ROOT / "README.md", ROOT / "docs" / "trainer.md"]

# Errors the pages name that are other libraries' own: Ray wraps a failed task's error in this.
FOREIGN_ERRORS = {"RayTaskError"}


def readme_imports() -> set[str]:
    """Names that the pages' ```python blocks import with `from refit_grpc import ...`."""
    names: set[str] = set()
    text = "\n".join(page.read_text() for page in PAGES)
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module == "refit_grpc":
                names.update(alias.name for alias in node.names)
    return names


def readme_errors() -> set[str]:
    """The project's errors the pages name anywhere (built-ins and other libraries' left out)."""
    text = "\n".join(page.read_text() for page in PAGES)
    names = set(re.findall(r"\b[A-Z][A-Za-z0-9]*Error\b", text))
    return {n for n in names if not hasattr(builtins, n)} - FOREIGN_ERRORS


def test_readme_imports_are_exported():
    names = readme_imports()
    assert {"Fleet", "WorkerEndpoint"} <= names  # the parse found the examples
    assert sorted(names - set(refit_grpc.__all__)) == []
    for name in names:
        assert getattr(refit_grpc, name) is not None


def test_readme_errors_are_exported():
    names = readme_errors()
    assert {"EpochRefusedError", "MembershipRefusedError"} <= names
    assert sorted(names - set(refit_grpc.__all__)) == []
    for name in names:
        assert issubclass(getattr(refit_grpc, name), refit_grpc.RefitError), name


def test_update_weights_handle_is_exported():
    # docs/trainer.md: `update_weights()` returns a handle (`wait_accepted()`, `result()`).
    assert refit_grpc.EpochHandle.__name__ == "EpochHandle"
    for method in ("wait_accepted", "result"):
        assert callable(getattr(refit_grpc.EpochHandle, method))


def test_every_exported_name_resolves_to_its_module_object():
    assert refit_grpc.__all__ == sorted(set(refit_grpc.__all__))
    for name in refit_grpc.__all__:
        value = getattr(refit_grpc, name)
        module = sys.modules[refit_grpc._EXPORTS[name]]
        assert getattr(module, name) is value, name
    namespace: dict = {}
    exec("from refit_grpc import *", namespace)
    assert sorted(k for k in namespace if not k.startswith("__")) == refit_grpc.__all__
    assert set(refit_grpc.__all__) <= set(dir(refit_grpc))


def test_import_stays_lazy():
    # vLLM imports refit_grpc.vllm_plugin in every engine process: the package itself must not
    # pull in the driver or gRPC.
    code = ("import sys, refit_grpc; "
            "print(sorted(m for m in ('grpc', 'refit_grpc.driver', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
