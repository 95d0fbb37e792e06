"""The index source a saved state records: which sampler order a rank read, typed, to and from plain JSON.

Only `ShardedSource` and `RemainderSource` can be recomputed for another rank, which is what elastic resume needs
(NOTE [ Elastic resume ] in resume.py); a stream or a custom sampler can only be resumed by the rank that read it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from odb_core.data.samplers import ShardedSampler
from odb_core.resume.fields import ElasticResumeError, StateError, int_list, no_leftovers, pop_field


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
    it is read in when it splits itself over them, else 1; `chunk`: then the samples of each worker's turn, which
    set the stream's order with `parts`, 0 where not recorded; NOTE [ Streams that split themselves over workers ])."""

    kind: ClassVar[str] = "stream"
    shard: bool
    parts: int = 1
    chunk: int = 0

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
    if isinstance(source, StreamSource) and not source.chunk:
        del values["chunk"]  # not recorded: read in one part, or saved before `chunk`
    return {"kind": source.kind, **values}


def source_from_dict(data: Any, where: str) -> Source:
    if not isinstance(data, Mapping):
        raise StateError(f"{where} must be a source descriptor (a dict with 'kind'), got {data!r}")
    data = dict(data)
    kind = pop_field(data, "kind", str, where)
    if kind == "remainder":
        world, first_step = pop_field(data, "world_size", int, where), pop_field(data, "first_step", int, where)
        first_round, parts = pop_field(data, "first_round", int, where), pop_field(data, "parts", list, where)
        no_leftovers(data, where)
        return RemainderSource(world_size=world, first_step=first_step, first_round=first_round,
                               parts=tuple(_part_from_dict(p, f"{where}.parts[{k}]") for k, p in enumerate(parts)))
    types = {"sharded": (ShardedSource, {"size": int, "shuffle": bool, "seed": int, "world_size": int}),
             "stream": (StreamSource, {"shard": bool}), "custom": (CustomSource, {"type": str, "size": int})}
    if kind not in types:
        raise StateError(f"{where}.kind={kind!r} is unknown (expected one of {sorted([*types, 'remainder'])})")
    cls, schema = types[kind]
    if kind == "stream":  # states saved before `parts` existed read one part; `chunk` is there with parts > 1
        schema = {**schema, **{name: int for name in ("parts", "chunk") if name in data}}
    values = {name: pop_field(data, name, typ, where) for name, typ in schema.items()}
    no_leftovers(data, where)
    return cls(**values)


def _part_from_dict(data: Any, where: str) -> RemainderPart:
    if not isinstance(data, Mapping):
        raise StateError(f"{where} must be a dict, got {data!r}")
    data = dict(data)
    source = source_from_dict(pop_field(data, "source", dict, where), f"{where}.source")
    if not isinstance(source, RECOMPUTABLE):
        raise StateError(f"{where}.source is {source.describe()}, which a remainder cannot be built from")
    part = RemainderPart(rank=pop_field(data, "rank", int, where), source=source,
                         consumed=pop_field(data, "consumed", int, where),
                         buffer=int_list(pop_field(data, "buffer", list, where), f"{where}.buffer"),
                         emitted=int_list(pop_field(data, "emitted", list, where), f"{where}.emitted"))
    no_leftovers(data, where)
    return part
