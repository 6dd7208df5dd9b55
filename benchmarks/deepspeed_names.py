"""How much of DeepSpeed's Python API, as real client code uses it, resolves through dsrun's ``deepspeed`` alias.

The list is ``benchmarks/deepspeed_names.txt``: every ``deepspeed.*`` name (module, function, class, constant)
that the Python files of DeepSpeedExamples importing deepspeed use, found statically (``import deepspeed``,
``import deepspeed.X as Y``, ``from deepspeed.X import Z``, and attribute chains read off those bindings).
Counting installs the alias (``dsrun.alias.install()``) and resolves each name: import the longest module
prefix, then ``getattr`` the rest.

    python benchmarks/deepspeed_names.py                      # count the kept list, print what is missing
    python benchmarks/deepspeed_names.py --scan DIR --write   # rebuild the list from a DeepSpeedExamples checkout
"""
from __future__ import annotations

import argparse
import ast
import importlib
import sys
from collections import Counter
from pathlib import Path

LIST = Path(__file__).with_name("deepspeed_names.txt")


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"], or None if the expression is not a plain dotted name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id] + parts[::-1]
    return None


def names_in_source(source: str) -> set[str]:
    """The ``deepspeed.*`` names one file uses (empty if it does not import deepspeed)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    bound: dict[str, str] = {}  # local name -> the deepspeed path it is bound to
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "deepspeed" or alias.name.startswith("deepspeed."):
                    used.add(alias.name)
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound["deepspeed"] = "deepspeed"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "deepspeed" or node.module.startswith("deepspeed.")):
            for alias in node.names:
                if alias.name == "*":
                    used.add(node.module)
                    continue
                used.add(f"{node.module}.{alias.name}")
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    if not used:
        return set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):  # every chain, the inner ones (a.b of a.b.c) included
            chain = _chain(node)
            if chain and chain[0] in bound and bound[chain[0]].split(".")[0] == "deepspeed":
                used.add(".".join([bound[chain[0]]] + chain[1:]))
    # every prefix a script reaches through counts too: `deepspeed.runtime.utils.see_memory_usage` needs
    # `deepspeed.runtime.utils` to be an attribute of `deepspeed.runtime` (issue 43's count, 111 names)
    return used


def scan(root: Path) -> tuple[Counter, int]:
    """(name -> number of files using it, number of files importing deepspeed) under ``root``."""
    counts: Counter = Counter()
    files = 0
    for path in sorted(root.rglob("*.py")):
        names = names_in_source(path.read_text(errors="replace"))
        if names:
            files += 1
            counts.update(names)
    return counts, files


def resolves(name: str) -> bool:
    """Whether ``name`` (a dotted ``deepspeed.*`` path) imports or is an attribute of an importable module."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # a module that raises on import does not resolve
            return False
        try:
            for attribute in parts[cut:]:
                value = getattr(value, attribute)
        except AttributeError:
            return False
        return True
    return False


def read_list(path: Path = LIST) -> list[str]:
    return [line.split()[0] for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scan", type=Path, help="a DeepSpeedExamples checkout to rebuild the list from")
    parser.add_argument("--write", action="store_true", help="with --scan: overwrite benchmarks/deepspeed_names.txt")
    parser.add_argument("--quiet", action="store_true", help="print only the count line")
    args = parser.parse_args()
    if args.scan:
        counts, files = scan(args.scan)
        lines = [f"# deepspeed.* names used by the {files} Python files of DeepSpeedExamples that import deepspeed",
                 "# (benchmarks/deepspeed_names.py --scan); each line: NAME FILES_USING_IT"]
        lines += [f"{name} {count}" for name, count in sorted(counts.items())]
        text = "\n".join(lines) + "\n"
        if args.write:
            LIST.write_text(text)
        else:
            print(text, end="")
        return 0
    import dsrun.alias

    dsrun.alias.install()
    names = read_list()
    missing = [name for name in names if not resolves(name)]
    if not args.quiet:
        for name in missing:
            print("missing", name)
    print(f"resolved {len(names) - len(missing)} of {len(names)} deepspeed.* names "
          f"(DeepSpeed API {dsrun.alias.DEEPSPEED_API_VERSION} alias)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
