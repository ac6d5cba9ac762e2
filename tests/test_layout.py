"""The house rules, checked on the source (CONTRIBUTING.md, "Layout" and "Size"):
dependencies point downwards and never in a circle, the simulator stays off the
network, and modules and functions stay small enough to read."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "zoo", "peer", "coordinator", "sim", "fusionllm")
#: what each package may import of the others (the layering of DESIGN.md)
MAY_IMPORT = {
    "protocol": set(),
    "zoo": {"protocol"},
    "peer": {"protocol", "zoo"},
    "coordinator": {"protocol", "zoo"},
    "sim": {"protocol", "zoo", "coordinator"},
    "fusionllm": {"protocol", "zoo", "peer", "coordinator", "sim"},
}
#: third-party packages that mean networking: the simulator's closure must hold none
NETWORKING = {"hivemind", "aiohttp", "multiaddr", "socket"}
SIZED = ("protocol", "peer", "coordinator")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []:
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST) -> Iterator[tuple[str, list[str]]]:
    """(module, names) of every import in ``tree``, at any depth, but not under ``if TYPE_CHECKING``."""
    for node in ast.iter_child_nodes(tree):
        if _type_checking(node):
            continue
        if isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, [a.name for a in node.names]
        yield from _imports(node)


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Edges between our modules, and the third-party top-level packages each imports."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    external: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for target, names in _imports(ast.parse(path.read_text())):
            if target.split(".")[0] not in PACKAGES:
                external[mod].add(target.split(".")[0])
                continue
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            edges[mod].update(subs or ([target] if target in modules else []))
            edges[mod].discard(mod)
    return edges, external


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    """None anywhere, the command line included: it imports its commands, they import
    what they share from a module below both (``fusionllm.usage``), never the parser."""
    edges, _ = _graph()
    assert _cycles(edges) == []


def test_dependencies_point_downwards() -> None:
    edges, _ = _graph()
    wrong = [
        f"{a} imports {b}"
        for a, targets in edges.items()
        for b in targets
        if a.split(".")[0] != b.split(".")[0] and b.split(".")[0] not in MAY_IMPORT[a.split(".")[0]]
    ]
    assert wrong == []


def test_the_simulator_reaches_no_networking() -> None:
    edges, external = _graph()
    seen, todo = set(), [m for m in edges if m.startswith("sim")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(edges[m])
    assert {m: sorted(external[m] & NETWORKING) for m in seen if external[m] & NETWORKING} == {}


def _sized() -> list[Path]:
    return [p for pkg in SIZED for p in sorted((ROOT / pkg).rglob("*.py"))]


@pytest.mark.parametrize("path", _sized(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_stay_small(path: Path) -> None:
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{lines} lines"
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_cycle_finder_finds_cycles() -> None:
    """The checks above pass on a tree without cycles; here they must see one."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]


def test_contributing_names_every_module() -> None:
    """CONTRIBUTING.md says where each concern lives: every module of ours has its row
    (by file name, as its tables write them), so a new one cannot land unnamed."""
    guide = (ROOT / "CONTRIBUTING.md").read_text()
    unnamed = [
        str(path.relative_to(ROOT))
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).rglob("*.py"))
        if path.name != "__init__.py" and f"{path.name}`" not in guide
    ]
    assert unnamed == [], f"add a row to CONTRIBUTING.md for: {unnamed}"
