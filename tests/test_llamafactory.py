"""LLaMA-Factory 0.9.5 SFT with `odb: true`, end to end, in its own environment (.venv-lf, built by `make venv-lf`).

Every run is a subprocess under .venv-lf's python on a tiny random Qwen2 with a BPE vocabulary trained on real
chitchat text, and alpaca/sharegpt datasets of real conversations (tests/lf_fixtures.py), using the example
configs in configs/llamafactory/ with `key=value` overrides, as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import lf_fixtures
from conftest import OVER_BUDGET
from test_properties import reference_windows

ROOT = Path(__file__).resolve().parents[1]
LF_BIN = ROOT / ".venv-lf" / "bin"
CONFIGS = ROOT / "configs" / "llamafactory"
LORA, FULL = CONFIGS / "qwen2_lora_sft_odb.yaml", CONFIGS / "qwen2_full_sft_odb.yaml"
BUDGET, G = 512, 2  # odb_token_budget override; gradient_accumulation_steps of the LoRA example

if not (LF_BIN / "python").exists():
    if os.environ.get("MAKELEVEL") or os.environ.get("CI"):
        raise RuntimeError(f"{LF_BIN / 'python'} is missing although make/CI runs the tests: `make test` builds "
                           "it through the venv-lf target")
    pytestmark = pytest.mark.skip(reason=".venv-lf is absent: build it with `make venv-lf` (make test does)")
else:
    pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lf")
    return {**lf_fixtures.build_all(root), "root": root}


def overrides(assets: dict[str, Path], out: str, keep: tuple[str, ...] = (), **extra) -> list[str]:
    """key=value overrides of an example config for this machine; `keep` names settings left as the config has them."""
    values = {"model_name_or_path": assets["model"], "dataset_dir": assets["data"], "output_dir": assets["root"] / out,
              "dataset": "chitchat_alpaca,chitchat_sharegpt", "cutoff_len": 256, "odb_token_budget": BUDGET,
              "max_samples": "null", "preprocessing_num_workers": "null", "dataloader_num_workers": 0,
              "bf16": "false", "logging_steps": 1, "save_steps": 1000, "plot_loss": "false", **extra}
    return [f"{key}={value}" for key, value in values.items() if key not in keep]


def run_lf(command: list[str], log: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("FORCE_TORCHRUN", "NPROC_PER_NODE", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   HF_HOME=str(log.parent / "hf-home"), **env)
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=environ, timeout=timeout,
                              cwd=ROOT)
    done.output = log.read_text()
    return done


def assert_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"{done.args[:4]} failed:\n{done.output[-6000:]}"


def trainer_state(folder: Path) -> dict:
    return json.loads((folder / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def lora_record(assets) -> dict:
    """One LoRA SFT run with ODB through odb_llamafactory's Python API, recorded by tests/lf_train.py."""
    record = assets["root"] / "lora-record"
    done = run_lf([str(LF_BIN / "python"), str(ROOT / "tests/lf_train.py"), str(LORA), str(record),
                   *overrides(assets, "lora-odb", max_samples=40, num_train_epochs=2, lora_rank=4)],
                  assets["root"] / "lora-odb.log", timeout=400)
    assert_ok(done)
    return json.loads((record / "rank0.json").read_text())


def test_lora_sft_with_odb_uses_every_sample_once_per_epoch_in_varying_batches_under_budget(lora_record):
    steps, size = lora_record["steps"], lora_record["dataset_size"]
    assert size == 80  # 40 alpaca + 40 sharegpt records after LLaMA-Factory's preprocessing
    for epoch in (0, 1):
        used = [i for s in steps if s["epoch"] == epoch for i in s["indices"]]
        assert sorted(used) == list(range(size)), f"epoch {epoch}: not every sample exactly once"
    real = [s for s in steps if not s["is_idle"]]
    assert all(s["padded_tokens"] <= BUDGET and s["cost"] <= BUDGET for s in real)  # tensors the collator built
    assert len({s["local_samples"] for s in real}) >= 3, "batch sizes should follow the observed lengths"
    assert len(steps) % G == 0 and lora_record["global_step"] == len(steps) // G


