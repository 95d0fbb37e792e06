"""The Trainer's side of ODB's settings: what `ODBCallback` takes and how the Trainer completes it.

`CALLBACK` is the `odb_core.settings.settings` source of `ODBCallback(**options)`: ODBConfig fields, the
epoch-length keys (defaults `EPOCH_LENGTH_DEFAULTS`) and the loader arguments it passes on; the settings that the
Trainer already holds are refused (`DERIVED`). `build_loader` completes the callback's `ODBConfig` with what the
Trainer derives (`ODBSettings.derive`: gradient accumulation, and the seed unless the user set one). The Trainer
classes and arguments that ODB refuses or warns about are checked in checks.py; nothing here changes a user setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import TrainingArguments

from odb_core.epoch.loader import WORKER_OPTIONS, ODBDataLoader
from odb_core.settings.settings import EPOCH_LENGTH_KEYS, PASSED_ON, ODBSettings, SettingsSource

DERIVED = {"accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
           "shuffle": "TrainingArguments.train_sampling_strategy ('random' or 'sequential')",
           "num_workers": "TrainingArguments.dataloader_num_workers", "collate_fn": "the Trainer's data_collator"}
LOADER_ARGS = ("length_fn", "observer", "idle_sample", "shard_iterable", *sorted(WORKER_OPTIONS))


class ODBSetupError(ValueError):
    """A Trainer setting, or a setting of ODB under the Trainer, that ODB cannot run with; the message names the
    setting and the fix."""


CALLBACK = SettingsSource(
    where="ODBCallback", noun="option", budget="optional", error=ODBSetupError, key_error=TypeError,
    refused={name: f"is not an ODBCallback option: it comes from {source}" for name, source in DERIVED.items()},
    keys={**EPOCH_LENGTH_KEYS, **dict.fromkeys(LOADER_ARGS, PASSED_ON)})
EPOCH_LENGTH_DEFAULTS = {"estimate_sample_size": 512, "length_slack": 0.25, "exact_schedule": True}


def build_loader(args: TrainingArguments, dataset: Any, collate_fn: Any, settings: ODBSettings) -> ODBDataLoader:
    """The training loader: the settings' `ODBConfig` with the Trainer's accumulation (and seed and collective
    timeout, `ddp_timeout`, unless the user set them), the Trainer's sampling strategy, workers and collator, then the
    callback's own loader arguments."""
    if settings.config.step_target is not None:
        unit = settings.config.step_target[0]
        if args.gradient_accumulation_steps != 1:
            raise ODBSetupError(f"gradient_accumulation_steps={args.gradient_accumulation_steps} with {unit}_per_step: "
                                f"ODB accumulates micro-batches until the optimizer step holds {unit}_per_step "
                                "itself; set gradient_accumulation_steps=1")
        if args.include_num_input_tokens_seen not in ("no", False):
            raise ODBSetupError(f"include_num_input_tokens_seen is not supported with {unit}_per_step (the Trainer "
                                "sees one item per optimizer step); ODB logs odb/tokens_per_second instead")
    config = settings.derive(accumulation_steps=args.gradient_accumulation_steps,
                             seed=args.data_seed if args.data_seed is not None else args.seed,
                             sync_timeout_s=float(args.ddp_timeout))  # a rank 0 saving a checkpoint, the others wait
    workers: dict[str, Any] = {"pin_memory": args.dataloader_pin_memory}
    if args.dataloader_num_workers > 0:
        workers["persistent_workers"] = args.dataloader_persistent_workers
        if args.dataloader_prefetch_factor is not None:
            workers["prefetch_factor"] = args.dataloader_prefetch_factor
    passed = {k: v for k, v in settings.extras.items() if k not in EPOCH_LENGTH_KEYS}
    return ODBDataLoader(dataset, config=config, collate_fn=collate_fn, num_workers=args.dataloader_num_workers,
                         shuffle=getattr(args, "train_sampling_strategy", "random") != "sequential",
                         **{**workers, **passed})


def check_collator_keeps_labels(collate_fn: Any, dataset: Any) -> None:
    """Collate one sample and require `labels`: ODB's exact loss counts supervised tokens from them."""
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return
    batch = collate_fn([dataset[0]])
    if not isinstance(batch, Mapping) or "labels" not in batch:
        keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ODBSetupError(f"the data collator returned {keys} without 'labels'; ODB's token-weighted loss needs "
                            "labels (-100 = not supervised), e.g. DataCollatorForLanguageModeling(tokenizer, "
                            "mlm=False) or a collator that pads a 'labels' field; if the model's forward takes no "
                            "'labels', the Trainer drops the column unless TrainingArguments(label_names=['labels'])")
