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
stream), dealt to new rank r' at positions r', r' + W', ... (`RemainderSource.indices`). Each remaining index is
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

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from odb_core.resume.fields import ElasticResumeError, StateError
from odb_core.resume.source_state import RECOMPUTABLE, RemainderPart, RemainderSource, ShardedSource
from odb_core.resume.state import MERGED_FORMAT, STATE_VERSION, LoaderIdentity, LoaderState, SavedPosition

__all__ = ["ElasticResumeError", "MergedState", "merge_states", "remainder_plan"]
logger = logging.getLogger(__name__)
ELASTIC_VERSIONS = (2, STATE_VERSION)


@dataclass(frozen=True, slots=True)
class MergedState:
    """Every rank's state of one run, taken after the same step, in rank order (what `merge_states` returns)."""

    world_size: int
    states: tuple[LoaderState, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "format": MERGED_FORMAT, "world_size": self.world_size,
                "states": [s.to_dict() for s in self.states]}

    @classmethod
    def from_dict(cls, merged: Mapping[str, Any]) -> MergedState:
        """Re-validated (it may have been edited or truncated on disk)."""
        unexpected = set(merged) - {"version", "format", "world_size", "states"}
        if unexpected:
            raise StateError(f"unexpected keys in merged loader state: {sorted(unexpected)}")
        if not isinstance(merged.get("states"), list):
            raise StateError("a merged loader state needs a 'states' list (from merge_states())")
        again = _merge([LoaderState.from_dict(s) for s in merged["states"]])
        if again.world_size != merged.get("world_size"):
            raise ElasticResumeError(f"merged state says world_size={merged.get('world_size')} but holds states of "
                                     f"a world of size {again.world_size}")
        return again


def is_merged(state: Any) -> bool:
    return isinstance(state, Mapping) and state.get("format") == MERGED_FORMAT


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Bundle every rank's `state_dict()` (one per rank, any order) into one state any world size can load.

    Checks that the ranks 0..W-1 are all present once, and that the states agree on world size, config, dataset
    and position (all taken after the same step). Loading it at the same world size is an exact resume (each
    rank takes its own state); at another world size it continues the epoch as in NOTE [ Elastic resume ].
    """
    if not states:
        raise ElasticResumeError("merge_states() needs every rank's state; got none")
    typed = []
    for s in states:
        if is_merged(s):
            raise ElasticResumeError("merge_states() takes per-rank states, not an already merged state")
        if not isinstance(s, Mapping) or s.get("version") not in ELASTIC_VERSIONS:
            version = s.get("version") if isinstance(s, Mapping) else None
            raise ElasticResumeError(f"a rank state has version {version!r}; elastic resume needs a state of "
                                     f"version {ELASTIC_VERSIONS} (it names its index source)")
        typed.append(LoaderState.from_dict(s))
    return _merge(typed).to_dict()


def _merge(states: list[LoaderState]) -> MergedState:
    world_size = states[0].world_size
    _check_ranks(states, world_size)
    states = sorted(states, key=lambda s: s.rank)
    for key, value in (("config", lambda s: dict(s.config)), ("sampler", lambda s: s.source),
                       ("world_size", lambda s: s.world_size)):
        values = [value(s) for s in states]
        if any(v != values[0] for v in values):
            raise ElasticResumeError(f"rank states disagree on {key}: {values}; they are not from the same run")
    where = [s.progress() for s in states]
    if len(set(where)) != 1:
        raise ElasticResumeError("rank states were taken after different steps (epoch, step per rank: "
                                 f"{where}); save every rank's state after the same step")
    plans = [s.plan for s in states if s.progress()[0] == s.epoch]  # not yet past a finished epoch
    if any(plan != plans[0] for plan in plans):
        raise ElasticResumeError("rank states disagree on the remainder of their epoch (plan); they are not from "
                                 "the same run")
    return MergedState(world_size=world_size, states=tuple(states))


def _check_ranks(states: Sequence[LoaderState], world_size: int) -> None:
    ranks = [s.rank for s in states]
    missing = sorted(set(range(world_size)) - set(ranks))
    duplicate = sorted(r for r, n in Counter(ranks).items() if n > 1)
    extra = sorted(set(ranks) - set(range(world_size)))
    if missing or duplicate or extra:
        raise ElasticResumeError(f"merging states of a world of size {world_size} needs ranks 0..{world_size - 1} "
                                 f"once each; missing {missing}, duplicated {duplicate}, out of range {extra}")


def check_elastic(merged: MergedState, loader: LoaderIdentity) -> None:
    """Refuse a merged state that another world size cannot continue: other config, dataset, or source kind."""
    first = merged.states[0]
    saved_config, my_config = _batching(first.config), _batching(loader.config)
    if saved_config != my_config:
        differing = sorted(k for k in saved_config.keys() | my_config.keys() if saved_config.get(k) != my_config.get(k))
        named = ", ".join(f"{k}={saved_config.get(k)!r} (this loader: {my_config.get(k)!r})" for k in differing)
        raise ValueError(f"loader states were saved with {named}; resume needs the same batching config: build the "
                         "loader with the saved values")
    saved, mine = first.source, loader.source
    change = f"from world size {merged.world_size} to {loader.world_size}"
    if not isinstance(saved, ShardedSource) or not isinstance(mine, ShardedSource):
        raise ElasticResumeError(
            f"cannot resume {change}: the saved run read {saved.describe() if saved else 'an unknown source'} and "
            f"this loader reads {mine.describe()}; only a map-style dataset with ODB's own sampler (no sampler= "
            f"argument) has a per-rank order that can be recomputed at another world size. Resume at world size "
            f"{merged.world_size}")
    if (saved.size, saved.shuffle, saved.seed) != (mine.size, mine.shuffle, mine.seed):
        raise ElasticResumeError(f"cannot resume {change}: it needs the same dataset and shuffle; the saved run "
                                 f"read {saved.describe()}, this loader {mine.describe()}")


def _layout(config: Mapping[str, Any]) -> object:
    return config.get("nproc_per_node")


def _batching(config: Mapping[str, Any]) -> dict[str, Any]:
    """The fingerprint without the node layout, which an elastic resume may change (it plans the remainder), nor
    `pool_window`, which the fingerprint records only where the layout lets it act (NOTE [ Pooled round sizes ]):
    the same setting reads None at 2 ranks and 8,192 at 4, and the remainder is planned with this loader's."""
    return {k: v for k, v in config.items() if k not in ("nproc_per_node", "pool_window")}


