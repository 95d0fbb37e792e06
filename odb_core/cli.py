"""`odb plan`: know the gain before you train.

Simulates a whole epoch on W virtual ranks with the loader's own planning and alignment code (no GPU, no
processes) and prints one labelled column per planning mode (at W > 1 global planning, the loader's default, and
rank-local side by side; `--planning global|local` prints one): steps, the estimated speed-up over standard fixed
batching under a linear step-time model, budget utilization, padding, step-cost imbalance across ranks, IDLE
micro-batches; then one line on the baseline (its fixed batch: budget // longest sample) and one on the time
model. `--verbose` adds the rounds, the fraction of samples that move between ranks, the metadata bytes and the
definitions; `--suggest`, other budgets, listed while an epoch keeps >= SUGGEST_MIN_STEPS optimizer steps.
Samples over the budget on their own get one warning line on stderr. `--json` prints every figure of every
report (the suggested budgets unfiltered), as `PlanReport` fields. `--nproc-per-node P` (ranks per node)
prints node-aware planning next to global and rank-local on nodes of P ranks, with the moved fractions within and
across nodes and, per rank per round, the planning metadata received and the plan's CPU seconds (`--json`:
`PlanReport` and `CostSummary` fields). The figures are computed in plan_report.py.

    odb plan lengths.npy --world-size 8 --token-budget 16384 [--cost padded] [--no-join] [--planning local]
    odb plan lengths.txt ...        # one length per line
    odb plan data.jsonl --field input_ids ...   # a list field (its length) or an int field per record
    odb plan lengths.npy --world-size 256 --nproc-per-node 8 ...   # node-aware, global, rank-local on 32 nodes

Step-time model: t(step) = a + b x (max over ranks of the step's padded tokens) + c x (max over ranks of
B x max_len^2). Defaults (a=0, b=1, c=0) compare padded tokens; calibrate a, b, c from two or three measured
step times of your model to include fixed overheads and attention.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn
from dataclasses import asdict, replace
from pathlib import Path

from odb_core.plan_report import (PlanReport, StepTimeModel, node_columns, oversize_of, plan_report, read_lengths,
                                  suggest_budgets)
from odb_core.planning.nodes import NodePlanning
from odb_core.planning.simulate import CostSummary
from odb_core.settings.config import COST_NAMES, ODBConfig
from odb_core.settings.console import describe_oversize

__all__ = ["PlanReport", "StepTimeModel", "main", "plan_report", "read_lengths", "suggest_budgets"]


SUGGEST_MIN_STEPS = 10  # `--suggest` lists a budget while an epoch keeps this many optimizer steps
GOOD_UTILIZATION = 0.9  # the suggested range: listed budgets at or above this utilization
Cell = Callable[[PlanReport], str]
ROWS: tuple[tuple[str, Cell], ...] = (
    ("steps per epoch", lambda r: str(r.steps)),
    ("speed-up over standard", lambda r: f"{r.estimated_speedup:.2f}x"),
    ("budget utilization", lambda r: f"{r.budget_utilization:.3f}"),
    ("padding ratio", lambda r: f"{r.padding_ratio:.3f}"),
    ("rank imbalance", lambda r: f"{r.mean_rank_imbalance:.3f}"),
    ("IDLE micro-batches", lambda r: f"{r.idle_steps} ({r.idle_fraction:.1%})"),
    ("samples not emitted", lambda r: str(r.not_emitted)),
)
VERBOSE_ROWS: tuple[tuple[str, Cell], ...] = (
    ("rounds", lambda r: str(r.rounds)),
    ("moved fraction", lambda r: f"{r.moved_fraction:.3f}"),
    ("metadata bytes per rank", lambda r: str(r.alignment_bytes_per_rank)),
)
NODE_ROWS: tuple[tuple[str, Callable[[CostSummary], str]], ...] = (
    ("moved within nodes", lambda c: f"{c.moved_within_fraction:.3f}"),
    ("moved across nodes", lambda c: f"{c.moved_across_fraction:.3f}"),
    ("metadata B/rank/round", lambda c: f"{c.metadata_bytes_per_round:.0f}"),
    ("plan s/rank/round", lambda c: f"{c.plan_seconds_per_round:.4f}"),
)
MULTI_RANK_ROWS = frozenset({"rank imbalance", "IDLE micro-batches", "moved fraction"})  # not printed at W = 1
DEFINITIONS = (
    "budget utilization: real tokens / (steps x ranks x token budget); padding ratio: pad tokens / padded tokens",
    "rank imbalance: the mean over steps of the coefficient of variation of the ranks' step costs",
    "IDLE micro-batches: zero-weight steps a rank runs while another still has data (every rank, every step)",
    "rounds: plan-and-align rounds of the epoch (a round plans up to --window samples per rank)",
    "moved fraction: the share of samples that run on another rank than the one that read them (global planning "
    "balances the ranks so; the samples themselves travel on top of the metadata)",
    "metadata bytes per rank: what one rank receives in the epoch's planning collectives (int64 counts and "
    "lengths)",
)


def _column(report: PlanReport) -> str:
    if report.world_size == 1:
        return "ODB"
    if report.planning == "node":
        return "ODB node-aware"
    return "ODB global" if report.planning == "global" else "ODB rank-local"


def _print_reports(reports: Sequence[PlanReport], longest: int, model: StepTimeModel, verbose: bool,
                   costs: Sequence[CostSummary] = ()) -> None:
    """One labelled column per report (global and rank-local side by side at W > 1), then what the figures mean."""
    first = reports[0]
    ranks = f"{first.world_size} rank{'s' if first.world_size > 1 else ''}"
    ending = "join" if first.join else "quota (non-join)"
    print(f"odb plan: {first.samples} samples on {ranks}, token budget {first.token_budget} ({first.cost} cost), "
          f"{ending}; the longest sample has {longest} tokens\n")
    rows = [(label, cell) for label, cell in ROWS + (VERBOSE_ROWS if verbose else ())
            if first.world_size > 1 or label not in MULTI_RANK_ROWS]
    width = max(len(label) for label, _ in rows) + 2
    print(" " * width + "".join(f"{_column(r):>16}" for r in reports))
    for label, cell in rows:
        print(f"{label:<{width}}" + "".join(f"{cell(r):>16}" for r in reports))
    for label, cost_cell in NODE_ROWS if costs else ():
        print(f"{label:<{width}}" + "".join(f"{cost_cell(c):>16}" for c in costs))
    print()
    if costs:
        print("ODB node-aware: each node plans its own ranks' samples and the nodes align their step counts")
    if first.world_size > 1 and len(reports) > 1 and not costs:
        print("ODB global: one plan over every rank's samples (the loader's default); rank-local: each rank its own")
    if first.standard_batch * longest > first.token_budget:
        why = f"the longest sample, {longest} tokens, is over the budget on its own"
    else:
        why = f"{first.token_budget} // {longest}: a fixed batch must fit the budget with the longest sample in it"
    samples = f"{first.standard_batch} sample{'s' if first.standard_batch > 1 else ''}"
    print(f"standard: fixed batches of {samples} per rank ({why}), {first.standard_steps} steps per epoch")
    print("speed-up: modelled epoch time of standard / ODB; step time = a + b x padded tokens + c x batch x longest^2 "
          "of the slowest")
    overhead = "a = 0: no fixed cost per step; " if model.a == 0 else ""
    print(f"rank, with a={model.a:g}, b={model.b:g}, c={model.c:g} ({overhead}measure yours and pass --time-model "
          "A B C)")
    if verbose:
        print("\n".join(DEFINITIONS))


def _print_suggestions(suggested: Sequence[PlanReport], config: ODBConfig, longest: int) -> None:
    """The `--suggest` table: budgets that keep at least SUGGEST_MIN_STEPS optimizer steps per epoch."""
    kept = [r for r in suggested if r.steps // config.accumulation_steps >= SUGGEST_MIN_STEPS]
    mode = "one rank" if suggested[0].world_size == 1 else f"{suggested[0].planning} planning"
    print(f"\nother budgets ({mode}): from {suggested[0].token_budget} (the longest sample, {longest}, rounded up "
          f"to a power of two), doubling to {suggested[-1].token_budget};")
    print(f"listed while an epoch keeps >= {SUGGEST_MIN_STEPS} optimizer steps (fewer, larger steps change training "
          "more than a speed-up shows)")
    if not kept:
        print(f"none of {', '.join(str(r.token_budget) for r in suggested)} does on these {suggested[0].samples} "
              "samples: keep the budget that fits your accelerator's memory")
        return
    print(f"{'token budget':>12}  {'steps':>5}  {'utilization':>11}  {'standard batch':>14}  {'speed-up':>8}")
    for r in kept:
        print(f"{r.token_budget:>12}  {r.steps:>5}  {r.budget_utilization:>11.3f}  {r.standard_batch:>14}  "
              f"{r.estimated_speedup:>7.2f}x")
    good = [r.token_budget for r in kept if r.budget_utilization >= GOOD_UTILIZATION]
    if good:
        print(f"suggested token_budget: {good[0]}..{good[-1]} (utilization >= {GOOD_UTILIZATION}); pick the largest "
              "that fits your accelerator's memory")
    else:
        print(f"no listed budget reaches utilization {GOOD_UTILIZATION}; pick the largest that fits your "
              "accelerator's memory")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (exit 2); `--help` prints the usage and exits 0."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="odb", description="Online Dynamic Batching tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="simulate an epoch and estimate the gain over fixed batching")
    p.add_argument("lengths", type=Path, help=".npy, .txt or .jsonl file of sample lengths")
    p.add_argument("--field", default="input_ids", help="jsonl field holding a token list or a length")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--token-budget", type=int, required=True)
    p.add_argument("--cost", choices=COST_NAMES, default="padded")
    p.add_argument("--attention-alpha", type=float, default=0.0)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--min-window", type=_int_or_none, default=ODBConfig.__dataclass_fields__["min_window"].default,
                   help="the first (and last) round's samples per rank (NOTE [ Round sizes ]); 'none': every round "
                        "a full window")
    p.add_argument("--round-growth", type=float, default=ODBConfig.__dataclass_fields__["round_growth"].default,
                   help="each growing round's size over the one before (NOTE [ Round sizes ]); 2 doubles them")
    p.add_argument("--pool-window", type=_int_or_none, default=ODBConfig.__dataclass_fields__["pool_window"].default,
                   help="the most samples one pooled plan holds (NOTE [ Pooled round sizes ]): past it each rank's "
                        "window and min window shrink; 'none': each rank keeps --window")
    p.add_argument("--no-join", action="store_true", help="quota closure instead of draining every rank")
    p.add_argument("--planning", choices=("both", "global", "local"), default="both",
                   help="global (the loader's default at W > 1), rank-local, or both side by side")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node: also node-aware planning, with moves and costs per rank per round")
    p.add_argument("--accumulation-steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-model", type=float, nargs=3, metavar=("A", "B", "C"), default=(0.0, 1.0, 0.0))
    p.add_argument("--suggest", action="store_true",
                   help=f"also compare budgets from the longest sample (a power of two) to 16x it (those that "
                        f"keep >= {SUGGEST_MIN_STEPS} optimizer steps)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text (every figure, every budget)")
    p.add_argument("--verbose", action="store_true", help="also rounds, moved fraction, metadata bytes, definitions")
    return parser


def plan(args: argparse.Namespace) -> int:
    """`odb plan`: read the lengths, simulate, print (raises OSError/ValueError/KeyError on bad input)."""
    lengths = read_lengths(args.lengths, args.field)
    if not lengths:
        raise ValueError(f"{args.lengths} holds no lengths")
    negative = next((index for index, length in enumerate(lengths) if length < 0), None)
    if negative is not None:  # zero is a valid (empty) sample here; a negative length is a broken file
        raise ValueError(f"{args.lengths}: sample {negative} has length {lengths[negative]}; lengths must be >= 0")
    if args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size} is invalid: it must be >= 1")
    plannings = ("global", "local") if args.planning == "both" and args.world_size > 1 else (
        ("global",) if args.planning == "both" else (args.planning,))
    configs = [ODBConfig(token_budget=args.token_budget, cost=args.cost, attention_alpha=args.attention_alpha,
                         window=args.window, min_window=args.min_window, round_growth=args.round_growth,
                         pool_window=args.pool_window,
                         join=not args.no_join,
                         accumulation_steps=args.accumulation_steps, planning=planning, seed=args.seed)
               for planning in plannings]
    model = StepTimeModel(*args.time_model)
    if args.nproc_per_node is not None:
        return plan_by_node(args, lengths, configs[0], model)
    reports = [plan_report(lengths, config, args.world_size, model) for config in configs]
    suggested = suggest_budgets(lengths, configs[0], args.world_size, model) if args.suggest else []
    oversize = oversize_of(lengths, configs[0])
    if oversize.count:  # stderr: the --json output stays as it was
        print(f"odb plan: warning: {describe_oversize(configs[0], oversize, f'of {len(lengths)}')}", file=sys.stderr)
    if args.json:
        print(json.dumps([asdict(r) for r in reports + suggested], indent=2))
        return 0
    _print_reports(reports, max(lengths), model, args.verbose)
    if suggested:
        _print_suggestions(suggested, configs[0], max(lengths))
    return 0


def plan_by_node(args: argparse.Namespace, lengths: list[int], config: ODBConfig, model: StepTimeModel) -> int:
    """`odb plan --nproc-per-node P`: node-aware next to global and rank-local (ValueError on a bad layout)."""
    if args.planning != "both" or args.suggest:
        raise ValueError("--nproc-per-node compares the three planning modes: drop --planning and --suggest")
    NodePlanning(args.nproc_per_node).layout(args.world_size)  # per node must divide the world size
    columns = node_columns(lengths, replace(config, planning="global"), args.world_size, model, args.nproc_per_node)
    if args.json:
        print(json.dumps([{**asdict(r), **asdict(c)} for r, c in columns], indent=2))
    else:
        _print_reports([r for r, _ in columns], max(lengths), model, args.verbose, [c for _, c in columns])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`odb plan ...`: 0 on success; a usage or input error is one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return plan(args)
    except (OSError, ValueError, KeyError) as exc:
        message = f"field {exc} is missing" if isinstance(exc, KeyError) else str(exc)
        print(f"odb plan: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
