"""The `odb` section of a DeepSpeed config: parsed and validated here, for `odb_deepspeed.initialize` and odb_hf
(both adapters read it, so it lives in the core; it only handles plain dicts and files).

    {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
     "odb": {"enabled": true, "token_budget": 16384, "shuffle": true, "num_workers": 2}}

Allowed keys: `enabled` (required bool), every `ODBConfig` field except `accumulation_steps` (DeepSpeed's
`gradient_accumulation_steps` is its one source, filled in by the caller), and the loader options `shuffle`
and `num_workers`. An unknown key raises `ValueError` naming it, its closest match and the allowed keys; a bad
value raises `ODBConfig`'s own error, prefixed with `odb.`. This module does not import deepspeed.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from odb_core.config import ODBConfig

SECTION = "odb"
LOADER_KEYS = ("shuffle", "num_workers")
CONFIG_KEYS = tuple(f.name for f in fields(ODBConfig) if f.name != "accumulation_steps")
ALLOWED_KEYS = ("enabled", *CONFIG_KEYS, *LOADER_KEYS)


@dataclass(frozen=True, kw_only=True, slots=True)
class ODBSection:
    """A validated `odb` section.

    `config` holds the `ODBConfig` kwargs that the section sets (without `accumulation_steps`); `shuffle` and
    `num_workers` are None when the section does not set them (`loader_kwargs` then uses False and 0).
    """

    enabled: bool
    config: Mapping[str, Any]
    shuffle: bool | None = None
    num_workers: int | None = None

    def odb_config(self, accumulation_steps: int) -> ODBConfig:
        """The loader's `ODBConfig`; pass the engine's (or Trainer's) gradient accumulation steps."""
        return ODBConfig(**self.config, accumulation_steps=accumulation_steps)

    def loader_kwargs(self, accumulation_steps: int) -> dict[str, Any]:
        """Keyword arguments for `ODBDataLoader(dataset, collate_fn=..., **kwargs)`."""
        return {"config": self.odb_config(accumulation_steps), "shuffle": bool(self.shuffle),
                "num_workers": self.num_workers or 0}


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


def _reject_unknown(section: Mapping[str, Any]) -> None:
    for key in section:
        if key == "accumulation_steps":
            raise ValueError("odb.accumulation_steps is not allowed: the loader takes DeepSpeed's "
                             "gradient_accumulation_steps, so that both always agree")
        if key not in ALLOWED_KEYS:
            close = difflib.get_close_matches(str(key), ALLOWED_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown key {key!r} in the DeepSpeed config's 'odb' section{hint}; allowed keys: "
                             f"{list(ALLOWED_KEYS)}")


def _check_loader_keys(section: Mapping[str, Any]) -> None:
    if not isinstance(section.get("shuffle", False), bool):
        raise ValueError(f"odb.shuffle={section['shuffle']!r} is invalid: it must be true or false")
    workers = section.get("num_workers", 0)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"odb.num_workers={workers!r} is invalid: it must be an int >= 0")


def parse_odb_section(ds_config: Any) -> ODBSection | None:
    """Validate the `odb` section of a DeepSpeed config (dict or path); None when the config has none.

    Raises `ValueError` for a missing or non-bool `enabled`, an unknown key, a missing `token_budget` or any
    value `ODBConfig` rejects; a disabled section is validated too, so a typo never hides.
    """
    section = load_ds_config(ds_config).get(SECTION)
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"the DeepSpeed config's 'odb' section must be an object, got {section!r}")
    _reject_unknown(section)
    if not isinstance(section.get("enabled"), bool):
        raise ValueError(f"odb.enabled={section.get('enabled')!r} is invalid: set it to true or false")
    if "token_budget" not in section:
        raise ValueError("odb.token_budget is required: the token budget of one micro-batch on one rank, e.g. 16384")
    _check_loader_keys(section)
    config = {k: section[k] for k in CONFIG_KEYS if k in section}
    try:
        ODBConfig(**config)  # validate every value now, before DeepSpeed builds an engine
    except ValueError as exc:
        raise ValueError(f"odb.{str(exc).removeprefix('ODBConfig.')}") from exc
    return ODBSection(enabled=section["enabled"], config=config, shuffle=section.get("shuffle"),
                      num_workers=section.get("num_workers"))


def without_odb_section(ds_config: Any) -> dict[str, Any]:
    """A copy of the config without the `odb` section (the caller's dict is not modified)."""
    config = load_ds_config(ds_config)
    config.pop(SECTION, None)
    return config
