"""A round's moved samples travel on a lane of their own while its steps train (NOTE [ Moves overlap training ] in
odb_core/ranks/moves_ahead.py; issue 27, item 4).

With the lane (`overlap_moves=True`, the default) the batches, every `StepInfo` field and the loader's counters
must be those of moving in line (`overlap_moves=False`), on virtual ranks (single node and node-aware) and on real
Gloo ranks; the round's steps must be released before its move has ended; a peer that dies while samples are in
flight must surface as an error within seconds, not a hang.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from conftest import LengthDataset
from dist_cases import Case, mixed_lengths, run_job

from odb_core import ODBDataLoader, PadCollator, run_virtual_ranks
from odb_core.ranks.moves_ahead import FACT_FIELDS, MovesInFlight, sample_facts, step_chunks

LENGTHS = [8 + (i * 37) % 300 for i in range(240)]


class MixedLabels(LengthDataset):
    """Labels half masked (the base) or fully masked; or, `labelled=False`, no labels at all (a group then counts
    each sample's input tokens less one)."""

    def __init__(self, lengths, labelled: bool = True) -> None:
        super().__init__(lengths)
        self.labelled = labelled

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        if index % 5 == 0:
            sample["labels"] = torch.full_like(sample["labels"], -100)
        if not self.labelled:
            del sample["labels"]
        return sample


def _epoch_records(loader: ODBDataLoader) -> list[tuple]:
    records = []
    for batch in loader:
        tensors = tuple((key, tuple(value.shape), value.flatten().tolist()) for key, value in sorted(batch.items())
                        if isinstance(value, torch.Tensor))
        records.append((batch.info, tensors))
    return records


def _run(world: int, overlap: bool, labelled: bool = True, **options) -> list[dict]:
    def rank_body(rank, transport):
        loader = ODBDataLoader(MixedLabels(LENGTHS, labelled), token_budget=1024, transport=transport, shuffle=True,
                               window=48, overlap_moves=overlap, **options)
        epochs = [_epoch_records(loader) for _ in range(2)]
        metrics = loader.metrics.snapshot()
        lane = loader._lane
        loader.close()
        return {"epochs": epochs, "metrics": metrics, "lane": lane is not None and lane.transport is not None}

    return run_virtual_ranks(rank_body, world, timeout_s=60)


@pytest.mark.parametrize(("world", "options"), [(2, {}), (3, {}), (4, {"nproc_per_node": 2}),
                                                (2, {"length_fn": lambda s: 2 * len(s["input_ids"])}),
                                                (2, {"labelled": False})],
                         ids=["W2", "W3", "2x2-nodes", "length_fn", "no-labels"])
def test_the_lane_gives_the_batches_step_infos_and_counters_of_moving_in_line(world, options):
    lane = _run(world, True, **options)
    inline = _run(world, False, **options)
    assert all(r["lane"] for r in lane) and not any(r["lane"] for r in inline)
    for got, want in zip(lane, inline, strict=True):
        assert got["epochs"] == want["epochs"]
        # wall time; the facts' exchange (metadata) on top; a frame's header and alignment per chunk of steps
        differ = {"sync_seconds", "sync_bytes", "moved_bytes"}
        assert {k: v for k, v in got["metrics"].items() if k not in differ} == \
            {k: v for k, v in want["metrics"].items() if k not in differ}
        assert got["metrics"]["sync_bytes"] > want["metrics"]["sync_bytes"]
        inline_bytes = want["metrics"]["moved_bytes"]
        assert inline_bytes <= got["metrics"]["moved_bytes"] <= 1.05 * inline_bytes
    assert sum(r["metrics"]["moved_samples"] for r in lane) > 0  # samples did move
    assert sum(r["metrics"]["moved_bytes"] for r in lane) > 0
    seen = sorted(i for r in lane for info, _ in r["epochs"][0] for i in info.indices)
    assert seen == list(range(len(LENGTHS)))  # identity coverage with the lane


def test_a_moved_samples_facts_are_what_its_group_counts():
    labelled = {"input_ids": torch.arange(10), "labels": torch.tensor([9] + [-100] * 3 + list(range(6)))}
    unlabelled = {"input_ids": torch.arange(7)}
    assert sample_facts(labelled, None) == (6, 1, 0)  # labels[1:] != -100: the first label (9) is never counted
    assert sample_facts(unlabelled, None) == (6, 0, 0)
    assert sample_facts(unlabelled, len) == (6, 0, 7)
    assert FACT_FIELDS == len(sample_facts(labelled, len))


def test_a_rounds_steps_move_in_chunks_that_double():
    assert step_chunks(0) == []
    assert step_chunks(1) == [range(0, 1)]
    assert step_chunks(10) == [range(0, 1), range(1, 3), range(3, 7), range(7, 10)]
    covered = [k for chunk in step_chunks(100) for k in chunk]
    assert covered == list(range(100)) and len(step_chunks(100)) == 7


ARRIVALS: list[float] = []
ARRIVALS_LOCK = threading.Lock()


def _arrive(delay_s: float) -> np.ndarray:
    time.sleep(delay_s)  # the sample's bytes take this long to arrive: unpickled on the receiving side
    with ARRIVALS_LOCK:
        ARRIVALS.append(time.monotonic())
    return np.zeros(1)


class SlowToArrive:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __reduce__(self):
        return _arrive, (self.delay_s,)


class SlowDataset(LengthDataset):
    def __getitem__(self, index: int) -> dict:
        return {**super().__getitem__(index), "slow": SlowToArrive(0.02)}


class DropSlow(PadCollator):
    """`PadCollator` without the test's marker field; its labels and ids are PadCollator's."""

    preserves_labels = True

    def __call__(self, samples):
        return super().__call__([{k: v for k, v in s.items() if k != "slow"} for s in samples])


@pytest.mark.parametrize("overlap", [True, False])
def test_a_rounds_steps_are_released_before_its_move_ends(overlap):
    ARRIVALS.clear()

    def rank_body(rank, transport):
        released: list[float] = []
        loader = ODBDataLoader(SlowDataset(LENGTHS[:120]), token_budget=1024, transport=transport, window=120,
                               min_window=None, collate_fn=DropSlow(), overlap_moves=overlap,
                               observer=lambda info: released.append(time.monotonic()))
        steps = sum(1 for _ in loader)
        moved = loader.metrics.moved_samples
        loader.close()
        return steps, moved, released

    results = run_virtual_ranks(rank_body, 2, timeout_s=60)
    assert all(moved > 10 for _, moved, _ in results)  # one round, most samples moved (each takes 20 ms to arrive)
    first_release = min(min(released) for _, _, released in results)
    last_arrival = max(ARRIVALS)
    if overlap:
        assert first_release < last_arrival - 0.1, "the steps waited for the whole move"
    else:
        assert first_release > last_arrival, "in line, a round's steps come after its move"


def _gloo_steps(tmp_path, name: str, **options) -> tuple[dict[int, list], int]:
    """Each rank's epochs and the bytes both ranks' move lanes sent."""
    case = Case(world_size=2, lengths=mixed_lengths(300), window=32, shuffle=True, first_image=150,
                options_by_rank={"0": options, "1": options})
    result = run_job(case, "env", tmp_path / name, timeout_s=240)
    assert not result.timed_out and result.returncodes == [0, 0], result.output[-4000:]
    lane_bytes = sum(record["lane_bytes_sent"] or 0 for record in result.records.values())
    return {rank: record["epochs"] for rank, record in result.records.items()}, lane_bytes


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gloo_ranks_with_the_lane_run_the_batches_of_moving_in_line(tmp_path):
    lane, lane_bytes = _gloo_steps(tmp_path, "lane", overlap_moves=True)
    inline, inline_bytes = _gloo_steps(tmp_path, "inline", overlap_moves=False)
    assert sorted(lane) == [0, 1] and lane == inline
    assert sum(e["moved_samples"] for r in lane.values() for e in r) > 0
    assert lane_bytes > 0 and inline_bytes == 0, (lane_bytes, inline_bytes)  # the moves went by the lane, or not


def test_a_moved_sample_is_freed_with_its_step_not_kept_by_the_round():
    """NOTE [ Moves overlap training ]: `MovesInFlight.sample` hands a received sample out once and drops it, so
    the round's flight does not keep every moved image alive until its end."""
    class Sample(dict):  # a dict that a weak reference can follow
        pass

    arrived: Future = Future()
    arrived.set_result({1: [Sample(input_ids=[5, 6]), Sample(input_ids=[7])]})
    flight = MovesInFlight(facts={1: [[1, 1, 0], [0, 1, 0]]}, futures=[arrived], starts={1: [0]}, samples=2,
                           bytes_in=0)
    sample = flight.take((1, 0)).sample()
    alive = weakref.ref(sample)
    assert sample["input_ids"] == [5, 6] and flight.take((1, 1)).sample()["input_ids"] == [7]
    del sample
    assert alive() is None


def test_a_frame_that_cannot_be_made_fails_that_exchange_on_every_rank_and_no_rank_trains_on_wrong_samples(
        monkeypatch):
    """NOTE [ A failed exchange keeps the lane in step ] in moves_ahead.py: rank 1's frames of its second exchange
    cannot be made (a frame it cannot allocate). Before, it skipped that exchange's collective, its next exchange
    paired with its peer's current one, and rank 0 trained on another chunk's samples in the rows of this one's (6
    wrong rows in a probe) until a bare IndexError. Now every batch either rank yields holds its own samples, and
    rank 0 gets a PeerError naming rank 1 and the cause."""
    from odb_core.ranks import moves_ahead

    local, exchanges = threading.local(), {0: 0, 1: 0}
    exchange, make_frame = moves_ahead._exchange, moves_ahead.frame_of

    def counted(lane, *args):
        exchanges[lane.rank] += 1
        local.rank, local.count = lane.rank, exchanges[lane.rank]
        return exchange(lane, *args)

    def failing_frame(pickled):
        if getattr(local, "rank", None) == 1 and local.count == 2:
            raise MemoryError("could not allocate the frame")
        return make_frame(pickled)

    monkeypatch.setattr(moves_ahead, "_exchange", counted)
    monkeypatch.setattr(moves_ahead, "frame_of", failing_frame)
    dataset = LengthDataset(LENGTHS)

    def rank_main(rank, transport):
        loader = ODBDataLoader(dataset, token_budget=1024, transport=transport, shuffle=True, window=48,
                               min_window=None)
        wrong = 0
        try:
            for batch in loader:
                for row, index in enumerate(batch.info.indices):
                    wrong += not torch.equal(batch["input_ids"][row][: LENGTHS[index]], dataset[index]["input_ids"])
        except Exception as exc:  # noqa: BLE001 - the error is what is checked
            return wrong, exc
        finally:
            loader.close()
        return wrong, None

    (wrong0, error0), (wrong1, error1) = run_virtual_ranks(rank_main, 2, timeout_s=60)
    assert wrong0 == wrong1 == 0
    assert isinstance(error1, MemoryError)
    assert "rank 1 could not send its samples of this exchange (MemoryError: could not allocate the frame)" \
        in str(error0) and type(error0).__name__ == "PeerError", error0
