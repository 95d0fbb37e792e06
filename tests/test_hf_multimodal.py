"""The HF Trainer on a VLM (tiny Qwen2-VL) on 2 CPU gloo ranks, ODB against Standard on the MM-Mix-like workload
(benchmarks/workers/mm_train_worker.py under torchrun): equal optimizer steps, loss going down, vision tower on every
step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.data import mm_mix

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


# a schedule replayed as is (how mm_bench trains on the reference release's batches); rank 0 has one batch more
FIXED_BATCHES = [[[0, 1], [2], [3, 4, 5]], [[6], [7, 8]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vlm_train")
    mm_mix.build_processor(out / "processor")
    (out / "fixed.json").write_text(json.dumps(FIXED_BATCHES))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "benchmarks.workers.mm_train_worker", "--processor", str(out / "processor"),
               "--out", str(out), "--mode", "odb", "--mode", "std", "--replay", f"fixed={out / 'fixed.json'}",
               "--n-train", "48", "--epochs", "2"]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


def facts(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / f"{mode}.rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("mode", ["odb", "std"])
def test_both_ranks_run_equal_steps_and_the_loss_goes_down(runs, mode):
    ranks = facts(runs, mode)
    assert ranks[0]["steps"] == ranks[1]["steps"] > 0
    losses = ranks[0]["losses"]
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses


def test_odb_covers_every_sample_once_per_epoch_under_the_patch_cap(runs):
    ranks = facts(runs, "odb")
    emitted = sorted(i for r in ranks for info in r["infos"] for i in info["indices"])
    assert emitted == sorted(list(range(48)) * 2)
    assert all(info["patches"] <= 8192 or len(info["indices"]) == 1 for r in ranks for info in r["infos"])
    assert len(ranks[0]["infos"]) == len(ranks[1]["infos"])


def test_the_vision_tower_runs_on_every_micro_batch_of_every_rank(runs):
    for r in facts(runs, "odb"):
        evaluation = math.ceil(24 / 2 / 8)  # held-out batches per rank: 24 samples, 2 ranks, 8 per device
        assert r["vision_calls"] == len(r["infos"]) + evaluation


def test_a_replayed_schedule_trains_exactly_its_batches_cut_to_the_shortest_rank(runs):
    ranks = facts(runs, "fixed")
    assert [r["steps"] for r in ranks] == [4, 4]  # 2 batches per rank per epoch; rank 0's third batch is cut
    assert ranks[0]["left_out"] == 48 - 6
    evaluation = math.ceil(24 / 2 / 8)
    assert all(r["vision_calls"] == 4 + evaluation for r in ranks)


@pytest.mark.timeout(600)
def test_the_trainer_with_worker_regions_trains_what_it_trains_with_files(tmp_path):
    """The HF Trainer, 2 gloo ranks, 2 DataLoader workers each processing the images: with `worker_regions` (NOTE [
    A worker's region ]) the losses, ODB's step infos and the eval loss are those of files, bit for bit."""
    mm_mix.build_processor(tmp_path / "processor")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    facts_of = {}
    for name, flags in (("files", ["--no-worker-regions"]), ("regions", ["--worker-regions"])):
        out = tmp_path / name
        out.mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "benchmarks.workers.mm_train_worker", "--processor", str(tmp_path / "processor"),
                   "--out", str(out), "--mode", "odb", "--n-train", "96", "--epochs", "2", "--workers", "2", *flags]
        result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=420)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        facts_of[name] = facts(out, "odb")
    for files, regions in zip(facts_of["files"], facts_of["regions"], strict=True):
        assert regions["losses"] == files["losses"] and len(files["losses"]) >= 10
        assert regions["infos"] == files["infos"] and regions["eval_loss"] == files["eval_loss"]
        assert regions["region_tensors"] > 0 and files["region_tensors"] == 0  # the images did take the regions
