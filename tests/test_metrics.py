"""The Trainer-log meter's moved-sample figures: per log, consistent across threads, no spike after a resume; its
rates leave the set-up before the first step out (NOTE [ The first interval starts at the first step ]); the
per-step counters written field by field agree with the generic dataclass operations."""

from __future__ import annotations

import time
from dataclasses import fields, replace

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import hf_support
from odb_core import ODBDataLoader
from odb_core.data.collate import PadCollator
from odb_core.settings.config import ODBConfig
from odb_core.steps.metrics import LoaderMetrics, StepCounts, StepMeter
from odb_core.steps.step_info import StepInfo
from odb_hf import ODBCallback


def test_moves_are_reported_per_log_from_whole_rounds_and_not_as_a_restored_total():
    metrics = LoaderMetrics(token_budget=100, world_size=2)
    metrics.restore({"moved_samples": 500, "moved_bytes": 80_000_000, "local_samples": 1000})  # a resumed run
    meter = StepMeter(ODBConfig(token_budget=100), metrics)
    metrics.moved_samples, metrics.moved_bytes = 505, 80_000_100  # a round's moves, its samples not yet staged
    assert meter.flush()["odb/moved_bytes"] == 0.0  # not visible before the round is published whole
    metrics.counts = replace(metrics.counts, local_samples=1010)
    metrics.publish_moves()
    logs = meter.flush()
    assert logs["odb/moved_fraction"] == 0.5 and logs["odb/moved_bytes"] == 100.0
    assert "moves" not in metrics.snapshot()  # derived, not part of a saved state


def _distinct_info(**window: int) -> StepInfo:
    """A StepInfo whose every field holds its own value (so that a field copied into the wrong place shows)."""
    values = {f.name: k + 2 for k, f in enumerate(fields(StepInfo))}
    values.update(indices=(3, 5), is_idle=False, cost=7.5, rank_imbalance=0.25, **window)
    return StepInfo(**values)


def test_in_window_equals_replace_for_every_field():
    info = _distinct_info()
    filled = info.in_window(tokens=101, samples=102, steps=103, index=104)
    assert filled == replace(info, window_tokens=101, window_samples=102, window_steps=103, window_index=104)


def test_step_counts_add_and_close_window_equal_field_wise_sums():
    counts = StepCounts(**{f.name: 1000 + k for k, f in enumerate(fields(StepCounts))})
    infos = (_distinct_info(), _distinct_info(window_steps=3, window_index=2), replace(_distinct_info(), is_idle=True))
    for info in infos:
        real, ends = not info.is_idle, info.ends_window
        expected = {"steps": 1, "idle_steps": int(info.is_idle), "local_samples": info.local_samples,
                    "global_samples": info.global_samples,
                    "local_input_tokens": info.local_input_tokens if real else 0,
                    "global_input_tokens": info.global_input_tokens, "global_supervised_tokens": info.global_tokens,
                    "global_patches": info.global_patches, "padded_tokens": info.padded_tokens if real else 0,
                    "imbalance_sum": info.rank_imbalance, "optimizer_steps": int(ends),
                    "step_samples_sum": info.window_samples * ends, "step_samples_sq": info.window_samples ** 2 * ends,
                    "step_tokens_sum": info.window_tokens * ends, "step_tokens_sq": info.window_tokens ** 2 * ends}
        assert set(expected) == {f.name for f in fields(StepCounts)}
        assert counts.add(info) - counts == StepCounts(**expected)
    window = _distinct_info(window_steps=1, window_index=0)
    closed = counts.close_window(window) - counts
    assert closed == StepCounts(optimizer_steps=1, step_samples_sum=window.window_samples,
                                step_samples_sq=window.window_samples ** 2, step_tokens_sum=window.window_tokens,
                                step_tokens_sq=window.window_tokens ** 2)


def test_a_step_without_accumulation_is_counted_once_as_staging_and_closing_its_window_count_it():
    # EpochRun._stage builds a step without accumulation with its window fields already filled and counts it with
    # one `add`; with accumulation the step is added unfilled and its window closed when released
    counts = StepCounts(**{f.name: 1000 + k for k, f in enumerate(fields(StepCounts))})
    for idle in (False, True):
        partial = replace(_distinct_info(window_tokens=-1), is_idle=idle)
        final = partial.in_window(tokens=partial.global_tokens, samples=partial.global_samples, steps=1, index=0)
        assert final.ends_window and not partial.ends_window
        assert counts.add(final) == counts.add(partial).close_window(final)


class ManualClock:
    """A clock the test moves by hand: `StepMeter(..., clock=ManualClock())`."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(samples: int, tokens: int) -> StepInfo:
    return replace(_distinct_info(), global_samples=samples, global_input_tokens=tokens)


def test_the_first_samples_per_second_counts_from_the_first_step_and_not_the_set_up_before_it():
    """The report: a DeepSpeed run built its engine and compiled the shm comm op (~55 s) after the meter was
    built, and the first interval logged 0.2 samples/s instead of ~60."""
    clock = ManualClock()
    meter = StepMeter(ODBConfig(token_budget=100), LoaderMetrics(token_budget=100, world_size=1), clock=clock)
    clock.now += 55.0  # set-up after the meter: engine build, op compile, worker start
    assert meter.flush()["odb/samples_per_second"] == 0.0  # nothing consumed yet; the clock is still not started
    clock.now += 5.0
    for _ in range(2):  # the first optimizer step: its micro-batches, then its compute
        meter.add(_step(samples=30, tokens=600))
    clock.now += 1.0
    first = meter.flush()
    assert first["odb/samples_per_second"] == 60.0 and first["odb/tokens_per_second"] == 1200.0
    clock.now += 1.5  # later intervals run from flush to flush: the wait for the next batches counts
    meter.add(_step(samples=30, tokens=600))
    clock.now += 0.5
    assert meter.flush()["odb/samples_per_second"] == 15.0


class SlowSetUp(TrainerCallback):
    """Set-up after the Trainer built its dataloader (and ODB its meter) and before the first step, as DeepSpeed's
    engine build and shm op compile are: `on_train_begin` runs after both."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.logs = seconds, []

    def on_train_begin(self, args, state, control, **kwargs):
        time.sleep(self.seconds)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "odb/samples_per_second" in logs:
            self.logs.append(logs)


