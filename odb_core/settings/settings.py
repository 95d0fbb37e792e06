"""ODB settings written in a framework's own configuration: one parser that every adapter calls with its naming.

    read_settings({"enabled": True, "token_budget": 16384, "shuffle": True}, DEEPSPEED_SECTION)  # DeepSpeed's "odb"
    read_settings({"odb": True, "odb_token_budget": 8192}, LLAMAFACTORY)                       # a LLaMA-Factory YAML
    read_settings({"token_budget": 16384, "window": 512}, CALLBACK)                            # ODBCallback(**kwargs)

A `SettingsSource` says how one place names ODB's settings: a key prefix (`odb_`), how errors show a key
(`odb.window`), an optional on/off switch, the fields the framework sets itself (`refused`, with the reason), and
the adapter's own keys with their `Rule`s. The rules are the same for every source:
  * every key is known: an `ODBConfig` field or one of the source's own keys; anything else raises, naming the
    key, its closest match and the allowed keys (`key_error`);
  * a field the framework owns (accumulation_steps: its gradient-accumulation setting) raises with that reason;
  * every value is checked now, by `ODBConfig` itself or by the key's `Rule`; the error (`error`) names the key as
    the user wrote it (`odb_window=0 is invalid: ...`). A switched-off source is checked too: a typo never hides;
  * the result holds one `ODBConfig`; values the framework derives later (accumulation_steps, a seed) enter with
    `ODBSettings.derive`, a `dataclasses.replace` that never overrides a field the user set;
  * settings given in two places (an `ODBCallback` and a DeepSpeed `odb` section) are joined by `combine`: a field
    is set in one of them, or in both with the same value (there is no precedence to guess).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from odb_core.settings.config import ODBConfig, _is_int, _is_number

CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ODBConfig))


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """The check of one adapter key's value; `allowed` ends the message "KEY=VALUE is invalid: ..."."""

    accepts: Callable[[Any], bool]
    allowed: str


