"""Imports run one way: ``cli, server → engine → backends → {models, quant, kv, artifacts, tile_cache} →
{profiles, preflight, device, power, progress} → errors`` (docs/architecture.md), with no cycles.

Every ``edgeinfer`` import in the package is read from the source (deferred imports inside
functions included), so a lower room reaching up is caught even where it imports lazily.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import edgeinfer

PACKAGE = Path(edgeinfer.__file__).parent

# Room -> layer; a module may import its own layer or lower ones, never a higher one.
LAYERS = {
    "errors": 0,
    "profiles": 1, "preflight": 1, "device": 1, "power": 1, "demo": 1, "progress": 1,
    "models": 2, "quant": 2, "kv": 2, "artifacts": 2, "tile_cache": 2,
    "backends": 3,
    "engine": 4,
    "cli": 5, "server": 5, "bench": 5, "doctor": 5, "testing": 5, "__init__": 5,
}


# The bare package holds only ``__version__`` and a lazy facade: any room may read it.
PACKAGE_ITSELF = "edgeinfer"


def room_of(module: str) -> str:
    """``edgeinfer.kv.pool`` -> ``kv``; ``edgeinfer`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def edgeinfer_imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports, anywhere in the file."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "edgeinfer"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "edgeinfer":
                modules = {f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")}
                found |= modules | ({base} if len(modules) < len(node.names) else set())
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    edges = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        edges[module_name(path)] = {m for m in edgeinfer_imports(path) if _is_module(m)}
    return edges


def test_every_room_has_a_layer():
    rooms = {room_of(m) for m in graph()}
    assert rooms <= set(LAYERS), f"rooms without a layer in this test: {sorted(rooms - set(LAYERS))}"


def test_the_package_itself_imports_nothing_eagerly():
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    eager = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not eager, "edgeinfer/__init__.py must import lazily: every room imports it for __version__"


def test_no_room_imports_a_higher_one():
    upward = [f"{src} imports {dst} ({room_of(src)} is layer {LAYERS[room_of(src)]}, "
              f"{room_of(dst)} is layer {LAYERS[room_of(dst)]})"
              for src, targets in graph().items() for dst in sorted(targets)
              if dst != PACKAGE_ITSELF and LAYERS.get(room_of(dst), -1) > LAYERS.get(room_of(src), 99)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles():
    edges = graph()
    # A package's __init__ re-exporting its own modules is not a cycle of rooms.
    edges = {src: {d for d in dst if d != src and not src.startswith(d + ".") and not d.startswith(src + ".")}
             for src, dst in edges.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("source, imported, allowed", [
    ("edgeinfer.kv.pool", "edgeinfer.engine.engine", False),
    ("edgeinfer.engine.engine", "edgeinfer.kv.pool", True),
    ("edgeinfer.profiles", "edgeinfer.kv.sizing", False),
])
def test_the_layer_rule_itself(source, imported, allowed):
    assert (LAYERS[room_of(imported)] <= LAYERS[room_of(source)]) is allowed
