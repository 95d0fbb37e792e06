"""The loader's resume state as typed values: what `ODBDataLoader.state_dict()` saves and `load_state_dict()` takes.

NOTE [ Loader state ]
A rank state says where one rank stands: its epoch, the index source it reads (`Source`), the remainder of an
elastically resumed epoch (`plan`), the position of its last consumed step (`SavedPosition`), and the metrics
counters matching that position. It travels as plain JSON (`to_dict` / `from_dict`, the version-2 layout);
`from_dict` checks the layout and names the field that is wrong, and `LoaderState.check_resumable_by` refuses a
state from another world size, rank, batching config or index source, each with its own error. Version 1 (no
source, no remainder, no emitted list) is still read. Sources are typed (`ShardedSource`, `StreamSource`,
`CustomSource`, `RemainderSource`); only the first and the last can be recomputed for another rank, which is
what elastic resume needs (NOTE [ Elastic resume ] in resume.py).

NOTE [ A state proves itself ]
A state is trusted only after it proved itself. Version 3 carries a `digest`: the sha256 of its canonical JSON,
so a truncated or hand-edited state is refused. `from_dict` checks every field's type and range (no negative
position, a carried accumulation window shorter than G and with no tokens or samples when it holds no
micro-batch, a consumed step inside the saved round). Before a rank
resumes, `check_against_shard` checks the position against the rank's own index order for the epoch: the
samples admitted before the round (`consumed`) are a prefix of it, the buffered ones are among them, and the
ones the round already emitted are among the buffered and the unread ones; what was emitted, buffered and
unread then partitions the shard exactly. Ranks that resume at different points fail at their first exchange
(`RankState.resumed_at`, `check_same_progress`). Every refusal names the field and what to do. Versions 1 and 2
(no digest) are still read, with the same range and shard checks.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from odb_core.sources import ShardedSampler

STATE_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MERGED_FORMAT = "merged"
# Fingerprint fields added after states were first written, with the behaviour those states had.
LEGACY_FINGERPRINT = {"planning": "local", "samples_per_step": None, "tokens_per_step": None}


class ElasticResumeError(ValueError):
    """A saved state cannot be continued at this world size without losing or repeating samples."""


class StateError(ValueError):
    """A loader state that is not a well-formed state dict; the message names the field."""


def _pop(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
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


def _ints(values: Any, where: str) -> tuple[int, ...]:
    if not isinstance(values, list | tuple) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise StateError(f"{where} must be a list of ints, got {str(values)[:80]}")
    return tuple(values)


def _at_least(value: int, low: int, where: str, why: str = "") -> None:
    if value < low:
        raise StateError(f"{where}={value} is out of range: it must be >= {low}{why}; the state is corrupt or was "
                         "edited: resume from another checkpoint")


def digest_of(state: Mapping[str, Any]) -> str:
    """sha256 of a state's canonical JSON, without its own `digest` field."""
    body = {k: v for k, v in state.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _no_leftovers(data: Mapping[str, Any], where: str) -> None:
    if data:
        raise StateError(f"unexpected keys in {where}: {sorted(data)}")


# -- index sources --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ShardedSource:
    """ODB's own `ShardedSampler` over a map-style dataset: any rank's order of any epoch can be recomputed."""

    kind: ClassVar[str] = "sharded"
    size: int
    shuffle: bool
    seed: int
    world_size: int

    def indices(self, rank: int, epoch: int) -> list[int]:
        return ShardedSampler(self.size, rank=rank, world_size=self.world_size, shuffle=self.shuffle,
                              seed=self.seed).with_epoch(epoch)

    def describe(self) -> str:
        return f"ODB's own sampler over {self.size} samples (shuffle={self.shuffle})"


@dataclass(frozen=True, slots=True)
class StreamSource:
    """An `IterableDataset` stream (`shard`: ODB deals stream positions to ranks; `parts`: the DataLoader workers
    it is read in when it splits itself over them, else 1; NOTE [ Streams that split themselves over workers ])."""

    kind: ClassVar[str] = "stream"
    shard: bool
    parts: int = 1

    def describe(self) -> str:
        return "an IterableDataset stream"


@dataclass(frozen=True, slots=True)
class CustomSource:
    """A user `sampler=` over a map-style dataset: its per-rank order is the user's, not recomputable here."""

    kind: ClassVar[str] = "custom"
    type: str
    size: int

    def describe(self) -> str:
        return f"a user sampler ({self.type})"


@dataclass(frozen=True, slots=True)
class RemainderPart:
    """What one old rank had not emitted: `buffer + source(rank)[consumed:] - emitted` (NOTE [ Elastic resume ])."""

    rank: int
    source: ShardedSource | RemainderSource
    consumed: int
    buffer: tuple[int, ...]
    emitted: tuple[int, ...]

    def remaining(self, epoch: int) -> list[int]:
        order = self.source.indices(self.rank, epoch)
        if Counter(self.buffer) - Counter(order[: self.consumed]):
            raise ElasticResumeError(f"state of rank {self.rank} is inconsistent: its buffer holds indices it had not "
                                     f"read by sample {self.consumed}; the state is corrupt or from other data")
        pool = list(self.buffer) + order[self.consumed:]
        emitted = Counter(self.emitted)
        remaining = []
        for index in pool:
            if emitted[index] > 0:
                emitted[index] -= 1
            else:
                remaining.append(index)
        if +emitted:
            raise ElasticResumeError(f"state of rank {self.rank} is inconsistent: it emitted indices "
                                     f"{sorted(+emitted)[:8]} that were neither buffered nor unread")
        return remaining


@dataclass(frozen=True, slots=True)
class RemainderSource:
    """The rest of an epoch after an elastic resume: old ranks' remaining lists, dealt to `world_size` ranks."""

    kind: ClassVar[str] = "remainder"
    world_size: int
    first_step: int
    first_round: int
    parts: tuple[RemainderPart, ...]

    def indices(self, rank: int, epoch: int) -> list[int]:
        """The old ranks' remaining lists interleaved round-robin in old-rank order, dealt round-robin."""
        lists = [part.remaining(epoch) for part in self.parts]
        merged = [lst[k] for k in range(max(map(len, lists), default=0)) for lst in lists if k < len(lst)]
        return merged[rank :: self.world_size]

    def describe(self) -> str:
        return f"the remainder of an elastically resumed epoch ({len(self.parts)} old ranks)"


Source = ShardedSource | StreamSource | CustomSource | RemainderSource
RECOMPUTABLE = (ShardedSource, RemainderSource)


def source_to_dict(source: Source) -> dict[str, Any]:
    if isinstance(source, RemainderSource):
        parts = [{"rank": p.rank, "source": source_to_dict(p.source), "consumed": p.consumed,
                  "buffer": list(p.buffer), "emitted": list(p.emitted)} for p in source.parts]
        return {"kind": source.kind, "world_size": source.world_size, "first_step": source.first_step,
                "first_round": source.first_round, "parts": parts}
    values = {name: getattr(source, name) for name in source.__slots__}  # type: ignore[union-attr]
    if isinstance(source, StreamSource) and source.parts == 1:
        del values["parts"]  # the layout of a stream read in one part is the one states had before `parts`
    return {"kind": source.kind, **values}


def source_from_dict(data: Any, where: str) -> Source:
    if not isinstance(data, Mapping):
        raise StateError(f"{where} must be a source descriptor (a dict with 'kind'), got {data!r}")
    data = dict(data)
    kind = _pop(data, "kind", str, where)
    if kind == "remainder":
        world, first_step = _pop(data, "world_size", int, where), _pop(data, "first_step", int, where)
        first_round, parts = _pop(data, "first_round", int, where), _pop(data, "parts", list, where)
        _no_leftovers(data, where)
        return RemainderSource(world_size=world, first_step=first_step, first_round=first_round,
                               parts=tuple(_part_from_dict(p, f"{where}.parts[{k}]") for k, p in enumerate(parts)))
    types = {"sharded": (ShardedSource, {"size": int, "shuffle": bool, "seed": int, "world_size": int}),
             "stream": (StreamSource, {"shard": bool}), "custom": (CustomSource, {"type": str, "size": int})}
    if kind not in types:
        raise StateError(f"{where}.kind={kind!r} is unknown (expected one of {sorted([*types, 'remainder'])})")
    cls, schema = types[kind]
    if kind == "stream" and "parts" in data:  # states saved before `parts` existed read one part
        schema = {**schema, "parts": int}
    values = {name: _pop(data, name, typ, where) for name, typ in schema.items()}
    _no_leftovers(data, where)
    return cls(**values)


def _part_from_dict(data: Any, where: str) -> RemainderPart:
    if not isinstance(data, Mapping):
        raise StateError(f"{where} must be a dict, got {data!r}")
    data = dict(data)
    source = source_from_dict(_pop(data, "source", dict, where), f"{where}.source")
    if not isinstance(source, RECOMPUTABLE):
        raise StateError(f"{where}.source is {source.describe()}, which a remainder cannot be built from")
    part = RemainderPart(rank=_pop(data, "rank", int, where), source=source, consumed=_pop(data, "consumed", int, where),
                         buffer=_ints(_pop(data, "buffer", list, where), f"{where}.buffer"),
                         emitted=_ints(_pop(data, "emitted", list, where), f"{where}.emitted"))
    _no_leftovers(data, where)
    return part


# -- positions ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RoundStart:
    """Where a round began: enough to replay it exactly in a new process (see NOTE [ Exact resume ])."""

    round: int
    steps_done: int
    consumed: int
    buffer: tuple[int, ...]
    carry_count: int
    carry_tokens: int
    dummy_index: int | None
    carry_samples: int = 0  # global samples of the open window (a step target in samples needs them)


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Replay from `start`, dropping the steps numbered below `steps_consumed` (already trained on).

    `round_emitted` lists this rank's indices in the consumed steps of that round (from `start.steps_done` up
    to `steps_consumed`); exact replay does not need it, elastic resume does (NOTE [ Elastic resume ])."""

    start: RoundStart
    steps_consumed: int
    round_emitted: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SavedPosition:
    """The last consumed step of an epoch: the round to replay, whether that step was the epoch's last
    (`complete`), and the metrics counters matching the replay point."""

    point: ResumePoint
    complete: bool
    metrics: Mapping[str, float | int] = field(default_factory=dict)
    window_open: int = 0  # micro-batches of an unfinished optimizer step consumed (0: at a step boundary)

    def to_dict(self) -> dict[str, Any]:
        start = self.point.start
        start_dict = {name: getattr(start, name) for name in RoundStart.__slots__}
        start_dict["buffer"] = list(start.buffer)
        return {"start": start_dict, "steps_consumed": self.point.steps_consumed,
                "round_emitted": list(self.point.round_emitted), "epoch_complete": self.complete,
                "window_open": self.window_open}

    @classmethod
    def from_dict(cls, data: Any, metrics: Mapping[str, float | int], where: str = "position") -> SavedPosition:
        if not isinstance(data, Mapping):
            raise StateError(f"{where} must be a dict or null, got {data!r}")
        data = dict(data)
        start = dict(_pop(data, "start", dict, where))
        values = {name: _pop(start, name, int, f"{where}.start") for name in
                  ("round", "steps_done", "consumed", "carry_count", "carry_tokens")}
        values["carry_samples"] = _pop(start, "carry_samples", int, f"{where}.start") if "carry_samples" in start else 0
        dummy = _pop(start, "dummy_index", (int, type(None)), f"{where}.start")
        buffer = _ints(_pop(start, "buffer", list, f"{where}.start"), f"{where}.start.buffer")
        _no_leftovers(start, f"{where}.start")
        point = ResumePoint(start=RoundStart(**values, buffer=buffer, dummy_index=dummy),
                            steps_consumed=_pop(data, "steps_consumed", int, where),
                            round_emitted=_ints(data.pop("round_emitted", []), f"{where}.round_emitted"))
        window_open = data.pop("window_open", 0)
        if not isinstance(window_open, int) or isinstance(window_open, bool) or window_open < 0:
            raise StateError(f"{where}.window_open={window_open!r} must be an int >= 0; the state is corrupt")
        complete = data.pop("epoch_complete", False)
        if not isinstance(complete, bool):
            raise StateError(f"{where}.epoch_complete={complete!r} must be true or false")
        _no_leftovers(data, where)
        for name, value in values.items():
            _at_least(value, 0, f"{where}.start.{name}")
        for name, indices in (("start.buffer", buffer), ("round_emitted", point.round_emitted)):
            if indices and min(indices) < 0:
                raise StateError(f"{where}.{name} holds a negative index {min(indices)}; the state is corrupt")
        _at_least(point.steps_consumed, values["steps_done"] + 1, f"{where}.steps_consumed",
                  f" (after at least one step of the round that began at step {values['steps_done']})")
        return cls(point=point, complete=complete, metrics=dict(metrics), window_open=window_open)


def start_of_remainder(plan: RemainderSource) -> ResumePoint:
    """Where a remainder epoch starts: step numbers and rounds continue the old run's, nothing buffered."""
    start = RoundStart(round=plan.first_round, steps_done=plan.first_step, consumed=0, buffer=(), carry_count=0,
                       carry_tokens=0, dummy_index=None)
    return ResumePoint(start=start, steps_consumed=plan.first_step)


