"""Elastic resume (NOTE [ Elastic resume ] in odb_core/resume/resume.py) on the in-process virtual cluster: states of W
ranks, merged, continue the epoch at W' without losing or repeating a sample; what cannot be honoured is refused."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from conftest import LengthDataset, lognormal_lengths
from odb_core import ODBDataLoader, run_virtual_ranks
from odb_core.resume.resume import ElasticResumeError, merge_states

N = 300
DATASET = LengthDataset(lognormal_lengths(N, 1.0, 128, seed=3, hi=1024))


def make(transport=None, dataset=DATASET, **kw):
    options = dict(token_budget=1024, shuffle=True, window=48, seed=1, prefetch_steps=1)
    return ODBDataLoader(dataset, transport=transport, **{**options, **kw})


def stop_after(world_size: int, steps: int, **kw):
    """Every rank consumes `steps` steps of epoch 0 and saves its state (through JSON); returns (infos, states)."""
    def rank_main(rank, transport):
        loader = make(transport, **kw)
        it = iter(loader)
        infos = [next(it).info for _ in range(steps)]
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        return infos, state
    results = run_virtual_ranks(rank_main, world_size)
    return [r[0] for r in results], [r[1] for r in results]


def continue_at(world_size: int, state, epochs: int = 1, **kw):
    """Every new rank loads `state` and runs `epochs` epochs; returns each rank's StepInfos."""
    def rank_main(rank, transport):
        loader = make(transport, **kw)
        loader.load_state_dict(state)
        return [b.info for _ in range(epochs) for b in loader]
    return run_virtual_ranks(rank_main, world_size)


def epoch_steps(world_size: int, **kw) -> int:
    return run_virtual_ranks(lambda r, t: sum(1 for _ in make(t, **kw)), world_size)[0]


def indices(infos_per_rank, epoch: int = 0) -> list[int]:
    return [i for infos in infos_per_rank for info in infos if info.epoch == epoch for i in info.indices]


