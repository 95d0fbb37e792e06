"""The Trainer's side of ODB's settings: what `ODBCallback` takes, how the Trainer completes it, what it refuses.

`CALLBACK` is the `odb_core.settings.settings` source of `ODBCallback(**options)`: ODBConfig fields, the epoch-length keys
and the loader arguments it passes on; the settings that the Trainer already holds are refused (`DERIVED`).
`build_loader` completes the callback's `ODBConfig` with what the Trainer derives (`ODBSettings.derive`:
gradient accumulation, and the seed unless the user set one). Nothing here changes a user setting: a setting ODB
makes meaningless gets a warning, one that would make the run wrong (or hang) raises `ODBSetupError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainingArguments

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
OWNED_METHODS = ("get_train_dataloader", "_get_train_sampler")


def _default(name: str) -> Any:
    return next(f.default for f in fields(TrainingArguments) if f.name == name)


def check_trainer(trainer: Trainer) -> None:
    """Refuse Trainer classes and arguments that conflict with ODB (called when ODB attaches)."""
    for name in OWNED_METHODS:
        owner = next(c for c in type(trainer).__mro__ if name in vars(c))
        if owner is not Trainer and not vars(owner).get("odb_owns_data", False):
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
    if getattr(args, "packing", False):  # TRL's SFTConfig
        raise ODBSetupError("SFTConfig(packing=True) packs samples into fixed max_length rows before batching, so "
                            "ODB would only batch equal rows and its gain is gone: set packing=False and let ODB "
                            "batch the samples (padding_free=True with ODBCallback(cost='tokens') for a collator "
                            "without padding), or keep packing without ODB")
    if args.n_gpu > 1:
        raise ODBSetupError(f"n_gpu={args.n_gpu} means torch.nn.DataParallel; ODB aligns one process per "
                            "device: launch with torchrun / accelerate launch instead")
    if args.world_size > 1 and not args.average_tokens_across_devices:
        raise ODBSetupError("average_tokens_across_devices=False normalises each rank's loss by its own tokens; "
                            "ODB's exact loss divides by the step's tokens over all ranks: set it to True")
    check_process_count(trainer.accelerator.num_processes, deepspeed=args.deepspeed is not None)
    if args.per_device_train_batch_size != _default("per_device_train_batch_size") and not args.deepspeed:
        # (under DeepSpeed the Trainer requires it to equal train_micro_batch_size_per_gpu: set for that, not ODB)
        warnings.warn(f"per_device_train_batch_size={args.per_device_train_batch_size} is ignored: ODB sizes "
                      "each batch by ODBCallback(token_budget=...); use max_batch_size=... to cap samples",
                      stacklevel=4)
    if args.dataloader_drop_last:
        warnings.warn("dataloader_drop_last=True is ignored: ODB drops no sample (every rank drains its data)",
                      stacklevel=4)


def check_process_count(trainer_processes: int, deepspeed: bool) -> None:
    """The Trainer's process count must be torch.distributed's: ODB shards over the latter, the loss uses the former.

    On a machine without a GPU, accelerate 1.16 finds no device backend unless use_cpu=True: it counts 1 process
    (index 0) on every rank, so without DeepSpeed the Trainer sets up no DDP at all (every rank trains alone on all
    the data) and under DeepSpeed the loss would be W times too small.
    """
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if ranks == trainer_processes:
        return
    cause = ("the Trainer still runs DeepSpeed over the ranks but ODB's loss scale would be W times too small"
             if deepspeed else "transformers sets up no DDP: every rank would train alone, on all the data")
    raise ODBSetupError(f"the Trainer counts {trainer_processes} process(es) but torch.distributed runs {ranks} "
                        "ranks: on a machine without a GPU, accelerate finds no device backend unless "
                        f"TrainingArguments(use_cpu=True), so {cause}; pass use_cpu=True (accelerate then runs gloo on "
                        "every rank; see docs/guides/hf-trainer.md)")


def build_loader(args: TrainingArguments, dataset: Any, collate_fn: Any, settings: ODBSettings) -> ODBDataLoader:
    """The training loader: the settings' `ODBConfig` with the Trainer's accumulation (and seed, unless the user set
    one), the Trainer's sampling strategy, workers and collator, then the callback's own loader arguments."""
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
                             seed=args.data_seed if args.data_seed is not None else args.seed)
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
