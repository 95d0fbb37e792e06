"""One rank of the 2-rank CPU/gloo DeepSpeed runs behind tests/test_deepspeed_zero.py.

Usage (the test launches one process per rank): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
TORCH_EXTENSIONS_DIR set, then `python tests/ds_worker.py OUT_DIR`. Everything runs in one launch, because
importing deepspeed and transformers costs ~20 s per process on these machines:
  1. passthrough: `odb.enabled=false` gives exactly deepspeed.initialize's result (its own dataloader);
  2. train: ZeRO-2, uneven ranks (rank 0: 64 short samples, rank 1: 8 long ones; rank-local planning, so rank 1
     runs IDLE steps), join, G=2, 3 epochs, AdamW, config given as a file through args.deepspeed_config;
  3. equivalence: ZeRO stages 0 (float32) and 1, 2, 3 (float64 model), uneven ranks with IDLE micro-batches
     (rank-local planning), stages 2 and 3 with global planning (samples move between ranks), and stage 2 with
     the loader built from the dataset (global, the default): every optimizer step's full gradient against a
     single-process float64 reference of the per-supervised-token mean over the step's samples;
  4. the plain loop (`loss = engine(**batch).loss; engine.backward(loss)`, no ODB helper) checked the same way,
     for a model that takes loss kwargs and for one declared without them (NOTE [ The plain DeepSpeed loop under
     ODB ] in odb_deepspeed/engine_mixin.py);
  5. refusals: a loss ODB did not weight, scale_wrt_gas=False, a model whose loss ignores num_items_in_batch;
  6. a mixture-of-experts model's router loss, with and without loss kwargs, and a fused loss without logits;
  7. oversize: a budget below the long samples, two epochs: the loader warns once on each rank (every run
     before it keeps each sample within its budget and warns nothing).
Writes OUT_DIR/rank{r}.json. The test process makes the assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import deepspeed  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

import odb_deepspeed  # noqa: E402
from odb_core import ODBDataLoader  # noqa: E402
from odb_core.steps.loss import causal_lm_loss_sum  # noqa: E402

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # else init_distributed compiles it (~3 min)
VOCAB = 128


class UnevenDataset(torch.utils.data.Dataset):
    """Even indices are short (5-15 tokens), odd ones long (40-64 tokens); a third of each is unsupervised."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        length = 5 + (index * 5) % 11 if index % 2 == 0 else 40 + (index * 7) % 25
        ids = (torch.arange(length) * 7 + index) % (VOCAB - 3) + 3
        labels = ids.clone()
        labels[: length // 3] = -100
        return {"input_ids": ids, "labels": labels}


def make_model(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="eager")
    return LlamaForCausalLM(config).to(dtype)


def ds_config(stage: int, enabled: bool = True, token_budget: int = 256) -> dict:
    config = json.loads((REPO / "configs/deepspeed/zero2_odb.json").read_text())
    config["zero_optimization"]["stage"] = stage
    config["odb"].update(enabled=enabled, token_budget=token_budget)
    return config


def passthrough() -> dict:
    model = make_model(torch.float32)
    engine, _, loader, _ = odb_deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                                                    training_data=UnevenDataset(8), config=ds_config(2, False))
    return {"loader_type": type(loader).__name__, "odb_in_engine_config": "odb" in engine.config}


def uneven_loader(dataset: UnevenDataset, n_short: int, n_long: int, token_budget: int, G: int = 2,
                  planning: str = "local"):
    """A user-built ODBDataLoader (the "wrap your own loader" path): rank 0 reads only short samples, rank 1
    only a few long ones. Rank-local planning: rank 1 runs out of groups and ODB pads its steps with IDLE
    dummies. Global planning: rank 0's samples move to rank 1 instead."""
    mine = range(0, 2 * n_short, 2) if dist.get_rank() == 0 else range(1, 2 * n_long, 2)
    return ODBDataLoader(dataset, sampler=list(mine), token_budget=token_budget, accumulation_steps=G,
                         cost="padded", seed=0, planning=planning)


