"""How many samples a round plans: the round's buffer target, a pure function of where the epoch stands.

NOTE [ Round sizes ]
A round fills its buffer, plans it, and releases its steps; while they are taken the next round's samples are
read (NOTE [ Reading ahead ] in epoch/reader.py). Two moments of an epoch cannot overlap like that: before the
first step nothing has been read, and after the last read nothing is left to read while the last round trains.
With every round of `window` samples, both cost a whole buffer: the first step waits for `window` processed samples
(4096 by default: 6.9 s at 6 ms per sample on 4 workers) and the epoch's last round trains with idle workers.

So round k's buffer target is `min(window, min_window x 2^k)`: the first round plans after `min_window` samples and
each round doubles the next, which the workers read while the previous round (half as many samples) trains. The
device waits for each growing round unless the workers read twice a round while the device trains one, so
`round_growth` (g, default 2) sets the factor: `min(window, floor(min_window x g^k))`; with workers a little faster
than the device (S/D between 1 and 2) a g at or under S/D keeps it fed through the ramp, for more rounds of smaller
pools (docs/benchmarks.md, "A gentler ramp"). When the rank's stream has a known length (`left` samples not yet
admitted), the rounds also halve towards its end: a round plans at most half of what is left (buffered + left,
rounded up; at least `min_window`), so the epoch ends in rounds of about rest/2, rest/4, ..., `min_window`. The
device can only train a round once all of it is read, so when reading ends the device still has the rounds read last
to train: with halving rounds, the rest after a round is as large as the round, and while the round trains the
workers read it (past the next fill: NOTE [ Reading ahead ] in epoch/reader.py); when the workers are at most
about half as fast as the device, the epoch ends about one `min_window` round after its last read (the round before
the last is then read while its predecessor trains). Where the workers are nearly as fast as the device, the device
stays about one round behind them through the epoch and trains it after the last read: one window's training per
epoch, which no rule of round sizes removes (docs/design.md, issue 27 item 2). While the rounds still grow, a rest
of up to twice what the next round adds, 2 (g - 1) times this round's size (at most g times it), is planned whole
instead: at the default that is twice the round, which the next round would have taken, so a rank's shard of up to 2
x `min_window` samples is one round, as before this NOTE, and a short shard is not cut into rounds of a few hundred
samples, which would each cost a partly filled step. A gentler ramp (g < 2) is still growing late in an epoch, where
"the next round would take it" would plan a last round of thousands of samples that the device trains after the last
read; with 2 (g - 1) the epoch ends in halving rounds instead, and a shard over 2 (g - 1) x `min_window` samples
(128 at 1.25) is cut into rounds from `min_window` on (`python -m benchmarks.round_rules`: at S/D 0.92 and 1.4 its
score is at or above the doubling rounds' in every cell of the sweep).

Everything here is a function of (config, round index, samples buffered, samples left), which the round's start
records for resume (`RoundStart.round`, `.buffer`, `.consumed`), so plans stay independent of worker timing
(G7) and a replayed round fills as the saved one did (G8). Smaller rounds cost utilization in those rounds only:
a pool of 64 samples packs less tightly than one of 4096 (docs/benchmarks.md "Keeping the accelerator fed").
`min_window=None` keeps every round at `window`.

NOTE [ Pooled round sizes ]
Under pooled planning one plan packs the buffers of P ranks (the world, or a node's ranks under node-aware rounds),
so its packing depends on the pool, P x `window` samples, not on one rank's share: 8 ranks of 4,096 pool 32,768, 64
ranks 262,144, far past what packing needs (docs/benchmarks.md, "Pooled round sizes": capped at 8,192, 0 to 2 more
steps per epoch at W = 4-64). A rank's share is what the device waits for: a round trains only once all of it is
read, at the epoch's start (the first round) and at its end (the rounds in flight when reading ends; at S = D the
efficiency is at most E / (E + the largest round), docs/design.md). And at scale a rank's epoch is short (a million
samples over 256 ranks: ~3,900 each), so rounds of up to 4,096 made most epochs one or two rounds. So
`ODBConfig.pool_window` (8,192 by default) caps the pool: when P x `window` exceeds it, the rounds run with
`window` = max(ceil(pool_window / P), 64) and `min_window` shrunk by the same factor (at least 32, or its own value
if smaller): at P = 4, 2,048 and 128; at 8, 1,024 and 64; at 64, 128 and 32 (`ODBConfig.rounds_for_pool`, applied
where the engines are built: the loader's rounds and `simulate_epoch`). The rule of the rounds is the same
(`round_target`), only its two sizes change; they are a function of the config and P, so plans stay independent of
worker timing (G7), and `pool_window` is in the fingerprint where it acts (a state saved before the field, at a P
where it acts, is refused naming `pool_window=None`; an elastic resume, which plans the remainder anew at another
layout, leaves it out of the comparison, as it does the node layout). Rank-local planning and P x `window` <=
`pool_window` (W <= 2 at the defaults) are unchanged.

`max_buffer_bytes` bounds the same buffer in bytes: `fill_more` is the rule of a fill (the loader's and the
simulator's); the read-ahead pulls up to the bytes the next fill may add (`SampleReader.byte_space`).
"""

