"""Every batching method of the comparison, each a function from a `Setting` to a `Schedule` (or `Unavailable`).

All methods see the same lengths, world size, budget and seed. Online methods read the same per-rank streams
(ODB's own sampler: one seeded permutation, rank r taking positions r, r+W, ...); methods that build a global list
of batches are sharded fairly by dealing batch k to rank k mod W. The reference release runs in its own
environment (`reference_peer`); everything else runs here, from the installed packages:

  standard          fixed batch B = L_max // longest sample, random order (the HF Trainer default)
  sorted            global sort by length, fixed batches of B, batch order shuffled
  group_by_length   `transformers.trainer_pt_utils.LengthGroupedSampler` with the same B
  hf_batch_rebalance  HF BatchRebalanceSampler, if the installed transformers has it
  deepspeed_*       DeepSpeed data efficiency `batch_by_seqlens` (variable batch size, token-sum cap), offline
  packing           padding-free packing: random order, next-fit under sum(len) <= L_max (for
                    `DataCollatorWithFlattening`)
  oracle_*          offline global sort + greedy fill (`benchmarks.lib.oracle.oracle_groups`) under each cost model
  odb_*             ODB's own planning code on W virtual ranks (`odb_core.planning.simulate`, as `odb plan` runs it), with
                    the default config: global planning at W > 1 (NOTE [ Pooled rounds ]); `odb_*_local` the same
                    with `planning="local"` (each rank plans its own samples). Identical at W = 1.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks.comparison.schedule import CostModel, Group, Schedule, deal_round_robin
from benchmarks.lib.oracle import oracle_groups
from odb_core import ODBConfig, simulate_epoch
from odb_core.data.sharding import shard
from odb_core.planning.budget import Item, build_budget
from odb_core.planning.simulate import is_pooled

DS_CHECK_SAMPLES = 600  # prefix on which our O(n) replay is checked against DeepSpeed's O(n^2) function


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """What every method is given."""

    lengths: Sequence[int]
    world_size: int
    token_budget: int
    attention_alpha: float
    seed: int = 0
    # ODB's smallest round (NOTE [ Round sizes ]): its default, or None for rounds of the full window only
    min_window: int | None = ODBConfig.__dataclass_fields__["min_window"].default


@dataclass(frozen=True, slots=True)
class Unavailable:
    """A peer that could not run here, and why (reported as such, never silently dropped)."""

    reason: str


def fixed_batch(lengths: Sequence[int], token_budget: int) -> int:
    """Standard's batch: the largest B whose padded batch fits L_max even for the longest sample."""
    return max(token_budget // max(lengths), 1)


def chunks(order: Sequence[int], size: int) -> list[Group]:
    return [tuple(order[i : i + size]) for i in range(0, len(order), size)]


def permutation(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def standard(s: Setting) -> Schedule:
    order = permutation(len(s.lengths), s.seed)
    return deal_round_robin(chunks(order, fixed_batch(s.lengths, s.token_budget)), s.world_size)


def sorted_batches(s: Setting) -> Schedule:
    order = sorted(range(len(s.lengths)), key=lambda i: (-s.lengths[i], i))
    batches = chunks(order, fixed_batch(s.lengths, s.token_budget))
    random.Random(s.seed).shuffle(batches)
    return deal_round_robin(batches, s.world_size)


def group_by_length(s: Setting) -> Schedule:
    from transformers.trainer_pt_utils import LengthGroupedSampler

    batch = fixed_batch(s.lengths, s.token_budget)
    sampler = LengthGroupedSampler(batch, lengths=list(s.lengths),
                                   generator=torch.Generator().manual_seed(s.seed))
    return deal_round_robin(chunks(list(iter(sampler)), batch), s.world_size)


def hf_batch_rebalance(s: Setting) -> Schedule | Unavailable:
    import transformers
    from transformers import trainer_pt_utils

    if not any(hasattr(m, "BatchRebalanceSampler") for m in (transformers, trainer_pt_utils)):
        return Unavailable(f"transformers {transformers.__version__} has no BatchRebalanceSampler")
    raise NotImplementedError("BatchRebalanceSampler appeared in this transformers: wire it up here")


def next_fit_tokens(order: Sequence[tuple[int, int]], max_tokens: int) -> list[Group]:
    """Cut (index, length) pairs, in the given order, into groups whose token sum stays within `max_tokens`."""
    groups: list[Group] = []
    current: list[int] = []
    total = 0
    for i, n in order:
        if current and total + n > max_tokens:
            groups.append(tuple(current))
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        groups.append(tuple(current))
    return groups


# -- DeepSpeed ---------------------------------------------------------------------------------------------------
def _ds_microbatches(lengths: Sequence[int], max_tokens: int, order: str, seed: int, multiple: int) -> list[Group]:
    """`batch_by_seqlens(..., min_batch_size=1, max_batch_size=None, effective_batch_size=multiple)` in O(n).

    DeepSpeed's loop tries every end position (O(n^2) slices), keeping the last one whose token sum fits; since
    the sum grows with the end position that is a next-fit. Its end position never reaches the last sample, so
    the last sample in picking order is never batched; then the micro-batch list is trimmed to a multiple of the
    effective batch size. This replay keeps both behaviours and is checked against DeepSpeed on a prefix."""
    metrics = [(n, i) for i, n in enumerate(lengths) if n <= max_tokens]
    if order == "random":
        random.Random(seed).shuffle(metrics)
    elif order == "seqlen":
        metrics.sort()
    groups = next_fit_tokens([(i, n) for n, i in metrics[:-1]], max_tokens)
    return groups[: len(groups) - len(groups) % multiple]


def check_deepspeed_replay(lengths: Sequence[int], max_tokens: int, order: str, seed: int, multiple: int) -> None:
    """Assert that `_ds_microbatches` equals DeepSpeed's own `batch_by_seqlens` on a prefix of the workload."""
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import batch_by_seqlens

    prefix = list(lengths[:DS_CHECK_SAMPLES])
    try:
        ids, _, _ = batch_by_seqlens(prefix, max_tokens, sequence_picking_order=order, seed=seed,
                                     effective_batch_size=multiple)
    except AssertionError:  # fewer micro-batches in the prefix than ranks: check the grouping without the trim
        multiple = 1
        ids, _, _ = batch_by_seqlens(prefix, max_tokens, sequence_picking_order=order, seed=seed)
    theirs = [tuple(int(i) for i in group) for _, group in ids]
    ours = _ds_microbatches(prefix, max_tokens, order, seed, multiple)
    assert theirs == ours, f"DeepSpeed replay differs from batch_by_seqlens ({order}, W={multiple})"


def deepspeed(order: str) -> Callable[[Setting], Schedule | Unavailable]:
    def run(s: Setting) -> Schedule | Unavailable:
        check_deepspeed_replay(s.lengths, s.token_budget, order, s.seed, s.world_size)
        groups = _ds_microbatches(s.lengths, s.token_budget, order, s.seed, s.world_size)
        if not groups:  # DeepSpeed itself asserts here
            return Unavailable(f"fewer micro-batches than {s.world_size} ranks (DeepSpeed refuses)")
        return deal_round_robin(groups, s.world_size)

    run.__name__ = f"deepspeed_{order}"
    return run


# -- packing, oracle, ODB ----------------------------------------------------------------------------------------
def packing(s: Setting) -> Schedule:
    order = [(i, s.lengths[i]) for i in permutation(len(s.lengths), s.seed)]
    return deal_round_robin(next_fit_tokens(order, s.token_budget), s.world_size)


def odb_config(s: Setting, cost: str, planning: str = "global") -> ODBConfig:
    alpha = s.attention_alpha if cost == "attention" else 0.0
    return ODBConfig(token_budget=s.token_budget, cost=cost, attention_alpha=alpha, seed=s.seed, planning=planning,
                     min_window=s.min_window)


def oracle(cost: str) -> Callable[[Setting], Schedule]:
    def run(s: Setting) -> Schedule:
        items = [Item(i, int(n)) for i, n in enumerate(s.lengths)]
        groups = [g.indices for g in oracle_groups(items, build_budget(odb_config(s, cost)))]
        return deal_round_robin(groups, s.world_size)

    run.__name__ = f"oracle_{cost}"
    return run


def odb(cost: str, planning: str = "global") -> Callable[[Setting], Schedule]:
    """ODB's epoch plan; under global planning the schedule also carries how many samples moved between ranks."""

    def run(s: Setting) -> Schedule:
        config = odb_config(s, cost, planning)
        plan = simulate_epoch(shard(s.lengths, s.world_size, config.seed), config)
        return Schedule([[g.indices if g else None for g in rank] for rank in plan.steps],
                        moved=plan.moved if is_pooled(config, s.world_size) else None)

    run.__name__ = f"odb_{cost}" + ("" if planning == "global" else f"_{planning}")
    return run


@dataclass(frozen=True, slots=True)
class Method:
    """A row of the comparison: its name, the cost model its batches respect, and how to run it."""

    name: str
    cost: str
    run: Callable[[Setting], Schedule | Unavailable] | None  # None: runs elsewhere (the reference release)
    label: str


METHODS: tuple[Method, ...] = (
    Method("standard", "padded", standard, "Standard fixed batch"),
    Method("sorted", "padded", sorted_batches, "Sorted batching (fixed B)"),
    Method("group_by_length", "padded", group_by_length, "HF group_by_length (fixed B)"),
    Method("hf_batch_rebalance", "padded", hf_batch_rebalance, "HF BatchRebalanceSampler"),
    Method("reference_default", "padded", None, "Reference release, default settings"),
    Method("reference_buffer512", "padded", None, "Reference release, 512-sample buffer"),
    Method("oracle_padded", "padded", oracle("padded"), "Offline oracle (padded)"),
    Method("odb_padded", "padded", odb("padded"), "ODB global (padded)"),
    Method("odb_padded_local", "padded", odb("padded", "local"), "ODB rank-local (padded)"),
    Method("deepspeed_seqlen", "tokens", deepspeed("seqlen"), "DeepSpeed variable batch (seqlen order)"),
    Method("deepspeed_dataloader", "tokens", deepspeed("dataloader"), "DeepSpeed variable batch (default order)"),
    Method("packing", "tokens", packing, "Padding-free packing (next-fit, flattening)"),
    Method("oracle_tokens", "tokens", oracle("tokens"), "Offline oracle (tokens)"),
    Method("odb_tokens", "tokens", odb("tokens"), "ODB global (tokens)"),
    Method("odb_tokens_local", "tokens", odb("tokens", "local"), "ODB rank-local (tokens)"),
    Method("oracle_attention", "attention", oracle("attention"), "Offline oracle (attention)"),
    Method("odb_attention", "attention", odb("attention"), "ODB global (attention)"),
)
ORACLE_OF = {"padded": "oracle_padded", "tokens": "oracle_tokens", "attention": "oracle_attention"}


def cost_model(method: Method, setting: Setting) -> CostModel:
    return CostModel(method.cost, setting.attention_alpha if method.cost == "attention" else 0.0)
