"""Token-weighted loss: the exact per-supervised-token mean of an optimizer step, split over ranks and micro-batches.

NOTE [ Exact token-weighted loss ]
An optimizer step runs micro-batches m = 1..G on ranks r = 1..W. The loss whose gradient we want is

    L = (1 / N) * sum_{r,m} S_{r,m},   S_{r,m} = sum of token CE over the supervised tokens of (r, m),
                                       N = sum_{r,m} n_{r,m}  (`StepInfo.window_tokens`, known before the step).

Each (r, m) backpropagates `S_{r,m} * c / N`, where `c` undoes what the training framework does to gradients:
DDP / ZeRO *average* gradients over W ranks (c gets a factor W), and some engines divide every micro-batch's loss
by G before backward (c gets a factor G). Summing the W x G backward passes then gives exactly dL/dtheta.
IDLE micro-batches have every label at -100: S = 0 and n = 0, so they contribute exactly zero. A step with no
supervised token at all (N = 0) has S = 0 everywhere; its normaliser is clamped to 1 so the loss is 0, not NaN.
Cost: nothing beyond the loss itself; N comes with the batch, so no collective is needed per step.

NOTE [ Exact or loud ]
A framework hands the loss it backpropagates to code ODB does not own (a model's loss, a Trainer subclass, a
loss function), and a per-micro-batch mean there makes the step silently inexact. The adapters check the first
optimizer step, where a wrong normalisation shows (every check costs nothing afterwards):
  * `normalized_share` (HF Trainer): the loss gets N as a leaf tensor that records gradients; -dL/dN * N / L is
    the share of the loss that is divided by N: 1 for sum / N, 0 for a loss that ignores N (a mean per batch or
    per sequence). Only the path from the loss to N is differentiated (no model gradient is computed). Shares from
    0.5 to 1 pass: a model may add a term that is no token mean (a MoE router's auxiliary loss, a regulariser),
    which the check cannot tell from a loss divided by N only in part; a loss that ignores N scores 0.
  * `weighting_error` (DeepSpeed): the loss against `causal_lm_loss_sum(logits, labels) * factor`, computed here
    sample by sample without gradients (no more memory than one sample's logits).
Anything else raises with the cause and the one-line fix (docs/guarantees.md G6 lists the cases).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from odb_core.data.collate import supervised_tokens
from odb_core.data.sample import IGNORE_INDEX


def step_normalizer(window_tokens: int) -> int:
    """N for a step's loss: its supervised tokens over every rank and micro-batch, clamped to >= 1."""
    if window_tokens < 0:
        raise ValueError(f"window_tokens={window_tokens} is unknown (< 0); the loader must release whole "
                         "accumulation windows (ODBConfig.accumulation_steps) before their tokens are used")
    return max(int(window_tokens), 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLossScale:
    """The factor `c / N` of NOTE [ Exact token-weighted loss ] for one micro-batch.

    Fields:
        window_tokens: `StepInfo.window_tokens` of the micro-batch (the same for all micro-batches of a step).
        world_size: data-parallel ranks whose gradients the framework averages (1 if it sums them).
        micro_batch_divisor: what the framework divides each micro-batch loss by before backward (1 if nothing).
    """

    window_tokens: int
    world_size: int = 1
    micro_batch_divisor: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.micro_batch_divisor < 1:
            raise ValueError(f"world_size={self.world_size} and micro_batch_divisor={self.micro_batch_divisor} "
                             "must both be >= 1")

    @property
    def factor(self) -> float:
        return self.world_size * self.micro_batch_divisor / step_normalizer(self.window_tokens)

    def apply(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate, from this micro-batch's summed token loss."""
        return loss_sum * self.factor


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of next-token cross-entropy over the supervised tokens (`labels[..., 1:] != ignore_index`).

    Half-precision logits are upcast to float32 (as the HF causal-LM loss does); float64 stays float64. The
    shift matches `odb_core.data.collate.supervised_tokens`, so `n_{r,m}` and `S_{r,m}` count the same tokens.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match in the "
                         "batch and sequence dimensions")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    shifted_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1])
    shifted_labels = labels[..., 1:].reshape(-1).to(shifted_logits.device)
    return F.cross_entropy(shifted_logits, shifted_labels, ignore_index=ignore_index, reduction="sum")


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, `output["logits"]`, `output.logits`, or a tuple's first."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]  # a model called with return_dict=False and no labels
    logits = getattr(output, "logits", None)
    if logits is None:
        raise TypeError(f"expected logits or a model output with .logits, got {type(output).__name__}")
    return logits


def causal_lm_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None) -> Any:
    """Summed next-token CE / num_items_in_batch (the micro-batch's token mean without it), with the signature of
    the HF Trainer's `compute_loss_func` (exported there as `odb_hf.causal_lm_loss`)."""
    total = causal_lm_loss_sum(logits_of(outputs), labels)
    if num_items_in_batch is None:
        return total / max(supervised_tokens({"labels": labels}, ()), 1)
    return total / num_items_in_batch


def normalized_share(loss: torch.Tensor, normalizer: torch.Tensor) -> float:
    """The share of `loss` that is divided by the leaf tensor `normalizer` (NOTE [ Exact or loud ]); 1.0 for a
    zero loss (nothing to tell)."""
    value = float(loss.detach())
    if value == 0.0:
        return 1.0
    if not loss.requires_grad:
        return 0.0
    (grad,) = torch.autograd.grad(loss, normalizer, retain_graph=True, allow_unused=True)
    return 0.0 if grad is None else float(-grad * normalizer.detach()) / value


@torch.no_grad()
def weighting_error(loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, factor: float) -> float:
    """Relative difference between `loss` and the token-weighted loss `sum CE * factor` of these logits."""
    expected = sum(float(causal_lm_loss_sum(logits[row : row + 1], labels[row : row + 1]))
                   for row in range(logits.shape[0])) * factor
    return abs(float(loss) - expected) / max(abs(expected), 1e-12)