from __future__ import annotations

import itertools

from odb_core.settings.config import ODBConfig

_MAX_DOUBLINGS = 62  # 2^62 samples: past any window, and keeps the shift an int64


def round_target(config: ODBConfig, round_index: int, buffered: int, left: int | None) -> int:
    """The buffer size round `round_index` plans at (NOTE [ Round sizes ]); `left`: samples of this rank's stream
    not yet admitted, None when the stream's length is unknown (an iterable dataset, a sampler without len)."""
    smallest = config.min_window
    if smallest is None or smallest >= config.window:
        return config.window
    grown = _grown(config.window, smallest, config.round_growth, round_index)
    if left is None:
        return grown
    rest = buffered + left
    if grown < config.window and rest <= _whole_up_to(config.round_growth, grown):  # plan it all now, and ask for
        return min(config.window, rest + 1)  # one more, so that the fill finds the stream's end (closing)
    return min(grown, max(smallest, -(-rest // 2)))


def growing(config: ODBConfig, round_index: int) -> bool:
    """Whether round `round_index` is a round of the growing ramp (NOTE [ Round sizes ]): the next may hold more."""
    return round_target(config, round_index, 0, None) < config.window


def ramp_rounds(config: ODBConfig) -> int:
    """The rounds of the growing ramp (`growing`): 0 without one. Non-join pooled rounds may plan no step in them
    (NOTE [ A pool too small for a band ] in termination.py)."""
    return next(k for k in itertools.count() if not growing(config, k))


def _grown(window: int, smallest: int, growth: float, round_index: int) -> int:
    """min(window, floor(smallest x growth^round_index)) as floats compute it: exact for growth 2 (a shift), and
    `window` where the power overflows a float."""
    if growth == 2:
        return min(window, smallest << min(round_index, _MAX_DOUBLINGS))
    try:
        return min(window, int(smallest * float(growth) ** round_index))
    except OverflowError:  # growth^round_index past a float's range (or an infinite product): far past `window`
        return window


def _whole_up_to(growth: float, grown: int) -> float:
    """The largest rest a growing round of `grown` samples plans whole: twice what the next round adds, 2 (g - 1)
    x grown, and at most the next round's size (g x grown) where g > 2, so that a fast ramp does not hold the
    first step back by many rounds' samples; 2 x grown, in integers, at the default."""
    if growth == 2:
        return 2 * grown
    return min(2 * (growth - 1), growth) * grown


def fill_more(config: ODBConfig, buffered_bytes: int) -> bool:
    """Whether a fill may admit one more sample by the byte bound: until the buffer's payloads reach
    `max_buffer_bytes`, the sample that reaches it included, so a fill into an empty buffer admits at least one
    sample (a carried buffer already at the bound admits none: the round plans what it holds)."""
    bound = config.max_buffer_bytes
    return bound is None or buffered_bytes < bound
