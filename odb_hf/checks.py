"""Every refusal of odb_hf when ODB attaches to a Trainer and when training begins, in one place.

At attach, `check_attach` (called by `attach.attach_odb` before anything changes; NOTE [ Attaching ODB to a
Trainer ] in attach.py) runs, in this order:
  * the DeepSpeed `odb` section (NOTE [ One DeepSpeed config for both adapters ] in ds_config.py) against the
    callback: `enabled` must agree, and a section that turns ODB off refuses an ODB trainer class; with ODB on, a
    setting in both must be equal (`combine`) and the section's loader options must say what the
    TrainingArguments say;
  * the Trainer class: an override of a data method that ODB does not own (`ODBTrainerTraits.owns_data`), and a
    `compute_loss` above `ODBTrainerMixin`;
  * the TrainingArguments that conflict with ODB (raise) or that ODB makes meaningless (warn), and the process count.
At train begin, `check_training_start` (from `ODBCallback.on_train_begin`): DeepSpeed averages gradients, and the
model is wrapped for data parallelism. Each refusal is an `ODBSetupError` that names the setting and the fix;
nothing here changes a user setting.
"""

from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from odb_core.settings.settings import ODBSettings, combine
from odb_hf.arguments import ODBSetupError
from odb_hf.ds_config import read_section
from odb_hf.trainer import ODBTrainerMixin, ODBTrainerTraits

OWNED_METHODS = ("get_train_dataloader", "_get_train_sampler", "get_batch_samples")


def check_attach(trainer: Trainer, settings: ODBSettings) -> ODBSettings | None:
    """Every attach-time check (see above): the settings `trainer` runs with, the callback's `settings` completed by
    the `odb` section of its `TrainingArguments.deepspeed`; None when that section turns ODB off."""
    section = read_section(trainer.args)
    _check_switch(trainer, settings, section)
    if not settings.enabled:
        return None
    if section is not None:
        settings = combine(settings, section)
        _check_loader_options(trainer.args, section)
    _check_data_methods(type(trainer))
    _check_arguments(trainer)
    _check_loss_order(type(trainer))
    return settings


def _check_switch(trainer: Trainer, settings: ODBSettings, section: ODBSettings | None) -> None:
    """A DeepSpeed `odb.enabled` must agree with the callback; ODB off refuses an ODB trainer class."""
    if section is not None and section.enabled != settings.enabled:
        asked = "asks for ODB" if settings.enabled else "comes from a config with odb.enabled=false"
        raise ODBSetupError(f"odb.enabled={str(section.enabled).lower()} in TrainingArguments.deepspeed, but the "
                            f"ODBCallback {asked}; build it with ODBCallback.from_deepspeed_config(args) so "
                            "that the config decides, or change odb.enabled")
    if not settings.enabled and isinstance(trainer, ODBTrainerMixin):
        raise ODBSetupError(f"{type(trainer).__name__} mixes in ODB but the ODBCallback comes from a config with "
                            "odb.enabled=false; use the plain Trainer class or set odb.enabled to true")


def _check_loader_options(args: TrainingArguments, section: ODBSettings) -> None:
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


def _owns_data(trainer_class: type) -> bool:
    """Whether `trainer_class` declares, in its own body, that its data-method overrides are ODB's."""
    traits = vars(trainer_class).get("odb_traits")
    if traits is not None and not isinstance(traits, ODBTrainerTraits):
        raise ODBSetupError(f"{trainer_class.__name__}.odb_traits is a {type(traits).__name__}; declare it as "
                            "odb_hf.ODBTrainerTraits(...)")
    return traits is not None and traits.owns_data


def _check_data_methods(trainer_class: type) -> None:
    """ODB builds the training batches: an override of a data method it does not own would be silently bypassed."""
    for name in OWNED_METHODS:
        owner = next(c for c in trainer_class.__mro__ if name in vars(c))
        if owner is not Trainer and not _owns_data(owner):
            raise ODBSetupError(f"{owner.__name__}.{name} is overridden, but ODB builds the training batches "
                                "itself and would silently bypass it; remove the override (ODB shards, shuffles "
                                "and batches the data) or do not use ODB with this Trainer")


