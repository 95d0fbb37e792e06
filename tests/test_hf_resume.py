"""G8 through the HF Trainer in one process: `train(resume_from_checkpoint=...)` from a checkpoint at any position
the Trainer saves at continues exactly as the uninterrupted run did.

The Trainer saves at optimizer-step boundaries only, so the positions are: a step inside an epoch, the last step
of an epoch (NOTE [ Resuming at an epoch's end ] in odb_core/epoch/epoch_length.py) and the run's last step. Each
case below trains once, saving after every optimizer step, and resumes from every checkpoint in a new Trainer:
the resumed run's per-step losses equal the uninterrupted run's (<= 1e-6; with dropout too: NOTE [ ODB draws
nothing from the global RNG ] in odb_core/epoch/loader.py), its batches are the uninterrupted run's remaining
ones, and it ends at the same global_step and epoch. The 2-rank versions are in tests/test_hf_distributed.py.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainingArguments

import hf_support
from conftest import LengthDataset, lognormal_lengths
from odb_core import ODBDataLoader
from odb_core.data.collate import PadCollator
from odb_core.resume.fields import StateError
from odb_hf import ODBCallback

pytest_plugins = ["hf_fixtures"]
TOLERANCE = 1e-6
SAMPLES = 28


@dataclass(frozen=True)
class Case:
    """One training set-up: gradient accumulation, attention dropout, ODB options and a step-based `max_steps`."""

    accumulation: int = 1
    dropout: float = 0.0
    odb: dict = field(default_factory=dict)
    max_steps: int = -1
    epochs: int = 2


CASES = {
    "ga1": Case(),
    "ga2-dropout": Case(accumulation=2, dropout=0.1),
    "samples-per-step-dropout": Case(dropout=0.1, odb=dict(samples_per_step=5)),
    "ga2-estimated-length": Case(accumulation=2, odb=dict(exact_schedule=False)),  # len() is an upper bound
    "max-steps-dropout": Case(dropout=0.1, max_steps=11),  # step-based: the run crosses ODB epochs
}


@dataclass(frozen=True)
class Run:
    losses: dict[int, float]
    global_step: int
    epoch: float
    indices: list[tuple[int, ...]]  # every micro-batch ODB yielded, in order


def train(folder: Path, case: Case, samples: list[dict], resume: Path | None = None) -> Run:
    """One Trainer run of `case` (saving after every optimizer step unless it resumes from `resume`)."""
    yielded: list[tuple[int, ...]] = []
    args = TrainingArguments(output_dir=str(folder), learning_rate=1e-2, num_train_epochs=case.epochs,
                             max_steps=case.max_steps,
                             gradient_accumulation_steps=case.accumulation, report_to=[], use_cpu=True,
                             save_strategy="no" if resume else "steps", save_steps=1, logging_steps=1, seed=0,
                             disable_tqdm=True, lr_scheduler_type="linear")
    odb = ODBCallback(token_budget=400, window=16, observer=lambda info: yielded.append(info.indices), **case.odb)
    trainer = Trainer(model=hf_support.tiny_llama(attention_dropout=case.dropout), args=args,
                      train_dataset=hf_support.ListDataset(samples),
                      data_collator=PadCollator(pad_token_id=hf_support.PAD), callbacks=[odb])
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    return Run(losses=losses, global_step=trainer.state.global_step, epoch=trainer.state.epoch, indices=yielded)


def checkpoints(folder: Path) -> dict[int, dict]:
    """Each checkpoint's global step -> its saved loader state."""
    found = {int(path.name.removeprefix("checkpoint-")): path for path in folder.glob("checkpoint-*")}
    return {step: json.loads((found[step] / "odb_loader_rank0.json").read_text()) for step in sorted(found)}


def position(state: dict, step: int, last: int) -> str:
    if step == last:
        return "last step"
    return "epoch end" if (state["position"] or {}).get("epoch_complete") else "inside an epoch"


