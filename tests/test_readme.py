"""The docs a newcomer reads first say only what is true, checked against the tree and the code
(no engine: the README's trainer runs against reference-engine shims on loopback).

docs/bench.md's commands are what the `make bench*` targets run (`make -n`).

README.md:
- it stays under 1,500 words (about ten minutes);
- its trainer example runs as written, its success path and its `except` branch;
- its RPC table is the proto's service, method for method, with each stream's phases; its state
  table is the proto's `ShimState` and the proto's comments on it; its engines are the shim's
  registry (`--engine`);
- its diagram of the layers is tests/test_layering.py's `LAYERS`, tier for tier;
- every inline code span names something that exists: a `make` target, a `refit-grpc` command and
  its flags, a path, an RPC, a state, an engine, a `Reason`, or a public name of `refit_grpc`
  (attributes and keywords included); an unknown kind of span fails;
- every link resolves, anchors included (in docs/ too), and the Python version is the one
  pyproject.toml requires.

docs/architecture.md names every module and package of `refit_grpc/` (the generated `v1/`
aside), names no path that does not exist, and its diagram is `LAYERS` too.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_layering import LAYERS
from test_layering import ROOT as PACKAGE_NAME

import refit_grpc
from refit_grpc.cli import COMMANDS
from refit_grpc.plan import weights_digest
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines import engine_kind, engine_names
from refit_grpc.shim.process import spawn_shim

from support import describe

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / PACKAGE_NAME
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PROTO = ROOT / "protos" / "refit_grpc" / "v1" / "refit.proto"
SERVICE = pb.DESCRIPTOR.services_by_name["RefitService"]
MAX_WORDS = 1500  # about ten minutes of reading


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


# --- README.md ----------------------------------------------------------------------------------


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a markdown text."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"no section '## {heading}'"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """The cells of the first markdown table in `text`, header and rule left out."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def unquote(cell: str) -> str:
    return cell.strip("`")


def test_readme_is_read_in_ten_minutes():
    words = len(README.read_text().split())  # what `wc -w` counts
    assert words < MAX_WORDS, f"README.md has {words} words; move detail to docs/"


def _phases_cell(method) -> str:
    """What the README's `streams` column says of `method`: nothing for a unary reply, else the
    phases of its messages' `phase` enum, or `yes` for a stream without one."""
    if not method.server_streaming:
        return ""
    phase = method.output_type.fields_by_name.get("phase")
    if phase is None or phase.enum_type is None:
        return "yes"
    values = [v.name for v in phase.enum_type.values]
    prefix = next(v for v in values if v.endswith("_UNSPECIFIED")).removesuffix("UNSPECIFIED")
    return ", ".join(v.removeprefix(prefix) for v in values if not v.endswith("_UNSPECIFIED"))


def test_readme_rpcs_are_the_services_methods():
    rows = table_rows(section(README.read_text(), "The RPCs"))
    assert [(unquote(name), streams) for name, streams, _ in rows] == \
        [(m.name, _phases_cell(m)) for m in SERVICE.methods]
    assert not any(m.client_streaming for m in SERVICE.methods)  # the table has no column for it
    assert all(what for _, _, what in rows)


def proto_enum(name: str) -> list[tuple[str, str]]:
    """`(value, its leading comment as one line)` for each value of the proto's enum `name`, the
    UNSPECIFIED one aside, read from the .proto text (the descriptor drops comments)."""
    match = re.search(rf"^enum {name} {{\n(.*?)^}}", PROTO.read_text(), flags=re.M | re.S)
    assert match, f"no enum {name} in {PROTO}"
    values, comment = [], []
    for line in match.group(1).splitlines():
        line = line.strip()
        if line.startswith("//"):
            comment.append(line[2:].strip())
        elif value := re.match(r"(\w+) = \d+;", line):
            if not value.group(1).endswith("_UNSPECIFIED"):
                values.append((value.group(1), " ".join(comment)))
            comment = []
    return values


def test_readme_states_are_the_protos_with_its_comments():
    values = proto_enum("ShimState")
    assert [v for v, _ in values] == [n for n in pb.ShimState.keys() if n != "SHIM_STATE_UNSPECIFIED"]
    want = [[f"`{v.removeprefix('SHIM_STATE_')}`", comment] for v, comment in values]
    got = table_rows(section(README.read_text(), "The shim's states"))
    table = "\n".join(f"| {name} | {comment} |" for name, comment in want)
    assert got == want, f"README.md's state table is not the proto's; paste:\n{table}"


