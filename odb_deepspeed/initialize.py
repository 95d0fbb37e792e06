"""`odb_deepspeed.initialize`: `deepspeed.initialize` with an ODB training dataloader, switched on by the config.

Without an enabled `odb` section every argument goes to `deepspeed.initialize` untouched and its result comes
back as is. With `"odb": {"enabled": true, ...}`:
  1. the section is validated before DeepSpeed starts (`odb_core.settings.ds_section.split_ds_config`), into one
     `ODBConfig` (`ODBSettings.config`);
  2. DeepSpeed gets a copy of the config *without* the section (DeepSpeed ignores unknown keys today; removing
     it keeps `engine.config` DeepSpeed's own and survives a stricter DeepSpeed), and no `training_data`;
  3. the ODB loader is built from `training_data` (a dataset, with `collate_fn`) with that config and
     `accumulation_steps` = the engine's `gradient_accumulation_steps()` (`ODBSettings.derive`), or checked
     against them if it already is an `ODBDataLoader`;
  4. with `odb.epochs`, a decaying scheduler's `total_num_steps` becomes the exact optimizer-step count of those
     epochs (NOTE [ Exact DeepSpeed schedule ]);
  5. it returns `(engine, optimizer, DeepSpeedODBLoader, lr_scheduler)`, the engine with ODB's loss weighting and
     checks mixed in (NOTE [ The plain DeepSpeed loop under ODB ] in engine_mixin.py), and logs "odb: on, ..." on rank 0.
Cost: one Gloo group for ODB's metadata (created collectively, so call this on every rank in the same order).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

from odb_core import ODBDataLoader
from odb_core.settings.console import announce
from odb_core.settings.ds_section import load_ds_config, split_ds_config, step_target_with_accumulation
from odb_core.settings.settings import ODBSettings
from odb_deepspeed.accounting import DeepSpeedODBLoader
from odb_deepspeed.engine_mixin import mix_into

DEFAULT_PORT = 29500  # deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT
LAST_STEP_OFFSET = {"WarmupDecayLR": -1, "WarmupCosineLR": 0}  # NOTE [ Exact DeepSpeed schedule ]


def _resolve_config(args: Any, config: Any, config_params: Any) -> Any:
    """The config `deepspeed.initialize` would use (same precedence), or None when there is none."""
    if config is None and config_params is not None:
        config = config_params
    if config is None:  # DeepSpeed still reads the deprecated `deepscale_config` too
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    return config


def _load_or_none(config: Any) -> dict[str, Any] | None:
    """The config as a dict; None when there is none or it is unreadable (DeepSpeed then reports it itself)."""
    if config is None:
        return None
    try:
        return load_ds_config(config)
    except (TypeError, ValueError):
        return None


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = DEFAULT_PORT,
               mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None) -> tuple:
    """Drop-in for `deepspeed.initialize` (same arguments and return values); see the module docstring.

    Every ODB check (the `odb` section, `training_data`) runs before DeepSpeed is imported or started.
    """
    passthrough = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                       lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
                       dist_init_required=dist_init_required, mesh_param=mesh_param)
    loaded = _load_or_none(_resolve_config(args, config, config_params))
    split = split_ds_config(loaded) if loaded is not None else None  # validates the odb section
    section = split.odb if split is not None else None
    if section is not None and section.enabled:
        _check_data(training_data, collate_fn)
    import deepspeed  # here, not at module level: the config parsing stays importable without deepspeed

    if section is None or not section.enabled:
        return deepspeed.initialize(**passthrough, training_data=training_data, collate_fn=collate_fn,
                                    config=config, config_params=config_params)
    if isinstance(model, deepspeed.PipelineModule):
        raise NotImplementedError("odb with pipeline parallelism is not supported: PipelineEngine.train_batch "
                                  "draws fixed-size micro-batches itself")
    if config is None and config_params is None and _resolve_config(args, None, None) is not None:
        passthrough["args"] = copy.copy(args)  # the config came from args; DeepSpeed refuses it next to config=
        for name in ("deepspeed_config", "deepscale_config"):
            if hasattr(args, name):
                setattr(passthrough["args"], name, None)
    engine, optimizer, _, scheduler = deepspeed.initialize(**passthrough, config=split.deepspeed)
    loader = _build_loader(training_data, section, engine, collate_fn)
    if "epochs" in section.extras:
        fit_schedule(scheduler, loader, section.extras["epochs"])
    announce(loader, "DeepSpeed")
    return mix_into(engine), optimizer, DeepSpeedODBLoader(loader, engine), scheduler


def fit_schedule(scheduler: Any, loader: ODBDataLoader, epochs: int) -> int:
    """NOTE [ Exact DeepSpeed schedule ]
    DeepSpeed's decaying schedulers (`WarmupDecayLR`, `WarmupCosineLR`) end at their `total_num_steps`, a count the
    config must give before training, while ODB's optimizer-step count is known only from the data. With
    `"odb": {"epochs": E}` this plans the E epochs exactly (`ODBDataLoader.plan_epochs_exactly`: every rank reads
    each sample's length once, the loader's own round code, the same count on every rank) and sets the scheduler's
    `total_num_steps` to their optimizer steps, so the LR reaches its end value at the last step. A config without
    a scheduler, or one of another type, is refused: `epochs` would change nothing. The two types count
    differently (measured on DeepSpeed 0.19): WarmupCosineLR is at its end value after `total_num_steps` scheduler
    steps, WarmupDecayLR one step later (its decay reaches 0 at iteration `total_num_steps`, and the first step is
    iteration 0), so for T optimizer steps WarmupDecayLR gets T - 1, and both end exactly after the last step.
    Returns the value set. Collective: every rank calls it (from `initialize`)."""
    name = type(scheduler).__name__
    if name not in LAST_STEP_OFFSET:
        kind = "no scheduler" if scheduler is None else f"a {name} scheduler, which has no total_num_steps"
        raise ValueError(f"odb.epochs={epochs} sets the scheduler's total_num_steps, but the DeepSpeed config has "
                         f"{kind}; use a scheduler section of type WarmupDecayLR or WarmupCosineLR, or drop "
                         "odb.epochs")
    steps = sum(loader.plan_epochs_exactly(range(epochs)).optimizer_steps)
    scheduler.total_num_steps = max(steps + LAST_STEP_OFFSET[name], 1)
    return scheduler.total_num_steps


def _check_data(training_data: Any, collate_fn: Callable | None) -> None:
    if training_data is None:
        raise ValueError("odb.enabled is true but training_data is None: pass your dataset (or an "
                         "ODBDataLoader) as training_data, or set odb.enabled to false")
    if isinstance(training_data, DataLoader):
        raise TypeError("training_data is a torch DataLoader; odb replaces its fixed batch_size with the token "
                        "budget, so pass its dataset (training_data=loader.dataset, collate_fn=loader.collate_fn) "
                        "or your own ODBDataLoader")
    if isinstance(training_data, ODBDataLoader) and collate_fn is not None:
        raise ValueError("collate_fn= was given with a ready ODBDataLoader; pass it to ODBDataLoader instead")


def _build_loader(training_data: Any, section: ODBSettings, engine: Any, collate_fn: Callable | None) -> ODBDataLoader:
    accumulation = engine.gradient_accumulation_steps()  # derived from train_batch_size where not given
    if section.config.step_target is not None and accumulation != 1:
        raise ValueError(step_target_with_accumulation(section.config.step_target, accumulation))
    config = section.derive(accumulation_steps=accumulation)
    if engine.sequence_parallel_size != 1:
        raise NotImplementedError("odb with sequence parallelism is not supported (ranks of one sequence-parallel "
                                  "group must see the same batch)")
    if isinstance(training_data, ODBDataLoader):
        _check_user_loader(training_data, section, config.accumulation_steps)
        loader = training_data
    else:
        loader = ODBDataLoader(training_data, config=config, collate_fn=collate_fn,
                               shuffle=section.extras.get("shuffle", False),
                               num_workers=section.extras.get("num_workers", 0))
    if loader.transport.world_size != engine.dp_world_size:
        raise ValueError(f"the ODB loader spans {loader.transport.world_size} ranks but DeepSpeed's data-parallel "
                         f"group has {engine.dp_world_size}; with model parallelism pass an ODBDataLoader whose "
                         "transport spans the data-parallel group")
    return loader


def _check_user_loader(loader: ODBDataLoader, section: ODBSettings, accumulation: int) -> None:
    """A ready loader must agree with the config: never silently prefer one over the other."""
    if loader.config.accumulation_steps != accumulation:
        raise ValueError(f"your ODBDataLoader has accumulation_steps={loader.config.accumulation_steps} but the "
                         f"engine's gradient_accumulation_steps is {accumulation}; they must be equal")
    for key, value in section.given.items():
        if getattr(loader.config, key) != value:
            raise ValueError(f"odb.{key}={value!r} in the DeepSpeed config but your ODBDataLoader has "
                             f"{key}={getattr(loader.config, key)!r}; keep one of them")
    builder_only = sorted(set(section.extras) & {"shuffle", "num_workers"})  # `epochs` applies to any loader
    if builder_only:
        raise ValueError(f"{', '.join('odb.' + key for key in builder_only)}: set on your ODBDataLoader instead (the "
                         "section's loader options apply only when odb_deepspeed builds the loader)")