def assert_resumes_exactly(resumed: Run, full: Run, step: int, epoch_based: bool = True) -> None:
    """The same losses after `step`, batches and final global_step (and epoch count, in an epoch-based run: in a
    step-based one the resumed loader knows no epoch length yet, so `state.epoch` measures the epoch from the
    resume step; NOTE [ Epoch progress ])."""
    assert resumed.global_step == full.global_step, step
    assert resumed.epoch == full.epoch or not epoch_based, (step, resumed.epoch, full.epoch)
    assert sorted(resumed.losses) == sorted(full.losses), step  # the log history up to `step` is the checkpoint's
    worst = max((abs(resumed.losses[k] - full.losses[k]) for k in resumed.losses if k > step), default=0.0)
    assert worst <= TOLERANCE, (step, worst)
    assert resumed.indices == full.indices[len(full.indices) - len(resumed.indices):], step


class Runs:
    """The uninterrupted run of each case, trained once per module (its checkpoints are resumed from)."""

    def __init__(self, root: Path, samples: list[dict]) -> None:
        self.root, self.samples, self._full = root, samples, {}

    def full(self, name: str) -> Run:
        if name not in self._full:
            self._full[name] = train(self.root / name, CASES[name], self.samples)
        return self._full[name]

    def resumed(self, name: str, step: int) -> Run:
        return train(self.root / f"{name}-resumed-{step}", CASES[name], self.samples,
                     resume=self.root / name / f"checkpoint-{step}")


@pytest.fixture(scope="module")
def runs(chat_data, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("resume"), chat_data.train[:SAMPLES])


@pytest.mark.slow
def test_a_checkpoint_at_the_last_step_of_an_epoch_resumes_into_the_next_epoch(runs):
    """Issue 28, case 1: the state of a checkpoint at epoch 0's last step says `epoch_complete`; the resumed
    Trainer used to find no batch in epoch 0 and stop half-way ("There seems not to be a single sample")."""
    full, saved = runs.full("ga2-dropout"), checkpoints(runs.root / "ga2-dropout")
    step = next(k for k, state in saved.items() if position(state, k, full.global_step) == "epoch end")
    assert saved[step]["epoch"] == 0
    assert_resumes_exactly(runs.resumed("ga2-dropout", step), full, step)


@pytest.mark.slow
def test_a_resumed_run_with_dropout_draws_the_same_dropout_masks(runs):
    """Issue 28, case 2: attention dropout 0.1, a checkpoint inside epoch 1; the resumed run used to draw one more
    number from the global torch RNG (the DataLoader's base seed at `iter()`) after the Trainer restored it."""
    full, saved = runs.full("ga2-dropout"), checkpoints(runs.root / "ga2-dropout")
    step = next(k for k, state in saved.items() if state["epoch"] == 1 and position(state, k, -1) == "inside an epoch")
    assert_resumes_exactly(runs.resumed("ga2-dropout", step), full, step)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_from_every_checkpoint_continues_with_the_uninterrupted_losses(runs, name):
    """Every checkpoint of the run (every optimizer step: inside an epoch, at each epoch's end, the last step)."""
    full, saved = runs.full(name), checkpoints(runs.root / name)
    assert sorted(saved) == list(range(1, full.global_step + 1))
    kinds = {position(state, k, full.global_step) for k, state in saved.items()}
    assert kinds == {"inside an epoch", "epoch end", "last step"}, kinds
    epoch_based = CASES[name].max_steps <= 0
    for step in saved:
        if not epoch_based and step == full.global_step:
            continue  # resumed at global_step == max_steps, transformers runs one more step, with or without ODB
        assert_resumes_exactly(runs.resumed(name, step), full, step, epoch_based)


