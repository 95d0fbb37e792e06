"""Unit tests of the budget constraints and the pure grouping (`odb_core.planning.budget`,
`odb_core.planning.grouping`), and of the benchmarks' offline oracle they are measured against
(`benchmarks.lib.oracle`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.lib.oracle import oracle_groups  # the benchmarks' offline oracle, checked here against the planner
from conftest import lognormal_lengths
from odb_core import Item, ODBConfig, simulate_epoch
from odb_core.planning.budget import AttentionBudget, CountCap, PaddedBudget, PatchCap, TokenBudget, build_budget
from odb_core.planning.grouping import Group, pack_sorted, plan_buffer, sort_longest_first, split_group, split_widest


def items_of(lengths, patches=None) -> list[Item]:
    patches = patches or [0] * len(lengths)
    return [Item(index=i, length=n, patches=p) for i, (n, p) in enumerate(zip(lengths, patches, strict=True))]


def lengths_of(groups) -> list[list[int]]:
    return [[it.length for it in g.items] for g in groups]


# -- cost models ---------------------------------------------------------------------------------------------

def test_padded_cost_is_batch_size_times_longest():
    budget = PaddedBudget(100)
    for item in items_of([30, 20]):
        budget.add(item)
    assert budget.measure() == 2 * 30
    assert budget.fits(Item(9, 33))  # 3 x 33 = 99
    assert not budget.fits(Item(9, 34))  # 3 x 34 = 102
    assert not budget.fits(Item(9, 101))


def test_token_cost_is_the_sum_of_lengths():
    budget = TokenBudget(100)
    for item in items_of([30, 20]):
        budget.add(item)
    assert budget.measure() == 50
    assert budget.fits(Item(9, 50))
    assert not budget.fits(Item(9, 51))


def test_attention_cost_adds_a_quadratic_term_in_the_longest_sample():
    budget = AttentionBudget(1000, alpha=0.5)
    for item in items_of([10, 4]):
        budget.add(item)
    assert budget.measure() == 2 * 10 + 0.5 * 2 * 10 * 10  # 120
    assert budget.fits(Item(9, 17))  # 3 x 17 + 0.5 x 3 x 289 = 484.5
    assert not budget.fits(Item(9, 25))  # 75 + 0.5 x 3 x 625 = 1012.5


def test_count_and_patch_caps_bound_samples_and_patches_per_group():
    count, patches = CountCap(2), PatchCap(10)
    for item in items_of([5, 5], patches=[4, 6]):
        assert count.fits(item) and patches.fits(item)
        count.add(item)
        patches.add(item)
    assert not count.fits(Item(9, 1)) and count.measure() == 2
    assert not patches.fits(Item(9, 1, patches=1)) and patches.fits(Item(9, 1, patches=0))


def test_reset_starts_an_empty_group():
    budget = PaddedBudget(10)
    budget.add(Item(0, 10))
    assert not budget.fits(Item(1, 1))
    budget.reset()
    assert budget.measure() == 0 and budget.fits(Item(1, 10))


def test_group_budget_checks_every_constraint_and_reports_the_token_cost():
    budget = build_budget(ODBConfig(token_budget=100, cost="tokens", max_batch_size=2, max_patches=5))
    budget.add(Item(0, 10, patches=3))
    assert not budget.fits(Item(1, 10, patches=3))  # patch cap
    assert budget.fits(Item(1, 10, patches=2))
    budget.add(Item(1, 10, patches=2))
    assert not budget.fits(Item(2, 1))  # count cap
    assert budget.cost() == 20  # tokens, not samples or patches


def test_a_sample_over_the_budget_or_patch_cap_alone_is_oversize():
    budget = build_budget(ODBConfig(token_budget=100, max_patches=5))
    assert budget.alone_fits(Item(0, 100, patches=5))
    assert not budget.alone_fits(Item(0, 101))
    assert not budget.alone_fits(Item(0, 1, patches=6))


@settings(max_examples=300, deadline=None)
@given(cost=st.sampled_from(["padded", "tokens", "attention"]), token_budget=st.integers(1, 50_000),
       alpha=st.sampled_from([0.0, 1e-4, 0.5]), cap=st.sampled_from([None, 1, 4]),
       lengths=st.lists(st.integers(1, 60_000), min_size=1, max_size=30))
def test_alone_length_is_exactly_where_a_patchless_sample_stops_fitting_alone(cost, token_budget, alpha, cap,
                                                                              lengths):
    # admit() skips alone_fits for a patchless sample no longer than alone_length: the two must agree everywhere
    config = ODBConfig(token_budget=token_budget, cost=cost, attention_alpha=alpha if cost == "attention" else 0.0,
                       max_batch_size=cap)
    budget = build_budget(config)
    edge = budget.alone_length
    for length in [*lengths, edge, edge + 1, max(edge - 1, 1)]:
        assert (length <= edge) == budget.alone_fits(Item(0, length)), (length, edge)


@pytest.mark.parametrize("cost", ["padded", "tokens", "attention"])
def test_admit_refuses_exactly_what_alone_fits_refuses_whatever_the_length(cost):
    # odb plan and simulate_epoch pass unchecked lengths: zero and negative ones too (-200 + 0.01 x 200^2 > 100)
    from odb_core.planning.planner import RankEngine
    from odb_core.planning.budget import SampleError

    config = ODBConfig(token_budget=100, cost=cost, attention_alpha=0.01 if cost == "attention" else 0.0,
                       oversize="error", max_patches=5)
    engine = RankEngine(config, epoch=0)
    for length in (-200, -1, 0, 1, 50, 100, 101):
        for patches in (0, 5, 6):
            item = Item(0, length, patches)
            try:
                engine.admit(item)
                admitted = True
            except SampleError:
                admitted = False
            assert admitted == engine.budget.alone_fits(item), (length, patches)


# -- two-pointer packing -------------------------------------------------------------------------------------

def test_token_top_up_from_the_short_end_beats_next_fit():
    # sorted: 6 6 4 4 under sum <= 10. Next-fit: [6] [6 4] [4]. Two-pointer: [6 4] [6 4].
    items = items_of([6, 4, 6, 4])
    budget = build_budget(ODBConfig(token_budget=10, cost="tokens"))
    packed = pack_sorted(sort_longest_first(items), budget)
    next_fit = oracle_groups(items, budget)
    assert lengths_of(packed) == [[6, 4], [6, 4]]
    assert lengths_of(next_fit) == [[6], [6, 4], [4]]


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 120), st.integers(0, 40)), min_size=1, max_size=60),
       st.sampled_from(["padded", "attention"]), st.sampled_from([None, 60]))
def test_padded_and_attention_packing_equals_the_global_sort_greedy(facts, cost, max_patches):
    # NOTE [ Grouping ]: no short-end top-up for costs fixed by the longest member, with or without a patch cap.
    config = ODBConfig(token_budget=100, cost=cost, attention_alpha=0.01 if cost == "attention" else 0.0,
                       max_patches=max_patches)
    items = items_of([n for n, _ in facts], [p for _, p in facts])
    budget = build_budget(config)
    packed = pack_sorted(sort_longest_first(items), budget)
    assert budget.padded_only == (cost == "padded" and max_patches is None)  # the per-group path, checked here
    assert [(g.indices, g.cost) for g in packed] == [(g.indices, g.cost) for g in oracle_groups(items, budget)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 150), min_size=1, max_size=60), st.sampled_from(["padded", "tokens", "attention"]))
def test_packing_keeps_every_sample_once_and_every_multi_sample_group_within_budget(lengths, cost):
    config = ODBConfig(token_budget=100, cost=cost, attention_alpha=0.01 if cost == "attention" else 0.0)
    budget = build_budget(config)
    groups = pack_sorted(sort_longest_first(items_of(lengths)), budget)
    assert sorted(i for g in groups for i in g.indices) == list(range(len(lengths)))
    for group in groups:
        assert group.cost == budget.cost_of_items(group.items)
        assert group.cost <= 100 or (group.size == 1 and not budget.alone_fits(group.items[0]))


def test_zero_length_items_which_odb_plan_accepts_are_packed_by_the_per_sample_greedy():
    budget = build_budget(ODBConfig(token_budget=100))
    groups = pack_sorted(sort_longest_first(items_of([30, 0, 0, 0, 20])), budget)
    assert [(g.indices, g.cost) for g in groups] == [((0, 4, 1), 90), ((2, 3), 0)]  # the per-sample greedy


def test_oversize_samples_form_groups_of_their_own():
    budget = build_budget(ODBConfig(token_budget=100, cost="tokens"))
    groups = pack_sorted(sort_longest_first(items_of([150, 30, 120, 40])), budget)
    assert lengths_of(groups) == [[150], [120], [40, 30]]


def test_sort_order_is_longest_then_most_patches_then_index():
    items = [Item(3, 5, 0), Item(1, 5, 2), Item(2, 7, 0), Item(0, 5, 0)]
    assert [it.index for it in sort_longest_first(items)] == [2, 1, 0, 3]


# -- tail carry ----------------------------------------------------------------------------------------------

def test_open_window_holds_back_its_tail_group():
    budget = build_budget(ODBConfig(token_budget=100))
    plan = plan_buffer(items_of([50, 50, 40, 40, 10]), budget, closing=False)
    assert lengths_of(plan.groups) == [[50, 50], [40, 40], [10]]
    assert plan.n_ready == 2
    assert lengths_of(plan.held) == [[10]]


def test_closing_window_emits_its_tail_group():
    budget = build_budget(ODBConfig(token_budget=100))
    plan = plan_buffer(items_of([50, 50, 40, 40, 10]), budget, closing=True)
    assert plan.n_ready == len(plan.groups) == 3
    assert plan.held == ()


def test_a_lone_group_is_ready_even_in_an_open_window():
    # An active rank always reports at least one ready group (NOTE [ Rounds and termination ]).
    budget = build_budget(ODBConfig(token_budget=100))
    plan = plan_buffer(items_of([10, 20]), budget, closing=False)
    assert plan.n_ready == 1 and plan.held == ()
    assert plan_buffer([], budget, closing=True).n_ready == 0


# -- split ---------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 50), min_size=2, max_size=30), st.sampled_from(["padded", "tokens", "attention"]))
def test_split_halves_keep_the_samples_and_cost_no_more_than_the_whole(lengths, cost):
    config = ODBConfig(token_budget=10_000, cost=cost, attention_alpha=0.5 if cost == "attention" else 0.0)
    budget = build_budget(config)
    items = tuple(sort_longest_first(items_of(lengths)))
    whole = Group(items, budget.cost_of_items(items))
    first, second = split_group(whole, budget)
    assert first.items + second.items == whole.items
    assert abs(first.size - second.size) <= 1 and first.size >= 1 and second.size >= 1
    for half in (first, second):
        assert half.cost == budget.cost_of_items(half.items) <= whole.cost


# -- oracle --------------------------------------------------------------------------------------------------

def test_oracle_is_a_next_fit_over_the_globally_sorted_lengths():
    items = items_of([10, 90, 30, 60, 45, 5, 70])
    budget = build_budget(ODBConfig(token_budget=100, cost="tokens"))
    groups = oracle_groups(items, budget)
    assert lengths_of(groups) == [[90], [70], [60], [45, 30, 10, 5]]
    flat = [n for g in lengths_of(groups) for n in g]
    assert flat == sorted(flat, reverse=True)
    # Next-fit closes a group only when the next sample does not fit it.
    for group, following in zip(groups, groups[1:], strict=False):
        assert budget.cost_of_items(group.items + following.items[:1]) > 100


# -- utilization against the oracle -------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("cv", [0.5, 1.0])
def test_simulated_utilization_is_within_five_percent_of_the_oracle(cv, world):
    # Planner quality (DESIGN 5), not timing: utilization = real tokens / (steps x W x L_max).
    budget_tokens = 16384
    lengths = lognormal_lengths(20_000, cv=cv, mean=1024, seed=0, lo=16, hi=8192)
    items = items_of(lengths)
    config = ODBConfig(token_budget=budget_tokens)
    oracle = len(oracle_groups(items, build_budget(config)))
    oracle_utilization = sum(lengths) / (oracle * budget_tokens)
    plan = simulate_epoch([items[r::world] for r in range(world)], config)
    utilization = sum(lengths) / (plan.n_steps * world * budget_tokens)
    assert utilization >= 0.95 * oracle_utilization


def _split_widest_by_scanning(groups, count, budget):
    """The definition: rescan for the widest group (earliest on ties) and split it in place, one at a time."""
    n_split = 0
    while len(groups) < count:
        widest = max(range(len(groups)), key=lambda i: (groups[i].size, -i), default=None)
        if widest is None or groups[widest].size < 2:
            break
        groups[widest : widest + 1] = list(split_group(groups[widest], budget))
        n_split += 1
    return n_split


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 12), max_size=12), extra=st.integers(0, 40))
def test_split_widest_splits_exactly_the_groups_a_rescan_would(sizes, extra):
    budget = build_budget(ODBConfig(token_budget=10_000))
    groups, start = [], 0
    for size in sizes:
        members = tuple(Item(index=start + k, length=5 + (start + k) % 7) for k in range(size))
        groups.append(Group(members, budget.cost_of_items(members)))
        start += size
    fast, slow = list(groups), list(groups)
    assert split_widest(fast, len(groups) + extra, budget) == _split_widest_by_scanning(slow, len(groups) + extra,
                                                                                          budget)
    assert [g.indices for g in fast] == [g.indices for g in slow]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(0, 3), st.integers(0, 5)), min_size=64, max_size=150))  # the lexsort path
def test_the_vectorised_sort_matches_the_key_sort(rows):
    items = [Item(index=i % 37, length=n, patches=p, owner=o) for i, (n, p, o) in enumerate(rows)]
    for by_owner in (False, True):
        key = ((lambda it: (-it.length, -it.patches, it.owner, it.index)) if by_owner
               else (lambda it: (-it.length, -it.patches, it.index)))
        got = [(it.length, it.patches, it.owner, it.index) for it in sort_longest_first(items, by_owner=by_owner)]
        want = [(it.length, it.patches, it.owner, it.index) for it in sorted(items, key=key)]
        assert got == want  # both sorts are stable, so even full ties keep the input order


def test_an_oversize_error_names_the_limit_the_sample_exceeds():
    """Before, a sample over max_patches alone was said to exceed token_budget, whose raise would not help."""
    from odb_core.planning.budget import SampleError
    from odb_core.planning.planner import RankEngine

    engine = RankEngine(ODBConfig(token_budget=4096, max_patches=512, oversize="error"), epoch=0)
    for item, named in ((Item(10, 22, 600), "exceeds max_patches=512 on its own; raise it"),
                        (Item(11, 5000, 0), "exceeds token_budget=4096 on its own; raise it"),
                        (Item(12, 5000, 600), "exceeds token_budget=4096 and max_patches=512 on its own; raise them")):
        with pytest.raises(SampleError, match=rf"^sample {item.index}: cost of length .* {named}, truncate"):
            engine.admit(item)
