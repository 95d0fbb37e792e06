"""The next round runs in a thread while the consumer trains on a round's last step (NOTE [ Planning the next
round ahead ] in odb_core/epoch/plan_ahead.py): same batches, same errors, exact resume, ranks that stay in step
when one leaves with a round planned ahead, and the data wait's parts counted only where the consumer waited."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time

import pytest

from conftest import LengthDataset, lognormal_lengths
from dist_cases import Case, mixed_lengths, run_job, wait_until
from odb_core import CollateError, ODBDataLoader, PadCollator, SampleError
from odb_core.epoch.plan_ahead import PLAN_THREAD, PlanAhead, RoundAheadError, WaitParts
from odb_core.steps.metrics import LoaderMetrics

LENGTHS = lognormal_lengths(400, 1.0, 128, seed=5, hi=1024)


def _make(dataset, **kw):
    return ODBDataLoader(dataset, token_budget=1024, shuffle=True, window=64, **kw)


def _record(batch):
    i = batch.info
    return (i.epoch, i.step, i.round, i.indices, i.is_idle, i.window_tokens, i.global_tokens,
            tuple(batch["input_ids"].shape), int(batch["input_ids"].sum()))


def _epochs(loader, n=2):
    return [_record(b) for _ in range(n) for b in loader]


def _last_steps_of_rounds(records) -> list[int]:
    """The steps after which the next one belongs to another round (the epoch's last round left out)."""
    return [k for k in range(len(records) - 1) if records[k][2] != records[k + 1][2]]


@pytest.mark.parametrize("options", [{}, {"accumulation_steps": 3}, {"samples_per_step": 24}])
def test_planning_ahead_yields_the_batches_of_planning_inline(options):
    inline = _epochs(_make(LengthDataset(LENGTHS), plan_ahead=False, **options))
    ahead = _epochs(_make(LengthDataset(LENGTHS), **options))
    assert {r[0] for r in inline} == {0, 1} and len(_last_steps_of_rounds(inline)) >= 4
    assert ahead == inline


def test_the_next_round_runs_in_its_thread_while_the_rounds_last_step_trains():
    reference = [_record(b) for b in _make(LengthDataset(LENGTHS), plan_ahead=False)]
    boundaries = _last_steps_of_rounds(reference)
    for plan_ahead in (True, False):
        threads: dict[int, set[str]] = {}
        observer = lambda info: threads.setdefault(info.round, set()).add(threading.current_thread().name)  # noqa: E731
        loader = _make(LengthDataset(LENGTHS), plan_ahead=plan_ahead, observer=observer)
        ran_ahead = []
        for k, batch in enumerate(loader):
            if k in boundaries:  # the consumer "trains" the round's last step; has the next round run meanwhile?
                round_ = batch.info.round
                ran_ahead.append(wait_until(lambda: loader.metrics.rounds == round_ + 2, 5.0 if plan_ahead else 0.3))
        assert ran_ahead == [plan_ahead] * len(boundaries)
        later = set().union(*(names for round_, names in threads.items() if round_ > 0))
        assert all(name.startswith(PLAN_THREAD) for name in later) == plan_ahead, later
        assert threads[0] == {threading.current_thread().name}  # the first round runs in the consumer's next()


def test_an_error_in_the_round_planned_ahead_is_raised_by_the_next_step_as_inline():
    bad = 200  # a sample of a later round that the collator refuses (collated at plan time: not label-preserving)
    lengths = [min(n, 900) for n in LENGTHS]
    lengths[bad] = 999

    refused_on: list[str] = []

    def refusing(samples):
        if any(len(s["input_ids"]) == 999 for s in samples):
            refused_on.append(threading.current_thread().name)
            raise ValueError("a sample the collator cannot take")
        return PadCollator()(samples)

    outcomes = []
    for plan_ahead in (False, True):
        loader = ODBDataLoader(LengthDataset(lengths), token_budget=1024, window=64, collate_fn=refusing,
                               plan_ahead=plan_ahead)
        taken = []
        with pytest.raises(CollateError) as caught:
            for batch in loader:
                taken.append(_record(batch))
        outcomes.append((taken, str(caught.value)))
        loader.close()
    assert outcomes[0] == outcomes[1]
    assert len(outcomes[0][0]) > 2 and "a sample the collator cannot take" in outcomes[0][1]
    assert refused_on[0] == threading.current_thread().name and refused_on[1].startswith(PLAN_THREAD), refused_on


def test_a_state_saved_after_a_rounds_last_step_with_the_next_round_run_ahead_resumes_exactly():
    reference = [_record(b) for b in _make(LengthDataset(LENGTHS), plan_ahead=False)]
    for stop in _last_steps_of_rounds(reference)[:3]:
        loader = _make(LengthDataset(LENGTHS))
        it = iter(loader)
        got = [_record(next(it)) for _ in range(stop + 1)]
        round_ = got[-1][2]
        assert wait_until(lambda: loader.metrics.rounds == round_ + 2, 5.0), "the next round did not run ahead"
        state = json.loads(json.dumps(loader.state_dict()))
        assert state["position"]["steps_consumed"] == stop + 1
        loader.close()
        resumed = _make(LengthDataset(LENGTHS))
        resumed.load_state_dict(state)
        got += [_record(b) for b in resumed]
        assert got == reference, f"resume after step {stop} diverged"


def test_the_job_counts_its_wait_parts_apart_and_the_consumer_adds_only_the_share_it_waited_for():
    metrics, parts = LoaderMetrics(token_budget=100, world_size=1), WaitParts()

    def job():  # 0.3 s, of which 0.2 s "reading" and 0.1 s "exchanging"
        time.sleep(0.3)
        parts.read_seconds += 0.2
        parts.sync_seconds += 0.1
        return "step"

    ahead: PlanAhead[str] = PlanAhead(parts, metrics)
    ahead.start(job)
    time.sleep(0.6)  # the consumer trains longer than the job takes: it waits for none of it
    assert (metrics.read_seconds, metrics.sync_seconds) == (0.0, 0.0)  # nothing counted before the consumer waits
    assert ahead.take() == "step"
    assert metrics.read_seconds < 0.02 and metrics.sync_seconds < 0.01, metrics
    ahead.start(job)  # taken at once: the consumer waits for the whole job, and its parts count in full
    assert ahead.take() == "step"
    assert 0.18 < metrics.read_seconds < 0.22 and 0.09 < metrics.sync_seconds < 0.11, metrics
    assert (parts.read_seconds, parts.sync_seconds) == (0.0, 0.0)


def _take_interrupted(ahead: PlanAhead[str], after_s: float, once_ended: bool) -> None:
    """Interrupt `ahead.take()` (a Ctrl-C, by SIGALRM) after `after_s`; with `once_ended`, only once the job ended."""
    def interrupt(signum, frame):
        assert not once_ended or ahead.wait(5.0)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, after_s)
        with pytest.raises(KeyboardInterrupt):
            ahead.take()
    finally:
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("once_ended", [False, True])
def test_an_interrupted_wait_for_the_job_leaves_it_pending(once_ended):
    """A Ctrl-C in the consumer's wait is the consumer's, not the job's, even when it lands as the job ends."""
    ahead: PlanAhead[str] = PlanAhead(WaitParts(), LoaderMetrics(token_budget=100, world_size=1))
    ahead.start(lambda: time.sleep(0.5 if not once_ended else 0.2) or "step")
    _take_interrupted(ahead, 0.1 if not once_ended else 0.05, once_ended)
    assert ahead.pending  # still the job's: a close() waits for it, and the next take() gets its step
    assert ahead.take() == "step"


