"""Resume at the same or a different world size: merged rank states and the remainder of an epoch.

NOTE [ Elastic resume ]
Each rank's `ODBDataLoader.state_dict()` says, for the epoch in progress, where its index source stood at the
start of the round of the last consumed step (`consumed`, the samples admitted so far), which admitted indices
were still buffered then (`buffer`), and which indices this rank already emitted in that round
(`round_emitted`). Everything admitted before the round start and not buffered was emitted in earlier steps,
and the steps of the current round drew only on the buffer and the stream after `consumed`. So the indices old
rank r has not emitted yet are, exactly (as a multiset),

    remaining_r = buffer_r + source_r(epoch)[consumed_r:]  -  round_emitted_r

where `source_r(epoch)` is the rank's index order for the epoch, recomputed from a small descriptor (ODB's own
`ShardedSampler`: dataset size, shuffle, seed, world size; or an earlier remainder, see below). This needs
every old rank's state, taken after the same step: `merge_states` checks that and bundles them.

A run at a different world size W' then continues the same epoch on the *remainder*: the old ranks' remaining
lists interleaved round-robin in old-rank order (which restores the global shuffled order of the unread
stream), dealt to new rank r' at positions r', r' + W', ... (`remainder_indices`). Each remaining index is
dealt to exactly one new rank, so with join=True the epoch emits every index exactly once in total (old steps
plus new steps); only the order differs from an uninterrupted run. Step numbers continue from the old run's
consumed step count (so gradient-accumulation windows stay aligned) and the next epoch uses the normal sampler
at W'. A crash inside the remainder epoch resumes exactly at W' (the remainder descriptor is in the state) or
elastically again (descriptors nest).

Kept: epoch, step numbering, seed and config, the set of samples still to emit. Not kept: the order of the
remaining samples, the old round's buffer grouping, and the per-rank metrics counters (they restart at zero).
Refused with `ElasticResumeError`: a missing or duplicate rank, states taken at different steps or epochs,
different batching config or dataset size, a user-supplied sampler or an IterableDataset (their per-rank order
cannot be recomputed for other ranks), and a step inside a gradient-accumulation window.
Costs: the state holds O(window) ints per rank; an elastic load recomputes every old rank's index order, O(N).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from odb_core.sources import ShardedSampler

MERGED_FORMAT = "merged"


class ElasticResumeError(ValueError):
    """A saved state cannot be continued at this world size without losing or repeating samples."""


def sharded_source(size: int, shuffle: bool, seed: int, world_size: int) -> dict[str, Any]:
    """Descriptor of ODB's own `ShardedSampler` order (any rank, any epoch)."""
    return {"kind": "sharded", "size": size, "shuffle": shuffle, "seed": seed, "world_size": world_size}


def source_indices(source: dict[str, Any], rank: int, epoch: int) -> list[int]:
    """Rank `rank`'s index order for `epoch` under a source descriptor (sharded or remainder)."""
    kind = source["kind"]
    if kind == "sharded":
        sampler = ShardedSampler(source["size"], rank=rank, world_size=source["world_size"],
                                 shuffle=source["shuffle"], seed=source["seed"])
        return sampler.with_epoch(epoch)
    if kind == "remainder":
        return remainder_indices(source, rank, epoch)
    raise ElasticResumeError(f"an index source of kind {kind!r} cannot be recomputed for another rank; elastic "
                             "resume needs a map-style dataset and ODB's own sampler")


def remaining_of(part: dict[str, Any], epoch: int) -> list[int]:
    """What one old rank had not emitted yet: buffer + unread source - emitted in the current round."""
    pool = list(part["buffer"]) + source_indices(part["source"], part["rank"], epoch)[part["consumed"]:]
    emitted = Counter(part["emitted"])
    remaining = []
    for index in pool:
        if emitted[index] > 0:
            emitted[index] -= 1
        else:
            remaining.append(index)
    if +emitted:
        raise ElasticResumeError(f"state of rank {part['rank']} is inconsistent: it emitted indices "
                                 f"{sorted(+emitted)[:8]} that were neither buffered nor unread")
    return remaining


def remainder_indices(source: dict[str, Any], rank: int, epoch: int) -> list[int]:
    """New rank `rank`'s share of a remainder: old ranks' remaining lists interleaved, dealt round-robin."""
    lists = [remaining_of(part, epoch) for part in source["parts"]]
    merged = [lst[k] for k in range(max(map(len, lists), default=0)) for lst in lists if k < len(lst)]
    return merged[rank :: source["world_size"]]


