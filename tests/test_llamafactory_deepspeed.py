"""LLaMA-Factory 0.9.5 SFT with `odb: true` + DeepSpeed ZeRO-2 + a Qwen2-VL on 2 ranks: the paper's stack, in .venv-lf.

The run is the guide's example, configs/llamafactory/qwen2vl_full_ds_z2_odb.yaml with its DeepSpeed config
configs/deepspeed/zero2_auto.json (both shown verbatim in docs/guides/llamafactory.md, which the first test holds
to the files), with `key=value` overrides for this machine only: a tiny random Qwen2-VL and a sharegpt dataset of
21 real conversations, 16 of them over 19 generated images (tests/lf_mm_fixtures.py), token budget 1024, 2 epochs,
gloo on CPU (`use_cpu=true`). Both ranks run tests/lf_mm_fixtures.py under torchrun, which records every StepInfo
and every training forward (what the DeepSpeed engine's module received) per rank; DeepSpeed's CPU shm comm op is
not compiled (NOTE [ DeepSpeed's shm op in the tests ] in tests/lf_mm_fixtures.py). About 30 s on 2 CPU cores.
"""

from __future__ import annotations

import json

import pytest

import lf_mm_fixtures
from test_llamafactory import CONFIGS, LF_BIN, ROOT, assert_ok, run_lf, trainer_state

CONFIG = CONFIGS / "qwen2vl_full_ds_z2_odb.yaml"
DS_CONFIG = ROOT / "configs" / "deepspeed" / "zero2_auto.json"
GUIDE = ROOT / "docs" / "guides" / "llamafactory.md"
BUDGET, G, RANKS, N_SAMPLES, EPOCHS = 1024, 2, 2, 21, 2  # G: the example's gradient_accumulation_steps

# under make/CI a missing .venv-lf is an error (raised when test_llamafactory is imported), never a skip
requires_lf = pytest.mark.skipif(not (LF_BIN / "python").exists(),
                                 reason=".venv-lf is absent: build it with `make venv-lf` (make test does)")


