"""The `odb` section of `TrainingArguments.deepspeed`: the config path of `odb_deepspeed.initialize`, in the Trainer.

NOTE [ One DeepSpeed config for both adapters ]
The Trainer hands `TrainingArguments.deepspeed` (a path or a dict) to `deepspeed.initialize` itself, `odb` section
included: `HfTrainerDeepSpeedConfig` only fills "auto" values and DeepSpeed 0.19.8 accepts unknown top-level keys
silently. So the section alone does nothing under the Trainer; an `ODBCallback` reads it when it attaches, with
`odb_core.settings.ds_section.parse_odb_section` (the parser `odb_deepspeed` uses):
  * a bad section (unknown key, bad value, no `enabled`) raises when the Trainer is built, whatever the callback;
  * `ODBCallback.from_deepspeed_config(args)` takes its settings from the section; `ODBCallback(token_budget=...)`
    adds the section's settings it leaves unset; a setting given in both must be equal, or it raises
    (`odb_core.settings.settings.combine`);
  * `odb.shuffle` / `odb.num_workers` must agree with `train_sampling_strategy` / `dataloader_num_workers`, from
    which the loader is built; a difference raises (neither side silently wins);
  * `"enabled": false` turns ODB off, with a warning, for a callback built from a config with `enabled: false`.
    An explicit `ODBCallback(token_budget=...)` or an ODB trainer class asks for ODB, and `enabled` must agree.
The exact loss needs no change under DeepSpeed: see NOTE [ Exact loss under the HF Trainer ] in trainer.py;
`engine.backward(loss, scale_wrt_gas=False)` replaces DDP's backward and DeepSpeed's "mean" reduction DDP's average.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import Trainer, TrainingArguments

from odb_core.settings.ds_section import parse_odb_section
from odb_core.settings.settings import ODBSettings, combine
from odb_hf.arguments import ODBSetupError
from odb_hf.trainer import ODBTrainerMixin

logger = logging.getLogger(__name__)


def read_section(source: Any, *, required: bool = False) -> ODBSettings | None:
    """The validated `odb` section of `source` (TrainingArguments, a DeepSpeed config dict or path); None if none,
    unless `required` (for `ODBCallback.from_deepspeed_config`)."""
    config = source.deepspeed if isinstance(source, TrainingArguments) else source
    where = "TrainingArguments.deepspeed" if isinstance(source, TrainingArguments) else "the DeepSpeed config"
    try:
        section = parse_odb_section(config) if config is not None else None
    except (TypeError, ValueError) as exc:
        raise ODBSetupError(f"{where}: {exc}") from exc
    if section is None and required:
        raise ODBSetupError(f"{where} has no 'odb' section: add \"odb\": {{\"enabled\": true, \"token_budget\": "
                            "...} or use ODBCallback(token_budget=...)")
    return section


def check_loader_options(args: TrainingArguments, section: ODBSettings) -> None:
    """`odb.shuffle`, `odb.num_workers` and `odb.epochs` must say what the TrainingArguments say."""
    strategy, shuffle, workers = (getattr(args, "train_sampling_strategy", "random"), section.extras.get("shuffle"),
                                  section.extras.get("num_workers"))
    if shuffle is not None and shuffle != (strategy != "sequential"):
        raise ODBSetupError(f"odb.shuffle={str(shuffle).lower()} in the DeepSpeed config but "
                            f"TrainingArguments.train_sampling_strategy={strategy!r}; make them agree ('random' "
                            "shuffles, 'sequential' does not) or drop odb.shuffle")
    epochs = section.extras.get("epochs")
    if epochs is not None and epochs != args.num_train_epochs:
        raise ODBSetupError(f"odb.epochs={epochs} in the DeepSpeed config but TrainingArguments.num_train_epochs="
                            f"{args.num_train_epochs}; the Trainer builds its exact schedule from num_train_epochs: "
                            "make them agree or drop odb.epochs")
    if workers is not None and workers != args.dataloader_num_workers:
        raise ODBSetupError(f"odb.num_workers={workers} in the DeepSpeed config but "
                            f"TrainingArguments.dataloader_num_workers={args.dataloader_num_workers}; make them "
                            "agree or drop odb.num_workers")


def resolve(settings: ODBSettings, trainer: Trainer) -> ODBSettings | None:
    """The settings `trainer` runs with: a callback's `settings`, completed by the `odb` section of its
    `TrainingArguments.deepspeed` (checked against them); None when the section turns ODB off."""
    section = read_section(trainer.args)
    if section is not None and section.enabled != settings.enabled:
        asked = "asks for ODB" if settings.enabled else "comes from a config with odb.enabled=false"
        raise ODBSetupError(f"odb.enabled={str(section.enabled).lower()} in TrainingArguments.deepspeed, but the "
                            f"ODBCallback {asked}; build it with ODBCallback.from_deepspeed_config(args) so "
                            "that the config decides, or change odb.enabled")
    if not settings.enabled and isinstance(trainer, ODBTrainerMixin):
        raise ODBSetupError(f"{type(trainer).__name__} mixes in ODB but the ODBCallback comes from a config with "
                            "odb.enabled=false; use the plain Trainer class or set odb.enabled to true")
    if not settings.enabled:
        logger.warning("ODB is off: odb.enabled is false in the DeepSpeed config; the Trainer uses its own "
                       "data loader, batch size and loss")
        return None
    if section is not None:
        settings = combine(settings, section)
        check_loader_options(trainer.args, section)
    return settings


def check_engine(trainer: Trainer) -> None:
    """At train begin: DeepSpeed must average gradients over ranks, as DDP does (the loss is scaled by W for it)."""
    engine = trainer.model_wrapped
    if trainer.is_deepspeed_enabled and not getattr(engine, "gradient_average", True):
        raise ODBSetupError("the DeepSpeed config sets gradient_allreduce_op='sum', but the Trainer's token-weighted "
                            "loss (x number of processes) assumes averaged gradients: remove gradient_allreduce_op "
                            "or set it to 'mean'")
