"""How ODB takes effect on a Trainer instance: the one place where odb_hf changes a user's object.

NOTE [ Attaching ODB to a Trainer ]
A callback only observes events, but ODB must own `get_train_dataloader`, `get_batch_samples`, `compute_loss`,
`create_scheduler`, `train` and `log`, which run before or between events. The contract:
  * Who, when: `ODBCallback.on_init_end`, which `Trainer.__init__` dispatches after building its callback handler,
    or `ODBCallback.attach(trainer)` for a callback added after construction (`trainer.add_callback` misses
    on_init_end, and training then refuses to start). Once per Trainer.
  * Which Trainer (`initialising_trainer`): at on_init_end, the nearest caller frame whose `self` is a Trainer
    holding the callback (`inspect`'s public frame API; subclasses such as SFTTrainer reach it through
    `super().__init__`).
  * Checks, then changes: `checks.check_attach` runs every check (the Trainer class, its arguments, a DeepSpeed
    `odb` section) and raises `ODBSetupError` before anything is changed.
  * What changes, on that instance only: its class becomes `ODB<Class>(ODBTrainerMixin, <Class>)` (`with_odb`, one
    class per base) unless it mixes ODB in already, and `trainer.odb` is set to a new `RunState` (run.py: the
    settings, the data position and the live run of this Trainer; the callback keeps the same object, so a
    callback serves one Trainer). That is all ODB adds to a Trainer: `odb` on the instance, and through the mixin
    the class declaration `odb_traits` (`ODBTrainerTraits`); the mixin's other methods override the Trainer's.
    Its class and other instances are untouched. The user's overrides stay below the mixin in the MRO and are
    called through `super()`; isinstance checks still hold.
  * A Trainer class may inherit `ODBTrainerMixin` itself (or be `ODBTrainer`). A class that overrides a data method
    on ODB's behalf declares it in its own body, `odb_traits = ODBTrainerTraits(owns_data=True, ...)`
    (odb_llamafactory's trainer does).
  * Off: a callback built from a DeepSpeed config with `"enabled": false` changes nothing (a warning says ODB is
    off); its events do nothing.
"""

from __future__ import annotations

import functools
import inspect
import logging

from transformers import Trainer, TrainerCallback

from odb_core.settings.settings import ODBSettings
from odb_hf.checks import check_attach
from odb_hf.run import RunState
from odb_hf.trainer import ODBTrainerMixin

logger = logging.getLogger(__name__)


@functools.cache
def with_odb(base: type) -> type:
    """`base` with `ODBTrainerMixin` first in its MRO (one class per base, so repeated use adds no classes)."""
    return type(f"ODB{base.__name__}", (ODBTrainerMixin, base), {"__module__": __name__})


def initialising_trainer(callback: TrainerCallback) -> Trainer | None:
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


def attach_odb(trainer: Trainer, settings: ODBSettings) -> RunState | None:
    """Check `trainer`, then mix ODB into this instance and set `trainer.odb` to its new `RunState` (see the NOTE
    above); None, with nothing changed, when a DeepSpeed config's `odb.enabled` is false."""
    settings = check_attach(trainer, settings)
    if settings is None:
        logger.warning("ODB is off: odb.enabled is false in the DeepSpeed config; the Trainer uses its own "
                       "data loader, batch size and loss")
        return None
    if not isinstance(trainer, ODBTrainerMixin):
        trainer.__class__ = with_odb(type(trainer))
    adapter = trainer.odb_traits.adapter or f"HF {type(trainer).__name__.removeprefix('ODB')}"
    trainer.odb = RunState(settings, adapter)
    return trainer.odb
