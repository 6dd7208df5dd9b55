"""The layer table of docs/architecture.md holds for every module under dsrun/: imports run down the layers
only, no two modules import each other (directly or through others), every module has a room, and no file
passes 600 lines. Imports inside functions count as much as those at the top of a file."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dsrun"
MAX_LINES = 600


def layer_table() -> dict[str, int]:
    text = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    rooms: dict[str, int] = {}
    for line in block.group(1).splitlines():
        layer, _, names = line.partition(":")
        for name in names.split():
            assert name not in rooms, f"room {name} listed twice"
            rooms[name] = int(layer)
    return rooms


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import sub` imports pkg.sub (and runs pkg's __init__, which is above it anyway);
            # `from pkg import name` imports pkg itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name and target.startswith("dsrun"):
                found.add(target)
    return found


def room_of(name: str, rooms: dict[str, int]) -> str | None:
    best = None
    for room in rooms:
        matches = name == room or (room != "dsrun" and name.startswith(room + "."))
        if matches and (best is None or len(room) > len(best)):
            best = room
    return best


def test_every_module_has_a_room_and_imports_only_downwards() -> None:
    rooms, known = layer_table(), modules()
    problems = []
    for name, path in sorted(known.items()):
        room = room_of(name, rooms)
        if room is None:
            problems.append(f"{name}: in no room of docs/architecture.md's layer table")
            continue
        for target in sorted(imports_of(name, path, known)):
            other = room_of(target, rooms)
            if other is not None and other != room and rooms[other] >= rooms[room]:
                problems.append(f"{name} (layer {rooms[room]}, {room}) imports {target} "
                                f"(layer {rooms[other]}, {other})")
    assert not problems, "\n".join(problems)


def test_no_import_cycles() -> None:
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"modules importing each other: {cycles}"


def test_no_file_over_600_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_checker_sees_an_upward_import(tmp_path) -> None:
    """The checker itself: a lower room importing a higher one is reported (inside a function too)."""
    rooms = {"dsrun.low": 0, "dsrun.high": 1}
    low = tmp_path / "low.py"
    low.write_text("def f():\n    from dsrun.high import thing\n")
    known = {"dsrun.low": low, "dsrun.high": tmp_path / "high.py"}
    assert imports_of("dsrun.low", low, known) == {"dsrun.high"}
    assert rooms[room_of("dsrun.high", rooms)] > rooms[room_of("dsrun.low", rooms)]
    assert room_of("dsrun.lowest", rooms) is None and room_of("dsrun", {"dsrun": 0}) == "dsrun"


def top_level(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_no_two_top_level_packages_import_each_other() -> None:
    """Rooms nest (a module may have a room of its own inside a package), but the top-level packages of dsrun
    form a DAG: none imports another that imports it back, directly or through others."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        for target in imports_of(name, path, known):
            if top_level(target) != top_level(name):
                graph.setdefault(top_level(name), set()).add(top_level(target))

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    pairs = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if reaches(b, a)})
    assert not pairs, f"top-level packages importing each other: {pairs}"


MAX_ANY_PARAMETERS = 120


def any_parameters() -> dict[str, int]:
    """Function parameters annotated exactly ``Any`` (or ``Any | None``), per file: the untyped seams."""
    counts: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, *(a for a in (args.vararg, args.kwarg) if a)]:
                    if arg.annotation is not None and ast.unparse(arg.annotation) in ("Any", "Any | None"):
                        counts[str(path.relative_to(REPO))] = counts.get(str(path.relative_to(REPO)), 0) + 1
    return counts


def test_seams_are_typed() -> None:
    counts = any_parameters()
    worst = sorted(counts.items(), key=lambda kv: -kv[1])[:10]
    assert sum(counts.values()) <= MAX_ANY_PARAMETERS, f"{sum(counts.values())} Any-typed parameters; most: {worst}"


def test_one_class_per_deepspeed_config_name() -> None:
    for class_name in ("DeepSpeedConfig", "ElasticityConfig"):
        defined = [str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py")
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.ClassDef) and node.name == class_name]
        assert len(defined) == 1, f"class {class_name} defined in {defined}"


def import_time_environment_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read the environment (``os.environ``, ``os.getenv``) when the module is imported:
    at module level, in a class body, a decorator or a default argument; a function body runs only when called."""
    found: list[int] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for part in [*getattr(node, "decorator_list", []), *node.args.defaults,
                         *(d for d in node.args.kw_defaults if d is not None)]:
                visit(part)
            return
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("environ", "getenv", "environb"):
            found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_no_module_reads_the_environment_when_imported() -> None:
    """The test ranks are forked from a server that imported dsrun once (tests/helpers.py, ``_PRELOAD``), each with
    its own environment put back after the fork: a value read at import would be the server's, not the rank's."""
    reads = {str(path.relative_to(REPO)): lines for root in (PACKAGE, REPO / "op_builder")
             for path in root.rglob("*.py") if (lines := import_time_environment_reads(path))}
    assert not reads, f"environment read at import (read it inside the function that needs it): {reads}"


def test_the_environment_check_sees_an_import_time_read(tmp_path) -> None:
    module = tmp_path / "module.py"
    module.write_text("import os\nA = os.environ.get('X')\nclass C:\n    B = os.getenv('Y')\n"
                      "def f(c=os.environ['Z']):\n    return os.environ.get('W')\n")
    assert import_time_environment_reads(module) == [2, 4, 5]
