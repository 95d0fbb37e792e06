"""The `odb*` keys of a LLaMA-Factory config: removed from the config, validated, and checked against it.

    odb: true                 # required once any odb_* key is present; false keeps the keys but trains without ODB
    odb_token_budget: 8192    # required when odb is true (ODBConfig.token_budget)
    odb_join: true            # any other ODBConfig field as odb_<field>, e.g. odb_cost, odb_window, odb_max_batch_size
    odb_length_slack: 0.25    # ODBCallback's estimate_sample_size / length_slack

LLaMA-Factory's parser rejects keys it does not know, so they must be gone before it runs. Settings that have
a LLaMA-Factory/Trainer source keep that one source (one name per concept): gradient_accumulation_steps,
seed/data_seed, disable_shuffling, dataloader_num_workers. `odb_max_patches` is refused: it could not act here
(NO_EFFECT says why). This module imports only odb_core.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields
from typing import Any

from odb_core.config import ODBConfig

PREFIX = "odb_"
SWITCH = "odb"
OWNED_ELSEWHERE = {"accumulation_steps": "gradient_accumulation_steps", "seed": "seed (or data_seed)",
                   "shuffle": "disable_shuffling", "num_workers": "dataloader_num_workers",
                   "collate_fn": "the template (LLaMA-Factory builds the collator)"}
NO_EFFECT = {"max_patches": "LLaMA-Factory's samples hold image paths and its collator computes pixel_values only "
                            "after ODB has grouped them, so ODB sees no patches to cap. The template expands each "
                            "image into its visual tokens in input_ids, so odb_token_budget counts them already"}
CONFIG_KEYS = tuple(f.name for f in fields(ODBConfig) if f.name not in OWNED_ELSEWHERE and f.name not in NO_EFFECT)
CALLBACK_KEYS = ("estimate_sample_size", "length_slack")
ALLOWED_KEYS = (SWITCH, *(PREFIX + k for k in CONFIG_KEYS + CALLBACK_KEYS))


class ODBConfigError(ValueError):
    """An `odb*` key, or a LLaMA-Factory setting combined with `odb: true`, that ODB cannot run with."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ODBSettings:
    """Validated `odb*` keys. `config` holds the ODBConfig fields set (token_budget included)."""

    enabled: bool
    config: Mapping[str, Any]
    callback: Mapping[str, Any]

    @property
    def token_budget(self) -> int:
        return self.config["token_budget"]


def _unknown_key_error(key: str) -> ODBConfigError:
    field = key.removeprefix(PREFIX)
    if field in OWNED_ELSEWHERE:
        return ODBConfigError(f"{key} is not an odb key: LLaMA-Factory's {OWNED_ELSEWHERE[field]} sets it, so that "
                              "both always agree; remove it")
    if field in NO_EFFECT:
        return ODBConfigError(f"{key} would have no effect under LLaMA-Factory: {NO_EFFECT[field]}; remove it")
    close = difflib.get_close_matches(key, ALLOWED_KEYS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ODBConfigError(f"unknown key {key!r}{hint}; the allowed odb keys are {list(ALLOWED_KEYS)}")


def pop_odb_settings(config: MutableMapping[str, Any]) -> ODBSettings | None:
    """Remove every `odb` / `odb_*` key from `config` (a LLaMA-Factory argument dict) and validate them.

    Returns None when the config has none. A config with `odb: false` is validated too, so a typo never hides.
    Raises `ODBConfigError` naming the key, the value and the allowed keys or range.
    """
    keys = [k for k in config if k == SWITCH or str(k).startswith(PREFIX)]
    if not keys:
        return None
    raw = {k: config.pop(k) for k in keys}
    for key in raw:
        if key not in ALLOWED_KEYS:
            raise _unknown_key_error(key)
    if SWITCH not in raw:
        raise ODBConfigError(f"{sorted(raw)} given without 'odb': add odb: true to train with ODB "
                             "(or odb: false to keep the settings and train without it)")
    if not isinstance(raw[SWITCH], bool):
        raise ODBConfigError(f"odb={raw[SWITCH]!r} is invalid: set it to true or false")
    values = {k.removeprefix(PREFIX): v for k, v in raw.items() if k != SWITCH}
    if raw[SWITCH] and "token_budget" not in values:
        raise ODBConfigError("odb_token_budget is required with odb: true: the token budget of one micro-batch "
                             "on one rank, e.g. odb_token_budget: 8192")
    config_values = {k: v for k, v in values.items() if k in CONFIG_KEYS}
    try:  # with odb: false and no budget, a placeholder budget lets the other values be checked
        ODBConfig(**{"token_budget": 1, **config_values})
    except ValueError as exc:
        raise ODBConfigError(PREFIX + str(exc).removeprefix("ODBConfig.")) from exc
    callback = {k: v for k, v in values.items() if k in CALLBACK_KEYS}
    _check_callback_values(callback)
    return ODBSettings(enabled=raw[SWITCH], config=config_values, callback=callback)


def _check_callback_values(callback: Mapping[str, Any]) -> None:
    size = callback.get("estimate_sample_size", 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ODBConfigError(f"odb_estimate_sample_size={size!r} is invalid: it must be an int >= 1")
    slack = callback.get("length_slack", 0.0)
    if not isinstance(slack, int | float) or isinstance(slack, bool) or slack < 0:
        raise ODBConfigError(f"odb_length_slack={slack!r} is invalid: it must be a number >= 0")


def check_compatible(config: Mapping[str, Any], settings: ODBSettings) -> None:
    """Refuse LLaMA-Factory settings that ODB cannot honour (config is the dict without odb keys)."""
    stage = config.get("stage", "sft")
    if stage != "sft":
        raise ODBConfigError(f"odb: true supports stage: sft only (got stage: {stage}); ODB's exact loss and "
                             "batching are wired into LLaMA-Factory's SFT trainer")
    for key in ("use_mca", "use_hyper_parallel", "use_ray"):
        if config.get(key):
            raise ODBConfigError(f"{key}: true conflicts with odb: true: that path trains outside the SFT Trainer "
                                 "that ODB plugs into, so ODB would silently not apply")
    for key in ("packing", "neat_packing"):
        if config.get(key):
            raise ODBConfigError(f"{key}: true conflicts with odb: true. Packing concatenates samples into fixed "
                                 "cutoff_len blocks before batching, so ODB would only see equal-length blocks; "
                                 "use one or the other (ODB batches unpacked samples under odb_token_budget)")
    if config.get("use_asft_loss"):
        raise ODBConfigError("use_asft_loss: true conflicts with odb: true: its loss is a per-batch mean that "
                             "ODB cannot weight by the step's tokens")
    if config.get("disable_shuffling") and config.get("train_sampling_strategy", "sequential") != "sequential":
        raise ODBConfigError(f"disable_shuffling: true contradicts train_sampling_strategy: "
                             f"{config['train_sampling_strategy']}; keep one of them")
    cutoff = config.get("cutoff_len", 2048)  # LLaMA-Factory's default
    if isinstance(cutoff, int) and cutoff > settings.token_budget:
        policy = settings.config.get("oversize", "alone")
        warnings.warn(f"odb_token_budget={settings.token_budget} is below cutoff_len={cutoff}: a sample longer than "
                      f"the budget {'runs alone in its own micro-batch' if policy == 'alone' else 'raises'} "
                      f"(odb_oversize: {policy})", stacklevel=2)
