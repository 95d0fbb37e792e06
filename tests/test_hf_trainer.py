"""The HF adapter in one process: how the callback takes effect, planning, logging, eval, and refused set-ups."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import hf_support
from dist_cases import wait_until
from odb_core.data.collate import PadCollator
from odb_core.epoch.loader import ODBDataLoader
from odb_hf import ODBCallback, ODBSetupError, ODBTrainer, ODBTrainerMixin, ODBTrainerTraits

pytest_plugins = ["hf_fixtures"]
COLLATE = PadCollator(pad_token_id=hf_support.PAD)


def make_args(tmp_path, **overrides) -> TrainingArguments:
    options = dict(output_dir=str(tmp_path), learning_rate=1e-2, num_train_epochs=1, report_to=[], use_cpu=True,
                   save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True, lr_scheduler_type="linear")
    options.update(overrides)
    return TrainingArguments(**options)


def make_trainer(tmp_path, samples, callbacks=(), trainer_class=Trainer, model=None, **overrides):
    return trainer_class(model=model if model is not None else hf_support.tiny_llama(), train_dataset=hf_support.ListDataset(samples),
                         args=make_args(tmp_path, **overrides), data_collator=COLLATE, callbacks=list(callbacks))


class CountingTrainer(Trainer):
    """A user subclass with its own compute_loss: ODB must keep calling it."""

    calls = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        CountingTrainer.calls += 1
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_callback_mixes_odb_into_the_trainer_instance_and_keeps_user_overrides(chat_data, tmp_path):
    trainer = make_trainer(tmp_path, chat_data.train[:24], [ODBCallback(token_budget=512)], CountingTrainer)
    assert isinstance(trainer, ODBTrainerMixin) and isinstance(trainer, CountingTrainer)
    assert type(trainer).__name__ == "ODBCountingTrainer" and ODBTrainerMixin not in CountingTrainer.__mro__
    trainer.train()
    assert CountingTrainer.calls == trainer.state.global_step > 0  # GA = 1: one compute_loss per step


def public_names(obj) -> set[str]:
    """The names reachable on `obj`, without Python's own dunders (`__annotations__` of an annotated class)."""
    return {name for name in dir(obj) if not (name.startswith("__") and name.endswith("__"))}


def test_odb_adds_at_most_two_names_to_the_users_trainer(chat_data, tmp_path):
    """`odb` on the instance (its RunState) and the class declaration `odb_traits`: nothing else, before or after
    training, whether the callback attaches itself in __init__ or by attach(); the user's class is untouched."""

    class UserTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class_dict = dict(vars(UserTrainer))
    plain = make_trainer(tmp_path / "plain", chat_data.train[:8], trainer_class=UserTrainer)
    names, attributes = public_names(plain), set(vars(plain))
    late = make_trainer(tmp_path / "late", chat_data.train[:8], trainer_class=UserTrainer)
    ODBCallback(token_budget=512).attach(late)
    built = make_trainer(tmp_path / "built", chat_data.train[:8], [ODBCallback(token_budget=512)], UserTrainer)
    for trainer in (late, built):
        assert set(vars(trainer)) - attributes == {"odb"}
        assert public_names(trainer) - names == {"odb", "odb_traits"}
        assert public_names(type(trainer)) - public_names(UserTrainer) == {"odb", "odb_traits"}
    plain.train()
    built.train()
    assert set(vars(built)) - set(vars(plain)) == {"odb"}
    assert public_names(built) - public_names(plain) == {"odb", "odb_traits"}
    assert dict(vars(UserTrainer)) == class_dict and ODBTrainerMixin not in UserTrainer.__mro__


def test_odb_trainer_class_and_callback_give_the_same_run(chat_data, tmp_path):
    runs = []
    for trainer_class in (Trainer, ODBTrainer):
        infos: list = []
        trainer = make_trainer(tmp_path / trainer_class.__name__, chat_data.train[:24],
                               [ODBCallback(token_budget=512, observer=infos.append)], trainer_class)
        trainer.train()
        runs.append(([i.indices for i in infos], [e["loss"] for e in trainer.state.log_history if "loss" in e]))
    assert runs[0] == runs[1]


