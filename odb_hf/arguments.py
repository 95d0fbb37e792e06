"""Translate a Trainer's settings into `ODBDataLoader` arguments, and refuse settings that ODB cannot honour.

Nothing here changes a user setting: a setting ODB makes meaningless gets a warning, a setting that would make
the run wrong (or hang) raises `ODBSetupError` naming the setting and the fix.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from transformers import Trainer, TrainingArguments

from odb_core.config import ODBConfig
from odb_core.loader import CONFIG_FIELDS, WORKER_OPTIONS

logger = logging.getLogger(__name__)
DERIVED = {"accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
           "shuffle": "TrainingArguments.train_sampling_strategy ('random' or 'sequential')",
           "num_workers": "TrainingArguments.dataloader_num_workers",
           "collate_fn": "the Trainer's data_collator"}
LOADER_ARGS = frozenset({"length_fn", "observer", "idle_sample", "shard_iterable"})
OWNED_METHODS = ("get_train_dataloader", "_get_train_sampler")


class ODBSetupError(ValueError):
    """A Trainer setting conflicts with ODB; the message names the setting and the fix."""


def _default(name: str) -> Any:
    return next(f.default for f in fields(TrainingArguments) if f.name == name)


def validate_options(token_budget: int, options: Mapping[str, Any]) -> None:
    """Check `ODBCallback(**options)` now, at construction, with ODBConfig's own validation."""
    derived = sorted(set(options) & set(DERIVED))
    if derived:
        raise TypeError(f"ODBCallback does not take {derived}: they come from {[DERIVED[k] for k in derived]}")
    unknown = set(options) - CONFIG_FIELDS - WORKER_OPTIONS - LOADER_ARGS
    if unknown:
        raise TypeError(f"ODBCallback got unknown options {sorted(unknown)}; it takes ODB config fields "
                        f"{sorted(CONFIG_FIELDS - set(DERIVED) - {'token_budget'})}, loader arguments "
                        f"{sorted(LOADER_ARGS)} and worker options {sorted(WORKER_OPTIONS)}")
    ODBConfig(token_budget=token_budget, **{k: v for k, v in options.items() if k in CONFIG_FIELDS})


def check_trainer(trainer: Trainer) -> None:
    """Refuse Trainer classes and arguments that conflict with ODB (called when ODB attaches)."""
    for name in OWNED_METHODS:
        owner = next(c for c in type(trainer).__mro__ if name in vars(c))
        if owner is not Trainer and "_odb_owns_data" not in vars(owner):
            raise ODBSetupError(f"{owner.__name__}.{name} is overridden, but ODB builds the training batches "
                                "itself and would silently bypass it; remove the override (ODB shards, shuffles "
                                "and batches the data) or do not use ODB with this Trainer")
    args = trainer.args
    if getattr(args, "train_sampling_strategy", "random") == "group_by_length":
        raise ODBSetupError("train_sampling_strategy='group_by_length' conflicts with ODB, which groups samples "
                            "by observed length itself; use 'random' (shuffle) or 'sequential'")
    if args.auto_find_batch_size:
        raise ODBSetupError("auto_find_batch_size=True conflicts with ODB: batch sizes come from token_budget; "
                            "lower ODBCallback(token_budget=...) instead if you run out of memory")
    if args.label_smoothing_factor != 0:
        raise ODBSetupError("label_smoothing_factor != 0 uses a per-batch mean loss that ODB cannot weight "
                            "exactly; pass a compute_loss_func that sums token losses and divides by "
                            "num_items_in_batch instead")
    if args.n_gpu > 1:
        raise ODBSetupError(f"n_gpu={args.n_gpu} means torch.nn.DataParallel; ODB aligns one process per "
                            "device: launch with torchrun / accelerate launch instead")
    if args.world_size > 1 and not args.average_tokens_across_devices:
        raise ODBSetupError("average_tokens_across_devices=False normalises each rank's loss by its own tokens; "
                            "ODB's exact loss divides by the step's tokens over all ranks: set it to True")
    if args.per_device_train_batch_size != _default("per_device_train_batch_size") and not args.deepspeed:
        # (under DeepSpeed the Trainer requires it to equal train_micro_batch_size_per_gpu: set for that, not ODB)
        warnings.warn(f"per_device_train_batch_size={args.per_device_train_batch_size} is ignored: ODB sizes "
                      "each batch by ODBCallback(token_budget=...); use max_batch_size=... to cap samples",
                      stacklevel=3)
    if args.dataloader_drop_last:
        warnings.warn("dataloader_drop_last=True is ignored: ODB drops no sample (every rank drains its data)",
                      stacklevel=3)


def loader_kwargs(args: TrainingArguments, token_budget: int, options: Mapping[str, Any]) -> dict[str, Any]:
    """ODBDataLoader keyword arguments from the TrainingArguments plus the callback's options."""
    kwargs: dict[str, Any] = {
        "token_budget": token_budget,
        "accumulation_steps": args.gradient_accumulation_steps,
        "shuffle": getattr(args, "train_sampling_strategy", "random") != "sequential",
        "seed": args.data_seed if args.data_seed is not None else args.seed,
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
    }
    if args.dataloader_num_workers > 0:
        kwargs["persistent_workers"] = args.dataloader_persistent_workers
        if args.dataloader_prefetch_factor is not None:
            kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
    kwargs.update(options)
    return kwargs


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