def test_the_guide_shows_the_deepspeed_example_configs_this_test_runs_verbatim():
    import yaml

    guide = GUIDE.read_text()
    assert f"```yaml\n{CONFIG.read_text()}```" in guide, f"the guide's ZeRO-2 YAML differs from {CONFIG}"
    assert f"```json\n{DS_CONFIG.read_text()}```" in guide, f"the guide's DeepSpeed JSON differs from {DS_CONFIG}"
    config, ds = yaml.safe_load(CONFIG.read_text()), json.loads(DS_CONFIG.read_text())
    assert (ROOT / config["deepspeed"]).resolve() == DS_CONFIG and config["odb"] is True
    assert ds["zero_optimization"]["stage"] == 2
    assert "odb" not in ds and "optimizer" not in ds  # odb_* keys live in the YAML; the Trainer's AdamW is used
    assert all(ds[key] == "auto" for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory) -> dict:
    """The example config on 2 torchrun ranks (gloo), each recorded by tests/lf_mm_fixtures.py."""
    root = tmp_path_factory.mktemp("lf-ds")
    assets = lf_mm_fixtures.build_all(root, n=N_SAMPLES)
    values = {"model_name_or_path": assets["model"], "dataset_dir": assets["data"], "dataset": "mm_chitchat",
              "output_dir": root / "out", "cutoff_len": BUDGET, "odb_token_budget": BUDGET, "max_samples": "null",
              "preprocessing_num_workers": "null", "dataloader_num_workers": 0, "bf16": "false",
              "num_train_epochs": EPOCHS, "logging_steps": 1, "save_steps": 1000, "plot_loss": "false",
              "use_cpu": "true"}  # no GPU: accelerate then sets up gloo for every rank and still runs DeepSpeed
    command = [str(LF_BIN / "python"), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               str(ROOT / "tests/lf_mm_fixtures.py"), str(CONFIG), str(root / "record"),
               *(f"{key}={value}" for key, value in values.items())]
    done = run_lf(command, root / "ds.log", timeout=400, TORCH_EXTENSIONS_DIR=str(root / "torch_extensions"))
    assert_ok(done)
    ranks = [json.loads((root / "record" / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return {"ranks": ranks, "n_images": assets["n_images"], "output": done.output,
            "log_history": trainer_state(root / "out")["log_history"]}


@requires_lf
@pytest.mark.slow
def test_llamafactory_trains_the_vlm_with_odb_under_deepspeed_zero2_on_two_ranks(ds_run):
    for rank in ds_run["ranks"]:
        assert rank["engine"] == {"optimizer": "DeepSpeedZeroOptimizer", "partition_gradients": True,
                                  "world_size": RANKS}, rank["engine"]  # partitioned gradients: ZeRO-2
    assert f"odb: on (LLaMA-Factory), token budget {BUDGET}" in ds_run["output"]
    assert f"world {RANKS}" in ds_run["output"] and f"accumulation {G}" in ds_run["output"]
    logged = [entry for entry in ds_run["log_history"] if "loss" in entry]
    assert logged and all(entry["odb/samples_per_second"] > 0 and "odb/budget_utilization" in entry
                          for entry in logged)


@requires_lf
@pytest.mark.slow
def test_every_sample_and_image_is_used_once_per_epoch_over_both_ranks_in_equal_step_counts(ds_run):
    ranks = ds_run["ranks"]
    assert all(rank["dataset_size"] == N_SAMPLES for rank in ranks)
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]), "ZeRO-2 needs the same micro-batch count on each rank"
    for rank in ranks:
        assert len(rank["micro"]) == len(rank["steps"]) == G * rank["global_step"]
        assert all(m["rows_match"] for m in rank["micro"]), "a forward's rows were not the samples ODB grouped"
    for epoch in range(EPOCHS):
        used = [i for rank in ranks for s in rank["steps"] if s["epoch"] == epoch for i in s["indices"]]
        assert sorted(used) == list(range(N_SAMPLES)), f"epoch {epoch}: not every sample exactly once"
        images = sum(m["images"] - bool(m["text_only"])  # less the collator's fake images
                     for rank in ranks for m, s in zip(rank["micro"], rank["steps"])
                     if s["epoch"] == epoch and not s["is_idle"])
        assert images == ds_run["n_images"], f"epoch {epoch}: not every image through the vision tower once"
    assert len({s["local_samples"] for rank in ranks for s in rank["steps"]}) >= 3, "batch sizes should vary"


@requires_lf
@pytest.mark.slow
def test_every_micro_batch_holds_the_token_budget_and_the_patch_cap_it_implies(ds_run):
    """The budget counts text and visual tokens (the template expanded each image before ODB saw it). The vision
    tower's patches are merge^2 = 4 per visual token, so the budget caps them at 4 x 1024 per micro-batch: under
    LLaMA-Factory that is the patch cap (`odb_max_patches` is refused there, tests/test_llamafactory_mm.py)."""
    for rank in ds_run["ranks"]:
        for info, m in zip(rank["steps"], rank["micro"]):
            assert info["padded_tokens"] <= BUDGET and info["cost"] <= BUDGET, info
            assert m["input_slots"] <= BUDGET, m  # the padded input_ids the engine's module received
            assert info["is_idle"] or m["input_slots"] <= info["cost"], (info, m)  # fake images counted too
            assert m["pixel_rows"] == m["grid_patches"] == m["merge"] ** 2 * m["image_tokens"], m
            assert m["grid_patches"] <= m["merge"] ** 2 * BUDGET, m
    assert max(m["input_slots"] for rank in ds_run["ranks"] for m in rank["micro"]) > BUDGET // 2  # budget binds


@requires_lf
@pytest.mark.slow
def test_the_logged_loss_is_the_token_weighted_ce_of_each_optimizer_step_over_both_ranks(ds_run):
    """Each rank's k-th optimizer step is its micro-batches G*k .. G*k+G-1; the Trainer logs the all-rank mean."""
    ranks = ds_run["ranks"]
    losses = ranks[0]["losses"]
    assert losses == ranks[1]["losses"] and len(losses) == ranks[0]["global_step"] == ranks[1]["global_step"]
    naive_gap = 0.0
    for k, logged in enumerate(losses):
        window = [m for rank in ranks for m in rank["micro"][G * k:G * k + G]]
        exact = sum(m["ce_sum"] for m in window) / sum(m["tokens"] for m in window)
        assert logged["loss"] == pytest.approx(exact, rel=1e-5), f"step {logged['step']}"
        real = [m for m in window if m["tokens"]]
        naive_gap = max(naive_gap, abs(sum(m["ce_sum"] / m["tokens"] for m in real) / len(real) - exact))
    assert naive_gap > 1e-4, "the data should tell a token-weighted loss from a mean of micro-batch means"