def test_the_trainer_logs_a_first_samples_per_second_without_the_set_up_time(tmp_path):
    set_up, infos = SlowSetUp(seconds=3.0), []
    samples = [{"input_ids": [2, 5, 6, 7], "labels": [-100, 5, 6, 7]}] * 8
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, logging_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=hf_support.tiny_llama(), args=args, train_dataset=hf_support.ListDataset(samples),
                      data_collator=PadCollator(pad_token_id=hf_support.PAD),
                      callbacks=[ODBCallback(token_budget=16, observer=infos.append), set_up])
    trainer.train()
    first = set_up.logs[0]
    seconds = infos[0].global_samples / first["odb/samples_per_second"]  # the first interval, as the meter timed it
    assert seconds < set_up.seconds / 2, f"the first interval ({seconds:.2f} s) counted the {set_up.seconds} s set-up"


def test_the_data_wait_fraction_is_the_share_of_the_interval_spent_waiting_for_batches():
    """NOTE [ Waiting for data ]: the loader's wait over the log's interval; the first batch's wait is set-up."""
    clock, metrics = ManualClock(), LoaderMetrics(token_budget=100, world_size=1)
    meter = StepMeter(ODBConfig(token_budget=100), metrics, clock=clock)
    assert meter.flush()["odb/data_wait_fraction"] == 0.0  # nothing consumed yet
    metrics.wait_seconds += 7.0  # the first batch: workers start, the first round fills
    meter.add(_step(samples=4, tokens=80))
    clock.now += 2.0
    metrics.wait_seconds += 0.5  # the next batches: half a second of the two
    meter.add(_step(samples=4, tokens=80))
    assert meter.flush()["odb/data_wait_fraction"] == 0.25
    clock.now += 1.0
    metrics.wait_seconds += 1.5  # a next() that began before the interval: at most the whole interval
    assert meter.flush()["odb/data_wait_fraction"] == 1.0
    assert "wait_seconds" not in metrics.snapshot()  # a wall time: not part of a saved state


def test_the_reading_and_exchange_parts_of_the_wait_are_shares_of_the_same_interval():
    """NOTE [ Waiting for data ]: the loader's seconds blocked on the workers and in the rounds' collectives, over
    the log's interval, from the first step on; the exchange only where there are ranks to exchange with."""
    clock, metrics = ManualClock(), LoaderMetrics(token_budget=100, world_size=2)
    meter = StepMeter(ODBConfig(token_budget=100), metrics, clock=clock)
    metrics.wait_seconds, metrics.read_seconds, metrics.sync_seconds = 3.0, 2.0, 0.5  # the first batch: set-up
    meter.add(_step(samples=4, tokens=80))
    clock.now += 4.0
    metrics.wait_seconds, metrics.read_seconds, metrics.sync_seconds = 5.0, 3.0, 1.5
    logs = meter.flush()
    assert (logs["odb/data_wait_fraction"], logs["odb/data_wait_reading_fraction"],
            logs["odb/data_wait_exchange_fraction"]) == (0.5, 0.25, 0.25)
    clock.now += 1.0
    metrics.read_seconds += 3.0  # a producer thread (prefetch_steps > 0) reads while the trainer trains
    logs = meter.flush()
    assert (logs["odb/data_wait_reading_fraction"], logs["odb/data_wait_exchange_fraction"]) == (1.0, 0.0)
    assert "read_seconds" not in metrics.snapshot()  # a wall time
    alone = StepMeter(ODBConfig(token_budget=100), LoaderMetrics(token_budget=100, world_size=1), clock=clock)
    alone.add(_step(samples=4, tokens=80))
    assert "odb/data_wait_exchange_fraction" not in alone.flush()


class SlowSamples(torch.utils.data.Dataset):
    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        time.sleep(self.seconds)
        return {"input_ids": torch.arange(4 + index % 5) + 3}


def _wait_fractions(read_s: float, step_s: float) -> tuple[float, float]:
    loader = ODBDataLoader(SlowSamples(96, read_s), token_budget=32, window=16, min_window=8, max_batch_size=4,
                           num_workers=1, fetch_chunk=2)
    meter = StepMeter(loader.config, loader.metrics)
    for batch in loader:
        meter.add(batch.info)
        time.sleep(step_s)
    logs = meter.flush()
    loader.close()
    return logs["odb/data_wait_fraction"], logs["odb/data_wait_reading_fraction"]


def test_a_trainer_waiting_on_slow_reads_logs_a_high_data_wait_and_a_fed_one_a_low_one():
    """Through the real loader and a worker process: reads of 10 ms per sample against steps of 1 ms keep the
    trainer waiting most of the time, and the wait is the reading; reads of 0 against steps of 20 ms almost
    never wait."""
    (starved, reading), (fed, fed_reading) = (_wait_fractions(read_s=0.01, step_s=0.001),
                                              _wait_fractions(read_s=0.0, step_s=0.02))
    assert starved > 0.6 and 0.8 * starved < reading <= starved, (starved, reading)
    assert fed_reading <= fed < 0.2, (fed, fed_reading)
