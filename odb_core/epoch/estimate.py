"""An honest epoch length before the epoch runs: sample this rank's lengths, simulate, agree across ranks; or the
exact step plan of whole epochs, from every rank's real lengths (`plan_epochs_exactly`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from odb_core.data.sample import LengthFn, inspect_sample
from odb_core.data.payload import payload_bytes
from odb_core.epoch.stream import SampleStream
from odb_core.planning.budget import Item
from odb_core.planning.nodes import NodePlanning
from odb_core.planning.simulate import is_pooled, simulate_epoch
from odb_core.ranks.sync import Transport
from odb_core.settings.config import ODBConfig
from odb_core.steps.accumulation import StepTarget

FACTS = 2  # per sampled sample in the all_gather of global planning: length, patches
EXACT_FACTS = 4  # per sample in `plan_epochs_exactly`'s all_gather: index, length, patches, payload bytes


def _stretched(observed: list[Item], count: int) -> list[Item]:
    """`count` items whose facts repeat the observed ones evenly (the sample stands for the whole shard)."""
    return [Item(index=k, length=observed[k * len(observed) // count].length,
                 patches=observed[k * len(observed) // count].patches) for k in range(count)] if observed else []


def estimate_steps(stream: SampleStream, config: ODBConfig, *, epoch: int, length_fn: LengthFn | None,
                   transport: Transport, sample_size: int, per_node: int | None = None) -> int:
    """The next epoch's step count, the same on every rank (see `ODBDataLoader.estimate_steps`).

    Reads up to `sample_size` of this rank's samples (evenly spaced in sampler order) in the calling process and
    stretches their facts over this rank's sample count. Rank-local planning runs this rank's epoch on the
    virtual cluster at W=1 and agrees on the max (join) or min (non-join) with one all_gather of one int. Global
    planning gathers every rank's sample (one all_gather of 2 + 2 x sample_size ints per rank) and runs the
    pooled epoch of all of them on W virtual ranks, so every rank computes the same figure (node-aware with
    `per_node` ranks per node, the loader's layout: None is one node).
    """
    if stream.size is None:
        raise TypeError("estimate_steps() needs a map-style dataset: an IterableDataset has no known size")
    indices = stream.epoch_indices(epoch)
    picked = indices if len(indices) <= sample_size else [
        indices[(k * len(indices)) // sample_size] for k in range(sample_size)]
    observed = [inspect_sample(i, stream.dataset[i], length_fn) for i in picked]
    if not is_pooled(config, transport.world_size):
        mine = _stretched(observed, len(indices))
        local = simulate_epoch([mine], config, epoch=epoch, lengths_known=stream.knows_length()).n_steps if mine else 0
        agreed = [v[0] for v in transport.all_gather([local])]
        return max(agreed) if config.join else min(agreed)
    facts = [x for item in observed for x in (item.length, item.patches)]
    padded = [len(indices), len(observed), *facts, *[0] * (FACTS * sample_size - len(facts))]
    streams = []
    for values in transport.all_gather(padded):
        count, n_observed = values[0], values[1]
        sample = [Item(index=k, length=values[2 + FACTS * k], patches=values[3 + FACTS * k])
                  for k in range(n_observed)]
        streams.append(_stretched(sample, count))
    return simulate_epoch(streams, config, epoch=epoch, nodes=_nodes(per_node),
                          lengths_known=stream.knows_length()).n_steps


@dataclass(frozen=True, slots=True)
class ExactPlan:
    """Per planned epoch, the micro-batches and the optimizer steps the real run will take (every rank)."""

    micro_batches: tuple[int, ...]
    optimizer_steps: tuple[int, ...]


def plan_epochs_exactly(stream: SampleStream, config: ODBConfig, *, epochs: Sequence[int],
                        length_fn: LengthFn | None, transport: Transport, per_node: int | None = None) -> ExactPlan:
    """NOTE [ Exact schedule ]
    The real step plan of `epochs`, computed before training, identically on every rank. Each rank reads the
    facts (index, length, patches, payload bytes for `max_buffer_bytes`) of every sample of its shard once (one
    pass over its samples in the calling process), and per epoch one all_gather of its count and one of its facts
    in sampler order;
    then every rank runs the epoch on the virtual cluster (`simulate_epoch`, the loader's own round code, on its
    node layout: `per_node` ranks per node), which
    yields the same groups as the real run because the plan is a pure function of these facts (G7). Optimizer
    steps are G micro-batches, or with `samples_per_step` the windows of the same rule the loader applies
    (`StepTarget.count_steps`). Not possible, and refused with TypeError: an iterable dataset (no index order),
    and `tokens_per_step` (supervised tokens exist only after the collator runs).
    Cost: O(shard) sample reads on every rank, O(W x shard) ints gathered per epoch, one simulation per epoch.
    `estimate_steps` does not model the byte bound (its sample stands for the shard's lengths only).
    """
    if stream.size is None:
        raise TypeError("an exact step plan needs a map-style dataset: an IterableDataset has no index order")
    target = config.step_target
    if target is not None and target[0] == "tokens":
        raise TypeError("tokens_per_step steps depend on supervised tokens, known only after collation; the step "
                        "count is estimated instead")
    facts: dict[int, tuple[Item, int]] = {}
    micro, optimizer = [], []
    for epoch in epochs:
        order = stream.epoch_indices(epoch)
        for index in order:
            if index not in facts:
                sample = stream.dataset[index]
                facts[index] = (inspect_sample(index, sample, length_fn), payload_bytes(sample))
        widest = max(v[0] for v in transport.all_gather([len(order)]))
        mine = [x for i in order for x in (i, facts[i][0].length, facts[i][0].patches, facts[i][1])]
        gathered = transport.all_gather([len(order), *mine, *[0] * (EXACT_FACTS * (widest - len(order)))])
        streams = [[Item(index=v[1 + EXACT_FACTS * k], length=v[2 + EXACT_FACTS * k], patches=v[3 + EXACT_FACTS * k])
                    for k in range(v[0])] for v in gathered]
        sizes = {v[1 + EXACT_FACTS * k]: v[4 + EXACT_FACTS * k] for v in gathered for k in range(v[0])}
        plan = simulate_epoch(streams, config, epoch=epoch, nodes=_nodes(per_node), lengths_known=stream.knows_length(),
                              sizes=sizes)
        micro.append(plan.n_steps)
        optimizer.append(StepTarget(*target).count_steps(plan.global_sizes()) if target is not None
                         else math.ceil(plan.n_steps / config.accumulation_steps))
    return ExactPlan(micro_batches=tuple(micro), optimizer_steps=tuple(optimizer))


def _nodes(per_node: int | None) -> NodePlanning | None:
    """The loader's node layout for the simulator (node-aware rounds; one node plans as global planning)."""
    return NodePlanning(per_node) if per_node is not None else None