# -- rank and merged states -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LoaderIdentity:
    """What a state must match to resume exactly on a loader: its world size, rank, batching config and source."""

    world_size: int
    rank: int
    config: Mapping[str, Any]
    source: Source


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderState:
    """One rank's position (NOTE [ Loader state ]). `source` is None only in version-1 states."""

    world_size: int
    rank: int
    config: Mapping[str, Any]
    source: Source | None
    epoch: int
    plan: RemainderSource | None
    position: SavedPosition | None
    metrics: Mapping[str, float | int]
    version: int = STATE_VERSION

    def progress(self) -> tuple[int, int]:
        """(epoch, steps consumed); a completed epoch counts as step 0 of the next one."""
        if self.position is None:
            return self.epoch, self.plan.first_step if self.plan is not None else 0
        if self.position.complete:
            return self.epoch + 1, 0
        return self.epoch, self.position.point.steps_consumed

    def to_dict(self) -> dict[str, Any]:
        state = {"version": STATE_VERSION, "world_size": self.world_size, "rank": self.rank,
                 "config": dict(self.config), "sampler": source_to_dict(self.source) if self.source else None,
                 "epoch": self.epoch, "plan": source_to_dict(self.plan) if self.plan is not None else None,
                 "position": self.position.to_dict() if self.position is not None else None,
                 "metrics": dict(self.metrics)}
        return {**state, "digest": digest_of(state)}

    @classmethod
    def from_dict(cls, data: Any) -> LoaderState:
        if not isinstance(data, Mapping):
            raise StateError(f"a loader state must be a dict (from state_dict()), got {type(data).__name__}")
        data = dict(data)
        version = data.get("version")
        if version not in READABLE_VERSIONS:
            raise StateError(f"loader state version {version!r} is not supported (expected {STATE_VERSION})")
        if version >= 3 and data.pop("digest", None) != digest_of(data):
            raise StateError("the loader state's digest does not match its content: it was truncated or edited "
                             "after it was saved; resume from another checkpoint (or from the epoch's start with "
                             "a fresh loader)")
        data.pop("version")
        world, rank = _pop(data, "world_size", int, "state"), _pop(data, "rank", int, "state")
        config, epoch = _pop(data, "config", dict, "state"), _pop(data, "epoch", int, "state")
        _at_least(world, 1, "state.world_size")
        _at_least(epoch, 0, "state.epoch")
        if not 0 <= rank < world:
            raise StateError(f"state.rank={rank} is out of range for world_size={world}; the state is corrupt")
        config = {**LEGACY_FINGERPRINT, **config}
        metrics = _pop(data, "metrics", dict, "state")
        bad = {k: v for k, v in metrics.items()
               if not isinstance(v, int | float) or isinstance(v, bool) or not v >= 0}
        if bad:
            raise StateError(f"state.metrics has values that are not counters (numbers >= 0): {bad}")
        source = source_from_dict(_pop(data, "sampler", dict, "state"), "state.sampler") if version >= 2 else None
        raw_plan = _pop(data, "plan", (dict, type(None)), "state") if version >= 2 else None
        plan = source_from_dict(raw_plan, "state.plan") if raw_plan is not None else None
        position = _pop(data, "position", (dict, type(None)), "state")
        _no_leftovers(data, "loader state")
        if plan is not None and not isinstance(plan, RemainderSource):
            raise StateError(f"state.plan must be a remainder descriptor, got {plan.describe()}")
        return cls(world_size=world, rank=rank, config=config, source=source, epoch=epoch, plan=plan,
                   position=SavedPosition.from_dict(position, metrics) if position is not None else None,
                   metrics=metrics, version=version)

    def check_against_shard(self, order: Sequence[int] | None, window: int, accumulation: int | None) -> None:
        """The saved position within this rank's index `order` for the epoch (None: a stream, unknown here):
        see NOTE [ A state proves itself ]. `accumulation` None: optimizer steps have a target size, so a carried
        window has no bound in micro-batches."""
        if self.position is None:
            return
        point, where = self.position.point, "state.position"
        start = point.start
        if accumulation is not None and start.carry_count >= accumulation:
            raise StateError(f"{where}.start.carry_count={start.carry_count} must be below accumulation_steps="
                             f"{accumulation}; the state is corrupt")
        if start.carry_count == 0 and (start.carry_tokens or start.carry_samples):
            raise StateError(f"{where}.start carries {start.carry_tokens} tokens and {start.carry_samples} samples "
                             "in an open window of 0 micro-batches; the state is corrupt")
        if len(start.buffer) > window:
            raise StateError(f"{where}.start.buffer holds {len(start.buffer)} samples, more than the window of "
                             f"{window}; the state is corrupt")
        if order is None:
            return
        if start.consumed > len(order):
            raise StateError(f"{where}.start.consumed={start.consumed} is past the end of this rank's "
                             f"{len(order)} samples of epoch {self.epoch}; the state is corrupt or from other data")
        extra = Counter(start.buffer) - Counter(order[: start.consumed])
        if extra:
            raise StateError(f"{where}.start.buffer holds {sorted(extra)[:8]} that this rank had not read by sample "
                             f"{start.consumed} of epoch {self.epoch} (or more often than read); the state is "
                             "corrupt or from other data")
        stray = Counter(point.round_emitted) - Counter(start.buffer) - Counter(order[start.consumed:])
        if stray:
            raise StateError(f"{where}.round_emitted holds {sorted(stray)[:8]} that were neither buffered nor unread "
                             "at the round's start; the state is corrupt or from other data")

    def check_resumable_by(self, loader: LoaderIdentity) -> None:
        """Refuse a state that an exact resume on `loader` cannot honour, naming what differs."""
        if self.world_size != loader.world_size:
            raise ElasticResumeError(
                f"loader state was saved by rank {self.rank} of a world of size {self.world_size}, but this "
                f"loader has world_size={loader.world_size}; to resume at another world size, collect every "
                "rank's state_dict() and load odb_core.resume.merge_states(states) on every new rank")
        saved, mine = self.source, loader.source
        if isinstance(saved, StreamSource) and isinstance(mine, StreamSource) and saved.parts != mine.parts:
            raise ValueError(
                f"loader state was saved reading the stream in {saved.parts} DataLoader worker part(s), this loader "
                f"reads it in {mine.parts}: a stream that splits itself over workers (an HF datasets stream with "
                f"shards) has an order fixed by num_workers, so resume with num_workers="
                f"{saved.parts if saved.parts > 1 else '0 or 1'}")
        checks = [("rank", self.rank, loader.rank), ("config", dict(self.config), dict(loader.config))]
        if self.source is not None:
            checks.append(("sampler", source_to_dict(self.source), source_to_dict(loader.source)))
        for key, saved, mine in checks:
            if saved != mine:
                raise ValueError(f"loader state was saved with {key}={saved!r} but this loader has {mine!r}; "
                                 "exact resume needs the same world size, rank, dataset, sampler and batching config")
