"""The Trainer's `state.epoch` under ODB (NOTE [ Epoch progress ] in odb_core/epoch/epoch_length.py): it never goes
back, is whole exactly at each ODB epoch's last step, and a run that stops inside an epoch ends below the next
whole number. Issue 31, item 6: with a stream and `samples_per_step` under max_steps the logged epoch read 0.71 at
the end of epoch 0 and then 1.14 (the Trainer's steps over max_steps)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import hf_support
from odb_core.data.collate import PadCollator
from odb_hf import ODBCallback

pytest_plugins = ["hf_fixtures"]


class Stream(torch.utils.data.IterableDataset):
    """A finite stream of processed samples, the same order every epoch (an HF `IterableDataset` without
    shuffling behaves alike)."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


class EpochWatch(TrainerCallback):
    """After ODB's own `on_step_end`: the epoch count of every optimizer step, and at every epoch's end."""

    def __init__(self) -> None:
        self.at_step: dict[int, float] = {}
        self.at_epoch_end: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.at_step[state.global_step] = state.epoch

    def on_epoch_end(self, args, state, control, **kwargs):
        self.at_epoch_end.append(state.epoch)


def train(tmp_path, dataset, max_steps: int, **odb_options) -> tuple[EpochWatch, list, Trainer]:
    infos: list = []
    watch = EpochWatch()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, learning_rate=1e-3, report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
                             gradient_accumulation_steps=odb_options.pop("accumulation", 1))
    odb = ODBCallback(token_budget=512, window=16, observer=infos.append, **odb_options)
    trainer = Trainer(model=hf_support.tiny_llama(), args=args, train_dataset=dataset,
                      data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=[odb, watch])
    trainer.train()
    return watch, infos, trainer


def last_step_of_each_epoch(infos: list) -> dict[int, int]:
    """ODB epoch -> the optimizer step (1-based, over the run) that ends it, from every micro-batch's StepInfo."""
    ends: dict[int, int] = {}
    steps = 0
    for info in infos:
        if info.ends_window:
            steps += 1
            ends[info.epoch] = steps
    return ends


def check_progress(watch: EpochWatch, infos: list, trainer: Trainer, max_steps: int) -> None:
    epochs = [watch.at_step[step] for step in sorted(watch.at_step)]
    assert len(epochs) == trainer.state.global_step == max_steps
    assert all(a <= b for a, b in pairwise(epochs)), epochs
    ends = last_step_of_each_epoch(infos)
    finished = [epoch for epoch in ends if epoch < max(ends)]  # the last epoch is cut by max_steps
    assert len(finished) >= 2, ends
    for epoch in finished:
        assert watch.at_step[ends[epoch]] == epoch + 1, (epoch, ends, epochs)
        assert watch.at_step[ends[epoch] - 1] < epoch + 1, (epoch, ends, epochs)
    assert max(ends) < trainer.state.epoch < max(ends) + 1, (ends, epochs)
    logged = [entry["epoch"] for entry in trainer.state.log_history if "loss" in entry]
    assert all(a <= b for a, b in pairwise(logged)), logged


def test_epoch_count_of_a_stream_with_samples_per_step_never_goes_back_and_is_whole_at_each_epochs_end(
        chat_data, tmp_path):
    """The issue's set-up on the HF Trainer directly: an IterableDataset, samples_per_step, max_steps across three
    ODB epochs; the first epoch's steps read below 1 (no length is known yet), the later ones a share of the
    previous epoch's length."""
    watch, infos, trainer = train(tmp_path, Stream(chat_data.train[:30]), max_steps=12, samples_per_step=6)
    check_progress(watch, infos, trainer, max_steps=12)
    assert watch.at_epoch_end[:2] == [1.0, 2.0]


def test_epoch_count_of_a_step_based_map_style_run_with_accumulation_is_whole_at_each_epochs_end(chat_data,
                                                                                                tmp_path):
    """max_steps with a map-style dataset and G = 2 is a step-based run too: the same guarantee."""
    watch, infos, trainer = train(tmp_path, hf_support.ListDataset(chat_data.train[:24]), max_steps=8, accumulation=2)
    check_progress(watch, infos, trainer, max_steps=8)


@pytest.mark.parametrize("epochs", [2, 1.5])
def test_epoch_count_of_an_epoch_based_run_ends_at_num_train_epochs(chat_data, tmp_path, epochs):
    """Epoch-based (exact plan): whole at each epoch's last step, never back, and the run ends at the epoch count."""
    watch = EpochWatch()
    args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=epochs, learning_rate=1e-3, report_to=[],
                             use_cpu=True, save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True)
    trainer = Trainer(model=hf_support.tiny_llama(), args=args, train_dataset=hf_support.ListDataset(chat_data.train[:24]),
                      data_collator=PadCollator(pad_token_id=hf_support.PAD),
                      callbacks=[ODBCallback(token_budget=512, window=16), watch])
    trainer.train()
    values = [watch.at_step[step] for step in sorted(watch.at_step)]
    assert all(a <= b for a, b in pairwise(values)), values
    assert 1.0 in values
    assert trainer.state.epoch == epochs if epochs % 1 == 0 else epochs <= trainer.state.epoch < 2
