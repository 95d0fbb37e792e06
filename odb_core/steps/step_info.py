"""Step metadata that travels beside the batch, never inside its tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInfo:
    """Facts about one yielded step on this rank.

    `*_tokens` are supervised tokens (labels != -100 after the causal shift); `*_input_tokens` are real,
    unpadded input tokens. `global_*` sum over every rank for this step. `window_tokens` is the supervised-token
    count of the whole optimizer step (every rank, every accumulation micro-batch): the exact normaliser of a
    per-token mean loss. `cost` is this rank's group cost under the cost model and `rank_imbalance` the
    coefficient of variation of the step's group costs across ranks (0 = perfectly balanced). `*_patches` are
    vision patches (rows of `pixel_values`) of the step's real samples. `window_steps` is the number of
    micro-batches of this step's optimizer step (the same on every rank), `window_index` this micro-batch's place
    in it (the optimizer step ends after `window_index == window_steps - 1`) and `window_samples` its global
    samples; like `window_tokens` they are filled when the optimizer step is complete. IDLE steps have no indices and zero counts
    and carry a zero-weight dummy batch.
    """

    epoch: int
    step: int
    round: int
    indices: tuple[int, ...]
    is_idle: bool
    local_samples: int
    global_samples: int
    local_tokens: int
    global_tokens: int
    local_input_tokens: int
    global_input_tokens: int
    padded_tokens: int
    cost: float
    rank_imbalance: float
    window_tokens: int
    local_patches: int = 0
    global_patches: int = 0
    window_steps: int = 0
    window_index: int = 0
    window_samples: int = 0

    def in_window(self, *, tokens: int, samples: int, steps: int, index: int) -> StepInfo:
        """This step with its optimizer step's window fields filled in (`AccumulationWindow.flush`, once per step:
        built field by field, which costs half of what `dataclasses.replace` does)."""
        return StepInfo(epoch=self.epoch, step=self.step, round=self.round, indices=self.indices, is_idle=self.is_idle,
                        local_samples=self.local_samples, global_samples=self.global_samples,
                        local_tokens=self.local_tokens, global_tokens=self.global_tokens,
                        local_input_tokens=self.local_input_tokens, global_input_tokens=self.global_input_tokens,
                        padded_tokens=self.padded_tokens, cost=self.cost, rank_imbalance=self.rank_imbalance,
                        window_tokens=tokens, local_patches=self.local_patches, global_patches=self.global_patches,
                        window_steps=steps, window_index=index, window_samples=samples)

    @property
    def ends_window(self) -> bool:
        """Whether the optimizer step ends after this micro-batch (on every rank)."""
        return self.window_index == self.window_steps - 1


class ODBBatch(dict):
    """The user's collated, model-ready mapping (`model(**batch)` works) with a frozen `StepInfo` as `.info`.

    Frameworks that rebuild mappings with `type(batch)(...)` (accelerate's `send_to_device`, the HF Trainer's
    `_prepare_inputs`) get a plain copy without `.info`; adapters read `.info` before moving the batch.
    """

    __slots__ = ("info",)

    def __init__(self, data: Mapping[str, Any] = (), info: StepInfo | None = None) -> None:
        super().__init__(data)
        self.info = info

    def __reduce__(self):  # picklable with its info
        return (type(self), (dict(self), self.info))
