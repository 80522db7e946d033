"""The import structure of `services/`: no circles, and the lower layers import nothing above them.

Every import counts, those inside functions too: a deferred import still ties the two modules
together. The layers are docs/architecture.md's.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ROOT / "services"

# package → the packages it may import (besides itself); packages not named here are only held to no circles
ALLOWED_BELOW = {
    "common": set(),
    "sandbox": {"common"},
    "formatter": {"common"},
    "reward": {"common", "formatter", "sandbox"},
    "weights": {"common"},
    # the recipe and its synth, SFT and eval stages: never the controller that runs them, nor the entry point
    "pipeline": {
        "common",
        "sandbox",
        "formatter",
        "reward",
        "evaluation",
        "synth",
        "qa",
        "rollout",
        "learner",
        "episodes",
        "weights",
        "models",
        "model_families",
    },
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in SERVICES.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The `services` modules a file imports, resolving `from package import module` to the module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("services")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("services"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return {m for m in found if m in modules}


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def package(module: str) -> str:
    """`services.reward.evaluator.core` → `reward`; top-level modules (`services.cli`) are their own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = defaultdict(set)
    for src, dsts in edges.items():
        packages[package(src)] |= {package(d) for d in dsts} - {package(src)}
    return packages


def test_no_module_imports_itself_around_a_circle():
    assert cycles(graph()) == []


def test_no_package_imports_itself_around_a_circle():
    assert cycles(package_graph(graph())) == []


@pytest.mark.parametrize("lower", sorted(ALLOWED_BELOW))
def test_lower_layers_import_nothing_above_them(lower):
    edges = graph()
    upward = sorted(
        f"{src} → {dst}"
        for src, dsts in edges.items()
        if package(src) == lower
        for dst in dsts
        if package(dst) not in ALLOWED_BELOW[lower] | {lower}
    )
    assert upward == [], f"services/{lower} may import only {sorted(ALLOWED_BELOW[lower])}"


def test_the_checks_see_a_circle_and_an_upward_import():
    """The checker itself: a made-up graph with a circle and a common → rollout edge."""
    edges = {"services.a.x": {"services.b.y"}, "services.b.y": {"services.a.x"}, "services.common.z": set()}
    assert cycles(edges) == [["services.a.x", "services.b.y"]]
    assert cycles(package_graph(edges)) == [["a", "b"]]
    real = graph()
    assert "services.rollout.protocol" in real["services.rollout.agent"]  # imports are found at all
