"""`odb-llamafactory train cfg.yaml [key=value ...]`: LLaMA-Factory SFT with ODB, in one or several processes.

The config is read as `llamafactory-cli train` reads it (YAML or JSON, then OmegaConf `key=value` overrides).
The `odb*` keys are removed and validated (odb_llamafactory.settings); everything else goes to LLaMA-Factory
unchanged. Without `odb: true` the run is plain LLaMA-Factory. Without LLaMA-Factory installed (`pip install
"odb[hf]"` installs this command too), `train` says in one line to install `odb[llamafactory]` (exit 2).

NOTE [ ODB in every torchrun rank ]
`llamafactory-cli train` re-launches multi-process runs as `torchrun .../llamafactory/launcher.py cfg.yaml`,
whose ranks run LLaMA-Factory's own entry: anything set up in the parent process is lost. This launcher runs
torchrun itself (same conditions and environment variables as LLaMA-Factory: FORCE_TORCHRUN=1, or more than one
accelerator, or NPROC_PER_NODE > 1; NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, RDZV_ID, ...) with *this
module* as the target and the same arguments. Each rank re-reads the config, re-validates the odb keys and
builds its own ODB trainer; a process started by a launcher (LOCAL_RANK set) never re-launches. Nothing of ODB's
travels through environment variables and nothing is patched in the parent; the ranks get the two variables
LLaMA-Factory's launcher sets for them under OPTIM_TORCH (`ranks_env`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from odb_core.settings.settings import ODBSettings
from odb_llamafactory.settings import ODBConfigError, check_compatible, env_enabled, pop_odb_settings

USAGE = "usage: odb-llamafactory train CONFIG.yaml|CONFIG.json [key=value ...]"
EXTRA = 'pip install "odb[llamafactory]"'  # what installs LLaMA-Factory beside odb
HELP = f"""{USAGE}

