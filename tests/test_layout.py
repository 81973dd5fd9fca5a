"""The layout's rules, checked on the source: imports point one way and never in a circle,
the layers below the service never import grpc, and no function grows past 80 lines
without saying why.

Imports are read with `ast`, all of them: at module level, inside functions (a lazy
import only hides a circle) and under `TYPE_CHECKING` (a type hint is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Import name -> folder, as pyproject.toml (the product) and bench/pyproject.toml map them.
PACKAGE_DIRS = {
    "croupier": REPO / "croupier",
    "croupier.v1": REPO / "protos" / "croupier" / "v1",
    "croupier.server": REPO / "server",
    "croupier.client": REPO / "client",
    "croupier.bench": REPO / "bench",
}
MAX_FUNCTION_LINES = 80
#: A longer function says why in its docstring, on a line starting with this.
LONG_REASON = "Long because"


def _modules() -> dict[str, Path]:
    """Every module of the product and of the harness: import name -> file."""
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for f in folder.rglob("*.py"):
            rel = f.relative_to(folder).with_suffix("")
            parts = list(rel.parts)
            if any(p.startswith(".") or p == "__pycache__" or p == "results" for p in parts):
                continue
            if pkg == "croupier" and parts[0] == "bench":
                continue  # not a folder of the product any more; croupier.bench is bench/
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([pkg, *parts])
            if pkg != "croupier" or not any(name == p or name.startswith(p + ".") for p in PACKAGE_DIRS if p != "croupier"):
                out[name] = f
    return out


MODULES = _modules()


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(name: str) -> str | None:
    """The croupier module an imported name lives in (a name may be a module's attribute)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """The croupier modules `module` imports, wherever in the file the import stands."""
    path = MODULES[module]
    package = _package_of(module, path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            names = [f"{root}.{a.name}" for a in node.names] + [root]
        else:
            continue
        for n in names:
            target = _resolve(n)
            # importing a submodule first imports its package; a package's __init__ is a
            # dependency only of modules outside that package
            if target and target != module and not module.startswith(target + "."):
                found.add(target)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_walk_sees_the_product() -> None:
    # the rules below are only as good as the walk: it must find the layers and their edges
    assert {"croupier.server.app", "croupier.client.loader", "croupier.protocol.options",
            "croupier.bench.real", "croupier.cli"} <= set(MODULES)
    assert "croupier.protocol.options" in GRAPH["croupier.client.loader"]


def test_no_import_circles() -> None:
    assert _cycles(GRAPH) == [], "modules that import each other, directly or around a ring"


def test_dependencies_point_one_way() -> None:
    """protocol <- server, client <- command line; the harness stands on top of it all."""
    rules = [
        ("croupier.v1", ("croupier.v1",)),
        ("croupier.protocol", ("croupier.v1", "croupier.protocol")),
        ("croupier.server", ("croupier.v1", "croupier.protocol", "croupier.server")),
        ("croupier.client", ("croupier.v1", "croupier.protocol", "croupier.client")),
    ]
    wrong = []
    for module, deps in GRAPH.items():
        for layer, allowed in rules:
            if _in(module, layer):
                wrong += [f"{module} -> {d}" for d in sorted(deps) if not _in(d, *allowed)]
        if not _in(module, "croupier.bench"):
            wrong += [f"{module} -> {d}" for d in sorted(deps) if _in(d, "croupier.bench")]
    assert wrong == []


def test_the_layers_below_the_service_never_import_grpc() -> None:
    quiet = ( "croupier.server.stream", "croupier.server.readers",
             "croupier.server.storage", "croupier.server.catalog", "croupier.server.config")
    offenders = []
    for module in MODULES:
        if not _in(module, *quiet):
            continue
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{module}: {n}" for n in names if n == "grpc" or n.startswith("grpc.")]
    assert offenders == []


def _long_functions(folder: Path) -> list[str]:
    out = []
    for f in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if lines > MAX_FUNCTION_LINES and not any(l.strip().startswith(LONG_REASON) for l in doc.splitlines()):
                    out.append(f"{f.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    return out


@pytest.mark.parametrize("folder", ["server", "client", "croupier"])
def test_no_function_over_80_lines_without_a_reason(folder: str) -> None:
    assert _long_functions(REPO / folder) == [], f"split them, or say why in a '{LONG_REASON} ...' docstring line"


def test_module_names_are_unique_in_the_product() -> None:
    seen: dict[str, list[str]] = {}
    for module in MODULES:
        if _in(module, "croupier.bench", "croupier.v1") or module.count(".") < 1:
            continue
        leaf = module.rpartition(".")[2]
        if leaf in {"__main__", "base"} or MODULES[module].name == "__init__.py":
            continue
        seen.setdefault(leaf, []).append(module)
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
