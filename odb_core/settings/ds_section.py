"""The `odb` section of a DeepSpeed config, read for `odb_deepspeed.initialize` and odb_hf (both adapters read it,
so it lives in the core; it only handles plain dicts and files).

    {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
     "odb": {"enabled": true, "token_budget": 16384, "shuffle": true, "num_workers": 2}}

Allowed keys: `enabled` (required bool), `token_budget` (required, also in a disabled section), every other
`ODBConfig` field except `accumulation_steps` (DeepSpeed's `gradient_accumulation_steps` is its one source: pass it
to `ODBSettings.derive`), the loader options `shuffle` and `num_workers` (`ODBSettings.extras`; False and 0
when unset), and `epochs`, the number of epochs the training loop will run, from which `odb_deepspeed.initialize`
sets a `scheduler` section's `total_num_steps` to the exact plan (NOTE [ Exact DeepSpeed schedule ]). The section
is parsed by `odb_core.settings.settings.read_settings` with `DEEPSPEED_SECTION`: an unknown key raises `ValueError` naming
it, its closest match and the allowed keys; a bad value raises `ODBConfig`'s own error with the key as written
(`odb.cost='flops' is invalid: ...`). This module does not import deepspeed.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from odb_core.settings.settings import BOOL, COUNT, ODBSettings, SettingsSource, read_settings

SECTION = "odb"
DEEPSPEED_SECTION = SettingsSource(
    where="the DeepSpeed config's 'odb' section", shown="odb.", switch="enabled", budget="always",
    refused={"accumulation_steps": "is not allowed: the loader takes DeepSpeed's gradient_accumulation_steps, so "
                                   "that both always agree"},
    keys={"shuffle": BOOL, "num_workers": COUNT, "epochs": COUNT})
ALLOWED_KEYS = DEEPSPEED_SECTION.allowed_keys


def load_ds_config(ds_config: Any) -> dict[str, Any]:
    """A DeepSpeed config as a dict (a copy): from a mapping, a JSON/HJSON file path, or a base64 JSON string,
    the forms `deepspeed.initialize(config=...)` accepts."""
    if isinstance(ds_config, Mapping):
        return dict(ds_config)
    if not isinstance(ds_config, str | os.PathLike):
        raise TypeError(f"a DeepSpeed config must be a dict or a path, got {type(ds_config).__name__}")
    if os.path.exists(ds_config):
        with open(ds_config) as handle:
            text = handle.read()
    else:
        try:
            text = base64.urlsafe_b64decode(str(ds_config)).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"DeepSpeed config {str(ds_config)!r} is neither an existing file nor base64") from exc
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        try:
            import hjson  # DeepSpeed's own config reader (comments, unquoted keys); installed with deepspeed
        except ImportError:
            raise ValueError(f"DeepSpeed config {str(ds_config)!r} is not valid JSON ({exc}); HJSON needs the "
                             "hjson package, which deepspeed installs") from exc
        loaded = hjson.loads(text)
    if not isinstance(loaded, Mapping):
        raise ValueError(f"DeepSpeed config {str(ds_config)!r} must hold a JSON object")
    return dict(loaded)


@dataclass(frozen=True, slots=True)
class SplitConfig:
    """A DeepSpeed config taken apart: DeepSpeed's own keys (a copy), and its validated `odb` section."""

    deepspeed: dict[str, Any]
    odb: ODBSettings | None  # None: the config has no `odb` section


def split_ds_config(ds_config: Any) -> SplitConfig:
    """Load a DeepSpeed config (dict or path) once and validate its `odb` section (see `parse_odb_section`)."""
    config = load_ds_config(ds_config)
    section = config.pop(SECTION, None)
    if section is not None and not isinstance(section, Mapping):
        raise ValueError(f"the DeepSpeed config's 'odb' section must be an object, got {section!r}")
    settings = read_settings(section, DEEPSPEED_SECTION) if section is not None else None
    if settings is not None and settings.enabled:
        _check_engine_keys(config, settings)
    return SplitConfig(deepspeed=config, odb=settings)


def _check_engine_keys(config: Mapping[str, Any], settings: ODBSettings) -> None:
    """DeepSpeed keys that ODB's loss weighting cannot run with, refused before DeepSpeed starts.
      * `managed_gradient_accumulation: false` makes every `engine.step()` an optimizer step, where ODB's loop
        (and the HF Trainer's) calls it once per micro-batch and scales each micro-batch by its whole window's
        tokens: each optimizer step then took one micro-batch's share of the window's gradient, with no error.
      * a step target (`samples_per_step`, `tokens_per_step`) with `gradient_accumulation_steps` > 1: the target
        sets each step's micro-batches; before, this failed only after the engine was built, naming a key the
        section refuses. A G derived from `train_batch_size` is caught there, with the same message."""
    if config.get("managed_gradient_accumulation") is False:
        raise ValueError("managed_gradient_accumulation=false in the DeepSpeed config is not supported with odb: "
                         "odb calls engine.step() once per micro-batch and weights each by its optimizer step's "
                         "tokens, so every micro-batch would become an optimizer step; remove the key")
    accumulation = config.get("gradient_accumulation_steps", 1)
    if settings.config is not None and settings.config.step_target is not None and accumulation not in (1, "auto"):
        raise ValueError(step_target_with_accumulation(settings.config.step_target, accumulation))


def step_target_with_accumulation(target: tuple[str, int], accumulation: Any) -> str:
    """The refusal of a step target (`ODBConfig.step_target`) beside DeepSpeed's gradient accumulation, naming
    DeepSpeed's own keys."""
    unit, amount = target
    return (f"odb.{unit}_per_step={amount} sets how many micro-batches each optimizer step holds, but DeepSpeed's "
            f"gradient accumulation is {accumulation}: set gradient_accumulation_steps to 1 in the DeepSpeed config "
            "(and train_batch_size to train_micro_batch_size_per_gpu x the data-parallel world size, or leave it out)")


def parse_odb_section(ds_config: Any) -> ODBSettings | None:
    """Validate the `odb` section of a DeepSpeed config (dict or path); None when the config has none.

    Raises `ValueError` for a missing or non-bool `enabled`, an unknown key, a missing `token_budget` or any
    value `ODBConfig` rejects; a disabled section is validated too, so a typo never hides.
    """
    return split_ds_config(ds_config).odb


def without_odb_section(ds_config: Any) -> dict[str, Any]:
    """A copy of the config without the `odb` section (the caller's dict is not modified)."""
    config = load_ds_config(ds_config)
    config.pop(SECTION, None)
    return config