def test_a_callback_passed_to_a_second_trainer_is_refused(chat_data, tmp_path):
    """Reused (a notebook cell run again, a sweep's loop), the callback kept the first Trainer's run: the second
    trained without ODB, with its max_steps set from the first one's plan, and stopped early."""
    odb = ODBCallback(token_budget=512)
    with pytest.raises(ODBSetupError, match="auto_find_batch_size"):  # refused: the callback stays free for a fixed one
        make_trainer(tmp_path / "refused", chat_data.train[:16], callbacks=[odb], auto_find_batch_size=True)
    make_trainer(tmp_path / "first", chat_data.train[:16], callbacks=[odb]).train()
    refused = r"already served another Trainer.*new ODBCallback\(\.\.\.\) to each"
    with pytest.raises(ODBSetupError, match=refused):
        make_trainer(tmp_path / "second", chat_data.train[:16], callbacks=[odb])
    added = make_trainer(tmp_path / "added", chat_data.train[:16])
    added.add_callback(odb)
    with pytest.raises(ODBSetupError, match=refused):
        added.train()


def test_the_rounds_wait_for_a_peer_as_long_as_the_trainers_own_collectives_unless_set(chat_data, tmp_path):
    """In DDP rank 0 writes each checkpoint while the others go on to the next batch: ODB's exchanges wait the
    Trainer's `ddp_timeout`, not ODB's own 300 s default, which failed a run whose save took longer."""
    derived = make_trainer(tmp_path / "a", chat_data.train[:16], callbacks=[ODBCallback(token_budget=512)],
                           ddp_timeout=1234)
    assert derived.get_train_dataloader().loader.config.sync_timeout_s == 1234.0
    chosen = make_trainer(tmp_path / "b", chat_data.train[:16], ddp_timeout=1234,
                          callbacks=[ODBCallback(token_budget=512, sync_timeout_s=60)])
    assert chosen.get_train_dataloader().loader.config.sync_timeout_s == 60.0


def test_callback_added_after_construction_must_be_attached(chat_data, tmp_path):
    trainer = make_trainer(tmp_path, chat_data.train[:16])
    trainer.add_callback(ODBCallback(token_budget=512))
    with pytest.raises(ODBSetupError, match=r"ODBCallback is not attached to this Trainer \(added after construction\?\)"):
        trainer.train()
    with pytest.raises(ODBSetupError, match="ODBTrainer mixes in ODB but has no ODBCallback"):
        make_trainer(tmp_path, chat_data.train[:16], trainer_class=ODBTrainer).train()
    late = make_trainer(tmp_path, chat_data.train[:16])
    ODBCallback(token_budget=512).attach(late)
    late.train()
    assert isinstance(late.get_train_dataloader().loader, ODBDataLoader)


def test_epoch_based_run_plans_the_schedule_from_the_estimate(chat_data, tmp_path):
    """W=1 with the epoch in the sample: the estimate is exact, so a linear LR ends at exactly one step above 0."""
    trainer = make_trainer(tmp_path, chat_data.train[:48], [ODBCallback(token_budget=512)], num_train_epochs=2,
                           gradient_accumulation_steps=2)
    trainer.train()
    view = trainer.get_train_dataloader()
    assert view.plan.planned_steps == trainer.state.global_step  # exact at W=1
    assert len(view) >= view.plan.estimate and len(view) % 2 == 0  # the bound, in whole GA windows
    assert trainer.state.epoch == 2.0
    last_lr = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e][-1]
    assert last_lr == pytest.approx(1e-2 / view.plan.planned_steps)


def test_step_based_run_crosses_odb_epochs_until_max_steps(chat_data, tmp_path):
    infos: list = []
    trainer = make_trainer(tmp_path, chat_data.train[:16], [ODBCallback(token_budget=512, observer=infos.append)],
                           max_steps=12)
    trainer.train()
    assert trainer.state.global_step == 12
    first_epoch = [i for info in infos if info.epoch == 0 for i in info.indices]
    assert sorted(first_epoch) == list(range(16)) and max(info.epoch for info in infos) >= 1


def test_epoch_longer_than_the_planned_bound_raises_instead_of_being_cut(chat_data, tmp_path, monkeypatch):
    monkeypatch.setattr(ODBDataLoader, "estimate_steps", lambda self, sample_size=512, epoch=None: 1)
    trainer = make_trainer(tmp_path, chat_data.train[:32], [ODBCallback(token_budget=256, length_slack=0.0,
                                                                        exact_schedule=False)])
    with pytest.raises(RuntimeError, match="more than the 1 steps"):
        trainer.train()


class LengthsChangeAfterPlanning(hf_support.ListDataset):
    """Each sample's first read (the exact schedule's planning read) at `first` of its length, every later read
    (the epochs') at `later`: a dataset that truncates at random in `__getitem__`, made deterministic."""

    def __init__(self, samples: list[dict], first: float, later: float) -> None:
        super().__init__(samples)
        self.first, self.later, self.reads = first, later, [0] * len(samples)

    def __getitem__(self, index: int) -> dict:
        share = self.first if self.reads[index] == 0 else self.later
        self.reads[index] += 1
        sample = self.samples[index]
        keep = max(4, int(len(sample["input_ids"]) * share))
        return {key: value[:keep] for key, value in sample.items()}


