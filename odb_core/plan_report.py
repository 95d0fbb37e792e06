"""The figures `odb plan` prints: a length file's epoch on the virtual cluster under each planning mode, against
standard fixed batching under a linear step-time model (`PlanReport`), and, on nodes of P ranks, the per-round
costs of node-aware, global and rank-local planning side by side (`node_columns`). Pure: no printing; cli.py
prints. `read_lengths` reads .npy, .txt and .jsonl length files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from odb_core.data.sharding import shard
from odb_core.planning.budget import Item, build_budget
from odb_core.planning.nodes import NodePlanning
from odb_core.planning.planner import Oversize
from odb_core.planning.simulate import CostSummary, EpochPlan, simulate_epoch, summarize_costs
from odb_core.settings.config import ODBConfig


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """t = a + b * padded_tokens + c * batch * max_len^2 per rank; a step lasts as long as its slowest rank."""

    a: float = 0.0
    b: float = 1.0
    c: float = 0.0

    def rank_time(self, size: int, longest: int) -> float:
        return self.b * size * longest + self.c * size * longest * longest if size else 0.0

    def step_time(self, per_rank: Sequence[tuple[int, int]]) -> float:
        return self.a + max(self.rank_time(size, longest) for size, longest in per_rank)


@dataclass(frozen=True, slots=True)
class PlanReport:
    world_size: int
    token_budget: int
    cost: str
    join: bool
    planning: str
    samples: int
    steps: int
    idle_steps: int
    idle_fraction: float
    moved_fraction: float
    budget_utilization: float
    padding_ratio: float
    mean_rank_imbalance: float
    alignment_bytes_per_rank: int
    rounds: int
    not_emitted: int
    standard_batch: int
    standard_steps: int
    estimated_speedup: float


def read_lengths(path: Path, field: str) -> list[int]:
    """Lengths from .npy, .txt (one int per line) or .jsonl (a list field's length, or an int field)."""
    if path.suffix == ".npy":
        return [int(x) for x in np.load(path).ravel()]
    if path.suffix == ".jsonl":
        out = []
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            value = json.loads(line)[field]
            if not isinstance(value, int | list):
                raise ValueError(f"{path}:{line_no}: field {field!r} must be an int or a list, got {type(value)}")
            out.append(value if isinstance(value, int) else len(value))
        return out
    return [int(tok) for tok in path.read_text().split()]


def standard_time(streams: list[list[Item]], batch: int, model: StepTimeModel) -> tuple[int, float]:
    """Steps and modelled time of Standard fixed batching (same shards, same order, batch per rank)."""
    steps = max(math.ceil(len(s) / batch) for s in streams)
    total = 0.0
    for k in range(steps):
        per_rank = []
        for s in streams:
            chunk = s[k * batch : (k + 1) * batch]
            per_rank.append((len(chunk), max((it.length for it in chunk), default=0)))
        total += model.step_time(per_rank)
    return steps, total


def odb_time(plan: EpochPlan, model: StepTimeModel) -> float:
    total = 0.0
    for k in range(plan.n_steps):
        per_rank = [(g.size, max(it.length for it in g.items)) if g else (1, 1) for g in
                    (plan.steps[r][k] for r in range(len(plan.steps)))]
        total += model.step_time(per_rank)
    return total


def plan_report(lengths: Sequence[int], config: ODBConfig, world: int, model: StepTimeModel,
                nodes: NodePlanning | None = None) -> PlanReport:
    return _report(lengths, config, model, simulate_run(lengths, config, world, nodes))


@dataclass(frozen=True, slots=True)
class Run:
    streams: list[list[Item]]
    plan: EpochPlan


def simulate_run(lengths: Sequence[int], config: ODBConfig, world: int, nodes: NodePlanning | None) -> Run:
    streams = shard(lengths, world, config.seed)
    return Run(streams, simulate_epoch(streams, config, nodes=nodes))  # its own bound (simulate_epoch's)


def _report(lengths: Sequence[int], config: ODBConfig, model: StepTimeModel, run: Run) -> PlanReport:
    streams, plan, world = run.streams, run.plan, len(run.streams)
    slots = [g for rank in plan.steps for g in rank]
    real = sum(g.tokens for g in slots if g)
    padded = sum(g.size * max(it.length for it in g.items) for g in slots if g)
    costs = [[(g.cost if g else 0.0) for g in rank] for rank in plan.steps]
    imbalance = [float(np.std(col) / np.mean(col)) if np.mean(col) > 0 else 0.0 for col in zip(*costs, strict=True)]
    longest = max(lengths)
    batch = max(config.token_budget // longest, 1)
    std_steps, std_time = standard_time(streams, batch, model)
    idle = sum(g is None for g in slots)
    return PlanReport(
        world_size=world, token_budget=config.token_budget, cost=config.cost, join=config.join,
        planning=plan.planning, samples=len(lengths), steps=plan.n_steps,
        idle_steps=idle, idle_fraction=idle / len(slots) if slots else 0.0,
        moved_fraction=plan.moved / plan.emitted if plan.emitted else 0.0,
        budget_utilization=real / (plan.n_steps * world * config.token_budget) if plan.n_steps else 0.0,
        padding_ratio=1 - real / padded if padded else 0.0,
        mean_rank_imbalance=float(np.mean(imbalance)) if imbalance else 0.0,
        alignment_bytes_per_rank=8 * (plan.gathered_ints + plan.reduced_ints) // world,
        rounds=plan.rounds, not_emitted=sum(len(x) for x in plan.not_emitted), standard_batch=batch,
        standard_steps=std_steps, estimated_speedup=std_time / odb_time(plan, model) if plan.n_steps else 0.0)


def node_columns(lengths: Sequence[int], config: ODBConfig, world: int, model: StepTimeModel,
                 per_node: int) -> list[tuple[PlanReport, CostSummary]]:
    """Node-aware, global and rank-local on nodes of `per_node` ranks: each report and its per-round costs."""
    modes = ((config, True), (config, False), (replace(config, planning="local"), False))
    runs = [(c, simulate_run(lengths, c, world, NodePlanning(per_node, aware))) for c, aware in modes]
    return [(_report(lengths, c, model, run), summarize_costs(run.plan)) for c, run in runs]


def suggest_budgets(lengths: Sequence[int], base: ODBConfig, world: int, model: StepTimeModel) -> list[PlanReport]:
    """Reports for budgets from the longest sample up to 16x it (powers of two); fits in memory is yours."""
    longest = max(lengths)
    budgets = sorted({max(longest, 1 << math.ceil(math.log2(longest))) * f for f in (1, 2, 4, 8, 16)})
    return [plan_report(lengths, ODBConfig(**{**_config_fields(base), "token_budget": b}), world, model)
            for b in budgets]


def _config_fields(config: ODBConfig) -> dict:
    return {name: getattr(config, name) for name in ODBConfig.__slots__}  # type: ignore[attr-defined]


def oversize_of(lengths: Sequence[int], config: ODBConfig) -> Oversize:
    """The samples over the budget on their own, as the loader counts them (`BufferEngine.admit`)."""
    budget, oversize = build_budget(config), Oversize()
    for item in (Item(0, length) for length in lengths):
        if not budget.alone_fits(item):
            oversize.add(item, budget.alone_cost(item))
    return oversize
