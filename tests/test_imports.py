"""The import graph of onnxmp, read from the sources' ``import`` / ``from`` statements (AST, nothing imported).

* no module-level import circle anywhere in onnxmp;
* no circle in onnxmp.training even counting the imports inside functions;
* the training run side (onnxmp/training/run/) never imports the build side (onnxmp/training/build/),
  at any level: a run needs no onnxruntime-training and no build stage;
* no module name appears twice under onnxmp/training/ (one name, one meaning).
"""
from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "onnxmp"


def _modules() -> dict[str, tuple[Path, bool]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The onnxmp module ``name`` is, or holds (``onnxmp.errors.OnnxMPError`` -> ``onnxmp.errors``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(tree: ast.Module, module: str, is_package: bool, module_level: bool) -> set[str]:
    """The onnxmp modules ``module`` imports: at module level only, or anywhere (inside functions too);
    ``TYPE_CHECKING`` blocks, which never run, are left out either way."""
    body = [n for n in tree.body if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
    if module_level:
        nodes = [inner for n in body for inner in (ast.walk(n) if isinstance(n, (ast.If, ast.Try)) else [n])]
    else:
        nodes = [inner for n in body for inner in ast.walk(n)]
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package (of the package...) of this module
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            # `from pkg import sub` imports the module pkg.sub; `from mod import name` the module mod.
            names += [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return {owner for owner in map(_owner, (n for n in names if n.split(".")[0] == "onnxmp"))
            if owner and owner != module}


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _graph(module_level: bool, within: str = "onnxmp") -> dict[str, set[str]]:
    graph = {}
    for module, (path, is_package) in MODULES.items():
        if module == within or module.startswith(within + "."):
            imported = _imported(_tree(path), module, is_package, module_level)
            graph[module] = {m for m in imported if m == within or m.startswith(within + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_level_import_circles_in_onnxmp():
    assert _cycles(_graph(module_level=True)) == []


def test_no_import_circles_in_onnxmp_even_inside_functions():
    assert _cycles(_graph(module_level=False)) == []


@pytest.mark.parametrize("module_level", [True, False], ids=["module level", "any level"])
def test_the_run_side_never_imports_the_build_side(module_level):
    run = _graph(module_level, within="onnxmp")
    offenders = {module: sorted(m for m in imported if m.startswith("onnxmp.training.build"))
                 for module, imported in run.items() if module.startswith("onnxmp.training.run")}
    assert {m: i for m, i in offenders.items() if i} == {}
    assert any(m.startswith("onnxmp.training.run.") for m in run)  # the walk saw the run side


def test_the_import_graph_sees_function_level_imports():
    # build_artifacts imports onnxmp.load inside a stage's call: only the any-level graph has it.
    assert "onnxmp.load" in _graph(False)["onnxmp.training.build.pipeline"]
    assert "onnxmp.load" not in _graph(True)["onnxmp.training.build.pipeline"]


def test_no_module_name_appears_twice_in_training():
    stems = Counter(path.stem for path in (PACKAGE / "training").rglob("*.py") if path.stem != "__init__")
    stems.update(path.name for path in (PACKAGE / "training").rglob("*")
                 if path.is_dir() and path.name != "__pycache__")
    assert [stem for stem, n in stems.items() if n > 1] == []


def test_a_run_loads_no_build_stage():
    # What the AST walk cannot see: a package __init__ importing more than its module needs.
    code = ("import sys; import onnxmp.training.run.trainer, onnxmp.training.run.engines.portable; "
            "from onnxmp.training import Trainer, DynamicLossScaler; "
            "print(sorted(m for m in sys.modules if m.startswith('onnxmp.training.build')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"