def test_an_exact_schedule_over_lengths_that_change_between_reads_says_so_and_names_the_fix(chat_data, tmp_path,
                                                                                            odb_log):
    """NOTE [ Lengths that change between reads ]: epochs shorter than the plan are warned about at their end
    (before: the LR schedule ended short of its end value without a word), longer ones raise naming the cause
    and exact_schedule=False (before: "raise length_slack", which an exact plan does not use)."""
    shorter = LengthsChangeAfterPlanning(chat_data.train[:48], first=1.0, later=0.3)
    trainer = Trainer(model=hf_support.tiny_llama(), train_dataset=shorter, args=make_args(tmp_path / "a"),
                      data_collator=COLLATE, callbacks=[ODBCallback(token_budget=256)])
    trainer.train()
    assert trainer.state.global_step < trainer.state.max_steps  # the premise: the epoch ran short of the plan
    warned = [r.getMessage() for r in odb_log.caplog.records if "the exact schedule planned" in r.getMessage()]
    assert len(warned) == 1 and "ODB epoch 0 ran" in warned[0] and "exact_schedule=False" in warned[0], warned
    longer = LengthsChangeAfterPlanning(chat_data.train[:48], first=0.3, later=1.0)
    trainer = Trainer(model=hf_support.tiny_llama(), train_dataset=longer, args=make_args(tmp_path / "b"),
                      data_collator=COLLATE, callbacks=[ODBCallback(token_budget=256)])
    with pytest.raises(RuntimeError, match=r"more than the \d+ steps the exact schedule planned: .*exact_schedule="
                                           r"False"):
        trainer.train()


def test_evaluation_is_unaffected(chat_data, tmp_path):
    held_out = hf_support.ListDataset(chat_data.eval)
    losses = []
    for callbacks in ([], [ODBCallback(token_budget=512)]):
        trainer = make_trainer(tmp_path, chat_data.train[:8], callbacks, per_device_eval_batch_size=8)
        losses.append(trainer.evaluate(held_out)["eval_loss"])
    assert losses[0] == losses[1]


def test_logged_odb_metrics_reach_tensorboard(chat_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(tmp_path, chat_data.train[:24], [ODBCallback(token_budget=512)], report_to=["tensorboard"])
    trainer.train()
    event_files = sorted((tmp_path / "runs").glob("*/events.out.tfevents.*"))  # TensorBoardCallback's default dir
    events = EventAccumulator(str(event_files[-1])).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/odb/budget_utilization", "train/odb/padding_ratio", "train/odb/tokens_per_second",
            "train/odb/samples_per_second", "train/odb/idle_steps", "train/odb/data_wait_fraction"} <= tags
    assert 0 < events.Scalars("train/odb/budget_utilization")[-1].value <= 1
    assert all(0 <= e.value <= 1 for e in events.Scalars("train/odb/data_wait_fraction"))


def test_samples_over_the_budget_are_warned_once_per_run_and_fitting_samples_not_at_all(chat_data, tmp_path,
                                                                                        odb_log):
    """The budget is the user's memory bound: a sample that runs alone over it is named once, with the fix, even
    over two epochs (before: no warning, only odb/budget_utilization > 1 in the log)."""
    samples = chat_data.train[:24]
    longest = max(len(s["input_ids"]) for s in samples)
    fits = make_trainer(tmp_path / "fits", samples, [ODBCallback(token_budget=longest)])
    fits.train()
    assert odb_log.over_budget() == []
    budget = longest // 2
    over = make_trainer(tmp_path / "over", samples, [ODBCallback(token_budget=budget)], num_train_epochs=2)
    over.train()
    warned = odb_log.over_budget()
    assert len(warned) == 1 and over.odb.run.loader.metrics.oversize_samples > 1, warned
    assert f"exceed token_budget={budget} on their own (the longest has {longest} tokens)" in warned[0]
    assert f"Raise token_budget to at least {longest}, truncate" in warned[0] and "oversize='error'" in warned[0]


class GradRecorder(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n.removeprefix("inner."): p.grad.clone() for n, p in model.named_parameters()})