def test_lora_sft_with_odb_logs_the_token_weighted_loss_of_each_optimizer_step(lora_record):
    micro, losses = lora_record["micro"], lora_record["losses"]
    assert len(micro) == G * lora_record["global_step"] and len(losses) == lora_record["global_step"]
    naive_gap = 0.0
    for k, logged in enumerate(losses):
        window = micro[G * k:G * k + G]
        exact = sum(m["ce_sum"] for m in window) / sum(m["tokens"] for m in window)
        mean_of_means = sum(m["ce_sum"] / m["tokens"] for m in window) / G
        assert logged["loss"] == pytest.approx(exact, rel=1e-5), f"step {logged['step']}"
        naive_gap = max(naive_gap, abs(mean_of_means - exact))
    assert naive_gap > 1e-4, "the data should tell a token-weighted loss from a mean of micro-batch means"


def test_cli_trains_to_the_end_with_and_without_odb(assets):
    """`odb-llamafactory train`: LoRA with odb=false (plain LLaMA-Factory) and full fine-tuning with ODB on a
    streaming dataset, side by side. The full example config is used with streaming switched on as its comment
    says, keeping its own dataloader_num_workers (4: LLaMA-Factory streams the local file as 4 shards, which ODB's
    4 workers read once each) and its lack of max_samples. ODB says that it is on, in the console."""
    cli = str(LF_BIN / "odb-llamafactory")
    plain = [cli, "train", str(LORA), *overrides(assets, "plain", odb="false", max_steps=2, dataset="chitchat_alpaca")]
    full = [cli, "train", str(FULL), *overrides(assets, "full-stream", keep=("max_samples", "dataloader_num_workers"),
                                                dataset="chitchat_sharegpt", streaming="true", max_steps=3)]
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda c: run_lf(c[0], assets["root"] / f"{c[1]}.log", timeout=400),
                             [(plain, "plain"), (full, "full-stream")]))
    for done in runs:
        assert_ok(done)
    plain_state, full_state = trainer_state(assets["root"] / "plain"), trainer_state(assets["root"] / "full-stream")
    assert plain_state["global_step"] == 2 and full_state["global_step"] == 3
    assert not any(key.startswith("odb/") for entry in plain_state["log_history"] for key in entry)
    assert all("odb/budget_utilization" in entry for entry in full_state["log_history"] if "loss" in entry)
    assert f"odb: on (LLaMA-Factory), token budget {BUDGET}" in runs[1].output and "world 1" in runs[1].output
    assert "odb: on" not in runs[0].output
    assert OVER_BUDGET not in runs[1].output  # cutoff_len 256 <= odb_token_budget: every sample fits


def test_cli_warns_once_when_samples_run_alone_over_the_budget(assets):
    """odb_token_budget=64 below cutoff_len=256: one warning in the console naming the budget and the fix, from
    the loader (odb_llamafactory's own check of cutoff_len against the budget is gone, so it is not said twice)."""
    done = run_lf([str(LF_BIN / "odb-llamafactory"), "train", str(LORA),
                   *overrides(assets, "over-budget", dataset="chitchat_alpaca", max_samples=16, max_steps=2,
                              odb_token_budget=64, lora_rank=4)],
                  assets["root"] / "over-budget.log", timeout=400)
    assert_ok(done)
    warned = [line for line in done.output.splitlines() if OVER_BUDGET in line]
    assert len(warned) == 1, warned
    # the line as the console shows it: the warning may follow the Trainer's progress bar on its line (stderr both)
    shown = warned[0][warned[0].find("odb: warning: "):]
    assert shown.startswith("odb: warning: ") and "exceed token_budget=64 on their own" in shown, warned[0]
    assert "Raise token_budget to at least " in shown and "oversize='error'" in shown


def test_two_ranks_with_uneven_data_run_equal_steps_after_torchrun_relaunch(assets):
    """FORCE_TORCHRUN=1 NPROC_PER_NODE=2 odb-llamafactory train: 37 samples over 2 gloo ranks on CPU."""
    out = assets["root"] / "two-ranks"
    done = run_lf([str(LF_BIN / "odb-llamafactory"), "train", str(LORA),
                   *overrides(assets, "two-ranks", dataset="chitchat_alpaca", max_samples=37, num_train_epochs=1,
                              save_strategy="epoch", lora_rank=4)],
                  assets["root"] / "two-ranks.log", timeout=500, FORCE_TORCHRUN="1", NPROC_PER_NODE="2")
    assert_ok(done)
    checkpoint = next(out.glob("checkpoint-*"))
    # odb_hf saves each rank's loader state: both files exist only if ODB ran in both torchrun ranks
    states = [json.loads((checkpoint / f"odb_loader_rank{r}.json").read_text())["metrics"] for r in (0, 1)]
    assert states[0]["steps"] == states[1]["steps"] > 0  # equal micro-batch counts, IDLE included
    assert states[0]["local_samples"] + states[1]["local_samples"] == 37  # join: every sample once
    assert states[0]["local_samples"] != states[1]["local_samples"]  # the data really was uneven
    assert trainer_state(out)["global_step"] * G == states[0]["steps"]


