"""An honest epoch length before the epoch runs: sample this rank's lengths, simulate, agree across ranks."""

from __future__ import annotations

from odb_core.budget import Item
from odb_core.config import ODBConfig
from odb_core.sample import LengthFn, inspect_sample
from odb_core.simulate import is_pooled, simulate_epoch
from odb_core.stream import SampleStream
from odb_core.sync import Transport

FACTS = 2  # per sampled sample in the all_gather of global planning: length, patches


def _stretched(observed: list[Item], count: int) -> list[Item]:
    """`count` items whose facts repeat the observed ones evenly (the sample stands for the whole shard)."""
    return [Item(index=k, length=observed[k * len(observed) // count].length,
                 patches=observed[k * len(observed) // count].patches) for k in range(count)] if observed else []


def estimate_steps(stream: SampleStream, config: ODBConfig, *, epoch: int, length_fn: LengthFn | None,
                   transport: Transport, sample_size: int) -> int:
    """The next epoch's step count, the same on every rank (see `ODBDataLoader.estimate_steps`).

    Reads up to `sample_size` of this rank's samples (evenly spaced in sampler order) in the calling process and
    stretches their facts over this rank's sample count. Rank-local planning runs this rank's epoch on the
    virtual cluster at W=1 and agrees on the max (join) or min (non-join) with one all_gather of one int. Global
    planning gathers every rank's sample (one all_gather of 2 + 2 x sample_size ints per rank) and runs the
    pooled epoch of all of them on W virtual ranks, so every rank computes the same figure.
    """
    if stream.size is None:
        raise TypeError("estimate_steps() needs a map-style dataset: an IterableDataset has no known size")
    indices = stream.epoch_indices(epoch)
    picked = indices if len(indices) <= sample_size else [
        indices[(k * len(indices)) // sample_size] for k in range(sample_size)]
    observed = [inspect_sample(i, stream.dataset[i], length_fn) for i in picked]
    if not is_pooled(config, transport.world_size):
        mine = _stretched(observed, len(indices))
        local = simulate_epoch([mine], config, epoch=epoch).n_steps if mine else 0
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
    return simulate_epoch(streams, config, epoch=epoch).n_steps
