"""LLaMA-Factory 0.9.5 vision-language SFT with `odb: true`, end to end in .venv-lf (built by `make venv-lf`).

A tiny random Qwen2-VL with a BPE vocabulary trained on real chitchat text, and a sharegpt dataset of real
conversations over generated images of varied resolutions (tests/lf_mm_fixtures.py), trained with the example
config configs/llamafactory/qwen2vl_lora_odb.yaml and `key=value` overrides. LLaMA-Factory's `qwen2_vl` template
expands each image into its visual tokens while preprocessing; its collator computes `pixel_values` per
micro-batch, after ODB grouped the samples. The model folder ships an image-only processor because transformers'
Qwen2-VL video processor needs torchvision (tests/lf_mm_fixtures.py NOTE [ A processor without torchvision ]).
"""

from __future__ import annotations

import json
import math

import pytest

import lf_mm_fixtures
from odb_llamafactory.settings import ALLOWED_KEYS, ODBConfigError, pop_odb_settings
from test_llamafactory import CONFIGS, LF_BIN, ROOT, assert_ok, run_lf

VLM_LORA = CONFIGS / "qwen2vl_lora_odb.yaml"
BUDGET, G = 1024, 2  # odb_token_budget override; gradient_accumulation_steps of the example
N_SAMPLES = 40

# under make/CI a missing .venv-lf is an error (raised when test_llamafactory is imported), never a skip
requires_lf = pytest.mark.skipif(not (LF_BIN / "python").exists(),
                                 reason=".venv-lf is absent: build it with `make venv-lf` (make test does)")


@pytest.fixture(scope="module")
def vlm_record(tmp_path_factory) -> dict:
    """One LoRA SFT run of the tiny Qwen2-VL with ODB through the Python API, recorded by VisionRecorder."""
    root = tmp_path_factory.mktemp("lf-mm")
    assets = lf_mm_fixtures.build_all(root)
    values = {"model_name_or_path": assets["model"], "dataset_dir": assets["data"], "dataset": "mm_chitchat",
              "output_dir": root / "out", "cutoff_len": BUDGET, "odb_token_budget": BUDGET, "max_samples": "null",
              "preprocessing_num_workers": "null", "dataloader_num_workers": 0, "bf16": "false", "num_train_epochs": 2,
              "lora_rank": 4, "logging_steps": 1, "save_steps": 1000, "plot_loss": "false"}
    done = run_lf([str(LF_BIN / "python"), str(ROOT / "tests/lf_mm_fixtures.py"), str(VLM_LORA), str(root / "record"),
                   *(f"{key}={value}" for key, value in values.items())], root / "vlm.log", timeout=300)
    assert_ok(done)
    return {**json.loads((root / "record" / "rank0.json").read_text()), "n_images": assets["n_images"]}


@requires_lf
@pytest.mark.slow
def test_vlm_lora_with_odb_uses_every_sample_and_image_once_per_epoch_in_varying_batches_under_budget(vlm_record):
    steps, micro = vlm_record["steps"], vlm_record["micro"]
    assert vlm_record["dataset_size"] == N_SAMPLES
    assert len(micro) == len(steps) == G * vlm_record["global_step"]
    for epoch in (0, 1):
        used = [i for s in steps if s["epoch"] == epoch for i in s["indices"]]
        assert sorted(used) == list(range(N_SAMPLES)), f"epoch {epoch}: not every sample exactly once"
        images = sum(m["images"] - bool(m["text_only"]) for m, s in zip(micro, steps) if s["epoch"] == epoch)
        assert images == vlm_record["n_images"], f"epoch {epoch}: not every image through the vision tower once"
    assert all(m["rows_match"] for m in micro), "a forward's rows were not the samples ODB grouped for it"
    assert all(s["padded_tokens"] <= BUDGET and s["cost"] <= BUDGET for s in steps)  # visual tokens included
    assert len({s["local_samples"] for s in steps}) >= 3, "batch sizes should follow the observed lengths"


@requires_lf
@pytest.mark.slow
def test_vlm_micro_batches_of_text_only_samples_stay_under_budget_with_the_collators_fake_image(vlm_record):
    """NOTE [ The collator's fake image ]: the collator appends a fake image's tokens to a micro-batch without an
    image; the tensor the model receives, padded to that row, stays within the budget."""
    fakes = [m for m in vlm_record["micro"] if m["text_only"]]
    assert fakes, "no micro-batch held only text samples: the dataset's text samples should group together"
    assert all(m["images"] == 1 and m["image_tokens"] > 0 for m in fakes), fakes  # the collator's fake image
    for step, m in zip(vlm_record["steps"], vlm_record["micro"]):  # the cost ODB planned covers the tensor built
        assert m["input_slots"] <= step["cost"] <= BUDGET, (step["cost"], m)


@requires_lf
@pytest.mark.slow
def test_vlm_collator_builds_pixel_values_that_match_the_visual_tokens_odb_budgeted(vlm_record):
    for m in vlm_record["micro"]:
        assert m["images"] >= 1
        assert m["pixel_rows"] == m["grid_patches"] == m["merge"] ** 2 * m["image_tokens"], m


@requires_lf
@pytest.mark.slow
def test_vlm_loss_computed_by_odb_is_the_token_weighted_ce_of_each_optimizer_step(vlm_record):
    """Qwen2-VL is called without labels (`accepts_loss_kwargs = False`): ODB's trainer computes this loss."""
    micro, losses = vlm_record["micro"], vlm_record["losses"]
    assert len(losses) == vlm_record["global_step"]
    naive_gap = 0.0
    for k, logged in enumerate(losses):
        window = micro[G * k:G * k + G]
        exact = sum(m["ce_sum"] for m in window) / sum(m["tokens"] for m in window)
        assert math.isfinite(logged["loss"]) and logged["loss"] == pytest.approx(exact, rel=1e-5), logged
        naive_gap = max(naive_gap, abs(sum(m["ce_sum"] / m["tokens"] for m in window) / G - exact))
    assert naive_gap > 1e-4, "the data should tell a token-weighted loss from a mean of micro-batch means"


def test_patch_cap_is_refused_because_llamafactory_computes_pixel_values_after_batching():
    """Samples reach ODB with image paths; a `odb_max_patches` cap would count 0 patches and never bind."""
    with pytest.raises(ODBConfigError, match="odb_max_patches would have no effect under LLaMA-Factory") as err:
        pop_odb_settings({"stage": "sft", "odb": True, "odb_token_budget": 4096, "odb_max_patches": 16384})
    assert "visual tokens in input_ids" in str(err.value)
    assert "odb_max_patches" not in ALLOWED_KEYS