def test_readme_engines_are_the_shims_engines():
    rows = table_rows(section(README.read_text(), "The engines"))
    names = [unquote(name) for name, _ in rows]
    assert sorted(names) == engine_names()
    for name in names:  # each loads: `--engine NAME` builds it
        assert engine_kind(name).takes("url") or name == "reference"


def test_readme_diagram_is_the_layering_rule():
    [diagram] = fenced_blocks(section(README.read_text(), "The layers"))
    assert diagram_layers(diagram) == layering_rule()
    [architecture] = fenced_blocks(ARCHITECTURE.read_text())
    assert diagram.strip().splitlines()[0] == architecture.strip().splitlines()[0]


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_readme_make_commands_are_targets():
    text = README.read_text()
    named = [s.split()[1] for s in code_spans(text) if s.startswith("make ")]
    for block in fenced_blocks(text, "bash"):
        named += [line.split()[1] for line in block.splitlines() if line.startswith("make ")]
    assert {"demo", "test", "check"} <= set(named)
    assert sorted(set(named) - make_targets()) == []


def test_development_names_every_make_target():
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), flags=re.M)[1].split()
    rows = table_rows(section((ROOT / "docs" / "development.md").read_text(), "Every target"))
    assert [unquote(target) for target, _ in rows] == [f"make {t}" for t in phony]
    assert set(phony) <= make_targets()


def test_readme_python_version_is_the_required_one():
    [version] = re.findall(r"python3 \((\d+\.\d+)\+\)", README.read_text())
    assert f'requires-python = ">={version}"' in (ROOT / "pyproject.toml").read_text()


# --- links, in the README and in docs/ ----------------------------------------------------------


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def broken_links(path: Path) -> list[str]:
    broken = []
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in heading_anchors(where):
            broken.append(target)
    return broken


