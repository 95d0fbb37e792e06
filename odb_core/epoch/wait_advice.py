"""Which lever feeds the accelerator: an epoch's waits for data, and whether the workers or the device was faster.

NOTE [ Which lever ]
`odb/data_wait_fraction` says that the accelerator waited for its batches (NOTE [ Waiting for data ] in
steps/metrics.py); what to change depends on why (docs/design.md, issue 27 items 2 and 7). At the end of an epoch
run to its end that waited at least `WORTH_SAYING` of its wall time, the loader names one case, from two rates it
measures on the rank (a run that stops inside its epochs, `max_steps` or a stream without end, gets none):
  * **The workers read faster than the device trains, but less than `round_growth` (g) times as fast** (`ramp`):
    it waited for the rounds that grow at the epoch's start. Round k + 1, g times round k, is read while round k
    trains, so the device waits at each unless the workers are g times as fast (NOTE [ Round sizes ]).
    `round_growth=1.25` keeps them ahead, for slightly looser packing in its smaller rounds. Not said when g <= 1.25
    already or there is no ramp (`min_window` None); then nothing is.
  * **Slower than the device** (`workers`, by more than `EVEN`): every round waits for its last samples. More
    `num_workers` or cheaper processing is the lever; where the workers cannot keep up, a loader that sorts still
    loses about one pool of device time per epoch (the pool bound), which a smaller `window` (under a pooled plan
    whose `pool_window` shrinks each rank's window, `pool_window`) shortens, for looser packing. Where they read at
    least `GENTLE_FROM` of the device's rate and the rounds grow faster than the gentle ramp, `round_growth=1.25` is
    offered as the alternative: its smaller rounds at the epoch's start and end gained 0.02-0.16 of pipeline
    efficiency on issue 27's rows whose ranks measured workers / device at 0.67-0.89, and moved those whose ranks
    all measured 0.30-0.60 by -0.04 to 0 (docs/benchmarks.md, "A gentler ramp" and "Which lever"); a conservative
    cutoff (a row that gained had two ranks at 0.30 and 0.52), and an alternative, not a pair (one run with both did
    worse than either). With `num_workers=0` the case says to use workers.
  * **About as fast** (`even`, within `EVEN`): the device stays about one round behind the reading and trains the
    largest round after the last read ("A bound no rule of round sizes escapes"). A gentler ramp makes the rounds at
    the epoch's start and end smaller (at S/D 0.92 it gained in every cell of `benchmarks.round_rules` at W = 1 and
    4, and moved W = 64's pooled rounds by at most 0.01; named only while g > 1.25), more workers make the reading
    faster, a smaller window caps the largest round. At W > 1 the device's rate includes the gradient collectives'
    waits for slower ranks, so a rank whose workers are faster than its peers' can read as `even`.
  * **The waits were mostly in the rounds' exchanges** (`ranks`; only W > 1 has them): they wait for the slowest
    rank (whose own log shows whether it waited for data; one that trains slower waits for nothing), and an inline
    move (`overlap_moves=False`) carries samples there too.
  * Otherwise (the reading under half the waits: the loader's own planning, collating, samples still on the move
    lane), or where a rate cannot be measured, nothing is said; the logged parts show the wait.
The rates, at no cost to the plans (G7: only this message depends on timing). The device's: the samples this rank
trained over the consumer's seconds outside `next()` (IDLE steps left out), its steps and its own work (at W > 1
the gradient collectives; an evaluation or a checkpoint inside the epoch counts too, and lowers it). The
workers': the samples this rank's stream delivered from its first chunk to its last (`ReadClock`, a clock read per
chunk), or to the first step whose read-ahead took chunks a reader thread held until it reached its cap (a window
of pending samples, or the next fill's bytes; or found no byte room at all): from there the consumer paced the
reading, and the rate would be the consumer's. Without a reader thread reading ahead (`looks_ahead`:
`reader_thread=False` where the workers are read on the main thread, a resumed stream), the consumer pulls only
what its next fill needs, so no rate is taken; nor over fewer than `MIN_SAMPLES` samples. The reader thread's queue
and the DataLoader's prefetch can still hold fast workers back between two steps that take many samples each; the
rate then reads low. The epoch's first step is left out (its wait is the first round's reading and the workers'
start, which no lever removes), and the read and exchange seconds are those of the steps' `next()` calls from the
second to the last one that handed over a step, scaled down to the wait where a producer thread (`prefetch_steps >
0`) spent them while the consumer trained. The loader keeps the advice in `EpochReport.advice` (case: text), none
for an epoch that another rank left early, and logs each case once per loader, at WARNING.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from odb_core.planning.nodes import NodeLayout
from odb_core.planning.simulate import is_pooled
from odb_core.settings.config import ODBConfig
from odb_core.settings.console import LOGGER
from odb_core.steps.metrics import LoaderMetrics

WORTH_SAYING = 0.10  # an epoch whose waits are under this share of its wall time gets no advice
GENTLE_GROWTH = 1.25  # the ramp the `ramp`, `even` and `workers` cases suggest
EVEN = 0.1  # workers within this share of the device's rate read about as fast as it trains (`even`)
GENTLE_FROM = 0.65  # slower workers at least this share of the device's rate: `workers` names the gentle ramp too
MIN_SAMPLES = 64  # a workers' rate over fewer samples is not taken (a few chunks arrive together at the start)
_WHERE = "(NOTE [ Which lever ] in odb_core/epoch/wait_advice.py)"


def rounds_config(config: ODBConfig, layout: NodeLayout) -> ODBConfig:
    """The config an epoch's rounds run with: a pooled plan's `window` and `min_window` (NOTE [ Pooled round sizes ]
    in planning/round_sizes.py), the config itself for rank-local rounds."""
    if not is_pooled(config, layout.world):
        return config
    return config.rounds_for_pool(layout.per_node if layout.n_nodes > 1 else layout.world)


@dataclass(slots=True)
class ReadClock:
    """How fast a rank's stream delivered its chunks (`SampleReader._extend`) while nothing held its reading back:
    from the first chunk to the last, or to the first read-ahead whose held chunks reached its cap (`held`), after
    which the consumer paced it. `paced`: no reader thread read ahead, so the consumer pulled only what its next fill
    needed, and the rate would be its own (NOTE [ Which lever ])."""

    first_s: float | None = None
    last_s: float = 0.0
    first_samples: int = 0  # the first chunk's: read before the clock started
    samples: int = 0
    held: bool = False
    paced: bool = False

    def took(self, samples: int) -> None:
        if self.held:
            return
        self.last_s = time.perf_counter()
        if self.first_s is None:
            self.first_s, self.first_samples = self.last_s, samples
        self.samples += samples

    def pulled(self, looks_ahead: bool, ahead: bool) -> None:
        """After a step's read-ahead (`SampleReader.read_ahead`): `looks_ahead`, a reader thread reads ahead of the
        consumer (else the consumer paces every read); `ahead`, the reading is ahead of what the consumer may take."""
        self.paced = self.paced or not looks_ahead
        self.held = self.held or ahead

    def rate(self) -> float | None:
        """Samples per second while the reading was free; None where the consumer paced it, or over fewer than
        `MIN_SAMPLES` samples."""
        counted = self.samples - self.first_samples
        if self.paced or self.first_s is None or self.last_s <= self.first_s or counted < MIN_SAMPLES:
            return None
        return counted / (self.last_s - self.first_s)


@dataclass(slots=True)
class EpochWaits:
    """One epoch's waits as the consumer saw them, its stream's `ReadClock`, and the loader's metrics, whose read
    and exchange seconds it counts over the `next()` calls from the second step to the last (NOTE [ Which lever ])."""

    reads: ReadClock
    metrics: LoaderMetrics
    last_s: float = 0.0  # when the previous `next()` returned
    read_s: float = 0.0  # the metrics' `read_seconds` and `sync_seconds` when the first step was handed over
    sync_s: float = 0.0
    read_end_s: float = 0.0  # ... and when the last one was: the parts of the steps' waits, nothing after
    sync_end_s: float = 0.0
    wall_s: float = 0.0  # the steps' intervals after the first: training and waiting
    wait_s: float = 0.0  # inside `next()`
    idle_s: float = 0.0  # of the intervals, the consumer's time outside `next()` on IDLE steps (no sample)
    samples: int = 0  # trained on this rank
    started: bool = False  # the first step was taken (it is left out)

    def took(self, samples: int, asked_s: float, now_s: float) -> None:
        """A step of `samples` samples (0: IDLE) handed over at `now_s`, asked for at `asked_s`."""
        metrics = self.metrics
        if self.started:
            self.wall_s += now_s - self.last_s
            self.wait_s += now_s - asked_s
            self.idle_s += 0.0 if samples else asked_s - self.last_s
            self.samples += samples
        else:
            self.read_s, self.sync_s = metrics.read_seconds, metrics.sync_seconds
        self.read_end_s, self.sync_end_s = metrics.read_seconds, metrics.sync_seconds
        self.started, self.last_s = True, now_s

    def share(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    def parts(self) -> tuple[float, float]:
        """(reading, exchange) seconds since the first step, scaled down to the wait where they exceed it (a
        producer thread, `prefetch_steps > 0`, spends them partly while the consumer trains)."""
        reading, exchange = self.read_end_s - self.read_s, self.sync_end_s - self.sync_s
        both = reading + exchange
        scale = self.wait_s / both if both > self.wait_s else 1.0
        return reading * scale, exchange * scale

    def device_rate(self) -> float | None:
        """Samples per second the consumer trained outside `next()`, IDLE steps left out."""
        busy = self.wall_s - self.wait_s - self.idle_s
        return self.samples / busy if busy > 0 and self.samples else None


@dataclass(frozen=True, slots=True)
class Levers:
    """What the advice names: the rounds' config (`rounds_config`), the user's `window`, and whether the samples are
    read in the training process (`num_workers=0`)."""

    rounds: ODBConfig
    window: int
    in_process: bool = False

    def window_text(self) -> str:
        """The window lever: under a pooled plan whose `pool_window` shrinks each rank's, that cap is the lever."""
        pooled = self.rounds.window
        if pooled == self.window:
            return f"window (now {self.window})"
        return f"pool_window (now {self.rounds.pool_window}: a rank's rounds of at most {pooled})"

    def steep(self) -> bool:
        """Whether the rounds grow, and faster than the gentle ramp the advice names."""
        smallest = self.rounds.min_window
        return self.rounds.round_growth > GENTLE_GROWTH and smallest is not None and smallest < self.rounds.window


