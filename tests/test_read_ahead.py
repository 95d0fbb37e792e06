"""The next round's samples are read while the current round's steps are taken (NOTE [ Reading ahead ] in
odb_core/epoch/pipeline.py), without changing any batch.

With `num_workers=0` the DataLoader reads a sample when it is pulled, so the count of `__getitem__` calls seen at
each step shows when the reader pulled. Before, a round read nothing while its steps were taken: every step of the
first round was yielded with exactly one buffer of samples read.
"""

from __future__ import annotations

from conftest import CountingDataset
from odb_core import ODBDataLoader

WINDOW = 64


def test_the_next_round_is_read_while_the_current_rounds_steps_are_taken():
    dataset = CountingDataset([16 + (i * 37) % 240 for i in range(600)])
    loader = ODBDataLoader(dataset, token_budget=1024, window=WINDOW, fetch_chunk=4)
    reads_at = [(batch.info.round, dataset.reads) for batch in loader]
    first_round = [reads for round_, reads in reads_at if round_ == 0]
    assert len(first_round) > 2
    assert first_round[0] == WINDOW  # the first fill reads one buffer, and the first step is yielded then
    assert first_round[-1] > WINDOW  # by the round's last step the next round's samples are being read
    assert first_round == sorted(first_round)  # spread over the steps, not read at once
    assert dataset.reads == len(dataset)  # each sample read once


def test_reading_ahead_reads_no_more_than_the_next_fill_admits():
    dataset = CountingDataset([16 + (i * 37) % 240 for i in range(600)])
    loader = ODBDataLoader(dataset, token_budget=1024, window=WINDOW, fetch_chunk=1)
    it = iter(loader)
    rounds: dict[int, int] = {}
    for batch in it:
        rounds[batch.info.round] = dataset.reads
        if batch.info.round == 3:
            break
    # with chunks of one sample, at most one buffer plus the next fill's samples have been read by a round's end
    for round_, reads in rounds.items():
        assert reads <= WINDOW * (round_ + 2), (round_, reads)
