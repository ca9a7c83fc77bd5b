"""The docs a newcomer reads first say only what is true, checked against the tree and the code
(pure and fast: no engine).

- docs/architecture.md names every module and package of `refit_grpc/` (the generated `v1/`
  aside), and every path it names exists;
- its diagram of the layers is tests/test_layering.py's `LAYERS`, tier for tier.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_layering import LAYERS
from test_layering import ROOT as PACKAGE_NAME

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / PACKAGE_NAME
ARCHITECTURE = ROOT / "docs" / "architecture.md"


# --- helpers: code spans, fenced blocks, paths -------------------------------------------------


def fenced_blocks(text: str, language: str = "") -> list[str]:
    """The bodies of the ```language blocks of a markdown text, in order (`""`: no language)."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def code_spans(text: str) -> list[str]:
    """The inline `code` spans of a markdown text, outside its fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"`([^`\n]+)`", prose)


def looks_like_path(span: str) -> bool:
    """A repository path: no spaces, and a slash or a markdown file's name (`README.md`)."""
    return " " not in span and ("/" in span or span.endswith(".md")) \
        and not span.startswith(("http://", "https://"))


def path_exists(span: str) -> bool:
    """`span` (relative to the repository's root, `*` allowed) names something that exists."""
    span = span.split("#", 1)[0]
    return any(ROOT.glob(span.rstrip("/"))) if "*" in span else (ROOT / span).exists()


# --- docs/architecture.md: every module, nothing that does not exist ---------------------------


def package_entries() -> set[str]:
    """What docs/architecture.md must name: every package (`refit_grpc/x/`, for its `__init__`)
    and every other module (`refit_grpc/x/y.py`), the generated `refit_grpc/v1/` aside."""
    want = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if "v1" in rel.parts:
            continue
        want.add(f"{rel.parent.as_posix()}/" if path.name == "__init__.py" else rel.as_posix())
    return want


def test_architecture_names_every_module_and_package():
    named = set(code_spans(ARCHITECTURE.read_text()))
    want = package_entries()
    assert len(want) > 100 and "refit_grpc/driver/fleet.py" in want  # the walk found the tree
    missing = sorted(want - named)
    assert not missing, f"docs/architecture.md does not say what these own: {missing}"


def test_architecture_names_no_path_that_does_not_exist():
    spans = [s for s in code_spans(ARCHITECTURE.read_text()) if looks_like_path(s)]
    assert "refit_grpc/shim/core.py" in spans and "tests/test_layering.py" in spans
    gone = sorted({s for s in spans if not path_exists(s)})
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"


# --- the diagram of the layers ------------------------------------------------------------------


def diagram_layers(block: str) -> list[tuple[str, list[list[str]]]]:
    """A layer diagram, top down, as `(layer, tiers bottom up, each a sorted list of units)`.
    Each line is `layer  unit, unit <- unit | unit <- ...`; `(...)` is commentary, and the
    package's own `__init__.py` is the unit `refit_grpc`."""
    layers = []
    for line in block.strip().splitlines():
        name, units = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        tiers = []
        for tier in re.sub(r"\([^)]*\)", "", units).split("<-"):
            names = [u.strip() for u in re.split(r"[,|]", tier) if u.strip()]
            tiers.append(sorted(PACKAGE_NAME if n == f"{PACKAGE_NAME}/__init__.py" else n
                                for n in names))
        layers.append((name, tiers))
    return layers


def layering_rule() -> list[tuple[str, list[list[str]]]]:
    """tests/test_layering.py's LAYERS, top down, units sorted within a tier."""
    return [(name, [sorted(tier) for tier in tiers]) for name, tiers in reversed(LAYERS)]


def test_the_diagram_parser_reads_tiers_and_commentary():
    block = "sides   wire, models <- driver | shim\nbottom  a (the first) <- refit_grpc/__init__.py\n"
    assert diagram_layers(block) == [("sides", [["models", "wire"], ["driver", "shim"]]),
                                     ("bottom", [["a"], ["refit_grpc"]])]


def test_architecture_diagram_is_the_layering_rule():
    [diagram] = fenced_blocks(ARCHITECTURE.read_text())
    assert diagram_layers(diagram) == layering_rule(), \
        f"docs/architecture.md's diagram is not tests/test_layering.py's LAYERS: {layering_rule()}"
