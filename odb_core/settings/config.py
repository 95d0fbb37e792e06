"""The one configuration object of the engine.

`ODBConfig` is frozen and checked at construction: a bad value raises `ValueError` naming the field, the value
and the allowed range. There are no aliases and no environment-variable knobs; every behaviour is a field here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

CostName = Literal["padded", "tokens", "attention"]
OversizePolicy = Literal["alone", "error"]
Planning = Literal["global", "cluster", "local"]
MoveMode = Literal["auto", "send", "fetch"]
COST_NAMES: tuple[str, ...] = ("padded", "tokens", "attention")
OVERSIZE_POLICIES: tuple[str, ...] = ("alone", "error")
PLANNINGS: tuple[str, ...] = ("global", "cluster", "local")
MOVE_MODES: tuple[str, ...] = ("auto", "send", "fetch")


# The fields that decide which samples share a step: a saved state records them, and ranks must agree on them
# (`fingerprint` adds the node layout as it acts: `nproc_per_node`).
FINGERPRINT = ("token_budget", "cost", "attention_alpha", "max_patches", "max_batch_size", "window", "min_window",
               "round_growth", "pool_window", "max_buffer_bytes", "join", "accumulation_steps", "samples_per_step",
               "tokens_per_step", "planning", "seed", "shuffle_steps")


# How the rounds of a known-length stream end (NOTE [ Round sizes ]), in every state's fingerprint: states saved
# without it left `min_window` samples for the last round, which a replay here cannot reproduce (resume/state.py).
ROUND_ENDS = "halving"
# The least `window` and `min_window` a rank's rounds shrink to under `pool_window` (NOTE [ Pooled round sizes ]).
POOL_WINDOW_FLOOR, POOL_MIN_WINDOW_FLOOR = 64, 32


def _require(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"ODBConfig.{field}={value!r} is invalid: {allowed}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True, slots=True)
class ODBConfig:
    """Everything that decides which samples share a step.

    Batches are a function of (seed, epoch, data, world size, this config) only.

    Fields:
        token_budget: `L_max`, the cost ceiling of one micro-batch on one rank (see `cost`).
        cost: how a group's cost is measured. `padded`: B x max_len (padded collators, the paper's model);
            `tokens`: sum of lengths (padding-free / flattening collators); `attention`:
            B x max_len + attention_alpha x B x max_len^2 (quadratic attention term).
        attention_alpha: weight of the quadratic term for `cost="attention"`, in budget units per token^2.
        max_patches: optional cap on vision patches (rows of `pixel_values`) per group.
        max_batch_size: optional cap on samples per group (for collators or kernels with a hard batch limit).
        window: samples buffered per rank before grouping. Bounds memory; larger comes closer to the oracle.
        min_window: the smallest round (NOTE [ Round sizes ] in planning/round_sizes.py). An epoch's first round
            plans once `min_window` samples are buffered, and each round doubles it up to `window`, so the first
            step comes after `min_window` samples are processed instead of `window`; when this rank's stream has a
            known length (map-style data), the rounds shrink again toward `min_window` as its end nears, so the last
            round's steps, which no reading can overlap, are short. None: every round fills `window` (the only
            behaviour before this field; states saved then resume with min_window=None).
        round_growth: how much larger each round is than the one before while the rounds grow from `min_window`
            to `window` (NOTE [ Round sizes ]): 2 doubles them (the default). The device waits for each growing
            round's reading unless the workers read it while the round before trains, that is, unless they are at
            least `round_growth` times as fast as the device; a smaller value (e.g. 1.25) keeps the device fed
            where the workers are only a little faster than it (`odb/data_wait_reading_fraction` high early in an
            epoch), for more, smaller rounds that pack a little less tightly (docs/benchmarks.md, "A gentler
            ramp"). A number > 1 and <= 1024.
        pool_window: under pooled planning (`global`, node-aware or not, and `cluster`, at W > 1) the most samples
            one plan pools: when the pooled ranks x `window` exceed it, each rank's `window` and `min_window` shrink
            by the same factor (to at least 64 and 32, neither above its own value), so the pool packs as tightly
            as a window of this size while each rank reads fewer samples per round (NOTE [ Pooled round sizes ] in
            planning/round_sizes.py): the first step comes sooner and less of an epoch's end waits for a round to
            be read. The default, 8,192,
            acts from W = 3 at the default `window` (W = 4: 2,048 and 128 per rank). None: every rank keeps
            `window` and `min_window`.
        max_buffer_bytes: a bound on the bytes of the tensor payloads (tensors, arrays) of the samples buffered on
            one rank, beside `window`: a fill stops at the sample that reaches it (docs/design.md, "Keeping the
            accelerator fed"). The default, 1 GiB, holds ~500 samples of a VLM pipeline averaging 2 MB of
            `pixel_values`; text samples weigh a few kB, so `window` binds first. None: no bound in bytes. A rank
            holds a round's samples until their steps are taken and meanwhile reads the next fill's ahead, a share
            per step: about the bound in all (at most twice it), plus the DataLoader's prefetch. A bound of a few
            samples makes every round a few samples: more steps, and under `join=False` an epoch that may end
            early.
        join: True drains every rank (each sample exactly once per epoch); False stops at the shortest rank.
        oversize: a single sample whose cost exceeds the budget either runs `alone` in its own group (counted in
            metrics) or raises an `error` naming its index.
        accumulation_steps: gradient-accumulation micro-batches per optimizer step. Epochs end on a multiple of
            it, and `StepInfo.window_tokens` sums the supervised tokens of each aligned window.
        samples_per_step: optional target of global samples per optimizer step (every rank, every micro-batch).
            The loader closes each optimizer step at the micro-batch boundary nearest the target (NOTE [ Steps
            of a target size ] in accumulation.py): a variable number of micro-batches, the same on every rank.
            Needs accumulation_steps=1; exclusive with tokens_per_step.
        tokens_per_step: the same with a target of global supervised tokens per optimizer step.
        planning: `global` (default) plans each round over every rank's buffered samples and deals the groups
            to the ranks (NOTE [ Pooled rounds ]; samples move between ranks); when the ranks span several nodes
            (`nproc_per_node`), each node pools and plans its own ranks' samples and the nodes only align their
            step counts, so no sample crosses a node (NOTE [ Node-aware rounds ]); on one node it is the same
            plan. `cluster` pools every rank's samples in one plan even across nodes (samples move over the
            network). `local` plans each rank's window alone and only aligns the step counts. All are the same at
            world size 1.
        nproc_per_node: ranks per node for `planning="global"` (rank r is on node r // nproc_per_node, torchrun's
            numbering); it must divide the world size. None (default): the launcher's `LOCAL_WORLD_SIZE`, read by
            the loader at construction as torchrun sets it (one node where it is not set). Ranks must agree on it.
        move: how a sample reaches another rank under global planning: `send` the processed sample over the
            metadata group, `fetch` re-read its index on the receiving rank (map-style datasets only; the
            sample's processing runs again there), `auto` chooses per dataset kind (docs/design.md).
        seed: seed of the sampler shuffle and of the in-round step order.
        shuffle_steps: shuffle the order of a round's steps (identically on every rank, so pairing is kept).
        prefetch_steps: 0 (default) plans and collates in the thread that iterates the loader; N > 0 runs that
            work in a background thread, up to N batches ahead. Measured (docs/benchmarks.md "The loader's hot
            path"), the thread rarely pays on CPython: its Python work holds the GIL that the training thread
            needs back after every operator call, and it can run at most N batches ahead of a round's reading.
            It helped where `__getitem__` tokenizes (the tokenizer releases the GIL) and there are no workers.
        fetch_chunk: samples per worker fetch (cuts inter-process overhead; does not change the batches, except
            for a stream that splits itself over workers, an HF datasets stream with shards, whose order is the
            workers' turns of this many samples: a resume needs the same value). Reads in the trainer process
            (`num_workers=0`) take at least 64 at a time.
        reader_thread: with workers, read their results (pipe reads, unpickling, unpacking) in a reader thread
            that runs while the training thread waits for its device (NOTE [ A thread reads the workers ] in
            epoch/reader_thread.py); False reads them in the iterating thread, between steps. Does not change the
            batches.
        collate_ahead: collate the step after the one just taken in a thread while the consumer trains (NOTE [
            Collating the next step ahead ] in epoch/collate_ahead.py): with `PadCollator`, e.g. a VLM step's
            `pixel_values` concatenation. Does not change the batches; off with `prefetch_steps > 0`.
        plan_ahead: once the consumer takes a round's last step, run the next round (its last reads, exchanges,
            plan and first collation) in a thread while that step trains (NOTE [ Planning the next round ahead ]
            in epoch/plan_ahead.py). Does not change the batches; off with `prefetch_steps > 0`; every rank must set the
            same value.
        overlap_moves: under global planning with `move="send"`, move a round's samples between ranks on a Gloo
            group and a thread of their own while its steps train (NOTE [ Moves overlap training ] in
            ranks/moves_ahead.py); False moves them before the round's first step. Does not change the batches;
            every rank must set the same value.
        shared_memory_moves: on the move lane, pass a moved tensor that already lies in a shared-memory file
            (what DataLoader workers send over the pipe's limit: images) to a rank of the same host by a handle to
            that file instead of its bytes (NOTE [ Moving shared tensors by handle ] in ranks/shared_handles.py):
            nothing copied or sent. Does not change the batches; ranks may differ.
        worker_regions: each DataLoader worker writes its samples' large top-level tensors into one shared region
            it reuses, which the rank maps once, instead of a shared-memory file per tensor (NOTE [ A worker's
            region ] in data/worker_region.py): less CPU per image on both sides. Does not change the batches;
            ranks may differ. Its pages stay reserved while the worker lives (max_buffer_bytes a rank together,
            at least 64 MiB a worker). Faster on this project's VLM rows at W = 1, somewhat under global planning
            at W = 2 (a moved image is used in place by its receiver), mixed with planning="local" at W = 2;
            measured on one 2-core machine only. On by default; False gives each large tensor a shared-memory file
            of its own, freed after its step.
        sync_timeout_s: how long a Gloo collective waits for a live peer that does not take part (a peer may pause
            legitimately: a checkpoint save, an evaluation); then it raises. A dead peer raises at once.
        liveness_timeout_s: a peer whose heartbeat stops this long (frozen, hung, unreachable) makes a waiting
            collective raise (NOTE [ Liveness ]).
        worker_timeout_s: timeout of one worker fetch (0 = no timeout). A dead worker is reported regardless,
            as a `WorkerDiedError` within seconds (NOTE [ A rank watches its workers ] in epoch/watch.py).
    """

    token_budget: int
    cost: CostName = "padded"
    attention_alpha: float = 0.0
    max_patches: int | None = None
    max_batch_size: int | None = None
    window: int = 4096
    min_window: int | None = 256
    round_growth: float = 2.0
    pool_window: int | None = 8192
    max_buffer_bytes: int | None = 1 << 30
    join: bool = True
    oversize: OversizePolicy = "alone"
    accumulation_steps: int = 1
    samples_per_step: int | None = None
    tokens_per_step: int | None = None
    planning: Planning = "global"
    nproc_per_node: int | None = None
    move: MoveMode = "auto"
    seed: int = 0
    shuffle_steps: bool = True
    prefetch_steps: int = 0
    fetch_chunk: int = 8
    reader_thread: bool = True
    collate_ahead: bool = True
    plan_ahead: bool = True
    overlap_moves: bool = True
    shared_memory_moves: bool = True
    worker_regions: bool = True
    sync_timeout_s: float = 300.0
    liveness_timeout_s: float = 30.0
    worker_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        _require(_is_int(self.token_budget) and self.token_budget > 0, "token_budget", self.token_budget,
                 "it must be a positive int (tokens per micro-batch per rank), e.g. 16384")
        _require(self.cost in COST_NAMES, "cost", self.cost, f"choose one of {COST_NAMES}")
        _require(_is_number(self.attention_alpha) and self.attention_alpha >= 0, "attention_alpha",
                 self.attention_alpha, "it must be >= 0")
        _require(self.cost == "attention" or self.attention_alpha == 0, "attention_alpha", self.attention_alpha,
                 "it only applies to cost='attention'; leave it at 0 or set cost='attention'")
        _require(self.max_patches is None or (_is_int(self.max_patches) and self.max_patches > 0),
                 "max_patches", self.max_patches, "it must be None or a positive int")
        _require(self.max_batch_size is None or (_is_int(self.max_batch_size) and self.max_batch_size > 0),
                 "max_batch_size", self.max_batch_size, "it must be None or a positive int")
        _require(_is_int(self.window) and self.window >= 1, "window", self.window,
                 "it must be an int >= 1 (samples buffered per rank); the default 4096 is near the oracle")
        _require(self.min_window is None or (_is_int(self.min_window) and self.min_window >= 1), "min_window",
                 self.min_window, "it must be None (every round fills `window`) or an int >= 1 (the first round's "
                 "samples; the default 256 starts training after 256 processed samples)")
        _require(_is_number(self.round_growth) and 1 < self.round_growth <= 1024, "round_growth", self.round_growth,
                 "it must be a number > 1 and <= 1024 (each growing round's size over the one before; 2 doubles "
                 "them)")
        _require(self.pool_window is None or (_is_int(self.pool_window) and self.pool_window >= 1), "pool_window",
                 self.pool_window, "it must be None (each rank keeps `window`) or an int >= 1 (samples one pooled "
                 "plan holds at most, e.g. 8192)")
        _require(self.max_buffer_bytes is None or (_is_int(self.max_buffer_bytes) and self.max_buffer_bytes >= 1),
                 "max_buffer_bytes", self.max_buffer_bytes, "it must be None (no bound) or an int >= 1 (bytes of "
                 "buffered tensor payloads per rank, e.g. 1 << 30)")
        _require(isinstance(self.join, bool), "join", self.join, "it must be True (drain all) or False (quota)")
        _require(self.oversize in OVERSIZE_POLICIES, "oversize", self.oversize,
                 f"choose one of {OVERSIZE_POLICIES}")
        _require(_is_int(self.accumulation_steps) and self.accumulation_steps >= 1, "accumulation_steps",
                 self.accumulation_steps, "it must be an int >= 1")
        for name in ("samples_per_step", "tokens_per_step"):
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and value > 0), name, value, "it must be None or a positive int")
            _require(value is None or self.accumulation_steps == 1, name, value,
                     f"a step target sets the number of micro-batches per optimizer step itself; leave "
                     f"accumulation_steps at 1 (it is {self.accumulation_steps})")
        _require(self.samples_per_step is None or self.tokens_per_step is None, "tokens_per_step",
                 self.tokens_per_step, "set samples_per_step or tokens_per_step, not both")
        _require(self.planning in PLANNINGS, "planning", self.planning,
                 f"choose one of {PLANNINGS}: 'global' pools each node's samples, 'cluster' every rank's, 'local' "
                 "plans each rank alone")
        _require(self.nproc_per_node is None or (_is_int(self.nproc_per_node) and self.nproc_per_node >= 1),
                 "nproc_per_node", self.nproc_per_node, "it must be None (the launcher's LOCAL_WORLD_SIZE) or an "
                 "int >= 1 that divides the world size")
        _require(self.move in MOVE_MODES, "move", self.move, f"choose one of {MOVE_MODES}")
        _require(_is_int(self.seed), "seed", self.seed, "it must be an int")
        _require(isinstance(self.shuffle_steps, bool), "shuffle_steps", self.shuffle_steps, "it must be True or False")
        _require(_is_int(self.prefetch_steps) and self.prefetch_steps >= 0, "prefetch_steps",
                 self.prefetch_steps, "it must be an int >= 0 (0 = no background thread)")
        _require(_is_int(self.fetch_chunk) and self.fetch_chunk >= 1, "fetch_chunk", self.fetch_chunk,
                 "it must be an int >= 1")
        _require(isinstance(self.reader_thread, bool), "reader_thread", self.reader_thread, "it must be True or False")
        _require(isinstance(self.collate_ahead, bool), "collate_ahead", self.collate_ahead, "it must be True or False")
        _require(isinstance(self.plan_ahead, bool), "plan_ahead", self.plan_ahead, "it must be True or False")
        _require(isinstance(self.overlap_moves, bool), "overlap_moves", self.overlap_moves, "it must be True or False")
        _require(isinstance(self.shared_memory_moves, bool), "shared_memory_moves", self.shared_memory_moves,
                 "it must be True or False")
        _require(isinstance(self.worker_regions, bool), "worker_regions", self.worker_regions,
                 "it must be True or False")
        _require(_is_number(self.sync_timeout_s) and self.sync_timeout_s > 0, "sync_timeout_s", self.sync_timeout_s,
                 "it must be > 0 seconds")
        _require(_is_number(self.liveness_timeout_s) and self.liveness_timeout_s > 0, "liveness_timeout_s",
                 self.liveness_timeout_s, "it must be > 0 seconds")
        _require(_is_number(self.worker_timeout_s) and self.worker_timeout_s >= 0, "worker_timeout_s",
                 self.worker_timeout_s, "it must be >= 0 seconds (0 = no timeout)")

    def rounds_for_pool(self, ranks: int) -> ODBConfig:
        """This config as the rounds of a plan that pools `ranks` ranks' buffers run it (NOTE [ Pooled round sizes ]
        in planning/round_sizes.py): `window` and `min_window` shrunk by the factor that keeps ranks x `window`
        within `pool_window`, or this config itself where `pool_window` does not act."""
        window = self._pooled_window(ranks)
        if window == self.window:
            return self
        smallest = self.min_window
        if smallest is not None:
            smallest = max(min(POOL_MIN_WINDOW_FLOOR, smallest), -(-smallest * window // self.window))
        return replace(self, window=window, min_window=smallest)

    def _pooled_window(self, ranks: int) -> int:
        bound = self.pool_window
        if bound is None or self.planning == "local" or ranks <= 1 or ranks * self.window <= bound:
            return self.window
        return max(min(POOL_WINDOW_FLOOR, self.window), -(-bound // ranks))

    @property
    def step_target(self) -> tuple[str, int] | None:
        """("samples" | "tokens", amount) when optimizer steps have a target size, else None (G micro-batches)."""
        if self.samples_per_step is not None:
            return ("samples", self.samples_per_step)
        if self.tokens_per_step is not None:
            return ("tokens", self.tokens_per_step)
        return None


class Layout(Protocol):
    """What `fingerprint` needs of a run's node layout (`planning.nodes.NodeLayout`)."""

    @property
    def per_node(self) -> int: ...  # the ranks one plan pools under global planning (the world on one node)

    @property
    def aware_per_node(self) -> int | None: ...  # the ranks per node of node-aware rounds, else None


def given_config(token_budget: int | None, config: ODBConfig | None, fields_given: dict[str, Any]) -> ODBConfig:
    """A loader's one `ODBConfig`: passed whole as `config=`, or built from `token_budget=` and other field names."""
    if config is None:
        if token_budget is None:
            raise TypeError("ODBDataLoader needs token_budget=... (tokens per micro-batch per rank) or config=")
        return ODBConfig(token_budget=token_budget, **fields_given)
    if token_budget is not None or fields_given:
        raise TypeError("pass either config=ODBConfig(...) or individual config fields, not both")
    return config


def fingerprint(config: ODBConfig, layout: Layout | None = None) -> dict[str, object]:
    """The `FINGERPRINT` fields of `config` as they act: `min_window` reads None when it does not shrink any round
    (`min_window >= window`), so such a state resumes on a loader with either value. `planning` reads `global` for
    `cluster` (one pool over every rank, which is what `global` is on one node and was on several before
    node-aware rounds), `round_ends` is `ROUND_ENDS` while `min_window` shrinks rounds, and `nproc_per_node` is the
    ranks per node of node-aware rounds over more than one node
    (`layout.aware_per_node`), else None: states saved on one node, or before the field, resume alike.
    `pool_window` reads None where it shrinks no round (at `layout.per_node` pooled ranks), so states saved before
    the field resume wherever it does not act; `round_growth` reads None where `min_window` reads None (no round
    grows)."""
    values: dict[str, object] = {name: getattr(config, name) for name in FINGERPRINT}
    if layout is None or config.rounds_for_pool(layout.per_node) is config:
        values["pool_window"] = None
    node_ranks = None if layout is None else layout.aware_per_node
    if config.min_window is not None and config.min_window >= config.window:
        values["min_window"] = None
    values["round_ends"] = None if values["min_window"] is None else ROUND_ENDS
    values["round_growth"] = None if values["min_window"] is None else float(config.round_growth)
    if config.planning == "cluster":
        values["planning"] = "global"
    values["nproc_per_node"] = node_ranks if config.planning == "global" else None
    return values
