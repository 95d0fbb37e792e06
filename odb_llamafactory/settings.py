"""The `odb*` keys of a LLaMA-Factory config: removed from the config, validated, and checked against it.

    odb: true                 # required once any odb_* key is present; false keeps the keys but trains without ODB
    odb_token_budget: 8192    # required when odb is true (ODBConfig.token_budget)
    odb_join: true            # any other ODBConfig field as odb_<field>, e.g. odb_cost, odb_window, odb_max_batch_size
    odb_length_slack: 0.25    # ODBCallback's estimate_sample_size / length_slack

LLaMA-Factory's parser rejects keys it does not know, so they must be gone before it runs. They are validated by
the core's settings parser (`odb_core.settings.settings.read_settings` with `LLAMAFACTORY` below) into `ODBSettings`, whose
`ODBConfig` the workflow hands to `ODBCallback.from_settings`. Settings that have a LLaMA-Factory/Trainer source
keep that one source (one name per concept): gradient_accumulation_steps, seed/data_seed, disable_shuffling,
dataloader_num_workers. `odb_max_patches` is refused: it could not act here (NO_EFFECT says why). This module
imports only odb_core.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from odb_core.settings.settings import EPOCH_LENGTH_KEYS, ODBSettings, SettingsSource, read_settings

PREFIX = "odb_"
SWITCH = "odb"
OWNED_ELSEWHERE = {"accumulation_steps": "gradient_accumulation_steps", "seed": "seed (or data_seed)",
                   "shuffle": "disable_shuffling", "num_workers": "dataloader_num_workers",
                   "collate_fn": "the template (LLaMA-Factory builds the collator)"}
NO_EFFECT = {"max_patches": "LLaMA-Factory's samples hold image paths and its collator computes pixel_values only "
                            "after ODB has grouped them, so ODB sees no patches to cap. The template expands each "
                            "image into its visual tokens in input_ids, so odb_token_budget counts them already"}


class ODBConfigError(ValueError):
    """An `odb*` key, or a LLaMA-Factory setting combined with `odb: true`, that ODB cannot run with."""


LLAMAFACTORY = SettingsSource(
    where="the LLaMA-Factory config", prefix=PREFIX, switch=SWITCH, keys=EPOCH_LENGTH_KEYS,
    refused={**{field: f"is not an odb key: LLaMA-Factory's {owner} sets it, so that both always agree; remove it"
                for field, owner in OWNED_ELSEWHERE.items()},
             **{field: f"would have no effect under LLaMA-Factory: {why}; remove it" for field, why in NO_EFFECT.items()}},
    error=ODBConfigError, key_error=ODBConfigError)
ALLOWED_KEYS = LLAMAFACTORY.allowed_keys


def env_enabled(env: Mapping[str, str], name: str, default: str = "0") -> bool:
    """An environment switch as LLaMA-Factory reads it (`llamafactory.extras.misc.is_env_enabled`)."""
    return env.get(name, default).lower() in ("true", "y", "1")


def pop_odb_settings(config: MutableMapping[str, Any]) -> ODBSettings | None:
    """Remove every `odb` / `odb_*` key from `config` (a LLaMA-Factory argument dict) and validate them.

    Returns None when the config has none. A config with `odb: false` is validated too, so a typo never hides.
    Raises `ODBConfigError` naming the key, the value and the allowed keys or range.
    """
    keys = [k for k in config if k == SWITCH or str(k).startswith(PREFIX)]
    if not keys:
        return None
    return read_settings({k: config.pop(k) for k in keys}, LLAMAFACTORY)


def check_compatible(config: Mapping[str, Any], settings: ODBSettings,
                     env: Mapping[str, str] | None = None) -> None:
    """Refuse LLaMA-Factory settings that ODB cannot honour (config is the dict without odb keys; settings enabled;
    `env`: the environment, `os.environ` by default)."""
    stage = config.get("stage", "sft")
    if stage != "sft":
        raise ODBConfigError(f"odb: true supports stage: sft only (got stage: {stage}); ODB's exact loss and "
                             "batching are wired into LLaMA-Factory's SFT trainer")
    env = os.environ if env is None else env
    # LLaMA-Factory 0.9.5 takes Ray and MCA from USE_RAY / USE_MCA (`hparams/parser.py`, `training_args.py`): a
    # `use_mca` key without USE_MCA=1 is reset to false there, and `use_ray` is no config key at all
    for variable in ("USE_RAY", "USE_MCA"):
        if env_enabled(env, variable):
            raise ODBConfigError(f"{variable}=1 conflicts with odb: true: that path trains outside the SFT Trainer "
                                 "that ODB plugs into, so ODB would silently not apply")
    if config.get("use_hyper_parallel"):
        raise ODBConfigError("use_hyper_parallel: true conflicts with odb: true: that path trains outside the SFT "
                             "Trainer that ODB plugs into, so ODB would silently not apply")
    for key in ("packing", "neat_packing"):
        if config.get(key):
            raise ODBConfigError(f"{key}: true conflicts with odb: true. Packing concatenates samples into fixed "
                                 "cutoff_len blocks before batching, so ODB would only see equal-length blocks; "
                                 "use one or the other (ODB batches unpacked samples under odb_token_budget)")
    if config.get("use_asft_loss"):
        raise ODBConfigError("use_asft_loss: true conflicts with odb: true: its loss is a per-batch mean that "
                             "ODB cannot weight by the step's tokens")
    for key in ("use_dft_loss", "use_eaft_loss"):  # a review ran the crash on 2 ranks (use_dft_loss)
        if config.get(key):
            raise ODBConfigError(f"{key}: true conflicts with odb: true: on a micro-batch without supervised tokens "
                                 "(ODB's IDLE steps, which keep the ranks in step) its loss is a constant with no "
                                 "gradient, and the backward pass fails")
    layerwise = [f"{name}_layerwise" for name in ("galore", "apollo")  # only under use_galore / use_apollo
                 if config.get(f"use_{name}") and config.get(f"{name}_layerwise")]
    if layerwise and settings.config is not None and settings.config.step_target is not None:
        raise ODBConfigError(f"{layerwise[0]}: true conflicts with odb_samples_per_step / odb_tokens_per_step: its "
                             "hooks step the optimizer and the LR scheduler at every backward pass, and a step "
                             "target runs several per optimizer step; drop the step target or the layer-wise mode")
    if config.get("disable_shuffling") and config.get("train_sampling_strategy", "sequential") != "sequential":
        raise ODBConfigError(f"disable_shuffling: true contradicts train_sampling_strategy: "
                             f"{config['train_sampling_strategy']}; keep one of them")
    if config.get("streaming"):
        check_streaming(config)
    # a cutoff_len above odb_token_budget is not refused or warned about here: the loader warns once when a
    # sample does run alone over the budget (odb_core NOTE [ Samples over the budget ]), as in every adapter


def check_streaming(config: Mapping[str, Any]) -> None:
    """`streaming: true` in LLaMA-Factory 0.9.5 (`llamafactory/data/loader.py`): a dataset loaded from a local file
    becomes `dataloader_num_workers` stream shards, each read by one worker (odb_core NOTE [ Streams that split
    themselves over workers ]), so 0 workers give it no shard; hub and script datasets stream by themselves.
    `max_samples` LLaMA-Factory refuses itself (`hparams/data_args.py`); said here before any model loads."""
    local = local_file_datasets(config)
    if config.get("dataloader_num_workers", 0) == 0 and local:
        raise ODBConfigError(f"streaming: true needs dataloader_num_workers: 1 or more for {', '.join(local)}: "
                             "LLaMA-Factory 0.9.5 splits a local dataset file into dataloader_num_workers stream "
                             "shards, so 0 gives an empty stream (it fails in align_dataset with StopIteration, "
                             "with or without ODB)")
    if config.get("max_samples") is not None:
        raise ODBConfigError("max_samples does not work with streaming: true (LLaMA-Factory refuses the pair); "
                             "remove max_samples, or set streaming: false")


def _names(value: Any) -> list[str]:
    """A `dataset` / `eval_dataset` value's names: a comma-separated string or a list."""
    if not value:
        return []
    return [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n) for n in value]


def local_file_datasets(config: Mapping[str, Any]) -> list[str]:
    """The training and evaluation datasets LLaMA-Factory 0.9.5 loads from local files (`data/parser.py`: an entry of
    `dataset_dir`/dataset_info.json with no hub, script or cloud address); none when that file is not there (an
    online `dataset_dir`) or cannot be read, where LLaMA-Factory decides and says."""
    folder = config.get("dataset_dir", "data")
    names = [n for key in ("dataset", "eval_dataset") for n in _names(config.get(key))]
    if not names or not isinstance(folder, str):
        return []
    try:
        with open(os.path.join(folder, "dataset_info.json")) as handle:
            info = json.load(handle)
    except (OSError, ValueError):
        return []
    remote = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
    return [n for n in names if isinstance(info, dict) and isinstance(info.get(n), dict)
            and not any(key in info[n] for key in remote)]
