"""The command lines follow CLI conventions: `--help` exits 0, an error exits non-zero with one clear line.

`--help` runs as a user runs it (`python -m` of the console scripts' modules, in a subprocess); the errors call the
same `main` in this process (the console scripts are `sys.exit(main())`). `odb-llamafactory`'s launcher imports
odb_core only before `train` starts, so all of this runs in the main environment.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
from odb_core import cli
from odb_llamafactory import launcher

ODB = [sys.executable, "-m", "odb_core.cli"]
ODB_LLAMAFACTORY = [sys.executable, "-m", "odb_llamafactory.launcher"]


def run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("command", [[*ODB, "--help"], [*ODB, "plan", "--help"], [*ODB_LLAMAFACTORY, "--help"]],
                         ids=["odb", "odb-plan", "odb-llamafactory"])
def test_help_prints_the_usage_and_exits_0(command):
    done = run(command)
    assert done.returncode == 0, done.stderr
    assert "usage: " in done.stdout and not done.stderr


def exit_status(main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse exits by itself
        return exc.code


@pytest.mark.parametrize(("main", "args", "cause"), [
    (cli.main, [], "the following arguments are required: command"),
    (cli.main, ["plan", "lengths.npy"], "required: --token-budget"),
    (cli.main, ["plan", "missing.npy", "--token-budget", "1024"], "No such file or directory: 'missing.npy'"),
    (cli.main, ["plan", "LENGTHS", "--token-budget", "0"], "ODBConfig.token_budget=0 is invalid"),
    (cli.main, ["plan", "LENGTHS", "--token-budget", "64", "--world-size", "0"], "--world-size 0 is invalid"),
    (cli.main, ["plan", "NEGATIVE", "--token-budget", "64"], "sample 1 has length -9; lengths must be >= 0"),
    (launcher.main, [], "unknown command '(none)'"),
    (launcher.main, ["trian", "cfg.yaml"], "unknown command 'trian'"),
    (launcher.main, ["train", "cfg.txt"], "expected a .yaml, .yml or .json config file"),
    (launcher.main, ["train", "missing.yaml"], "missing.yaml does not exist"),
], ids=["odb", "plan-args", "plan-file", "plan-budget", "plan-world", "plan-negative", "lf-none", "lf-typo", "lf-ext", "lf-file"])
def test_errors_exit_2_with_one_line_naming_the_cause(tmp_path, capsys, main, args, cause):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("5\n9\n12\n")
    negative = tmp_path / "negative.txt"
    negative.write_text("5\n-9\n12\n")
    files = {"LENGTHS": str(lengths), "NEGATIVE": str(negative)}
    status = exit_status(main, [files.get(a, a) for a in args])
    out, err = capsys.readouterr()
    assert status == 2 and not out
    assert len(err.strip().splitlines()) == 1 and cause in err, err
    assert err.startswith(("odb: error:", "odb plan: error:", "odb-llamafactory: error:"))


INSTALLED = Path(sys.executable).with_name("odb-llamafactory")  # the console script of this environment's install


@pytest.mark.skipif(importlib.util.find_spec("llamafactory") is not None, reason="LLaMA-Factory is installed here")
@pytest.mark.parametrize("command", [ODB_LLAMAFACTORY, [str(INSTALLED)]], ids=["module", "installed-script"])
def test_odb_llamafactory_without_llamafactory_names_the_extra_to_install(command, tmp_path):
    """`pip install "odb[hf]"` installs the odb-llamafactory command too; without LLaMA-Factory (and OmegaConf) in
    the environment, as here, `train` says in one line what to install (before: ModuleNotFoundError: omegaconf)."""
    if not Path(command[0]).exists():
        pytest.skip(f"{command[0]} is not installed")
    config = tmp_path / "cfg.yaml"
    config.write_text("odb: true\nodb_token_budget: 1024\n")
    done = run([*command, "train", str(config)])
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == ["odb-llamafactory: error: LLaMA-Factory is not installed in this environment "
                                        "(no module 'llamafactory' or 'omegaconf'): pip install \"odb[llamafactory]\""]