LLaMA-Factory SFT with Online Dynamic Batching: `llamafactory-cli train` plus the odb keys of the config
(odb: true, odb_token_budget: ..., odb_<field>: ...); see docs/guides/llamafactory.md. Multi-process runs use
LLaMA-Factory's variables (FORCE_TORCHRUN=1, NPROC_PER_NODE=N, NNODES, MASTER_ADDR, ...). Needs LLaMA-Factory:
{EXTRA}."""


class UsageError(ValueError):
    """A command line or config file odb-llamafactory cannot read; `main` prints it as one line (exit 2)."""


class MissingFrameworkError(ImportError):
    """LLaMA-Factory, or OmegaConf (its config reader), is not installed here; the message names the extra that
    installs them. `main` prints it as one line (exit 2) instead of a traceback."""


def require_llamafactory() -> None:
    """Raise `MissingFrameworkError` unless LLaMA-Factory and OmegaConf can be imported. `pip install "odb[hf]"`
    installs the `odb-llamafactory` command too (every console script comes with the package), without them."""
    missing = [name for name in ("llamafactory", "omegaconf") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingFrameworkError(f"LLaMA-Factory is not installed in this environment (no module "
                                    f"{' or '.join(repr(name) for name in missing)}): {EXTRA}")


def read_config(argv: Sequence[str]) -> dict[str, Any]:
    """`argv` = [config file, key=value overrides...] as a dict (llamafactory.hparams.parser.read_args' rules)."""
    if not argv or not argv[0].endswith((".yaml", ".yml", ".json")):
        raise UsageError(f"expected a .yaml, .yml or .json config file, got {list(argv)} ({USAGE})")
    path = Path(argv[0]).absolute()
    if not path.is_file():
        raise UsageError(f"{path} does not exist")
    require_llamafactory()
    from omegaconf import OmegaConf  # LLaMA-Factory's config reader (installed with it)

    loaded = OmegaConf.load(path) if path.suffix != ".json" else OmegaConf.create(json.loads(path.read_text()))
    return OmegaConf.to_container(OmegaConf.merge(loaded, OmegaConf.from_cli(list(argv[1:]))))


def accelerator_count() -> int:
    """Accelerators on this node (torch's public accelerator API: CUDA, XPU, MPS, ...); 0 on a CPU machine."""
    import torch

    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # llamafactory.extras.misc.find_available_port
        sock.bind(("", 0))
        return sock.getsockname()[1]


def wants_torchrun(env: Mapping[str, str], device_count: Callable[[], int]) -> bool:
    """Whether `llamafactory-cli train` would re-launch under torchrun (or NPROC_PER_NODE asks for ranks)."""
    if "LOCAL_RANK" in env:  # already one rank of a launched job
        return False
    return (env_enabled(env, "FORCE_TORCHRUN") or env_enabled(env, "USE_MCA") or int(env.get("NPROC_PER_NODE", "1")) > 1
            or device_count() > 1)


def ranks_env(env: Mapping[str, str]) -> dict[str, str]:
    """The ranks' environment, as LLaMA-Factory's launcher makes it: with OPTIM_TORCH on (its default), the CUDA
    allocator's expandable segments and NCCL's record-stream avoidance (before, the ranks ran without them, whose
    fragmenting allocator hurts most where batch shapes vary, as ODB's do)."""
    ranks = dict(env)
    if env_enabled(env, "OPTIM_TORCH", default="1"):
        ranks.update(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", TORCH_NCCL_AVOID_RECORD_STREAMS="1")
    return ranks


def torchrun_command(argv: Sequence[str], env: Mapping[str, str], device_count: Callable[[], int],
                     port: int) -> list[str]:
    """torchrun with this module as every rank's target, from LLaMA-Factory's launcher variables."""
    nnodes = env.get("NNODES", "1")
    nproc = env["NPROC_PER_NODE"] if "NPROC_PER_NODE" in env else str(max(device_count(), 1))
    master = f"{env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', str(port))}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc]
    if env.get("RDZV_ID") is not None:  # elastic launch, as LLaMA-Factory does it
        if env.get("MIN_NNODES") is not None and env.get("MAX_NNODES") is not None:
            nnodes = f"{env['MIN_NNODES']}:{env['MAX_NNODES']}"
        command += ["--nnodes", nnodes, "--rdzv-id", env["RDZV_ID"], "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", master, "--max-restarts", env.get("MAX_RESTARTS", "0")]
    else:
        address, master_port = master.rsplit(":", 1)
        command += ["--nnodes", nnodes, "--node-rank", env.get("NODE_RANK", "0"), "--master-addr", address,
                    "--master-port", master_port]
    return command + ["-m", "odb_llamafactory.launcher", "train", *argv]


def prepare(config: Mapping[str, Any]) -> tuple[dict[str, Any], ODBSettings | None]:
    """LLaMA-Factory's argument dict without the odb keys, and the validated odb settings (None: no odb keys)."""
    config = dict(config)
    settings = pop_odb_settings(config)
    if settings is not None and settings.enabled:
        check_compatible(config, settings)
        if config.get("disable_shuffling"):  # CustomSeq2SeqTrainer's sampler switch, in the Trainer's own terms
            config["train_sampling_strategy"] = "sequential"
    return config, settings


def train(config: Mapping[str, Any], *, callbacks: Sequence[Any] = (),
          observer: Callable[[Any], None] | None = None) -> None:
    """Run LLaMA-Factory training in this process; with `odb: true` in `config`, SFT with ODB.

    `config` is LLaMA-Factory's argument dict including the odb keys (not modified). `callbacks` are extra
    `TrainerCallback`s; `observer` receives every `StepInfo` the ODB loader yields (Python API only).
    """
    config, settings = prepare(config)
    require_llamafactory()
    from odb_llamafactory.workflow import run  # imports LLaMA-Factory (heavy): only when training

    run(config, settings, callbacks, observer)


def main(argv: Sequence[str] | None = None) -> int:
    """`odb-llamafactory train ...`; `--help` exits 0; a usage or config error, or LLaMA-Factory missing from this
    environment, is one line on stderr (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(HELP)
        return 0
    try:
        if argv[:1] != ["train"]:
            raise UsageError(f"unknown command {argv[0] if argv else '(none)'!r}; {USAGE}")
        clean, settings = prepare(read_config(argv[1:]))  # fail fast, before any process starts or LF loads
    except (UsageError, ODBConfigError, MissingFrameworkError) as exc:
        print(f"odb-llamafactory: error: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if wants_torchrun(env, accelerator_count):  # the parent only launches: it never imports LLaMA-Factory
        command = torchrun_command(argv[1:], env, accelerator_count, free_port())
        return subprocess.run(command, env=ranks_env(env)).returncode
    from odb_llamafactory.workflow import run

    run(clean, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