def train(out_dir: Path, epochs: int = 3) -> dict:
    model = make_model(torch.float32)
    config = ds_config(2, token_budget=64)
    del config["odb"]["shuffle"], config["odb"]["num_workers"]  # they belong to the user's own loader
    config["csv_monitor"] = {"enabled": True, "output_path": str(out_dir / "monitor"), "job_name": "odb"}
    path = out_dir / f"train_config_rank{dist.get_rank()}.json"  # the config reaches us as a file in args
    path.write_text(json.dumps(config))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=int(os.environ["LOCAL_RANK"]))
    engine, _, loader, _ = odb_deepspeed.initialize(
        args=args, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        training_data=uneven_loader(UnevenDataset(200), n_short=64, n_long=8, token_budget=64))
    assert args.deepspeed_config == str(path), "the user's args must not be modified"
    assert "odb" not in engine.config
    report: dict = {"epochs": [], "odb_enabled_loader_type": type(loader).__name__}
    for _ in range(epochs):
        indices, micro, idle, sums = [], 0, 0, torch.zeros(2, dtype=torch.float64)
        for batch in loader:
            output = engine(**batch)
            engine.backward(odb_deepspeed.token_weighted_loss(output, batch, engine))
            engine.step()
            with torch.no_grad():
                sums += torch.tensor([float(causal_lm_loss_sum(output.logits, batch["labels"])),
                                      batch.info.local_tokens], dtype=torch.float64)
            indices += batch.info.indices
            micro, idle = micro + 1, idle + int(batch.info.is_idle)
        dist.all_reduce(sums)
        report["epochs"].append({"indices": indices, "micro_batches": micro, "idle": idle,
                                 "mean_loss": float(sums[0] / sums[1])})
    report.update(global_steps=engine.global_steps, micro_steps=engine.micro_steps,
                  engine_global_samples=engine.global_samples, train_batch_size=engine.train_batch_size(),
                  consumed=asdict(loader.consumed))
    return report


def full_params(engine) -> dict[str, torch.Tensor]:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {name: p.detach().to(torch.float64).clone() for name, p in engine.module.named_parameters()}


def reference_grads(params: dict[str, torch.Tensor], samples: list[dict]) -> tuple[dict[str, torch.Tensor], int]:
    """Single process, float64, one sample at a time: grad of sum(CE) / (supervised tokens of the step)."""
    model = make_model(torch.float64)
    model.load_state_dict(params)
    tokens = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    total = sum(causal_lm_loss_sum(model(input_ids=s["input_ids"][None]).logits, s["labels"][None])
                for s in samples)
    (total / tokens).backward()
    return {name: p.grad for name, p in model.named_parameters()}, tokens


