"""The layout of benchmarks/ holds: scripts share code through libraries, never by importing each other.

A runnable module is one with a top-level `if __name__ == "__main__":` (what `python -m benchmarks.<module>` or
torchrun runs). No module under benchmarks/ may import one, at the top or inside a function: what two scripts
share belongs in `benchmarks/lib/`, `benchmarks/data/` or `benchmarks/comparison/` (benchmarks/__init__.py). And
the parts of benchmarks/ (its subpackages and top-level modules) import each other without a cycle, so that, for
example, comparison/ and reference/ depend on each other in one direction only. Imports are read with `ast`,
without importing anything. The checks also run on a small package that breaks them, so that they cannot pass
silently.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules_of(package_dir: Path) -> dict[str, Path]:
    """Every module of the package at `package_dir` (dotted name -> file), the package inits included; hidden
    folders (benchmarks/.venv-ref, .cache) are not the package's."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if any(part.startswith(".") for part in parts):
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def is_runnable(tree: ast.Module) -> bool:
    """Whether the module has a top-level `if __name__ == "__main__":`."""
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
                and test.comparators[0].value == "__main__"):
            return True
    return False


def imported_modules(name: str, path: Path, tree: ast.Module, known: set[str]) -> set[str]:
    """The modules among `known` that module `name` imports anywhere in its body (a `from a import b` imports
    module `a.b` when there is one, else package `a`)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known and m != name}


def script_imports(package_dir: Path) -> list[str]:
    """`importer -> script` for every import of a runnable module by another module of the package."""
    modules = modules_of(package_dir)
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in modules.items()}
    scripts = {name for name, tree in trees.items() if is_runnable(tree)}
    return sorted(f"{name} -> {target}" for name, tree in trees.items()
                  for target in imported_modules(name, modules[name], tree, set(modules)) if target in scripts)


def part_cycles(package_dir: Path) -> list[list[str]]:
    """Cycles among the parts of the package (its subpackages and top-level modules; the package's own init,
    which every module may import for shared paths, is left out), as lists of part names."""
    root = package_dir.name
    modules = modules_of(package_dir)
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name == root:
            continue
        part = name.split(".")[1]
        targets = imported_modules(name, path, ast.parse(path.read_text()), set(modules) - {root})
        edges.setdefault(part, set()).update(t.split(".")[1] for t in targets if t.split(".")[1] != part)
    cycles, done = [], set()
    for start in sorted(edges):
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    cycles.append(trail)
                elif nxt not in trail and nxt not in done:
                    stack.append((nxt, [*trail, nxt]))
        done.add(start)
    return cycles


def test_no_benchmark_module_imports_a_runnable_script():
    assert script_imports(ROOT / "benchmarks") == []


def test_benchmark_parts_import_each_other_without_a_cycle():
    assert part_cycles(ROOT / "benchmarks") == []


def test_the_checks_name_a_script_import_and_a_cycle_in_a_package_that_has_them(tmp_path):
    package = tmp_path / "bench"
    for folder in (package / "lib", package / "peers"):
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    main = 'if __name__ == "__main__":\n    main()\n'
    (package / "demo.py").write_text("def main():\n    pass\n\n\n" + main)
    (package / "report.py").write_text("def figure():\n    from bench.demo import main\n")  # a lazy import
    (package / "lib" / "clock.py").write_text("from ..peers import run\n")
    (package / "peers" / "run.py").write_text(textwrap.dedent("""
        from bench.lib import clock
        import bench.report
    """))
    assert script_imports(package) == ["bench.report -> bench.demo"]
    assert part_cycles(package) == [["lib", "peers"]]
