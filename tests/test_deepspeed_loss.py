"""Loss scaling and step accounting of odb_deepspeed, in one process against a stub of the engine's interface.

The real engine is exercised by tests/test_deepspeed_zero.py; here the scaling formula itself is checked by
emulating what DeepSpeed does to a loss (divide by G in backward, average over W ranks in the reduction).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import odb_deepspeed
from odb_core import ODBBatch, ODBDataLoader, StepInfo
from odb_deepspeed.accounting import DeepSpeedODBLoader


@dataclass
class StubMonitor:
    enabled: bool = True
    events: list = field(default_factory=list)

    def write_events(self, events):
        self.events.extend(events)


@dataclass
class StubEngine:
    """The attributes of a DeepSpeedEngine that odb_deepspeed reads."""

    dp_world_size: int = 2
    gradient_average: bool = True
    accumulation: int = 2
    micro_steps: int = 0
    global_steps: int = 0
    monitor: StubMonitor = field(default_factory=StubMonitor)

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation

    def step(self) -> None:  # what engine.step() does to the counters
        self.micro_steps += 1
        self.global_steps += int(self.micro_steps % self.accumulation == 0)


def _info(window_tokens: int) -> StepInfo:
    """A real StepInfo (from a one-sample loader) with the given window_tokens."""
    sample = {"input_ids": torch.arange(4), "labels": torch.arange(4)}
    info = next(iter(ODBDataLoader([sample], token_budget=8))).info
    return dataclasses.replace(info, window_tokens=window_tokens)


def _micro_batches(world: int, accumulation: int, seed: int = 0):
    """world x accumulation micro-batches of different sizes and lengths, some fully masked (IDLE-like)."""
    gen = torch.Generator().manual_seed(seed)
    batches = {}
    for r in range(world):
        for m in range(accumulation):
            rows, length = 1 + (r + 2 * m) % 3, 4 + 3 * r + m
            labels = torch.randint(0, 11, (rows, length), generator=gen)
            labels[torch.rand(rows, length, generator=gen) < 0.3] = -100
            if (r, m) == (world - 1, accumulation - 1):
                labels[:] = -100  # an IDLE dummy
            batches[r, m] = (torch.randn(rows, length, 5, generator=gen, dtype=torch.float64), labels)
    return batches


@pytest.mark.parametrize(("world", "accumulation", "average"), [(2, 2, True), (3, 1, True), (2, 3, False)])
def test_scaled_losses_give_the_exact_global_token_mean_gradient_after_deepspeed_normalisation(
        world, accumulation, average):
    weight = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    batches = _micro_batches(world, accumulation)
    window_tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches.values())
    engine = StubEngine(dp_world_size=world, gradient_average=average, accumulation=accumulation)
    info = _info(window_tokens)
    reduced = torch.zeros_like(weight)
    for r in range(world):
        local = torch.zeros_like(weight)
        for m in range(accumulation):
            features, labels = batches[r, m]
            loss = odb_deepspeed.token_weighted_loss(features @ weight, {"labels": labels}, engine, info=info)
            local += torch.autograd.grad(loss / accumulation, weight)[0]  # engine.backward divides by G
        reduced += local
    reduced /= world if average else 1  # DP reduction: mean (default) or sum
    logits = torch.cat([(f @ weight)[:, :-1].reshape(-1, 11) for f, _ in batches.values()])
    targets = torch.cat([labels[:, 1:].reshape(-1) for _, labels in batches.values()])
    reference = torch.autograd.grad(F.cross_entropy(logits, targets, ignore_index=-100), weight)[0]
    assert torch.allclose(reduced, reference, rtol=1e-12, atol=1e-15)


def test_window_without_supervised_tokens_gives_zero_loss_and_unknown_windows_are_refused():
    logits = torch.randn(1, 4, 3, requires_grad=True)
    batch = {"labels": torch.full((1, 4), -100)}
    loss = odb_deepspeed.token_weighted_loss(logits, batch, StubEngine(), info=_info(0))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
    with pytest.raises(ValueError, match="window_tokens=-1 is unknown"):
        odb_deepspeed.loss_scale(_info(-1), StubEngine())


def test_token_weighted_loss_needs_step_info_when_the_batch_was_copied():
    with pytest.raises(ValueError, match="info=batch.info"):
        odb_deepspeed.token_weighted_loss(torch.zeros(1, 3, 4), {"labels": torch.zeros(1, 3, dtype=torch.long)},
                                          StubEngine())


def test_loader_counts_real_samples_and_tokens_and_writes_them_to_the_monitor(small_dataset):
    engine = StubEngine(dp_world_size=1)
    loader = DeepSpeedODBLoader(ODBDataLoader(small_dataset, token_budget=2048, accumulation_steps=2), engine)
    seen = []
    for batch in loader:
        assert isinstance(batch, ODBBatch)
        seen += batch.info.indices
        engine.step()
    counts, metrics = loader.consumed, loader.odb.metrics.counts
    assert sorted(seen) == list(range(len(small_dataset))) and counts.samples == len(small_dataset)
    assert counts.optimizer_steps == engine.global_steps == counts.micro_batches // 2
    assert (counts.supervised_tokens, counts.input_tokens) == (metrics.global_supervised_tokens,
                                                               metrics.global_input_tokens)
    samples = [value for name, value, _ in engine.monitor.events if name == "Train/ODB/samples"]
    steps = [step for name, _, step in engine.monitor.events if name == "Train/ODB/samples"]
    assert sum(samples) == len(small_dataset) and steps == list(range(1, engine.global_steps + 1))


def test_loader_refuses_to_continue_when_deepspeed_window_is_out_of_step(small_dataset):
    engine = StubEngine(dp_world_size=1)
    loader = DeepSpeedODBLoader(ODBDataLoader(small_dataset, token_budget=2048, accumulation_steps=2), engine)
    batches = iter(loader)
    next(batches)
    engine.step()
    next(batches)  # the loop forgot engine.step() for this micro-batch
    with pytest.raises(RuntimeError, match="engine.step\\(\\) once per yielded batch"):
        next(batches)


def test_counts_resume_from_a_version_1_state_and_are_saved_in_the_same_format(small_dataset):
    """A state written before the counts were `StepCounts` (version 1: these keys) loads, and is written back the same."""
    def fresh() -> DeepSpeedODBLoader:
        return DeepSpeedODBLoader(ODBDataLoader(small_dataset, token_budget=2048, accumulation_steps=2),
                                  StubEngine(dp_world_size=1))

    loader = fresh()
    batches = iter(loader)
    for _ in range(3):  # one optimizer step and one micro-batch of the next
        next(batches)
        loader.engine.step()
    state = loader.state_dict()
    assert state["version"] == 1 and set(state) == {"version", "odb", "consumed", "window"}
    assert state["window"]["samples"] > 0 and state["consumed"]["optimizer_steps"] == 1
    old = {"version": 1, "odb": state["odb"],
           "consumed": {"optimizer_steps": 3, "micro_batches": 7, "idle_micro_batches": 1, "samples": 20,
                        "supervised_tokens": 500, "input_tokens": 600},
           "window": {"samples": 2, "supervised_tokens": 30, "input_tokens": 40}}
    for saved in (state, old):
        resumed = fresh()
        resumed.load_state_dict(saved)
        assert dataclasses.asdict(resumed.consumed) == saved["consumed"]
        assert {k: v for k, v in resumed.state_dict().items() if k != "odb"} == {k: v for k, v in saved.items()
                                                                                 if k != "odb"}
    with pytest.raises(ValueError, match="unexpected keys"):
        fresh().load_state_dict({**old, "extra": 1})
