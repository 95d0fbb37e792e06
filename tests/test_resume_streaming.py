"""Streaming data whose ranks run dry at different times (HF streaming split by node, a plain IterableDataset):
join mode yields equal step counts and every sample exactly once (G2, G3); a stopped HF stream resumes exactly.
Under global planning (the default) samples move between ranks by `send`, the only way a stream can move them."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import resume_stream_worker
from odb_core import ODBDataLoader
from odb_core.resume.fields import digest_of
from resume_launch import free_port, run_to_end


def _run_world(tmp_path, world_size: int, stop: int) -> list[dict]:
    port = free_port()
    run_to_end(resume_stream_worker.main, [(str(tmp_path), r, world_size, port, stop) for r in range(world_size)])
    return [json.loads((tmp_path / f"stream.r{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_streams_align_steps_and_emit_every_sample_once(tmp_path, world_size):
    ranks = _run_world(tmp_path, world_size, stop=5)
    for name in ("hf", "torch"):
        runs = [r[name]["full"] for r in ranks]
        assert len({len(run) for run in runs}) == 1, f"{name}: step counts differ"  # G2
        sizes = [len(r[name]["kept"]) for r in ranks]
        assert max(sizes) - min(sizes) >= 8, f"{name}: ranks are not uneven enough ({sizes})"
        emitted = Counter(i for run in runs for row in run for i in row["idx"])
        expected = Counter(i for r in ranks for i in r[name]["kept"])
        assert emitted == expected and max(emitted.values()) == 1, f"{name}: lost or repeated samples"  # G3
    for r in ranks:
        assert r["hf"]["resumed"] == r["hf"]["full"]  # G8 on a stream: replayed from its start
    # global planning (the default): processed samples of the longer streams were sent to the ranks that ran dry
    assert sum(r["torch"]["moved"] for r in ranks) > 0


def hf_sharded_stream(n: int = 60, shards: int = 4):
    """An HF datasets stream in `shards` shards, as LLaMA-Factory streams a local file: each DataLoader worker
    reads only its own shards. Sample i's tokens are all i + 3, so batches tell which samples they hold."""
    from datasets import Dataset

    rows = [{"input_ids": [i + 3] * (4 + (i * 7) % 19)} for i in range(n)]
    return Dataset.from_list(rows).to_iterable_dataset(num_shards=shards)


def sample_ids(batches) -> list[int]:
    return [int(row[0]) - 3 for batch in batches for row in batch["input_ids"] if not batch.info.is_idle]


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_a_stream_that_splits_itself_over_workers_is_read_once_with_any_worker_count(workers):
    """NOTE [ Streams that split themselves over workers ]: every worker reads its own shards, every sample once."""
    loader = ODBDataLoader(hf_sharded_stream(), token_budget=96, num_workers=workers)
    assert sorted(sample_ids(loader)) == list(range(60))


def stopped_after_four_batches(workers: int) -> tuple[list, dict]:
    """The first 4 batches of the split stream with `workers` workers, and the state saved after them."""
    stopped = ODBDataLoader(hf_sharded_stream(), token_budget=96, num_workers=workers)
    head = [batch for _, batch in zip(range(4), stopped)]
    state = stopped.state_dict()
    stopped.close()
    return head, state


