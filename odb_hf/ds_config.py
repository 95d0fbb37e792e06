"""The `odb` section of `TrainingArguments.deepspeed`: the config path of `odb_deepspeed.initialize`, in the Trainer.

NOTE [ One DeepSpeed config for both adapters ]
The Trainer hands `TrainingArguments.deepspeed` (a path or a dict) to `deepspeed.initialize` itself, `odb` section
included: `HfTrainerDeepSpeedConfig` only fills "auto" values and DeepSpeed 0.19.8 accepts unknown top-level keys
silently. So the section alone does nothing under the Trainer; an `ODBCallback` reads it when it attaches, with
`odb_core.ds_section.parse_odb_section` (the parser `odb_deepspeed` uses):
  * a bad section (unknown key, bad value, no `enabled`) raises when the Trainer is built, whatever the callback;
  * `ODBCallback.from_deepspeed_config(args)` takes its settings from the section; `ODBCallback(token_budget=...)`
    adds the section's settings it leaves unset; a setting given in both must be equal, or it raises;
  * `odb.shuffle` / `odb.num_workers` must agree with `train_sampling_strategy` / `dataloader_num_workers`, from
    which the loader is built; a difference raises (neither side silently wins);
  * `"enabled": false` turns ODB off, with a warning, for a callback built from a config with `enabled: false`.
    An explicit `ODBCallback(token_budget=...)` or an ODB trainer class asks for ODB, and `enabled` must agree.
The exact loss needs no change under DeepSpeed: see NOTE [ Exact loss under the HF Trainer ] in trainer.py;
`engine.backward(loss, scale_wrt_gas=False)` replaces DDP's backward and DeepSpeed's "mean" reduction DDP's average.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from odb_core.ds_section import ODBSection, parse_odb_section
from odb_hf.arguments import ODBSetupError
from odb_hf.trainer import ODBTrainerMixin

logger = logging.getLogger(__name__)


def read_section(source: Any) -> ODBSection | None:
    """The validated `odb` section of `source` (TrainingArguments, a DeepSpeed config dict or path); None if none."""
    config = source.deepspeed if isinstance(source, TrainingArguments) else source
    if config is None:
        return None
    try:
        return parse_odb_section(config)
    except (TypeError, ValueError) as exc:
        where = "TrainingArguments.deepspeed" if isinstance(source, TrainingArguments) else "the DeepSpeed config"
        raise ODBSetupError(f"{where}: {exc}") from exc


def merge_settings(token_budget: int, options: Mapping[str, Any], section: ODBSection) -> dict[str, Any]:
    """`options` plus the section's ODB settings that the callback leaves unset; a setting in both must agree."""
    mine = {"token_budget": token_budget, **options}
    clashes = {k: (mine[k], v) for k, v in section.config.items() if k in mine and mine[k] != v}
    if clashes:
        detail = "; ".join(f"{k}={a!r} in ODBCallback but odb.{k}={b!r} in the DeepSpeed config"
                           for k, (a, b) in sorted(clashes.items()))
        raise ODBSetupError(f"{detail}: set each in one place (ODBCallback.from_deepspeed_config(args) takes "
                            "them from the config)")
    return {**{k: v for k, v in section.config.items() if k != "token_budget"}, **options}


@dataclass(frozen=True, slots=True)
class SectionCallback:
    """`ODBCallback` arguments read from an `odb` section, and whether the section turns ODB on."""

    enabled: bool
    kwargs: dict[str, Any]


def callback_arguments(source: Any, kwargs: Mapping[str, Any]) -> SectionCallback:
    """For `ODBCallback.from_deepspeed_config`: the section's settings plus `kwargs` (a setting in both must agree)."""
    section = read_section(source)
    if section is None:
        where = "TrainingArguments.deepspeed" if isinstance(source, TrainingArguments) else "the DeepSpeed config"
        raise ODBSetupError(f"{where} has no 'odb' section: add \"odb\": {{\"enabled\": true, \"token_budget\": "
                            "...} or use ODBCallback(token_budget=...)")
    options = dict(kwargs)
    budget = options.pop("token_budget", section.config["token_budget"])
    own = {k: options.pop(k) for k in ("estimate_sample_size", "length_slack") if k in options}
    merged = merge_settings(budget, options, section)
    return SectionCallback(enabled=section.enabled, kwargs={"token_budget": budget, **own, **merged})


