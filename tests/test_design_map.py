"""docs/design.md's module map lists every module of odb_core and the adapters, and nothing that is gone.

The map is the table under "## Packages and layers"; each of odb_core's packages must also appear in the layer
picture there (its `__init__` holds only the docstring saying what it owns, so the package, not the file, is
what the picture names). The import contracts that keep the picture true are checked by tests/test_layers.py.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("odb_core", "odb_hf", "odb_deepspeed", "odb_llamafactory")
MAPPED = re.compile(r"^\| `((?:odb_core|odb_hf|odb_deepspeed|odb_llamafactory)/[\w/]+\.py)` \|", re.M)


def _section() -> str:
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("## Packages and layers")
    return text[start : text.index("\n## ", start + 1)]


def _core_packages() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "odb_core").glob("*/__init__.py"))


def _modules() -> set[str]:
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            relative = path.relative_to(ROOT)
            if "env" in relative.parts or "__pycache__" in relative.parts:
                continue  # odb_llamafactory/env: the pinned environment's build files, not odb's code
            if relative.parts[0] == "odb_core" and len(relative.parts) == 3 and path.name == "__init__.py":
                continue  # a package of odb_core: named in the layer picture instead
            found.add(relative.as_posix())
    return found


def test_the_module_map_lists_every_module_and_no_other():
    mapped = set(MAPPED.findall(_section()))
    modules = _modules()
    assert not modules - mapped, f"modules missing from docs/design.md's module map: {sorted(modules - mapped)}"
    stale = sorted(mapped - modules)
    assert not stale, f"docs/design.md's module map names modules that do not exist: {stale}"


def test_the_layer_picture_names_every_package_of_odb_core():
    picture = _section().split("```")[1]
    named = set(re.findall(r"^(\w+)(?: \| (\w+))?", picture, re.M))
    names = {n for pair in named for n in pair if n}
    assert set(_core_packages()) <= names, f"packages missing from the layer picture: {set(_core_packages()) - names}"
    assert len(_core_packages()) >= 7, _core_packages()  # the map is not vacuous


def test_no_module_of_odb_core_is_over_350_lines():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / "odb_core").rglob("*.py")}
    too_long = {module: n for module, n in sizes.items() if n > 350}
    assert len(sizes) > 30 and not too_long, too_long