def equivalence(stage: int, dtype: torch.dtype, own_loader: bool, planning: str = "local", plain: bool = False,
                loss_kwargs: bool = True, samples_per_step: int | None = None, reduce_op: str | None = None) -> dict:
    """`plain`: the loop backpropagates the engine's own output.loss; `loss_kwargs=False`: a model declared without
    loss kwargs (ODB's engine then computes the weighted loss from the logits); `samples_per_step`: optimizer steps
    of a target size (the engine accumulates 1 micro-batch, the loader sets the boundary); `reduce_op`: DeepSpeed's
    `gradient_allreduce_op` ("sum": the ranks' gradients are summed, not averaged)."""
    dataset = UnevenDataset(60)
    model = make_model(dtype)
    if not loss_kwargs:
        model.accepts_loss_kwargs = False
    config = ds_config(stage, token_budget=64)
    if reduce_op is not None:
        config["gradient_allreduce_op"] = reduce_op
    if samples_per_step is not None:  # optimizer steps of a target size: the engine accumulates 1, ODB decides
        config["gradient_accumulation_steps"] = 1
        config["odb"]["samples_per_step"] = samples_per_step
    data = dataset
    if own_loader:
        del config["odb"]["shuffle"], config["odb"]["num_workers"]
        data = uneven_loader(dataset, n_short=24, n_long=3, token_budget=64, planning=planning)
    engine, _, loader, _ = odb_deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), training_data=data, config=config)
    G = engine.gradient_accumulation_steps()
    errors, windows, idle, window_indices, before = [], [], 0, [], None
    for batch in loader:
        if batch.info.window_index == 0:
            before, window_indices = full_params(engine), []
        output = engine(**batch)
        engine.backward(output.loss if plain else odb_deepspeed.token_weighted_loss(output, batch, engine))
        window_indices += batch.info.indices
        idle += int(batch.info.is_idle)
        if batch.info.ends_window:
            grads = {name: deepspeed.utils.safe_get_full_grad(p).to(torch.float64)
                     for name, p in engine.module.named_parameters()}
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, window_indices)
            if dist.get_rank() == 0:
                step_indices = sorted(i for part in gathered for i in part)
                reference, tokens = reference_grads(before, [dataset[i] for i in step_indices])
                diff = max(float((grads[n] - reference[n]).abs().max()) for n in reference)
                scale = max(float(reference[n].abs().max()) for n in reference)
                errors.append(diff / scale)
                windows.append({"indices": step_indices, "tokens": tokens, "window_tokens": batch.info.window_tokens,
                                "steps": batch.info.window_steps})
        engine.step()
    return {"stage": stage, "dtype": str(dtype), "own_loader": own_loader, "planning": loader.odb.config.planning,
            "gradient_average": engine.gradient_average,
            "plain": plain, "loss_kwargs": loss_kwargs,
            "window_steps": sorted({w["steps"] for w in windows}) if windows and "steps" in windows[0] else [G],
            "max_rel_error": max(errors) if errors else None, "errors": errors, "windows": windows,
            "idle_micro_batches": idle, "moved": loader.odb.metrics.moved_samples, "steps": engine.global_steps}


class IgnoresNumItems(torch.nn.Module):
    """Takes **kwargs (so ODB's engine passes num_items_in_batch) but returns the model's own per-batch mean."""

    def __init__(self, inner: LlamaForCausalLM) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def refused(engine, batch, backward) -> str | None:
    output = engine(**batch)
    try:
        backward(output)
    except odb_deepspeed.ODBLossError as exc:
        return str(exc)
    return None


def refusals() -> dict:
    """What `engine.backward` refuses, one served batch each, and a model whose loss ignores num_items_in_batch."""
    model = make_model(torch.float64)
    engine, _, loader, _ = odb_deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.0),
                                                    training_data=UnevenDataset(60), config=ds_config(2, token_budget=64))
    batches = iter(loader)
    result = {"rescaled": refused(engine, next(batches), lambda output: engine.backward(output.loss * 1.0)),
              "no_gas_scale": refused(engine, next(batches),
                                      lambda output: engine.backward(output.loss, scale_wrt_gas=False))}
    engine(**next(batches)).loss.backward()  # the tensor's own backward: DeepSpeed takes it, ODB's check is skipped
    try:
        next(batches)
        result["bypassed"] = None
    except odb_deepspeed.ODBLossError as exc:
        result["bypassed"] = str(exc)
    loader.odb.close()
    model = IgnoresNumItems(make_model(torch.float64))
    engine, _, loader, _ = odb_deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.0),
                                                    training_data=UnevenDataset(60), config=ds_config(2, token_budget=64))
    try:
        engine(**next(iter(loader)))
        result["ignores_num_items"] = None
    except odb_deepspeed.ODBLossError as exc:
        result["ignores_num_items"] = str(exc)
    loader.odb.close()
    config = ds_config(2, token_budget=64)
    config["gradient_accumulation_steps"], config["odb"]["samples_per_step"] = 1, 12
    model = make_model(torch.float64)
    engine, _, loader, _ = odb_deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.0),
                                                    training_data=UnevenDataset(60), config=config)
    result["skipped_step"] = None
    try:
        for batch in loader:  # a loop that forgets engine.step() at the first window's end
            engine.backward(engine(**batch).loss)
            if not (batch.info.ends_window and engine.global_steps == 0):
                engine.step()
    except RuntimeError as exc:
        result["skipped_step"] = str(exc)
    loader.odb.close()
    return result


class FusedLoss(torch.nn.Module):
    """A model whose loss is fused with its last layer (as Liger-kernel's): divided by num_items_in_batch, with no
    logits in its output."""

    def __init__(self, inner: LlamaForCausalLM) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        output = self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        return CausalLMOutputWithPast(loss=output.loss, logits=None)


