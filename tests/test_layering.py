"""The layout's two rules, checked on the source (pure: `ast`, no import of the package):

- no module reaches into another object's private names (`x._name` where `x` is not `self`,
  `cls` or `super()`): a collaborator owns its state and offers methods for it. The only
  exceptions are third-party privates the project cannot avoid, each named below with why;
- no import circle between the package's modules (module-level and TYPE_CHECKING imports both
  count; a package's `__init__`, which re-exports lazily, is not a node).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "refit_grpc"

# Third-party privates, with why: torch's gloo options (the device list and timeout have no
# public setter), vLLM's backend registry (no public re-registration), nn.Module's parameter
# dict (read without the __getattr__ that would resolve a tied head to the embedding's module),
# vLLM's LoRA loader and the adapter manager it loads into (the one place an adapter can come
# from memory instead of a path; vllm_plugin/adapters.py), and nn.Module's other state (its
# buffers, children and non-persistent names: a prepared flip builds a shadow of a layer with
# tensors of its own and installs its state, as vLLM's own reload rebuilds layers in
# reload/meta.py; vllm_plugin/prepared.py).
THIRD_PARTY = {"_Options", "_timeout", "_devices", "_registry", "_parameters", "_load_adapter",
               "_adapter_manager", "_buffers", "_modules", "_non_persistent_buffers_set"}


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "v1" not in p.relative_to(PACKAGE).parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_no_module_reaches_into_another_objects_private_names():
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) \
                    and owner.func.id == "super":
                continue
            if node.attr in THIRD_PARTY:
                continue
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: "
                         f"{ast.unparse(node)}")
    assert not found, "private names reached from outside their class:\n" + "\n".join(found)


def _import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in _sources() if p.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        package = name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package upwards
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_the_packages_modules():
    graph = _import_graph()
    assert "refit_grpc.driver.fleet" in graph and graph["refit_grpc.driver.fleet"]
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
