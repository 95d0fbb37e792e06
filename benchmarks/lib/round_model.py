"""The wall time of one rank's epoch from its round sizes alone (issue 27): what the rounds allow a pipeline of
reading and training, to set measured efficiencies against (`python -m benchmarks.round_model`, and the `bound`
column of `python -m benchmarks.overlap`).

The model: the rank's stream is cut into rounds by the loader's own rule (`round_target`, NOTE [ Round sizes ]; no
samples carried between rounds). The workers read one sample every 1/S seconds whenever fewer than `cap` samples
are read and not yet admitted by a plan (NOTE [ Reading ahead ]). Round j is planned once all its samples are read
and the device has trained round j-1; the device trains it in n_j / D seconds. Nothing else costs time: no trainer
CPU, no collectives, no per-step granularity, no core shared by ranks and workers.
"""

from __future__ import annotations

from itertools import accumulate

from odb_core.planning.round_sizes import round_target
from odb_core.settings.config import ODBConfig


def rounds_of(samples: int, config: ODBConfig) -> list[int]:
    """The round sizes one rank's known-length stream of `samples` samples gets (nothing carried over)."""
    sizes, left = [], samples
    while left > 0:
        size = min(round_target(config, len(sizes), 0, left), left)
        sizes.append(size)
        left -= size
    return sizes


def epoch_seconds(sizes: list[int], supply: float, demand: float, cap: int) -> tuple[float, float]:
    """(seconds to the first batch, seconds of the epoch) for rounds `sizes` (see the module docstring)."""
    return epoch_seconds_of(list(accumulate(sizes)), [size / demand for size in sizes], supply, cap)


def epoch_seconds_of(reads: list[int], device_seconds: list[float], supply: float, cap: int) -> tuple[float, float]:
    """`epoch_seconds` for rounds given by where each one's reading ends (`reads`: samples read, cumulative) and
    its device seconds (a planned round's steps, `python -m benchmarks.round_rules`)."""
    planned_at: list[float] = []  # when each round is planned
    read = 0.0  # when the last sample was read
    device_free = 0.0
    sample = 0
    for end, seconds in zip(reads, device_seconds, strict=True):
        for _ in range(end - sample):
            ready = read + 1.0 / supply
            # the sample waits while `cap` samples are read and not yet admitted by a plan
            m = next((j for j, total in enumerate(reads[: len(planned_at)]) if total >= sample + 1 - cap), None)
            if sample + 1 - cap > 0 and m is not None:
                ready = max(ready, planned_at[m])
            read, sample = ready, sample + 1
        plan = max(read, device_free)
        planned_at.append(plan)
        device_free = plan + seconds
    return planned_at[0], device_free


def latency_bound(sizes: list[int], supply: float, demand: float) -> float:
    """The fewest seconds an epoch of whole rounds `sizes` can take (docs/design.md, issue 27 item 2): round r can
    be planned only once the stream is read to its end, at C_r / S (C_r: the samples of rounds 1..r), and from then
    the device still trains rounds r..R, (E - C_{r-1}) / D seconds; so the epoch takes at least the largest of
    C_r / S + (E - C_{r-1}) / D over r. Reading that never stops (no cap) attains it: `epoch_seconds` with
    cap >= E equals it, a schedule's max-plus recursion unrolled."""
    total, before, best = sum(sizes), 0, 0.0
    for size in sizes:
        best = max(best, (before + size) / supply + (total - before) / demand)
        before += size
    return best


def pool_bound(samples: int, pool: int, supply: float, demand: float) -> float:
    """The most pipeline efficiency any loader allows a rank's epoch of `samples` if it ever chooses a step from a
    pool of `pool` read, untrained samples (docs/design.md, issue 27 item 2, "A bound no loader that sorts
    escapes"): the epoch takes at least E / D + B / S where S <= D, so 1 / (S/D + B/E); no bound (1) where S > D."""
    if supply > demand:
        return 1.0
    return min(1.0, 1.0 / (supply / demand + pool / samples))


def bound(samples: int, supply: float, demand: float, config: ODBConfig) -> float:
    """The efficiency the rounds allow one rank: (samples / min(S, D)) / the modelled epoch seconds."""
    sizes = rounds_of(samples, config)
    _, total = epoch_seconds(sizes, supply, demand, config.window)
    return samples / min(supply, demand) / total