def test_a_stream_split_over_workers_resumes_exactly():
    """G8 with 2 workers over 4 shards: the resumed loader re-reads the stream the same way."""
    full = list(ODBDataLoader(hf_sharded_stream(), token_budget=96, num_workers=2))
    head, state = stopped_after_four_batches(2)
    resumed = ODBDataLoader(hf_sharded_stream(), token_budget=96, num_workers=2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [b.info.indices for b in head + rest] == [b.info.indices for b in full]
    assert sample_ids(head + rest) == sample_ids(full)


@pytest.mark.parametrize("saved,resumed", [(2, 3), (2, 0), (3, 2)])
def test_a_split_stream_resumed_with_another_worker_count_is_refused_naming_it(saved, resumed):
    """The split stream's order depends on num_workers; a resume with another count would repeat and lose samples."""
    _, state = stopped_after_four_batches(saved)
    other = ODBDataLoader(hf_sharded_stream(), token_budget=96, num_workers=resumed)
    with pytest.raises(ValueError, match=rf"in {saved} DataLoader worker part\(s\).*resume with num_workers={saved}"):
        other.load_state_dict(state)


def test_a_split_stream_resumed_with_another_fetch_chunk_is_refused_and_an_older_state_still_resumes():
    """The workers' turns of fetch_chunk samples set a split stream's order too: before, a state saved with 4 loaded
    into a loader reading turns of 8, which repeated 3 samples and lost 3 without a word (a review's run)."""
    head, state = stopped_after_four_batches(2)
    assert state["sampler"]["chunk"] == 8  # the default fetch_chunk
    other = ODBDataLoader(hf_sharded_stream(), token_budget=96, num_workers=2, fetch_chunk=4)
    with pytest.raises(ValueError, match=r"in turns of 8 samples, this loader reads turns of 4: .* fetch_chunk=8"):
        other.load_state_dict(state)
    older = {**state, "sampler": {k: v for k, v in state["sampler"].items() if k != "chunk"}}
    older["digest"] = digest_of({k: v for k, v in older.items() if k != "digest"})
    resumed = ODBDataLoader(hf_sharded_stream(), token_budget=96, num_workers=2)
    resumed.load_state_dict(older)  # saved before the turns were recorded: loaded as before, at the default turns
    full = list(ODBDataLoader(hf_sharded_stream(), token_budget=96, num_workers=2))
    assert sample_ids(head + list(resumed)) == sample_ids(full)


def test_a_stream_with_a_num_shards_attribute_outside_hf_datasets_is_not_split():
    """Only HF datasets streams are trusted to hand each worker its own shards; another stream is dealt by ODB."""

    class Shardy(torch.utils.data.IterableDataset):
        num_shards = 4

        def __iter__(self):
            return iter([{"input_ids": [i + 3] * 5} for i in range(30)])

    assert sorted(sample_ids(ODBDataLoader(Shardy(), token_budget=96, num_workers=2))) == list(range(30))


def test_a_stream_split_by_node_is_read_whole_by_its_rank_and_a_wrong_split_is_refused(caplog):
    """NOTE [ Streams already split over ranks ]: with the default shard_iterable=True, ODB kept 1/W of each rank's
    part (40 of 80 samples at W = 2); an unsplit stream that every rank reads whole is said to train W times."""
    from datasets.distributed import split_dataset_by_node

    from odb_core import run_virtual_ranks

    def split_run(rank, transport):
        stream = split_dataset_by_node(hf_sharded_stream(80), rank=rank, world_size=transport.world_size)
        return sample_ids(ODBDataLoader(stream, token_budget=96, transport=transport, idle_sample={"input_ids": [1]}))

    emitted = [i for ids in run_virtual_ranks(split_run, 2) for i in ids]
    assert sorted(emitted) == list(range(80))
    with pytest.raises(ValueError, match=r"rank 0: the stream was split with split_dataset_by_node\(rank=1, "
                                         r"world_size=2\), but this is rank 0 of 1"):
        ODBDataLoader(split_dataset_by_node(hf_sharded_stream(), rank=1, world_size=2), token_budget=96)

    def unsplit_run(rank, transport):
        return sample_ids(ODBDataLoader(hf_sharded_stream(), token_budget=96, transport=transport,
                                        shard_iterable=False))

    with caplog.at_level("WARNING", logger="odb"):
        twice = Counter(i for ids in run_virtual_ranks(unsplit_run, 2) for i in ids)
    assert set(twice.values()) == {2}  # what the user asked for, and was told about
    assert "each sample trains 2 times" in caplog.text
