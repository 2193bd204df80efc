"""The import graph of the `blockgen` package, read from the source with `ast`: no cycles, and the layers
of the design (models <- harness <- tasks) hold.

Every import counts, at module level or inside a function: an import hidden in a function still ties
the two modules together. Module names come from pyproject.toml's package layout (`blockgen.harness`
is the folder harness/, ...), so the graph is the one Python imports, whatever the folders are called."""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edge:
    target: str
    line: int


def package_dirs() -> dict[str, Path]:
    """Package name -> folder, as setuptools installs them: the package-dir of the package or of its
    nearest mapped parent (`blockgen.harness.training` -> harness/training), else the dotted path."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = tool.get("package-dir", {})

    def folder(name: str) -> Path:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mapped:
                return REPO / mapped[".".join(parts[:i])] / "/".join(parts[i:])
        return REPO / name.replace(".", "/")

    return {name: folder(name) for name in tool["packages"]}


def modules() -> dict[str, Path]:
    """Every module of the package: its dotted name -> its file."""
    out: dict[str, Path] = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> tuple[list[Edge], list[str]]:
    """(edges to modules of the package, imported `blockgen` names that are no module of it)."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    edges, unresolved = [], []

    def resolve(candidates: list[str], line: int, what: str) -> None:
        found = next((c for c in candidates if c in known), None)
        if found is not None:
            edges.append(Edge(found, line))
        elif what.split(".")[0] == "blockgen":
            unresolved.append(f"{path.relative_to(REPO)}:{line}: {what}")

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve([alias.name], node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:  # `from pkg import module` imports the module; else the name is in `base`
                resolve([f"{base}.{alias.name}", base], node.lineno, f"{base}.{alias.name}")
    return edges, unresolved


def graph() -> tuple[dict[str, list[Edge]], dict[str, Path], list[str]]:
    mods = modules()
    edges, unresolved = {}, []
    for name, path in mods.items():
        found, missing = imports(name, path, set(mods))
        edges[name] = [e for e in found if e.target != name]
        unresolved += missing
    return edges, mods, unresolved


def find_cycle(edges: dict[str, list[Edge]]) -> list[tuple[str, Edge]] | None:
    """One cycle as [(module, the edge it imports the next one by), ...], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[tuple[str, Edge]] = []

    def visit(node: str) -> list[tuple[str, Edge]] | None:
        state[node] = 1
        for edge in edges.get(node, []):
            path.append((node, edge))
            if state.get(edge.target) == 1:
                start = next(i for i, (n, _) in enumerate(path) if n == edge.target)
                return path[start:]
            if edge.target not in state:
                found = visit(edge.target)
                if found:
                    return found
            path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def describe(cycle: list[tuple[str, Edge]], mods: dict[str, Path]) -> str:
    steps = [f"{name} ({mods[name].relative_to(REPO)}:{edge.line}) imports {edge.target}" if name in mods
             else f"{name} imports {edge.target}" for name, edge in cycle]
    return "import cycle:\n  " + "\n  ".join(steps)


def package_of(module: str) -> str:
    """The layer a module belongs to: blockgen.models, blockgen.harness, blockgen.tasks, or blockgen (the rest)."""
    for layer in ("blockgen.models", "blockgen.harness", "blockgen.tasks"):
        if module == layer or module.startswith(layer + "."):
            return layer
    return "blockgen"


# ------------------------------------------------------------------------------ the checks


def test_the_graph_is_read_from_every_module():
    """Not vacuous: every file of the mapped folders is a node, module- and function-level imports are
    edges, and every `blockgen` import names a module that exists."""
    edges, mods, unresolved = graph()
    assert unresolved == [], "imports of names that are no module of the package:\n" + "\n".join(unresolved)
    for folder in ("models", "harness", "tasks"):
        for path in (REPO / folder).rglob("*.py"):
            assert path in mods.values(), path
    targets = {name: {e.target for e in out} for name, out in edges.items()}
    assert "blockgen.harness.reports.leaderboard" in targets["blockgen.harness.reports.regression"]  # module level
    assert "blockgen.harness.training.train" in targets["blockgen.harness.cli"]  # inside `main`
    assert "blockgen.models.model" in targets["blockgen.harness.checkpoints.checkpoint"]  # across the mapped folders


def test_find_cycle_reports_the_loop_with_its_lines():
    loop = {"a": [Edge("b", 3)], "b": [Edge("c", 5)], "c": [Edge("a", 7), Edge("d", 8)], "d": []}
    cycle = find_cycle(loop)
    assert [(n, e.target, e.line) for n, e in cycle] == [("a", "b", 3), ("b", "c", 5), ("c", "a", 7)]
    assert "c imports a" in describe(cycle, {})
    assert find_cycle({"a": [Edge("b", 1)], "b": [Edge("c", 1)], "c": []}) is None


def test_no_import_cycles():
    edges, mods, _ = graph()
    cycle = find_cycle(edges)
    assert cycle is None, describe(cycle, mods)


@pytest.mark.parametrize("lower, upper", [("blockgen.models", "blockgen.harness"), ("blockgen.models", "blockgen.tasks"),
                                          ("blockgen.harness", "blockgen.tasks")])
def test_layers_import_only_downwards(lower, upper):
    """models/ is the science and imports neither harness/ nor tasks/; harness/ never imports tasks/
    (the tasks call harness helpers, and any lm-eval model runs them)."""
    edges, mods, _ = graph()
    wrong = [f"{name} ({mods[name].relative_to(REPO)}:{e.line}) imports {e.target}"
             for name, out in edges.items() if package_of(name) == lower for e in out if package_of(e.target) == upper]
    assert wrong == [], "\n".join(wrong)


# The wings of harness/, lowest first: a wing imports only the wings before it (and models/); the
# top-level modules (cli, demo, gpu_check) may import any. So a checkpoint loads without training or
# evaluation, training never needs evaluation, costs or reports, and reports read everything.
WINGS = ("runtime", "checkpoints", "data", "training", "costs", "evaluation", "reports")
TOP_LEVEL_PACKAGES = ("gpu_check",)  # a top-level command grown into a package: no wing, it may import any


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    inside = parts[:2] == ["blockgen", "harness"] and len(parts) >= 4
    return parts[2] if inside and parts[2] not in TOP_LEVEL_PACKAGES else None


def test_wings_import_downwards():
    edges, mods, _ = graph()
    found = {wing_of(name) for name in mods} - {None}
    assert found == set(WINGS), f"harness/'s wings {sorted(found)} are not the ordered ones {list(WINGS)}"
    wrong = []
    for name, out in edges.items():
        source = wing_of(name)
        for e in out:
            target = wing_of(e.target)
            if source and target and WINGS.index(target) > WINGS.index(source):
                wrong.append(f"{name} ({mods[name].relative_to(REPO)}:{e.line}) imports {e.target}: {source} may not import {target}")
    assert wrong == [], "\n".join(wrong)