def test_model_without_loss_kwargs_gets_the_exact_token_mean(chat_data, tmp_path):
    samples, infos, recorder = chat_data.train[:30], [], GradRecorder()
    model = hf_support.LogitsOnly(hf_support.tiny_llama(dtype=torch.float64))
    trainer = make_trainer(tmp_path, samples, [ODBCallback(token_budget=320, observer=infos.append), recorder],
                           model=model, learning_rate=0.0, optim="sgd", max_grad_norm=0.0, label_names=["labels"],
                           gradient_accumulation_steps=3, lr_scheduler_type="constant")
    assert not trainer.model_accepts_loss_kwargs
    trainer.train()
    steps = hf_support.steps_of([{"epoch": i.epoch, "step": i.step, "indices": i.indices} for i in infos], 3)
    error = max(hf_support.max_relative_error(got, hf_support.reference_gradient(model.inner, [samples[i] for i in steps[k]]))
                for got, k in zip(recorder.steps, sorted(steps)))
    assert len(recorder.steps) == len(steps) and error <= 1e-6


def test_patch_cap_reaches_the_loader(tmp_path):
    """VLM-style samples: ODBCallback(max_patches=...) caps the pixel_values rows of every micro-batch."""
    samples = [{"input_ids": list(range(3, 3 + 8 + k % 5)), "labels": list(range(3, 3 + 8 + k % 5)),
                "pixel_values": torch.zeros(4 + k % 3, 6)} for k in range(24)]
    trainer = make_trainer(tmp_path, samples, [ODBCallback(token_budget=4096, max_patches=12)],
                           remove_unused_columns=False)
    batches = list(trainer.get_train_dataloader())
    assert sum(len(b.info.indices) for b in batches) == 24
    assert all(b["pixel_values"].shape[0] <= 12 for b in batches)


@pytest.mark.parametrize("overrides,match", [
    (dict(train_sampling_strategy="group_by_length"),
     "group_by_length' conflicts with ODB, which groups samples by observed length itself"),
    (dict(auto_find_batch_size=True), "auto_find_batch_size=True conflicts with ODB: batch sizes come from token_budget"),
    (dict(label_smoothing_factor=0.1), "label_smoothing_factor != 0 uses a per-batch mean loss that ODB cannot weight"),
])
def test_conflicting_training_arguments_raise(chat_data, tmp_path, overrides, match):
    with pytest.raises(ODBSetupError, match=match):
        make_trainer(tmp_path, chat_data.train[:8], [ODBCallback(token_budget=512)], **overrides)


def test_custom_sampler_and_odb_owned_options_raise(chat_data, tmp_path):
    class SamplerTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    with pytest.raises(ODBSetupError, match="SamplerTrainer._get_train_sampler is overridden, but ODB builds the "
                                            "training batches itself and would silently bypass it"):
        make_trainer(tmp_path, chat_data.train[:8], [ODBCallback(token_budget=512)], SamplerTrainer)

    class BatchSamplesTrainer(Trainer):  # the Trainer's batches of one update, which ODB forms itself
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            return super().get_batch_samples(epoch_iterator, num_batches, device)

    with pytest.raises(ODBSetupError, match="BatchSamplesTrainer.get_batch_samples is overridden"):
        make_trainer(tmp_path, chat_data.train[:8], [ODBCallback(token_budget=512)], BatchSamplesTrainer)
    with pytest.raises(TypeError, match="gradient_accumulation_steps"):
        ODBCallback(token_budget=512, accumulation_steps=4)
    with pytest.raises(TypeError, match="unknown option 'batch_size'"):
        ODBCallback(token_budget=512, batch_size=4)
    with pytest.raises(ValueError, match="token_budget"):
        ODBCallback(token_budget=0)


def test_a_data_method_override_is_accepted_only_from_a_class_that_declares_odb_owns_it(chat_data, tmp_path):
    """`odb_traits = ODBTrainerTraits(owns_data=True)` in the overriding class's own body (odb_llamafactory's
    trainer); a subclass that overrides the method again must declare it again; a malformed declaration raises."""

    class OwnedSampler(ODBTrainerMixin, Trainer):
        odb_traits = ODBTrainerTraits(owns_data=True, adapter="test")

        def _get_train_sampler(self, train_dataset=None):
            raise AssertionError("ODB uses no training sampler")

    class Undeclared(OwnedSampler):
        def _get_train_sampler(self, train_dataset=None):
            return None

    trainer = make_trainer(tmp_path, chat_data.train[:8], [ODBCallback(token_budget=512)], OwnedSampler)
    assert trainer.odb.adapter == "test" and trainer.train().global_step > 0
    with pytest.raises(ODBSetupError, match="Undeclared._get_train_sampler is overridden"):
        make_trainer(tmp_path, chat_data.train[:8], [ODBCallback(token_budget=512)], Undeclared)
    with pytest.raises(ValueError, match=r"ODBTrainerTraits.bypassed_compute_loss=\[<class .*a tuple of Trainer"):
        ODBTrainerTraits(bypassed_compute_loss=[Trainer])