def advise(waits: EpochWaits, levers: Levers, epoch: int) -> dict[str, str]:
    """The epoch's advice by case (`ramp`, `even`, `workers`, `ranks`; NOTE [ Which lever ]): empty when it waited
    little, for the loader's own work, or where the rates could not be measured."""
    share = waits.share()
    if share < WORTH_SAYING:
        return {}
    reading, exchange = waits.parts()
    said = f"ODB: in epoch {epoch} the accelerator waited for data {share:.0%} of the time"
    if exchange >= 0.5 * waits.wait_s:
        return {"ranks": f"{said}, {exchange:.1f} s of it in the rounds' exchanges, which wait for the slowest rank "
                         "and carry the samples that move between ranks: another rank reads or trains slower (its "
                         "odb/data_wait_reading_fraction and its workers are where to look), or the moves are slow "
                         f"(overlap_moves, planning) {_WHERE}"}
    if reading < 0.5 * waits.wait_s:
        return {}
    if levers.in_process:
        return {"workers": f"{said}, {reading:.1f} s of it processing samples in the training process "
                           "(num_workers=0): DataLoader workers (num_workers > 0) process them while it trains "
                           f"{_WHERE}"}
    workers, device = waits.reads.rate(), waits.device_rate()
    if workers is None or device is None:
        return {}
    rates = f"(this rank's workers read {workers:,.0f} samples/s, it trained {device:,.0f})"
    if workers < (1 - EVEN) * device:
        gentler = (f", or round_growth={GENTLE_GROWTH:g} makes the rounds at the epoch's start and end smaller"
                   if levers.steep() and workers >= GENTLE_FROM * device else "")
        return {"workers": f"{said}, {reading:.1f} s of it for the workers' samples {rates}: they read slower than "
                           "it trains. More num_workers or cheaper processing in the dataset feeds it; where they "
                           f"cannot keep up, a smaller {levers.window_text()} shortens the wait that each epoch's end "
                           f"costs{gentler}, for looser packing {_WHERE}"}
    if workers <= (1 + EVEN) * device:
        gentler = f"round_growth={GENTLE_GROWTH:g} makes them smaller, " if levers.steep() else ""
        return {"even": f"{said}, {reading:.1f} s of it for the workers' samples, which they read about as fast as it "
                        f"trains {rates}: it waited about one round's training for the rounds read whole before they "
                        f"train, at the epoch's start and end. {gentler}more num_workers makes the workers faster, "
                        f"and a smaller {levers.window_text()} caps the largest round {_WHERE}"}
    if not levers.steep() or workers >= levers.rounds.round_growth * device:
        return {}  # a gentle ramp, or workers fast enough for a steep one: not the rounds' sizes
    return {"ramp": f"{said}, {reading:.1f} s of it for the workers' samples, which they read faster than it trains "
                    f"{rates}, but not round_growth={levers.rounds.round_growth:g} times as fast: it waited for the "
                    "rounds that grow at the epoch's start, each that many times the one before. "
                    f"round_growth={GENTLE_GROWTH:g} keeps them ahead through the ramp, for slightly looser packing "
                    f"in its rounds {_WHERE}"}


@dataclass(slots=True)
class Advisor:
    """A loader's: an `EpochWaits` for each epoch, and its advice at the epoch's end, each case logged once."""

    levers: Levers
    given: set[str] = field(default_factory=set)  # the cases logged so far

    def epoch_waits(self, metrics: LoaderMetrics, reads: ReadClock) -> EpochWaits:
        """An epoch's account, begun now (its `iter()`), with its stream's `reads`."""
        return EpochWaits(reads, metrics, time.perf_counter())

    def advise(self, waits: EpochWaits, epoch: int, abandoned: bool) -> dict[str, str]:
        """The advice of an epoch at its end, by case (none for an epoch another rank left early: NOTE [ Leaving an
        epoch ]); a case not logged before is logged now."""
        advice = {} if abandoned else advise(waits, self.levers, epoch)
        for case in advice.keys() - self.given:
            LOGGER.warning(advice[case])
        self.given.update(advice)
        return advice
