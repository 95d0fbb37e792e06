"""The `odb` section of `TrainingArguments.deepspeed`: the config path of `odb_deepspeed.initialize`, in the Trainer.

NOTE [ One DeepSpeed config for both adapters ]
The Trainer hands `TrainingArguments.deepspeed` (a path or a dict) to `deepspeed.initialize` itself, `odb` section
included: `HfTrainerDeepSpeedConfig` only fills "auto" values and DeepSpeed 0.19.8 accepts unknown top-level keys
silently. So the section alone does nothing under the Trainer; an `ODBCallback` reads it (`read_section`, with
`odb_core.settings.ds_section.parse_odb_section`, the parser `odb_deepspeed` uses) when it attaches, where
`checks.check_attach` holds it against the callback and the TrainingArguments:
  * a bad section (unknown key, bad value, no `enabled`) raises when the Trainer is built, whatever the callback;
  * `ODBCallback.from_deepspeed_config(args)` takes its settings from the section; `ODBCallback(token_budget=...)`
    adds the section's settings it leaves unset; a setting given in both must be equal, or it raises
    (`odb_core.settings.settings.combine`);
  * `odb.shuffle` / `odb.num_workers` / `odb.epochs` must agree with `train_sampling_strategy` /
    `dataloader_num_workers` / `num_train_epochs`, from which the loader and the schedule are built; a difference
    raises (neither side silently wins);
  * `"enabled": false` turns ODB off, with a warning, for a callback built from a config with `enabled: false`.
    An explicit `ODBCallback(token_budget=...)` or an ODB trainer class asks for ODB, and `enabled` must agree.
The exact loss needs no change under DeepSpeed: see NOTE [ Exact loss under the HF Trainer ] in trainer.py;
`engine.backward(loss, scale_wrt_gas=False)` replaces DDP's backward and DeepSpeed's "mean" reduction DDP's average.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainingArguments

from odb_core.settings.ds_section import parse_odb_section
from odb_core.settings.settings import ODBSettings
from odb_hf.arguments import ODBSetupError


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
