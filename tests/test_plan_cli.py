"""`odb plan` runs the loader's own planning code: its figures match a real 2-rank Gloo run on the same data."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import LengthDataset, lognormal_lengths
from odb_core import ODBConfig, ODBDataLoader
from odb_core.cli import StepTimeModel, main, plan_report

BUDGET = 2048


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, lengths: list[int], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        loader = ODBDataLoader(LengthDataset(lengths), token_budget=BUDGET, shuffle=True, window=128)
        steps = sum(1 for _ in loader)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"steps": steps, **loader.metrics.summary()}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_plan_agrees_with_a_real_two_rank_gloo_run(tmp_path):
    lengths = lognormal_lengths(600, cv=1.0, mean=96, seed=11, hi=1024)
    mp.spawn(_rank_main, args=(_free_port(), lengths, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    report = plan_report(lengths, ODBConfig(token_budget=BUDGET, window=128), 2, StepTimeModel())
    assert ranks[0]["steps"] == ranks[1]["steps"] == report.steps
    assert ranks[0]["budget_utilization"] == pytest.approx(report.budget_utilization, abs=1e-12)
    assert ranks[0]["idle_steps"] == report.idle_steps


def test_plan_cli_reads_npy_txt_and_jsonl(tmp_path, capsys):
    lengths = lognormal_lengths(300, cv=0.5, mean=64, seed=1, hi=512)
    np.save(tmp_path / "l.npy", np.array(lengths))
    (tmp_path / "l.txt").write_text("\n".join(map(str, lengths)))
    (tmp_path / "l.jsonl").write_text("\n".join(json.dumps({"input_ids": [0] * n}) for n in lengths))
    outputs = []
    for name in ("l.npy", "l.txt", "l.jsonl"):
        assert main(["plan", str(tmp_path / name), "--world-size", "4", "--token-budget", "1024", "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0][0]["samples"] == 300 and outputs[0][0]["estimated_speedup"] > 1.0


def test_plan_takes_round_growth_and_plans_the_rounds_the_loader_would(tmp_path, capsys):
    """`odb plan --round-growth` is the loader's `round_growth`: at 1.25 the report counts the rounds that
    `plan_report` plans with that config, which are more than the doubling rounds of the default."""
    lengths = lognormal_lengths(3000, cv=1.0, mean=96, seed=2, hi=1024)
    np.save(tmp_path / "l.npy", np.array(lengths))
    reports = {}
    for growth in ("2", "1.25"):
        assert main(["plan", str(tmp_path / "l.npy"), "--world-size", "1", "--token-budget", "1024", "--window",
                     "2048", "--min-window", "64", "--round-growth", growth, "--json"]) == 0
        reports[growth] = json.loads(capsys.readouterr().out)[0]
    config = ODBConfig(token_budget=1024, window=2048, min_window=64, round_growth=1.25)
    assert reports["1.25"]["rounds"] == plan_report(lengths, config, 1, StepTimeModel()).rounds
    assert reports["1.25"]["rounds"] > reports["2"]["rounds"]


DATA = Path(__file__).resolve().parent / "data"
LENGTHS = DATA / "plan_lengths.txt"  # 400 fixed lengths, median 194, the longest 2000 (sample 17), 8 over 1024
OLD_JSON_KEYS = ["world_size", "token_budget", "cost", "join", "planning", "samples", "steps", "idle_steps",
                 "idle_fraction", "moved_fraction", "budget_utilization", "padding_ratio", "mean_rank_imbalance",
                 "alignment_bytes_per_rank", "rounds", "not_emitted", "standard_batch", "standard_steps",
                 "estimated_speedup"]


@pytest.mark.parametrize(("args", "golden"), [
    (["--world-size", "2", "--token-budget", "2048"], "plan_two_ranks.txt"),
    (["--world-size", "2", "--token-budget", "2048", "--verbose", "--suggest"], "plan_two_ranks_verbose_suggest.txt"),
    (["--token-budget", "1024", "--suggest"], "plan_one_rank_over_budget_suggest.txt"),
], ids=["two-ranks", "two-ranks-verbose-suggest", "one-rank-over-budget-suggest"])
def test_plan_prints_labelled_columns_the_baseline_and_only_budgets_that_keep_ten_steps(args, golden, capsys):
    """Golden text (tests/data/<golden>): the columns are named, the baseline's fixed batch and why is one line,
    moved fraction and metadata bytes only under --verbose, and --suggest lists 2048 and 4096 (31 and 15 steps at
    W = 2; 62, 30 and 16 at W = 1) but not the larger budgets, whose epochs have fewer than 10 steps."""
    assert main(["plan", str(LENGTHS), *args]) == 0
    assert capsys.readouterr().out == (DATA / golden).read_text()


def test_plan_warns_in_one_line_when_samples_exceed_the_budget_and_not_otherwise(capsys):
    assert main(["plan", str(LENGTHS), "--token-budget", "1024"]) == 0
    assert capsys.readouterr().err == (
        "odb plan: warning: 8 samples of 400 exceed token_budget=1024 on their own (the longest has 2000 tokens) and "
        "run alone, over the budget (oversize='alone'): the budget is the memory bound you set, so expect "
        "out-of-memory on an accelerator. Raise token_budget to at least 2000, truncate the samples to fit, or set "
        "oversize='error' to refuse them\n")
    assert main(["plan", str(LENGTHS), "--token-budget", "2000", "--world-size", "2", "--suggest"]) == 0
    assert capsys.readouterr().err == ""


def test_plan_json_keeps_its_keys_and_every_suggested_budget(capsys):
    """--json is the machine-readable output: the same keys as before, and all five suggested budgets (the text
    table's 10-step rule is not applied); the oversize warning goes to stderr, so stdout stays JSON."""
    assert main(["plan", str(LENGTHS), "--world-size", "2", "--token-budget", "1024", "--suggest", "--json"]) == 0
    captured = capsys.readouterr()
    reports = json.loads(captured.out)
    assert [list(r) for r in reports] == [OLD_JSON_KEYS] * 7
    assert [r["token_budget"] for r in reports] == [1024, 1024, 2048, 4096, 8192, 16384, 32768]
    assert [r["planning"] for r in reports[:2]] == ["global", "local"] and captured.err.startswith("odb plan: warning")


def test_the_readme_shows_what_odb_plan_prints():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "`odb plan tests/data/plan_lengths.txt --world-size 2 --token-budget 2048` prints" in readme
    assert "```\n" + (DATA / "plan_two_ranks.txt").read_text() + "```\n" in readme


def _seconds_masked(text: str) -> str:
    """The plan-seconds row is a CPU-time measurement: the golden file holds <seconds> in its place."""
    return re.sub(r"^(plan s/rank/round +).*$", r"\1<seconds>", text, flags=re.M)


def test_plan_by_node_prints_node_aware_next_to_global_and_rank_local(capsys):
    """Golden text (tests/data/plan_nodes.txt, the CPU seconds masked): 8 ranks on 2 nodes of 4; node-aware moves
    nothing across nodes and receives about half of global's metadata per round; the seconds are numbers."""
    assert main(["plan", str(LENGTHS), "--world-size", "8", "--nproc-per-node", "4", "--token-budget", "2048"]) == 0
    out = capsys.readouterr().out
    assert _seconds_masked(out) == (DATA / "plan_nodes.txt").read_text()
    seconds = re.search(r"^plan s/rank/round +(.*)$", out, flags=re.M).group(1).split()
    assert len(seconds) == 3 and all(float(s) >= 0 for s in seconds)


def test_plan_by_node_json_adds_the_cost_fields_and_refuses_a_layout_that_does_not_divide(capsys):
    assert main(["plan", str(LENGTHS), "--world-size", "6", "--nproc-per-node", "3", "--token-budget", "2048",
                 "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["planning"] for r in reports] == ["node", "global", "local"]
    assert [list(r) for r in reports] == [OLD_JSON_KEYS + ["moved_within_fraction", "moved_across_fraction",
                                                           "metadata_bytes_per_round", "plan_seconds_per_round"]] * 3
    assert reports[0]["moved_across_fraction"] == 0 and reports[1]["moved_across_fraction"] > 0
    assert reports[0]["metadata_bytes_per_round"] < reports[1]["metadata_bytes_per_round"]
    assert main(["plan", str(LENGTHS), "--world-size", "6", "--nproc-per-node", "4", "--token-budget", "2048"]) == 2
    assert "per_node=4 must be >= 1 and divide the world size 6" in capsys.readouterr().err
