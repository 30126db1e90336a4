"""meshd's rooms only look down: every import of one meshd room by another (at the top of a module, inside
a function, or for type checking alike) goes from a room to one listed before it in the package's
opening (meshd/__init__.py's `ROOMS`), so a newcomer can read the rooms bottom up and a cycle cannot form.
Pure: parses the sources, imports nothing of them."""

import ast
from pathlib import Path

import meshd

PACKAGE = Path(meshd.__file__).parent


def imports_of(path: Path):
    """(line, module) of every meshd module `path` imports, wherever in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "meshd" else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        yield from ((node.lineno, name) for name in names if name.startswith("meshd."))


def room_of(module: str) -> str:
    return module.split(".")[1]


def looking_up() -> list[str]:
    rank = {room: i for i, room in enumerate(meshd.ROOMS)}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        if len(rel.parts) < 3:
            continue  # meshd/__init__.py itself
        here = rel.parts[1]
        for line, module in imports_of(path):
            there = room_of(module)
            if there != here and rank[there] > rank[here]:
                found.append(f"{rel}:{line} ({here}) imports {module} ({there})")
    return found


def test_every_room_is_named_in_the_order():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(meshd.ROOMS), f"rooms not in meshd.ROOMS: {rooms - set(meshd.ROOMS)}; " \
                                      f"named but absent: {set(meshd.ROOMS) - rooms}"
    assert len(set(meshd.ROOMS)) == len(meshd.ROOMS)


def test_no_room_imports_a_room_above_it():
    assert looking_up() == []


def test_the_check_sees_an_import_that_looks_up(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\nfrom meshd.node.daemon import Daemon\n\ndef f():\n    from meshd import cli\n")
    assert list(imports_of(source)) == [(2, "meshd.node.daemon"), (5, "meshd.cli")]
    assert meshd.ROOMS.index(room_of("meshd.node.daemon")) > meshd.ROOMS.index("wire")
