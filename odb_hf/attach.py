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
  * Checks, then changes: `arguments.check_trainer` refuses Trainer classes and arguments that conflict with ODB
    (`ODBSetupError`) before anything is changed; so does `ds_config.resolve` for a DeepSpeed `odb` section, and
    `attach_odb` for a `compute_loss` defined above the mixin (ODB checks the loss it gets from below).
  * What changes, on that instance only: its class becomes `ODB<Class>(ODBTrainerMixin, <Class>)` (`with_odb`, one
    class per base) unless it mixes ODB in already, and `trainer.odb` is set to the callback, which holds the
    settings and the run state of this Trainer (so a callback serves one Trainer). Nothing else is set on the
    Trainer; its class and other instances are untouched. The user's overrides stay below the mixin in the MRO and
    are called through `super()`; isinstance checks still hold.
  * A Trainer class may inherit `ODBTrainerMixin` itself (or be `ODBTrainer`). A class that overrides a data method
    on ODB's behalf declares it with `odb_owns_data = True` in its own body (odb_llamafactory's trainer does).
  * Off: a callback built from a DeepSpeed config with `"enabled": false` changes nothing; its events do nothing.
"""

from __future__ import annotations

import functools
import inspect

from transformers import Trainer, TrainerCallback

from odb_hf.arguments import ODBSetupError, check_trainer
from odb_hf.trainer import ODBTrainerMixin


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


def attach_odb(trainer: Trainer, callback: TrainerCallback) -> None:
    """Check `trainer`, then mix ODB into this instance and set `trainer.odb = callback` (see the NOTE above)."""
    check_trainer(trainer)
    mro = type(trainer).__mro__
    above = [c for c in mro[:mro.index(ODBTrainerMixin)] if "compute_loss" in vars(c)] if ODBTrainerMixin in mro else []
    if above:  # ODB checks the loss it gets from below (trainer.py NOTE [ Exact loss under the HF Trainer ])
        raise ODBSetupError(f"{above[0].__name__}.compute_loss is defined above ODBTrainerMixin in the MRO, so ODB "
                            "cannot check the loss it returns: move it into a base class that comes after "
                            "ODBTrainerMixin, or drop the mixin (ODBCallback alone puts ODB above your class)")
    if not isinstance(trainer, ODBTrainerMixin):
        trainer.__class__ = with_odb(type(trainer))
    trainer.odb = callback
