"""`ODBCallback`: turn ODB on in a `transformers.Trainer` (or a subclass such as TRL's SFTTrainer) with one line.

NOTE [ How the callback takes effect ]
A callback only observes events, but ODB must own `get_train_dataloader`, `get_batch_samples`, `compute_loss`,
`create_scheduler`, `train` and `log`, which run before or between events. At `on_init_end`, which
`Trainer.__init__` dispatches after building its callback handler, the callback finds the Trainer being built:
the nearest caller frame whose `self` is a Trainer holding this callback (`inspect`'s public frame API; subclasses
such as SFTTrainer reach it through `super().__init__`). It then sets that instance's class to a subclass
`ODB<Class>(ODBTrainerMixin, <Class>)`, created once per class. Only this instance changes; the user's overrides
stay in the MRO below the mixin, which calls them through `super()`; isinstance checks still hold. A callback
added after construction (`trainer.add_callback`) misses `on_init_end`: call `ODBCallback.attach(trainer)`, or
training refuses to start. Subclasses may instead inherit `ODBTrainerMixin` (or use `ODBTrainer`) themselves.
Attaching also reads the `odb` section of `TrainingArguments.deepspeed` (NOTE [ One DeepSpeed config for both
adapters ] in ds_config.py); a callback that it turns off leaves the Trainer as is, and its events do nothing.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

from transformers import Trainer, TrainerCallback

from odb_hf import ds_config
from odb_hf.arguments import ODBSetupError, check_trainer, validate_options
from odb_hf.checkpoint import save_loader_state
from odb_hf.trainer import ODBRun, ODBTrainerMixin


@functools.cache
def with_odb(base: type) -> type:
    """`base` with `ODBTrainerMixin` first in its MRO (one class per base, so repeated use adds no classes)."""
    return type(f"ODB{base.__name__}", (ODBTrainerMixin, base), {"__module__": __name__})


def _when_on(event: Any) -> Any:
    """The event, or nothing when the DeepSpeed config's `odb.enabled` turned the callback off."""
    return functools.wraps(event)(lambda self, *args, **kwargs: event(self, *args, **kwargs) if self.enabled else None)


def _initialising_trainer(callback: TrainerCallback) -> Trainer | None:
    """The Trainer whose `__init__` is dispatching an event to `callback`, found up the call stack."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            handler = getattr(owner, "callback_handler", None)
            if isinstance(owner, Trainer) and handler is not None and callback in handler.callbacks:
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame


class ODBCallback(TrainerCallback):
    """Online Dynamic Batching for the Trainer: `Trainer(..., callbacks=[ODBCallback(token_budget=16384)])`.

    Args:
        token_budget: cost ceiling of one micro-batch on one rank (`ODBConfig.token_budget`).
        estimate_sample_size: samples read to estimate the steps per epoch (epoch-based runs).
        length_slack: the epoch length reported to the Trainer is the estimate x (1 + slack), an upper bound.
        **options: other `ODBConfig` fields (cost, max_patches, window, seed, ...), `length_fn`, `observer`,
            `idle_sample` and DataLoader worker options. Gradient accumulation, shuffling, workers and the
            collator come from the Trainer; see docs/guides/hf-trainer.md.
    With `TrainingArguments(deepspeed=...)`, `ODBCallback.from_deepspeed_config(args)` reads the config's `odb` section.
    """

    def __init__(self, token_budget: int, *, estimate_sample_size: int = 512, length_slack: float = 0.25,
                 **options: Any) -> None:
        validate_options(token_budget, options)
        if not length_slack >= 0 or estimate_sample_size < 1:
            raise ValueError(f"length_slack={length_slack} must be >= 0 and estimate_sample_size="
                             f"{estimate_sample_size} >= 1")
        self.token_budget, self.options = token_budget, dict(options)
        self.estimate_sample_size, self.length_slack = estimate_sample_size, length_slack
        self.enabled = True  # False only from a DeepSpeed config with odb.enabled=false (from_deepspeed_config)
        self._trainer: weakref.ref[Trainer] | None = None

    @classmethod
    def from_deepspeed_config(cls, source: Any, **kwargs: Any) -> ODBCallback:
        """The settings of the `odb` section of `source` (TrainingArguments, or a DeepSpeed config dict or path);
        `kwargs`: other `ODBCallback` arguments. `"enabled": false` gives a callback that leaves the Trainer as is."""
        found = ds_config.callback_arguments(source, kwargs)
        callback = cls(**found.kwargs)
        callback.enabled = found.enabled
        return callback

    def attach(self, trainer: Trainer) -> Trainer:
        """Make `trainer` use ODB (done automatically when passed in `Trainer(callbacks=[...])`)."""
        self._trainer = weakref.ref(trainer)
        if not ds_config.resolve(self, trainer):
            return trainer  # odb.enabled is false in the DeepSpeed config: ODB is off
        check_trainer(trainer)
        if not isinstance(trainer, ODBTrainerMixin):
            trainer.__class__ = with_odb(type(trainer))
        trainer._odb_callback = self
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return trainer

    def _run(self) -> ODBRun:
        trainer = self._trainer() if self._trainer is not None else None
        run = getattr(trainer, "_odb_run", None)
        if run is None:
            raise ODBSetupError("ODBCallback is not attached to this Trainer (added after construction?); pass it "
                                "in Trainer(callbacks=[...]) or call ODBCallback(...).attach(trainer) before train()")
        return run

    # -- events --------------------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        if self._trainer is None:
            trainer = _initialising_trainer(self)
            if trainer is None:
                raise ODBSetupError("ODBCallback could not find the Trainer being built; call "
                                    "ODBCallback(...).attach(trainer) after constructing it")
            self.attach(trainer)

    @_when_on
    def on_train_begin(self, args, state, control, **kwargs):
        planned = self._run().view.plan.planned_steps
        trainer = self._trainer()
        ds_config.check_engine(trainer)
        if args.world_size > 1 and not trainer.is_fsdp_enabled and trainer.model_wrapped is trainer.model:
            raise ODBSetupError("the model is not wrapped for data-parallel training, so gradients would not be "
                                "synchronised across ranks (transformers skips the DDP wrap when "
                                "trainer.evaluate() ran before train()); evaluate after training or on another "
                                "Trainer instance")
        if planned is not None:  # ratio logging/eval/save steps follow the estimate, not the bound
            state.compute_steps(args, planned)

    @_when_on
    def on_step_end(self, args, state, control, **kwargs):
        run = self._run()
        info, estimate = run.last, run.view.plan.estimate
        if info is None or estimate is None:
            return
        state.epoch = info.epoch + min((info.step + 1) / estimate, 1.0)
        if args.num_train_epochs % 1 and state.epoch >= args.num_train_epochs:
            control.should_training_stop = True

    @_when_on
    def on_epoch_end(self, args, state, control, **kwargs):
        view = self._run().view
        requested_stop = control.should_training_stop and state.global_step < state.max_steps
        if view.plan.length is None or control.should_epoch_stop or requested_stop:
            return  # step-based run, or a stop asked for by a callback: the epoch is left on purpose
        if view.overflowed():
            raise RuntimeError(f"ODB epoch {view.next_epoch - 1} has more than the {len(view)} steps the Trainer "
                               f"planned (estimate {view.plan.estimate}); raise ODBCallback(length_slack=...) "
                               "above its current value or set max_steps")
        if view.done():
            control.should_training_stop = True

    @_when_on
    def on_save(self, args, state, control, **kwargs):
        save_loader_state(self._run().loader, args.output_dir, state.global_step)

    @_when_on
    def on_train_end(self, args, state, control, **kwargs):
        self._run().loader.close()
