"""The layers of odb_core and its adapters hold (contracts in pyproject.toml, [tool.importlinter]).

`lint-imports` checks them all: the package layers of odb_core, no torch in planning and settings, only
odb_core.ranks importing torch.distributed, adapters importing odb_core and not each other, and no import cycle
(type-only imports included). The custom contract for torch.distributed is also run on a package that breaks it,
so that a contract that cannot fail does not pass silently.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c",
        "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def _lint(cwd: Path, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LINT, "--config", str(config), "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_import_contracts_of_pyproject_are_kept():
    result = _lint(ROOT, ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and "Contracts: 6 kept, 0 broken." in result.stdout, result.stdout


def test_external_submodule_contract_names_an_import_outside_the_allowed_package(tmp_path):
    package = tmp_path / "layered"
    (package / "ranks").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "ranks" / "__init__.py").write_text("import torch.distributed as dist\n")
    (package / "planner.py").write_text("import torch\nfrom torch import distributed\n")
    (tmp_path / "contracts.py").write_text((ROOT / "tests" / "import_contracts.py").read_text())
    config = tmp_path / "contracts.toml"
    config.write_text(textwrap.dedent("""
        [tool.importlinter]
        root_packages = ["layered"]
        include_external_packages = true
        contract_types = ["external_submodule: contracts.ExternalSubmoduleContract"]

        [[tool.importlinter.contracts]]
        name = "only layered.ranks imports torch.distributed"
        type = "external_submodule"
        submodule = "torch.distributed"
        allowed_importers = ["layered.ranks"]
    """))
    result = _lint(tmp_path, config)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "layered.planner:2: from torch import distributed" in result.stdout, result.stdout
    assert "layered.ranks" not in result.stdout.split("may be imported only by")[1].split("\n", 1)[1], result.stdout
