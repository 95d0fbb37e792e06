"""ODB's console line: at the start of training every adapter says that ODB is on, and how.

    odb: on (HF Trainer), token budget 16384 (padded cost), world 2, mode global planning + join, accumulation 2

`announce` writes it on rank 0 through the `odb` logger, which prints INFO lines on stderr by default (a handler of
its own that does not propagate, as transformers and DeepSpeed set up for their loggers), so it shows in a plain
script and in LLaMA-Factory's console alike; `logging.getLogger("odb").setLevel(logging.WARNING)` silences it.
"""

from __future__ import annotations

import logging
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


class _Loader(Protocol):
    config: ODBConfig
    transport: _Transport


def describe(config: ODBConfig, world_size: int, where: str) -> str:
    """The console line for `config` on `world_size` ranks, run by `where` (the adapter)."""
    planning = ("single rank" if world_size == 1 else
                "global planning" if config.planning == "global" else "rank-local planning")
    ending = "join" if config.join else "quota (non-join)"
    target = config.step_target
    steps = (f"optimizer steps of ~{target[1]} {target[0]}" if target is not None
             else f"accumulation {config.accumulation_steps}")
    return (f"odb: on ({where}), token budget {config.token_budget} ({config.cost} cost), world {world_size}, "
            f"mode {planning} + {ending}, {steps}")


def announce(loader: _Loader, where: str) -> None:
    """Log `describe(...)` of `loader` once, on rank 0."""
    if loader.transport.rank == 0:
        LOGGER.info(describe(loader.config, loader.transport.world_size, where))
