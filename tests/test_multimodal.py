"""VLM samples through the engine: the offline Qwen2-VL pipeline (benchmarks/data/mm_mix.py), the cost ODB observes
(text + expanded visual tokens, patch rows), mixed text/image collation, and the patch cap with real workers."""

from __future__ import annotations

import pytest
import torch

from benchmarks.data import mm_mix
from odb_core import ODBDataLoader
from odb_core.data.collate import PadCollator
from odb_core.data.sample import inspect_sample


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm")
    processor = mm_mix.build_processor(folder)
    return folder, processor.tokenizer


def test_sample_cost_is_text_plus_expanded_visual_tokens(vlm):
    folder, tokenizer = vlm
    dataset = mm_mix.MMMixDataset(folder, mm_mix.mm_mix_specs(40, seed=3))
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for index in range(len(dataset)):
        sample = dataset[index]
        grid = sample["image_grid_thw"]
        visual = int((sample["input_ids"] == image_id).sum())
        assert visual == int(grid.prod(dim=1).sum()) // mm_mix.MERGE**2  # every image expanded, none lost
        assert torch.equal(sample["mm_token_type_ids"], (sample["input_ids"] == image_id).long())
        item = inspect_sample(index, sample, None)
        assert item.length == len(sample["input_ids"]) and item.length > visual  # text + visual tokens
        assert item.patches == sample["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())
        assert (sample["labels"] != -100).any()  # the assistant reply is supervised


def test_a_group_mixing_text_only_and_image_samples_collates_and_runs(vlm):
    folder, tokenizer = vlm
    dataset = mm_mix.MMMixDataset(folder, mm_mix.mm_mix_specs(6, seed=4))
    images = [dataset[0], dataset[1]]
    text = {k: dataset[2][k][:20] for k in ("input_ids", "labels")}  # no image fields at all
    text["input_ids"] = torch.where(text["input_ids"] == tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                                    tokenizer.pad_token_id, text["input_ids"])
    batch = PadCollator(pad_token_id=tokenizer.pad_token_id)([images[0], text, images[1]])
    assert torch.equal(batch["pixel_values"], torch.cat([images[0]["pixel_values"], images[1]["pixel_values"]]))
    assert torch.equal(batch["mm_token_type_ids"][1], torch.zeros_like(batch["mm_token_type_ids"][1]))
    loss = mm_mix.tiny_qwen2_vl(tokenizer)(**batch).loss
    assert torch.isfinite(loss)


def test_every_group_respects_the_token_budget_and_the_patch_cap_with_workers(vlm):
    folder, tokenizer = vlm
    dataset = mm_mix.MMMixDataset(folder, mm_mix.mm_mix_specs(60, seed=5))
    loader = ODBDataLoader(dataset, token_budget=2048, max_patches=3000, window=64, num_workers=2,
                           collate_fn=PadCollator(pad_token_id=tokenizer.pad_token_id))
    seen = []
    for batch in loader:
        rows, width = batch["input_ids"].shape
        patches = batch["pixel_values"].shape[0]
        assert batch.info.local_patches == patches
        assert rows == 1 or (rows * width <= 2048 and patches <= 3000)  # a single sample may be oversize
        seen += batch.info.indices
    assert sorted(seen) == list(range(len(dataset)))
    summary = loader.metrics.summary()
    assert 0 < summary["patch_utilization"] <= 1 and 0 < summary["budget_utilization"] <= 1


def test_vlm_step_gradient_equals_big_batch_token_mean_through_the_trainer(vlm, tmp_path):
    """G6 for a VLM: with GA=2, every optimizer step's gradient (text and vision parameters) equals the float64
    gradient of the mean CE over all supervised tokens of the step's samples, computed in one big batch."""
    from transformers import Trainer, TrainingArguments

    import hf_support
    from odb_hf import ODBCallback

    folder, tokenizer = vlm
    dataset = mm_mix.MMMixDataset(folder, mm_mix.mm_mix_specs(24, seed=6))
    samples = [dataset[k] for k in range(len(dataset))]
    model = mm_mix.tiny_qwen2_vl(tokenizer, dtype=torch.float64)
    infos, recorder = [], hf_support.GradRecorder()
    args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2, learning_rate=0.0, optim="sgd",
                             max_grad_norm=0.0, num_train_epochs=1, report_to=[], save_strategy="no",
                             logging_steps=1000, use_cpu=True, seed=0, lr_scheduler_type="constant", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=hf_support.ListDataset(samples),
                      data_collator=PadCollator(pad_token_id=tokenizer.pad_token_id),
                      callbacks=[ODBCallback(token_budget=1024, max_patches=4096, window=24, observer=infos.append),
                                 recorder])
    trainer.train()
    records = [{"epoch": i.epoch, "step": i.step, "indices": list(i.indices)} for i in infos]
    steps = hf_support.steps_of(records, 2)
    assert len(recorder.steps) == len(steps) > 1
    worst = max(hf_support.max_relative_error(got, hf_support.reference_gradient(
        model, [samples[i] for i in steps[key]], pad_token_id=tokenizer.pad_token_id))
        for got, key in zip(recorder.steps, sorted(steps)))
    print(f"VLM W=1 GA=2: max relative gradient error {worst:.2e} over {len(steps)} steps")
    assert worst <= 1e-6
