"""Ranks built with different settings are refused at their first exchange, naming the setting and both values
(NOTE [ Ranks agree on their settings ] in odb_core/ranks/agreement.py; issue 28, case 5).

Before, a per-rank seed gave batches whose rows were not what `StepInfo.indices` said (and over the budget), a
different budget or `join` a `ValueError` from zip(), a different `move` a hang until sync_timeout_s blamed on a
dead peer, a different `planning` a Gloo abort. Every field runs on virtual ranks (the loader's own collectives);
two run as real 2-process Gloo jobs.
"""

from __future__ import annotations

import pytest

from conftest import LengthDataset
from dist_cases import Case, mixed_lengths, run_job
from odb_core import DesyncError, ODBDataLoader, run_virtual_ranks

LENGTHS = [8 + (i * 37) % 200 for i in range(200)]
DIFFERENCES = [
    ("seed", 0, 7, "seed is 0 on rank 0 but 7 on rank 1"),
    ("token_budget", 1024, 2048, "token_budget is 1024 on rank 0 but 2048 on rank 1"),
    ("join", True, False, "join is True on rank 0 but False on rank 1"),
    ("move", "send", "fetch", "move is 'send' on rank 0 but 'fetch' on rank 1"),
    ("planning", "global", "local", "planning is 'global' on rank 0 but 'local' on rank 1"),
    ("window", 64, 32, "window is 64 on rank 0 but 32 on rank 1"),
    ("samples_per_step", None, 16, "samples_per_step is None on rank 0 but 16 on rank 1"),
    ("oversize", "alone", "error", "oversize is 'alone' on rank 0 but 'error' on rank 1"),
    ("plan_ahead", True, False, "plan_ahead is True on rank 0 but False on rank 1"),
]


@pytest.mark.parametrize(("field", "rank0", "rank1", "named"), DIFFERENCES, ids=[d[0] for d in DIFFERENCES])
def test_ranks_with_a_different_setting_are_refused_at_the_first_exchange_naming_it(field, rank0, rank1, named):
    def run(rank, transport):
        options = {"token_budget": 1024, "shuffle": True, field: (rank0, rank1)[rank]}
        loader = ODBDataLoader(LengthDataset(LENGTHS), transport=transport, **options)
        with pytest.raises(DesyncError) as raised:
            next(iter(loader))
        loader.close()
        return str(raised.value)

    messages = run_virtual_ranks(run, 2, timeout_s=30)
    assert messages[0] == messages[1]  # every rank names the same difference
    assert named in messages[0] and messages[0].startswith("ranks disagree on ODB's settings"), messages[0]


def test_a_different_dataset_size_is_refused_before_any_step():
    def run(rank, transport):
        loader = ODBDataLoader(LengthDataset(LENGTHS[: 200 - rank]), token_budget=1024, transport=transport)
        with pytest.raises(DesyncError, match=r"sampler is .*'size': 200.* on rank 0 but .*'size': 199.* on rank 1"):
            loader.estimate_steps()  # any first collective runs the check, not only iteration
        return True

    assert run_virtual_ranks(run, 2, timeout_s=30) == [True, True]


def test_settings_a_rank_may_choose_alone_are_not_compared():
    def run(rank, transport):
        loader = ODBDataLoader(LengthDataset(LENGTHS), token_budget=1024, transport=transport, shuffle=True,
                               prefetch_steps=2 * rank, fetch_chunk=4 + rank, liveness_timeout_s=10.0 + rank)
        return sorted(i for batch in loader for i in batch.info.indices)

    indices = run_virtual_ranks(run, 2, timeout_s=30)
    assert sorted(indices[0] + indices[1]) == list(range(len(LENGTHS)))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("field", "value", "named"), [("seed", 7, "seed is 0 on rank 0 but 7 on rank 1"),
                                                      ("planning", "local",
                                                       "planning is 'global' on rank 0 but 'local' on rank 1")])
def test_gloo_ranks_with_a_different_setting_both_raise_naming_it(tmp_path, field, value, named):
    case = Case(world_size=2, lengths=mixed_lengths(300), window=16, sync_timeout_s=60.0, shuffle=True,
                options_by_rank={"1": {field: value}}, record_errors=True)
    result = run_job(case, "env", tmp_path, timeout_s=180)
    assert not result.timed_out, f"the job hung:\n{result.output[-4000:]}"
    for rank in (0, 1):
        record = result.records.get(rank)
        assert record is not None, result.output[-4000:]
        assert record["error_type"] == DesyncError.__name__ and named in record["message"], record
        assert record["steps"] == 0 and record["blocked_s"] < 30.0, record
