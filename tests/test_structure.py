"""The house's shape, read from the source with ``ast`` (every import counts: at module level,
inside functions, and type-only ones under ``TYPE_CHECKING``):

- data flows one way and so do imports: ``capture`` < ``planner`` < ``collector`` < ``api``
  (DESIGN, "Layout"); ``capture`` imports none of the others and ``planner`` only the field
  catalogue and the numba settings of ``capture``;
- inside ``collector/``, the modules every layer uses (``config``, ``metrics``, ``keys``) <
  ``pipeline/`` (the per-batch stages) < ``spark/`` (the HFTA) < ``daemon/``;
- no import cycle between modules, and no test module imported by another.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGES = ("capture", "planner", "collector", "api")
PLANNER_MAY_USE = {"capture.fields", "capture.jit"}
COLLECTOR_LAYERS = ("collector.pipeline", "collector.spark", "collector.daemon")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The project modules ``name`` imports (a name imported from a package resolves to its
    module when it is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        found |= {t for t in targets if t.split(".")[0] in PACKAGES and t != name}
    return found


GRAPH = {n: imports(n, p, modules()) for n, p in modules().items()}


def rank(module: str) -> tuple[int, int]:
    top = module.split(".")[0]
    inner = 0
    if top == "collector":
        inner = next((k + 1 for k, layer in enumerate(COLLECTOR_LAYERS)
                      if module == layer or module.startswith(layer + ".")), 0)
    return PACKAGES.index(top), inner


def test_the_graph_is_read():
    assert "collector.pipeline.engine" in GRAPH
    assert "collector.pipeline.prefilter" in GRAPH["collector.pipeline.engine"]
    assert "capture.batch" in GRAPH["collector.pipeline.prefilter"]


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_runs_up(module):
    up = sorted(t for t in GRAPH[module] if rank(t) > rank(module))
    assert not up, f"{module} imports a higher layer: {up}"
    if module.startswith("planner."):
        other = sorted(t for t in GRAPH[module]
                       if t.startswith("capture") and t not in PLANNER_MAY_USE)
        assert not other, f"{module} imports more of capture than {PLANNER_MAY_USE}: {other}"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(GRAPH.get(m, ())):
            if state.get(t) == 1:
                cycle = path[path.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t in GRAPH and t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_no_test_module_imports_another():
    """What tests share lives in helper modules (tests/helpers.py, pipelines.py, processes.py,
    reference.py, flowtools.py), never in a test module another one imports."""
    found = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                      if n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_")]
    assert not found, found