def test_settle_returns_the_jobs_error_and_close_ends_the_thread():
    ahead: PlanAhead[str] = PlanAhead(WaitParts(), LoaderMetrics(token_budget=100, world_size=1))
    ahead.start(lambda: 1 / 0)
    ended, error = ahead.settle(5.0)
    assert ended and isinstance(error, ZeroDivisionError)
    assert not ahead.pending
    ran_on: list[threading.Thread] = []
    ahead.start(lambda: ran_on.append(threading.current_thread()))
    ahead.close(5.0)
    assert ran_on[0].name.startswith(PLAN_THREAD) and ran_on[0].daemon
    assert wait_until(lambda: not ran_on[0].is_alive(), 5.0)
    ahead.start(lambda: time.sleep(2.0))
    started = time.monotonic()
    ahead.close(0.2)  # a job that does not end in time is left to end on its own
    assert time.monotonic() - started < 1.0


def test_an_epoch_that_ends_ends_its_planning_thread():
    ran_on: set[threading.Thread] = set()
    loader = _make(LengthDataset(LENGTHS), observer=lambda info: ran_on.add(threading.current_thread()))
    assert len(list(loader)) > 5
    planners = [t for t in ran_on if t.name.startswith(PLAN_THREAD)]
    assert planners and wait_until(lambda: not any(t.is_alive() for t in planners), 5.0)