def progress(state: dict[str, Any]) -> tuple[int, int]:
    """(epoch, steps consumed) of a rank state; a completed epoch counts as step 0 of the next one."""
    position = state.get("position")
    if position is None:
        first = (state.get("plan") or {}).get("first_step", 0)
        return int(state["epoch"]), int(first)
    if position.get("epoch_complete", False):
        return int(state["epoch"]) + 1, 0
    return int(state["epoch"]), int(position["steps_consumed"])


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Bundle every rank's `state_dict()` (one per rank, any order) into one state any world size can load.

    Checks that the ranks 0..W-1 are all present once, and that the states agree on world size, config, dataset
    and position (all taken after the same step). Loading it at the same world size is an exact resume (each
    rank takes its own state); at another world size it continues the epoch as in NOTE [ Elastic resume ].
    """
    if not states:
        raise ElasticResumeError("merge_states() needs every rank's state; got none")
    states = [dict(s) for s in states]
    for s in states:
        if s.get("format") == MERGED_FORMAT:
            raise ElasticResumeError("merge_states() takes per-rank states, not an already merged state")
        if s.get("version") != 2:
            raise ElasticResumeError(f"a rank state has version {s.get('version')!r}; elastic resume needs "
                                     "version 2 states (saved by this release)")
    world_size = states[0]["world_size"]
    _check_ranks(states, world_size)
    states.sort(key=lambda s: s["rank"])
    for key in ("config", "sampler", "world_size"):
        values = [s[key] for s in states]
        if any(v != values[0] for v in values):
            raise ElasticResumeError(f"rank states disagree on {key}: {values}; they are not from the same run")
    where = [progress(s) for s in states]
    if len(set(where)) != 1:
        raise ElasticResumeError("rank states were taken after different steps (epoch, step per rank: "
                                 f"{where}); save every rank's state after the same step")
    plans = [s.get("plan") for s in states if progress(s)[0] == s["epoch"]]  # not yet past a finished epoch
    if any(plan != plans[0] for plan in plans):
        raise ElasticResumeError("rank states disagree on the remainder of their epoch (plan); they are not from "
                                 "the same run")
    return {"version": 2, "format": MERGED_FORMAT, "world_size": world_size, "states": states}


def _check_ranks(states: Sequence[dict[str, Any]], world_size: int) -> None:
    ranks = [s["rank"] for s in states]
    missing = sorted(set(range(world_size)) - set(ranks))
    duplicate = sorted(r for r, n in Counter(ranks).items() if n > 1)
    extra = sorted(set(ranks) - set(range(world_size)))
    if missing or duplicate or extra:
        raise ElasticResumeError(f"merging states of a world of size {world_size} needs ranks 0..{world_size - 1} "
                                 f"once each; missing {missing}, duplicated {duplicate}, out of range {extra}")


def check_merged(merged: dict[str, Any]) -> list[dict[str, Any]]:
    """The rank states of a merged state, re-validated (it may have been edited or truncated on disk)."""
    unexpected = set(merged) - {"version", "format", "world_size", "states"}
    if unexpected:
        raise ValueError(f"unexpected keys in merged loader state: {sorted(unexpected)}")
    again = merge_states(merged["states"])
    if again["world_size"] != merged["world_size"]:
        raise ElasticResumeError(f"merged state says world_size={merged['world_size']} but holds states of a world "
                                 f"of size {again['world_size']}")
    return again["states"]


def remainder_plan(states: Sequence[dict[str, Any]], new_world_size: int) -> dict[str, Any] | None:
    """The remainder descriptor continuing the old ranks' epoch at `new_world_size`, or None when the epoch
    is untouched or complete (the next `iter()` then runs a normal epoch at the new world size)."""
    first = states[0]
    position = first["position"]
    if position is None and first.get("plan") is None:
        return None
    if position is not None and position.get("epoch_complete", False):
        return None
    accumulation = first["config"]["accumulation_steps"]
    epoch, step = progress(first)
    if step % accumulation:
        raise ElasticResumeError(f"the states were saved after step {step} of epoch {epoch}, inside a gradient-"
                                 f"accumulation window of {accumulation} steps; an elastic resume regroups the "
                                 "remaining samples, so save at an optimizer-step boundary")
    parts = [_part(s) for s in states]
    first_round = position["start"]["round"] + 1 if position is not None else first["plan"]["first_round"]
    return {"kind": "remainder", "world_size": new_world_size, "first_step": step, "first_round": first_round,
            "parts": parts}


def _part(state: dict[str, Any]) -> dict[str, Any]:
    source = state["plan"] if state.get("plan") is not None else state["sampler"]
    if source.get("kind") not in ("sharded", "remainder"):
        raise ElasticResumeError(f"rank {state['rank']} read its samples from {describe_source(source)}, whose "
                                 "per-rank order cannot be recomputed at another world size; elastic resume needs a "
                                 "map-style dataset with ODB's own sampler (no sampler= argument). Resume at "
                                 f"world size {state['world_size']} instead (exact)")
    position = state["position"]
    if position is None:
        return {"rank": state["rank"], "source": source, "consumed": 0, "buffer": [], "emitted": []}
    return {"rank": state["rank"], "source": source, "consumed": position["start"]["consumed"],
            "buffer": list(position["start"]["buffer"]), "emitted": list(position["round_emitted"])}


def describe_source(source: dict[str, Any]) -> str:
    """A source descriptor in words, for error messages."""
    if source.get("kind") == "sharded":
        return f"ODB's own sampler over {source.get('size')} samples (shuffle={source.get('shuffle')})"
    if source.get("kind") == "stream":
        return "an IterableDataset stream"
    if source.get("kind") == "custom":
        return f"a user sampler ({source.get('type')})"
    return f"a source of kind {source.get('kind')!r}"
