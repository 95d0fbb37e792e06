"""odb_hf: Online Dynamic Batching in the Hugging Face Trainer.

    trainer = Trainer(model, args, train_dataset=..., data_collator=...,
                      callbacks=[ODBCallback(token_budget=16384)])

With `TrainingArguments(deepspeed=...)`, `ODBCallback.from_deepspeed_config(args)` reads the config's `odb` section.
ODB's state on the Trainer is `trainer.odb`, a `RunState` (odb_hf.run); a Trainer class tells ODB about itself
with one class attribute, `odb_traits = ODBTrainerTraits(...)`. `causal_lm_loss` is a `compute_loss_func` for models
without loss kwargs next to a `compute_loss` override. See docs/guides/hf-trainer.md for the knobs, what is
exact, and how the callback takes effect.
"""

from odb_core.steps.loss import causal_lm_loss
from odb_hf.arguments import ODBSetupError
from odb_hf.attach import with_odb
from odb_hf.callback import ODBCallback
from odb_hf.trainer import ODBTrainer, ODBTrainerMixin, ODBTrainerTraits

__all__ = ["ODBCallback", "ODBSetupError", "ODBTrainer", "ODBTrainerMixin", "ODBTrainerTraits", "causal_lm_loss",
           "with_odb"]
