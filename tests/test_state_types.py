"""The typed pieces behind the loader's state: `LoaderState` round trips the saved JSON layout and names a bad
field; `AccumulationWindow` releases whole optimizer steps with their exact token count; `RoundLog` answers the
position after a consumed step, and a consume cut anywhere by a raising signal handler leaves the step's position
or the one before it, never a mix."""

from __future__ import annotations

import inspect
import json
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from odb_core.resume.fields import StateError, digest_of
from odb_core.resume.round_log import RoundLog
from odb_core.resume.state import LEGACY_FINGERPRINT, LoaderState, RoundStart
from odb_core.steps.accumulation import AccumulationWindow
from odb_core.steps.step_info import StepInfo

V2_STATES = json.loads((Path(__file__).parent / "data" / "v2_states.json").read_text())


def _info(step: int, round_: int, tokens: int, indices=(1,)) -> StepInfo:
    return StepInfo(epoch=0, step=step, round=round_, indices=tuple(indices), is_idle=not indices, local_samples=1,
                    global_samples=2, local_tokens=tokens, global_tokens=tokens, local_input_tokens=tokens,
                    global_input_tokens=tokens, padded_tokens=tokens, cost=float(tokens), rank_imbalance=0.0,
                    window_tokens=-1)


def _with_new_position_fields(position):
    if position is None:
        return None
    return {**position, "start": {**position["start"], "carry_samples": 0}, "window_open": 0}


@pytest.mark.parametrize("name", sorted(V2_STATES))
def test_saved_states_round_trip_through_the_typed_state(name):
    for state in V2_STATES[name]:
        typed = LoaderState.from_dict(state)
        # states written before global planning existed were planned rank-locally, and now say so; version 3 adds
        # the digest of the content
        again = typed.to_dict()
        assert again.pop("version") == 3 and again.pop("digest") == digest_of({**again, "version": 3})
        # (and the fields added since: no step target, no carried samples, no open optimizer step)
        assert again == {k: v for k, v in {**state, "config": {**state["config"], **LEGACY_FINGERPRINT},
                                           "position": _with_new_position_fields(state["position"])}.items()
                         if k != "version"}
        assert LoaderState.from_dict(typed.to_dict()) == replace(typed, version=3)


def test_a_truncated_or_mistyped_state_is_refused_with_the_field_named():
    state = V2_STATES["w2_resume_mid_round"][0]
    with pytest.raises(StateError, match="no 'epoch'"):
        LoaderState.from_dict({k: v for k, v in state.items() if k != "epoch"})
    with pytest.raises(StateError, match=r"position\.start\.buffer"):
        LoaderState.from_dict({**state, "position": {**state["position"], "start": {
            **state["position"]["start"], "buffer": ["7"]}}})
    with pytest.raises(StateError, match="state.rank"):
        LoaderState.from_dict({**state, "rank": True})
    with pytest.raises(StateError, match="must be a dict"):
        LoaderState.from_dict([state])


def test_the_accumulation_window_releases_whole_steps_with_their_token_total():
    window: AccumulationWindow[str] = AccumulationWindow(3)
    assert window.stage("a", _info(0, 0, 5)) == []
    assert window.stage("b", _info(1, 0, 7)) == []
    released = window.stage("c", _info(2, 1, 11))
    assert [p for p, _ in released] == ["a", "b", "c"] and {i.window_tokens for _, i in released} == {23}
    assert window.open_count == 0
    window.restore(2, 12)  # a resumed round inside a window: two earlier steps of 12 tokens, not replayed
    [(payload, info)] = window.stage("d", _info(3, 2, 4))
    assert payload == "d" and info.window_tokens == 16


def test_the_round_log_points_at_the_round_of_the_last_consumed_step():
    log = RoundLog(None)
    start0 = RoundStart(round=0, steps_done=0, consumed=0, buffer=(), carry_count=0, carry_tokens=0, dummy_index=None)
    log.begin_round(start0, {"steps": 0})
    start1 = replace(start0, round=1, steps_done=2, consumed=8, buffer=(3, 4))
    log.begin_round(start1, {"steps": 2})
    log.consume(_info(0, 0, 5, indices=(9,)))
    log.consume(_info(1, 0, 5, indices=(8,)))
    assert log.position.point.start == start0 and log.position.point.round_emitted == (9, 8)
    log.end_epoch(3, {"steps": 3})
    log.consume(_info(2, 1, 5, indices=(3,)))
    position = log.position
    assert position.point.start == start1 and position.point.steps_consumed == 3
    assert position.point.round_emitted == (3,) and position.complete and position.metrics == {"steps": 3}