def check_loader_options(args: TrainingArguments, section: ODBSection) -> None:
    """`odb.shuffle` and `odb.num_workers` must say what the TrainingArguments say."""
    strategy = getattr(args, "train_sampling_strategy", "random")
    if section.shuffle is not None and section.shuffle != (strategy != "sequential"):
        raise ODBSetupError(f"odb.shuffle={str(section.shuffle).lower()} in the DeepSpeed config but "
                            f"TrainingArguments.train_sampling_strategy={strategy!r}; make them agree ('random' "
                            "shuffles, 'sequential' does not) or drop odb.shuffle")
    if section.num_workers is not None and section.num_workers != args.dataloader_num_workers:
        raise ODBSetupError(f"odb.num_workers={section.num_workers} in the DeepSpeed config but "
                            f"TrainingArguments.dataloader_num_workers={args.dataloader_num_workers}; make them "
                            "agree or drop odb.num_workers")


def resolve(callback: Any, trainer: Trainer) -> bool:
    """Check `callback` against the Trainer's `odb` section and complete its options; False: ODB is off."""
    section = read_section(trainer.args)
    if section is not None and section.enabled != callback.enabled:
        asked = "asks for ODB" if callback.enabled else "comes from a config with odb.enabled=false"
        raise ODBSetupError(f"odb.enabled={str(section.enabled).lower()} in TrainingArguments.deepspeed, but the "
                            f"ODBCallback {asked}; build it with ODBCallback.from_deepspeed_config(args) so "
                            "that the config decides, or change odb.enabled")
    if not callback.enabled and isinstance(trainer, ODBTrainerMixin):
        raise ODBSetupError(f"{type(trainer).__name__} mixes in ODB but the ODBCallback comes from a config with "
                            "odb.enabled=false; use the plain Trainer class or set odb.enabled to true")
    if not callback.enabled:
        logger.warning("ODB is off: odb.enabled is false in the DeepSpeed config; the Trainer uses its own "
                       "data loader, batch size and loss")
        return False
    if section is not None:
        callback.options = merge_settings(callback.token_budget, callback.options, section)
        check_loader_options(trainer.args, section)
    check_process_count(trainer.accelerator.num_processes)
    return True


def check_process_count(trainer_processes: int) -> None:
    """The Trainer's process count must be torch.distributed's: ODB shards over the latter, the loss uses the former.

    Under DeepSpeed on a machine without a GPU, accelerate 1.16 finds no device backend unless use_cpu=True: it
    then counts 1 process (index 0) on every rank while DeepSpeed runs W, so the loss would be W times too small.
    """
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if ranks != trainer_processes:
        raise ODBSetupError(f"the Trainer counts {trainer_processes} process(es) but torch.distributed runs {ranks} "
                            "ranks, so ODB's loss scale would be wrong; on a machine without a GPU, pass "
                            "TrainingArguments(use_cpu=True): accelerate then runs gloo on every rank and the "
                            "Trainer still uses DeepSpeed (see docs/guides/hf-trainer.md)")


def check_engine(trainer: Trainer) -> None:
    """At train begin: DeepSpeed must average gradients over ranks, as DDP does (the loss is scaled by W for it)."""
    engine = trainer.model_wrapped
    if trainer.is_deepspeed_enabled and not getattr(engine, "gradient_average", True):
        raise ODBSetupError("the DeepSpeed config sets gradient_allreduce_op='sum', but the Trainer's token-weighted "
                            "loss (x number of processes) assumes averaged gradients: remove gradient_allreduce_op "
                            "or set it to 'mean'")
