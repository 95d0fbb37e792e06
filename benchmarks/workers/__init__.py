"""The training benchmarks' torchrun ranks (`train_worker`, `mm_train_worker`) and the standalone CPU training run
(`training`; its launcher and summary are `benchmarks.lib.cpu_training`). Ranks are launched as modules
(`-m benchmarks.workers.<worker>`) from the repository root."""
