"""The package's shape: stages import one way, and no module imports itself through others.

Reads every `import` in andrea/ with ast (lazy imports inside functions count: a dependency
is a dependency wherever it is written) and checks two rules:

- no cycles between modules;
- no import points up the stages: helpers < data, cuda < model < train < trained < verbs <
  cli. data and cuda are separate stages of one rank and may not import each other; verbs
  may import each other.

The guard is checked on a small synthetic package too, so a planted cycle or an upward
import is shown to fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

# Lower rank = lower stage. A module's stage is the longest prefix listed here.
STAGES: dict[str, tuple[int, str]] = {
    "andrea.errors": (0, "helpers"),
    "andrea.fileio": (0, "helpers"),
    "andrea.resources": (0, "helpers"),
    "andrea.config": (0, "helpers"),
    "andrea.faults": (0, "helpers"),
    "andrea.folder_lock": (0, "helpers"),
    "andrea.data": (1, "data"),
    "andrea.cuda": (1, "cuda"),
    "andrea.model": (2, "model"),
    "andrea.train": (3, "train"),
    "andrea.trained": (4, "trained"),
    "andrea.evaluate": (5, "verbs"),
    "andrea.generate": (5, "verbs"),
    "andrea.hf": (5, "verbs"),
    "andrea.bench": (5, "verbs"),
    "andrea.runs": (5, "verbs"),
    "andrea.plot": (5, "verbs"),
    "andrea.tasks": (5, "verbs"),
    "andrea.cli": (6, "cli"),
    "andrea.__main__": (6, "cli"),
    "andrea": (0, "helpers"),
}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(root: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, for every .py file under root."""
    files = {module_name(root, p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the submodule when there is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    deps.add(target)
        graph[mod] = deps
    return graph


def stage(mod: str, stages: dict[str, tuple[int, str]]) -> tuple[int, str]:
    for prefix in sorted(stages, key=len, reverse=True):
        if mod == prefix or mod.startswith(prefix + "."):
            return stages[prefix]
    raise AssertionError(f"{mod} belongs to no stage: add it to STAGES")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def upward_imports(graph: dict[str, set[str]], stages: dict[str, tuple[int, str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        rank, name = stage(mod, stages)
        for dep in sorted(deps):
            dep_rank, dep_name = stage(dep, stages)
            if dep_rank > rank or (dep_rank == rank and dep_name != name and name != "verbs"):
                bad.append(f"{mod} ({name}) imports {dep} ({dep_name})")
    return bad


def test_andrea_has_no_import_cycle() -> None:
    cycle = find_cycle(imports_of(REPO / "andrea"))
    assert cycle is None, " -> ".join(cycle or [])


def test_andrea_imports_point_down_the_stages() -> None:
    assert upward_imports(imports_of(REPO / "andrea"), STAGES) == []


def test_every_module_belongs_to_a_stage() -> None:
    for mod in imports_of(REPO / "andrea"):
        stage(mod, STAGES)


def test_verbs_open_a_trained_model_through_trained_not_evaluate() -> None:
    """Finding and loading a checkpoint is andrea.trained's: the verbs that open one use it,
    and only the CLI imports the eval verb. `andrea runs` opens no model: it reads the run's
    files (train.rundir's checks), without torch (tests/test_cli.py)."""
    graph = imports_of(REPO / "andrea")
    assert {mod for mod, deps in graph.items() if "andrea.evaluate" in deps} == {"andrea.cli"}
    for verb in ("andrea.evaluate", "andrea.generate", "andrea.hf"):
        assert "andrea.trained" in graph[verb], verb
    assert "andrea.trained" not in graph["andrea.runs"]
    assert "andrea.train.rundir" in graph["andrea.runs"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    return _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/base.py": "import os\n",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": "from pkg import base\nfrom . import b\n",
        "pkg/low/b.py": "from pkg.base import os\n",
        "pkg/high.py": "from pkg.low.a import b\n",
    })


SYNTHETIC_STAGES = {"pkg.base": (0, "helpers"), "pkg.low": (1, "low"), "pkg.high": (2, "high"),
                    "pkg": (0, "helpers")}


def test_guard_reads_absolute_and_relative_imports(synthetic: Path) -> None:
    graph = imports_of(synthetic)
    assert graph["pkg.low.a"] == {"pkg.base", "pkg.low.b"}
    assert graph["pkg.high"] == {"pkg.low.a"}
    assert find_cycle(graph) is None
    assert upward_imports(graph, SYNTHETIC_STAGES) == []


def test_guard_finds_a_planted_cycle(synthetic: Path) -> None:
    # A lazy import inside a function closes the loop b -> a -> b.
    (synthetic / "low" / "b.py").write_text("def f():\n    from pkg.low import a\n")
    cycle = find_cycle(imports_of(synthetic))
    assert cycle is not None and set(cycle) == {"pkg.low.a", "pkg.low.b"}


def test_guard_finds_an_upward_import(synthetic: Path) -> None:
    (synthetic / "base.py").write_text("from pkg.high import b\n")
    bad = upward_imports(imports_of(synthetic), SYNTHETIC_STAGES)
    assert bad == ["pkg.base (helpers) imports pkg.high (high)"]