class ArmedBadSample(LengthDataset):
    """`LengthDataset` whose sample `bad` has empty `input_ids` (a `SampleError` at its round's fill) while armed."""

    def __init__(self, lengths, bad: int) -> None:
        super().__init__(lengths)
        self.bad, self.armed = bad, True

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        if self.armed and index == self.bad:
            sample["input_ids"] = sample["input_ids"][:0]
        return sample


def _boundary_and_next_sample(**options):
    reference = [_record(b) for b in ODBDataLoader(LengthDataset(LENGTHS), token_budget=1024, window=64,
                                                   plan_ahead=False, **options)]
    stop = _last_steps_of_rounds(reference)[1]
    return stop, reference[stop + 1][3][0]  # round 2's first step's first sample: read by round 2's fill


def test_a_break_after_a_rounds_last_step_leaves_the_epoch_when_the_round_run_ahead_failed_in_its_fill(caplog):
    """The consumer stops at a round's last step; the next round, which it never asked for, ran ahead and failed
    before its first exchange (a bad sample in the fill): the rank leaves the epoch as inline, saying why."""
    stop, bad = _boundary_and_next_sample()
    outcomes = []
    for plan_ahead in (False, True):
        dataset = ArmedBadSample(LENGTHS, bad)
        loader = ODBDataLoader(dataset, token_budget=1024, window=64, plan_ahead=plan_ahead)
        for k, _ in enumerate(loader):
            if k == stop:
                break
        run = loader._current.run  # its report says whether the epoch was left
        with caplog.at_level(logging.WARNING):
            loader.leave_epoch()
        dataset.armed = False
        outcomes.append((run.report is not None and run.report.abandoned, _epochs(loader, 1)))
    assert outcomes[0] == outcomes[1] and outcomes[0][0]
    assert any("run ahead failed" in r.message and "SampleError" in r.message for r in caplog.records)


class Tagged(LengthDataset):
    """`LengthDataset` whose first token is the sample's index + 1000, so that a collator can tell samples apart."""

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        sample["input_ids"][0] = index + 1000
        return sample


def test_a_round_run_ahead_that_failed_inside_its_exchanges_is_not_left():
    """The limit of the above: a collator counted at plan time fails between the round's plan and its all_reduce,
    where the peers wait; the epoch is not left (as for any rank failing mid-round), and the leave raises
    `RoundAheadError` with the collator's error. Inline, the round never ran and the epoch is left."""
    refused: set[int] = set()

    def refusing(samples):
        if any(int(s["input_ids"][0]) - 1000 in refused for s in samples):
            raise ValueError("refused")
        return PadCollator()(samples)

    reference = [_record(b) for b in ODBDataLoader(Tagged(LENGTHS), token_budget=1024, window=64,
                                                   collate_fn=refusing, plan_ahead=False)]
    stop = _last_steps_of_rounds(reference)[1]
    left = []
    for plan_ahead in (False, True):
        refused.clear()
        loader = ODBDataLoader(Tagged(LENGTHS), token_budget=1024, window=64, collate_fn=refusing,
                               plan_ahead=plan_ahead)
        for k, _ in enumerate(loader):
            if k == stop - 1:  # round 1 was collated at its plan: refuse round 2's first step from now on
                refused.update(reference[stop + 1][3])
            if k == stop:
                break
        run = loader._current.run
        if plan_ahead:  # this rank cannot go on in step with its peers: said to the caller, not logged
            with pytest.raises(RoundAheadError, match="refused"):
                loader.leave_epoch()
        else:
            loader.leave_epoch()
        left.append(run.report is not None and run.report.abandoned)
    assert left == [True, False]


