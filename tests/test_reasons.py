"""Every `Reason` is documented in docs/protocol.md's tables, and the tables name no other."""

from __future__ import annotations

import re
from pathlib import Path

from refit_grpc.errors import RefitError
from refit_grpc.reasons import Reason

PROTOCOL = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def documented_reasons() -> set[str]:
    section = PROTOCOL.read_text().split("## Error reasons", 1)[1]
    # The reason column: the second cell of each table row, in backquotes.
    return set(re.findall(r"^\| [^|]+ \| `([A-Z_]+)` \|", section, flags=re.M))


def test_every_reason_is_documented_and_nothing_else():
    documented = documented_reasons()
    members = {r.value for r in Reason}
    assert members - documented == set(), "reasons missing from docs/protocol.md"
    assert documented - members == set(), "docs/protocol.md names reasons that do not exist"


def test_every_error_class_defaults_to_a_member():
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    import refit_grpc.driver.failures  # noqa: F401  (registers the fleet errors)
    import refit_grpc.shim.auth  # noqa: F401

    for cls in [RefitError, *subclasses(RefitError)]:
        assert isinstance(cls.default_reason, Reason), cls


def test_a_reason_is_its_wire_string():
    assert Reason.STALE_VERSION == "STALE_VERSION"
    assert f"{Reason.BROKEN}" == "BROKEN"
