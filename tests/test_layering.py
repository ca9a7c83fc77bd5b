"""The layout's rules, checked on the source (pure: `ast`, no import of the package):

- no module reaches into another object's private names (`x._name` where `x` is not `self`,
  `cls` or `super()`): a collaborator owns its state and offers methods for it. The only
  exceptions are third-party privates the project cannot avoid, each named below with why;
- no import circle between the package's modules, and one direction for the whole package.

What counts as an import: every `import` and `from ... import` anywhere in a module (at module
level, under `if TYPE_CHECKING:`, inside a function: a lazy import still runs, and a type
checker's import still couples the two), with a package's `__init__.py` a module like any other
(`refit_grpc.driver` is its `__init__`). `from P import name` is an edge to `P.name` when that is
a module, else to `P`. Not counted: the parent packages Python runs before a module (every module
would import the root's `__init__`: see `test_the_package_root_imports_nothing_eagerly` for why
that is safe), and imports by name at runtime (`importlib`, vLLM's registry by module path, the
fork server's preload list, `python -m` command lines).

The direction (`LAYERS`, bottom up). Each top-level module or sub-package of `refit_grpc` is a
unit, and so is the package's own `__init__` (`refit_grpc`, the lazy public facade); each unit
sits in one tier of one layer. A module may import its own unit, and any unit of a lower tier,
in its own layer or a lower one; never a unit of its own tier, never one above. So the units of
one tier never import each other (the driver and the shim meet only on the wire; the code inside
vLLM imports neither), and within a layer the tiers say which way same-layer imports go:

0. vocabulary: what every layer speaks, pure: `reasons`, `signals` (stopping on SIGTERM) and the
   generated `v1`; then `errors` (typed, each with its Reason); `common` and `plan`; `proto` (the
   generated modules and their enum maps); `canary` (which reads the proto's messages).
1. data plane: `dataplane`, the bytes of an epoch over a group, on the vocabulary only, so that
   both sides and the code in vLLM's workers build on it.
2. the sides: first what both ends of an engine share, `wire` (the bodies of its routes) and
   `models` (the reference engine's model); then `driver` (the trainer's side), `shim` (the
   engine's side) and `vllm_plugin` (inside vLLM), which never import each other.
3. adapters: `integrations` (Ray, transformers, Dynamo discovery, on the driver and the wire)
   and the package root's facade (the driver's names, resolved lazily).
4. front ends: `testing` (harnesses), then `tools` (the demos and benches, built on the
   harnesses), then `cli`, which only dispatches to the commands of every lower layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "refit_grpc"
ROOT = "refit_grpc"

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

# Bottom up: (layer, its tiers, each a list of units). The module docstring says why.
LAYERS: list[tuple[str, list[list[str]]]] = [
    ("vocabulary", [["reasons", "signals", "v1"], ["errors"], ["common", "plan"], ["proto"],
                    ["canary"]]),
    ("data plane", [["dataplane"]]),
    ("sides", [["wire", "models"], ["driver", "shim", "vllm_plugin"]]),
    ("adapters", [["integrations", ROOT]]),
    ("front ends", [["testing"], ["tools"], ["cli"]]),
]


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


# --- the import graph ---------------------------------------------------------------------------


def _imports(name: str, path: Path, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(target, line, eager) for every import of a `refit_grpc` module in `path`; `eager`: at
    module level and not under TYPE_CHECKING (it runs whenever the module is imported)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    lazy: set[int] = set()  # ids of import nodes in a function or under TYPE_CHECKING
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            lazy |= {id(n) for n in ast.walk(node) if n is not node}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found += [(t, node.lineno, id(node) not in lazy) for t in dict.fromkeys(targets)
                  if (t == ROOT or t.startswith(ROOT + ".")) and t != name]
    return found


def _import_graph() -> dict[str, dict[str, tuple[int, bool]]]:
    """module -> {imported module: (first line, eager anywhere)}, `__init__`s included; imports
    of the generated `refit_grpc.v1` modules are kept as `refit_grpc.v1`."""
    paths = {_module_name(p): p for p in _sources()}
    graph: dict[str, dict[str, tuple[int, bool]]] = {}
    for name, path in paths.items():
        deps: dict[str, tuple[int, bool]] = {}
        for target, line, eager in _imports(name, path, set(paths)):
            if target.startswith(f"{ROOT}.v1."):
                target = f"{ROOT}.v1"
            if target not in paths and target != f"{ROOT}.v1":
                raise AssertionError(f"{path}:{line}: imports {target}, which is no module here")
            first = deps.get(target, (line, False))
            deps[target] = (min(first[0], line), first[1] or eager)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def _a_circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete circle through the component's first module: [a, b, ..., a]."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to `start`
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    return paths[v] + [start]
                if w in inside and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in {component}")


def _unit(module: str) -> str:
    """`refit_grpc.driver.fleet` -> `driver`; the package's own `__init__` -> `refit_grpc`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def _ranks() -> dict[str, tuple[int, str]]:
    """unit -> (its tier's rank, bottom up, counted across layers; its layer's name)."""
    ranks: dict[str, tuple[int, str]] = {}
    rank = 0
    for layer, tiers in LAYERS:
        for tier in tiers:
            for unit in tier:
                assert unit not in ranks, f"{unit} is placed twice"
                ranks[unit] = (rank, layer)
            rank += 1
    return ranks