class CountingPad(PadCollator):
    """PadCollator counting its collations and the times its reused memory is given back."""

    preserves_labels = True

    def __init__(self) -> None:
        super().__init__(pad_token_id=hf_support.PAD)
        self.calls, self.released = 0, 0

    def __call__(self, samples):
        self.calls += 1
        return super().__call__(samples)

    def release_memory(self) -> None:
        self.released += 1
        super().release_memory()


@pytest.mark.parametrize("remove_unused_columns", [True, False])
def test_a_pad_collator_behind_the_trainers_column_remover_is_collated_when_taken(chat_data, tmp_path,
                                                                                  remove_unused_columns):
    """A non-Arrow dataset makes the Trainer wrap its collator in RemoveColumnsCollator (the default
    remove_unused_columns=True). Behind it a PadCollator was not seen as label-preserving: the round's first step
    collated every step of the round (here all 30 samples' steps), and its reused memory was never given back."""
    collator = CountingPad()
    trainer = make_trainer(tmp_path, chat_data.train[:30], [ODBCallback(token_budget=160)],
                           remove_unused_columns=remove_unused_columns)
    trainer.data_collator = collator
    loader = trainer.get_train_dataloader()
    checked = collator.calls  # the label check's collation of a sample
    steps = iter(loader)
    first = next(steps)
    assert wait_until(lambda: collator.calls == checked + 2, timeout_s=5.0), collator.calls  # and the next, ahead
    rest = list(steps)
    assert first.info.round == 0 and len(rest) >= 4 and collator.calls == checked + 1 + len(rest)
    assert sorted(i for b in [first, *rest] for i in b.info.indices) == list(range(30))
    assert collator.released >= 1  # at the epoch's end


class HeldIdLists(torch.utils.data.Dataset):
    """Samples whose ids are lists made at each read (lengths no other list in the process has); at each chunk read
    it counts the lists of those lengths alive in the process: the samples the window holds, unless compacted."""

    def __init__(self, n: int) -> None:
        self.lengths, self.held = [700 + i for i in range(n)], []

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        ids = [3 + (k % 90) for k in range(self.lengths[index])]
        return {"input_ids": ids, "labels": list(ids)}

    def __getitems__(self, indices: list[int]) -> list[dict]:
        wanted = set(self.lengths)
        self.held.append(sum(1 for o in gc.get_objects() if type(o) is list and len(o) in wanted and o
                             and type(o[0]) is int))
        return [self[i] for i in indices]


def test_ids_behind_the_trainers_column_remover_are_buffered_as_arrays(tmp_path, monkeypatch):
    """NOTE [ Compact buffered samples ]: behind the Trainer's column remover (a non-Arrow dataset) a PadCollator
    gets the ids as the int64 arrays the window holds, as without it (not lists made again for it), and the filling
    window holds no list for the garbage collector to walk (at afa14ef: 0, 128, 256, 384 lists at the chunk
    reads)."""
    dataset = HeldIdLists(200)
    trainer = Trainer(model=hf_support.tiny_llama(), args=make_args(tmp_path), train_dataset=dataset,
                      data_collator=PadCollator(pad_token_id=hf_support.PAD),
                      callbacks=[ODBCallback(token_budget=4096, window=200, min_window=None)])
    view = trainer.get_train_dataloader()  # checks the collator on one sample of the dataset: lists, not recorded
    given, collate = set(), PadCollator.__call__

    def recording(self, samples):  # PadCollator itself, watched
        given.update(type(sample[key]) for sample in samples for key in ("input_ids", "labels"))
        return collate(self, samples)

    monkeypatch.setattr(PadCollator, "__call__", recording)
    batch = next(iter(view))
    assert batch["input_ids"].shape[1] >= 700 and given == {np.ndarray}, given
    assert len(dataset.held) == 4 and dataset.held == [0, 0, 0, 0], dataset.held


def test_collator_that_drops_labels_is_refused(chat_data, tmp_path):
    def no_labels(samples):
        return {k: v for k, v in COLLATE(samples).items() if k != "labels"}

    trainer = make_trainer(tmp_path, chat_data.train[:8], [ODBCallback(token_budget=512)])
    trainer.data_collator = no_labels
    with pytest.raises(ODBSetupError, match="without 'labels'"):
        trainer.train()


def test_ignored_batch_settings_warn(chat_data, tmp_path):
    with pytest.warns(UserWarning, match="per_device_train_batch_size=4 is ignored"):
        make_trainer(tmp_path, chat_data.train[:8], [ODBCallback(token_budget=512)], per_device_train_batch_size=4)
    assert math.isclose(ODBCallback(token_budget=512).settings.extras["length_slack"], 0.25)


