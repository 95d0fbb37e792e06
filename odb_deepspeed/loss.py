"""The token-weighted loss to hand to `engine.backward`, so that every optimizer step is exact (guarantee G6).

NOTE [ Loss scaling under DeepSpeed ]
Goal: the gradient of one optimizer step equals the gradient of  L = sum(CE over every supervised token of the
step, on all W ranks and all G micro-batches) / N,  with N = `StepInfo.window_tokens`.
What DeepSpeed 0.19.8 does to a loss `l` of micro-batch (r, m):
  * `engine.backward(l)` backpropagates `l / G` (`scale_wrt_gas=True`, the default); under ZeRO a plain
    `l.backward()` after `engine(...)` divides the output gradients by G too (`_backward_prologue_per_tensor`);
  * gradients accumulate over the G micro-batches, then the data-parallel reduction (stage 0 all-reduce,
    ZeRO-1/2 `average_tensor`/reduce, ZeRO-3 reduce-scatter) sums over ranks and divides by W when
    `gradient_allreduce_op` is "mean" (the default; `gradient_predivide_factor` cancels out); "sum" divides
    by nothing.
So the step's gradient is  (1 / (G * W)) * sum_{r,m} grad l_{r,m},  and
    l_{r,m} = sum_CE_{r,m} * G * W / N        (W := 1 under "sum")
gives exactly grad L: `odb_core.steps.loss.TokenLossScale(world_size=W, micro_batch_divisor=G)` (see NOTE [ Exact
token-weighted loss ] there). Each factor is applied once: nothing else here divides by G, W or a local token count.
IDLE micro-batches have every label at -100: sum_CE = 0, a zero gradient, and they still run forward and backward,
so ZeRO's per-micro-batch reductions stay matched across ranks.
`engine.backward(l)` returns l / G = sum_CE * W / N; summed over the window and averaged over ranks, that is
the step's per-token mean loss (see docs/guides/deepspeed.md). With ODB on, the engine applies the same l to the
model's own `output.loss` and checks what reaches `engine.backward` (NOTE [ The plain DeepSpeed loop under ODB ]
in engine_mixin.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from odb_core import StepInfo
from odb_core.steps.loss import TokenLossScale, causal_lm_loss_sum, logits_of


def loss_scale(info: StepInfo, engine: Any) -> float:
    """The factor G * W / N that turns a micro-batch's *summed* token loss into the loss for `engine.backward`.

    Use it with your own loss: `engine.backward(my_sum_loss * odb_deepspeed.loss_scale(batch.info, engine))`.
    G is `engine.gradient_accumulation_steps()`, W is `engine.dp_world_size` when DeepSpeed averages gradients
    (`gradient_allreduce_op` "mean", the default) and 1 when it sums them. With ODB's engine this also tells it
    that the loop weights this batch's loss itself (engine_mixin.py).
    """
    mark = getattr(engine, "odb_mark_scaled", None)
    if mark is not None:
        mark(info)
    return weighting_factor(info, engine)


def weighting_factor(info: StepInfo, engine: Any) -> float:
    """G * W / N of `loss_scale`, without telling the engine anything."""
    ranks = engine.dp_world_size if engine.gradient_average else 1
    return TokenLossScale(window_tokens=info.window_tokens, world_size=ranks,
                          micro_batch_divisor=engine.gradient_accumulation_steps()).factor


def token_weighted_loss(output: Any, batch: Mapping[str, Any], engine: Any, *,
                        info: StepInfo | None = None) -> torch.Tensor:
    """The loss to pass to `engine.backward` for one ODB micro-batch of a causal LM.

    Args:
        output: the model's output (anything with `.logits`) or the logits tensor [..., seq, vocab].
        batch: the micro-batch with `labels` (the unshifted labels, as for HF models).
        engine: the DeepSpeed engine (supplies G, W and the reduction op).
        info: the batch's `StepInfo`; defaults to `batch.info`. Pass it when `batch` is a copy without `.info`
            (e.g. a dict rebuilt to move tensors to the device).
    """
    info = info if info is not None else getattr(batch, "info", None)
    if info is None:
        raise ValueError("token_weighted_loss needs the batch's StepInfo: pass the ODBBatch, or info=batch.info "
                         "when the batch was copied to the device")
    return causal_lm_loss_sum(logits_of(output), batch["labels"]) * loss_scale(info, engine)