def test_no_import_circle_between_the_packages_modules():
    graph = {m: set(deps) for m, deps in _import_graph().items()}
    assert "refit_grpc.driver.fleet" in graph and graph["refit_grpc.driver.fleet"]
    assert "refit_grpc.cli" in graph and graph["refit_grpc.cli"], "an __init__ is a node"
    circles = [" -> ".join(_a_circle(graph, c)) for c in _cycles(graph)]
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_every_unit_sits_in_a_layer():
    ranks = _ranks()
    unplaced = sorted({_unit(m) for m in _import_graph()} - set(ranks))
    assert not unplaced, (f"{unplaced}: not in tests/test_layering.py's LAYERS; place each in "
                          "the tier whose units it may import, and say why in the docstring")


def test_imports_go_one_way():
    ranks = _ranks()
    wrong = []
    for module, deps in sorted(_import_graph().items()):
        unit = _unit(module)
        for target, (line, _) in sorted(deps.items()):
            there = _unit(target)
            if there == unit or unit not in ranks or there not in ranks:
                continue  # the unplaced: test_every_unit_sits_in_a_layer
            (rank, layer), (their_rank, their_layer) = ranks[unit], ranks[there]
            if their_rank >= rank:
                how = "the same tier" if their_rank == rank else "above"
                wrong.append(f"{module}:{line} imports {target}: {there} ({their_layer}) is "
                             f"{how} {unit} ({layer})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_package_root_imports_nothing_eagerly():
    """Python runs `refit_grpc/__init__.py` before any module of the package, the vocabulary's
    included, so an eager import there would make every module import what the facade names
    (the driver, gRPC) and close a circle the graph above cannot see. The facade imports only
    under TYPE_CHECKING and resolves its names on first use (tests/test_public_api.py)."""
    eager = [f"{target} (line {line})"
             for target, (line, eager) in _import_graph()[ROOT].items() if eager]
    assert not eager, f"refit_grpc/__init__.py imports eagerly: {eager}"


def test_the_cycle_finder_finds_a_circle_and_names_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _a_circle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_init_files_lazy_and_type_checking_imports():
    graph = _import_graph()
    # cli's __init__ dispatches to the benches by lazy imports inside functions.
    assert "refit_grpc.tools.bench" in graph["refit_grpc.cli"]
    assert graph["refit_grpc.cli"]["refit_grpc.tools.bench"][1] is False
    # The root's facade names the driver's classes under TYPE_CHECKING only.
    assert "refit_grpc.driver" in graph[ROOT]
    assert "refit_grpc.dataplane.group" in graph["refit_grpc.dataplane.transfer"]