def test_the_loaders_own_exchanges_wait_for_a_round_run_ahead():
    """`estimate_steps` after a break at a round's last step: its all_gather must come after the job's round."""
    stop, _ = _boundary_and_next_sample()

    def slow_in_the_job(sample):
        if threading.current_thread().name.startswith(PLAN_THREAD):
            time.sleep(0.005)
        return len(sample["input_ids"])

    loader = ODBDataLoader(LengthDataset(LENGTHS), token_budget=1024, window=64, length_fn=slow_in_the_job)
    for k, batch in enumerate(loader):
        if k == stop:
            round_ = batch.info.round
            break
    assert loader.metrics.rounds == round_ + 1  # the job is still filling its round (64 samples x 5 ms)
    loader.estimate_steps(sample_size=32)
    assert loader.metrics.rounds == round_ + 2, "estimate_steps ran its exchange beside the job's round"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_stay_in_step_when_one_leaves_with_a_round_planned_ahead(tmp_path):
    """Real Gloo ranks, no background producer: each breaks out of epoch 0 after `break_after` steps (rank 1 a
    second later) and runs epoch 1 whole. Where the break follows a round's last step, the next round has run
    ahead on both ranks; leaving must wait for it, so the leaving exchange pairs with the peer's next round."""
    covered = False
    for break_after in (2, 3, 4, 5, 6, 7):
        case = Case(world_size=2, lengths=mixed_lengths(300), window=8, prefetch_steps=0, epochs=2,
                    break_after=break_after, break_skew_s=1.0, shuffle=True, sync_timeout_s=30.0)
        result = run_job(case, "env", tmp_path / str(break_after), timeout_s=120)
        assert not result.timed_out and result.returncodes == [0, 0], result.output[-4000:]
        first = [result.records[r]["epochs"][0]["steps"] for r in range(2)]
        second = [result.records[r]["epochs"][1] for r in range(2)]
        assert [len(steps) for steps in first] == [break_after, break_after]
        assert len(second[0]["steps"]) == len(second[1]["steps"]) > 0
        emitted = sorted(i for r in second for s in r["steps"] for i in s["indices"])
        assert emitted == list(range(300)), "epoch 1 must cover every index once"
        covered |= all(steps[-1]["planned_ahead_at_break"] for steps in first)
    assert covered, "no break came right after a round's last step on both ranks"


def test_a_planning_thread_that_cannot_start_leaves_the_round_to_the_next_next(monkeypatch, caplog):
    """Before, the job was marked pending before its thread started: where `Thread.start` failed (a process at its
    thread limit) that `next()` raised, and the next one waited for good on a job no thread ran. Now the round runs
    in line at the next `next()`, and the epoch yields every batch of a run whose threads started."""
    dataset = LengthDataset(lognormal_lengths(200, 1.0, 64, seed=4, hi=250))
    options = dict(token_budget=256, window=32, shuffle=True)

    def steps() -> list[tuple[int, ...]]:
        loader = ODBDataLoader(dataset, **options)
        try:
            return [tuple(batch.info.indices) for batch in loader]
        finally:
            loader.close()

    expected = steps()
    start, refused = threading.Thread.start, []

    def start_or_refuse(thread):
        if thread.name == PLAN_THREAD and len(refused) < 2:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_refuse)
    with caplog.at_level("WARNING", logger="odb_core.epoch.plan_ahead"):
        assert steps() == expected
    assert len(refused) == 2 and "could not start (can't start new thread)" in caplog.text
