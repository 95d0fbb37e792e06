"""`ODBCallback`: turn ODB on in a `transformers.Trainer` (or a subclass such as TRL's SFTTrainer) with one line.

The callback holds the settings it was built with (one `ODBSettings`, validated at construction by
`odb_core.settings.settings.read_settings`) and maps the Trainer's events onto ODB. At `on_init_end` it attaches to
the Trainer being built (NOTE [ Attaching ODB to a Trainer ] in attach.py, the one place a user's Trainer changes,
after every check in checks.py), which also reads the `odb` section of `TrainingArguments.deepspeed` (NOTE [ One
DeepSpeed config for both adapters ] in ds_config.py). The per-Trainer state (settings, data position, live run)
is the `RunState` of run.py, `trainer.odb`, which the callback shares; the Trainer methods ODB owns are in trainer.py.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import IntervalStrategy, SaveStrategy

from odb_core.settings.console import announce
from odb_core.settings.settings import ODBSettings, combine, read_settings
from odb_hf import ds_config
from odb_hf.arguments import CALLBACK, EPOCH_LENGTH_DEFAULTS, ODBSetupError
from odb_hf.attach import attach_odb, initialising_trainer
from odb_hf.checks import check_training_start
from odb_hf.run import ODBRun, RunState


def _when_on(event: Any) -> Any:
    """The event, or nothing when the DeepSpeed config's `odb.enabled` turned the callback off."""
    return functools.wraps(event)(lambda self, *args, **kwargs: event(self, *args, **kwargs) if self.enabled else None)


def _served_another() -> ODBSetupError:
    """A callback keeps one Trainer's run, plan and position: a second Trainer is refused."""
    return ODBSetupError("this ODBCallback already served another Trainer, whose run it keeps; pass a new "
                         "ODBCallback(...) to each Trainer")


def _stop_at_the_end(args: Any, state: Any, control: Any) -> None:
    """NOTE [ The run's last step ]
    The Trainer ends a run at `max_steps`, and there (`DefaultFlowCallback`) it also saves a checkpoint under a
    "steps" save strategy and evaluates under a "steps" eval strategy unless this step already did. On an estimated
    epoch length `max_steps` is only the bound, so ODB ends the run itself when its last epoch ran out (or at a
    fractional epoch's end): it asks for the same final save and evaluation, which before were silently skipped
    (no last checkpoint, no last eval). Where the Trainer's own `max_steps` ends the run (an exact length, a
    step-based run), its flow has asked already, and nothing is asked twice; nor for a step saved or evaluated
    by the schedule already."""
    control.should_training_stop = True
    step = state.global_step
    if step >= state.max_steps:
        return
    if args.save_strategy == SaveStrategy.STEPS and not (state.save_steps and step % state.save_steps == 0):
        control.should_save = True
    if (args.eval_strategy == IntervalStrategy.STEPS and not (state.eval_steps and step % state.eval_steps == 0)
            and args.eval_delay <= step):
        control.should_evaluate = True


