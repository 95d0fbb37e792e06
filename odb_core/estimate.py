"""An honest epoch length before the epoch runs: sample this rank's lengths, simulate, agree across ranks."""

from __future__ import annotations

from odb_core.budget import Item
from odb_core.config import ODBConfig
from odb_core.sample import LengthFn, inspect_sample
from odb_core.simulate import is_pooled, simulate_epoch
from odb_core.stream import SampleStream
from odb_core.sync import Transport


def estimate_steps(stream: SampleStream, config: ODBConfig, *, epoch: int, length_fn: LengthFn | None,
                   transport: Transport, sample_size: int) -> int:
    """The next epoch's step count, the same on every rank (see `ODBDataLoader.estimate_steps`).

    Reads up to `sample_size` of this rank's samples (evenly spaced in sampler order) in the calling process,
    stretches their lengths over this rank's sample count, runs the epoch on the virtual cluster at W=1, then
    agrees with one all_gather of one int: rank-local planning takes the max (join) or min (non-join) over ranks;
    global planning deals every rank's groups to all ranks, so it takes their sum / W, rounded up to a whole
    accumulation window (a slight overestimate: a rank's own samples pack a little worse than the pool).
    """
    if stream.size is None:
        raise TypeError("estimate_steps() needs a map-style dataset: an IterableDataset has no known size")
    indices = stream.epoch_indices(epoch)
    picked = indices if len(indices) <= sample_size else [
        indices[(k * len(indices)) // sample_size] for k in range(sample_size)]
    observed = [inspect_sample(i, stream.dataset[i], length_fn) for i in picked]
    scaled = [observed[k * len(observed) // len(indices)] for k in range(len(indices))]
    items = [Item(index=k, length=item.length, patches=item.patches) for k, item in enumerate(scaled)]
    local = simulate_epoch([items], config, epoch=epoch).n_steps if items else 0  # W=1: rank-local
    agreed = [v[0] for v in transport.all_gather([local])]
    if is_pooled(config, transport.world_size):
        windows = -(-sum(agreed) // (transport.world_size * config.accumulation_steps))
        return windows * config.accumulation_steps
    return max(agreed) if config.join else min(agreed)
