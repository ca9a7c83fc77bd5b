"""`make docs`: pdoc builds the API reference of the public modules, Fleet's and the errors' pages
among them, from the same module list as the Makefile, without vLLM."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _docs_modules() -> list[str]:
    """The Makefile's DOCS_MODULES (continuation lines joined)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(r"^DOCS_MODULES\s*:=\s*(.+)$", text, re.MULTILINE)
    assert match, "Makefile has no DOCS_MODULES"
    return match.group(1).split()


@pytest.mark.timeout(300)
def test_api_reference_builds(tmp_path):
    pdoc = shutil.which("pdoc", path=str(Path(sys.executable).parent))
    if pdoc is None:
        pytest.skip("pdoc is not installed (it is in the dev extra: pip install -e '.[dev]')")
    modules = _docs_modules()
    assert "refit_grpc.driver" in modules and "refit_grpc.errors" in modules
    subprocess.run([pdoc, "--docformat", "google", "-o", str(tmp_path), *modules],
                   check=True, cwd=ROOT, timeout=280)
    # The package's page documents every public name (refit_grpc.__all__).
    public = (tmp_path / "refit_grpc.html").read_text()
    for name in ("Fleet", "FleetConfig", "WorkerEndpoint", "ChannelSecurity", "EpochHandle",
                 "EpochRefusedError", "EpochFailedError", "FleetTimeoutError", "FleetStateError",
                 "MembershipRefusedError", "WeightsMismatchError", "CanaryMismatchError",
                 "RefitError", "MembershipChangedError"):
        assert f'id="{name}"' in public, name
    fleet = (tmp_path / "refit_grpc" / "driver.html").read_text()
    assert 'id="Fleet"' in fleet and 'id="Fleet.refit"' in fleet
    errors = (tmp_path / "refit_grpc" / "errors.html").read_text()
    assert 'id="RefitError"' in errors
    # --docformat google: the Args/Returns/Raises sections rendered as headings.
    for section in ("arguments", "returns", "raises"):
        assert f'<h6 id="{section}">' in fleet, section
    for module in modules:
        page = tmp_path / (module.replace(".", "/") + ".html")
        assert page.exists(), module