def routed_and_fused() -> dict:
    """NOTE [ Router losses under DeepSpeed ]: a tiny Mixtral with its router loss (coefficient 0.5, so that the
    term dwarfs the check's tolerance), taking loss kwargs and not; and a fused loss without logits. For each
    micro-batch: output.loss - the token-weighted loss from the logits, against coefficient x aux_loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    result = {}
    for kwargs in (True, False):
        torch.manual_seed(0)
        model = MixtralForCausalLM(MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
            output_router_logits=True, router_aux_loss_coef=0.5))  # float32: its grouped matmul has no float64
        model.accepts_loss_kwargs = kwargs
        engine, _, loader, _ = odb_deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), 0.0), training_data=UnevenDataset(60),
            config=ds_config(2, token_budget=64))
        gaps = []
        try:
            for batch in loader:
                output = engine(**batch)
                weighted = odb_deepspeed.token_weighted_loss(output.logits, batch, engine, info=batch.info)
                gaps.append(float(output.loss - weighted - 0.5 * output.aux_loss))
                engine.backward(output.loss)
                engine.step()
            result[f"router_loss_kwargs_{kwargs}"] = {"max_gap": max(abs(g) for g in gaps), "steps": len(gaps)}
        except odb_deepspeed.ODBLossError as exc:
            result[f"router_loss_kwargs_{kwargs}"] = {"error": str(exc)}
        loader.odb.close()
    model = FusedLoss(make_model(torch.float64))
    engine, _, loader, _ = odb_deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.0),
                                                    training_data=UnevenDataset(60),
                                                    config=ds_config(2, token_budget=64))
    try:
        steps = 0
        for batch in loader:
            engine.backward(engine(**batch).loss)
            engine.step()
            steps += 1
        result["fused"] = {"steps": steps}
    except odb_deepspeed.ODBLossError as exc:
        result["fused"] = {"error": str(exc)}
    loader.odb.close()
    return result


def oversize(epochs: int = 2) -> dict:
    """token_budget=32 against long samples of 40-64 tokens, built by `initialize` from the dataset (shuffled over
    both ranks): they run alone, over the budget, and each rank's log says so once, however many epochs."""
    model = make_model(torch.float64)
    engine, _, loader, _ = odb_deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.0),
                                                    training_data=UnevenDataset(16), config=ds_config(2, token_budget=32))
    for _ in range(epochs):
        for batch in loader:
            engine.backward(odb_deepspeed.token_weighted_loss(engine(**batch), batch, engine))
            engine.step()
    return {"oversize_samples": loader.odb.metrics.oversize_samples}


def main(out_dir: Path) -> None:
    result: dict = {"rank": int(os.environ["RANK"])}
    result["passthrough"] = passthrough()
    deepspeed.init_distributed(dist_backend="gloo")  # a user-built ODBDataLoader needs the process group first
    result["train"] = train(out_dir)
    runs = [(0, torch.float32, True, "local"), (1, torch.float64, True, "local"), (2, torch.float64, True, "local"),
            (2, torch.float64, False, "global"), (3, torch.float64, True, "local"), (2, torch.float64, True, "global"),
            (3, torch.float64, True, "global")]
    result["equivalence"] = [equivalence(stage, dtype, own, planning) for stage, dtype, own, planning in runs]
    result["equivalence"].append(equivalence(2, torch.float64, False, "global", samples_per_step=12))
    result["equivalence"].append(equivalence(2, torch.float64, False, "global", reduce_op="sum"))
    result["plain"] = [equivalence(2, torch.float64, False, "global", plain=True, loss_kwargs=kwargs)
                       for kwargs in (True, False)]
    result["refusals"] = refusals()
    result["routed_and_fused"] = routed_and_fused()
    result["oversize"] = oversize()
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # do not wait in atexit handlers for a peer that will never arrive
    # this rank finished: destroy its groups now, since Gloo groups left to interpreter teardown can abort the
    # process (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#190489)
    dist.destroy_process_group()
