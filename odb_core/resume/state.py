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
A state is trusted only after it proved itself. Version 3 carries a `digest`: the sha256 of its canonical JSON, so a
truncated or hand-edited state is refused. `from_dict` checks every field's type and range (no negative position, a
carried accumulation window shorter than G and with no tokens or samples when it holds no micro-batch, a consumed
step inside the saved round). Before a rank resumes, `check_against_shard` checks the position against the rank's
own index order for the epoch: the samples admitted before the round (`consumed`) are a prefix of it, the buffered
ones and the IDLE dummy are among them, and the ones the round already emitted are among the buffered and the unread
ones; what was emitted, buffered and unread then partitions the shard exactly (a user sampler's order is checked as
`iter()` draws it, and the order and the replayed round's lengths against digests the state records: NOTE [ A resume
reads what the save read ] in replay.py). Ranks that resume at different points fail at their first exchange
(`RankState.resumed_at`, `check_same_progress`). Every refusal names the field and what to do. Versions 1 and 2 (no
digest) are still read, with the same range and shard checks.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from odb_core.resume.fields import (ElasticResumeError, StateError, at_least, digest_of, int_list, no_leftovers,
                                    pop_field)
from odb_core.resume.source_state import (RemainderSource, ShardedSource, Source, StreamSource, source_from_dict,
                                          source_to_dict)