@pytest.mark.parametrize(("scheduler", "warmup", "end"), [("cosine", 0.2, 0.0), ("polynomial", 2, 1e-7),
                                                           ("linear", 0.1, 0.0)])
def test_every_scheduler_ends_at_its_end_value_after_the_real_last_step(chat_data, tmp_path, scheduler, warmup, end):
    """NOTE [ Exact schedule ] at W = 1, with samples_per_step and a warm-up given as steps or as a ratio: the
    schedule is built over the real optimizer steps (state.max_steps, the bar's total), so the LR is at its end
    value (0; polynomial's lr_end 1e-7) after the last step, and the last step still trains with a larger LR."""
    lrs = []

    class LrLog(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            lrs.append(optimizer.param_groups[0]["lr"])

    odb = ODBCallback(token_budget=512, samples_per_step=6, window=16)
    trainer = make_trainer(tmp_path, chat_data.train[:40], [odb, LrLog()], num_train_epochs=2,
                           lr_scheduler_type=scheduler, warmup_steps=warmup, learning_rate=1e-2)
    trainer.train()
    real = trainer.state.global_step
    planned = trainer.odb.run.view.loader.plan_epochs_exactly(range(2))
    assert real == trainer.state.max_steps == len(lrs) == sum(planned.optimizer_steps)
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(end, abs=1e-12)
    assert lrs[-1] > end and max(lrs) == pytest.approx(1e-2, rel=0.2)


def test_a_step_target_needs_gradient_accumulation_1_and_trains_every_sample_with_an_estimated_schedule(chat_data,
                                                                                                        tmp_path):
    with pytest.raises(ODBSetupError, match="gradient_accumulation_steps=1"):
        make_trainer(tmp_path, chat_data.train[:16], [ODBCallback(token_budget=512, samples_per_step=6)],
                     gradient_accumulation_steps=2).train()
    seen = []
    odb = ODBCallback(token_budget=512, samples_per_step=6, window=16, exact_schedule=False,
                      observer=lambda info: seen.extend(info.indices))
    trainer = make_trainer(tmp_path, chat_data.train[:30], [odb])
    trainer.train()
    assert sorted(seen) == list(range(30)) and not trainer.odb.run.view.plan.exact
    assert trainer.state.global_step == trainer.odb.run.loader.metrics.counts.optimizer_steps
def test_a_callback_outside_a_trainer_says_how_to_attach_it(tmp_path):
    from transformers import TrainerControl, TrainerState

    with pytest.raises(ODBSetupError, match=r"ODBCallback could not find the Trainer being built; call "
                                            r"ODBCallback\(\.\.\.\)\.attach\(trainer\)"):
        ODBCallback(token_budget=512).on_init_end(make_args(tmp_path), TrainerState(), TrainerControl())


def test_a_resume_that_ignores_the_data_skip_restarts_the_epoch_and_a_reused_arguments_object_still_restores(
        chat_data, tmp_path):
    """The user's `ignore_data_skip=True`: the checkpoint's epoch starts over and the run ends at the Trainer's
    `max_steps` inside it (before, the callback took that stop for the epoch's end and raised that the epoch was
    longer than planned). And ODB's own setting of `ignore_data_skip` on the arguments is marked as ODB's: a second
    Trainer built from the same `TrainingArguments` (a retry loop) restores the position too (before, it took the
    flag for the user's, restarted the epoch and raised at its end)."""
    full_infos = []
    full = make_trainer(tmp_path / "full", chat_data.train[:40],
                        [ODBCallback(token_budget=400, window=16, observer=full_infos.append)], num_train_epochs=2,
                        save_strategy="steps", save_steps=4)
    full.train()
    checkpoint = str(tmp_path / "full" / "checkpoint-4")
    at = 4  # G = 1: checkpoint-4 was saved after the 4th micro-batch
    restarted_infos = []
    restarted = make_trainer(tmp_path / "restarted", chat_data.train[:40], num_train_epochs=2, ignore_data_skip=True,
                             callbacks=[ODBCallback(token_budget=400, window=16, observer=restarted_infos.append)])
    restarted.train(resume_from_checkpoint=checkpoint)
    assert restarted.state.global_step == full.state.global_step
    assert restarted_infos[0].indices == full_infos[0].indices  # epoch 0 from its beginning
    args = make_args(tmp_path / "again", num_train_epochs=2)
    for attempt in range(2):
        infos = []
        again = Trainer(model=hf_support.tiny_llama(), args=args, train_dataset=hf_support.ListDataset(
            chat_data.train[:40]), data_collator=COLLATE,
            callbacks=[ODBCallback(token_budget=400, window=16, observer=infos.append)])
        again.train(resume_from_checkpoint=checkpoint)
        assert [i.indices for i in infos] == [i.indices for i in full_infos[at:]], attempt
        assert again.state.global_step == full.state.global_step


def test_resuming_from_a_checkpoint_without_odb_state_names_the_missing_file_and_the_fix(chat_data, tmp_path):
    """A checkpoint of a run without ODB (no odb_loader_rank0.json) cannot give the exact data position."""
    plain = make_trainer(tmp_path / "plain", chat_data.train[:8], max_steps=1, save_strategy="steps", save_steps=1,
                         per_device_train_batch_size=4)
    plain.train()
    checkpoint = tmp_path / "plain" / "checkpoint-1"
    resumed = make_trainer(tmp_path / "odb", chat_data.train[:8], [ODBCallback(token_budget=512)], max_steps=2)
    with pytest.raises(ODBSetupError, match=r"odb_loader_rank0.json is missing: the checkpoint was not written by an "
                                            r"ODB run with this world size.*stopped while it saved this "
                                            r"checkpoint .*resume from the checkpoint before it, if one is "
                                            r"left; otherwise pass ignore_data_skip=True"):
        resumed.train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.parametrize("exact", [False, True])
def test_the_run_s_last_step_is_saved_and_evaluated_as_the_trainer_does_at_max_steps(chat_data, tmp_path, exact):
    """On an estimated epoch length (`exact_schedule=False`) `max_steps` is only a bound and ODB ends the run: the
    Trainer's end-of-run checkpoint ("steps" save strategy) and evaluation ("steps" eval strategy) were skipped
    without a word (NOTE [ The run's last step ] in odb_hf/callback.py). Each happens once, at the last step, as
    where the Trainer's own max_steps ends the run (an exact length)."""
    evaluated = []

    class Evaluations(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            evaluated.append(state.global_step)

    trainer = Trainer(model=hf_support.tiny_llama(), train_dataset=hf_support.ListDataset(chat_data.train[:40]),
                      eval_dataset=hf_support.ListDataset(chat_data.eval[:4]), data_collator=COLLATE,
                      args=make_args(tmp_path, save_strategy="steps", save_steps=1000, eval_strategy="steps",
                                     eval_steps=1000),
                      callbacks=[ODBCallback(token_budget=256, exact_schedule=exact), Evaluations()])
    trainer.train()
    last = trainer.state.global_step
    assert trainer.odb.run.view.plan.exact is exact and (last < trainer.state.max_steps) is not exact
    assert evaluated == [last]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [f"checkpoint-{last}"]


@pytest.mark.parametrize("config,model_tp,named", [
    (dict(tp_size=2), None, "tensor parallel size 2"), (dict(cp_size=2), None, "context parallel size 2"),
    (dict(sp_size=4, sp_backend="deepspeed"), None, "sequence parallel size 4"), (None, 2, "tensor parallel size 2"),
    (dict(dp_shard_size=2), None, None), (None, None, None)])
def test_tensor_context_and_sequence_parallelism_are_refused_naming_the_size(config, model_tp, named):
    """The ranks of a TP/CP/SP group must see one batch; ODB gives each rank its own, and transformers divides the
    token count by the non-data-parallel size. Before, nothing refused it under the HF Trainer (the DeepSpeed
    adapter refuses sequence parallelism). Checked on the arguments and model the Trainer holds: a real TP run
    needs several processes whose accelerator setup this machine's single CPU process cannot build."""
    from types import SimpleNamespace

    from accelerate import ParallelismConfig

    from odb_hf.checks import _check_data_parallel_only

    trainer = SimpleNamespace(args=SimpleNamespace(parallelism_config=config and ParallelismConfig(**config)),
                              model=SimpleNamespace(tp_size=model_tp))
    if named is None:
        _check_data_parallel_only(trainer)
    else:
        with pytest.raises(ODBSetupError, match=rf"data parallelism only, and this run uses {named}"):
            _check_data_parallel_only(trainer)
    # what the Trainer reads from its accelerator (`accelerate launch --parallelism_config_cp_size 2`, with no
    # parallelism_config in the arguments) or DeepSpeed's AutoTP, through its own get_*_size methods
    trainer.get_cp_size = lambda: 2
    with pytest.raises(ODBSetupError, match=r"context parallel size 2"):
        _check_data_parallel_only(trainer)


def test_a_plain_trainer_s_own_parallel_sizes_are_one(chat_data, tmp_path):
    trainer = make_trainer(tmp_path, chat_data.train[:8], [ODBCallback(token_budget=256)])
    assert (trainer.get_tp_size(), trainer.get_cp_size(), trainer.get_sp_size()) == (1, 1, 1)


def test_a_model_without_loss_kwargs_gets_an_integer_token_count_after_the_first_step(chat_data, tmp_path):
    """The first optimizer step's count is a float leaf that records gradients (the check that a loss divides by
    it); ODB's own loss for a model without loss kwargs is not checked, and before, it got that float32 leaf at every
    step (a count past 2^24 tokens rounds in float32)."""
    seen = []

    class Recording(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append((num_items_in_batch.dtype, num_items_in_batch.requires_grad))
            return super().training_step(model, inputs, num_items_in_batch)

    model = hf_support.tiny_llama()
    model.accepts_loss_kwargs = False
    trainer = make_trainer(tmp_path, chat_data.train[:32], [ODBCallback(token_budget=256)], trainer_class=Recording,
                           model=model, gradient_accumulation_steps=2)
    trainer.train()
    assert len(seen) > 4 and seen[:2] == [(torch.float32, True)] * 2
    assert set(seen[2:]) == {(torch.int64, False)}


@pytest.mark.parametrize("length", [dict(max_steps=5), dict(num_train_epochs=1)])
def test_train_samples_per_second_counts_the_samples_odb_trained(chat_data, tmp_path, length):
    """NOTE [ The samples a run trained ]: the Trainer derives a step-based run's samples from its batch size, which
    ODB's steps do not have (before: max_steps x 8 samples); ODB puts in the rows its steps trained."""
    rows = []

    class Counting(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            rows.append(inputs["input_ids"].shape[0])
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = make_trainer(tmp_path, chat_data.train[:48], [ODBCallback(token_budget=512)], trainer_class=Counting,
                           gradient_accumulation_steps=2, **length)
    metrics = trainer.train().metrics
    trained = sum(rows)
    assert trained != trainer.state.global_step * 2 * trainer.args.per_device_train_batch_size  # what HF would say
    assert metrics["train_samples_per_second"] == pytest.approx(trained / metrics["train_runtime"], rel=1e-3)
    assert trainer.state.log_history[-1]["train_samples_per_second"] == metrics["train_samples_per_second"]
    if "num_train_epochs" in length:
        assert trained == 48


def test_train_steps_per_second_counts_the_steps_run_under_an_estimated_schedule(chat_data, tmp_path):
    """NOTE [ The samples a run trained ]: the Trainer divides max_steps, under an estimated epoch length the
    schedule's bound, into the runtime; ODB puts in the optimizer steps this train() ran."""
    trainer = make_trainer(tmp_path, chat_data.train[:48], [ODBCallback(token_budget=512, exact_schedule=False)],
                           num_train_epochs=1)
    metrics = trainer.train().metrics
    assert trainer.state.max_steps > trainer.state.global_step  # the premise: the bound, not the steps run
    steps_per_second = trainer.state.global_step / metrics["train_runtime"]
    assert metrics["train_steps_per_second"] == pytest.approx(steps_per_second, abs=1e-3, rel=1e-3)


def test_a_train_that_raises_closes_its_loader_and_a_second_train_runs(chat_data, tmp_path):
    """NOTE [ A failed train() ends its loader ]: before, the failed run's DataLoader workers and threads lived on
    beside the second run's."""
    import multiprocessing
    import threading
    import time

    class Failing(TrainerCallback):
        armed = True

        def on_step_end(self, args, state, control, **kwargs):
            if self.armed and state.global_step == 2:
                raise RuntimeError("a user's callback failed")

    before, threads_before = set(multiprocessing.active_children()), set(threading.enumerate())
    failing = Failing()
    trainer = make_trainer(tmp_path, chat_data.train[:64], [ODBCallback(token_budget=256), failing],
                           dataloader_num_workers=2)
    with pytest.raises(RuntimeError, match="a user's callback failed"):
        trainer.train()
    def left():  # this run's: other tests of the session may have threads of their own
        return [t.name for t in set(threading.enumerate()) - threads_before
                if t.name.startswith("odb-") and t.name != "odb-sigchld"]

    start = time.monotonic()
    while (set(multiprocessing.active_children()) - before or left()) and time.monotonic() - start < 10:
        time.sleep(0.05)
    assert set(multiprocessing.active_children()) - before == set()
    assert not left()
    assert trainer.odb.run.loader.state_dict()["epoch"] == 0  # a closed loader keeps its state
    failing.armed = False
    trainer.train()
    assert trainer.state.global_step > 2
