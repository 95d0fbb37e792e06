"""Reading a saved state's fields: typed pops and range checks whose errors name the field, and the digest.

Shared by the state's parts (`state.py`, `source_state.py`) so that every refusal reads the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


class ElasticResumeError(ValueError):
    """A saved state cannot be continued at this world size without losing or repeating samples."""


class StateError(ValueError):
    """A loader state that is not a well-formed state dict; the message names the field."""


def pop_field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise StateError(f"{where} has no {key!r}; it is not a loader state_dict() (or it was truncated)")
    value = data.pop(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise StateError(f"{where}.{key}={value!r} has the wrong type (expected {_names(kind)})")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kind))


def int_list(values: Any, where: str) -> tuple[int, ...]:
    if not isinstance(values, list | tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise StateError(f"{where} must be a list of ints, got {str(values)[:80]}")
    return tuple(values)


def at_least(value: int, low: int, where: str, why: str = "") -> None:
    if value < low:
        raise StateError(f"{where}={value} is out of range: it must be >= {low}{why}; the state is corrupt or was "
                         "edited: resume from another checkpoint")


def digest_of(state: Mapping[str, Any]) -> str:
    """sha256 of a state's canonical JSON, without its own `digest` field."""
    body = {k: v for k, v in state.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def no_leftovers(data: Mapping[str, Any], where: str) -> None:
    if data:
        raise StateError(f"unexpected keys in {where}: {sorted(data)}")