@pytest.mark.parametrize("planning", ["global", "local"])
@pytest.mark.parametrize("old,new", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_elastic_resume_emits_every_index_exactly_once(old, new, planning):
    """Under global planning a rank's `round_emitted` lists its own samples emitted on any rank in the round."""
    total = epoch_steps(old, planning=planning)
    for stop in sorted({0, 1, total // 3, total - 1}):
        before, states = stop_after(old, stop, planning=planning)
        after = continue_at(new, merge_states(states), planning=planning)
        assert Counter(indices(before) + indices(after)) == Counter(range(N)), f"{old}->{new} after {stop} steps"
        assert len({len(infos) for infos in after}) == 1  # G2 at the new world size
        assert [info.step for info in after[0]] == list(range(stop, stop + len(after[0])))  # numbering continues


@pytest.mark.parametrize("old,new", [(2, 4), (4, 2)])
def test_elastic_resume_across_world_sizes_where_pool_window_acts_at_one_of_them(old, new):
    """window 200 and pool_window 512: the cap leaves 2 ranks alone (400 <= 512) and shrinks the rounds of 4 (800 >
    512: 128 per rank), so the fingerprints record pool_window None and 512; the same setting still resumes."""
    options = dict(window=200, pool_window=512)
    total = epoch_steps(old, **options)
    before, states = stop_after(old, total // 3, **options)
    after = continue_at(new, merge_states(states), **options)
    assert {s["config"]["pool_window"] for s in states} == {None if old == 2 else 512}
    assert Counter(indices(before) + indices(after)) == Counter(range(N))
    assert len({len(infos) for infos in after}) == 1


def test_elastic_resume_after_the_last_step_starts_the_next_epoch():
    total = epoch_steps(2)
    _, states = stop_after(2, total)
    after = continue_at(1, merge_states(states))
    assert {info.epoch for info in after[0]} == {1}
    assert Counter(indices(after, epoch=1)) == Counter(range(N))


def test_elastic_resume_without_join_never_repeats_and_reports_the_rest():
    before, states = stop_after(2, 4, join=False)

    def rank_main(rank, transport):
        loader = make(transport, join=False)
        loader.load_state_dict(merge_states(states))
        return [b.info for b in loader], list(loader.last_report.not_emitted)
    results = run_virtual_ranks(rank_main, 3)
    emitted = indices(before) + indices([infos for infos, _ in results])
    reported = [i for _, left in results for i in left]
    assert max(Counter(emitted).values()) == 1  # G4: no sample twice
    assert Counter(emitted + reported) == Counter(range(N))


def test_a_remainder_epoch_resumes_exactly_and_elastically_again():
    before, states = stop_after(2, 5)
    merged = merge_states(states)

    def remainder(rank, transport, stop):
        loader = make(transport)
        loader.load_state_dict(merged)
        it = iter(loader)
        head = [next(it).info for _ in range(stop)]
        state = json.loads(json.dumps(loader.state_dict()))
        return head, state, [b.info for b in it]
    (head, state, tail), = run_virtual_ranks(lambda r, t: remainder(r, t, 7), 1)
    assert state["plan"]["kind"] == "remainder"
    exact = continue_at(1, state)[0]
    assert [(i.step, i.indices, i.window_tokens) for i in exact] == [(i.step, i.indices, i.window_tokens) for i in tail]
    again = continue_at(2, merge_states([state]))  # 2 -> 1 -> 2 inside the same epoch
    assert Counter(indices(before) + [i for info in head for i in info.indices] + indices(again)) == Counter(range(N))


def test_the_epoch_after_an_elastic_resume_is_a_normal_epoch_at_the_new_world_size():
    _, states = stop_after(1, 6)
    after = continue_at(2, merge_states(states), epochs=2)

    def fresh(rank, transport):
        loader = make(transport)
        loader.set_epoch(1)
        return [b.info.indices for b in loader]
    assert [[i.indices for i in infos if i.epoch == 1] for infos in after] == run_virtual_ranks(fresh, 2)


def test_elastic_resume_keeps_gradient_accumulation_windows_whole():
    _, states = stop_after(2, 4, accumulation_steps=2)
    after = continue_at(1, merge_states(states), accumulation_steps=2)[0]
    assert after[0].step == 4 and (after[-1].step + 1) % 2 == 0
    for k in range(0, len(after), 2):
        window = after[k : k + 2]
        assert window[0].window_tokens == window[1].window_tokens == sum(i.global_tokens for i in window)


def test_elastic_resume_refuses_what_it_cannot_honour():
    _, states = stop_after(2, 3, accumulation_steps=2)
    with pytest.raises(ElasticResumeError, match=r"missing \[1\]"):
        merge_states(states[:1])
    _, later = stop_after(2, 4, accumulation_steps=2)
    with pytest.raises(ElasticResumeError, match="after different steps"):
        merge_states([states[0], later[1]])
    with pytest.raises(ElasticResumeError, match="accumulation window"):
        make(accumulation_steps=2).load_state_dict(merge_states(states))
    with pytest.raises(ElasticResumeError, match="merge_states"):
        make(accumulation_steps=2).load_state_dict(states[0])  # one rank's state at another world size
    merged = merge_states(later)
    with pytest.raises(ValueError, match=r"saved with token_budget=\d+ \(this loader: 2048\); resume needs the same "
                                         r"batching config: build the loader with the saved values$"):
        make(accumulation_steps=2, token_budget=2048).load_state_dict(merged)  # before, both whole configs
    with pytest.raises(ElasticResumeError, match="same dataset"):
        make(accumulation_steps=2, dataset=LengthDataset([10] * (N - 1))).load_state_dict(merged)
    custom = make(accumulation_steps=2, shuffle=False, sampler=torch.utils.data.SequentialSampler(DATASET))
    with pytest.raises(ElasticResumeError, match="own sampler"):
        custom.load_state_dict(merged)


def test_elastic_resume_refuses_states_of_an_iterable_dataset():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return (DATASET[i] for i in range(N))

    def rank_main(rank, transport):
        loader = ODBDataLoader(Stream(), token_budget=1024, window=48, transport=transport)
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        loader.close()
        return state
    merged = merge_states(run_virtual_ranks(rank_main, 2))
    with pytest.raises(ElasticResumeError, match="IterableDataset"):
        ODBDataLoader(Stream(), token_budget=1024, window=48).load_state_dict(merged)


def test_a_merged_state_at_the_same_world_size_resumes_exactly():
    total = epoch_steps(2)
    reference = run_virtual_ranks(lambda r, t: [b.info for b in make(t)], 2)
    before, states = stop_after(2, total // 2)
    after = continue_at(2, merge_states(list(reversed(states))))
    assert [b + a for b, a in zip(before, after)] == reference