class ODBCallback(TrainerCallback):
    """Online Dynamic Batching for the Trainer: `Trainer(..., callbacks=[ODBCallback(token_budget=16384)])`.

    Args:
        token_budget: cost ceiling of one micro-batch on one rank (`ODBConfig.token_budget`).
        estimate_sample_size: samples read to estimate the steps per epoch (epoch-based runs).
        length_slack: the epoch length reported to the Trainer is the estimate x (1 + slack), an upper bound.
        exact_schedule: plan the run's real step count before training (NOTE [ Exact schedule ]: every sample's
            length is read once) so that the LR schedule ends exactly at the last step and the progress bar at
            100 %; falls back to the estimate for `tokens_per_step` (an iterable dataset needs `max_steps`).
        **options: other `ODBConfig` fields (cost, max_patches, window, seed, ...), `length_fn`, `observer`,
            `idle_sample` and DataLoader worker options. Gradient accumulation, shuffling, workers and the
            collator come from the Trainer; see docs/guides/hf-trainer.md.
    With `TrainingArguments(deepspeed=...)`, `ODBCallback.from_deepspeed_config(args)` reads the config's `odb` section.
    """

    def __init__(self, token_budget: int, *, estimate_sample_size: int = EPOCH_LENGTH_DEFAULTS["estimate_sample_size"],
                 length_slack: float = EPOCH_LENGTH_DEFAULTS["length_slack"],
                 exact_schedule: bool = EPOCH_LENGTH_DEFAULTS["exact_schedule"], **options: Any) -> None:
        self._hold(read_settings({"token_budget": token_budget, "estimate_sample_size": estimate_sample_size,
                                  "length_slack": length_slack, "exact_schedule": exact_schedule, **options}, CALLBACK))

    def _hold(self, settings: ODBSettings) -> None:
        self._settings = settings
        self._trainer: weakref.ref[Trainer] | None = None
        self._odb: RunState | None = None  # the attached Trainer's `trainer.odb`

    @classmethod
    def from_settings(cls, settings: ODBSettings, **options: Any) -> ODBCallback:
        """A callback for settings read elsewhere (a DeepSpeed `odb` section, LLaMA-Factory's `odb_*` keys) plus
        `ODBCallback` options; a field set in both must be equal. Only `options` are validated here: the
        settings' `ODBConfig`, completed by the options' fields, is the one the loader gets."""
        callback = cls.__new__(cls)
        callback._hold(combine(read_settings({**EPOCH_LENGTH_DEFAULTS, **options}, CALLBACK), settings))
        return callback

    @classmethod
    def from_deepspeed_config(cls, source: Any, **kwargs: Any) -> ODBCallback:
        """The settings of the `odb` section of `source` (TrainingArguments, or a DeepSpeed config dict or path);
        `kwargs`: other `ODBCallback` arguments. `"enabled": false` gives a callback that leaves the Trainer as is."""
        return cls.from_settings(ds_config.read_section(source, required=True), **kwargs)

    @property
    def settings(self) -> ODBSettings:
        """The settings: once attached, those the Trainer runs with (completed by a DeepSpeed `odb` section)."""
        return self._odb.settings if self._odb is not None else self._settings

    @property
    def run(self) -> ODBRun | None:
        """The attached Trainer's live run (`trainer.odb.run`): its loader, epoch view and log meter; None before
        the first `get_train_dataloader()`."""
        return self._odb.run if self._odb is not None else None

    @property
    def enabled(self) -> bool:
        """False only for a callback from a DeepSpeed config with `odb.enabled=false`: it changes nothing."""
        return self.settings.enabled

    @property
    def attached(self) -> bool:
        """Whether the callback attached to a Trainer (which may be gone since): odb_llamafactory checks it."""
        return self._trainer is not None

    @property
    def trainer(self) -> Trainer | None:
        """The Trainer this callback attached to; None before, or once that Trainer is collected."""
        return self._trainer() if self._trainer is not None else None

    def attach(self, trainer: Trainer) -> Trainer:
        """Make `trainer` use ODB (done automatically when passed in `Trainer(callbacks=[...])`)."""
        odb = attach_odb(trainer, self._settings)  # its refusals leave the callback free for a fixed Trainer
        self._trainer, self._odb = weakref.ref(trainer), odb
        if self._odb is not None and self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return trainer

    def _live(self) -> RunState:
        """The attached Trainer's `RunState`, with the run its `get_train_dataloader()` started."""
        if self._odb is None or self._odb.run is None:
            raise ODBSetupError("ODBCallback is not attached to this Trainer (added after construction?); pass it "
                                "in Trainer(callbacks=[...]) or call ODBCallback(...).attach(trainer) before train()")
        return self._odb

    # -- events --------------------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        trainer = initialising_trainer(self)
        if self._trainer is not None:  # its run, plan and position are another Trainer's (still alive or not)
            if trainer is not None and trainer is not self.trainer:
                raise _served_another()
            return
        if trainer is None:
            raise ODBSetupError("ODBCallback could not find the Trainer being built; call "
                                "ODBCallback(...).attach(trainer) after constructing it")
        self.attach(trainer)

    @_when_on
    def on_train_begin(self, args, state, control, **kwargs):
        trainer = initialising_trainer(self)  # the Trainer whose train() dispatches this (found as in on_init_end)
        if self._trainer is not None and trainer is not None and trainer is not self.trainer:
            raise _served_another()
        odb = self._live()
        run = odb.run
        check_training_start(self.trainer)
        run.first_step = state.global_step  # the checkpoint's step on a resume (NOTE [ The samples a run trained ])
        planned = run.view.plan.planned_steps
        if planned is not None:  # ratio logging/eval/save steps follow the plan, not the bound
            state.compute_steps(args, planned)
        if run.view.plan.exact:  # the real count: the progress bar (created after this) and the stop
            state.max_steps = planned
        announce(run.loader, odb.adapter)

    @_when_on
    def on_step_end(self, args, state, control, **kwargs):
        run = self._live().run
        if run.meter.last is None:
            return
        state.epoch = run.view.progress(run.meter.last, global_step=state.global_step, max_steps=state.max_steps)
        fractional = run.view.plan.stop_epoch is not None and args.num_train_epochs % 1  # epoch-based runs only
        if fractional and state.epoch >= args.num_train_epochs:
            _stop_at_the_end(args, state, control)

    @_when_on
    def on_epoch_end(self, args, state, control, **kwargs):
        odb = self._live()
        view = odb.run.view
        if view.plan.length is None:  # step-based: whole once the epoch ran out (NOTE [ Epoch progress ])
            if view.finished and view.loader.epoch > (state.epoch or 0):
                state.epoch = float(view.loader.epoch)
            return
        requested_stop = control.should_training_stop and (state.global_step < state.max_steps or odb.restarted)
        cut = args.num_train_epochs % 1 and view.loader.epoch >= view.plan.stop_epoch  # the last of 1.5 epochs
        if control.should_epoch_stop or requested_stop or cut:
            return  # a stop asked for by a callback, or a fractional last epoch: the epoch is left on purpose
        state.epoch = view.end_epoch()  # whole, whatever the estimate said its length was; raises on an overflow
        if view.done():
            _stop_at_the_end(args, state, control)

    @_when_on
    def on_save(self, args, state, control, **kwargs):
        self._live().save_position(args.output_dir, state.global_step)

    @_when_on
    def on_train_end(self, args, state, control, **kwargs):
        self._live().run.loader.close()  # with ODB's threads and Gloo group (NOTE [ Threads at interpreter exit ])
