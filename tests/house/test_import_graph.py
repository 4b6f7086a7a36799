"""No import circle between kvtier's modules.

Every module of kvtier's packages (the `packages` of pyproject.toml, in the folders its
`package-dir` maps them to: kvtier.schemas is schemas/, ...) is parsed with `ast`, and every
`import` and `from ... import` statement in it counts, wherever it stands: at module level, in a
function or class body, under `if TYPE_CHECKING:`. A function-level import is the usual way to hide
a circle from Python's import machinery, but the two modules still need each other: neither can be
read, tested or moved without the other, and whether they load depends on which one is imported
first. Only imports of kvtier's own modules make edges; `from package import name` is an edge to
the submodule when `name` is one, else to the package.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")

ROOT = pathlib.Path(__file__).resolve().parents[2]

Graph = dict[str, set[str]]


def module_files() -> dict[str, pathlib.Path]:
    """Module name -> source file, for every module setuptools installs."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    modules = {}
    for package in setuptools["packages"]:
        # The folder of the longest mapped prefix, then the rest of the name as subfolders.
        base = max((name for name in package_dir if package == name or package.startswith(name + ".")), key=len)
        folder = ROOT / package_dir[base] / pathlib.Path(*package[len(base):].split(".")[1:])
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imports_of(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The kvtier modules `module` imports, anywhere in its source."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                origin = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                found.add(f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin)
    return {name for name in found if name in known and name != module}


def import_graph() -> Graph:
    modules = module_files()
    return {module: imports_of(module, path, set(modules)) for module, path in modules.items()}


def find_cycles(graph: Graph) -> list[list[str]]:
    """One circle per group of modules that import each other (a strongly connected component
    of more than one module), as [a, b, ..., a]; [] when the graph has none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_through(graph, set(component)) for component in components]


def _circle_through(graph: Graph, component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, set()) & component - {node}):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_no_import_circle_between_kvtier_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join("  " + " -> ".join(cycle) for cycle in cycles)


def test_the_stages_meet_only_in_schemas():
    """producers/, consumers/ and router/ share wire types (schemas/) and kvtier's plumbing
    (connections, streams, Lua scripts), never each other's modules; schemas/ imports nothing of
    kvtier but itself. So each stage can be read, tested and changed on its own."""
    stages = ("kvtier.producers", "kvtier.consumers", "kvtier.router")

    def stage(module: str) -> str | None:
        return next((s for s in stages if module == s or module.startswith(s + ".")), None)

    graph = import_graph()
    crossing = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                      if stage(m) and stage(t) and stage(m) != stage(t))
    assert not crossing, "a stage imports another:\n  " + "\n  ".join(crossing)
    outside = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("kvtier.schemas")
                     for t in targets if not t.startswith("kvtier.schemas"))
    assert not outside, "schemas/ imports outside itself:\n  " + "\n  ".join(outside)


def test_plumbing_and_the_services_never_reach_up_to_tools_commands_or_benches():
    """kvtier/plumbing/ imports only schemas/ and itself, kvtier/harness/ only those; producers/,
    consumers/, router/ and plumbing never import the operator tools, the command modules or the
    benches (the layout of kvtier/README.md: services below, what drives or inspects them above)."""
    graph = import_graph()
    below = ("kvtier.plumbing", "kvtier.producers", "kvtier.consumers", "kvtier.router")
    above = ("kvtier.tools", "kvtier.commands", "kvtier.bench", "kvtier.eval", "kvtier.testing", "kvtier.cli")

    def within(module: str, packages) -> bool:
        return any(module == p or module.startswith(p + ".") for p in packages)

    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if within(m, below)
                    for t in targets if within(t, above))
    assert not upward, "imports upward:\n  " + "\n  ".join(upward)
    base = ("kvtier.plumbing", "kvtier.schemas")
    plumbing_out = sorted(f"{m} -> {t}" for m, targets in graph.items() if within(m, ("kvtier.plumbing",))
                          for t in targets if not within(t, base))
    assert not plumbing_out, "plumbing imports beyond schemas:\n  " + "\n  ".join(plumbing_out)
    harness_out = sorted(f"{m} -> {t}" for m, targets in graph.items() if within(m, ("kvtier.harness",))
                         for t in targets if not within(t, (*base, "kvtier.harness")))
    assert not harness_out, "harness imports beyond plumbing and schemas:\n  " + "\n  ".join(harness_out)


def test_the_simulators_stand_beside_the_services():
    """kvtier/sim/ (the simulated engines) is driven by the benches, the commands and the tests;
    the services never import it, and it imports only what they may (schemas, plumbing, harness):
    a simulated rank reaches the bridge over SGLang's wire format, as SGLang does."""
    graph = import_graph()
    services = ("kvtier.producers", "kvtier.consumers", "kvtier.router", "kvtier.plumbing", "kvtier.harness",
                "kvtier.schemas")

    def within(module: str, packages) -> bool:
        return any(module == p or module.startswith(p + ".") for p in packages)

    assert any(within(m, ("kvtier.sim",)) for m in graph), "kvtier/sim/ not found by the graph"
    into = sorted(f"{m} -> {t}" for m, targets in graph.items() if within(m, services)
                  for t in targets if within(t, ("kvtier.sim",)))
    assert not into, "a service imports the simulators:\n  " + "\n  ".join(into)
    out = sorted(f"{m} -> {t}" for m, targets in graph.items() if within(m, ("kvtier.sim",))
                 for t in targets if not within(t, ("kvtier.sim", "kvtier.plumbing", "kvtier.harness",
                                                    "kvtier.schemas")))
    assert not out, "the simulators import beyond schemas, plumbing and harness:\n  " + "\n  ".join(out)


def test_the_graph_is_the_real_one():
    """The check above is not vacuous: the mapping finds the modules and their imports."""
    modules = module_files()
    assert modules["kvtier.schemas.events"] == ROOT / "schemas" / "events.py"
    assert modules["kvtier.eval.replay"] == ROOT / "kvtier" / "eval" / "replay.py"
    assert modules["kvtier.router"] == ROOT / "router" / "__init__.py"
    graph = import_graph()
    assert len(graph) > 70 and sum(map(len, graph.values())) > 200
    # module-level, relative, `from package import submodule` and function-level imports
    assert "kvtier.schemas.hashes" in graph["kvtier.schemas.events"]  # from .hashes import WireBlockHash
    assert "kvtier.router.core" in graph["kvtier.router.service"]  # from .core import ...
    assert "kvtier.router.scoring" in graph["kvtier.tools.explain"]  # from kvtier.router import scoring
    assert "kvtier.tools.replay" in graph["kvtier.commands.replay"]  # inside run()


def test_find_cycles_reports_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    graph["d"] = {"f"}
    graph["f"] = {"d"}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["d", "f", "d"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set(), "e": {"e"}}) == []


