"""What `max_buffer_bytes` costs in utilization on the MM-Mix-like VLM workload (issue 27, item 3).

    python -m benchmarks.byte_bound [--samples 20000] [--worlds 1 8]

The MM-Mix-like facts (text + visual tokens, vision patches) of `mm_bench.observe` (400 processed samples, cached
in benchmarks/.cache/), resampled with replacement to `--samples`; each sample's bytes are its `pixel_values`
(patches x 1176 float32, 2.1 MB on average) and its ids. The real `ODBDataLoader` runs on `--worlds` virtual ranks
with the mm_bench settings (budget 8192, max_patches 16384, window 4096), once with `max_buffer_bytes` at its
default (1 GiB) and once without a bound. The samples carry `--scale`-times fewer bytes and the bound is scaled the
same way, so the fills stop at the same samples while the run holds 1/scale of the memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from benchmarks import CACHE, RESULTS
from odb_core import ODBConfig, ODBDataLoader, run_virtual_ranks

PIXEL_ROW_BYTES = 1176 * 4  # one Qwen2-VL patch row of float32
ID_FIELDS = 3  # input_ids, labels, mm_token_type_ids: int64 each


class ScaledVlmSamples(torch.utils.data.Dataset):
    """Samples with the facts' tokens and patches whose payload weighs 1/scale of the real sample's bytes."""

    def __init__(self, facts: np.ndarray, scale: int) -> None:
        self.facts, self.scale = facts, scale

    def __len__(self) -> int:
        return len(self.facts)

    def __getitem__(self, index: int) -> dict:
        tokens, patches = (int(v) for v in self.facts[index])
        nbytes = patches * PIXEL_ROW_BYTES + tokens * 8 * ID_FIELDS
        return {"input_ids": list(range(tokens)), "payload": np.empty(nbytes // self.scale, dtype=np.uint8),
                "image_grid_thw": [[1, patches, 1]] if patches else [[0, 0, 0]]}


def count_only(samples: list[dict]) -> dict:
    """The steps are all this measures: a batch of one token per sample (labels absent: ids count)."""
    return {"input_ids": torch.zeros(len(samples), 1, dtype=torch.long)}


def run(facts: np.ndarray, world: int, bound: int | None, scale: int) -> dict:
    config = ODBConfig(token_budget=8192, max_patches=16384, max_buffer_bytes=None if bound is None else bound // scale)
    dataset = ScaledVlmSamples(facts, scale)

    def rank_main(rank, transport):
        loader = ODBDataLoader(dataset, config=config, transport=transport, collate_fn=count_only)
        steps = sum(1 for _ in loader)
        summary = loader.metrics.summary()
        loader.close()
        return steps, summary["budget_utilization"], summary["rounds"]

    steps, utilization, rounds = run_virtual_ranks(rank_main, world, timeout_s=600)[0]
    return {"world_size": world, "max_buffer_bytes": bound, "steps": steps, "rounds": rounds,
            "budget_utilization": round(utilization, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--scale", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS / "byte_bound.json"))
    args = parser.parse_args()
    cached = sorted(Path(CACHE).glob("mm_mix_facts_n400_s0_*.json"))
    if not cached:
        raise SystemExit("run `python -m benchmarks.mm_bench --parts quality` once to cache the MM-Mix-like facts")
    observed = np.asarray(json.loads(cached[-1].read_text()), dtype=np.int64)
    facts = observed[np.random.default_rng(0).integers(0, len(observed), args.samples)]
    rows = [run(facts, world, bound, args.scale) for world in args.worlds for bound in (1 << 30, None)]
    print("| W | max_buffer_bytes | steps | rounds | budget utilization |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world_size']} | {r['max_buffer_bytes']} | {r['steps']} | {r['rounds']} | "
              f"{r['budget_utilization']:.4f} |")
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