def remainder_plan(states: Sequence[LoaderState], new_world_size: int) -> RemainderSource | None:
    """The remainder descriptor continuing the old ranks' epoch at `new_world_size`, or None when the epoch
    is untouched or complete (the next `iter()` then runs a normal epoch at the new world size)."""
    first = states[0]
    position = first.position
    if (position is None and first.plan is None) or (position is not None and position.complete):
        return None
    accumulation = first.config["accumulation_steps"]
    epoch, step = first.progress()
    if step % accumulation:
        raise ElasticResumeError(f"the states were saved after step {step} of epoch {epoch}, inside a gradient-"
                                 f"accumulation window of {accumulation} steps; an elastic resume regroups the "
                                 "remaining samples, so save at an optimizer-step boundary")
    if position is not None and position.window_open:
        raise ElasticResumeError(f"the states were saved after step {step} of epoch {epoch}, inside an optimizer "
                                 f"step ({position.window_open} of its micro-batches consumed); an elastic resume "
                                 "regroups the remaining samples, so save at an optimizer-step boundary")
    first_round = position.point.start.round + 1 if position is not None else first.plan.first_round
    return RemainderSource(world_size=new_world_size, first_step=step, first_round=first_round,
                           parts=tuple(_part(s) for s in states))


def _part(state: LoaderState) -> RemainderPart:
    source = state.plan if state.plan is not None else state.source
    if not isinstance(source, RECOMPUTABLE):
        raise ElasticResumeError(f"rank {state.rank} read its samples from {source.describe()}, whose per-rank "
                                 "order cannot be recomputed at another world size; elastic resume needs a "
                                 "map-style dataset with ODB's own sampler (no sampler= argument). Resume at "
                                 f"world size {state.world_size} instead (exact)")
    if state.position is None:
        return RemainderPart(rank=state.rank, source=source, consumed=0, buffer=(), emitted=())
    start = state.position.point.start
    return RemainderPart(rank=state.rank, source=source, consumed=start.consumed, buffer=start.buffer,
                         emitted=state.position.point.round_emitted)


@dataclass(frozen=True, slots=True)
class Restored:
    """What a loaded state makes of a loader: the epoch to continue with its pending position (exact resume) or
    remainder plan (elastic), and the metrics counters to restore (None: they restart at zero)."""

    epoch: int
    position: SavedPosition | None
    plan: RemainderSource | None
    metrics: dict[str, Any] | None


def restore(state: Any, me: LoaderIdentity, shard_order: Callable[[LoaderState], list[int] | None],
            window: int, accumulation_steps: int | None) -> Restored:
    """Check a `state_dict()` or `merge_states()` result against the loader `me` and say where it continues.

    A rank state, or a merged state of the same world size, resumes exactly after `check_resumable_by` and the
    check against this rank's shard (`shard_order(loaded)`: its index order of the loaded epoch, None for a
    stream; `accumulation_steps` None: steps of a target size, no bound on a carried window). A merged state of
    another world size continues on the remainder (NOTE [ Elastic resume ]); every
    old rank's remainder is recomputed here, so an inconsistent one is refused at load, not mid-epoch."""
    if is_merged(state):
        merged = MergedState.from_dict(state)
        if merged.world_size != me.world_size or _layout(merged.states[0].config) != _layout(me.config):
            check_elastic(merged, me)
            if merged.world_size == me.world_size and me.rank == 0:  # the layout alone changed: said, not silent
                logger.warning("ODB: the merged state was saved at world size %d with another node layout "
                               "(nproc_per_node %s, this run %s): the epoch's remaining samples are planned anew "
                               "(an elastic resume), not replayed batch for batch", merged.world_size,
                               _layout(merged.states[0].config), _layout(me.config))
            epoch = merged.states[0].progress()[0]
            plan = remainder_plan(merged.states, me.world_size)
            if plan is not None:
                plan.indices(me.rank, epoch)
            return Restored(epoch=epoch, position=None, plan=plan, metrics=None)
        loaded = merged.states[me.rank]
    else:
        loaded = LoaderState.from_dict(state)
    loaded.check_resumable_by(me)
    loaded.check_against_shard(shard_order(loaded), window, accumulation_steps)
    return Restored(epoch=loaded.epoch, position=loaded.position, plan=loaded.plan, metrics=dict(loaded.metrics))