STATE_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MERGED_FORMAT = "merged"
# Fingerprint fields added after states were first written, with the behaviour those states had.
LEGACY_FINGERPRINT = {"planning": "local", "samples_per_step": None, "tokens_per_step": None, "min_window": None,
                      "max_buffer_bytes": None, "nproc_per_node": None, "round_ends": None, "pool_window": None,
                      "round_growth": None}  # round_growth: None where min_window is, else 2.0 (from_dict)


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
    order_digest: str | None = None  # NOTE [ A resume reads what the save read ] in replay.py (None: not recorded)
    lengths_digest: str | None = None


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
        start_dict = {name: getattr(start, name) for name in RoundStart.__slots__  # a digest not recorded: absent
                      if getattr(start, name) is not None or not name.endswith("_digest")}
        start_dict["buffer"] = list(start.buffer)
        return {"start": start_dict, "steps_consumed": self.point.steps_consumed,
                "round_emitted": list(self.point.round_emitted), "epoch_complete": self.complete,
                "window_open": self.window_open}

    @classmethod
    def from_dict(cls, data: Any, metrics: Mapping[str, float | int], where: str = "position") -> SavedPosition:
        if not isinstance(data, Mapping):
            raise StateError(f"{where} must be a dict or null, got {data!r}")
        data = dict(data)
        start = dict(pop_field(data, "start", dict, where))
        values = {name: pop_field(start, name, int, f"{where}.start") for name in
                  ("round", "steps_done", "consumed", "carry_count", "carry_tokens")}
        has_samples = "carry_samples" in start
        values["carry_samples"] = pop_field(start, "carry_samples", int, f"{where}.start") if has_samples else 0
        dummy = pop_field(start, "dummy_index", (int, type(None)), f"{where}.start")
        buffer = int_list(pop_field(start, "buffer", list, f"{where}.start"), f"{where}.start.buffer")
        digests = {name: pop_field(start, name, (str, type(None)), f"{where}.start")  # absent: saved before them
                   for name in ("order_digest", "lengths_digest") if name in start}
        no_leftovers(start, f"{where}.start")
        point = ResumePoint(start=RoundStart(**values, buffer=buffer, dummy_index=dummy, **digests),
                            steps_consumed=pop_field(data, "steps_consumed", int, where),
                            round_emitted=int_list(data.pop("round_emitted", []), f"{where}.round_emitted"))
        window_open = data.pop("window_open", 0)
        if not isinstance(window_open, int) or isinstance(window_open, bool) or window_open < 0:
            raise StateError(f"{where}.window_open={window_open!r} must be an int >= 0; the state is corrupt")
        complete = data.pop("epoch_complete", False)
        if not isinstance(complete, bool):
            raise StateError(f"{where}.epoch_complete={complete!r} must be true or false")
        no_leftovers(data, where)
        for name, value in values.items():
            at_least(value, 0, f"{where}.start.{name}")
        for name, indices in (("start.buffer", buffer), ("round_emitted", point.round_emitted)):
            if indices and min(indices) < 0:
                raise StateError(f"{where}.{name} holds a negative index {min(indices)}; the state is corrupt")
        at_least(point.steps_consumed, values["steps_done"] + 1, f"{where}.steps_consumed",
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
        world, rank = pop_field(data, "world_size", int, "state"), pop_field(data, "rank", int, "state")
        config, epoch = dict(pop_field(data, "config", dict, "state")), pop_field(data, "epoch", int, "state")
        at_least(world, 1, "state.world_size")
        at_least(epoch, 0, "state.epoch")
        if not 0 <= rank < world:
            raise StateError(f"state.rank={rank} is out of range for world_size={world}; the state is corrupt")
        if "round_ends" not in config:  # saved before the rounds halved toward the end (NOTE [ Round sizes ])
            config["round_ends"] = None if config.get("min_window") is None else "min_window left"
        if "round_growth" not in config:  # saved before the field: rounds doubled wherever they grew
            config["round_growth"] = None if config.get("min_window") is None else 2.0
        config = {**LEGACY_FINGERPRINT, **config}
        metrics = pop_field(data, "metrics", dict, "state")
        bad = {k: v for k, v in metrics.items()
               if not isinstance(v, int | float) or isinstance(v, bool) or not v >= 0}
        if bad:
            raise StateError(f"state.metrics has values that are not counters (numbers >= 0): {bad}")
        source = source_from_dict(pop_field(data, "sampler", dict, "state"), "state.sampler") if version >= 2 else None
        raw_plan = pop_field(data, "plan", (dict, type(None)), "state") if version >= 2 else None
        plan = source_from_dict(raw_plan, "state.plan") if raw_plan is not None else None
        position = pop_field(data, "position", (dict, type(None)), "state")
        no_leftovers(data, "loader state")
        if plan is not None and not isinstance(plan, RemainderSource):
            raise StateError(f"state.plan must be a remainder descriptor, got {plan.describe()}")
        return cls(world_size=world, rank=rank, config=config, source=source, epoch=epoch, plan=plan,
                   position=SavedPosition.from_dict(position, metrics) if position is not None else None,
                   metrics=metrics, version=version)

    def check_against_shard(self, order: Sequence[int] | None, window: int, accumulation: int | None) -> None:
        """The saved position within this rank's index `order` for the epoch (None: a stream or a user sampler,
        whose order `iter()` checks as drawn): see NOTE [ A state proves itself ]. `accumulation` None: optimizer
        steps have a target size, so a carried window has no bound in micro-batches."""
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
        if order is not None:
            check_in_order(point, order, self.epoch)

    def check_resumable_by(self, loader: LoaderIdentity) -> None:
        """Refuse a state that an exact resume on `loader` cannot honour, naming what differs."""
        if self.world_size != loader.world_size:
            raise ElasticResumeError(
                f"loader state was saved by rank {self.rank} of a world of size {self.world_size}, but this "
                f"loader has world_size={loader.world_size}; to resume at another world size, collect every "
                "rank's state_dict() and load odb_core.resume.resume.merge_states(states) on every new rank")
        saved, mine = self.source, loader.source
        if isinstance(saved, StreamSource) and isinstance(mine, StreamSource) and saved.parts != mine.parts:
            raise ValueError(
                f"loader state was saved reading the stream in {saved.parts} DataLoader worker part(s), this loader "
                f"reads it in {mine.parts}: a stream that splits itself over workers (an HF datasets stream with "
                f"shards) has an order fixed by num_workers, so resume with num_workers="
                f"{saved.parts if saved.parts > 1 else '0 or 1'}")
        if isinstance(saved, StreamSource) and isinstance(mine, StreamSource) and saved.chunk and \
                saved.chunk != mine.chunk:
            raise ValueError(f"loader state was saved reading the stream's {saved.parts} worker parts in turns of "
                             f"{saved.chunk} samples, this loader reads turns of {mine.chunk}: the turns set the "
                             f"stream's order, so resume with fetch_chunk={saved.chunk}")
        elastic = isinstance(saved, ShardedSource) and isinstance(mine, ShardedSource) and \
            (saved.size, saved.shuffle, saved.seed) == (mine.size, mine.shuffle, mine.seed)
        _check_same_layout(self.config, loader.config, self.world_size, elastic)
        _check_same_config(self.config, loader.config)
        checks = [("rank", self.rank, loader.rank)]
        if self.source is not None:  # a stream's turns not recorded (a state saved before them) are not compared
            unknown = isinstance(saved, StreamSource) and isinstance(mine, StreamSource) and not saved.chunk
            mine = dataclasses.replace(mine, chunk=0) if unknown else mine
            checks.append(("sampler", source_to_dict(self.source), source_to_dict(mine)))
        for key, saved, mine in checks:
            if saved != mine:
                each = ("; every rank loads the state its own rank saved (a checkpoint that keeps one rank's state, "
                        "as DeepSpeed's client_state does outside ZeRO-3, cannot resume the others: save each "
                        "rank's with odb_core.resume.checkpoints.save_loader_state)") if key == "rank" else ""
                raise ValueError(f"loader state was saved with {key}={saved!r} but this loader has {mine!r}; "
                                 "exact resume needs the same world size, rank, dataset, sampler and batching config"
                                 + each)


def check_in_order(point: ResumePoint, order: Sequence[int], epoch: int) -> None:
    """The position within this rank's index `order` for `epoch`: the samples admitted before the round
    (`consumed`) are a prefix of it, the buffered ones and the IDLE dummy among them, and the ones the round
    already emitted among the buffered and the unread ones (NOTE [ A state proves itself ] in state.py)."""
    start, where = point.start, "state.position"
    if start.consumed > len(order):
        raise StateError(f"{where}.start.consumed={start.consumed} is past the end of this rank's "
                         f"{len(order)} samples of epoch {epoch}; the state is corrupt or from other data")
    read = Counter(order[: start.consumed])
    extra = Counter(start.buffer) - read
    if extra:
        raise StateError(f"{where}.start.buffer holds {sorted(extra)[:8]} that this rank had not read by sample "
                         f"{start.consumed} of epoch {epoch} (or more often than read); the state is "
                         "corrupt or from other data")
    if start.dummy_index is not None and start.dummy_index not in read:
        raise StateError(f"{where}.start.dummy_index={start.dummy_index} is not a sample this rank had read by sample "
                         f"{start.consumed} of epoch {epoch}; the state is corrupt or from other data")
    stray = Counter(point.round_emitted) - Counter(start.buffer) - Counter(order[start.consumed:])
    if stray:
        raise StateError(f"{where}.round_emitted holds {sorted(stray)[:8]} that were neither buffered nor unread "
                         "at the round's start; the state is corrupt or from other data")



def describe_layout(per_node: int | None, world: int) -> str:
    """A fingerprint's `nproc_per_node` in words: node-aware rounds on several nodes, or one pool."""
    if per_node is None:
        return f"one pool over {world} rank{'s' * (world > 1)} (one node, or planning='cluster')"
    return f"{world // per_node} nodes of {per_node} rank{'s' * (per_node > 1)}"


def _check_same_layout(saved: Mapping[str, Any], mine: Mapping[str, Any], world: int, elastic: bool) -> None:
    """Refuse a state whose node layout (node-aware rounds) is not this loader's, naming both; `elastic`: the saved
    source's order can be recomputed on another layout (a map-style dataset with ODB's own sampler)."""
    if saved.get("nproc_per_node") != mine.get("nproc_per_node"):
        other = ("resume elastically on this one: load odb_core.resume.resume.merge_states(every rank's state) on "
                 "every rank" if elastic else "nothing else: an elastic resume, which plans the rest on another "
                 "layout, needs a map-style dataset read with ODB's own sampler, the same dataset and shuffle as "
                 "saved, and a state that records them")
        raise ValueError(f"loader state was saved with {describe_layout(saved.get('nproc_per_node'), world)}, this "
                         f"loader runs {describe_layout(mine.get('nproc_per_node'), world)}: an exact resume replays "
                         "the saved round on the same nodes. Launch on the saved layout (ODBConfig.nproc_per_node, or "
                         f"the launcher's LOCAL_WORLD_SIZE), or {other}")


def _check_same_config(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Refuse a state saved with other batching settings, naming each field that differs (a field added later
    reads as the value states had before it, `LEGACY_FINGERPRINT`: such a state resumes with that value)."""
    if saved.get("round_ends") == "min_window left" and mine.get("round_ends") is not None:
        raise ValueError("loader state was saved by an earlier odb, whose last round of an epoch left `min_window` "
                         "samples; this odb halves the last rounds (NOTE [ Round sizes ] in "
                         "odb_core/planning/round_sizes.py), so it cannot replay the saved round exactly. Resume "
                         "with the odb that saved the state, or start the epoch anew with a fresh loader")
    differ = sorted(set(saved) | set(mine), key=lambda k: (k not in mine, k))
    differ = [k for k in differ if saved.get(k) != mine.get(k) and k != "round_ends"]  # round_ends: min_window's
    if differ:
        fields = ", ".join(f"{k}={saved.get(k)!r} (this loader: {mine.get(k)!r})" for k in differ)
        raise ValueError(f"loader state was saved with {fields}; exact resume needs the same batching config: "
                         f"build the loader with {', '.join(f'{k}={saved.get(k)!r}' for k in differ)}")