def test_the_test_code_in_the_wheel_stays_in_kvtier_testing():
    """Hypothesis (a test dependency) is imported, even lazily, only by kvtier/testing/, so no
    service, tool or bench pulls it in; and kvtier/testing/ (the process stacks the benches, the
    evaluation and the tests share, and the fuzz table of every decoder, the tools' too) never
    imports the benches, the evaluation or the commands."""
    modules = module_files()
    with_hypothesis = sorted(
        module for module, path in modules.items()
        if any(isinstance(node, (ast.Import, ast.ImportFrom))
               and any(name.split(".")[0] == "hypothesis"
                       for name in ([a.name for a in node.names] if isinstance(node, ast.Import)
                                    else [node.module or ""]))
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))))
    assert with_hypothesis, "no module imports hypothesis: the check looks at nothing"
    outside = [m for m in with_hypothesis if not m.startswith("kvtier.testing.")]
    assert not outside, "hypothesis imported outside kvtier/testing/:\n  " + "\n  ".join(outside)
    graph = import_graph()
    above = ("kvtier.bench", "kvtier.eval", "kvtier.commands", "kvtier.cli")
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("kvtier.testing.")
                    for t in targets if any(t == p or t.startswith(p + ".") for p in above))
    assert not upward, "kvtier/testing/ imports upward:\n  " + "\n  ".join(upward)


def test_mypy_checks_every_package():
    """scripts/mypy checks what [tool.mypy] names: every package setuptools installs is in it
    (or under one that is), and every top-level module of kvtier (kvtier.cli)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    checked = config["tool"]["mypy"]["packages"]
    installed = config["tool"]["setuptools"]["packages"]
    unchecked = [p for p in installed if p != "kvtier" and not any(p == c or p.startswith(c + ".") for c in checked)]
    assert not unchecked, f"packages mypy does not check: {unchecked}"
    top = sorted(f"kvtier.{path.stem}" for path in (ROOT / "kvtier").glob("*.py") if path.stem != "__init__")
    assert top and set(top) <= set(config["tool"]["mypy"].get("modules", [])), top