@pytest.mark.slow
def test_a_checkpoint_after_a_longer_epoch_resumes_every_epoch_left(chat_data, tmp_path):
    """The resumed Trainer counts the epochs done as global_step // (len() / G). `len()` was the longest epoch from
    the restored one on, so after a longer earlier epoch the count came out one too high and the resumed run
    skipped the last epoch without a word (global_step and epoch short, the LR schedule never finished). On 36
    samples at G = 2 the epochs take 5, 6, 5 and 5 optimizer steps; the checkpoints inside the third one are where
    the count can go wrong (at step 15, 15 // 5 = 3 epochs done, where two were)."""
    case, samples = Case(accumulation=2, epochs=4), chat_data.train[:36]
    full = train(tmp_path / "full", case, samples)
    saved = checkpoints(tmp_path / "full")
    per_epoch = Counter(state["epoch"] for state in saved.values())
    assert [per_epoch[e] for e in range(4)] == [5, 6, 5, 5]  # the premise: a longer epoch before the last ones
    inside = [k for k, state in saved.items() if state["epoch"] == 2 and position(state, k, full.global_step)
              == "inside an epoch"]
    assert inside == [12, 13, 14, 15]
    for step in inside:
        resumed = train(tmp_path / f"resumed-{step}", case, samples, resume=tmp_path / "full" / f"checkpoint-{step}")
        assert_resumes_exactly(resumed, full, step)


def global_rng_states() -> tuple:
    """torch's, numpy's and Python's global RNG states; numpy's whole (the key array changes only once every 624
    draws: the position and the cached Gaussian tell a single draw)."""
    kind, key, position, has_gauss, gauss = np.random.get_state()
    return torch.get_rng_state(), (kind, key.tolist(), position, has_gauss, gauss), random.getstate()


@pytest.mark.parametrize("num_workers,prefetch_steps", [(0, 0), (0, 2), (2, 2)])
def test_iterating_planning_and_resuming_leave_the_global_rngs_alone(num_workers, prefetch_steps):
    """NOTE [ ODB draws nothing from the global RNG ]: the model's dropout draws from the same RNG the Trainer
    restores from a checkpoint, so ODB must draw nothing from it, at `iter()` (a DataLoader's base seed) or after."""
    dataset = LengthDataset(lognormal_lengths(120, 1.0, 128, seed=3, hi=1024))

    def make() -> ODBDataLoader:
        return ODBDataLoader(dataset, token_budget=1024, shuffle=True, window=16, num_workers=num_workers,
                             prefetch_steps=prefetch_steps)

    loader = make()
    before = global_rng_states()
    loader.plan_epochs_exactly([0, 1])
    loader.estimate_steps()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    steps = len(list(resumed)) + len(list(resumed))
    after = global_rng_states()
    assert steps > 0
    assert torch.equal(before[0], after[0]), "ODB drew from the global torch RNG"
    assert before[1] == after[1], "ODB drew from numpy's global RNG"
    assert before[2] == after[2], "ODB drew from Python's global RNG"


@pytest.mark.slow
def test_a_resume_on_re_tokenized_data_is_refused_naming_the_replayed_round(runs):
    """The same checkpoint resumed on the same samples cut to 24 tokens (a lower `cutoff_len` between the runs): the
    replayed round's fill is not the saved one's, and the Trainer's resume stops with a `StateError` before its
    first step (NOTE [ A resume reads what the save read ]); before, it trained the rest of the epoch on other
    batches, repeating and skipping samples."""
    full, saved = runs.full("ga1"), checkpoints(runs.root / "ga1")
    step = next(k for k, state in saved.items() if position(state, k, full.global_step) == "inside an epoch")
    cut = [{key: value[:24] for key, value in sample.items()} for sample in runs.samples]
    assert any(len(a["input_ids"]) != len(b["input_ids"]) for a, b in zip(cut, runs.samples, strict=True))
    with pytest.raises(StateError, match="which the resume replays, are not the ones the saved run planned"):
        train(runs.root / f"ga1-cut-{step}", CASES["ga1"], cut, resume=runs.root / "ga1" / f"checkpoint-{step}")
