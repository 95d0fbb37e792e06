"""The settings every rank must share, checked once before a loader's first collective.

NOTE [ Ranks agree on their settings ]
Ranks that plan with different settings do not fail cleanly on their own: a different `seed` deals rows that are
not what `StepInfo.indices` says, a different budget or `join` breaks the pooled plan's arithmetic, a different
`move` makes one rank wait for bytes the other never sends, a different `planning` makes them call different
collectives. So a loader hands its transport the settings that must agree (`ODBDataLoader` names them: the
batching fields of its state fingerprint, `oversize`, `move`, and the index source when it is ODB's own sharded
sampler), and the transport's next collective, whichever it is, first runs one `all_gather` of one 63-bit digest
per setting. Equal digests: the collective goes on (cost: one all_gather of that many ints, once per loader).
A difference: every rank sees the same differing names, so every rank takes part in one more exchange of those
values, and every rank raises `DesyncError` naming the first differing setting and its value on each rank.
Settings a rank may legitimately choose alone (worker counts, prefetch depth, timeouts) are not in the set.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from odb_core.planning.termination import DesyncError

RANKS_SHOWN = 8  # ranks listed per value in the error message


def digests(settings: Mapping[str, object]) -> list[int]:
    """One non-negative int64 per setting, in the mapping's order (the loader's code fixes it, so it is the same on
    every rank), from the setting's name and repr."""
    return [int.from_bytes(hashlib.sha256(f"{name}={value!r}".encode()).digest()[:8], "big") >> 1
            for name, value in settings.items()]


def differing(settings: Mapping[str, object], gathered: Sequence[Sequence[int]]) -> list[str]:
    """The names whose digests differ between ranks, in the mapping's order (the same list on every rank)."""
    return [name for k, name in enumerate(settings) if len({row[k] for row in gathered}) > 1]


def payload(settings: Mapping[str, object], names: Sequence[str]) -> bytes:
    """This rank's values of `names`, as sent to every rank to name the difference."""
    return json.dumps({name: repr(settings[name]) for name in names}).encode()


def mismatch_error(names: Sequence[str], received: Sequence[bytes]) -> DesyncError:
    """The error every rank raises: the first differing setting and its value on each rank."""
    name = names[0]
    by_value: dict[str, list[int]] = {}
    for rank, data in enumerate(received):
        by_value.setdefault(json.loads(data)[name], []).append(rank)
    parts = [f"{value} on rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}" for value, ranks in by_value.items()]
    also = f" (also differing: {', '.join(names[1:])})" if len(names) > 1 else ""
    hint = " (a per-rank seed belongs to the model's randomness, not to ODB's)" if name == "seed" else ""
    return DesyncError(f"ranks disagree on ODB's settings: {name} is {' but '.join(parts)}{also}; every rank must "
                       f"build its loader with the same {name}{hint}")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:RANKS_SHOWN])
    return shown + (f" and {len(ranks) - RANKS_SHOWN} more" if len(ranks) > RANKS_SHOWN else "")
