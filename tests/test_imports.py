"""The package's shape, read from its imports (ast, every import, lazy ones inside functions too): no
import circles, and nothing in a lower room imports an upper one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "oommagic"

# Floors, lowest first: a module may import its own floor and those below, never above. Within a floor,
# the no-circle rule alone holds.
FLOORS = [
    {"sizes", "timeline", "options", "oom", "devices", "lengths", "categories"},
    {"diagnosis"},
    {"cellrun"},
    {"comm"},
    {"run"},
    {"view"},
    {"magics", "server", "__init__"},
]


def room(module: str) -> str:
    """'oommagic.run.session' -> 'run'; 'oommagic.cellrun' -> 'cellrun'; 'oommagic' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor(module: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room(module) in rooms)


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (resolved, relative included)."""
    graph: dict[str, set[str]] = {}
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        is_package = path.name == "__init__.py"
        base = name.split(".") if is_package else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    prefix = base[: len(base) - node.level + 1]
                    target = ".".join([*prefix, *(node.module.split(".") if node.module else [])])
                else:
                    target = node.module or ""
                # `from .. import comm` imports the module oommagic.comm; `from ..x import y` imports x.
                candidates = [
                    f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names
                ]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            found |= {c for c in candidates if c in modules and c != name}
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = imports()
    # A package's __init__ re-exporting its own modules is not a circle of the code.
    graph = {
        k: {d for d in v if not k.startswith(d + ".") and not d.startswith(k + ".")} for k, v in graph.items()
    }
    assert cycles(graph) == []


def test_nothing_imports_a_room_above_its_own():
    upward = [
        f"{src} -> {dst}"
        for src, targets in imports().items()
        for dst in targets
        if floor(dst) > floor(src) and room(dst) != room(src)
    ]
    assert upward == []


def test_the_core_imports_neither_torch_nor_ipython_at_module_level():
    """Parsing, diagnosis, the plan's arithmetic, timeline maths and sizes run on plain data."""
    for path in [
        *PACKAGE.glob("diagnosis/*.py"),
        *PACKAGE.glob("oom/*.py"),
        PACKAGE / "sizes.py",
        PACKAGE / "timeline.py",
        PACKAGE / "options.py",
        PACKAGE / "cellrun.py",
    ]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in top if isinstance(n, ast.ImportFrom)}
        assert not {m.split(".")[0] for m in names} & {"torch", "IPython", "ipywidgets"}, path.name


def test_every_module_sits_on_a_floor():
    for name in imports():
        floor(name)  # raises StopIteration for a room no floor lists
