"""The layout stays true: no import cycle between modules of the three packages, no private import across them,
short files and functions, few modules flat in ``adaptive_mem/`` (docs/architecture.md states these rules)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("profiler", "search", "adaptive_mem")
# Which package may import which (docs/architecture.md): profiler <- search <- adaptive_mem.
ALLOWED = {"profiler": {"profiler"}, "search": {"profiler", "search"},
           "adaptive_mem": {"profiler", "search", "adaptive_mem"}}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> modules of the three packages it imports, at any depth of its body (lazy imports
    in functions count: they hide cycles, they do not remove them)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # ``from pkg import sub`` imports the submodule ``pkg.sub`` where one exists
                subs = [f"{stem}.{a.name}" for a in node.names if f"{stem}.{a.name}" in modules]
                targets = subs if subs and len(subs) == len(node.names) else [stem, *subs]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
        for w in sorted(graph[v]):
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


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_packages_import_one_way():
    wrong = [f"{a} imports {b}" for a, targets in import_graph().items() for b in targets
             if b.split(".")[0] not in ALLOWED[a.split(".")[0]]]
    assert wrong == []


def test_cycle_check_can_fail(tmp_path):
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "search" / "_a.py").write_text("from ._b import x\n")
    (tmp_path / "search" / "_b.py").write_text("def f():\n    from search import _a\n")
    (tmp_path / "adaptive_mem" / "_c.py").write_text("import search._a\n")
    assert cycles(import_graph(tmp_path)) == [["search._a", "search._b"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_source_file_over_400_lines(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_few_modules_flat_in_adaptive_mem():
    flat = sorted(p.name for p in (ROOT / "adaptive_mem").glob("*.py"))
    assert len(flat) <= 8, flat


def test_architecture_doc_names_every_folder():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    folders = [p for p in (ROOT / "adaptive_mem").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    missing = [f"adaptive_mem/{p.name}/" for p in folders if f"adaptive_mem/{p.name}/" not in doc]
    assert missing == []
    for pkg in ("profiler/", "search/"):
        assert pkg in doc


def long_functions(root: Path = ROOT, limit: int = 60) -> dict[str, int]:
    """``path:line name`` -> length of every function (def line to last line) longer than ``limit`` lines."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > limit:
                        out[f"{path.relative_to(root)}:{node.lineno} {node.name}"] = length
    return out


def private_imports(root: Path = ROOT) -> list[str]:
    """Imports of another package's private module or private name (``search._plan``, ``_MATMUL_OPS``):
    across packages only what a package makes public is used."""
    found = []
    for name, path in _modules(root).items():
        home = name.split(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                pairs = [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                pairs = [(a.name, "") for a in node.names]
            else:
                continue
            for module, imported in pairs:
                parts = module.split(".")
                if parts[0] in PACKAGES and parts[0] != home and (
                        any(p.startswith("_") for p in parts[1:]) or imported.startswith("_")):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {module} {imported}".strip())
    return found


def test_no_function_over_60_lines():
    assert long_functions() == {}


def test_no_private_import_across_packages():
    assert private_imports() == []


def test_function_and_import_checks_can_fail(tmp_path):
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "search" / "_a.py").write_text("def f():\n" + "    x = 1\n" * 60)
    (tmp_path / "adaptive_mem" / "_b.py").write_text(
        "from search._a import f\nfrom search import _hidden\nimport profiler._c\nfrom adaptive_mem._d import g\n")
    assert long_functions(tmp_path) == {"search/_a.py:1 f": 61}
    assert private_imports(tmp_path) == ["adaptive_mem/_b.py:1 search._a f", "adaptive_mem/_b.py:2 search _hidden",
                                         "adaptive_mem/_b.py:3 profiler._c"]
