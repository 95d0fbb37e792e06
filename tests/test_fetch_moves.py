"""Under `move="fetch"` a moved sample is re-read by the rank that runs it, and checked there against what its
owner read (NOTE [ A re-read sample is checked ] in odb_core/ranks/moves.py; issue 28, case 4).

A dataset that processes a sample differently on another rank (augmentation, rank-dependent processing) used to
be collated as planned: micro-batches over the budget while `StepInfo.cost` said otherwise. A re-read that failed
raised the dataset's raw error, naming no index. Both now raise naming the index and that the sample moved, and
no micro-batch over the budget is ever yielded. Ranks run as threads over the loader's own collectives.
"""

from __future__ import annotations

import pytest
import torch

from conftest import LengthDataset
from odb_core import DatasetFetchError, ODBDataLoader, PeerError, SampleError, run_virtual_ranks
from odb_core.data.samplers import ShardedSampler

BUDGET = 2048
LENGTHS = [40 + (i * 53) % 300 for i in range(240)]
RANK0 = set(ShardedSampler(len(LENGTHS), rank=0, world_size=2, shuffle=False, seed=0).with_epoch(0))


class RankDependent(LengthDataset):
    """On rank 1, the samples of rank 0's shard come out `grow` tokens longer, or raise (`grow=None`)."""

    def __init__(self, rank: int, grow: int | None) -> None:
        super().__init__(LENGTHS)
        self.rank, self.grow = rank, grow

    def __getitem__(self, index: int) -> dict:
        if self.rank == 1 and index in RANK0:
            if self.grow is None:
                raise PermissionError(f"[Errno 13] Permission denied: 'shard-0/{index}.jpg'")
            ids = torch.arange(LENGTHS[index] + self.grow) % 97 + 3
            return {"input_ids": ids, "labels": ids.clone()}
        return super().__getitem__(index)


def _run(grow: int | None, move: str, timeout_s: float = 3.0):
    """Per rank: (padded size and cost of each batch, the error the epoch ended with, the indices trained, the
    samples moved to the rank)."""
    def rank_run(rank, transport):
        loader = ODBDataLoader(RankDependent(rank, grow), token_budget=BUDGET, transport=transport, move=move,
                               window=32)
        costs, trained = [], []
        try:
            for batch in loader:
                rows, width = batch["input_ids"].shape
                costs.append((rows * width, batch.info.cost))
                trained.extend(batch.info.indices)
        except (SampleError, DatasetFetchError, PeerError) as exc:
            return costs, exc, trained, loader.metrics.moved_samples
        finally:
            loader.close()
        return costs, None, trained, loader.metrics.moved_samples
    return run_virtual_ranks(rank_run, 2, timeout_s=timeout_s)  # short: a failing rank's peer waits this long


def test_a_re_read_sample_that_changed_is_refused_naming_the_index_and_the_move():
    (costs0, error0, _, _), (costs1, error1, _, _) = _run(grow=400, move="fetch")
    assert isinstance(error1, SampleError), error1
    assert error1.index in RANK0
    message = str(error1)
    assert message.startswith(f"sample {error1.index}: moved from rank 0 to rank 1 (move='fetch') and re-read there")
    assert f"read length {LENGTHS[error1.index]} " in message and "use move='send'" in message
    assert isinstance(error0, PeerError)  # its peer left the epoch: rank 0 is told, not left waiting
    for padded, cost in costs0 + costs1:  # nothing over the budget was yielded, and each cost is the batch's
        assert padded <= BUDGET and padded == cost


def test_a_re_read_that_fails_names_the_index_and_the_move():
    (_, error0, _, _), (_, error1, _, _) = _run(grow=None, move="fetch")
    assert isinstance(error1, DatasetFetchError), error1
    message = str(error1)
    assert "moved from rank 0 to rank 1 (move='fetch') and re-read there" in message
    assert "raised PermissionError: [Errno 13] Permission denied" in message
    assert isinstance(error1.__cause__, PermissionError)


def test_send_moves_the_sample_its_owner_processed_so_a_rank_dependent_dataset_trains_within_the_budget():
    (costs0, error0, trained0, moved0), (costs1, error1, trained1, moved1) = _run(grow=400, move="send",
                                                                                  timeout_s=60.0)
    assert error0 is None and error1 is None
    assert all(padded <= BUDGET for padded, _ in costs0 + costs1)
    assert sorted(trained0 + trained1) == list(range(len(LENGTHS)))  # every sample once
    assert moved1 > 0 and RANK0 & set(trained1), "no sample of rank 0's shard moved to rank 1: the case is moot"