def test_cli_names_an_unknown_odb_key_and_the_allowed_keys_before_training(assets, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text(LORA.read_text().replace("odb_join: true", "odb_joins: true"))
    done = run_lf([str(LF_BIN / "odb-llamafactory"), "train", str(config)], tmp_path / "typo.log", timeout=120)
    assert done.returncode == 2
    assert "unknown key 'odb_joins' (did you mean 'odb_join'?)" in done.output
    assert "odb_token_budget" in done.output and "Traceback" not in done.output


def test_cli_names_the_dataloader_workers_that_streaming_needs_before_training(assets, tmp_path):
    """The example config with streaming and 0 workers (an empty stream in LLaMA-Factory 0.9.5): one line, exit 2."""
    done = run_lf([str(LF_BIN / "odb-llamafactory"), "train", str(FULL), "streaming=true", "max_steps=3",
                   "dataloader_num_workers=0", f"dataset_dir={assets['data']}", "dataset=chitchat_alpaca"],
                  tmp_path / "stream0.log", timeout=120)
    assert done.returncode == 2 and done.output.strip().splitlines() == [
        "odb-llamafactory: error: streaming: true needs dataloader_num_workers: 1 or more for chitchat_alpaca: "
        "LLaMA-Factory 0.9.5 splits a local dataset file into dataloader_num_workers stream shards, so 0 gives an "
        "empty stream (it fails in align_dataset with StopIteration, with or without ODB)"]


def test_lora_sft_with_samples_per_step_logs_the_token_mean_of_each_step_and_plans_the_real_step_count(assets):
    """`odb_samples_per_step` with gradient_accumulation_steps=1 (the HF adapter runs each optimizer step's
    micro-batches as one StepWindow): the key reaches the loader, every logged loss is the exact token mean over
    its step's micro-batches (grouped by the recorded StepInfos), every sample is used once per epoch, and the
    exact schedule plans the real optimizer-step count."""
    record, target = assets["root"] / "target-record", 12
    done = run_lf([str(LF_BIN / "python"), str(ROOT / "tests/lf_train.py"), str(LORA), str(record),
                   *overrides(assets, "lora-target", max_samples=40, num_train_epochs=2, lora_rank=4,
                              gradient_accumulation_steps=1, odb_samples_per_step=target)],
                  assets["root"] / "lora-target.log", timeout=400)
    assert_ok(done)
    run = json.loads((record / "rank0.json").read_text())
    steps, micro, losses, size = run["steps"], run["micro"], run["losses"], run["dataset_size"]
    for epoch in (0, 1):
        used = [i for s in steps if s["epoch"] == epoch for i in s["indices"]]
        assert sorted(used) == list(range(size)), f"epoch {epoch}: not every sample exactly once"
    assert len(micro) == len(steps)  # one recorded forward per yielded micro-batch (W = 1: no IDLE)
    windows, start = [], 0
    for k, info in enumerate(steps):
        assert info["window_index"] == k - start and info["window_steps"] >= 1
        if info["window_index"] == info["window_steps"] - 1:
            windows.append(range(start, k + 1))
            start = k + 1
    assert start == len(steps)
    assert max(len(w) for w in windows) > 1, "the target should take several micro-batches per step"
    for epoch in (0, 1):  # the steps close where the rule says (NOTE [ Steps of a target size ]); W = 1
        sizes = [s["global_samples"] for s in steps if s["epoch"] == epoch]
        assert [len(w) for w in windows if steps[w[0]]["epoch"] == epoch] == reference_windows(sizes, target)
    assert run["global_step"] == len(windows) == len(losses)
    assert trainer_state(assets["root"] / "lora-target")["global_step"] == len(windows)
    assert trainer_state(assets["root"] / "lora-target")["max_steps"] == len(windows)  # the exact schedule
    for window, logged in zip(windows, losses):
        assert sum(micro[k]["tokens"] for k in window) == steps[window[0]]["window_tokens"]
        exact = sum(micro[k]["ce_sum"] for k in window) / sum(micro[k]["tokens"] for k in window)
        assert logged["loss"] == pytest.approx(exact, rel=1e-5), f"step {logged['step']}"