@pytest.mark.parametrize("name", ["README.md"] + sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
def test_links_resolve(name):
    assert broken_links(ROOT / name) == []


def test_readme_links_every_doc():
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", README.read_text()))
    docs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert sorted(docs - linked) == []


# --- every code span of the README names something that exists ----------------------------------


def cli_accepts(span: str) -> bool:
    """`refit-grpc COMMAND [--flag ...]`: a command the CLI dispatches, whose flags it has."""
    words = shlex.split(span)[1:]
    if not words or words[0] not in COMMANDS:
        return False
    parser = argparse.ArgumentParser(prog=f"refit-grpc {words[0]}")
    COMMANDS[words[0]][1]().add_arguments(parser)
    usage = parser.format_help()
    return all(re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", usage)
               for w in words[1:] if w.startswith("-"))


def resolve(node: ast.expr) -> Any:
    """The object a README expression names: a public name of `refit_grpc`, an attribute of one
    (or a parameter of its constructor: `FleetError.failures`), a call with keywords it takes."""
    if isinstance(node, ast.Name):
        if node.id not in refit_grpc.__all__:
            raise LookupError(f"{node.id} is not exported by refit_grpc")
        return getattr(refit_grpc, node.id)
    if isinstance(node, ast.Attribute):
        owner = resolve(node.value)
        if hasattr(owner, node.attr):
            return getattr(owner, node.attr)
        if not (callable(owner) and node.attr in inspect.signature(owner).parameters):
            raise LookupError(f"{ast.unparse(node)} does not exist")
        return None
    if isinstance(node, ast.Call):
        function = resolve(node.func)
        params = inspect.signature(function).parameters
        for keyword in node.keywords:
            if keyword.arg not in params:
                raise LookupError(f"{ast.unparse(node)}: no keyword {keyword.arg}")
        return function
    raise LookupError(f"not a name, attribute or call: {ast.unparse(node)}")


def known_words() -> set[str]:
    """Names from the proto and the code: RPCs, states, phases, engines, reasons."""
    words = {m.name for m in SERVICE.methods} | {SERVICE.name, SERVICE.full_name}
    for enum in pb.DESCRIPTOR.enum_types_by_name.values():
        words.add(enum.name)
        if enum.name == "ShimState" or enum.name.endswith("Phase"):
            prefix = enum.values[0].name.removesuffix("UNSPECIFIED")
            words |= {v.name.removeprefix(prefix) for v in enum.values[1:]}
    return words | set(engine_names()) | {r.value for r in Reason}


def what_is_wrong(span: str, targets: set[str], words: set[str]) -> str | None:
    """None when `span` names something that exists, else why not."""
    if span.startswith("make "):
        return None if span.split()[1] in targets else "no such make target"
    if span.startswith("refit-grpc "):
        return None if cli_accepts(span) else "no such command or flag"
    if looks_like_path(span):
        return None if path_exists(span) else "no such path"
    if span in words:
        return None
    try:
        resolve(ast.parse(span, mode="eval").body)
    except SyntaxError:
        return "not a kind of name this test knows: say it in words, or teach the test"
    except LookupError as e:
        return str(e)
    return None


def test_readme_code_spans_name_what_exists():
    spans = code_spans(README.read_text())
    assert {"Fleet", "make check", "UpdateWeights", "Staged(delta=True)"} <= set(spans)
    targets, words = make_targets(), known_words()
    wrong = {s: why for s in spans if (why := what_is_wrong(s, targets, words))}
    assert wrong == {}


def test_the_code_span_check_catches_what_does_not_exist():
    targets, words = make_targets(), known_words()
    for span in ["make nothing", "refit-grpc shim --no-such-flag", "refit-grpc nothing",
                 "docs/nothing.md", "WorkerReport", "Fleet.nothing", "Staged(nothing=True)",
                 "UpdateEverything", "1 + 1", "Fleet is"]:
        assert what_is_wrong(span, targets, words), span
    for span in ["make demo", "refit-grpc shim --engine vllm", "docs/protocol.md", "Fleet",
                 "FleetError.failures", "Staged(min_engines=7)", "Flip", "CATCHING_UP",
                 "STALE_VERSION", "dynamo"]:
        assert what_is_wrong(span, targets, words) is None, span


# --- the README's trainer, run as written ---------------------------------------------------------


def readme_trainer() -> str:
    [block] = fenced_blocks(section(README.read_text(), "A trainer"), "python")
    return block


def run_readme_trainer(shims, monkeypatch, capsys) -> tuple[dict, list[str]]:
    """The README's block as written, its shims and address from the environment it reads."""
    monkeypatch.setenv("SHIMS", ",".join(s.address for s in shims))
    monkeypatch.setenv("TRAINER_IP", "127.0.0.1")
    namespace: dict = {"__name__": "readme_trainer"}
    capsys.readouterr()
    exec(compile(readme_trainer(), "README.md (A trainer)", "exec"), namespace)
    return namespace, capsys.readouterr().out.splitlines()


@pytest.mark.timeout(180)
def test_the_readme_trainer_runs_as_written(monkeypatch, capsys):
    # Shims with their own instance ids: the example names its workers itself.
    shims = [spawn_shim("--model", "none") for _ in range(2)]
    try:
        namespace, out = run_readme_trainer(shims, monkeypatch, capsys)
        assert [re.match(r"v(\d+): \d+ bytes in [\d.]+ s$", line)[1] for line in out] == \
            ["1", "2", "3"], out
        want = weights_digest(namespace["model"].state_dict().items())
        for shim in shims:
            d = describe(shim.address)
            assert (d.weight_version, d.weights_digest) == (3, want)

        # Again, a new fleet on the same shims: its versions 1 to 3 are stale there, so every
        # epoch is refused before any byte moves, and the `except` branch runs three times.
        _, out = run_readme_trainer(shims, monkeypatch, capsys)
        assert len(out) == 3, out
        for line in out:  # both engines named, each with its reason
            assert line.startswith("epoch failed: [") and "'engine-0'" in line, out
            assert "'engine-1'" in line and line.count("Reason.STALE_VERSION") == 2, out
        for shim in shims:
            d = describe(shim.address)
            assert (d.weight_version, d.weights_digest) == (3, want)
    finally:
        for shim in shims:
            shim.stop()


# --- docs/bench.md: the commands that reproduce each result ---------------------------------------


def make_runs(target: str, *assignments: str) -> list[str]:
    """The `refit-grpc` command lines `make TARGET` runs (a dry run), without the venv's path."""
    dry = subprocess.run(["make", "-n", "-s", target, *assignments], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60)
    return [re.sub(r"^\S*/bin/(refit-grpc )", r"\1", " ".join(line.split()))
            for line in dry.stdout.splitlines() if "/bin/refit-grpc " in line]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_bench_doc_commands_are_what_make_runs():
    text = (ROOT / "docs" / "bench.md").read_text()
    rows = table_rows(section(text, "Reproduce"))
    targets = [unquote(target).removeprefix("make ") for target, _, _ in rows]
    assert sorted(targets) == sorted(t for t in make_targets() if t.startswith("bench"))
    for target, (_, runs, _) in zip(targets, rows):
        assert re.findall(r"`(refit-grpc [^`]+)`", runs) == make_runs(target), target
    variants = re.findall(r"`make ([\w-]+) (\w+=\S+)` runs `(refit-grpc [^`]+)`", text)
    assert variants, "docs/bench.md names no `make TARGET VAR=...` variant"
    for target, assignment, command in variants:
        assert make_runs(target, assignment) == [command]