BOOL = Rule(accepts=lambda v: isinstance(v, bool), allowed="it must be true or false")
COUNT = Rule(accepts=lambda v: _is_int(v) and v >= 0, allowed="it must be an int >= 0")
POSITIVE_INT = Rule(accepts=lambda v: _is_int(v) and v >= 1, allowed="it must be an int >= 1")
NON_NEGATIVE = Rule(accepts=lambda v: _is_number(v) and v >= 0, allowed="it must be a number >= 0")
PASSED_ON = Rule(accepts=lambda v: True, allowed="")  # checked by whoever receives it (the loader)
EPOCH_LENGTH_KEYS = {"estimate_sample_size": POSITIVE_INT, "length_slack": NON_NEGATIVE, "exact_schedule": BOOL}
"""Keys of a framework that needs an epoch length up front: the sample size of `ODBDataLoader.estimate_steps`,
the slack of the length bound, and whether to plan the exact step count instead (NOTE [ Exact schedule ] in
estimate.py; the HF Trainer, and LLaMA-Factory through it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SettingsSource:
    """How one place names ODB's settings (see the module docstring).

    A field's key is `prefix + field`, an own key's `prefix + key`; errors show a key as `shown + key`. `refused`
    maps a field (or any name) to the rest of the sentence "KEY ...": why it is not set here. `budget` says when
    `token_budget` is required: `always`, `when_on` (with the switch on), or `optional` (the caller enforces it).
    """

    where: str
    noun: str = "key"
    prefix: str = ""
    shown: str = ""
    switch: str | None = None
    refused: Mapping[str, str] = field(default_factory=dict)
    keys: Mapping[str, Rule] = field(default_factory=dict)
    budget: Literal["always", "when_on", "optional"] = "when_on"
    error: type[Exception] = ValueError
    key_error: type[Exception] = ValueError

    @property
    def allowed_keys(self) -> tuple[str, ...]:
        switch = (self.switch,) if self.switch is not None else ()
        names = [f for f in CONFIG_FIELDS if f not in self.refused] + list(self.keys)
        return (*switch, *(self.prefix + name for name in names))

    def name(self, key: str) -> str:
        """How a message shows a field or own key (`window` -> `odb.window`, `odb_window`, ...)."""
        return self.shown + self.prefix + key


@dataclass(frozen=True, slots=True)
class SplitKeys:
    """A source's keys by kind, without the prefix: `ODBConfig` fields, and the source's own keys."""

    fields: dict[str, Any]
    extras: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class ODBSettings:
    """Validated settings of one source.

    `config` is the one `ODBConfig` they describe (None only when switched off without a `token_budget`);
    `given` the fields the source set (the others are defaults, open to `derive`); `extras` the source's own keys
    that it set (not the switch). `enabled` is the switch, True for a source without one.
    """

    source: SettingsSource
    enabled: bool
    config: ODBConfig | None
    given: Mapping[str, Any]
    extras: Mapping[str, Any]

    def derive(self, **derived: Any) -> ODBConfig:
        """The config to run, with values the framework derives (accumulation_steps, seed) for the fields that
        the source left unset: a field the user set is never overridden."""
        assert self.config is not None, "switched-off settings without a token_budget have no config"
        unset = {k: v for k, v in derived.items() if k not in self.given}
        return dataclasses.replace(self.config, **unset) if unset else self.config


def _unknown_keys(keys: list[str], source: SettingsSource) -> Exception:
    allowed = source.allowed_keys
    close = {k: difflib.get_close_matches(str(k), allowed, n=1) for k in keys}
    if len(keys) == 1:
        hint = f" (did you mean {close[keys[0]][0]!r}?)" if close[keys[0]] else ""
        what = f"unknown {source.noun} {keys[0]!r}{hint}"
    else:
        hints = ", ".join(f"{c[0]!r} for {k!r}" for k, c in close.items() if c)
        what = f"unknown {source.noun}s {keys}" + (f" (did you mean {hints}?)" if hints else "")
    return source.key_error(f"{what} in {source.where}; the allowed {source.noun}s are {list(allowed)}")


def split_keys(values: Mapping[str, Any], source: SettingsSource) -> SplitKeys:
    """Sort `values` (the source's keys, switch excluded) into fields and own keys; raise on refused or unknown keys."""
    by_key = {source.prefix + name: name for name in (*CONFIG_FIELDS, *source.keys, *source.refused)}
    for key in values:
        if by_key.get(key) in source.refused:
            raise source.key_error(f"{source.shown}{key} {source.refused[by_key[key]]}")
    unknown = sorted(str(key) for key in values if key not in by_key)
    if unknown:
        raise _unknown_keys(unknown, source)
    named = {by_key[key]: value for key, value in values.items()}
    return SplitKeys(fields={k: v for k, v in named.items() if k in CONFIG_FIELDS},
                     extras={k: v for k, v in named.items() if k not in CONFIG_FIELDS})


def _switch(values: Mapping[str, Any], source: SettingsSource) -> bool:
    if source.switch is None:
        return True
    value, name = values.get(source.switch), source.shown + source.switch
    if not isinstance(value, bool):
        raise source.error(f"{name}={value!r} is invalid: add {name}: true to train with ODB (or {name}: false to "
                           "keep these settings and train without it)")
    return value


def _check_extras(extras: Mapping[str, Any], source: SettingsSource) -> None:
    for key, value in extras.items():
        if not source.keys[key].accepts(value):
            raise source.error(f"{source.name(key)}={value!r} is invalid: {source.keys[key].allowed}")


def _build_config(given: Mapping[str, Any], enabled: bool, source: SettingsSource) -> ODBConfig | None:
    if "token_budget" not in given and (source.budget == "always" or (enabled and source.budget == "when_on")):
        raise source.error(f"{source.name('token_budget')} is required: the token budget of one micro-batch on one "
                           f"rank, e.g. {source.name('token_budget')}: 16384")
    try:  # without a budget (switched off, or optional) a placeholder lets the other values be checked
        config = ODBConfig(**{"token_budget": 1, **given})
    except ValueError as exc:
        raise source.error(source.name(str(exc).removeprefix("ODBConfig."))) from exc
    return config if "token_budget" in given else None


def read_settings(values: Mapping[str, Any], source: SettingsSource) -> ODBSettings:
    """Validate `values` (every key of `source`, switch included) into `ODBSettings`; see the module docstring."""
    keys = split_keys({k: v for k, v in values.items() if k != source.switch}, source)
    enabled = _switch(values, source)
    _check_extras(keys.extras, source)
    config = _build_config(keys.fields, enabled, source)
    return ODBSettings(source=source, enabled=enabled, config=config, given=keys.fields, extras=keys.extras)


def combine(mine: ODBSettings, other: ODBSettings) -> ODBSettings:
    """`mine` completed by `other`: `other`'s `ODBConfig` with the fields that only `mine` sets, and `other`'s switch;
    a field set in both must be equal, or `mine.source.error` names both places. `mine` keeps its own keys (what
    `other`'s own keys mean is for its adapter to check)."""
    clashes = [k for k in sorted(mine.given.keys() & other.given.keys()) if mine.given[k] != other.given[k]]
    if clashes:
        raise mine.source.error("; ".join(
            f"{mine.source.name(k)}={mine.given[k]!r} in {mine.source.where} but {other.source.name(k)}="
            f"{other.given[k]!r} in {other.source.where}" for k in clashes) + ": set each in one place")
    assert other.config is not None, "settings to complete others with have a token_budget"
    only_mine = {k: v for k, v in mine.given.items() if k not in other.given}
    config = dataclasses.replace(other.config, **only_mine) if only_mine else other.config
    return dataclasses.replace(mine, enabled=other.enabled, config=config, given={**other.given, **only_mine})
