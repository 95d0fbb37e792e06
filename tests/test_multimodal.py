"""VLM samples through the engine: the offline Qwen2-VL pipeline (benchmarks/data/mm_mix.py), the cost ODB observes
(text + expanded visual tokens, patch rows), mixed text/image collation, and the patch cap with real workers."""

from __future__ import annotations

import numpy as np
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


# -- vision fields of several families (NOTE [ Vision fields in a batch ] in odb_core/data/vision_fields.py) -------
IMAGE, VIDEO, START, END = 90, 91, 92, 93  # special tokens of the samples built without a model


def special_tokens(tokenizer) -> tuple[int, int, int, int]:
    """The MM-Mix tokenizer's image, video, vision start and end ids, as `mm_mix.tiny_qwen2_vl` reads them."""
    ids = tokenizer.convert_tokens_to_ids
    return ids("<|image_pad|>"), ids("<|video_pad|>"), ids("<|vision_start|>"), ids("<|vision_end|>")


def qwen_sample(n_text: int, image=None, video=None, seed: int = 0,
                tokens: tuple[int, int, int, int] = (IMAGE, VIDEO, START, END)) -> dict:
    """Text tokens, then an image's and a video's expanded tokens ((t, h, w) grids; 4 patches per token)."""
    image_token, video_token, start, end = tokens
    generator = torch.Generator().manual_seed(seed)
    ids, kinds, sample = [10 + i % 50 for i in range(n_text)], [0] * n_text, {}  # above every special id
    for grid, token, kind, pixels, grid_key in ((image, image_token, 1, "pixel_values", "image_grid_thw"),
                                                (video, video_token, 2, "pixel_values_videos", "video_grid_thw")):
        if grid is not None:
            t, h, w = grid
            ids += [start] + [token] * (t * h * w // 4) + [end]
            kinds += [0] + [kind] * (t * h * w // 4) + [0]
            sample[pixels] = torch.randn(t * h * w, 1176, generator=generator)
            sample[grid_key] = torch.tensor([grid])
    ids = torch.tensor(ids)
    return {**sample, "input_ids": ids, "labels": ids.clone(), "mm_token_type_ids": torch.tensor(kinds)}


def test_video_patches_are_counted_and_capped():
    """Before, a video counted 0 patches: one batch held 512 patch rows under max_patches=64."""
    assert inspect_sample(0, qwen_sample(6, video=(2, 4, 4)), None).patches == 32
    assert inspect_sample(0, qwen_sample(6, image=(1, 4, 4), video=(2, 4, 4)), None).patches == 48
    loader = ODBDataLoader([qwen_sample(6, video=(2, 4, 4), seed=i) for i in range(16)], token_budget=4096,
                           max_patches=64, collate_fn=PadCollator())
    rows = [batch["pixel_values_videos"].shape[0] for batch in loader]
    assert sum(rows) == 16 * 32 and max(rows) <= 64 and all(b.info.local_patches for b in loader)


def test_text_rows_videos_and_multi_axis_positions_collate_as_qwen2_vl_takes_them(vlm):
    """An empty grid (HF datasets' [] for a text row) no longer turns the batch's grid into float32, and Qwen2-VL's
    (3, L) rope positions batch as (3, B, L): the loss equals the model's own positions' (before, rows of unequal
    lengths failed to collate, and three equal ones trained on wrong positions)."""
    _, tokenizer = vlm
    model, tokens = mm_mix.tiny_qwen2_vl(tokenizer).eval(), special_tokens(tokenizer)
    samples = [qwen_sample(6, image=(1, 4, 4), seed=1, tokens=tokens), qwen_sample(9, video=(2, 4, 4), seed=2,
                                                                                   tokens=tokens),
               qwen_sample(4, image=(1, 4, 8), seed=3, tokens=tokens)]
    text = {**qwen_sample(12, seed=4, tokens=tokens), "image_grid_thw": torch.tensor([]),
            "pixel_values": torch.tensor([])}
    collate = PadCollator()
    plain = collate([*samples, text])
    assert plain["image_grid_thw"].dtype == torch.long and plain["image_grid_thw"].shape == (2, 3)
    with torch.no_grad():
        own = model(**plain).loss
        for sample in [*samples, text]:  # each sample's positions, as its own batch of one gives them
            single = collate([sample])
            positions, _ = model.model.get_rope_index(
                single["input_ids"], mm_token_type_ids=single["mm_token_type_ids"],
                image_grid_thw=single.get("image_grid_thw"), video_grid_thw=single.get("video_grid_thw"),
                attention_mask=single["attention_mask"])
            sample["position_ids"] = positions[:, 0, :]
        batch = collate([*samples, text])
        assert batch["position_ids"].shape == (3, 4, plain["input_ids"].shape[1])
        assert torch.allclose(model(**batch).loss, own, atol=1e-6)


def test_per_image_lists_flat_grids_and_other_families_fields_concatenate():
    """A list of per-image pixels and a flat (t, h, w) grid, which the patch count reads, collate; LLaVA-NeXT's
    crops are padded to the group's most and its image_sizes concatenated; Qwen2.5-VL's second_per_grid_ts too."""
    a, b = torch.randn(16, 6), torch.randn(8, 6)
    listed = {"input_ids": torch.arange(5), "pixel_values": [a, b], "image_grid_thw": [1, 4, 4, 1, 2, 4]}
    batch = PadCollator()([listed, {"input_ids": torch.arange(3), "pixel_values": b, "image_grid_thw": [1, 2, 4]}])
    assert torch.equal(batch["pixel_values"], torch.cat([a, b, b]))
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4], [1, 2, 4]]
    assert inspect_sample(0, listed, None).patches == 24
    two, three = torch.randn(1, 2, 3, 28, 28), torch.randn(1, 3, 3, 28, 28)
    next_ = PadCollator()([{"input_ids": torch.arange(4), "pixel_values": two, "image_sizes": [[28, 56]]},
                           {"input_ids": torch.arange(6), "pixel_values": three, "image_sizes": [[56, 28]]}])
    assert next_["pixel_values"].shape == (2, 3, 3, 28, 28) and next_["image_sizes"].shape == (2, 2)
    assert torch.equal(next_["pixel_values"][0, :2], two[0]) and not next_["pixel_values"][0, 2].any()
    timed = PadCollator()([{"input_ids": torch.arange(4), "second_per_grid_ts": torch.tensor([1.0, 2.0])},
                           {"input_ids": torch.arange(4)},
                           {"input_ids": torch.arange(4), "second_per_grid_ts": torch.tensor([0.5])}])
    assert timed["second_per_grid_ts"].tolist() == [1.0, 2.0, 0.5]
    one, two_images = [np.zeros((3, 8, 8))], [np.zeros((3, 8, 8)), np.ones((3, 8, 8))]  # LLaVA's images, listed
    llava = PadCollator()([{"input_ids": torch.arange(4), "pixel_values": one, "image_sizes": [np.array([8, 8])]},
                           {"input_ids": torch.arange(4), "pixel_values": two_images,
                            "image_sizes": [np.array([8, 8]), np.array([8, 8])]}])
    assert llava["pixel_values"].shape == (3, 3, 8, 8) and llava["image_sizes"].shape == (3, 2)  # stacked, not
    # concatenated along their first axis (a review of the first version found (9, 8, 8))
