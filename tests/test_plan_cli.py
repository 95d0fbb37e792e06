"""`odb plan` runs the loader's own planning code: its figures match a real 2-rank Gloo run on the same data."""

from __future__ import annotations

import json
import os
import socket

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
