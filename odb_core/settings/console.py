"""ODB's console: at the start of training every adapter says that ODB is on, and how; and the loader warns once
when samples run alone over the budget.

    odb: on (HF Trainer), token budget 16384 (padded cost), world 2, mode global planning + join, accumulation 2
    odb: warning: 33 samples read so far exceed token_budget=512 on their own (the longest has 1733 tokens) ...

`announce` writes the first on rank 0 through the `odb` logger, which prints INFO lines on stderr by default (a
handler of its own that does not propagate, as transformers and DeepSpeed set up for their loggers), so it shows in
a plain script and in LLaMA-Factory's console alike; `logging.getLogger("odb").setLevel(logging.WARNING)` silences
it. `warn_oversize` goes through the same logger at WARNING, so the HF Trainer's, DeepSpeed's and LLaMA-Factory's
users see it in their console by default, whatever the root logger's set-up (`warnings.warn` would show it once
per code location and process: a second run in one process would stay silent), and it stays after the start line
is silenced. `describe_oversize` is its text, which `odb plan` prints too.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Protocol

from odb_core.settings.config import ODBConfig

LOGGER = logging.getLogger("odb")
if not LOGGER.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(_handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


class _Transport(Protocol):
    rank: int
    world_size: int


class _Layout(Protocol):
    n_nodes: int


class _Loader(Protocol):
    config: ODBConfig
    transport: _Transport
    layout: _Layout


class _Oversize(Protocol):
    """The samples that exceed a limit on their own (`odb_core.planning.planner.Oversize`)."""

    count: int
    cost: float
    longest: int
    patches: int


def describe_oversize(config: ODBConfig, oversize: _Oversize, counted: str) -> str:
    """What runs alone over which limit, and the fix; `counted` places the count ("read so far", "of 40")."""
    over_patches = config.max_patches is not None and oversize.patches > config.max_patches
    limits = [f"token_budget={config.token_budget}"] if oversize.cost > config.token_budget else []
    raises = [f"token_budget to at least {math.ceil(oversize.cost)}"] if limits else []
    facts = f"the longest has {oversize.longest} tokens"
    if over_patches:
        limits.append(f"max_patches={config.max_patches}")
        raises.append(f"max_patches to at least {oversize.patches}")
        facts += f", the most patches {oversize.patches}"
    one = oversize.count == 1
    return (f"{oversize.count} sample{'' if one else 's'} {counted} exceed{'s' if one else ''} {' or '.join(limits)} "
            f"on {'its' if one else 'their'} own ({facts}) and run{'s' if one else ''} alone, over the budget "
            "(oversize='alone'): the budget is the memory bound you set, so expect out-of-memory on an accelerator. "
            f"Raise {' and '.join(raises)}, truncate the samples to fit, or set oversize='error' to refuse them")


def warn_oversize(config: ODBConfig, oversize: _Oversize, rank: int, world_size: int) -> None:
    """Log `describe_oversize(...)` on this rank, once per loader (NOTE [ Samples over the budget ])."""
    where = f"rank {rank}: " if world_size > 1 else ""
    LOGGER.warning(f"odb: warning: {where}{describe_oversize(config, oversize, 'read so far')} (said once; "
                   "metrics.oversize_samples counts them all)")


def describe(config: ODBConfig, world_size: int, where: str, n_nodes: int = 1) -> str:
    """The console line for `config` on `world_size` ranks (on `n_nodes` nodes), run by `where` (the adapter)."""
    planning = ("single rank" if world_size == 1 else "rank-local planning" if config.planning == "local" else
                f"node-aware global planning ({n_nodes} nodes)" if n_nodes > 1 and config.planning == "global"
                else f"{config.planning} planning")
    ending = "join" if config.join else "quota (non-join)"
    target = config.step_target
    steps = (f"optimizer steps of ~{target[1]} {target[0]}" if target is not None
             else f"accumulation {config.accumulation_steps}")
    return (f"odb: on ({where}), token budget {config.token_budget} ({config.cost} cost), world {world_size}, "
            f"mode {planning} + {ending}, {steps}")


def announce(loader: _Loader, where: str) -> None:
    """Log `describe(...)` of `loader` once, on rank 0."""
    if loader.transport.rank == 0:
        LOGGER.info(describe(loader.config, loader.transport.world_size, where, loader.layout.n_nodes))
