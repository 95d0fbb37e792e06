"""Installing odb into an existing environment (README, "Use it in your own environment"), without the Makefile.

The extras' version ranges in pyproject.toml span what the tests run with: every requirement of `odb[hf]`,
`odb[trl]` and `odb[deepspeed]` is met by this (main) environment, and `odb[llamafactory]`'s by LLaMA-Factory's
pinned set. A wheel built from the checkout, installed into an empty folder with `pip install --no-deps`, has the
extras and both commands, and its `odb --help` runs from that folder.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
LF_PINS = ROOT / "odb_llamafactory" / "env" / "requirements.txt"
PACKAGES = ("odb_core", "odb_hf", "odb_deepspeed", "odb_llamafactory")


def requirements(extra: str) -> list[Requirement]:
    """The requirements of `odb[extra]`, with `odb[other]` references expanded."""
    out = []
    for text in EXTRAS[extra]:
        requirement = Requirement(text)
        if requirement.name == PROJECT["name"]:
            out += [r for other in requirement.extras for r in requirements(other)]
        else:
            out.append(requirement)
    return out


def pinned(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_the_readme_installs_every_extra_and_only_extras_that_exist():
    section = (ROOT / "README.md").read_text().split("## Use it in your own environment")[1].split("\n## ")[0]
    named = set(re.findall(r'pip install "\./odb\[(\w+)\]"', section))
    assert named == set(EXTRAS) - {"dev"}, named


@pytest.mark.parametrize("extra", ["hf", "trl", "deepspeed"])
def test_the_main_environment_meets_the_extras_ranges(extra):
    for requirement in requirements(extra):
        version = importlib.metadata.version(requirement.name)
        assert requirement.specifier.contains(version), f"odb[{extra}]: {requirement} but {version} is tested"


def test_the_llamafactory_environment_meets_its_extras_ranges():
    pins = {**pinned(LF_PINS), "llamafactory": "0.9.5"}  # installed --no-deps by the Makefile, pinned there
    for requirement in requirements("llamafactory"):
        version = pins[requirement.name.lower()]
        assert requirement.specifier.contains(version), f"odb[llamafactory]: {requirement} but {version} is tested"


def test_a_wheel_installed_without_the_makefile_has_the_extras_and_the_commands(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info next to pyproject.toml
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("odb-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {f"Provides-Extra: {extra}" for extra in ("hf", "trl", "deepspeed", "llamafactory")} <= set(
        metadata.splitlines())
    assert "odb = odb_core.cli:main" in entry_points and "odb-llamafactory = odb_llamafactory.launcher:main" in entry_points
    assert {name.split("/")[0] for name in names if name.endswith(".py")} == set(PACKAGES)
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target)}  # the installed copy, not the checkout
    where = subprocess.run([sys.executable, "-c", "import odb_core, odb_hf; print(odb_core.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0 and where.stdout.startswith(str(target)), where.stderr[-3000:]
    helped = subprocess.run([str(target / "bin" / "odb"), "--help"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "usage: odb" in helped.stdout, helped.stderr[-3000:]
