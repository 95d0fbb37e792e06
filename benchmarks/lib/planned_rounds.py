"""The real planner's epoch, round by round, with a rule of round sizes swapped in (what-if), and its score in the
pipeline model (`python -m benchmarks.round_rules`, `python -m benchmarks.pool_rounds`; issue 27).

`plan_epoch` plans `samples` lognormal samples (mean 900, CV 1, budget 16,384) over W virtual ranks with
`simulate_epoch`, the candidate's rule swapped in for `odb_core.planning.planner.round_target` (for this process
only; restored after), and records each round's read boundary (the furthest any rank's stream was read when the
round planned) and device seconds (per step the largest rank's padded tokens x 1.5 us, summed). `score` runs the
pipeline of benchmarks/lib/round_model.py on them: samples/s over min(W x S, the device rate of whole-window
rounds), so a rule pays for its looser packing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

import odb_core.planning.planner as planner
import odb_core.planning.simulate as simulate
from benchmarks.data.feeding import SlowSamples
from benchmarks.lib.round_model import epoch_seconds_of
from odb_core.planning.budget import Item
from odb_core.planning.round_sizes import round_target
from odb_core.settings.config import ODBConfig

STEP_US_PER_TOKEN = 1.5
Rule = Callable[[ODBConfig, int, int, "int | None"], int]


def variant(share: int = 2, whole: str = "grown") -> Rule:
    """`round_target` with another share of the rest (1/`share`) and another rest planned whole (`whole`)."""

    def target(config: ODBConfig, round_index: int, buffered: int, left: int | None) -> int:
        smallest = config.min_window
        if smallest is None or smallest >= config.window:
            return config.window
        grown = min(config.window, smallest << min(round_index, 62))
        if left is None:
            return grown
        rest = buffered + left
        limit = (2 * grown if grown < config.window else 0) if whole == "grown" else 2 * smallest
        if rest <= limit:
            return min(config.window, rest + 1)
        return min(grown, max(smallest, -(-rest // share)))

    return target


@dataclass(frozen=True)
class Candidate:
    name: str
    rule: Rule
    min_window: int | None
    options: tuple[tuple[str, object], ...] = ()  # other `ODBConfig` fields of the candidate (e.g. round_growth)


FULL = Candidate("whole windows", round_target, None)


@contextlib.contextmanager
def swapped(rule: Rule, reads: list[int]) -> Iterator[None]:
    """`rule` as the planner's round target, and each fill's furthest read position appended to `reads`."""
    fill = simulate._fill

    def traced(engines, streams, cursors, *args, **kwargs):  # noqa: ANN001, ANN202 - simulate's own signature
        active = fill(engines, streams, cursors, *args, **kwargs)
        reads.append(max(cursors))
        return active

    planner.round_target, simulate._fill = rule, traced
    try:
        yield
    finally:
        planner.round_target, simulate._fill = round_target, fill


@dataclass(frozen=True)
class PlannedEpoch:
    reads: list[int]  # per round, the furthest position read on any rank when it planned
    device_seconds: list[float]  # per round
    steps: int


def plan_epoch(candidate: Candidate, samples: int, world: int, planning: str, window: int,
               **options: object) -> PlannedEpoch:
    """`samples` lognormal samples over `world` ranks planned under `candidate`'s rule (any other `ODBConfig`
    field in `options`; `pool_window` None unless given, so that `window` is each rank's)."""
    lengths = SlowSamples(samples, process_ms=0).lengths
    order = np.random.default_rng(1).permutation(samples)
    streams = [[Item(int(i), lengths[i], owner=rank) for i in order[rank::world]] for rank in range(world)]
    options = {"pool_window": None, **dict(candidate.options), **options}
    config = ODBConfig(token_budget=16384, window=window, min_window=candidate.min_window, planning=planning,
                       **options)  # type: ignore[arg-type]
    reads: list[int] = []
    with swapped(candidate.rule, reads):
        plan = simulate.simulate_epoch(streams, config)
    seconds, start = [], 0
    for steps in plan.targets:
        tokens = sum(max(slot.size * max(it.length for it in slot.items) if slot is not None else 0
                         for slot in (rank[k] for rank in plan.steps)) for k in range(start, start + steps))
        seconds.append(tokens * STEP_US_PER_TOKEN * 1e-6)
        start += steps
    return PlannedEpoch(reads, seconds, plan.n_steps)


def score(epoch: PlannedEpoch, samples: int, world: int, ratio: float, full_rate: float, window: int) -> float:
    supply = ratio * full_rate / world
    _, total = epoch_seconds_of(epoch.reads, epoch.device_seconds, supply, window)
    return samples / total / min(world * supply, full_rate)