def _two_round_log() -> tuple[RoundLog, list]:
    """A log of rounds 0 (steps 0-1) and 1 (steps 2-3, the epoch's last), this rank's samples emitted elsewhere
    in step 1 (global planning), and the steps to consume in order."""
    log = RoundLog(None)
    start0 = RoundStart(round=0, steps_done=0, consumed=0, buffer=(), carry_count=0, carry_tokens=0, dummy_index=None)
    log.begin_round(start0, {"steps": 0})
    log.record_owned(0, ((9,), (8, 7)))
    log.begin_round(replace(start0, round=1, steps_done=2, consumed=8, buffer=(3, 4)), {"steps": 2})
    log.end_epoch(4, {"steps": 4})
    return log, [_info(0, 0, 5, (9,)), _info(1, 0, 5, (8,)), _info(2, 1, 5, (3,)), _info(3, 1, 5, (4,))]


class _Cut(BaseException):
    """What a signal handler raises (torch's SIGCHLD error, KeyboardInterrupt), at a chosen line."""


def _consume_cut_at(log: RoundLog, info: StepInfo, at: int | None) -> int:
    """`log.consume(info)` with `_Cut` raised at its `at`-th traced line (counting lines of the functions it
    calls too), as a signal handler may raise there; returns how many lines it ran (all of them when `at` is None
    or past the end). A trace function may raise at more points than a signal handler, which runs only where the
    interpreter checks for pending calls: not at the `with` line, whose second event comes before the call that
    releases the lock (a raise there would leave it held; a handler runs only after that call)."""
    seen = [0]
    code = RoundLog.consume.__code__
    with_line = code.co_firstlineno + inspect.getsource(RoundLog.consume).splitlines().index(
        "        with self._lock:")

    def trace(frame, event, arg):
        if event == "line" and not (frame.f_code is code and frame.f_lineno == with_line):
            seen[0] += 1
            if seen[0] == at:
                raise _Cut
        return trace

    previous = sys.gettrace()  # a coverage tool's or a debugger's, put back after
    sys.settrace(lambda frame, event, arg: trace if event == "call" else None)
    try:
        log.consume(info)
    except _Cut:
        pass
    finally:
        sys.settrace(previous)
    return seen[0]


def lock_is_free(lock) -> bool:
    """Whether another thread can take `lock` now (a re-entrant lock always lets its holder in)."""
    taken: list[bool] = []

    def probe() -> None:
        taken.append(lock.acquire(blocking=False))
        if taken[0]:
            lock.release()

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return taken[0]


@pytest.mark.parametrize("cut_step", [0, 1, 2, 3])  # the first step, one inside a round, a new round, the last
def test_a_consume_cut_anywhere_leaves_the_position_before_or_after_the_step(cut_step):
    log, steps = _two_round_log()
    for info in steps[:cut_step]:
        log.consume(info)
    before = log.position
    lines = _consume_cut_at(log, steps[cut_step], None)  # a whole consume, traced: its lines
    after = log.position
    assert after != before and lines > 10
    for at in range(1, lines + 1):
        log, steps = _two_round_log()
        for info in steps[:cut_step]:
            log.consume(info)
        _consume_cut_at(log, steps[cut_step], at)
        assert lock_is_free(log._lock), f"cut at line {at} of {lines} left the log's lock held"
        cut = log.position
        assert cut in (before, after), f"cut at line {at} of {lines}: {cut}"
        assert log.complete == (cut is not None and cut.complete)
        if cut == before:  # the same step again (a failed epoch does not, but the log must stay whole)
            log.consume(steps[cut_step])
        assert log.position == after
        for info in steps[cut_step + 1:]:
            log.consume(info)
        assert log.position.complete and log.position.point.round_emitted == (3, 4)