def _check_loss_order(trainer_class: type) -> None:
    """ODB checks the loss it gets from below (NOTE [ Exact loss under the HF Trainer ] in trainer.py)."""
    mro = trainer_class.__mro__
    if ODBTrainerMixin not in mro:
        return
    above = [c for c in mro[:mro.index(ODBTrainerMixin)] if "compute_loss" in vars(c)]
    if above:
        raise ODBSetupError(f"{above[0].__name__}.compute_loss is defined above ODBTrainerMixin in the MRO, so ODB "
                            "cannot check the loss it returns: move it into a base class that comes after "
                            "ODBTrainerMixin, or drop the mixin (ODBCallback alone puts ODB above your class)")


def _default(name: str) -> Any:
    return next(f.default for f in fields(TrainingArguments) if f.name == name)


def _check_data_parallel_only(trainer: Trainer) -> None:
    """Tensor, context or sequence parallelism (`TrainingArguments.parallelism_config`, a model loaded with a
    `tp_plan`): the ranks of one such group must see the same batch, and ODB gives every rank batches of its own
    (its shard, its plan); transformers also divides the step's token count by the non-data-parallel size, which
    ODB's count does not. Refused, as the DeepSpeed adapter refuses sequence parallelism."""
    config = getattr(trainer.args, "parallelism_config", None)
    sizes = {"tensor": getattr(trainer.model, "tp_size", None) or 1, "context": 1, "sequence": 1}
    if config is not None:
        sizes.update(tensor=max(sizes["tensor"], config.tp_size or 1), context=config.cp_size or 1,
                     sequence=config.sp_size or 1)
    for name, method in (("tensor", "get_tp_size"), ("context", "get_cp_size"), ("sequence", "get_sp_size")):
        get = getattr(trainer, method, None)  # the Trainer's own reading: the accelerator's config (`accelerate
        if callable(get):  # launch --parallelism_config_*`, an accelerate config file), DeepSpeed's AutoTP
            sizes[name] = max(sizes[name], int(get() or 1))
    used = {name: size for name, size in sizes.items() if size > 1}
    if used:
        described = ", ".join(f"{name} parallel size {size}" for name, size in used.items())
        raise ODBSetupError(f"ODB supports data parallelism only, and this run uses {described}: the ranks of one "
                            "such group must train on the same batch, while ODB gives every rank batches of its "
                            "own; train without it, or without ODB")


def _check_arguments(trainer: Trainer) -> None:
    """Refuse TrainingArguments that conflict with ODB; warn about those it makes meaningless."""
    args = trainer.args
    _check_data_parallel_only(trainer)
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
                      stacklevel=5)
    if args.dataloader_drop_last:
        warnings.warn("dataloader_drop_last=True is ignored: ODB drops no sample (every rank drains its data)",
                      stacklevel=5)


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


def check_training_start(trainer: Trainer) -> None:
    """At train begin, once the Trainer has wrapped the model: gradients are averaged over the ranks."""
    check_engine(trainer)
    if trainer.args.world_size > 1 and not trainer.is_fsdp_enabled and trainer.model_wrapped is trainer.model:
        raise ODBSetupError("the model is not wrapped for data-parallel training, so gradients would not be "
                            "synchronised across ranks (transformers skips the DDP wrap when "
                            "trainer.evaluate() ran before train()); evaluate after training or on another "
                            "Trainer instance")


def check_engine(trainer: Trainer) -> None:
    """DeepSpeed must average gradients over ranks, as DDP does (the loss is scaled by W for it)."""
    engine = trainer.model_wrapped
    if trainer.is_deepspeed_enabled and not getattr(engine, "gradient_average", True):
        raise ODBSetupError("the DeepSpeed config sets gradient_allreduce_op='sum', but the Trainer's token-weighted "
                            "loss (x number of processes) assumes averaged gradients: remove gradient_allreduce_op "
                            "or set it to 'mean'")
